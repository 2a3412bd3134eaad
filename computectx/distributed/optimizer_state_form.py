"""Compact optimizer state (``ctx.optim_state``) in the distributed checkpoint form.

An optimizer whose state is packed (``int8``, ``fp8``, ``int4`` codes with their scales, or
``bf16`` values) keeps each packed state tensor in ``optimizer.state_dict()["state"][i]`` as
parts, ``"exp_avg.codes"``, ``"exp_avg.absmax"``, ..., laid out by this rank's blocks. Parts
cannot be resharded: a block of one world size is not a block of another, and a rank-1
scale (``int4`` second moments) is a per-row and per-column maximum of the rank's own rows.
So the form ``optimizer_state_dict`` gives holds every packed entry *decoded*: a float32
tensor of the (local) master's shape under the plain state name (``"exp_avg"``), which
``torch.distributed.checkpoint`` wraps, reshards and reassembles as it does float32 state;
loading encodes it again with the loading ranks' blocks (``OffloadedOptimizer.load_state_dict``
accepts a plain float tensor where parts would be).

What that costs and what it keeps:

- While the form exists (between ``optimizer_state_dict`` and ``save``, or ``load`` and
  ``set_optimizer_state_dict``) this rank holds its state at float32: what ``f32`` state
  would hold. The optimizer's own state stays packed.
- Decoding is exact (``decode`` gives the values the codes stand for). Encoding the decoded
  values again re-forms the same codes and scales wherever the loading rank's blocks are the
  saving rank's blocks: the same world size, or shards whose boundaries fall on block
  boundaries (and, for ``int4`` second moments, the same rows). Elsewhere a loaded value
  differs from the saved one by at most ``round_trip_bound(saved, optim_state, kind)``
  (``computectx.memory.optim.state.codecs``): one more quantization, no more.
- ``"optim_state"`` (the text form of the saving optimizer's ``ctx.optim_state``) is carried
  at the top level when it is not ``f32``, so a state loaded under another format is
  converted with the warning naming both (``OffloadedOptimizer.load_state_dict``); an ``f32``
  checkpoint has no such key, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from computectx.memory.optim.state import (
    MASTER_ROUNDING_KEY,
    OPTIM_STATE_KEY,
    PART_SEP,
)
from computectx.optim_state import OptimState, parse_optim_state

__all__ = ["MASTER_ROUNDING", "OPTIM_STATE", "packed_keys", "saved_format"]

OPTIM_STATE = OPTIM_STATE_KEY
"""The key of the state format's text form, in both state dict forms."""
MASTER_ROUNDING = MASTER_ROUNDING_KEY
"""The key of the stochastic-rounding generators' state (a master below float32)."""


def packed_keys(per_param: Mapping[Any, Any]) -> list[str]:
    """The keys of packed parts (``"exp_avg.codes"``) in one parameter's state."""
    return [str(k) for k in per_param if PART_SEP in str(k)]


def saved_format(value: object, where: str) -> OptimState:
    """The ``"optim_state"`` entry of a checkpoint, checked: its text (or JSON) form."""
    if not isinstance(value, (str, Mapping, OptimState)):
        raise TypeError(
            f"{where} must be the text form of an optim_state (e.g. 'int8'), got "
            f"{type(value).__name__}"
        )
    try:
        return parse_optim_state(value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
