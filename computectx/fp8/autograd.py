"""The fp8 linear as an autograd function: three scaled GEMMs sharing one quantized gradient.

Forward ``Y = X Wᵀ (+ b)`` with ``X`` and ``W`` quantized in the policy's forward format;
backward ``dX = dY W`` and ``dW = dYᵀ X`` with ``dY`` quantized once in the backward format
and shared by both GEMMs (the transposes are views handed to ``ops.scaled_mm``). The
forward saves the fp8 operands and the steps it used together with its plan (policy,
scaling state, backend), so ``loss.backward()`` needs nothing from the region or module
that ran the forward and may run after both are gone.

Under activation checkpointing the original forward of a checkpointed region remembers the
steps it quantized with, and the region's recomputation during the backward quantizes with
exactly those and records nothing (``computectx.fp8.recompute``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.utils.checkpoint import checkpoint

from computectx.dtypes import DType
from computectx.fp8 import ops, reference
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.granular_linear import granular_linear
from computectx.fp8.inline import QuantizeImpl
from computectx.fp8.quantized import Fp8Weight
from computectx.fp8.recompute import (
    SAVE_FP8,
    CheckpointSite,
    StepsUsed,
    checkpoint_site,
    delayed_quantize_in_compiled_checkpoint,
    selective_modes_set_aside,
    warn_nothing_to_replay,
)
from computectx.fp8.scaling import AmaxReduce, Fp8ScalingState
from computectx.recipes import DelayedScaling, Fp8Policy

__all__ = [
    "ACTIVATION_DTYPES",
    "DTensorLinear",
    "Fp8LinearPlan",
    "autocast_dtype",
    "fp8_linear",
    "gemm_dtype_for",
    "is_dtensor",
    "set_dtensor_linear",
]

ACTIVATION_DTYPES = ops.QUANTIZABLE_DTYPES
"""Input and weight dtypes an fp8 linear quantizes from."""


def gemm_dtype_for(compute: DType) -> torch.dtype:
    """Dtype the GEMM epilogue writes for a ctx's compute dtype.

    BF16 and F16 activations come out of the epilogue at that dtype (one rounding of the
    float32 accumulator); F32/F64 policies get float32, the widest the kernels write.
    """
    if compute is DType.BF16:
        return torch.bfloat16
    if compute is DType.F16:
        return torch.float16
    return torch.float32


@dataclass(frozen=True, eq=False)
class Fp8LinearPlan:
    """Everything one fp8 linear call needs besides its tensors.

    ``frozen_weight`` is ``(data_fp8, step)`` for a weight quantized once for serving;
    the weight ledger is then left alone. ``quantize`` says how a compiled call quantizes
    (``computectx.fp8.inline``; eager calls always run the operators). ``amax_reduce``
    makes dynamic scaling of the input and the output gradient use a group's amax
    (``OperandScaling.quantize``). ``record=False`` is a call outside training: every
    operand is quantized from the state as it is and nothing is written
    (``OperandScaling.quantize_unrecorded``); ``amax_reduce`` is then ``None``.

    ``input_reduce``, ``weight_reduce`` and ``grad_reduce`` are set for operands that are
    shards of a larger tensor (tensor parallelism: ``computectx.distributed`` computes a
    linear of DTensors on the local shards): each turns its operand's amax into the whole
    tensor's (including ``amax_reduce``'s group when that is set), every call quantizes
    that operand with the whole tensor's step and records the whole amax
    (``OperandScaling.quantize_sharded``), and a call outside training uses it where it
    needs the current amax.
    """

    policy: Fp8Policy
    state: Fp8ScalingState
    backend: Fp8Backend
    gemm_dtype: torch.dtype
    frozen_weight: tuple[torch.Tensor, torch.Tensor] | None = None
    quantize: QuantizeImpl = "op"
    amax_reduce: AmaxReduce | None = None
    record: bool = True
    input_reduce: AmaxReduce | None = None
    weight_reduce: AmaxReduce | None = None
    grad_reduce: AmaxReduce | None = None

    lockstep: bool = False
    """The layer is kept in step with other ranks and this call records: an empty input
    still goes through the recording path, so its history moves with theirs."""

    def reduces(self) -> bool:
        """Whether any quantize of this call reduces its amax with other ranks."""
        return any(
            r is not None
            for r in (self.amax_reduce, self.input_reduce, self.weight_reduce, self.grad_reduce)
        )


DTensorLinear = Callable[
    [torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", Fp8LinearPlan], torch.Tensor
]
"""Computes ``fp8_linear`` of operands some of which are DTensors (the seam
``computectx.distributed`` fills: it runs the call on the local shards)."""

_dtensor_linear: list[DTensorLinear] = []


def set_dtensor_linear(fn: DTensorLinear) -> None:
    """Make ``fn`` the handler of fp8 linears whose operands include a DTensor."""
    _dtensor_linear[:] = [fn]


def is_dtensor(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (no import for plain tensors)."""
    if t is None or type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    plan: Fp8LinearPlan,
) -> torch.Tensor:
    """``x Wᵀ + b`` in fp8 for ``x`` of any leading shape; the result has ``x``'s dtype, or
    under ``torch.autocast`` for ``x``'s device the autocast dtype, as ``nn.Linear``'s has.

    ``weight`` is the high-precision weight (``None`` when ``plan.frozen_weight`` holds a
    pre-quantized one). Inputs are assumed checked by the caller (dtype in
    ``ACTIVATION_DTYPES``, matching ``in_features``).
    """
    lowered = autocast_dtype(x)
    if lowered is not None:
        # As autocast runs a linear: the input at the autocast dtype (what is quantized, and
        # the output's dtype); the weight stays as it is (it is quantized from its own
        # dtype). Autocast is then off inside, so it cannot also lower the fp8 path's
        # float32 work (the reference GEMM's matmul, the amaxes).
        with torch.autocast(x.device.type, enabled=False):
            return fp8_linear(x.to(lowered), weight, bias, plan)
    if is_dtensor(x) or is_dtensor(weight) or is_dtensor(bias):
        # Tensor parallelism (or any DTensor activations): the handler runs this call on
        # the local shards, each amax the whole tensor's.
        if not _dtensor_linear:
            raise TypeError(
                "an fp8 linear got DTensor operands (tensor parallelism); import "
                "computectx.distributed, which computes it on the local shards"
            )
        return _dtensor_linear[0](x, weight, bias, plan)
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if plan.policy.granularity != "tensor":  # granular_linear: dynamic, no history
        if x2.shape[0] == 0:
            return _empty_linear(x, weight, bias, plan)
        y_fine = granular_linear(x2, weight, bias, plan)
        out_fine: torch.Tensor = torch.ops.aten._unsafe_view(y_fine, (*lead, y_fine.shape[-1]))
        return out_fine
    site = checkpoint_site(plan.record)
    if x2.shape[0] == 0:
        checkpointed = site is not None and site.kind != "backward"
        if plan.reduces() or plan.lockstep:
            # No rows on this rank, but the group's other ranks quantize theirs: this rank
            # takes part in every reduction they issue (forward and backward) and records
            # what they record, through the same path, so its history moves in step with
            # theirs (an amax of 0 is MAX's identity).
            pass
        elif checkpointed:
            # A checkpointed region's call and its recomputation must take the same path
            # (the recomputation cannot know whether the original was armed): the function,
            # recording nothing here, as the matmul below would not.
            plan = replace(plan, record=False)
        else:
            # No rows: nothing to measure, and an empty amax (0) must not enter the
            # history. A matmul, not F.linear, so an open region's dispatch does not see it.
            return _empty_linear(x, weight, bias, plan)
        # On the pure-torch twins: a kernel launch over no elements is not worth a case.
        plan = replace(plan, backend=Fp8Backend.REFERENCE)
    y2: torch.Tensor
    if (
        torch.compiler.is_compiling()
        and plan.record
        and isinstance(plan.policy.scaling, DelayedScaling)
        and delayed_quantize_in_compiled_checkpoint(_unsaveable(plan)) == "unsaved"
    ):
        y2 = _saving_the_quantize(x2, weight, bias, plan)
    else:
        y2 = _Fp8LinearFunction.apply(x2, weight, bias, plan, site)  # type: ignore[no-untyped-call]
    # Back to x's leading shape as a new tensor, not a view of the 2-D product (what
    # torch.matmul does for N-D inputs): wrappers that hook module outputs (FSDP2's
    # pre-backward hook) warn that an in-place op on a view would drop their hook.
    out: torch.Tensor = torch.ops.aten._unsafe_view(y2, (*lead, y2.shape[-1]))
    return out


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` would run a linear of ``x`` at, when it is on for ``x``'s
    device and that dtype is not ``x``'s; else ``None``."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype != x.dtype and dtype in ACTIVATION_DTYPES else None


def _empty_linear(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, plan: Fp8LinearPlan
) -> torch.Tensor:
    # No rows: nothing to measure, and an empty amax (0) must not enter the history. A
    # matmul, not F.linear, so an open region's dispatch does not see it.
    w = weight if weight is not None else _dequantized(plan, x.dtype)
    y = x.matmul(w.to(x.dtype).t())
    return y if bias is None else y + bias.to(x.dtype)


def _saving_the_quantize(
    x2: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, plan: Fp8LinearPlan
) -> torch.Tensor:
    """A recording delayed call that dynamo traces inside a checkpointed region without a
    ``context_fn``, checkpointed again under ``fp8_checkpoint_context_fn()``.

    AOTAutograd would recompute its quantize in the backward from the ledger the forward
    advanced (pytorch/pytorch#197039). The inner region's policy saves the quantize's
    outputs (the fp8 codes and the step) and recomputes the GEMM, as the user's region
    recomputes the rest: the same as passing ``fp8_checkpoint_context_fn()`` to it.
    """

    def call(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        y: torch.Tensor = _Fp8LinearFunction.apply(x, w, b, plan, None)  # type: ignore[no-untyped-call]
        return y

    out: torch.Tensor = checkpoint(call, x2, weight, bias, use_reentrant=False, context_fn=SAVE_FP8)
    return out


def _unsaveable(plan: Fp8LinearPlan) -> Literal["", "inline", "sharded"]:
    # Quantizes that no checkpointing policy can single out for saving (recompute.py).
    if plan.quantize != "op":
        return "inline"
    if plan.input_reduce is not None or plan.weight_reduce is not None:
        return "sharded"
    return ""


def _dequantized(plan: Fp8LinearPlan, dtype: torch.dtype) -> torch.Tensor:
    if plan.frozen_weight is None:
        raise ValueError("an fp8 linear needs a weight or a frozen (pre-quantized) weight")
    data, step = plan.frozen_weight
    return reference.dequantize(data, step, dtype)


class _Fp8LinearFunction(torch.autograd.Function):
    """``Y = X Wᵀ + b`` on 2-D ``X``; see the module docstring."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        plan: Fp8LinearPlan,
        site: CheckpointSite | None,
    ) -> torch.Tensor:
        if site is None:
            xq, sx, wq, sw, live_step, own_w = _quantize_operands(x, weight, plan, None)
        else:
            replay = site.recall(plan.state) if site.recomputing else None
            if site.recomputing and replay is None and plan.record:
                warn_nothing_to_replay()
            # A recomputed call records nothing; the one it replays recorded already.
            quantize_plan = plan if not site.recomputing else replace(plan, record=False)
            with selective_modes_set_aside():
                xq, sx, wq, sw, live_step, own_w = _quantize_operands(
                    x, weight, quantize_plan, replay
                )
            if replay is not None:
                # The backward of a recomputed call (reentrant checkpointing runs that one)
                # quantizes the output gradient as the original call's plan said.
                plan = replace(plan, record=replay.record, amax_reduce=replay.amax_reduce)
            elif not site.recomputing:
                site.remember(
                    StepsUsed(
                        state=plan.state,
                        input_step=sx,
                        weight_step=sw if own_w else None,
                        record=plan.record,
                        amax_reduce=plan.amax_reduce,
                    )
                )
        y = ops.scaled_mm(xq, wq, sx, sw, bias, plan.gemm_dtype, backend=plan.backend)
        # The fp8 operands (1 byte per element) are what the backward GEMMs consume, so
        # they, not the high-precision inputs, are what stays alive until backward.
        # An Fp8Weight's codes live in a buffer that FSDP2 frees after the forward and
        # gathers again before the backward, writing the step of those codes into the same
        # Fp8Weight: the backward reads that step then, so codes and step stay a pair.
        ctx.save_for_backward(xq, wq, sx, sw if live_step is None else None)  # type: ignore[arg-type]
        c: Any = ctx
        c.live_step = live_step
        c.plan = plan
        c.x_dtype = x.dtype
        c.w_dtype = None if weight is None else weight.dtype
        c.b_dtype = None if bias is None else bias.dtype
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        xq, wq, sx, sw = ctx.saved_tensors
        if ctx.live_step is not None:
            sw = ctx.live_step
        plan: Fp8LinearPlan = ctx.plan
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if need_x or need_w:
            # One quantization of dY serves both GEMMs: its amax pass is paid once and
            # both products see the same rounded gradient.
            bwd = plan.policy.format.backward
            grad = plan.state.grad
            if plan.record and plan.grad_reduce is not None:
                gq, sg = grad.quantize_sharded(
                    dy, bwd, plan.policy.scaling, plan.backend, plan.grad_reduce
                )
            elif plan.record:
                gq, sg = grad.quantize(
                    dy, bwd, plan.policy.scaling, plan.backend, plan.quantize, plan.amax_reduce
                )
            else:
                gq, sg = grad.quantize_unrecorded(
                    dy, bwd, plan.policy.scaling, plan.backend, plan.grad_reduce
                )
            if need_x:
                # dX[M, K] = dY[M, N] · W[N, K]; scaled_mm wants b as [K, N]: W's transpose.
                dx = ops.scaled_mm(gq, wq.t(), sg, sw, None, plan.gemm_dtype, backend=plan.backend)
                dx = dx.to(ctx.x_dtype)
            if need_w:
                # dW[N, K] = dYᵀ[N, M] · X[M, K], kept in float32 until it reaches the
                # weight's dtype: it feeds the optimizer's (master) weights.
                dw = ops.scaled_mm(
                    gq.t(), xq.t(), sg, sx, None, torch.float32, backend=plan.backend
                ).to(ctx.w_dtype)
        if need_b:
            # The bias never goes through fp8: its gradient sums the unquantized dY in float32.
            db = dy.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None


def _quantize_operands(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    plan: Fp8LinearPlan,
    replay: StepsUsed | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """``(xq, sx, wq, sw, live_step, own_w)``: the forward's fp8 operands and their steps.

    ``replay`` (a recomputed call under activation checkpointing) gives the steps the
    original call used: both operands are quantized with them and nothing is recorded.
    Otherwise ``plan.record`` says whether the quantizes record. ``live_step`` is an
    ``Fp8Weight``'s step (read again in the backward); ``own_w`` says the weight was
    quantized here, from this layer's scaling state.
    """
    fwd = plan.policy.format.forward
    scaling = plan.policy.scaling
    live_step: torch.Tensor | None = None
    own_w = False
    if replay is not None:
        xq, _ = ops.quantize_with_step(x, fwd, replay.input_step, backend=plan.backend)
        sx = replay.input_step
    elif plan.record and plan.input_reduce is not None:
        xq, sx = plan.state.input.quantize_sharded(x, fwd, scaling, plan.backend, plan.input_reduce)
    elif plan.record:
        xq, sx = plan.state.input.quantize(
            x, fwd, scaling, plan.backend, plan.quantize, plan.amax_reduce
        )
    else:
        xq, sx = plan.state.input.quantize_unrecorded(
            x, fwd, scaling, plan.backend, plan.input_reduce
        )
    if plan.frozen_weight is not None:
        wq, sw = plan.frozen_weight
    elif isinstance(weight, Fp8Weight):
        # Quantized before it got here (FSDP2's fp8 all-gather): its codes and step are
        # used as they are, and its ledger was advanced where it was quantized.
        wq, sw = weight.fp8_data, weight.fp8_step
        live_step = sw
    elif weight is None:
        raise ValueError("an fp8 linear needs a weight or a frozen (pre-quantized) weight")
    else:
        own_w = True
        if replay is not None and replay.weight_step is not None:
            sw = replay.weight_step
            wq, _ = ops.quantize_with_step(weight, fwd, sw, backend=plan.backend)
        elif plan.record and plan.weight_reduce is not None:
            wq, sw = plan.state.weight.quantize_sharded(
                weight, fwd, scaling, plan.backend, plan.weight_reduce
            )
        elif plan.record:
            wq, sw = plan.state.weight.quantize(weight, fwd, scaling, plan.backend, plan.quantize)
        else:
            wq, sw = plan.state.weight.quantize_unrecorded(
                weight, fwd, scaling, plan.backend, plan.weight_reduce
            )
    return xq, sx, wq, sw, live_step, own_w
