"""The block-scaled GEMM's pure-torch twin and its a-priori error bound.

``reference_scaled_mm`` is the semantics every backend of ``block_scaled_mm``
(``computectx.fp8.ops.gemm``) is held to: ``row`` x ``row`` is the per-tensor twin with per-row
steps; the block pairs cut K into blocks of the scale's width, sum each block's exact fp8
products in float32, scale each partial once and accumulate in float32 (DeepSeek-V3's
promotion recipe), then add the bias and round once. ``scaled_mm_error_bound`` bounds any
implementation that sums blocks (or sub-blocks) in float32 in any order;
``NARROW_ACCUMULATION`` widens it for the Triton kernel's 14-bit tensor-core accumulator.
``computectx.fp8.ops.gemm``'s docstring gives the derivation.
"""

from __future__ import annotations

from typing import Final

import torch

from computectx.fp8.numerics import blockwise, layouts, tensorwise
from computectx.fp8.numerics.layouts import BlockGranularity, block_width

__all__ = ["NARROW_ACCUMULATION", "reference_scaled_mm", "row_steps", "scaled_mm_error_bound"]

NARROW_ACCUMULATION: Final[tuple[int, float]] = (128, 2.0**-13)
"""How the Triton kernels (the block-scaled one and the per-tensor one) sum on a GPU, for
``scaled_mm_error_bound(accumulation=)`` here and in ``numerics.tensorwise``: at most 128 products
(one ``BLOCK_K`` step, ``max_num_imprecise_acc=BLOCK_K``) in the fp8 tensor cores'
accumulator, each addition with relative error at most ``2**-13`` (14 significant bits,
truncated: the "around 14 bits" DeepSeek-V3 measured on H800), then promoted to float32."""


def row_steps(scale: torch.Tensor, granularity: BlockGranularity, rows: int) -> torch.Tensor:
    """float32 steps of one operand, one per row and K block: ``(rows, n_kb)`` (a
    ``128x128`` block's step repeated over its rows; E8M0 widened exactly)."""
    steps = blockwise.steps_of_scale(scale)
    if granularity == "128x128":
        steps = steps.repeat_interleave(layouts.TILE, dim=0)[:rows]
    return steps


def _block_partials(
    a: torch.Tensor, b: torch.Tensor, width: int, first: int, last: int
) -> torch.Tensor:
    # The float32 partial sums of K blocks first..last-1: (blocks, M, N). fp8 values widen
    # exactly and their products are exact in float32 (TF32 too: 4 significant bits).
    k = a.shape[1]
    lo, hi = first * width, min(k, last * width)
    pad = (last - first) * width - (hi - lo)
    a3 = torch.nn.functional.pad(a[:, lo:hi].to(torch.float32), (0, pad))
    b3 = torch.nn.functional.pad(b[:, lo:hi].to(torch.float32), (0, pad))
    a3 = a3.reshape(a.shape[0], last - first, width).transpose(0, 1)
    b3 = b3.reshape(b.shape[0], last - first, width).permute(1, 2, 0)
    return torch.bmm(a3, b3)


def _twin_blocks(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    ga: BlockGranularity,
    scale_b: torch.Tensor,
    gb: BlockGranularity,
) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    width = block_width(ga, k)
    sa = row_steps(scale_a, ga, m)
    sb = row_steps(scale_b, gb, n)
    n_kb = sa.shape[1]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    # Blocks in groups, so the (group, M, N) partials stay near 2**24 elements.
    group = max(1, 2**24 // max(1, m * n))
    for first in range(0, n_kb, group):
        last = min(n_kb, first + group)
        partials = _block_partials(a, b, width, first, last)
        # Each block's scale step_a[i, kb] * step_b[j, kb] (one float32 product), then
        # partial * scale (one rounding), then the in-order float32 sum.
        scales = sa[:, first:last].t().unsqueeze(2) * sb[:, first:last].t().unsqueeze(1)
        partials.mul_(scales)
        for i in range(last - first):
            acc.add_(partials[i])
    return acc


def reference_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    granularity_a: BlockGranularity,
    scale_b: torch.Tensor,
    granularity_b: BlockGranularity,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The twin: ``block_scaled_mm``'s semantics (module docstring) in plain torch, on the
    operands' device. Arguments are assumed checked (``check_args``)."""
    if granularity_a == "row":
        return tensorwise.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)
    dev = a.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        # An enclosing autocast would run the partial sums in 16 bits.
        with torch.autocast(dev, enabled=False):
            acc = _twin_blocks(a, b, scale_a, granularity_a, scale_b, granularity_b)
    else:
        acc = _twin_blocks(a, b, scale_a, granularity_a, scale_b, granularity_b)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def scaled_mm_error_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    granularity_a: BlockGranularity,
    scale_b: torch.Tensor,
    granularity_b: BlockGranularity,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    accumulation: tuple[int, float] | None = None,
) -> torch.Tensor:
    """The a-priori elementwise bound on ``|block_scaled_mm(...) - exact|`` of the module
    docstring, float64 ``[M, N]`` on the CPU, for checked arguments on any device.

    ``accumulation=(w, u_h)`` widens it for hardware that sums up to ``w`` consecutive
    products of a block in a narrower accumulator, each addition with relative error at most
    ``u_h``, before promoting that partial to float32 (``NARROW_ACCUMULATION``: the Triton
    kernel on a GPU; the module docstring derives the bound)."""
    a, b = a.cpu(), b.cpu()
    scale_a, scale_b = scale_a.cpu(), scale_b.cpu()
    bias = None if bias is None else bias.cpu()
    if granularity_a == "row" and accumulation is None:
        return tensorwise.scaled_mm_error_bound(a, b, scale_a, scale_b, bias, out_dtype)
    m, k = a.shape
    n = b.shape[0]
    width = block_width(granularity_a, k)
    sa = row_steps(scale_a, granularity_a, m).to(torch.float64)
    sb = row_steps(scale_b, granularity_b, n).to(torch.float64)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    n_kb = sa.shape[1]
    exact = torch.zeros((m, n), dtype=torch.float64)
    mag = torch.zeros((m, n), dtype=torch.float64)
    for kb in range(n_kb):
        sl = slice(kb * width, min(k, (kb + 1) * width))
        s = sa[:, kb : kb + 1] * sb[:, kb].reshape(1, n)  # exact in float64
        exact += (a64[:, sl] @ b64[:, sl].t()) * s
        mag += (a64[:, sl].abs() @ b64[:, sl].abs().t()) * s.abs()
    if bias is not None:
        exact = exact + bias.to(torch.float64)
        mag = mag + bias.to(torch.float64).abs()
    gamma = tensorwise.accumulation_gamma(k + n_kb + 4, width, accumulation)
    unscaled = a64.abs() @ b64.abs().t()
    e = gamma * mag + 2.0**-148 * (unscaled + n_kb)
    u_out = tensorwise.UNIT_ROUNDOFF[out_dtype]
    tiny = torch.finfo(out_dtype).smallest_normal * u_out * 2
    return e + u_out * (exact.abs() + e) + tiny
