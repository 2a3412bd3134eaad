"""Compact optimizer state: quantization maps, codecs, the fused update and the engine.

- ``codecs``: ``encode``/``decode`` one state tensor in a format of ``ctx.optim_state``
  (``Packed``: its parts), ``from_parts``/``parts_of`` for checkpoints, ``round_trip_bound``
  and ``packed_nbytes`` (bytes without encoding);
- ``fused``: the Adam/AdamW update on packed state in one (compilable) function;
- ``maps``: the quantization maps; ``search``: the nearest map entry of each element by a
  table on its float32 bit pattern (the codes of ``torch.bucketize``, faster);
- ``kinds``: which map (signed/unsigned) each torch.optim state name takes;
- ``store``: the stored form of a parameter's state (``"name.part"`` keys), the scratch
  buffer, and loading a state dict saved under any format;
- ``scalars``: the check of a state's scalars (``step`` a whole number >= 0, the rest finite);
- ``stepper``: ``Stepper``, the per-parameter step behind ``CompactOptimizer`` and
  ``OffloadedOptimizer``.
"""

from computectx.memory.optim.state.codecs import (
    Kind,
    Packed,
    decode,
    encode,
    from_parts,
    packed_nbytes,
    part_names,
    parts_of,
    round_trip_bound,
)
from computectx.memory.optim.state.kinds import SIGNED_STATE, UNSIGNED_STATE, kind_of
from computectx.memory.optim.state.store import (
    MASTER_ROUNDING_KEY,
    OPTIM_STATE_KEY,
    PART_SEP,
    Scratch,
    decode_entry,
    encode_entry,
    split_entry,
    state_name,
)

__all__ = [
    "MASTER_ROUNDING_KEY",
    "OPTIM_STATE_KEY",
    "PART_SEP",
    "SIGNED_STATE",
    "UNSIGNED_STATE",
    "Kind",
    "Packed",
    "Scratch",
    "decode",
    "decode_entry",
    "encode",
    "encode_entry",
    "from_parts",
    "kind_of",
    "packed_nbytes",
    "part_names",
    "parts_of",
    "round_trip_bound",
    "split_entry",
    "state_name",
]
