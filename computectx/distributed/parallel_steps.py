"""The steps ``parallelize`` takes, in its one right order, each one job: check on every rank
(``check_setup``), then on many ranks spread the converted model over them (``distribute``:
shard it or wrap it in DDP, join its collective forwards, scale the experts' gradients, sync
the fp8 scaling), then build the optimizer and the accumulator.

Every rank runs the same steps with the same choices (the ranks compared them in
``check_setup``), so every rank issues the same collectives in the same order."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from computectx.ctx import ComputeCtx
from computectx.distributed.collectives import comm_device
from computectx.distributed.expert_parallel import expert_parallel_group, moe_local_buffers
from computectx.distributed.fp4_all_gather import enable_fp4_all_gather
from computectx.distributed.fp4_expert_gather import enable_fp4_expert_gather
from computectx.distributed.fp8_all_gather import (
    enable_quantized_all_gather,
    gathers_quantized,
    parameter_holders,
)
from computectx.distributed.fp8_amax_sync import AmaxSync, scaling_buffer_names
from computectx.distributed.fp8_expert_gather import enable_quantized_expert_gather
from computectx.distributed.frozen_broadcast import share_frozen
from computectx.distributed.grad_accumulator import DataParallelGradAccumulator
from computectx.distributed.group import (
    COMPILE_REFUSED,
    agree,
    data_parallel_group,
    describe_forward,
    join,
    join_forwards,
    joined,
)
from computectx.distributed.mixed_precision import fsdp_mixed_precision
from computectx.distributed.parallel_checks import (
    ParallelArgs,
    check_parallelize,
    check_same_setup,
    setup_choices,
    uses_offloaded,
    wants_accumulator,
    warn_shared_fp4_streams,
)
from computectx.distributed.same_setup import check_same_model, check_same_policy
from computectx.distributed.sharding import ShardedParams
from computectx.formats import Fp4Linear, Fp4Recipe, QuantizedLinear
from computectx.formats.seam import frozen_buffer_names, refuse_sharded
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer
from computectx.nn import GroupedExperts

__all__ = [
    "build_accumulator",
    "build_optimizer",
    "check_experts_held",
    "check_reduced",
    "check_setup",
    "distribute",
    "join_until_rebuilt",
    "rebuild_ddp_buckets",
    "world_of",
]


def world_of(mesh: DeviceMesh | None) -> int:
    """How many ranks ``parallelize`` sets up: ``mesh``'s size, else the default group's,
    else 1 (one process)."""
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(
                f"parallelize takes a one-dimensional DeviceMesh (data parallel), got "
                f"{mesh.ndim} dimensions {mesh.mesh_dim_names or ''}"
            )
        return int(mesh.size())
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def check_setup(
    model: nn.Module,
    ctx: ComputeCtx,
    args: ParallelArgs,
    world: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Check every argument before anything changes; on many ranks the ranks also agree that
    they all passed, and that they set up the same model the same way under the same policy
    (one ``ValueError``, alike on every rank, naming the rank that differs)."""

    def check() -> list[tuple[str, str]]:
        check_parallelize(model, ctx, args, world=world, group=group)
        return setup_choices(model, ctx, args, world=world)

    if world > 1:  # agree joins first; every rank raises alike before anything changes
        check_same_setup(agree(check, group, what="parallelize", join_timeout=args.join_timeout))
        check_same_policy(ctx, group)
    else:
        check()


def distribute(
    model: nn.Module,
    ctx: ComputeCtx,
    args: ParallelArgs,
    mesh: DeviceMesh | None,
    group: dist.ProcessGroup | None,
    world: int,
    experts: list[nn.Parameter],
) -> tuple[nn.Module, DeviceMesh | None, AmaxSync | None]:
    """Spread the (converted) ``model`` over ``world`` ranks: what runs forward, the mesh
    (FSDP2 makes one over the default group when none was given) and the fp8 amax sync."""
    sharded = args.strategy == "fsdp"
    # Ranks that converted other layers (another fp8_filter) or built another model (a
    # parameter of another FQN, shape or dtype: DDP's own check would refuse it on one rank
    # after the frozen buffers were sent) stop here, named, before anything is written.
    check_same_model(model, group, parameters=True)
    warn_shared_fp4_streams(model)
    pg = data_parallel_group(group)
    # Rank 0's frozen codes and scales, which neither DDP (they stay out of its broadcast)
    # nor FSDP2 (it sends no buffer) sends: without this a rank that built its model from
    # its own seed, or that did not load the checkpoint, would serve its own codes beside
    # the rest, silently. First: a refusal (the ranks froze other layers) changes nothing.
    share_frozen(model, pg, 0, args.join_timeout)
    share_scaling(model, pg)
    # Expert-parallel MoEs (their frozen experts hold no weight: experts may be empty).
    spread = expert_parallel_group(model) is not None
    run: nn.Module = model
    if sharded:
        if mesh is None:
            mesh = init_device_mesh(ctx.device.type, (world,))
        shard(model, ctx, args, mesh, world, experts)
    else:
        run = wrap_ddp(model, ctx, group, experts, args.join_timeout)
        if not spread:  # with experts spread every forward joins (below)
            join_until_rebuilt(run, data_parallel_group(group), args.join_timeout)
    if sharded or spread:
        # Every forward of what runs is a collective here (FSDP2's all-gathers, the experts'
        # all-to-alls): it joins the group first, before DDP's or FSDP2's own hooks, so a
        # rank that runs one alone gets a clear error instead of a hang.
        join_forwards(run, data_parallel_group(group), args.join_timeout)
    average_expert_grads(experts, world)
    sync = None
    if ctx.recipe and not isinstance(ctx.recipe, Fp4Recipe):  # 4 bits keep no amax history
        sync = AmaxSync(
            run,
            mesh,
            hooks=True,
            current_amax=args.current_amax,
            loss_normalization=args.loss_normalization,
            check=False,  # compared in check_setup, before wrapping
        )
    return run, mesh, sync


def share_scaling(model: nn.Module, pg: dist.ProcessGroup) -> None:
    """Copy group rank 0's fp8 scaling state (ledgers, tallies, ``fp8_meta``) of every
    trainable ``QuantizedLinear`` of ``model`` over every rank's, in place (the frozen
    layers' went with ``share_frozen``), and make each layer re-read its host state
    (``adopt_written``). Neither DDP (the scaling buffers stay out of its broadcast) nor
    FSDP2 sends them: a rank that did not load rank 0's checkpoint would otherwise scale
    its first forwards by its own ledgers (serving another model until the first merge) and,
    under FSDP2, decide by its own tally whether a quantize reduces its amax, a collective
    the other ranks would not run. One broadcast of every tensor's bytes, packed; the ranks
    compared the fp8 layers (``check_same_model``: policies, so the ledgers' sizes), so every
    rank sends the same bytes count (none without a trainable fp8 layer)."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and not m.frozen]
    tensors: dict[int, torch.Tensor] = {}
    for layer in layers:
        held = dict(layer.named_buffers(recurse=False))
        for name in layer.scaling.tensor_names():
            tensors.setdefault(id(held[name]), held[name])
    # A model built on the meta device (docs/fp8.md, "The meta device") holds no state to send
    # until to_empty: nothing to share. Whether its layers are on meta was compared with the
    # parameters (check_same_model), so every rank returns here alike.
    if not tensors or any(p.is_meta for layer in layers for p in layer.parameters(False)):
        return
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]
    wire = torch.cat([p.to(comm_device(pg)) for p in parts])
    dist.broadcast(wire, group=pg, group_src=0)
    with torch.no_grad():
        start = 0
        for t, part in zip(tensors.values(), parts, strict=True):
            got = wire[start : start + part.numel()].to(t.device).clone()  # aligned
            t.copy_(got.view(t.dtype).view(t.shape))
            start += part.numel()
    for layer in layers:
        layer.scaling.adopt_written()


def shard(
    model: nn.Module,
    ctx: ComputeCtx,
    args: ParallelArgs,
    mesh: DeviceMesh,
    world: int,
    experts: list[nn.Parameter],
) -> None:
    """FSDP2: the fp8 weights all-gather as fp8 and the 4-bit ones in 4 bits
    (``args.fp8_all_gather``), then ``fully_shard`` each shard unit and the root, in place."""
    if ctx.recipe and args.fp8_all_gather:
        gather_fp8_weights_as_fp8(model, world, experts)
    # Gather at ctx.compute, reduce-scatter at ctx.grad (fp8 weights keep their
    # fp8 gather: FSDP2 never casts a WeightGatheredQuantized's own gather inputs).
    # Expert-parallel weights are each rank's own: FSDP2 leaves them alone.
    mixed = fsdp_mixed_precision(ctx) if args.mp_policy is None else args.mp_policy
    own = set(experts) or None
    units = args.shard_units if args.shard_units is not None else default_units(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mixed, ignored_params=own)
    fully_shard(model, mesh=mesh, mp_policy=mixed, ignored_params=own)
    # A layer frozen now would quantize its DTensor shard (torch's bare AssertionError, its
    # weight ledger written first): its freeze_for_serving refuses instead, nothing changed.
    for fqn, m in model.named_modules():
        if isinstance(m, QuantizedLinear | Fp4Linear | GroupedExperts) and any(
            isinstance(p, DTensor) for p in m.parameters(recurse=False)
        ):
            vars(m)["freeze_for_serving"] = functools.partial(refuse_sharded_freeze, fqn, m)


def refuse_sharded_freeze(fqn: str, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``freeze_for_serving`` of a layer that ``parallelize(strategy="fsdp")`` sharded: the
    formats' refusal (``refuse_sharded``), whatever its weights are at the moment (a forward
    may leave them unsharded for a while), nothing changed."""
    refuse_sharded(f"{fqn or 'the model'}.freeze_for_serving", layer, managed=True)


def gather_fp8_weights_as_fp8(model: nn.Module, world: int, experts: list[nn.Parameter]) -> None:
    """Make FSDP2 gather the fp8 layers' weights (but tied ones, and those whose policy
    gathers high precision: ``gathers_quantized``) and the block fp8 experts as fp8, and the
    4-bit layers' weights and 4-bit experts' weights in 4 bits (but tied ones, each kind)."""
    owners = parameter_holders(model)
    enable_fp4_all_gather(
        model,
        module_filter=lambda m, fqn: (
            isinstance(m, Fp4Linear) and len(owners.get(id(m.weight), [])) <= 1
        ),
    )
    enable_quantized_all_gather(
        model,
        module_filter=lambda m, fqn: (
            isinstance(m, QuantizedLinear)
            and gathers_quantized(m.policy)
            and len(owners.get(id(m.weight), [])) <= 1
        ),
    )
    # Expert-parallel weights (FSDP2 leaves them alone) and tied ones gather high precision.
    tied = {i for i, holders in owners.items() if len(holders) > 1}
    skip = frozenset(map(id, experts)) | tied
    enable_quantized_expert_gather(model, world, skip=skip)
    enable_fp4_expert_gather(model, skip=skip)


def default_units(model: nn.Module) -> list[nn.Module]:
    """FSDP2's usual grain: every block of a ModuleList (transformer layers), else every
    direct child that holds parameters; the root is sharded last in any case."""
    blocks = [
        child
        for m in model.modules()
        if isinstance(m, nn.ModuleList)
        for child in m
        if any(True for _ in child.parameters())
    ]
    if blocks:
        return blocks
    return [c for c in model.children() if any(True for _ in c.parameters())]


def wrap_ddp(
    model: nn.Module,
    ctx: ComputeCtx,
    group: dist.ProcessGroup | None,
    experts: list[nn.Parameter],
    join_timeout: float | None,
) -> DistributedDataParallel:
    """``DistributedDataParallel`` over ``model`` on this rank's device, the buffers and
    weights it must not broadcast or all-reduce left out. It broadcasts rank 0's other
    buffers once, here, and never before a forward: no forward of it is a collective; the
    weights frozen for serving and the fp8 scaling state went from rank 0 before
    (``share_frozen``, ``share_scaling``), as DDP's broadcast would send them could it."""
    ids = None
    if ctx.device.type == "cuda":
        # A bare "cuda" means this rank's current device (torchrun's
        # torch.cuda.set_device(local_rank)), not cuda:0 on every rank.
        index = ctx.device.index
        ids = [torch.cuda.current_device() if index is None else index]
    # The fp8 scaling buffers stay out of DDP's broadcasts, at construction too: the
    # amax sync merges them (scaling_buffer_names). So do the weights frozen for serving
    # (float8 and float4 codes, which gloo cannot send, and their scales: each rank serves
    # its own), whether or not exclude_frozen_from_ddp listed them already.
    ignored = [*getattr(model, "_ddp_params_and_buffers_to_ignore", [])]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # type: ignore[no-untyped-call]
        model,
        list(
            dict.fromkeys(
                [
                    *ignored,
                    *frozen_buffer_names(model),
                    *scaling_buffer_names(model),
                    *moe_local_buffers(model),
                    *_names_of(model, experts),
                ]
            )
        ),
    )
    # No compression hook at ctx.grad: a low-precision ctx.grad builds the
    # DataParallelGradAccumulator (build_accumulator), which reduces the bf16 sums once per
    # step in float32 and owns DDP's one comm hook (docs/distributed.md, "Mixed precision
    # under FSDP2 and DDP").
    run = DistributedDataParallel(model, device_ids=ids, process_group=group)
    # The construction above broadcast rank 0's buffers once, every rank there. From now on
    # no forward broadcasts them: DDP's default broadcast before every forward (no_grad and
    # inference_mode included) is a collective one rank's evaluation forward would make
    # alone. computectx's buffers stay equal by their own means, and a user buffer that must
    # agree is the user's to sync, as under FSDP2 (docs/distributed.md, "Buffers under
    # DDP"). The attribute, not the constructor's argument: torch 2.13 renamed it
    # (forward_sync_buffers), and broadcast_buffers=False would skip the construction's too.
    run.broadcast_buffers = False
    return run


def check_experts_held(module: nn.Module, experts: tuple[nn.Parameter, ...]) -> None:
    """``RuntimeError`` (nothing changed) when an expert-parallel expert weight that
    ``parallelize`` took is no longer ``module``'s: experts frozen for serving after the wrap
    (no reducer holds them, so ``check_reduced`` cannot see it; the optimizer would keep the
    dropped weights and the frozen experts would silently stop training)."""
    if not experts:  # every step: no set of the model's parameters without experts
        return
    held = {id(p) for p in module.parameters()}
    gone = sum(id(p) not in held for p in experts)
    if gone:
        raise RuntimeError(
            f"Parallel.step: {gone} of the expert-parallel expert weights parallelize took are "
            f"no longer the model's: experts were frozen for serving after parallelize (or "
            f"replaced: load_state_dict(assign=True)). Freeze and load before parallelize; to "
            f"train a model changed since, parallelize it anew (serving needs no step). "
            f"Nothing was changed"
        )


def check_reduced(run: nn.Module) -> None:
    """``RuntimeError`` (nothing changed) when ``run``, a ``DistributedDataParallel``, wraps
    weights that are no longer its module's (a layer frozen for serving after the wrap, or
    weights replaced by ``load_state_dict(assign=True)``: DDP and the optimizer hold the old
    ones, and the step would train nothing, silently), or did not reduce every weight it wraps
    in the last backward (a weight the loss never reached; DDP itself would say so only at the
    forward after, in its own terms). Anything else: nothing."""
    if not isinstance(run, DistributedDataParallel):
        return
    held = {id(p) for p in run.module.parameters()}
    # The weights DDP reduces: one that never trains (requires_grad=False) may be replaced.
    gone = sum(p.requires_grad and id(p) not in held for p in run._module_parameters)
    why = (
        f"{gone} of the weights it wraps are no longer the model's: weights were replaced "
        f"after parallelize (a layer frozen for serving, load_state_dict(assign=True), a "
        f"parametrization such as weight_norm, a cast that makes new parameters). Freeze, load "
        f"and convert before parallelize; to train a model changed since, parallelize it anew "
        f"(serving needs no step)"
    )
    try:
        run.reducer._check_reducer_finalized()
    except RuntimeError as err:
        if not gone:
            why = (
                "a weight the loss did not reach (DDP needs every weight's gradient in every "
                "backward)"
            )
        raise RuntimeError(
            f"Parallel.step: DDP did not reduce every weight in the last backward: {why}. "
            f"Nothing was changed"
        ) from err
    if gone:
        raise RuntimeError(f"Parallel.step: {why}. Nothing was changed")


def rebuild_ddp_buckets(run: nn.Module) -> None:
    """DDP's one rebuild of its gradient buckets, now (``run`` a ``DistributedDataParallel``;
    anything else: nothing). DDP makes it at the first forward with grad on after the first
    backward, and it is a collective (a broadcast of the bucket order): a forward that one
    rank ran alone then would make it alone. ``Parallel.step`` calls this at its end, every
    rank together, so the rebuild happens there; afterwards it issues nothing. The rebuild
    is recorded where DDP's own forward records it (``_has_rebuilt_buckets``, which DDP
    clears again when it must rebuild: ``_update_process_group``)."""
    if isinstance(run, DistributedDataParallel) and run.reducer._rebuild_buckets():
        run._has_rebuilt_buckets = True  # as DDP's _pre_forward records its own rebuild


def join_until_rebuilt(run: nn.Module, group: dist.ProcessGroup, timeout: float | None) -> None:
    """Make each forward of ``run`` (a ``DistributedDataParallel``) with grad on after a
    backward, until DDP's bucket rebuild has happened (the first ``Parallel.step``), join
    ``group`` first (``join``): DDP makes the rebuild, a collective, in the first such
    forward, so a rank that runs it alone (a validation forward between the first backward
    and the first step) gets ``join``'s ``RuntimeError`` naming the absent ranks instead of
    leaving the group one broadcast apart. Every other forward issues nothing and joins
    nothing (before any backward there is nothing to rebuild). Its two hooks are removed at
    the first forward after the rebuild, and the weight's hook when ``run`` is freed."""
    trainable = [p for p in run.parameters() if p.requires_grad]
    if not trainable:
        return
    backward = [False]  # a backward reached the weights: DDP recorded its bucket order

    def reached(p: torch.Tensor) -> None:
        backward[0] = True

    # DDP (no unused parameters) needs every weight's gradient each backward: one is enough.
    # The weight outlives the wrapper (a Parallel dropped, the model wrapped again): its hook
    # goes with the wrapper.
    hooks = [trainable[0].register_post_accumulate_grad_hook(reached)]  # type: ignore[no-untyped-call]
    weakref.finalize(run, hooks[0].remove)

    @torch.compiler.disable(reason=COMPILE_REFUSED)  # type: ignore[untyped-decorator, no-untyped-call]
    def enter(m: nn.Module, args: Any) -> None:
        if getattr(m, "_has_rebuilt_buckets", False):
            for hook in hooks:  # nothing left to join for
                hook.remove()
            return
        if backward[0] and torch.is_grad_enabled() and not joined(group):
            join(group, describe_forward(m), timeout)

    hooks.append(run.register_forward_pre_hook(enter, prepend=True))


def average_expert_grads(experts: list[nn.Parameter], world: int) -> None:
    """Scale each expert-parallel weight's gradient by ``1/world``."""
    for p in experts:
        # DDP and FSDP2 average the other gradients over the ranks; an expert's
        # gradient already sums every rank's tokens, so it takes the same 1/world.
        p.register_hook(lambda grad: grad / world)  # type: ignore[no-untyped-call]


def build_optimizer(
    model: nn.Module, ctx: ComputeCtx, args: ParallelArgs, shards: DeviceMesh | None
) -> torch.optim.Optimizer:
    """The optimizer over ``model``'s trainable parameters: an ``OffloadedOptimizer`` over
    ``args.optimizer_class`` where ``uses_offloaded`` says so (stepping FSDP2's shards of
    ``shards``, the mesh, when sharded), else ``args.optimizer_class`` itself."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not uses_offloaded(ctx, model, args.offload):
        return args.optimizer_class(params, **args.optimizer_kwargs)
    sharding = None if shards is None else ShardedParams(shards, join_timeout=args.join_timeout)
    return OffloadedOptimizer(
        params, ctx, args.optimizer_class, sharding=sharding, **args.optimizer_kwargs
    )


def build_accumulator(
    model: nn.Module, run: nn.Module, ctx: ComputeCtx, args: ParallelArgs
) -> LowPrecGradAccumulator | None:
    """The gradient accumulator, when ``args.accumulate`` or (by default) the ctx asks for
    one (never under FSDP2 on many ranks: ``check_setup`` refused that): over DDP's ``run``
    a ``DataParallelGradAccumulator``, in one process a ``LowPrecGradAccumulator``."""
    if not wants_accumulator(ctx, args.accumulate):
        return None
    if isinstance(run, DistributedDataParallel):
        return DataParallelGradAccumulator(run, ctx)
    return LowPrecGradAccumulator([p for p in model.parameters() if p.requires_grad], ctx)


def _names_of(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    ids = {id(p) for p in params}
    return [n for n, p in model.named_parameters() if id(p) in ids]
