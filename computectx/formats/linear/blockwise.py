"""The fine-grained fp8 linear (policy granularity ``row``, ``block`` or ``mx``).

Scaling is dynamic and per block: every GEMM operand is quantized from the current amax of
each of its blocks, with no history (``numerics.layouts.StepRule``: ``"pow2"`` or ``"amax"`` as
``policy.power_of_two`` says for ``row`` and ``block``; ``"mx_rceil"`` or ``"mx_floor"``
as ``policy.mx_rounding`` says for ``mx``). Each operand below is ``(rows, contraction)``
as ``ops.blockwise.block_scaled_mm`` takes it; its blocks run along the contraction:

=========================  ======================  ======================  ==================
GEMM (contraction)         ``row``                 ``block``               ``mx``
=========================  ======================  ======================  ==================
forward ``X·Wᵀ`` (K)       X 1xK, W 1xK            X 1x128, W 128x128      X 1x32, W 1x32
dgrad ``dY·W`` (N)         dY 1xN, Wᵀ 1xN (again)  dY 1x128, Wᵀ 128x128    dY 1x32, Wᵀ 1x32
                                                   (W's blocks transposed) (again)
wgrad ``dYᵀ·X`` (M)        dYᵀ 1xM, Xᵀ 1xM         dYᵀ 1x128, Xᵀ 1x128     dYᵀ 1x32, Xᵀ 1x32
                           (both again)            (both again)            (both again)
=========================  ======================  ======================  ==================

"Again": a block of one row does not transpose, so an operand that a backward GEMM contracts
along its other axis is quantized again from high precision along that axis (issue 16's
rule); the forward therefore keeps ``X`` (and ``W`` for ``row`` and ``mx``) in high
precision for the backward. A 128x128 block is square: ``Wᵀ`` for the dgrad is the
forward's weight codes and scales transposed as they are (``wq.t()``, ``sw.t()``), no second
quantize, so ``block`` keeps the weight's fp8 codes, not the weight. A ``block`` weight
that arrives quantized (``linear.weights.QuantizedBlockWeight``, FSDP2's fp8 all-gather) is
those codes and scales: the forward and the dgrad use them as they are. So is a frozen
(serving) weight (``linear.frozen``: codes and float32 steps per row, per 128x128 block or
per 1x32 MX group, whose power-of-two steps the GEMM takes as E8M0 bytes again, exactly);
the dgrad of a frozen ``row`` or ``mx`` weight quantizes ``Wᵀ`` along N from its codes times
their steps (float32). With ``gw_hp`` (``row`` only, torchao's
``ROWWISE_WITH_GW_HP``) the wgrad is ``dYᵀ X`` in float32 from the
high-precision ``dY`` and ``X``. X, W and Wᵀ are quantized in the policy's forward format,
dY and dYᵀ in its backward format, Xᵀ in the forward format.

Every GEMM is ``ops.blockwise.block_scaled_mm`` on ``plan.backend`` (its semantics and a-priori
bound are that module's: each K block's float32 partial sum promoted with its scales; one
scaling of the whole float32 sum for ``row``), with the bias in the forward's epilogue; the
forward and dgrad write the GEMM dtype, the wgrad float32 until it reaches the weight's
dtype. The bias gradient sums the unquantized ``dY`` in float32. The ``gw_hp`` wgrad is
an IEEE float32 matmul with TF32 off for that call (``computectx::wgrad_float32``).

**Ragged shapes.** A contraction that is not a multiple of the block is a partial last
block (``numerics.blockwise``'s rule). The one shape a block layout refuses is an ``mx`` contraction
shorter than one block (``K < 32``): ``QuantizedLinear`` refuses ``mx`` widths that are not
multiples of 32 (``check_granularity_widths``; ``convert_to_quantized`` skips them and an
``autocast`` region runs them in high precision), so that happens only in the wgrad of a
call with fewer than 32 rows (tokens). Both of its operands are then zero-padded along the
contraction to one block of 32 before they are quantized: exact, since a zero changes no
block's amax and adds nothing to a dot product.

**Ledgers** keep statistics only: in training each operand's ledger records the operand's
amax (the largest block amax; a non-finite one is counted as per tensor) and its largest
block step, and its tally the elements: ``X`` in ``input``, ``W`` in ``weight``, and in
``grad`` the first quantize of ``dY`` in the backward (the dgrad's, or the wgrad's ``dYᵀ``
when there is no dgrad; nothing under ``gw_hp`` without a dgrad). The ledger's saturated
count adds the elements that recorded quantize saturated (``numerics.blockwise.saturated_count``:
``|x / step|`` past the rounding midpoint above ``fmt.max``): never under ``amax``, ``pow2``
and ``rceil`` steps, which come from the block's own amax; under ``mx+floor`` the largest
elements of a block may. A weight that arrives as ``QuantizedBlockWeight`` was quantized with a
dynamic step and adds 0. Under activation checkpointing a region's recomputation quantizes
again to the same bytes (every step comes from the operand itself) and records nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from computectx.dtypes import Fp8Format
from computectx.formats.linear.plan import Fp8LinearPlan, LinearGrads, linear_grads
from computectx.formats.linear.recompute import CheckpointSite
from computectx.formats.linear.weights import QuantizedBlockWeight, QuantizedWeight
from computectx.formats.numerics import blockwise
from computectx.formats.numerics.layouts import (
    E8M0,
    MX_BLOCK,
    OPERAND_GRANULARITY,
    BlockGranularity,
    layout_of,
)
from computectx.formats.numerics.tensorwise import FORMATS
from computectx.formats.ops import blockwise as block_ops
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.formats.ops.blockwise import block_scaled_mm
from computectx.formats.scaling.operand import record_statistics
from computectx.saved import kept_back, offload_kept, refuse_double_backward

__all__ = ["blockwise_linear", "quantize_weight_blocks"]


def _quantize(
    x: torch.Tensor,
    fmt: Fp8Format,
    granularity: BlockGranularity,
    plan: Fp8LinearPlan,
    count_saturated: bool = False,
) -> block_ops.Quantized:
    """``x`` quantized in blocks along its last dimension: ``(codes, scale, largest step,
    saturated count)``, the scale as ``quantize_tensor`` returns it, the count (float32 ``(1,)``)
    only when ``count_saturated`` (a recorded quantize; else 0); an ``mx`` contraction under
    32 zero-padded to one block."""
    return _quantize_all([(x, granularity)], fmt, plan, count_saturated)[0]


def _quantize_all(
    operands: Sequence[tuple[torch.Tensor, BlockGranularity]],
    fmt: Fp8Format,
    plan: Fp8LinearPlan,
    count_saturated: bool,
) -> list[block_ops.Quantized]:
    """Each ``(x, granularity)`` quantized as ``_quantize`` says, in one call."""
    padded = [
        (torch.nn.functional.pad(x, (0, MX_BLOCK - x.shape[-1])), g)
        if g == "mx" and x.shape[-1] < MX_BLOCK
        else (x, g)
        for x, g in operands
    ]
    rule, backend, fp8 = plan.step_rule, plan.backend.value, FORMATS[fmt].dtype
    return [
        block_ops.fp8_quantize_blocks(x, fp8, g, rule, backend, count_saturated) for x, g in padded
    ]


def quantize_weight_blocks(weight: torch.Tensor, plan: Fp8LinearPlan) -> block_ops.Quantized:
    """``weight`` quantized as the forward quantizes it under ``plan`` (its recipe's weight
    blocks, the forward format, the step rule): what a frozen layer holds."""
    return _quantize(weight, plan.fwd, OPERAND_GRANULARITY[plan.policy.granularity][1], plan)


def _held(
    weight: torch.Tensor | None, plan: Fp8LinearPlan
) -> tuple[torch.Tensor, torch.Tensor] | None:
    # The weight's codes and scale when they came quantized: a frozen layer's (its
    # recipe's layout; mx's float32 steps as the E8M0 scale the GEMM takes, exactly) or
    # FSDP2's gathered 128x128 blocks; None: quantize the weight here.
    if plan.frozen_weight is not None:
        data, steps = plan.frozen_weight
        # A dtype conversion, exact for E8M0's powers of two (and one inductor compiles).
        return data, steps.to(E8M0) if plan.policy.granularity == "mx" else steps
    if isinstance(weight, QuantizedBlockWeight):
        return weight.fp8_data, weight.fp8_scale
    return None


class _GranularLinearFunction(torch.autograd.Function):
    """``Y = X Wᵀ + b`` on 2-D ``X`` with block-scaled fp8 operands (module docstring)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        plan: Fp8LinearPlan,
        record_forward: bool,
    ) -> torch.Tensor:
        fwd = plan.fwd
        g_act, g_w = OPERAND_GRANULARITY[plan.policy.granularity]
        held = _held(weight, plan)
        operands = (
            [(x, g_act)] if held is not None or weight is None else [(x, g_act), (weight, g_w)]
        )
        (xq, sx, x_step, x_sat), *quantized_w = _quantize_all(operands, fwd, plan, record_forward)
        if held is not None:  # its codes and scale, as they are
            wq, sw = held
        else:
            wq, sw, w_step, w_sat = quantized_w[0]
        if record_forward:  # never frozen: a frozen layer records nothing
            if isinstance(weight, QuantizedBlockWeight):  # gathered by FSDP2
                # Statistics of the gathered blocks (dynamic: nothing saturates), only when
                # recorded: the dequantized weight is a full-size float32 copy.
                w_sat = torch.zeros(1, dtype=torch.float32, device=sw.device)
                w_stats = (weight.dequantize(), sw.amax().reshape(1), w_sat)
            else:
                assert weight is not None  # quantized above: nothing was held
                w_stats = (weight, w_step, w_sat)
            state = plan.state
            record_statistics([(state.input, x, x_step, x_sat), (state.weight, *w_stats)])
        y = block_scaled_mm(xq, wq, sx, g_act, sw, g_w, bias, plan.gemm_dtype, backend=plan.backend)
        # block: the dgrad reads the weight's codes and scales (its 128x128 blocks transpose);
        # row and mx quantize the weight again along N from high precision (a frozen row or
        # mx weight: from its codes times their steps, in float32).
        c: Any = ctx
        kept = (x,) if plan.save != "fp8" else _kept_input(c.needs_input_grad[1], x, xq, sx, plan)
        if plan.save == "offload":  # in host memory
            kept = offload_kept(ctx, kept)
        if g_w == "128x128" or weight is None:
            ctx.save_for_backward(*kept, wq, sw)
        else:
            ctx.save_for_backward(*kept, weight)
        c.plan, c.kept, c.x_dtype = plan, len(kept), x.dtype
        c.w_dtype = None if weight is None else weight.dtype
        c.b_dtype = None if bias is None else bias.dtype
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> LinearGrads:
        # Under linear: fp8 or offload X comes back as codes or a host copy: refused, by name.
        refuse_double_backward("linear", ctx.plan.save, fp8_gemm=True)
        return _GranularLinearFunction.first_order(ctx, dy)

    @staticmethod
    @once_differentiable
    def first_order(ctx: Any, dy: torch.Tensor) -> LinearGrads:
        plan: Fp8LinearPlan = ctx.plan
        policy = plan.policy
        fwd, bwd = plan.fwd, plan.bwd
        g_act, g_w = OPERAND_GRANULARITY[policy.granularity]
        saved = ctx.saved_tensors  # read once: checkpointing unpacks each tensor once
        kept, w_saved = kept_back(ctx, saved[: ctx.kept]), saved[ctx.kept :]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = None
        record = plan.record
        if need_x:
            # dX[M, K] = dY[M, N] · W[N, K]: contraction over N, dY's rows and W's columns.
            gq, sg, g_step, g_sat = _quantize(dy, bwd, g_act, plan, record)
            if record:
                record_statistics([(plan.state.grad, dy, g_step, g_sat)])
                record = False
            g_wt: BlockGranularity = g_w
            if g_w == "128x128":
                wq, sw = w_saved
                wtq, swt = wq.t(), sw.t()
            else:
                w = w_saved[0] if len(w_saved) == 1 else _dequantized(w_saved[0], w_saved[1], g_w)
                wtq, swt, _, _ = _quantize(w.t(), fwd, g_act, plan)
            dx = block_scaled_mm(
                gq, wtq, sg, g_act, swt, g_wt, None, plan.gemm_dtype, backend=plan.backend
            )
            dx = dx.to(ctx.x_dtype)
        if need_w:
            # dW[N, K] = dYᵀ[N, M] · X[M, K]: contraction over M, dY's and X's columns; kept
            # in float32 until it reaches the weight's dtype.
            if policy.gw_hp:
                x = kept[0] if len(kept) == 1 else _dequantized(kept[0], kept[1], g_act)
                dw32 = tensor_ops.wgrad_float32(dy, x)
            else:
                gtq, sgt, gt_step, gt_sat = _quantize(dy.t(), bwd, g_act, plan, record)
                if record:
                    record_statistics([(plan.state.grad, dy, gt_step, gt_sat)])
                if len(kept) == 1:
                    xtq, sxt, _, _ = _quantize(kept[0].t(), fwd, g_act, plan)
                else:  # linear: fp8 quantized Xᵀ in the forward, as this would
                    xtq, sxt = kept
                dw32 = block_scaled_mm(
                    gtq, xtq, sgt, g_act, sxt, g_act, None, torch.float32, backend=plan.backend
                )
            dw = dw32.to(ctx.w_dtype)
        return linear_grads(dx, dw, dy, ctx.b_dtype if need_b else None)


def _kept_input(
    need_w: bool, x: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor, plan: Fp8LinearPlan
) -> tuple[torch.Tensor, ...]:
    """What the backward keeps of ``x`` under ``linear: fp8``: only what the wgrad reads
    (nothing when the weight needs no gradient: a frozen or untrained weight). ``Xᵀ``
    quantized along M here, as the backward would quantize it from ``x``, so ``dW`` is the
    same bit for bit; under ``gw_hp`` (float32 wgrad) the forward's row-wise codes of ``x``,
    which the backward dequantizes (an E4M3/E5M2 rounding of ``x``: docs/activations.md)."""
    if not need_w:
        return ()
    if plan.policy.gw_hp:
        return xq, sx
    g_act = OPERAND_GRANULARITY[plan.policy.granularity][0]
    xtq, sxt, _, _ = _quantize(x.t(), plan.fwd, g_act, plan)
    return xtq, sxt


def blockwise_linear(
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    plan: Fp8LinearPlan,
    site: CheckpointSite | None,
) -> torch.Tensor:
    """The fine-grained fp8 linear on 2-D ``x2`` (``plan.policy.granularity`` row, block or
    mx; ``site``: where the call sits with respect to activation checkpointing). Each takes
    a frozen weight (``plan.frozen_weight``: codes and steps in the forward format, per row,
    per 128x128 block or per 1x32 MX group, ``weight`` ``None``) and ``block`` also its
    weight already quantized in 128x128 blocks, in the forward format (a
    ``QuantizedBlockWeight``: FSDP2's fp8 all-gather): both are used as they are, with no
    second quantize. ``ValueError`` for what it does not run yet: any other pre-quantized
    weight, data-parallel amax reduction."""
    granularity = plan.policy.granularity
    unsupported = [
        what
        for what, present in (
            ("an fp8 all-gathered weight (FSDP2)", _is_fp8_weight(weight, plan)),
            ("data-parallel amax reduction", plan.reduces),
        )
        if present
    ]
    if (weight is None and plan.frozen_weight is None) or unsupported:
        what = ", ".join(unsupported) or "a missing weight"
        raise ValueError(
            f"granularity {granularity!r} in QuantizedLinear does not support {what} "
            f"yet; use granularity 'tensor' for it"
        )
    # Under activation checkpointing the recomputation quantizes again, to the same bytes (the
    # steps are the operands' own), and records nothing; the backward records dY once.
    record_forward = plan.record and (site is None or not site.recomputing)
    out: torch.Tensor = _GranularLinearFunction.apply(x2, weight, bias, plan, record_forward)  # type: ignore[no-untyped-call]
    return out


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, g: BlockGranularity) -> torch.Tensor:
    # A frozen row or mx weight in float32: each code times its step (exact for powers of
    # two), from which the dgrad quantizes Wᵀ along N.
    return blockwise.dequantize(codes, scale, layout_of(g, codes.shape), torch.float32)


def _is_fp8_weight(weight: torch.Tensor | None, plan: Fp8LinearPlan) -> bool:
    # A pre-quantized weight this call cannot use as it is: a per-tensor QuantizedWeight, or
    # 128x128 blocks under another granularity or in another format.
    if isinstance(weight, QuantizedBlockWeight):
        return plan.policy.granularity != "block" or weight.fp8_data.dtype != plan.fwd.torch
    return isinstance(weight, QuantizedWeight)
