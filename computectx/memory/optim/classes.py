"""What the optimizers need to know of a ``torch.optim`` class, found by probing it.

A class is never read by name alone: what its step keeps and what its groups carry is found
by building it on small probe parameters and stepping them (the probes are optimizers of
their own; nothing of the caller's changes, and torch's global generator is not drawn from).

- ``check_fits``: whether every state tensor a class keeps has the parameter's shape or is a
  scalar, which the stepper's per-parameter, per-block storage needs;
- ``check_optimizer_class``: whether a saved state dict was made by the loading class.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from computectx.memory.optim.state.store import state_name
from computectx.optim_state import OptimState

__all__ = ["check_fits", "check_optimizer_class", "class_name"]

_GROUP_ENTRIES = frozenset({"params", "param_names"})
# Options about how a step runs, not what it computes; a probe leaves them at their defaults
# (a fused or capturable step may not run on the probe's CPU tensor).
_HOW = frozenset({"foreach", "fused", "capturable", "differentiable"})
_PROBE_SHAPES = ((4, 3), (5,))


def class_name(cls: type) -> str:
    """``torch.optim.Adam`` for torch's classes, else the class's module and name."""
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def check_fits(
    cls: type[torch.optim.Optimizer], options: dict[str, Any], optim_state: OptimState, who: str
) -> None:
    """``ValueError`` unless every state tensor ``cls`` keeps has the parameter's shape or is
    a scalar, found by two steps on a matrix and a vector probe under the group ``options``.

    SparseAdam (sparse gradients: a step touches only some rows) and LBFGS (a closure
    re-evaluated per step, history vectors of the flattened parameters) are refused by
    name; a class whose probe cannot step is refused with the probe's error. Draws nothing
    from torch's global generator.
    """
    name = class_name(cls)
    why = (
        f"{who}: optimizer state stored as {optim_state} (or a weight below float32) is "
        f"stepped one parameter at a time, with blocks inside each parameter's state, so "
        f"every state tensor must have the parameter's shape or be a scalar"
    )
    use = (
        "Use optim_state='f32' and a float32 weight with it, or a class whose state fits "
        "(AdamW, Adam, SGD, RMSprop, Adagrad, Adamax, NAdam, RAdam, ...)"
    )
    if issubclass(cls, torch.optim.SparseAdam):
        raise ValueError(
            f"{why}; {name} is refused: it steps sparse gradients, touching only the rows "
            f"a batch used, which a per-block encoding of the whole state cannot follow. {use}"
        )
    if issubclass(cls, torch.optim.LBFGS):
        raise ValueError(
            f"{why}; {name} is refused: its state is a history of flattened update vectors, "
            f"not per-parameter tensors. {use}"
        )
    kept = {k: v for k, v in options.items() if k not in _GROUP_ENTRIES | _HOW}
    for shape in _PROBE_SHAPES:
        try:
            with torch.inference_mode(False), torch.enable_grad():
                n = math.prod(shape)
                p = torch.nn.Parameter(torch.linspace(-1.0, 1.0, n).reshape(shape))
                build: Any = cls
                probe = build([p], lr=kept.get("lr", 1e-3))
                probe.param_groups[0].update(kept)
                for k in range(2):
                    p.grad = torch.linspace(0.5, -0.5 - k, n).reshape(shape)
                    probe.step()
            state = dict(probe.state[p])
        except Exception as e:  # the probe cannot step: we cannot tell, so we refuse
            raise ValueError(
                f"{why}; {name} could not be checked: a step on a probe parameter of shape "
                f"{list(shape)} failed ({type(e).__name__}: {e}). {use}"
            ) from e
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if value.dim() == 0 or value.shape == p.shape:
                    continue
                got = f"a tensor of shape {list(value.shape)}"
            elif value is None or isinstance(value, (bool, int, float)):
                continue
            else:
                got = f"a {type(value).__name__}"
            raise ValueError(
                f"{why}; {name} keeps state {key!r} as {got} for a parameter of shape "
                f"{list(shape)}. {use}"
            )


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
    target = class_name(optimizer_class)
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
