"""What an ``OffloadedOptimizer`` checkpoint holds, the checks a saved master weight passes, and
the one check that a saved optimizer state is of the loading optimizer's class.

``OffloadedOptimizer.state_dict()`` is the master optimizer's state dict plus the master
weights under ``MASTER_WEIGHTS`` (index -> tensor). ``check_master_weight`` is the one check a
saved master goes through before it is loaded, whether it arrives by position
(``OffloadedOptimizer.load_state_dict``) or by parameter name
(``computectx.distributed.set_optimizer_state_dict``); ``check_saved_masters`` checks a whole
position-keyed mapping with it, and adds the finiteness check, which reads the data.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from computectx.dtypes import DType
from computectx.memory.optim.state.scalars import check_scalars
from computectx.memory.optim.state.store import state_name

__all__ = [
    "MASTER_WEIGHTS",
    "check_checkpoint_scalars",
    "check_group_options",
    "check_master_weight",
    "check_optimizer_class",
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


# ----- which optimizer class a saved state belongs to -------------------------------------
#
# A torch optimizer's state dict names no class, and torch's load_state_dict replaces the
# loading optimizer's param groups with the saved ones, so another class's state leaves the
# next step without its own options (SGD after an AdamW checkpoint: KeyError 'momentum') or
# its own per-parameter state (Adam after Adamax: no exp_avg_sq). What identifies a class is
# what its step reads, and the rule checks exactly that, for each saved group:
#
# 1. no option that some torch.optim class has and the loading class does not (AdamW's
#    betas, eps, amsgrad in an SGD load). A key no class has (a scheduler's initial_lr, an
#    option a newer torch added) proves nothing and is let through, as torch lets it;
# 2. no option of the loading class missing from the group that its class does not fill in
#    itself when state is loaded (``__setstate__``: Adam fills in the options torch added
#    over the years, so an older checkpoint still loads);
# 3. where the saved state has per-parameter entries, their keys are the ones the loading
#    class keeps under the group's options (found by one step of that class, with those
#    options, on a 2x2 zero parameter). A packed state's parts ("exp_avg.codes",
#    "exp_avg.absmax": see computectx.memory.optim.state.store) count as their state name.
#
# Adam and AdamW pass all three both ways (AdamW is Adam with decoupled_weight_decay=True,
# an option the group carries, which loads as saved, as lr does), as in torch. An error names
# the saved class: the torch.optim class whose option keys are nearest the group's, Adam and
# AdamW told apart by that option.

_GROUP_ENTRIES = frozenset({"params", "param_names"})
# Options about how a step runs, not what it computes; a probe leaves them at their defaults
# (a fused or capturable step may not run on the probe's CPU tensor).
_HOW = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _probe_param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(2, 2))


@functools.cache
def _torch_optimizer_defaults() -> dict[str, dict[str, Any]]:
    """``torch.optim.NAME`` -> its ``defaults`` (the options of its param groups), for every
    torch.optim class that can be built on one 2-D parameter with its defaults (built once)."""
    out: dict[str, dict[str, Any]] = {}
    for name in torch.optim.__all__:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            continue
        if cls is torch.optim.Optimizer:
            continue
        try:
            build: Any = cls  # built with its defaults only (mypy wants a `defaults` arg)
            probe = build([_probe_param()])
        except (TypeError, ValueError, RuntimeError):  # needs arguments we cannot guess
            continue
        out[f"torch.optim.{name}"] = dict(probe.defaults)
    return out


def _class_name(cls: type) -> str:
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _unfilled(cls: type, defaults: Mapping[str, Any], group: Mapping[str, Any]) -> list[str]:
    """The options of ``defaults`` missing from ``group`` that ``cls`` does not fill in when
    it loads such a group (its ``__setstate__``, run on a probe)."""
    missing = sorted(set(defaults) - _GROUP_ENTRIES - set(map(str, group)))
    if not missing:
        return []
    try:
        with torch.inference_mode(False):
            p = _probe_param()
            probe = cls([p])
        kept = {k: v for k, v in group.items() if k not in _GROUP_ENTRIES}
        probe.__setstate__(
            {"defaults": probe.defaults, "state": {}, "param_groups": [{**kept, "params": [p]}]}
        )
        filled = set(probe.param_groups[0])
    except Exception:  # a class the probe cannot build (it needs arguments): not judged here
        return []
    return [k for k in missing if k not in filled]


def _state_keys(
    cls: type, defaults: Mapping[str, Any], group: Mapping[str, Any]
) -> set[frozenset[str]]:
    """The per-parameter state key sets ``cls`` keeps under ``group``'s options, for a matrix
    and a vector (Adafactor keeps other keys for each): one step on a probe of each shape.
    Empty when no probe can run (the check is then skipped)."""
    found: set[frozenset[str]] = set()
    for shape in ((2, 2), (2,)):
        try:
            with torch.inference_mode(False):
                p = torch.nn.Parameter(torch.zeros(shape))
                probe = cls([p])
                # As loading the group would set them (a constructor may not take every
                # option: AdamW fixes decoupled_weight_decay).
                probe.param_groups[0].update(
                    {k: group[k] for k in defaults if k in group and k not in _GROUP_ENTRIES | _HOW}
                )
                p.grad = torch.zeros_like(p)
                probe.step()
            found.add(frozenset(map(str, probe.state[p])))
        except Exception:  # a shape or class the probe cannot run
            continue
    return found


def _saved_by(group: Mapping[str, Any]) -> str:
    """The torch.optim class(es) whose option keys are nearest to ``group``'s, for errors."""
    defaults = _torch_optimizer_defaults()
    keys = frozenset(map(str, group)) - _GROUP_ENTRIES
    distance = {n: len(keys ^ (set(d) - _GROUP_ENTRIES)) for n, d in defaults.items()}
    names = sorted(n for n, d in distance.items() if d == min(distance.values()))
    # Classes with the same keys (Adam, AdamW) are told apart by their boolean defaults.
    flags = {
        k
        for k in keys
        if all(isinstance(defaults[n].get(k), bool) for n in names)
        and len({defaults[n][k] for n in names}) > 1
    }
    agree = {n: sum(defaults[n][k] == group[k] for k in flags) for n in names}
    names = [n for n in names if agree[n] == max(agree.values())]
    return " or ".join(names[:3]) + (" (or another)" if len(names) > 3 else "")


def check_optimizer_class(
    state_dict: object, optimizer_class: type, defaults: Mapping[str, Any], who: str
) -> None:
    """``ValueError`` naming both classes when ``state_dict`` (a torch optimizer state dict,
    or one keyed by FQN) was saved by another optimizer class than ``optimizer_class``, whose
    groups carry the options ``defaults``: the rule above this function.

    Changes nothing (its probes are optimizers of their own on a 2x2 zero tensor). A state
    dict without a list of param groups is left to the checks that follow it (they name
    what is wrong).
    """
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        return
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    entries = (
        [e for e in state.values() if isinstance(e, Mapping) and e]
        if isinstance(state, Mapping)
        else []
    )
    target = _class_name(optimizer_class)
    ours = set(defaults) - _GROUP_ENTRIES
    known = set().union(*(set(d) for d in _torch_optimizer_defaults().values()))
    for j, group in enumerate(groups):
        keys = set(map(str, group)) - _GROUP_ENTRIES
        found = []
        foreign = sorted((keys & known) - ours)
        if foreign:
            found.append(f"options {foreign} that {target} does not have")
        unfilled = _unfilled(optimizer_class, defaults, group)
        if unfilled:
            found.append(f"no {unfilled}, which {target} needs")
        if not found and entries and j == 0:
            want = _state_keys(optimizer_class, defaults, group)
            # Packed state is stored as "name.part" keys: the state names are what count.
            got = {frozenset(map(state_name, e)) for e in entries}
            if want and not got <= want:
                keeps = " or ".join(str(sorted(w)) for w in sorted(want, key=sorted))
                found.append(
                    f"per-parameter state {sorted(sorted(g) for g in got - want)} where "
                    f"{target} keeps {keeps}"
                )
        if found:
            raise ValueError(
                f"{who}: the optimizer state was saved by {_saved_by(group)}, not {target}: "
                f"its param_groups[{j}] hold {' and '.join(found)} (an optimizer state dict "
                f"names no class; what its step reads identifies it). Loading it would leave "
                f"this optimizer's next step without its own options or state. Nothing was "
                f"changed: build the optimizer as the one that saved it to resume this "
                f"checkpoint"
            )
