"""``OffloadedOptimizer``: any ``torch.optim`` optimizer stepping master weights on ``ctx.offload``.

The wrapper is a real ``torch.optim.Optimizer``, built by ``Optimizer.__init__``, but holds
no optimizer state of its own: ``param_groups``, ``state`` and ``defaults`` are the very
objects of the inner (master) optimizer, so LR schedulers write the learning rate the
master step reads, and ``state_dict`` describes exactly one optimizer.

This module puts one step together; each part is a module of its own:
``computectx.memory.optim._masters`` (parameter groups, master weights, copy-back),
``computectx.memory.optim._grad_ingest`` (gradients onto the masters),
``computectx.memory.optim._grad_health`` (the clip norm and the non-finite verdict) and
``computectx.memory.optim.checkpoint`` (what a checkpoint holds, and its checks); what it
shares with ``CompactOptimizer`` (the inner optimizer's objects, the stepper, the skip, the
load) is ``computectx.memory.optim._wrapper``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from computectx._checks import check_max_norm
from computectx.ctx import ComputeCtx
from computectx.memory._transfer import Transfer, check_transfer
from computectx.memory.accumulator import LowPrecGradAccumulator
from computectx.memory.optim._grad_ingest import GradIngest
from computectx.memory.optim._masters import MasterWeights, Sharding, check_sharding
from computectx.memory.optim._overlap import (
    NEAR_BELOW,
    CudaLanes,
    HostLanes,
    Lanes,
    Overlap,
)
from computectx.memory.optim._wrapper import InnerWrapper
from computectx.memory.optim.checkpoint import MASTER_WEIGHTS, check_saved_masters, state_tensors

__all__ = ["MASTER_WEIGHTS", "OffloadedOptimizer", "Sharding", "state_tensors"]


class OffloadedOptimizer(InnerWrapper):
    """Step master weights (``ctx.master``) and optimizer state on ``ctx.offload_device``.

    The compute parameters stay where they are; each gets a master copy at ``ctx.master``
    on the offload device, and ``optimizer_class(master_groups, **optimizer_kwargs)`` steps
    those. A parameter that already is its master (contiguous, ``ctx.master``'s dtype, on the
    offload device, unsharded, not staged) shares its storage with it: the step writes it
    directly and nothing is copied back. One step is: ``ingest_grads`` (move gradients from
    an accumulator and/or ``param.grad`` onto the masters), optional ``clip_grad_norm``,
    ``step`` (step the masters, copy them back into the compute parameters at their dtype),
    ``zero_grad``.
    ``step`` ingests any ``param.grad`` left behind, so ``loss.backward(); opt.step()``
    works as with any torch optimizer. Gradients ingested between two steps add up; the
    first one ingested for a master after a step replaces the gradient that step applied
    (unless ``zero_grad`` cleared it), so the master gradient a step applies is what torch's
    ``param.grad`` would be when ``param.grad`` is assigned each step without ``zero_grad``
    (``torch.autograd.grad`` style). One use differs from torch: ``loss.backward()`` over
    several steps with no ``zero_grad`` sums every step's gradient in torch's ``param.grad``
    (kept after its step), whereas here ``param.grad`` moved to the master at the step, so
    each step applies the gradients since the step before.

    Non-finite gradients are never applied, and nothing else is needed: a ``step`` whose
    gradients hold an inf or NaN (or whose norm ``clip_grad_norm`` measured as inf or NaN)
    drops them, changes no weight and no optimizer state, warns (``RuntimeWarning``), sets
    ``last_step_skipped`` and counts itself in ``skipped_steps``. No decision carries over
    to a later step. The check reuses the norm of ``clip_grad_norm`` when the gradients are
    unchanged since it was measured; otherwise it is one summing pass over the master
    gradients at the step, which waits for the device when they live on a GPU.

    ``overlap`` (keyword, ``False`` by default; refused as ``True`` with a ``sharding``)
    overlaps the step with the backward, for a model on a CUDA device with its masters on
    the host: each gradient is copied down to a pinned host buffer on a side stream in its
    post-accumulate hook, and ``step`` steps each master as soon as its copy lands, queueing
    its weight's upload at once; parameters under 4096 elements keep their masters and state
    on their CUDA device and are stepped there (``computectx.memory.optim._overlap``; the same
    result as the serial step). It changes what the loop sees: the hook takes each gradient,
    so ``param.grad`` is ``None`` after the backward; clip with ``clip_grad_norm`` (not
    ``torch.nn.utils.clip_grad_norm_`` over the model's parameters), and run no collective
    or hook of your own on ``param.grad``.

    ``transfer`` (keyword, a ``Transfer``) picks how gradients and weights cross devices:
    ``"auto"`` (default) stages them through one reused pinned host buffer per parameter
    exactly for CUDA <-> CPU, ``"blocking"`` always copies directly, ``"staged"`` always
    stages (also between tensors on one device). ``state_dict`` is the inner optimizer's
    plus the master weights under ``"master_weights"``, so a resume is exact even when the
    compute copy is lower precision. LBFGS is rejected: it re-evaluates its closure against
    the tensors it steps, which here are the masters, not the model.

    ``ctx.optim_state`` says how optimizer state is stored (``"f32"``: torch's own state,
    the step above exactly). A compact format (bf16, int8, fp8, int4) or a master below
    float32 (``ctx.master`` bf16/f16) steps the masters one at a time through
    ``computectx.memory.optim.stepper.Stepper``: state decoded into one reused float32 scratch
    buffer (``memory_report``'s ``"scratch"``), torch's own update (or the fused Adam(W)
    update: ``compile=None`` or ``True`` runs it on the CPU as the native kernel, on CUDA
    through ``torch.compile``; ``False`` runs its torch-ops twin eagerly; docs/memory.md,
    "The compact step's implementation"), state encoded back, masters below float32
    written back with stochastic rounding drawn from generators seeded by ``seed`` (the
    same on every rank, so data-parallel masters stay identical). An optimizer class whose
    state is not parameter-shaped (Adafactor, SparseAdam) is then refused at construction.
    ``state_dict`` adds ``"optim_state"`` and, for masters below float32,
    ``"master_rounding"``; packed state sits under ``"name.part"`` keys.

    ``sharding`` (keyword, a ``Sharding``) is for parameters split across ranks (FSDP2's
    DTensors): each master is then this rank's local shard as a plain tensor on the offload
    device, optimizer state is per shard, ``clip_grad_norm`` measures the global norm with
    one all-reduce, and the skip decision for non-finite gradients is taken by all ranks
    together. ``computectx.distributed.ShardedParams(mesh)`` provides it; see
    docs/distributed.md. Under DDP no sharding is needed: the gradients the masters receive
    are already reduced, so every rank measures the same global norm.

    Weights changed outside the optimizer between steps (``model.load_state_dict``,
    ``load_weights``, an in-place edit under ``no_grad``) are adopted: ``step`` and
    ``state_dict`` first copy every such compute parameter into its master, so the next
    update starts from the new weights, as a plain torch optimizer's would, instead of
    overwriting them with the old master. Optimizer state (moments) is kept, as torch keeps it.
    A write that leaves a parameter exactly as the master's copy-back has it is no edit and
    keeps the master, so a resume is exact whichever of ``model.load_state_dict`` and this
    optimizer's ``load_state_dict`` runs first.
    """

    _who = "OffloadedOptimizer"

    def __init__(
        self,
        params_or_groups: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        ctx: ComputeCtx,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        transfer: Transfer = "auto",
        sharding: Sharding | None = None,
        seed: int = 0,
        compile: bool | None = None,
        overlap: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        self._check_args(ctx, optimizer_class, seed, compile)
        weights = MasterWeights(ctx, check_transfer(transfer), check_sharding(sharding))
        check_overlap(overlap, sharding)
        self._overlap: Overlap | None = None
        if overlap:
            weights.near_below = NEAR_BELOW
        super().__init__(
            params_or_groups, weights, optimizer_class, optimizer_kwargs, seed=seed, compile=compile
        )
        self._ingest = GradIngest(weights)
        if overlap:
            # Built after the first groups were added (``_watch``), which it then hooks.
            self._overlap = Overlap(weights, self._ingest, _lanes)
            self._overlap.watch(weights.compute)

    @classmethod
    def _refuse(cls, optimizer_class: type[torch.optim.Optimizer]) -> None:
        if issubclass(optimizer_class, OffloadedOptimizer):
            raise TypeError("optimizer_class cannot itself be an OffloadedOptimizer")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS re-evaluates its closure several times per step against the tensors "
                "it optimizes, which here are the offloaded master copies, not the model; "
                "use LBFGS directly on the model's parameters"
            )

    @property
    def overlap(self) -> bool:
        """Whether the step overlaps the backward (the ``overlap`` constructor option)."""
        return self._overlap is not None

    @property
    def transfer(self) -> Transfer:
        """How gradients and weights cross devices (the ``transfer`` constructor option)."""
        return self._weights.transfer

    @property
    def sharding(self) -> Sharding | None:
        """How the parameters are split across ranks (``None``: each rank holds them whole)."""
        return self._weights.sharding

    @property
    def compute_params(self) -> tuple[torch.Tensor, ...]:
        """The model's parameters, in param-group order."""
        return tuple(self._weights.compute)

    @property
    def master_params(self) -> tuple[torch.Tensor, ...]:
        """The master copies, aligned with ``compute_params``."""
        return tuple(self._weights.master)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The master copy of compute parameter ``param``."""
        return self._weights.master_of(param)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of compute parameters; their masters join the inner optimizer.

        Options the group leaves out take the inner optimizer's defaults. Everything is
        checked before anything is added.
        """
        where = self._where(param_group)
        compute = self._weights.check_group(dict(param_group), where)
        masters = self._weights.make(compute)
        self._join({**param_group, "params": masters}, compute, masters)

    # ----- gradients ------------------------------------------------------------------

    def ingest_grads(self, accumulator: LowPrecGradAccumulator | None = None) -> None:
        """Move gradients onto the master copies (adding to any ingested since the last
        step; replacing a gradient the last step applied, unless ``zero_grad`` cleared it).

        From ``accumulator`` (its sums are handed over and emptied) when given, then from
        every compute ``param.grad`` (which becomes ``None``). Staged copies (see
        ``transfer``) are all issued before any is waited on. Overlapped (``overlap``), the
        gradients the hooks sent down land first, so that the masters hold every gradient
        (what ``torch.amp.GradScaler.unscale_`` reads); the step then takes the serial path.
        """
        overlap = self._overlap
        if overlap is not None and overlap.has_pending():
            overlap.land_all()
            self._health.forget()
        if accumulator is not None and self._ingest.from_accumulator(accumulator):
            self._health.forget()
        self._take_param_grads()

    def _take_param_grads(self) -> None:
        if self._ingest.from_param_grads():
            self._health.forget()

    def _watch(self, compute: list[torch.Tensor]) -> None:
        if self._overlap is not None:  # a group added after construction
            self._overlap.watch(compute)

    def _fast(self) -> bool:
        """Whether this step lands and steps one master at a time (``Overlap.fast``; torch's
        own step: the stepper steps all masters at once)."""
        return self._overlap is not None and self._stepper is None and self._overlap.fast()

    def _gather(self) -> None:
        """Ingest the gradients left in ``param.grad`` (``clip_grad_norm`` and ``step``),
        landing every download first unless the step takes them one at a time."""
        overlap = self._overlap
        if overlap is not None and overlap.has_pending() and not self._fast():
            overlap.land_all()
        self._take_param_grads()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients to total norm ``max_norm``; return the norm before.

        ``math.inf`` measures only. The master gradients are clipped, after the gradients left
        in ``param.grad`` are ingested; with a ``sharding`` the norm is the global one over
        every rank's shards (one all-reduce). Overlapped (``overlap``), the 2-norm is taken
        from the norms the hooks took on the device (one sync) and each gradient is scaled
        as it lands. A non-finite norm (an inf or NaN gradient) is returned as is, and the
        next ``step`` skips these gradients without being told; that ``step`` decides by
        this norm, without looking at them again.
        """
        overlap = self._overlap
        if overlap is not None and self._fast() and float(norm_type) == 2.0 and not overlap.scaled:
            check_max_norm(max_norm)
            return overlap.clip(float(max_norm))
        if overlap is not None:
            overlap.land_all()
        return super().clip_grad_norm(max_norm, norm_type)

    # ----- the step -------------------------------------------------------------------

    def _applicable(self) -> bool:
        overlap = self._overlap
        if overlap is not None and self._fast():
            verdict = overlap.verdict()
            if verdict is not None:
                return verdict
            overlap.land_all()  # the host tells them apart exactly
        return super()._applicable()

    def _stepped(self) -> None:
        super()._stepped()
        if self._overlap is not None:
            self._overlap.stepped()

    def _update(self) -> None:
        overlap = self._overlap
        if overlap is None or not overlap.has_pending():
            super()._update()
            return
        # Each master stepped alone as its gradient lands, its weight's upload queued at
        # once: the inner optimizer sees one parameter in its group, none in the others.
        inner = self._built()
        groups = inner.param_groups
        saved = [group["params"] for group in groups]
        where = {id(p): k for k, params in enumerate(saved) for p in params}

        def step_one(i: int) -> None:
            master = self._weights.master[i]
            k = where[id(master)]
            try:
                for j, group in enumerate(groups):
                    group["params"] = [master] if j == k else []
                inner.step()
            finally:
                for group, params in zip(groups, saved, strict=True):
                    group["params"] = params
            self._weights.copy_one(i)

        overlap.step_each(step_one)
        self._uploaded = True

    def _before_update(self) -> None:
        self._weights.adopt_outside_edits()
        self._uploaded = False
        pending = self._overlap is not None and self._overlap.has_pending()
        if not pending and all(mp.grad is None for mp in self._weights.master):
            warnings.warn(
                "OffloadedOptimizer.step() found no gradient on any parameter; if a "
                "LowPrecGradAccumulator holds them, call ingest_grads(accumulator) first",
                RuntimeWarning,
                stacklevel=4,
            )

    def _after_update(self) -> None:
        self._ingest.mark_applied()
        if not self._uploaded:
            self._weights.copy_to_compute()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the master gradients and any ``param.grad`` on the compute parameters (and,
        overlapped, the gradients on their way down).

        ``set_to_none`` is for the compute parameters' gradients (zeroed in place when
        ``False``, as torch does); the master gradients are always set to ``None``: the next
        ingest puts the gradient there as it is. Zeros left on the masters would pass for
        gradients: ``torch.amp.GradScaler.unscale_`` reads the masters' gradients, and a loop
        that forgot ``ingest_grads`` would have its zeros unscaled and checked, and the scaled
        gradients applied at the step, instead of the scaler's error for no gradient."""
        super().zero_grad(True)
        self._ingest.clear_applied()
        if self._overlap is not None:
            self._overlap.forget()
        for cp in self._weights.compute:
            if cp.grad is None:
                continue
            if set_to_none:
                cp.grad = None
            else:
                cp.grad.detach_()
                cp.grad.zero_()

    # ----- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"master_weights"`` (index -> tensor); with
        the stepper also ``"optim_state"`` and (masters below float32) ``"master_rounding"``."""
        self._weights.adopt_outside_edits()
        sd = dict(super().state_dict())
        sd[MASTER_WEIGHTS] = dict(enumerate(self._weights.master))
        return self._with_extras(sd)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore state, groups and master weights, then refresh the compute parameters.

        Without ``"master_weights"`` (e.g. a plain torch optimizer's state dict) the
        masters are rebuilt from the current compute parameters. Everything is validated
        before anything changes: that the state is of the master optimizer's class
        (``classes.check_optimizer_class``, ``ValueError`` naming both), the master
        weights' count, shapes and dtypes, and that those of trainable parameters are finite
        (``checkpoint.check_saved_masters``), packed state parts (``ValueError`` naming
        the key) and the rounding generators. State saved under another ``optim_state`` is
        converted, with a ``UserWarning`` naming both formats and the bound; a plain float
        tensor of the parameter's shape (a DCP or plain torch checkpoint) is encoded.
        """
        sd = self._checked(state_dict)
        saved = sd.pop(MASTER_WEIGHTS, None)
        masters = (
            None
            if saved is None
            else check_saved_masters(saved, self._weights.master, self._weights.ctx.master)
        )
        self._load(sd)
        self._weights.load(masters)

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Run every check ``load_state_dict`` runs, loading nothing: the error it would
        raise, or ``None`` when it would load (``Parallel.load_state_dict`` checks the
        optimizer part before the model loads, the ranks agreeing under FSDP2)."""
        sd = self._checked(state_dict)
        saved = sd.pop(MASTER_WEIGHTS, None)
        if saved is not None:
            check_saved_masters(saved, self._weights.master, self._weights.ctx.master)
        self._plan(sd)

    def _repr_fields(self) -> str:
        return f"master={self.ctx.master}, device={self.ctx.offload_device}"

    # ----- accounting -----------------------------------------------------------------

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor this optimizer holds, with its role for ``memory_report``.

        ``("master", w)`` and, while it exists, ``("grads", w.grad)`` per master weight;
        ``("optimizer_state", t)`` per tensor in the inner optimizer's state; and
        ``("staging", buffer)`` per staging buffer; ``("scratch", buffer)`` per scratch
        buffer of the stepper. The compute parameters are the model's and are not included.
        """
        for mp in self._weights.master:
            yield "master", mp
            if mp.grad is not None:
                yield "grads", mp.grad
        yield from self._state_tensors()
        downloads = [] if self._overlap is None else self._overlap.buffers()
        for buffer in (
            *self._ingest.staging_buffers(),
            *self._weights.staging_buffers(),
            *downloads,
        ):
            yield "staging", buffer
        yield from self._scratch_tensors()


def check_overlap(overlap: object, sharding: Sharding | None) -> None:
    """``TypeError`` unless ``overlap`` is ``True`` or ``False``; ``ValueError`` for
    ``overlap=True`` with a ``sharding``, which the overlapped step does not take yet."""
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if overlap and sharding is not None:
        raise ValueError(
            "overlap=True does not compose with a sharding yet: the overlapped step takes "
            "each whole gradient in a hook during the backward, while a sharded gradient "
            "(FSDP2) is reduce-scattered after it; pass overlap=False (the default)"
        )


def _lanes(device: torch.device) -> Lanes:
    """A side stream for a CUDA device; the CPU's stand-in otherwise."""
    return CudaLanes(device) if device.type == "cuda" else HostLanes()
