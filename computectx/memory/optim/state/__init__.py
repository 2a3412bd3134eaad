"""Optimizer state in its stored form: the compact formats of ``ctx.optim_state``.

- ``packed``: ``Packed``, one state tensor as its parts (``Spec``, ``part_layout``), and the
  tensor kernels between float32 and parts (``encode_tensors``/``decode_tensors``);
- ``codecs``: ``encode``/``decode`` one state tensor, checked, ``from_parts`` for
  checkpoints and ``round_trip_bound`` (the formats' bounds, with their proofs);
- ``maps``: the quantization maps and the nearest map entry of each element, by a table on
  its float32 bit pattern (the codes of ``torch.bucketize``, faster);
- ``store``: one parameter's entry (``"name.part"`` keys), which map each state name takes
  (``kind_of``), the check of its scalars (``step`` a whole number >= 0, the rest finite)
  and the scratch buffer a step decodes into;
- ``load``: a state dict saved under any format, or decoded, brought into the stored form.
"""

from computectx.memory.optim.state.codecs import decode, encode, from_parts, round_trip_bound
from computectx.memory.optim.state.packed import (
    Kind,
    Packed,
    packed_nbytes,
    part_names,
    parts_of,
)
from computectx.memory.optim.state.store import (
    MASTER_ROUNDING_KEY,
    OPTIM_STATE_KEY,
    PART_SEP,
    SIGNED_STATE,
    UNSIGNED_STATE,
    Scratch,
    decode_entry,
    encode_entry,
    kind_of,
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
