"""The per-tensor fp8 linear as an autograd function: three scaled GEMMs, one quantized gradient.

Forward ``Y = X Wᵀ (+ b)`` with ``X`` and ``W`` quantized in the policy's forward format;
backward ``dX = dY W`` and ``dW = dYᵀ X`` with ``dY`` quantized once in the backward format
and shared by both GEMMs (the transposes are views handed to ``ops.tensorwise.scaled_mm``). The
forward saves the fp8 operands and the steps it used together with its plan (policy,
scaling state, backend), so ``loss.backward()`` needs nothing from the region or module
that ran the forward and may run after both are gone. ``tensorwise_linear`` is the entry the
router (``linear.function``) calls with a 2-D input.

Under activation checkpointing the original forward of a checkpointed region remembers the
steps it quantized with, and the region's recomputation during the backward quantizes with
exactly those and records nothing (``computectx.formats.linear.recompute``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import torch
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.utils.checkpoint import checkpoint

from computectx.formats.linear.plan import Fp8LinearPlan, LinearGrads, linear_grads
from computectx.formats.linear.recompute import (
    SAVE_FP8,
    CheckpointSite,
    StepsUsed,
    delayed_quantize_in_compiled_checkpoint,
    selective_modes_set_aside,
    warn_nothing_to_replay,
)
from computectx.formats.linear.weights import QuantizedWeight
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.recipes import DelayedScaling
from computectx.saved import kept_back, offload_kept, refuse_double_backward

__all__ = ["TensorwiseLinearFunction", "tensorwise_linear"]


def tensorwise_linear(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    plan: Fp8LinearPlan,
    site: CheckpointSite | None,
) -> torch.Tensor:
    """The per-tensor fp8 linear on 2-D ``x2`` (``site``: where the call sits with respect
    to activation checkpointing, ``linear.recompute.checkpoint_site``)."""
    if (
        torch.compiler.is_compiling()
        and plan.record
        and isinstance(plan.policy.scaling, DelayedScaling)
        and delayed_quantize_in_compiled_checkpoint(_unsaveable(plan)) == "unsaved"
    ):
        return _saving_the_quantize(x2, weight, bias, plan)
    y: torch.Tensor = TensorwiseLinearFunction.apply(x2, weight, bias, plan, site)  # type: ignore[no-untyped-call]
    return y


def _saving_the_quantize(
    x2: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, plan: Fp8LinearPlan
) -> torch.Tensor:
    """A recording delayed call that dynamo traces inside a checkpointed region without a
    ``context_fn``, checkpointed again under ``checkpoint_context_fn()``.

    AOTAutograd would recompute its quantize in the backward from the ledger the forward
    advanced (pytorch/pytorch#197039). The inner region's policy saves the quantize's
    outputs (the fp8 codes and the step) and recomputes the GEMM, as the user's region
    recomputes the rest: the same as passing ``checkpoint_context_fn()`` to it.
    """

    def call(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        y: torch.Tensor = TensorwiseLinearFunction.apply(x, w, b, plan, None)  # type: ignore[no-untyped-call]
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


class TensorwiseLinearFunction(torch.autograd.Function):
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
        y = tensor_ops.scaled_mm(xq, wq, sx, sw, bias, plan.gemm_dtype, backend=plan.backend)
        # The fp8 operands (1 byte per element) are what the backward GEMMs consume, so
        # they, not the high-precision inputs, are what stays alive until backward.
        # A QuantizedWeight's codes live in a buffer that FSDP2 frees after the forward and
        # gathers again before the backward, writing the step of those codes into the same
        # QuantizedWeight: the backward reads that step then, so codes and step stay a pair.
        # Under linear: fp8 a weight that needs no gradient (frozen, untrained) keeps no X.
        c: Any = ctx
        x_kept = None if plan.save == "fp8" and not c.needs_input_grad[1] else xq
        if plan.save == "offload" and x_kept is not None and not offload_kept(ctx, (x_kept,)):
            x_kept = None  # in host memory (kept_back in the backward)
        ctx.save_for_backward(x_kept, wq, sx, sw if live_step is None else None)  # type: ignore[arg-type]
        c.live_step = live_step
        c.plan = plan
        c.x_dtype = x.dtype
        c.w_dtype = None if weight is None else weight.dtype
        c.b_dtype = None if bias is None else bias.dtype
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> LinearGrads:
        # Under linear: fp8 or offload: refused by name (what is kept is outside the graph).
        refuse_double_backward("linear", ctx.plan.save, fp8_gemm=True)
        return TensorwiseLinearFunction.first_order(ctx, dy)

    @staticmethod
    @once_differentiable
    def first_order(ctx: Any, dy: torch.Tensor) -> LinearGrads:
        xq, wq, sx, sw = ctx.saved_tensors
        xq = kept_back(ctx, (xq,))[0]
        if ctx.live_step is not None:
            sw = ctx.live_step
        plan: Fp8LinearPlan = ctx.plan
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = None
        if need_x or need_w:
            # One quantization of dY serves both GEMMs: its amax pass is paid once and
            # both products see the same rounded gradient.
            bwd = plan.bwd
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
                dx = tensor_ops.scaled_mm(
                    gq, wq.t(), sg, sw, None, plan.gemm_dtype, backend=plan.backend
                )
                dx = dx.to(ctx.x_dtype)
            if need_w:
                # dW[N, K] = dYᵀ[N, M] · X[M, K], kept in float32 until it reaches the
                # weight's dtype: it feeds the optimizer's (master) weights.
                dw = tensor_ops.scaled_mm(
                    gq.t(), xq.t(), sg, sx, None, torch.float32, backend=plan.backend
                ).to(ctx.w_dtype)
        return linear_grads(dx, dw, dy, ctx.b_dtype if need_b else None)


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
    ``QuantizedWeight``'s step (read again in the backward); ``own_w`` says the weight was
    quantized here, from this layer's scaling state.
    """
    fwd = plan.fwd
    scaling = plan.policy.scaling
    state = plan.state
    live_step: torch.Tensor | None = None
    own_w = False
    if replay is not None:
        xq, _ = tensor_ops.quantize_with_step(x, fwd, replay.input_step, backend=plan.backend)
        sx = replay.input_step
    elif plan.record and plan.input_reduce is not None:
        xq, sx = state.input.quantize_sharded(x, fwd, scaling, plan.backend, plan.input_reduce)
    elif plan.record:
        xq, sx = state.input.quantize(
            x, fwd, scaling, plan.backend, plan.quantize, plan.amax_reduce
        )
    else:
        xq, sx = state.input.quantize_unrecorded(x, fwd, scaling, plan.backend, plan.input_reduce)
    if plan.frozen_weight is not None:
        wq, sw = plan.frozen_weight
    elif isinstance(weight, QuantizedWeight):
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
            wq, _ = tensor_ops.quantize_with_step(weight, fwd, sw, backend=plan.backend)
        elif plan.record and plan.weight_reduce is not None:
            wq, sw = state.weight.quantize_sharded(
                weight, fwd, scaling, plan.backend, plan.weight_reduce
            )
        elif plan.record:
            wq, sw = state.weight.quantize(weight, fwd, scaling, plan.backend, plan.quantize)
        else:
            wq, sw = state.weight.quantize_unrecorded(
                weight, fwd, scaling, plan.backend, plan.weight_reduce
            )
    return xq, sx, wq, sw, live_step, own_w
