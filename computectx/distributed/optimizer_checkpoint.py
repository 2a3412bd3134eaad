"""The ``OffloadedOptimizer`` state for ``torch.distributed.checkpoint``: keyed by FQN, resharded.

``OffloadedOptimizer.state_dict()`` keys everything by position and, under FSDP2, holds this
rank's plain local shards: it resumes exactly on the same ranks, but a checkpoint taken on two
ranks cannot be loaded on one. ``optimizer_state_dict(model, optimizer)`` gives the same state
keyed by each parameter's fully qualified name (the keys ``get_model_state_dict`` uses), with
every sharded tensor wrapped back into a ``DTensor`` with its parameter's mesh and placements,
so that ``torch.distributed.checkpoint`` reshards it to whatever ranks load it;
``set_optimizer_state_dict(model, optimizer, state)`` installs such a state.

torch's own ``get_optimizer_state_dict`` maps the optimizer's parameters to the model's by
identity: an ``OffloadedOptimizer`` steps master copies, which are not the model's
parameters (given one, torch 2.13 raises ``KeyError: 0``, after stepping a fresh optimizer
with zero gradients), and its masters are not part of a torch optimizer state dict at all, so
the mapping and the resharding are done here, in the same form torch uses
(``{"state": {fqn: {...}}, "param_groups": [{"params": [fqn, ...], ...}]}``) plus
``"master_weights": {fqn: tensor}``. Compact state (``ctx.optim_state``) is decoded into that
form and encoded again on load: ``computectx.memory.optim.state.load``.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from computectx.memory import OffloadedOptimizer
from computectx.memory.optim.checkpoint import MASTER_WEIGHTS, check_master_weight
from computectx.memory.optim.classes import check_optimizer_class
from computectx.memory.optim.state.load import saved_format
from computectx.memory.optim.state.store import (
    MASTER_ROUNDING_KEY,
    OPTIM_STATE_KEY,
    decode_entry,
    packed_keys,
)

__all__ = [
    "MASTER_WEIGHTS",
    "check_optimizer_state_dict",
    "check_saved_optimizer",
    "optimizer_state_dict",
    "parameter_fqns",
    "set_optimizer_state_dict",
]

"""The key of the master weights, as in ``OffloadedOptimizer.state_dict()``."""

_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"
_KEYS = (_STATE, _GROUPS, MASTER_WEIGHTS, OPTIM_STATE_KEY, MASTER_ROUNDING_KEY)
# torch.distributed.algorithms checkpoint_wrapper's child name: left out of FQNs, as
# get_model_state_dict leaves it out.
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"


def parameter_fqns(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> FQN`` for every parameter of ``model``, as checkpoints name them.

    The FQN is the name in ``model.named_parameters()`` without the wrappers' own levels:
    DDP's ``module``, ``torch.compile``'s ``_orig_mod`` and the activation-checkpoint
    wrapper's ``_checkpoint_wrapped_module``, so it is the key ``get_model_state_dict`` gives
    the same parameter. FSDP2 (``fully_shard``) renames nothing. A parameter shared by two
    modules takes its first name.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    out: dict[int, str] = {}
    for name, param in model.named_parameters():
        if id(param) not in out:
            out[id(param)] = _canonical(model, name)
    return out


def _canonical(model: nn.Module, name: str) -> str:
    kept = []
    current: Any = model
    for atom in name.split("."):
        wrapper_level = (
            (isinstance(current, DistributedDataParallel) and atom == "module")
            or (atom == "_orig_mod" and _is_compiled_wrapper(current))
            or atom == _CHECKPOINT_WRAPPED
        )
        if not wrapper_level:
            kept.append(atom)
        current = getattr(current, atom)
    return ".".join(kept)


def _is_compiled_wrapper(module: Any) -> bool:
    # torch.compile's wrapper class; when torch._dynamo was never imported there is none (and
    # importing it here would cost most of a second).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _fqns_of(model: nn.Module, optimizer: OffloadedOptimizer) -> list[str]:
    """The FQN of each of the optimizer's parameters, in its (position) order."""
    if not isinstance(optimizer, OffloadedOptimizer):
        raise TypeError(
            f"optimizer must be a computectx.memory.OffloadedOptimizer, got "
            f"{type(optimizer).__name__}; for a plain torch optimizer use "
            f"torch.distributed.checkpoint.state_dict.get_optimizer_state_dict"
        )
    names = parameter_fqns(model)
    fqns = []
    for i, param in enumerate(optimizer.compute_params):
        fqn = names.get(id(param))
        if fqn is None:
            raise ValueError(
                f"the optimizer's parameter {i} (shape {list(param.shape)}) is not a parameter "
                f"of model ({type(model).__name__}); pass the model the optimizer was built on"
            )
        fqns.append(fqn)
    return fqns


# ----- get ------------------------------------------------------------------------------


def optimizer_state_dict(model: nn.Module, optimizer: OffloadedOptimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN, ready for ``torch.distributed.checkpoint``.

    ``{"state": {fqn: {name: value}}, "param_groups": [{"params": [fqn, ...], ...options}],
    "master_weights": {fqn: tensor}}``: torch's ``get_optimizer_state_dict`` form plus the
    master weights. For a parameter that is a ``DTensor`` (FSDP2), the master and every
    state tensor of the master's shape (``exp_avg``, ``exp_avg_sq``, a momentum buffer, ...)
    is this rank's shard wrapped into a ``DTensor`` with the parameter's mesh, placements,
    shape and stride, so ``torch.distributed.checkpoint.save`` writes one tensor per FQN and
    ``load`` reshards it to the loading ranks; zero-dimensional state (Adam's ``step``) is
    the same on every rank and stays a plain tensor. Otherwise everything is a plain tensor.

    Packed state (``ctx.optim_state`` ``bf16``, ``int8``, ``fp8``, ``int4``) goes in decoded:
    float32 of the master's shape under the plain name (``"exp_avg"``), so it reshards as
    float32 state does, and loading encodes it again with the loading ranks' blocks: exactly
    the saved codes where the blocks are the same, else within one round trip's bound
    (``computectx.memory.optim.state.load``). The format's text form is kept under
    ``"optim_state"`` (not for ``f32``), the stochastic-rounding generators of a master below
    f32 under ``"master_rounding"`` (plain tensors: ``torch.distributed.checkpoint`` keeps one
    rank's, which under DDP is every rank's).

    Other tensors share storage with the optimizer (no copy), as torch's state dicts do:
    loading a checkpoint into this dict writes into the optimizer, and
    ``set_optimizer_state_dict`` must follow (it checks the values and refreshes the model's
    parameters). An optimizer that has not stepped yet has no state to load into; as torch's
    ``get_optimizer_state_dict`` does, the state is then created as one step with zero
    gradients would create it (Adam: zero moments, ``step`` 1) -- on a throwaway copy of the
    inner optimizer, so this optimizer itself does not change.
    """
    fqns = _fqns_of(model, optimizer)
    position = optimizer.state_dict()
    states: Mapping[int, Any] = position[_STATE] if optimizer.state else _initial_state(optimizer)
    compute, masters = optimizer.compute_params, optimizer.master_params
    fmt = optimizer.ctx.optim_state
    out_state: dict[str, dict[str, Any]] = {}
    for i, per_param in states.items():
        fqn = fqns[i]
        # Packed entries (ctx.optim_state) go in decoded: float32 of the master's shape, which
        # reshards as float32 state does (computectx.memory.optim.state.load); plain
        # entries (f32 state, step) stay the optimizer's own tensors.
        plain = decode_entry(per_param, masters[i].shape, fmt, f"state of {fqn!r}")
        out_state[fqn] = {
            name: _shareable(value, compute[i], masters[i], f"state {name!r} of {fqn!r}")
            for name, value in plain.items()
        }
    groups = [{**group, _PARAMS: [fqns[i] for i in group[_PARAMS]]} for group in position[_GROUPS]]
    out_masters = {
        fqn: _shareable(mp.detach(), cp, mp, f"the master weight of {fqn!r}")
        for fqn, cp, mp in zip(fqns, compute, masters, strict=True)
    }
    out: dict[str, Any] = {_STATE: out_state, _GROUPS: groups, MASTER_WEIGHTS: out_masters}
    if fmt.compact:  # an f32 checkpoint keeps its form (and loads where it loaded before)
        out[OPTIM_STATE_KEY] = str(fmt)
    if MASTER_ROUNDING_KEY in position:  # a master below f32: the same on every rank
        out[MASTER_ROUNDING_KEY] = position[MASTER_ROUNDING_KEY]
    return out


def _initial_state(optimizer: OffloadedOptimizer) -> dict[int, Any]:
    """The state one step with zero gradients creates, made on a copy of the inner optimizer."""
    inner = optimizer.inner
    # The copy steps zeros shaped as the masters; the real masters are never touched. Packed
    # state and masters below f32 step through a float32 working copy: their state (as the
    # checkpoint form holds it) is float32.
    f32 = optimizer.ctx.optim_state.compact or optimizer.ctx.master.torch != torch.float32
    memo: dict[int, Any] = {
        id(mp): nn.Parameter(
            torch.zeros_like(mp, dtype=torch.float32 if f32 else mp.dtype),
            requires_grad=mp.requires_grad,
        )
        for mp in optimizer.master_params
    }
    shadow = copy.deepcopy(inner, memo)
    stand_ins = [p for group in shadow.param_groups for p in group[_PARAMS]]
    for p in stand_ins:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    shadow.step()
    return {i: dict(shadow.state[p]) for i, p in enumerate(stand_ins) if p in shadow.state}


def _shareable(value: Any, param: torch.Tensor, master: torch.Tensor, what: str) -> Any:
    """``value`` as it goes into the checkpoint: a shard wrapped into a DTensor, or as it is."""
    if not isinstance(value, torch.Tensor) or not isinstance(param, DTensor):
        return value
    if value.dim() == 0 and master.dim() > 0:
        return value  # replicated: the same number on every rank
    if value.shape != master.shape:
        raise ValueError(
            f"{what} has shape {list(value.shape)}, neither this rank's shard of the parameter "
            f"({list(master.shape)}) nor a scalar, so it cannot be resharded; "
            f"optimizer_state_dict handles element-wise optimizer state (Adam, AdamW, SGD, "
            f"RMSprop, ...). Use optimizer.state_dict() to resume on the same ranks"
        )
    return DTensor.from_local(
        value,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


# ----- set ------------------------------------------------------------------------------


def check_saved_optimizer(
    optimizer: torch.optim.Optimizer, state: object, key: str, who: str
) -> None:
    """``ValueError`` naming both classes when ``state[key]`` (a checkpoint's optimizer part)
    was saved by another optimizer class than ``optimizer`` (an ``OffloadedOptimizer``'s
    master optimizer for one): ``computectx.memory.optim.classes.check_optimizer_class``'s
    rule. Run before anything loads (``Parallel.load_state_dict`` calls it before the
    model), so a refused checkpoint changes nothing; a malformed ``state`` is left to the
    checks that follow."""
    if not isinstance(state, Mapping):
        return
    inner = optimizer.inner if isinstance(optimizer, OffloadedOptimizer) else optimizer
    check_optimizer_class(state.get(key), type(inner), inner.defaults, who)


def set_optimizer_state_dict(
    model: nn.Module, optimizer: OffloadedOptimizer, state_dict: Mapping[str, Any]
) -> None:
    """Install a state keyed by FQN (``optimizer_state_dict``'s form), then refresh the model.

    Everything is checked before anything changes: the keys (``"state"``, ``"param_groups"``,
    optionally ``"master_weights"``, ``"optim_state"``, ``"master_rounding"``), that the
    groups hold exactly this optimizer's parameters group by group, that every FQN is one of
    them, and that each tensor fits its parameter -- for a sharded (``DTensor``) parameter a
    ``DTensor`` of the parameter's shape on its mesh and placements (or a scalar), otherwise
    a plain tensor of the master's shape (or a scalar); masters also in the master dtype
    (``ctx.master``). Errors
    name the bad key and what is accepted. Then the state goes in as
    ``OffloadedOptimizer.load_state_dict`` puts it in, which copies the masters into the
    model's parameters. Without ``"master_weights"`` (a plain torch optimizer's state) the
    masters are taken from the model's current parameters. State is float32 (decoded, as
    ``optimizer_state_dict`` gives it, never packed parts): ``load_state_dict`` encodes it
    with this optimizer's ``ctx.optim_state`` and its own blocks, and converts, with a
    warning naming both, a state whose ``"optim_state"`` is another format (absent: ``f32``).

    As ``Optimizer.load_state_dict`` does, the state's tensors are taken, not copied (the
    masters are copied into the optimizer's own): the dict ``optimizer_state_dict`` gave and
    ``torch.distributed.checkpoint.load`` filled costs no second copy. Load the model first
    (``set_model_state_dict``), then the optimizer: the masters are the more precise copy,
    and this call writes them into the model.
    """
    optimizer.load_state_dict(_position(model, optimizer, state_dict))


def check_optimizer_state_dict(
    model: nn.Module, optimizer: OffloadedOptimizer, state_dict: Mapping[str, Any]
) -> None:
    """Run every check ``set_optimizer_state_dict`` runs (its own and the optimizer's
    ``load_state_dict``'s), loading nothing: the error it would raise, else ``None``."""
    optimizer.check_state_dict(_position(model, optimizer, state_dict))


def _position(
    model: nn.Module, optimizer: OffloadedOptimizer, state_dict: Mapping[str, Any]
) -> dict[str, Any]:
    """``state_dict`` (keyed by FQN) checked and keyed by position, as
    ``OffloadedOptimizer.load_state_dict`` takes it (nothing changes)."""
    fqns = _fqns_of(model, optimizer)
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    unknown = sorted(str(k) for k in state_dict if k not in _KEYS)
    if unknown or _STATE not in state_dict or _GROUPS not in state_dict:
        raise ValueError(
            f"state_dict has keys {sorted(map(str, state_dict))}; accepted: 'state', "
            f"'param_groups' (both required), 'master_weights', 'optim_state' and "
            f"'master_rounding' (as optimizer_state_dict gives; a flattened state dict is "
            f"not accepted)"
        )
    index = {fqn: i for i, fqn in enumerate(fqns)}
    groups = _check_groups(state_dict[_GROUPS], optimizer, fqns, index)
    state = _check_state(state_dict[_STATE], optimizer, index)
    position: dict[str, Any] = {_STATE: state, _GROUPS: groups}
    if MASTER_WEIGHTS in state_dict:
        position[MASTER_WEIGHTS] = _check_masters(state_dict[MASTER_WEIGHTS], optimizer, index)
    if OPTIM_STATE_KEY in state_dict:
        # The saving format, for load_state_dict's conversion rule (absent: f32). The values
        # are decoded whatever it is; load_state_dict encodes them with this optimizer's.
        fmt = saved_format(state_dict[OPTIM_STATE_KEY], f"state_dict[{OPTIM_STATE_KEY!r}]")
        position[OPTIM_STATE_KEY] = str(fmt)
    if MASTER_ROUNDING_KEY in state_dict:
        position[MASTER_ROUNDING_KEY] = state_dict[MASTER_ROUNDING_KEY]  # load_state_dict checks it
    return position


def _check_groups(
    saved: Any, optimizer: OffloadedOptimizer, fqns: list[str], index: Mapping[str, int]
) -> list[dict[str, Any]]:
    if not isinstance(saved, (list, tuple)) or not all(isinstance(g, Mapping) for g in saved):
        raise TypeError("state_dict['param_groups'] must be a list of dicts")
    ours = optimizer.param_groups
    if len(saved) != len(ours):
        raise ValueError(
            f"state_dict['param_groups'] has {len(saved)} group(s); this optimizer has {len(ours)}"
        )
    out = []
    first = 0
    for j, (group, own) in enumerate(zip(saved, ours, strict=True)):
        names = group.get(_PARAMS)
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"state_dict['param_groups'][{j}]['params'] must be a list of parameter FQNs "
                f"(strings), got {names!r:.80}"
            )
        own_names = fqns[first : first + len(own[_PARAMS])]
        first += len(own[_PARAMS])
        if sorted(names) != sorted(own_names):
            missing = sorted(set(own_names) - set(names))
            extra = sorted(set(names) - set(own_names))
            raise ValueError(
                f"state_dict['param_groups'][{j}] does not hold this optimizer's group {j}: "
                f"missing {missing}, unexpected {extra} (accepted: exactly {own_names})"
            )
        out.append({**group, _PARAMS: [index[n] for n in own_names]})
    return out


def _check_state(
    saved: Any, optimizer: OffloadedOptimizer, index: Mapping[str, int]
) -> dict[int, dict[str, Any]]:
    if not isinstance(saved, Mapping):
        raise TypeError(f"state_dict['state'] must be a mapping FQN -> dict, got {type(saved)}")
    out: dict[int, dict[str, Any]] = {}
    for fqn, per_param in saved.items():
        if fqn not in index:
            raise ValueError(
                f"state_dict['state'] has an entry for {fqn!r}, which is not one of this "
                f"optimizer's parameters; accepted: {_some(index)}"
            )
        if not isinstance(per_param, Mapping):
            raise TypeError(
                f"state_dict['state'][{fqn!r}] must be a dict, got {type(per_param).__name__}"
            )
        i = index[fqn]
        where = f"state_dict['state'][{fqn!r}]"
        parts = packed_keys(per_param)
        if parts:
            raise ValueError(
                f"{where} holds packed parts {parts}; accepted: each state tensor decoded, "
                f"under its plain name (as optimizer_state_dict gives; optimizer.state_dict() "
                f"keeps parts and loads through optimizer.load_state_dict)"
            )
        out[i] = {
            name: _local_value(value, optimizer, i, f"{where}[{name!r}]", master=False)
            for name, value in per_param.items()
        }
    return out


def _check_masters(
    saved: Any, optimizer: OffloadedOptimizer, index: Mapping[str, int]
) -> dict[int, torch.Tensor]:
    if not isinstance(saved, Mapping):
        raise TypeError(
            f"state_dict['master_weights'] must be a mapping FQN -> tensor, got "
            f"{type(saved).__name__}"
        )
    missing = sorted(set(index) - set(saved))
    extra = sorted(str(k) for k in saved if k not in index)
    if missing or extra:
        raise ValueError(
            f"state_dict['master_weights'] does not match this optimizer's {len(index)} "
            f"parameters: missing {missing}, unexpected {extra}"
        )
    out = {}
    for fqn, i in index.items():
        where = f"state_dict['master_weights'][{fqn!r}]"
        local = _local_value(saved[fqn], optimizer, i, where, master=True)
        sharded = isinstance(optimizer.compute_params[i], DTensor)
        master, policy = optimizer.master_params[i], optimizer.ctx.master
        out[i] = check_master_weight(local, master, where, policy, shard=sharded)
    return out


def _local_value(
    value: Any, optimizer: OffloadedOptimizer, i: int, where: str, *, master: bool
) -> Any:
    """This rank's part of a saved value, after checking that it fits parameter ``i``.

    The part of a master weight is checked further by ``check_master_weight``, as
    ``OffloadedOptimizer.load_state_dict`` checks it.
    """
    if not isinstance(value, torch.Tensor):
        # Numbers and None in an optimizer's state go in as they are; a master that is no
        # tensor is refused by check_master_weight.
        return value
    param = optimizer.compute_params[i]
    mp = optimizer.master_params[i]
    scalar_ok = not master and value.dim() == 0 and mp.dim() > 0
    if isinstance(param, DTensor):
        accepted = (
            f"a DTensor of shape {list(param.shape)} on the parameter's mesh with placements "
            f"{tuple(param.placements)}{'' if master else ', or a zero-dimensional tensor'}"
        )
        if scalar_ok and not isinstance(value, DTensor):
            return value
        if not isinstance(value, DTensor):
            raise ValueError(
                f"{where} is a plain tensor of shape {list(value.shape)}, but the parameter is "
                f"sharded; accepted: {accepted} (load the checkpoint into the dict that "
                f"optimizer_state_dict gives)"
            )
        if (
            value.shape != param.shape
            or value.device_mesh != param.device_mesh
            or tuple(value.placements) != tuple(param.placements)
        ):
            raise ValueError(
                f"{where} is a DTensor of shape {list(value.shape)} with placements "
                f"{tuple(value.placements)} on mesh {value.device_mesh}; accepted: {accepted}"
            )
        local = value.to_local()
    else:
        if isinstance(value, DTensor):
            raise ValueError(
                f"{where} is a DTensor, but the parameter is not sharded; accepted: a plain "
                f"tensor of shape {list(mp.shape)}"
                f"{'' if master else ' or a zero-dimensional tensor'}"
            )
        if scalar_ok:
            return value
        local = value
    if not master and local.shape != mp.shape:
        sharded = isinstance(param, DTensor)
        raise ValueError(
            f"{where} has shape {list(local.shape)}{' on this rank' if sharded else ''}, but "
            f"the master weight{'s shard' if sharded else ''} is {list(mp.shape)}; accepted: "
            f"a tensor of the parameter's shape or a zero-dimensional one"
        )
    return local


def _some(index: Mapping[str, int], limit: int = 6) -> str:
    names = list(index)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
