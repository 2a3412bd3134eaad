"""What an optimizer checkpoint holds and the checks a saved one passes before it loads.

``OffloadedOptimizer.state_dict()`` is the master optimizer's state dict plus the master
weights under ``MASTER_WEIGHTS`` (index -> tensor). ``check_master_weight`` is the one check a
saved master goes through before it is loaded, whether it arrives by position
(``OffloadedOptimizer.load_state_dict``) or by parameter name
(``computectx.distributed.set_optimizer_state_dict``); ``check_saved_masters`` checks a whole
position-keyed mapping with it, and adds the finiteness check, which reads the data.
``check_checkpoint_scalars`` and ``check_group_options`` hold a state dict's scalars and
group options to what torch's constructors accept. Which class saved a state dict is
``classes.check_optimizer_class``'s to tell.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from computectx.dtypes import DType
from computectx.memory.optim.state.store import check_scalars

__all__ = [
    "MASTER_WEIGHTS",
    "check_checkpoint_scalars",
    "check_group_options",
    "check_master_weight",
    "check_saved_masters",
    "state_tensors",
]

MASTER_WEIGHTS = "master_weights"
"""The key under which ``OffloadedOptimizer.state_dict()`` holds the master weights."""


def check_master_weight(
    value: object, master: torch.Tensor, where: str, policy: DType, *, shard: bool = False
) -> torch.Tensor:
    """``value``, a saved master weight, after checking that it can replace ``master``.

    It must be a tensor (``TypeError``) of the master's shape and dtype (``ValueError``; the
    dtype is ``ctx.master``, ``policy`` here, so another dtype means a checkpoint made under
    another policy). ``where`` names the value in the messages; ``shard=True`` says that
    ``value`` and ``master`` are this rank's shards of a sharded parameter. Reads only
    metadata; ``check_saved_masters`` also reads the data (finiteness).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(value).__name__}")
    if value.shape != master.shape:
        raise ValueError(
            f"{where} has shape {list(value.shape)}{' on this rank' if shard else ''}, but the "
            f"master weight{'s shard' if shard else ''} is {list(master.shape)}; accepted: a "
            f"tensor of the parameter's shape"
        )
    if value.dtype != master.dtype:
        raise ValueError(
            f"{where} is {value.dtype}{list(value.shape)}, but the master weight is "
            f"{master.dtype} (ctx.master={policy}); the checkpoint was made under another policy"
        )
    return value


def check_saved_masters(
    saved: object, masters: Sequence[torch.Tensor], policy: DType
) -> list[torch.Tensor]:
    """The saved master weights (``state_dict[MASTER_WEIGHTS]``, index -> tensor), checked.

    Exactly one entry per master, each passing ``check_master_weight``; then every master of
    a trainable parameter (``requires_grad``) must be finite: an inf or NaN weight turns
    every later gradient non-finite, so every later step would be skipped. A frozen
    parameter may hold inf on purpose (a mask) and is not checked. Finiteness costs one read
    of the saved masters (one host read per device they are on). Returns them in order.
    """
    what = f"state_dict[{MASTER_WEIGHTS!r}]"
    if not isinstance(saved, Mapping):
        raise TypeError(f"{what} must be a mapping index -> tensor, got {type(saved).__name__}")
    want = set(range(len(masters)))
    if set(saved) != want:
        missing = sorted(want - set(saved))
        extra = sorted(set(saved) - want, key=str)
        raise ValueError(
            f"{what} does not match this optimizer's {len(masters)} parameters: missing "
            f"indices {missing}, unexpected {extra}"
        )
    out = [
        check_master_weight(saved[i], mp, f"{what}[{i}]", policy) for i, mp in enumerate(masters)
    ]
    trainable = [i for i, mp in enumerate(masters) if mp.requires_grad]
    bad = [trainable[j] for j in _nonfinite([out[i] for i in trainable])]
    if bad:
        named = ", ".join(f"[{i}] (shape {list(out[i].shape)})" for i in bad[:8])
        raise ValueError(
            f"{what} holds inf or NaN in {len(bad)} master weight(s) of trainable parameters: "
            f"{named}; every step from such weights would be skipped. The checkpoint was "
            f"saved after the weights diverged, or is damaged"
        )
    return out


def _nonfinite(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The positions of the tensors holding an inf or NaN; one host read per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    bad: list[int] = []
    for positions in by_device.values():
        finite = torch.stack([torch.isfinite(tensors[i]).all() for i in positions]).tolist()
        bad.extend(i for i, ok in zip(positions, finite, strict=True) if not ok)
    return sorted(bad)


# Options torch's own constructors hold to a range (Adam, SGD, RMSprop, ...): a checkpoint
# may not bring in what the constructor would refuse.
_NON_NEGATIVE = frozenset({"lr", "eps", "weight_decay", "momentum"})


def check_checkpoint_scalars(state_dict: Mapping[str, Any], who: str) -> None:
    """``ValueError`` naming the key, the parameter index or group, and the value, for a bad
    scalar of an optimizer state dict: in each per-parameter entry, ``step`` must be a whole
    number >= 0 and every other scalar finite (``store.check_scalars``); in each group,
    every number (and every number of a tuple, ``betas``) finite, ``lr``, ``eps``,
    ``weight_decay`` and ``momentum`` >= 0 and each of ``betas`` in [0, 1), as torch's
    constructors require. Changes nothing; reads each scalar tensor once."""
    state = state_dict.get("state")
    if isinstance(state, Mapping):
        check_scalars(
            [
                (f"{who}: state_dict['state'][{index!r}]", entry)
                for index, entry in state.items()
                if isinstance(entry, Mapping)
            ]
        )
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)):
        return
    for j, group in enumerate(groups):
        if isinstance(group, Mapping):
            check_group_options(group, f"{who}: state_dict['param_groups'][{j}]")


def check_group_options(group: Mapping[str, Any], where: str) -> None:
    """``ValueError`` naming ``where[key]`` and the value for a bad option of one param group:
    every number (and every number of a tuple, ``betas``) finite, ``lr``, ``eps``,
    ``weight_decay`` and ``momentum`` >= 0 and each of ``betas`` in [0, 1), as torch's
    constructors require; those options must be numbers (a string or a bool is refused:
    ``float("1e-3")`` would step). The one rule of ``load_state_dict``, the constructor and
    ``add_param_group``, so a group that can be saved can be loaded."""
    for key, value in group.items():
        if key in ("params", "param_names"):
            continue
        shown_key = f"{where}[{key!r}]"
        values = value if isinstance(value, (list, tuple)) else (value,)
        for k, v in enumerate(values):
            shown = f"{shown_key}[{k}]" if isinstance(value, (list, tuple)) else shown_key
            accepted = _accepted(str(key))
            if (key in _NON_NEGATIVE or key == "betas") and isinstance(v, (str, bytes, bool)):
                raise ValueError(f"{shown} is {v!r}; accepted: {accepted}")
            number = _number(v)
            if number is None:
                continue
            ok = math.isfinite(number)
            if ok and key in _NON_NEGATIVE:
                ok = number >= 0
            if ok and key == "betas":
                ok = 0 <= number < 1
            if not ok:
                raise ValueError(f"{shown} is {v!r}; accepted: {accepted}")


def _number(value: object) -> float | None:
    """``value`` as a float when it is a number or a one-element tensor (not a bool)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return None
        return float(value.detach().reshape(()).item())
    if isinstance(value, int):
        return float(value) if abs(value) < 2**1000 else math.inf
    if isinstance(value, float):
        return value
    return None


def _accepted(key: str) -> str:
    if key == "betas":
        return "each in [0, 1)"
    if key in _NON_NEGATIVE:
        return "a finite number >= 0"
    return "a finite number"


def state_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in an optimizer's ``state`` (or in one entry of it).

    Nested mappings, lists and tuples are walked; anything else is skipped.
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from state_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from state_tensors(v)
