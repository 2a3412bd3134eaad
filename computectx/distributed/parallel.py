"""One call that sets a model up for many ranks, in the one right order: ``parallelize``.

Training fp8 data-parallel takes several pieces (fp8 conversion, the fp8 all-gather, DDP or
FSDP2, the amax sync, the memory policy's accumulator and optimizer) and most wrong orders
are silent. ``parallelize(model, ctx, strategy=...)`` runs them in order and returns a
``Parallel``: the module to run forwards on, the optimizer, the accumulator, the sync, and
``step`` / ``state_dict`` / ``load_state_dict`` for the loop and its checkpoints. With no
process group (or a world of one) it sets up the same model for one process, so one script
runs under ``python`` and under ``torchrun`` alike. The pieces stay public for experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from computectx._checks import check_max_norm
from computectx.ctx import ComputeCtx
from computectx.distributed.expert_parallel import (
    clip_grad_norm_with_experts,
    expert_parameters,
    shard_expert_optimizer_state,
    update_expert_bias,
)
from computectx.distributed.fp4_counters import sync_fp4_counters
from computectx.distributed.fp8_amax_sync import (
    AmaxSync,
    CurrentAmax,
    LossNormalization,
    rescale_grad_ledger,
)
from computectx.distributed.group import agree, agree_ok, data_parallel_group, joining
from computectx.distributed.optimizer_checkpoint import (
    optimizer_state_dict,
    set_optimizer_state_dict,
)
from computectx.distributed.parallel_checks import (
    ParallelArgs,
    check_parallel_load,
    check_same_saved_streams,
    saved_fp4_streams,
)
from computectx.distributed.parallel_steps import (
    build_accumulator,
    build_optimizer,
    check_experts_held,
    check_reduced,
    check_setup,
    distribute,
    rebuild_ddp_buckets,
    world_of,
)
from computectx.formats import ConversionReport, QuantizedLinear, convert_to_quantized
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer

__all__ = ["Parallel", "Strategy", "parallelize"]

Strategy = Literal["ddp", "fsdp"]
"""How the ranks share the model: replicated (``DistributedDataParallel``) or sharded
(FSDP2's ``fully_shard``)."""

ModuleFilter = Callable[[nn.Module, str], bool]

_MODEL, _OPTIMIZER = "model", "optimizer"


@dataclass(eq=False)
class Parallel:
    """What ``parallelize`` set up. Run forwards on ``model``; keep ``module`` for evaluation
    and sampling. Under DDP and in one process a call on ``module`` is rank-local: it
    issues no collective and records nothing, so one rank may validate or sample alone.
    Under DDP one rank may also run ``model`` alone (a validation forward in eval or train
    mode, with or without grad), and call ``state_dict()`` alone: fp8 adds no collective to
    either (docs/distributed.md, "What one rank may call"). Under FSDP2 ``module`` is the
    sharded model itself: its forward all-gathers the weights, so every rank must call it
    together.

    ``world_size`` is 1 in one process, where ``model`` is ``module`` and ``sync`` is
    ``None``.
    """

    model: nn.Module
    """What the ranks run forward: the DDP wrapper, the sharded model, or the model."""
    module: nn.Module
    """The model itself (under FSDP2, sharded in place: the same object as ``model``)."""
    optimizer: torch.optim.Optimizer
    """An ``OffloadedOptimizer`` where the ctx asks for one, else ``optimizer_class``."""
    accumulator: LowPrecGradAccumulator | None
    """The gradient accumulator, where the ctx asks for one (DDP and one process)."""
    sync: AmaxSync | None
    """The fp8 amax sync (many ranks, fp8 policy; none for a 4-bit recipe, which keeps no
    amax history): it merges the ranks' scaling state at the
    end of every backward of ``model``. Row, block and mx layers reduce no amax (their
    scales keep no history); their statistics are merged with the rest."""
    conversion: ConversionReport | None
    """What ``convert_to_quantized`` did (fp8 policy)."""
    world_size: int
    loss_normalization: LossNormalization = "per_rank"
    """What each rank's loss is normalized by (``parallelize``'s argument)."""
    expert_params: tuple[nn.Parameter, ...] = ()
    """The expert weights of an expert-parallel model (``expert_parallel``): each rank's
    own, left out of DDP's all-reduce and FSDP2's sharding."""
    group: dist.ProcessGroup | None = None
    """The data-parallel group (``None`` in one process)."""
    join_timeout: float | None = None
    """How long a collective call (``step``, a forward under FSDP2 or expert parallelism)
    waits for every rank to join it (``parallelize``'s argument)."""

    def step(self, max_norm: float | None = None) -> float | None:
        """End an optimizer step: hand the gradients over, clip, step, zero them.

        Returns the total gradient norm when ``max_norm`` is given (measured over every
        rank; a non-finite norm skips the step, as ``OffloadedOptimizer`` does), else
        ``None``. Then every ``MoE``'s router bias moves with the load all ranks counted
        since the last step (``update_expert_bias``: one all-reduce on many ranks, none
        without MoE layers). On many ranks every 4-bit layer's stochastic-rounding counter
        first becomes the largest over the ranks (``sync_fp4_counters``: one all-reduce,
        none without such layers), so a checkpoint saved after a step is every rank's.
        Under DDP the first step ends with DDP's one rebuild of its gradient buckets (a
        broadcast, ``rebuild_ddp_buckets``), which DDP would otherwise make in the next
        forward with grad on: no forward of ``model`` is then a collective.

        On many ranks it is a collective call: every rank steps together. It first joins
        the group (``join``), so a rank that steps alone gets a ``RuntimeError`` naming the
        ranks that did not join after ``join_timeout``, with nothing changed.

        ``max_norm`` is checked before any gradient moves: a real number > 0, not NaN
        (``math.inf`` measures the norm without clipping, as in torch); a bool, a string,
        NaN, zero or a negative number is a ``TypeError``/``ValueError``. So is the state of
        an ``OffloadedOptimizer`` (``check_step``: a ``step`` that is not a whole number
        >= 0, a non-finite scalar, a bad packed part), and on many ranks the ranks agree on
        it (``agree_ok``: one 1-element all-reduce per step) before any rank steps: state that
        cannot step on one rank is the same ``ValueError`` on every rank, naming that rank,
        with nothing changed on any.

        Under DDP a last backward that did not reduce every weight DDP wraps (a layer frozen
        for serving after ``parallelize``: its dropped weight stays DDP's) is a
        ``RuntimeError`` naming that cause, nothing changed: freeze before ``parallelize``,
        and to train a model frozen since, parallelize it anew. Expert-parallel experts
        frozen after ``parallelize`` (no reducer holds them) are the same ``RuntimeError``;
        on every rank at once when one rank froze them (told at the join).
        """
        if max_norm is not None:
            check_max_norm(max_norm)
        if self.group is None:
            return self._step(max_norm)
        # A layer frozen after the wrap: its weight's gradient never reached DDP's reducer, on
        # every rank that froze it (named here, before DDP's next forward says it its way);
        # experts frozen since. Checked on this rank and told at the join (the store, no
        # collective): a rank's refusal is every rank's error, at once.
        refusal = None
        try:
            check_reduced(self.model)
            check_experts_held(self.module, self.expert_params)
        except RuntimeError as err:
            refusal = str(err)
        # A collective (the gradients' hand-over, the norm, the biases' load): every rank
        # steps together, or a clear error here; the expert helpers ride on this join.
        with joining(self.group, "Parallel.step", self.join_timeout, refusal):
            opt = self.optimizer
            if isinstance(opt, OffloadedOptimizer):
                # Its state's checks (step counts, packed parts), exchanged before anything
                # moves: state that cannot step on one rank makes every rank raise, naming
                # it, before any rank steps (its replicas or shards would part ways).
                agree_ok(opt.check_step, self.group, what="Parallel.step")
            # The 4-bit layers' stochastic-rounding counters, one over the ranks (the
            # largest): a checkpoint saved after a step is every rank's (fp4_counters). After
            # the agreed checks: a refused step changes no counter.
            sync_fp4_counters(self.module, self.group)
            norm = self._step(max_norm)
            # DDP's bucket rebuild (once, a broadcast) here, not in the next forward, which
            # one rank may run alone (an evaluation forward with grad on).
            rebuild_ddp_buckets(self.model)
            return norm

    def _step(self, max_norm: float | None) -> float | None:
        opt, acc = self.optimizer, self.accumulator
        norm: float | None = None
        if isinstance(opt, OffloadedOptimizer):
            if acc is not None:
                opt.ingest_grads(acc)
            if max_norm is not None:
                norm = opt.clip_grad_norm(max_norm)
            opt.step()
        else:
            if acc is not None:
                acc.flush_to_param_grads()
            if max_norm is not None:
                params = [p for g in opt.param_groups for p in g["params"]]
                if self.expert_params and self.group is not None:
                    # Each rank's experts are its own: the norm sums them over the ranks,
                    # so every rank clips (or skips) alike.
                    norm = clip_grad_norm_with_experts(
                        params, self.expert_params, self.group, max_norm
                    )
                else:
                    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            if norm is None or math.isfinite(norm):
                opt.step()
        opt.zero_grad(set_to_none=True)
        # The routers' auxiliary-loss-free biases move with the whole batch's load (one
        # all-reduce per step, none without MoE layers): every rank's stay identical.
        update_expert_bias(self.module, self.group)
        return norm

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` keyed by parameter FQN, for
        ``torch.distributed.checkpoint`` (it reshards to any world size) or ``torch.save``.

        The fp8 scaling state is merged over the ranks at the end of every backward, so
        it is the world's on every rank: under DDP (and in one process) this issues no
        collective, and one rank may call it alone (``if rank == 0: torch.save(...)``).
        A training forward whose backward has not run yet leaves its records out: the
        state saved is the last merge's. Under FSDP2 it gathers DCP's state dict, a
        collective in torch: every rank calls it.
        """
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opt = self.optimizer
        optim = (
            optimizer_state_dict(self.module, opt)
            if isinstance(opt, OffloadedOptimizer)
            else get_optimizer_state_dict(self.module, opt)
        )
        if self.expert_params:
            # Each rank's experts' moments are its own: DTensors, as the experts are.
            optim = shard_expert_optimizer_state(self.module, optim)
        model = get_model_state_dict(self.module)
        if self.sync is not None:
            merged = self.sync.merged_state(self.module)
            model.update({k: v for k, v in merged.items() if k in model})
        return {_MODEL: model, _OPTIMIZER: optim}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what ``state_dict`` gave (after ``torch.distributed.checkpoint.load`` filled
        it): the model first, then the optimizer, whose masters follow the model.

        On many ranks (DDP and FSDP2 alike) it is a collective call: it first joins the group
        (as ``step`` does; torch's loaders issue a collective under FSDP2), so a rank that
        loads alone gets a ``RuntimeError`` naming the ranks that did not join, with nothing
        loaded. Every rank checks its part before any rank loads, and the outcomes are
        exchanged in that join's one ``all_gather_object`` (``agree``): one rank's bad part
        (a 4-bit counter or stream out of range, another recipe, a missing key) is the same
        error on every rank, naming that rank, with nothing changed on any; so is a part
        whose 4-bit streams differ from another rank's (``check_same_saved_streams``: the
        ranks would draw on different streams from then on). An expert-parallel model
        refuses, before anything loads, expert weights or moments that another rank saved (a
        one-rank ``torch.save`` of ``state_dict()``): ``ValueError`` naming both ranks and
        the fix."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
        )
        from torch.distributed.checkpoint.state_dict import (
            set_optimizer_state_dict as set_plain_optimizer_state_dict,
        )

        opt, ready = self.optimizer, list[Any]()

        def check() -> list[tuple[str, int]]:
            ready.append(check_parallel_load(self.module, opt, state))
            return saved_fp4_streams(self.module, state[_MODEL])

        if self.group is not None:
            # Every rank loads together and has checked its part before any loads (one rank's
            # bad part is the same error on every rank, naming it; under DDP a rank would
            # otherwise load and train on while another refused).
            everyone = agree(
                check, self.group, what="Parallel.load_state_dict", join_timeout=self.join_timeout
            )
            check_same_saved_streams(everyone)
        else:
            check()
        optim_state = ready[0]
        set_model_state_dict(self.module, state[_MODEL])
        if self.sync is None:
            # No sync to bring state recorded at another world size to this one at its
            # first merge (one process): a gradient ledger saved on N ranks would keep steps
            # N times too large. With a sync, its first merge does this.
            for layer in self.module.modules():
                if isinstance(layer, QuantizedLinear) and layer.policy.granularity == "tensor":
                    rescale_grad_ledger(layer, self.world_size, self.loss_normalization)
        if isinstance(opt, OffloadedOptimizer):
            set_optimizer_state_dict(self.module, opt, state[_OPTIMIZER])
        else:
            set_plain_optimizer_state_dict(self.module, opt, optim_state)


def parallelize(
    model: nn.Module,
    ctx: ComputeCtx,
    mesh: DeviceMesh | None = None,
    *,
    strategy: Strategy = "ddp",
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    fp8_filter: ModuleFilter | None = None,
    fp8_all_gather: bool = True,
    shard_units: list[nn.Module] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    accumulate: bool | None = None,
    offload: bool | None = None,
    current_amax: CurrentAmax | None = None,
    loss_normalization: LossNormalization = "per_rank",
    join_timeout: float | None = None,
    **optimizer_kwargs: Any,
) -> Parallel:
    """Set ``model`` up to train under ``ctx`` on every rank of ``mesh`` (default: the whole
    default group; none: one process), in the one right order, and return a ``Parallel``.

    1. fp8 policy: ``convert_to_quantized(model, ctx, module_filter=fp8_filter)``, agreed first.
    2. ``strategy="fsdp"``: the fp8 weights all-gather as fp8 and a 4-bit recipe's
       ``Fp4Linear`` and ``Fp4Experts`` weights in 4 bits (``fp8_all_gather``,
       ``enable_fp4_all_gather``, ``enable_fp4_expert_gather``;
       weights tied to another module, and ``row`` and ``mx`` fp8 weights
       (``gathers_quantized``), gather high precision), then ``fully_shard`` each of
       ``shard_units`` (default: every block of a ``ModuleList``, else every child with
       parameters) and the root, with ``mp_policy`` (default
       ``fsdp_mixed_precision(ctx)``: gather and compute at ``ctx.compute``, reduce-scatter
       gradients at ``ctx.grad``, float inputs cast to ``ctx.compute``; the fp8 weights keep
       their fp8 gather; ``MixedPrecisionPolicy()`` gathers at the parameters' own dtype).
       ``strategy="ddp"``: ``DistributedDataParallel``, whose gradients are all-reduced at
       the parameters' dtype (or by the accumulator, below; docs/distributed.md says why
       not at ``ctx.grad``); weights frozen for serving (their float8 and float4 codes and
       scales) stay out of its broadcasts, listed or not by ``exclude_frozen_from_ddp``.
    3. fp8 policy on many ranks (a 4-bit recipe keeps no amax history: none):
       ``sync_scaling`` on what runs forward
       (``current_amax``, ``loss_normalization`` as there; ``current_amax`` defaults to
       ``"local"`` under DDP, ``"group"`` under FSDP2). It merges every rank's scaling
       state at the end of each backward, so no forward and no ``state_dict()`` issues a
       collective of it. Row, block and mx layers reduce no amax; their statistics are
       merged with the rest. Before anything is wrapped the ranks compare what was
       converted (each fp8 layer's FQN, widths and policy) and every parameter's FQN and
       shape, once: a mismatch is a ``ValueError`` on every rank naming the ranks and the
       first layer that differs. Then rank 0's frozen weights and fp8 scaling state go to
       every rank (neither DDP nor FSDP2 sends them).
    4. The memory policy. The optimizer is an ``OffloadedOptimizer`` over
       ``optimizer_class`` when ``offload`` is true, or by default when the ctx asks for one
       (``ctx.offload`` set, ``ctx.master`` differing from a parameter's dtype, or
       ``ctx.optim_state`` other than ``f32``: packed moments); else
       ``optimizer_class`` itself. ``optimizer_kwargs`` (``lr=...``) go to it (an
       ``OffloadedOptimizer`` also takes its own: ``transfer``, ``seed``, ``compile``; its
       ``sharding`` is parallelize's choice). A gradient
       accumulator is built when ``accumulate`` is true, or by default when the ctx asks
       for one (``ctx.grad`` differing from ``ctx.master``: low-precision gradient sums):
       ``DataParallelGradAccumulator`` under DDP, ``LowPrecGradAccumulator`` in one
       process. FSDP2 reduce-scatters gradients itself and takes none: a ctx that asks for
       one under FSDP2 is a ``ValueError`` unless ``accumulate=False`` says so.

    Mixture-of-experts models (``computectx.nn.MoE``) take part as they are: under DDP the
    3-D expert weights are replicated (an expert no token chose has a zero gradient, so the
    reducer sees every parameter), under FSDP2 they are sharded along their expert dimension
    (a ``block`` fp8 policy gathers them as fp8: ``enable_quantized_expert_gather``), and each
    ``MoE``'s rank-local load counters stay out of DDP's buffer broadcast. ``Parallel.step``
    moves the routers' auxiliary-loss-free biases with the whole batch's load (one
    all-reduce per step), so they stay identical on every rank. A model spread over the
    ranks by ``expert_parallel`` (over this same group) keeps each rank's experts out of
    DDP's all-reduce and FSDP2's sharding and scales their gradients by ``1/world``, as
    DDP averages the rest; it takes a plain optimizer and no accumulator (``ValueError``).

    Everything is checked before the model changes (DDP: a parameter needs a gradient).
    Then: ``out = par.model(x)``, ``loss.backward()``, ``par.step(max_norm)``; checkpoints
    through ``par.state_dict()``. Under FSDP2 a layer frozen after the wrap: ``ValueError``.
    """
    given = locals()  # the keyword arguments, by name: ParallelArgs' fields
    args = ParallelArgs(**{f.name: given[f.name] for f in fields(ParallelArgs)})
    world = world_of(mesh)
    group = mesh.get_group() if mesh is not None else None
    check_setup(model, ctx, args, world, group)
    experts = expert_parameters(model)
    conversion = convert_to_quantized(model, ctx, module_filter=fp8_filter) if ctx.recipe else None
    run, sync, sharded = model, None, strategy == "fsdp" and world > 1
    if world > 1:
        run, mesh, sync = distribute(model, ctx, args, mesh, group, world, experts)
    optimizer = build_optimizer(model, ctx, args, mesh if sharded else None)
    accumulator = build_accumulator(model, run, ctx, args)
    return Parallel(
        model=run,
        module=model,
        optimizer=optimizer,
        accumulator=accumulator,
        sync=sync,
        conversion=conversion,
        world_size=world,
        loss_normalization=loss_normalization,
        expert_params=tuple(experts) if world > 1 else (),
        group=data_parallel_group(group) if world > 1 else None,
        join_timeout=join_timeout,
    )
