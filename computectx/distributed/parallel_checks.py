"""What ``parallelize`` accepts: every rank-local check of its arguments, run before anything
changes (on many ranks inside ``agree``, so a check that fails on one rank raises on all)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from computectx._checks import described
from computectx.ctx import ComputeCtx
from computectx.distributed.expert_parallel import (
    expert_parallel_group,
    expert_parameters,
    same_ranks,
    unshard_expert_optimizer_state,
)
from computectx.distributed.fp8_amax_sync import CurrentAmax, LossNormalization
from computectx.distributed.group import check_join_timeout
from computectx.distributed.optimizer_checkpoint import (
    check_optimizer_state_dict,
    check_saved_optimizer,
)
from computectx.distributed.same_setup import first_difference
from computectx.formats import Fp4Experts, Fp4Linear
from computectx.formats.seam import check_convertible, check_layer_entries, shared_streams
from computectx.memory import OffloadedOptimizer

__all__ = [
    "ParallelArgs",
    "check_model_state",
    "check_parallel_load",
    "check_parallelize",
    "check_same_saved_streams",
    "check_same_setup",
    "saved_fp4_streams",
    "setup_choices",
    "uses_offloaded",
    "wants_accumulator",
    "warn_shared_fp4_streams",
]


_MODEL, _OPTIMIZER = "model", "optimizer"


@dataclass(frozen=True, eq=False)
class ParallelArgs:
    """``parallelize``'s keyword arguments as the caller gave them, unchecked (its docstring
    says what each means); ``check_parallelize`` checks them, the setup steps read them."""

    strategy: str
    mp_policy: MixedPrecisionPolicy | None
    accumulate: bool | None
    offload: bool | None
    join_timeout: float | None
    optimizer_class: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    fp8_filter: Callable[[nn.Module, str], bool] | None
    fp8_all_gather: bool
    shard_units: list[nn.Module] | None
    current_amax: CurrentAmax | None
    loss_normalization: LossNormalization


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
    naming the keys or the key and both shapes); then each layer's own check of its entries
    (``scaling_load``, ``check_load``: a 4-bit counter out of range, another recipe or seed),
    as ``load_state_dict``'s whole-load guard runs it. Nothing is changed."""
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
            raise ValueError(
                f"the checkpoint's 'model'[{key!r}] is {described(value)}; accepted: a tensor "
                f"of the model's shape {tuple(own.shape)}; nothing was loaded"
            )
    # Each layer's own check of its entries, as the whole-load guard of load_state_dict runs
    # it: here inside the load's agreement, so one rank's bad entry is the same error on
    # every rank instead of one rank loading alone.
    check_layer_entries(model, saved)


def saved_fp4_streams(model: nn.Module, saved: Mapping[str, object]) -> list[tuple[str, int]]:
    """``(key, stream)`` of each 4-bit module's ``_extra_state`` in ``saved`` (a checkpoint's
    model part, checked already: ``check_model_state``), a version-1 state's stream 0; what
    ``check_same_saved_streams`` compares across the ranks."""
    out = []
    for fqn, m in model.named_modules():
        key = f"{fqn}._extra_state" if fqn else "_extra_state"
        if isinstance(m, Fp4Linear | Fp4Experts) and key in saved:
            out.append((key, m.saved_stream(saved[key], fqn)))  # the layout's owner reads it
    return out


def check_same_saved_streams(everyone: list[list[tuple[str, int]]]) -> None:
    """Stop with the same ``ValueError`` on every rank when the ranks' checkpoint parts
    (``saved_fp4_streams`` of each, in rank order) hold different 4-bit streams: the ranks
    would draw on different streams from then on, which ``parallelize``'s setup check
    refuses. Nothing has loaded yet."""
    found = first_difference(everyone, "none")
    if found is None:
        return
    differ, key, zero, other = found
    raise ValueError(
        f"the ranks' checkpoints hold different stochastic-rounding streams: rank(s) "
        f"{', '.join(map(str, differ))} differ from rank 0; the first is {key!r}: stream "
        f"{zero} on rank 0, {other} on rank {differ[0]}. Load "
        f"one checkpoint on every rank (a DCP checkpoint, or one rank's torch.save); nothing "
        f"was loaded"
    )


def warn_shared_fp4_streams(model: nn.Module) -> None:
    """Warn (``UserWarning``, naming both) when two 4-bit modules of the model share a
    stochastic-rounding stream (every rank's alike: they draw the same uniforms;
    ``shared_streams``, as ``assign_fp4_streams`` warns). That the ranks converted the same
    layers to 4 bits, on the same streams, is ``same_setup.check_same_model``'s to check, in its
    one exchange; this issues no collective."""
    named = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, Fp4Linear | Fp4Experts)]
    shared = shared_streams((fqn, m.sr_stream) for fqn, m in named)
    if shared:
        warnings.warn(f"{shared} before parallelize", UserWarning, stacklevel=4)


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


def wants_accumulator(ctx: ComputeCtx, accumulate: bool | None) -> bool:
    """Whether ``parallelize`` asks for a gradient accumulator: ``accumulate`` when given,
    else when the ctx asks for one (``ctx.grad`` differing from ``ctx.master``)."""
    return ctx.grad != ctx.master if accumulate is None else bool(accumulate)


def check_parallelize(
    model: nn.Module,
    ctx: ComputeCtx,
    args: ParallelArgs,
    *,
    world: int,
    group: dist.ProcessGroup | None,
) -> None:
    """``parallelize``'s checks of its arguments on this rank (its docstring says what each
    refuses); raises before anything changes. Every argument is checked here, the ones only
    many ranks use too, so a bad one never stops ``parallelize`` after the model changed."""
    check_join_timeout(args.join_timeout)
    _check_model_and_ctx(model, ctx)
    _check_choices(args)
    if args.shard_units is not None:
        _check_shard_units(model, args.shard_units)
    _check_optimizer_class(args.optimizer_class)
    _check_mp_policy(args.mp_policy, args.strategy)
    _check_not_wrapped(model)
    # Inside the ranks' agreement: what the conversion would refuse (without a recipe: layers
    # converted already, whose scaling no sync would keep in step across the ranks).
    check_convertible(model, ctx, args.fp8_filter)
    if args.strategy == "ddp" and world > 1:
        _check_trains_something(model)
    builds_accumulator = _check_accumulator(ctx, args, world)
    offloaded = uses_offloaded(ctx, model, args.offload)
    if expert_parallel_group(model) is not None and world > 1:
        _check_expert_parallel(model, ctx, group, builds_accumulator, offloaded)
    if ctx.optim_state.compact and not offloaded:
        raise ValueError(
            f"ctx.optim_state={ctx.optim_state} asks for compact optimizer state, which "
            f"parallelize keeps through an OffloadedOptimizer; offload=False would build a "
            f"plain {args.optimizer_class.__name__} holding float32 state. Pass offload=None "
            f"(or True), or set optim_state='f32'"
        )
    _check_optimizer_builds(ctx, args, offloaded)


def _check_trains_something(model: nn.Module) -> None:
    """DDP's own refusal, made before anything changes: a model with no parameter that
    requires a gradient (expert-parallel experts aside, which DDP leaves out)."""
    experts = {id(p) for p in expert_parameters(model)}
    if not any(p.requires_grad and id(p) not in experts for p in model.parameters()):
        raise ValueError(
            "parallelize(strategy='ddp'): no parameter of the model requires a gradient "
            "(every layer frozen for serving or requires_grad=False), and "
            "DistributedDataParallel wraps only a model with one. Serve a frozen model "
            "without a wrap (computectx.distributed.broadcast_frozen(model) on every rank "
            "shares rank 0's frozen buffers), or leave a layer trainable; nothing changed"
        )


def _check_model_and_ctx(model: object, ctx: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(ctx, ComputeCtx):
        raise TypeError(f"ctx must be a computectx.ComputeCtx, got {type(ctx).__name__}")


def _check_choices(args: ParallelArgs) -> None:
    """The strategy, the three flags, ``fp8_filter``, ``current_amax``, ``loss_normalization``."""
    if args.strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {args.strategy!r}")
    for name, flag, accepted in (
        ("accumulate", args.accumulate, (True, False, None)),
        ("offload", args.offload, (True, False, None)),
        ("fp8_all_gather", args.fp8_all_gather, (True, False)),
    ):
        if not any(flag is a for a in accepted):
            raise TypeError(
                f"{name} must be {' or '.join(map(str, accepted))}, got {flag!r} (a string "
                f"such as 'no' would read as true)"
            )
    if args.fp8_filter is not None and not callable(args.fp8_filter):
        raise TypeError(
            f"fp8_filter must be callable(module, fqn) -> bool or None, got "
            f"{type(args.fp8_filter).__name__}"
        )
    if args.current_amax not in ("group", "local", None):
        raise ValueError(
            f"current_amax must be 'group' or 'local' (or None: the strategy's default), got "
            f"{args.current_amax!r}"
        )
    if args.loss_normalization not in ("per_rank", "global"):
        raise ValueError(
            f"loss_normalization must be 'per_rank' or 'global', got {args.loss_normalization!r}"
        )


def _check_optimizer_class(optimizer_class: object) -> None:
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
            f"torch.optim.AdamW), got {optimizer_class!r}"
        )


def _check_mp_policy(mp_policy: object, strategy: str) -> None:
    if mp_policy is None:
        return
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


def _check_not_wrapped(model: nn.Module) -> None:
    if isinstance(model, DistributedDataParallel | FSDPModule):
        raise ValueError(
            f"parallelize wraps the model itself: pass the plain module, not a "
            f"{type(model).__name__} (it was wrapped already)"
        )


def _check_accumulator(ctx: ComputeCtx, args: ParallelArgs, world: int) -> bool:
    """Whether ``parallelize`` builds a gradient accumulator (``accumulate``, else when the
    ctx asks for one), refused under FSDP2 on many ranks."""
    builds = wants_accumulator(ctx, args.accumulate)
    if builds and args.strategy == "fsdp" and world > 1:
        why = "accumulate=True" if args.accumulate else f"the ctx ({ctx}) asks for one"
        raise ValueError(
            f"strategy='fsdp' takes no gradient accumulator ({why}): FSDP2 reduce-scatters "
            f"the gradients itself. Pass accumulate=False, or strategy='ddp'"
        )
    return builds


def _check_expert_parallel(
    model: nn.Module,
    ctx: ComputeCtx,
    group: dist.ProcessGroup | None,
    builds_accumulator: bool,
    offloaded: bool,
) -> None:
    """An expert-parallel model on many ranks: its experts spread over ``group``, with no
    accumulator and a plain optimizer."""
    # Expert parallelism over the data-parallel ranks (each rank its experts, each
    # expert every rank's tokens): other layouts need a 2-D mesh this does not take.
    if not same_ranks(expert_parallel_group(model), group):
        raise ValueError(
            "the model's experts are spread over another group than parallelize's: "
            "call expert_parallel(model, group) with the data-parallel group (or mesh)"
        )
    if builds_accumulator:
        raise ValueError(
            "an expert-parallel model takes no gradient accumulator here: it would "
            "average each rank's own experts with the others'. Pass accumulate=False"
        )
    if offloaded:
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


def _check_optimizer_builds(ctx: ComputeCtx, args: ParallelArgs, offloaded: bool) -> None:
    """The optimizer is built on a stand-in before the model changes, the way parallelize
    builds it: a bad learning rate, or a class the OffloadedOptimizer refuses (LBFGS), must
    not leave a model half converted, sharded or wrapped."""
    if not offloaded:
        args.optimizer_class([nn.Parameter(torch.zeros(1))], **args.optimizer_kwargs)
        return
    if "sharding" in args.optimizer_kwargs:
        raise ValueError(
            "parallelize chooses the OffloadedOptimizer's sharding itself (FSDP2's "
            "shards under strategy='fsdp'); leave sharding out of its arguments"
        )
    stand_in = nn.Parameter(torch.zeros(1, device=ctx.device))
    OffloadedOptimizer([stand_in], ctx, args.optimizer_class, **args.optimizer_kwargs)


def setup_choices(
    model: nn.Module, ctx: ComputeCtx, args: ParallelArgs, *, world: int
) -> list[tuple[str, str]]:
    """What ``parallelize`` will set up on this rank, as ``(choice, text)`` pairs the ranks
    compare (``check_same_setup``) before anything changes: the strategy and every choice
    that shapes a collective or the training (expert parallelism included). Run after
    ``check_parallelize`` passed."""
    names = {id(m): n for n, m in model.named_modules()}
    ep = expert_parallel_group(model)
    ep_ranks = None if ep is None else sorted(dist.get_process_group_ranks(ep))
    units = None if args.shard_units is None else [names.get(id(u), "?") for u in args.shard_units]
    kwargs = {k: repr(v) for k, v in sorted(args.optimizer_kwargs.items())}
    experts = {id(e) for e in expert_parameters(model)}
    cls = args.optimizer_class
    return [
        ("strategy", repr(args.strategy)),
        ("world", str(world)),
        ("expert parallelism", "none" if ep is None else f"over ranks {ep_ranks}"),
        (
            "expert parameters",
            str(sorted(n for n, p in model.named_parameters() if id(p) in experts)),
        ),
        (
            "gradient accumulator",
            str(wants_accumulator(ctx, args.accumulate)),
        ),
        ("OffloadedOptimizer", str(uses_offloaded(ctx, model, args.offload))),
        ("optimizer_class", f"{cls.__module__}.{cls.__qualname__}"),
        ("optimizer arguments", str(kwargs)),
        ("mp_policy", repr(args.mp_policy)),
        ("fp8_filter", "None" if args.fp8_filter is None else "a filter"),
        ("fp8_all_gather", repr(args.fp8_all_gather)),
        ("shard_units", str(units)),
        ("current_amax", repr(args.current_amax)),
        ("loss_normalization", repr(args.loss_normalization)),
        ("join_timeout", repr(args.join_timeout)),
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
