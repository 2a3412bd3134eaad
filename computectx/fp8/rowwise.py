"""The row-wise fp8 linear (policy granularity ``row``): one step per row of every operand.

Every GEMM operand is quantized row-wise *along its contraction dimension* from high
precision, dynamically (``fp8_quantize``'s ``row`` twin or kernel, power-of-two steps unless
the policy says ``no_pow2``); blocks of one row do not transpose, so an operand that a
backward GEMM contracts along its other axis is quantized again from high precision along
that axis (issue 16's rule):

=========================  ==========================  ==============================
GEMM                       A (rows, contraction)       B (rows, contraction)
=========================  ==========================  ==============================
forward ``Y = X Wᵀ``       ``X`` rows, along K         ``W`` rows (output features), K
dgrad ``dX = dY W``        ``dY`` rows, along N        ``Wᵀ`` rows (W's columns), N
wgrad ``dW = dYᵀ X``       ``dYᵀ`` rows, along M       ``Xᵀ`` rows (X's columns), M
=========================  ==========================  ==============================

With ``gw_hp`` (torchao's ``ROWWISE_WITH_GW_HP``) the wgrad is ``dYᵀ X`` in float32 from the
high-precision ``dY`` and ``X``. The forward therefore keeps ``X`` and ``W`` in high
precision for the backward (not their fp8 codes, as the per-tensor path does).

The GEMM (``reference.scaled_mm`` with per-row steps) is the reference scaled GEMM: the fp8
codes widen to float32 exactly and their products are exact, the sum is accumulated in
float32 and multiplied once by ``step_a[i] * step_b[j]`` (one rounding, none for powers of
two), the bias added in float32, and the result rounded once to the output dtype; the a-priori
bound of ``reference.scaled_mm_error_bound`` holds elementwise with ``s = step_a[i] *
step_b[j]`` (``reference.scaled_mm_error_bound``).

Ledgers: row-wise scaling is dynamic and keeps no history. In training each operand's
ledger records, for statistics only, the largest row amax of the call (the tensor's amax)
and the largest row step (forward operands: ``X`` in ``input``, ``W`` in ``weight``; the
backward's row-wise ``dY`` in ``grad``); a non-finite amax is counted as per tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from computectx.fp8 import granular_ops, reference
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.granular import StepRule
from computectx.fp8.scaling import OperandScaling
from computectx.recipes import Fp8Policy

if TYPE_CHECKING:
    from computectx.fp8.autograd import Fp8LinearPlan

__all__ = ["row_linear"]


def _rows(
    x: torch.Tensor, policy: Fp8Policy, forward: bool, backend: Fp8Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s rows quantized along its last dimension: ``(codes, steps [rows, 1])``."""
    fmt = policy.format.forward if forward else policy.format.backward
    rule: StepRule = "pow2" if policy.power_of_two else "amax"
    return granular_ops.quantize(x, fmt, "row", rule, None, backend=backend)


def _record(operand: OperandScaling, x: torch.Tensor, steps: torch.Tensor) -> None:
    # Statistics only: the largest row amax (the tensor's; NaN propagates and is counted)
    # and the largest row step.
    amax = x.detach().abs().amax().to(torch.float32).reshape(1)
    operand.record(amax, steps.amax().reshape(1))


class _RowLinearFunction(torch.autograd.Function):
    """``Y = X Wᵀ + b`` on 2-D ``X`` with row-wise fp8 operands (module docstring)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: Fp8LinearPlan,
    ) -> torch.Tensor:
        policy = plan.policy
        xq, sx = _rows(x, policy, True, plan.backend)
        wq, sw = _rows(weight, policy, True, plan.backend)
        if plan.record:
            _record(plan.state.input, x, sx)
            _record(plan.state.weight, weight, sw)
        y = reference.scaled_mm(xq, wq, sx, sw, bias, plan.gemm_dtype)
        ctx.save_for_backward(x, weight)
        c: Any = ctx
        c.plan = plan
        c.b_dtype = None if bias is None else bias.dtype
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        plan: Fp8LinearPlan = ctx.plan
        policy, backend = plan.policy, plan.backend
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if need_x:
            # dX[M, K] = dY[M, N] · W[N, K]: contraction over N, dY's rows and W's columns.
            gq, sg = _rows(dy, policy, False, backend)
            if plan.record:
                _record(plan.state.grad, dy, sg)
            wtq, swt = _rows(weight.t(), policy, True, backend)
            dx = reference.scaled_mm(gq, wtq, sg, swt, None, plan.gemm_dtype).to(x.dtype)
        if need_w:
            # dW[N, K] = dYᵀ[N, M] · X[M, K]: contraction over M, dY's and X's columns; kept
            # in float32 until it reaches the weight's dtype.
            if policy.gw_hp:
                dw32 = dy.to(torch.float32).t() @ x.to(torch.float32)
            else:
                gtq, sgt = _rows(dy.t(), policy, False, backend)
                xtq, sxt = _rows(x.t(), policy, True, backend)
                dw32 = reference.scaled_mm(gtq, xtq, sgt, sxt, None, torch.float32)
            dw = dw32.to(weight.dtype)
        if need_b:
            db = dy.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None


def row_linear(
    x2: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, plan: Fp8LinearPlan
) -> torch.Tensor:
    """The row-wise fp8 linear on 2-D ``x2``; ``ValueError`` for what it does not run yet."""
    unsupported = [
        what
        for what, present in (
            ("a frozen (serving) weight", plan.frozen_weight is not None),
            ("an fp8 all-gathered weight (FSDP2)", weight is not None and _is_fp8_weight(weight)),
            ("data-parallel amax reduction", plan.reduces()),
        )
        if present
    ]
    if weight is None or unsupported:
        what = ", ".join(unsupported) or "a missing weight"
        raise ValueError(
            f"granularity 'row' in Fp8Linear does not support {what} yet; use granularity "
            f"'tensor' for it"
        )
    out: torch.Tensor = _RowLinearFunction.apply(x2, weight, bias, plan)  # type: ignore[no-untyped-call]
    return out


def _is_fp8_weight(weight: torch.Tensor) -> bool:
    from computectx.fp8.quantized import Fp8Weight

    return isinstance(weight, Fp8Weight)
