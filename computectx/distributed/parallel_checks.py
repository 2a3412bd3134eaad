"""What ``parallelize`` accepts: every rank-local check of its arguments, run before anything
changes (on many ranks inside ``agree``, so a check that fails on one rank raises on all)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from computectx.ctx import ComputeCtx
from computectx.distributed.expert_parallel import (
    expert_parallel_group,
    expert_parameters,
    same_ranks,
    unshard_expert_optimizer_state,
)
from computectx.distributed.group import check_join_timeout
from computectx.distributed.optimizer_checkpoint import (
    check_optimizer_state_dict,
    check_saved_optimizer,
)
from computectx.memory import OffloadedOptimizer

__all__ = [
    "check_model_state",
    "check_parallel_load",
    "check_parallelize",
    "check_same_setup",
    "setup_choices",
    "uses_offloaded",
]


_MODEL, _OPTIMIZER = "model", "optimizer"


def check_parallel_load(model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> Any:
    """Everything ``Parallel.load_state_dict`` checks before it loads ``state`` into ``model``
    (the module) and ``optimizer``, changing nothing: the checkpoint's keys, its optimizer's
    class, other ranks' expert moments, the model part (``check_model_state``) and, for an
    ``OffloadedOptimizer``, everything its load would check. Returns the optimizer part with
    this rank's expert moments (``unshard_expert_optimizer_state``)."""
    # Another optimizer class's state is refused before the model or anything loads.
    check_saved_optimizer(optimizer, state, _OPTIMIZER, "Parallel.load_state_dict")
    if not isinstance(state, Mapping) or set(state) != {_MODEL, _OPTIMIZER}:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(
            f"a Parallel checkpoint has the keys {[_MODEL, _OPTIMIZER]} (Parallel."
            f"state_dict()), got {got}"
        )
    # Another rank's expert moments are refused before anything loads.
    optim = unshard_expert_optimizer_state(model, state[_OPTIMIZER])
    # Both parts are checked whole before either loads: a refused load changes neither the
    # model nor the optimizer (whose masters follow the model).
    check_model_state(model, state[_MODEL])
    if isinstance(optimizer, OffloadedOptimizer):
        check_optimizer_state_dict(model, optimizer, state[_OPTIMIZER])
    return optim


def check_model_state(model: nn.Module, saved: object) -> None:
    """What ``set_model_state_dict`` (strict) would refuse of ``saved`` (a checkpoint's model
    part) after loading the rest, refused first: not a mapping (``TypeError``), a key missing
    or unexpected, a tensor where the model holds none or of another shape (``ValueError``
    naming the keys or the key and both shapes). The values are not read."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if not isinstance(saved, Mapping):
        raise TypeError(
            f"the checkpoint's 'model' part must be a mapping FQN -> tensor (Parallel."
            f"state_dict()['model']), got {type(saved).__name__}"
        )
    ours = get_model_state_dict(model)
    missing = sorted(k for k in ours if k not in saved)
    extra = sorted(str(k) for k in saved if k not in ours)
    if missing or extra:
        raise ValueError(
            f"the checkpoint's 'model' part does not hold this model's keys: missing "
            f"{missing[:8]}, unexpected {extra[:8]}; nothing was loaded"
        )
    for key, own in ours.items():
        if not isinstance(own, torch.Tensor):
            continue
        value = saved[key]
        if not isinstance(value, torch.Tensor) or value.shape != own.shape:
            got = (
                f"shape {list(value.shape)}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise ValueError(
                f"the checkpoint's 'model'[{key!r}] is {got}; accepted: a tensor of the "
                f"model's shape {list(own.shape)}; nothing was loaded"
            )


def uses_offloaded(ctx: ComputeCtx, model: nn.Module, offload: bool | None) -> bool:
    """Whether ``parallelize`` steps ``model`` with an ``OffloadedOptimizer``: ``offload``
    when given, else when the ctx asks for one (``ctx.offload`` set, ``ctx.master``
    differing from a trainable parameter's dtype, or compact state: ``ctx.optim_state``
    other than ``f32``, which a plain optimizer would silently keep at float32)."""
    if offload is not None:
        return bool(offload)
    params = [p for p in model.parameters() if p.requires_grad]
    return (
        ctx.offload is not None
        or ctx.optim_state.compact
        or any(p.dtype != ctx.master.torch for p in params)
    )


def check_parallelize(
    model: nn.Module,
    ctx: ComputeCtx,
    *,
    world: int,
    group: dist.ProcessGroup | None,
    strategy: str,
    mp_policy: MixedPrecisionPolicy | None,
    accumulate: bool | None,
    offload: bool | None,
    join_timeout: float | None,
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any],
    fp8_filter: object = None,
    fp8_all_gather: object = True,
    shard_units: object = None,
    current_amax: object = None,
    loss_normalization: object = "per_rank",
) -> None:
    """``parallelize``'s checks of its arguments on this rank (its docstring says what each
    refuses); raises before anything changes. Every argument is checked here, the ones only
    many ranks use too, so a bad one never stops ``parallelize`` after the model changed."""
    check_join_timeout(join_timeout)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(ctx, ComputeCtx):
        raise TypeError(f"ctx must be a computectx.ComputeCtx, got {type(ctx).__name__}")
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    for name, flag, accepted in (
        ("accumulate", accumulate, (True, False, None)),
        ("offload", offload, (True, False, None)),
        ("fp8_all_gather", fp8_all_gather, (True, False)),
    ):
        if not any(flag is a for a in accepted):
            raise TypeError(
                f"{name} must be {' or '.join(map(str, accepted))}, got {flag!r} (a string "
                f"such as 'no' would read as true)"
            )
    if fp8_filter is not None and not callable(fp8_filter):
        raise TypeError(
            f"fp8_filter must be callable(module, fqn) -> bool or None, got "
            f"{type(fp8_filter).__name__}"
        )
    if current_amax not in ("group", "local", None):
        raise ValueError(
            f"current_amax must be 'group' or 'local' (or None: the strategy's default), got "
            f"{current_amax!r}"
        )
    if loss_normalization not in ("per_rank", "global"):
        raise ValueError(
            f"loss_normalization must be 'per_rank' or 'global', got {loss_normalization!r}"
        )
    if shard_units is not None:
        _check_shard_units(model, shard_units)
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
            f"torch.optim.AdamW), got {optimizer_class!r}"
        )
    if mp_policy is not None:
        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                f"{type(mp_policy).__name__}"
            )
        if strategy != "fsdp":
            raise ValueError(
                f"mp_policy is FSDP2's mixed precision and strategy={strategy!r} does not "
                f"shard; pass it with strategy='fsdp' only"
            )
    if isinstance(model, DistributedDataParallel | FSDPModule):
        raise ValueError(
            f"parallelize wraps the model itself: pass the plain module, not a "
            f"{type(model).__name__} (it was wrapped already)"
        )
    wants_acc = ctx.grad != ctx.master
    build_acc = wants_acc if accumulate is None else bool(accumulate)
    if build_acc and strategy == "fsdp" and world > 1:
        why = "accumulate=True" if accumulate else f"the ctx ({ctx}) asks for one"
        raise ValueError(
            f"strategy='fsdp' takes no gradient accumulator ({why}): FSDP2 reduce-scatters "
            f"the gradients itself. Pass accumulate=False, or strategy='ddp'"
        )

    if expert_parameters(model) and world > 1:
        # Expert parallelism over the data-parallel ranks (each rank its experts, each
        # expert every rank's tokens): other layouts need a 2-D mesh this does not take.
        if not same_ranks(expert_parallel_group(model), group):
            raise ValueError(
                "the model's experts are spread over another group than parallelize's: "
                "call expert_parallel(model, group) with the data-parallel group (or mesh)"
            )
        if build_acc:
            raise ValueError(
                "an expert-parallel model takes no gradient accumulator here: it would "
                "average each rank's own experts with the others'. Pass accumulate=False"
            )
        if uses_offloaded(ctx, model, offload):
            raise ValueError(
                "an expert-parallel model steps with a plain optimizer here: the "
                "OffloadedOptimizer's clipping and inf/NaN skips are rank-local, and each "
                "rank's experts are its own. Pass offload=False"
                + (
                    f" and ctx.optim_state='f32' (ctx.optim_state={ctx.optim_state} is kept "
                    f"only by the OffloadedOptimizer)"
                    if ctx.optim_state.compact
                    else ""
                )
            )
    if ctx.optim_state.compact and not uses_offloaded(ctx, model, offload):
        raise ValueError(
            f"ctx.optim_state={ctx.optim_state} asks for compact optimizer state, which "
            f"parallelize keeps through an OffloadedOptimizer; offload=False would build a "
            f"plain {optimizer_class.__name__} holding float32 state. Pass offload=None (or "
            f"True), or set optim_state='f32'"
        )
    # The optimizer is built on a stand-in before the model changes, the way parallelize
    # builds it: a bad learning rate, or a class the OffloadedOptimizer refuses (LBFGS), must
    # not leave a model half converted, sharded or wrapped.
    if uses_offloaded(ctx, model, offload):
        if "sharding" in optimizer_kwargs:
            raise ValueError(
                "parallelize chooses the OffloadedOptimizer's sharding itself (FSDP2's "
                "shards under strategy='fsdp'); leave sharding out of its arguments"
            )
        stand_in = nn.Parameter(torch.zeros(1, device=ctx.device))
        OffloadedOptimizer([stand_in], ctx, optimizer_class, **optimizer_kwargs)
    else:
        optimizer_class([nn.Parameter(torch.zeros(1))], **optimizer_kwargs)


def setup_choices(
    model: nn.Module,
    ctx: ComputeCtx,
    *,
    world: int,
    strategy: str,
    mp_policy: MixedPrecisionPolicy | None,
    accumulate: bool | None,
    offload: bool | None,
    join_timeout: float | None,
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any],
    fp8_filter: object,
    fp8_all_gather: object,
    shard_units: object,
    current_amax: object,
    loss_normalization: object,
) -> list[tuple[str, str]]:
    """What ``parallelize`` will set up on this rank, as ``(choice, text)`` pairs the ranks
    compare (``check_same_setup``) before anything changes: the strategy and every choice
    that shapes a collective or the training (expert parallelism included). Run after
    ``check_parallelize`` passed."""
    names = {id(m): n for n, m in model.named_modules()}
    ep = expert_parallel_group(model)
    ep_ranks = None if ep is None else sorted(dist.get_process_group_ranks(ep))
    units = None if shard_units is None else [names.get(id(u), "?") for u in shard_units]  # type: ignore[attr-defined]
    kwargs = {k: repr(v) for k, v in sorted(optimizer_kwargs.items())}
    experts = {id(e) for e in expert_parameters(model)}
    return [
        ("strategy", repr(strategy)),
        ("world", str(world)),
        ("expert parallelism", "none" if ep is None else f"over ranks {ep_ranks}"),
        (
            "expert parameters",
            str(sorted(n for n, p in model.named_parameters() if id(p) in experts)),
        ),
        (
            "gradient accumulator",
            str(bool(ctx.grad != ctx.master if accumulate is None else accumulate)),
        ),
        ("OffloadedOptimizer", str(uses_offloaded(ctx, model, offload))),
        ("optimizer_class", f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"),
        ("optimizer arguments", str(kwargs)),
        ("mp_policy", repr(mp_policy)),
        ("fp8_filter", "None" if fp8_filter is None else "a filter"),
        ("fp8_all_gather", repr(fp8_all_gather)),
        ("shard_units", str(units)),
        ("current_amax", repr(current_amax)),
        ("loss_normalization", repr(loss_normalization)),
        ("join_timeout", repr(join_timeout)),
    ]


def check_same_setup(everyone: list[list[tuple[str, str]]]) -> None:
    """Stop with the same ``ValueError`` on every rank when the ranks called ``parallelize``
    with different choices (``setup_choices`` of every rank, in rank order): it names the
    ranks that differ from rank 0 and the first choice that differs."""
    first = everyone[0]
    differ = [r for r, theirs in enumerate(everyone) if theirs != first]
    if not differ:
        return
    theirs = dict(everyone[differ[0]])
    name, ours = next((n, t) for n, t in first if theirs.get(n) != t)
    raise ValueError(
        f"parallelize was called differently on the ranks of the group: rank(s) "
        f"{', '.join(map(str, differ))} differ from rank 0 in their {name} (rank 0: {ours}, "
        f"rank {differ[0]}: {theirs.get(name)}); every rank must set up the same model the "
        f"same way. Nothing changed"
    )


def _check_shard_units(model: nn.Module, units: object) -> None:
    """``shard_units``: a list of submodules of ``model`` (each at most once)."""
    if not isinstance(units, list | tuple) or not all(isinstance(u, nn.Module) for u in units):
        raise TypeError(f"shard_units must be a list of submodules of the model, got {units!r:.80}")
    inside = {id(m) for m in model.modules()}
    stray = [i for i, u in enumerate(units) if id(u) not in inside]
    if stray:
        raise ValueError(
            f"shard_units[{stray[0]}] ({type(units[stray[0]]).__name__}) is not a submodule "
            f"of the model; pass the model's own blocks"
        )
