"""The grouped GEMMs' twin: each group is the dense fp8 linear's GEMM on its own rows.

A grouped GEMM multiplies row groups of one operand by one matrix each: the experts of a
mixture-of-experts layer, ``Y[rows of g] = X[rows of g] · W[g]ᵀ`` for tokens sorted by expert.
``offs`` (int32, one per group) holds each group's *end* row, as torch's ``F.grouped_mm``
takes it: group ``g`` is rows ``offs[g-1]:offs[g]`` (``offs[-1]`` read as 0). This module
is the float32 reference every backend is held to, written as a loop over the groups'
bounds (``bounds_of``) that calls the dense twins unchanged:

- ``reference_grouped_mm(a, b, bounds, ...)``: ``a [M, K]`` and ``b [E, N, K]``; group ``g``
  quantizes ``a``'s rows and ``b[g]`` at the operand granularities (dynamically, from their
  own amax) and multiplies them with ``numerics.blockwise.reference_scaled_mm`` (the
  block pairs) or ``numerics.tensorwise.scaled_mm`` (``tensor``: one step for the group's
  rows, one for the expert). The forward (``X·Wᵀ``) and the input gradient (``dY·W``, with
  ``b = Wᵀ`` per expert) are this call. ``reference_held_grouped_mm`` is the same GEMM
  with ``b`` already quantized (frozen experts' codes, ``ops.grouped_frozen``): only ``a``'s
  rows are quantized.
- ``reference_grouped_wgrad(dy, x, bounds, ...)``: the weight gradient
  ``dW[g] = dY[rows of g]ᵀ · X[rows of g]``, float32 ``[E, N, K]``: the contraction runs over
  the group's own rows, so every block along it starts at the group's first row (a group of
  ``m`` rows has ``ceil(m / w)`` blocks of width ``w``, the last one partial), and under
  ``row`` each operand row's step is the group's. ``high_precision=True`` is ``gw_hp``: the
  float32 product of the unquantized operands.

An empty group computes nothing and reads nothing of its expert (its weight is never
quantized: a memory-mapped expert no token chose stays on disk); its output rows do not
exist and its weight gradient is zero. Rows past the last group's end come out zero, as do
their gradients.

Under ``mx`` a contraction shorter than one block (``K < 32`` in the forward, ``N < 32`` in
the input gradient, a wgrad over a group of fewer than 32 rows) is zero-padded to one block of
32 before it is quantized, as the dense linear does: exact, since a zero changes no block's
amax and adds nothing to a dot product. The Triton path pads the same operands.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from computectx.dtypes import Fp8Format
from computectx.formats.numerics import blockwise, tensorwise
from computectx.formats.numerics.layouts import MX_BLOCK, Granularity, StepRule, layout_of

__all__ = [
    "bounds_of",
    "quantize_operand",
    "reference_grouped_mm",
    "reference_grouped_wgrad",
    "reference_held_grouped_mm",
    "scaled_gemm",
]


def bounds_of(offs: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of each group from checked int32 ``offs`` (a host read)."""
    ends = [int(e) for e in offs.tolist()]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def quantize_operand(
    x: torch.Tensor, fmt: Fp8Format, granularity: Granularity, rule: StepRule, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D ``x`` quantized dynamically at ``granularity``: ``(codes, scale)``.

    ``tensor``: one step from ``x``'s amax with ``margin`` (``tensorwise.quantize_dynamic``),
    the scale a float32 ``(1,)``; the block granularities: ``numerics.blockwise.quantize``
    with ``rule``, an ``mx`` contraction under 32 zero-padded to one block first.
    """
    if granularity == "tensor":
        q, step, _ = tensorwise.quantize_dynamic(x, fmt, margin)
        return q, step
    if granularity == "mx" and x.shape[-1] < MX_BLOCK:
        x = torch.nn.functional.pad(x, (0, MX_BLOCK - x.shape[-1]))
    return blockwise.quantize(x, fmt, layout_of(granularity, x.shape), rule)


def scaled_gemm(
    qa: torch.Tensor,
    sa: torch.Tensor,
    ga: Granularity,
    qb: torch.Tensor,
    sb: torch.Tensor,
    gb: Granularity,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The dense twin of one group's GEMM ``(qa * sa) @ (qb * sb)ᵀ`` at ``out_dtype``."""
    if ga == "tensor" or ga == "row":  # == narrows the Literal for mypy
        # Per-tensor or per-row steps: blockwise.reference_scaled_mm's row x row is this call.
        return tensorwise.scaled_mm(tensorwise.GemmArgs(qa, qb, sa, sb, None, out_dtype))
    assert gb != "tensor"
    return blockwise.reference_scaled_mm(
        blockwise.BlockGemmArgs(qa, qb, sa, ga, sb, gb, None, out_dtype)
    )


def reference_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: list[tuple[int, int]],
    granularity_a: Granularity,
    granularity_b: Granularity,
    fmt_a: Fp8Format,
    fmt_b: Fp8Format,
    rule: StepRule,
    margin: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows are the dense fp8 GEMM of ``a``'s rows and ``b[g]``."""

    def expert(g: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_operand(b[g], fmt_b, granularity_b, rule, margin)

    ga, gb = granularity_a, granularity_b
    return _by_group(a, b.shape[1], bounds, expert, (ga, gb, fmt_a, rule, margin, out_dtype))


def reference_held_grouped_mm(
    a: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    bounds: list[tuple[int, int]],
    granularity_a: Granularity,
    granularity_b: Granularity,
    fmt_a: Fp8Format,
    rule: StepRule,
    margin: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``reference_grouped_mm`` with ``b`` held quantized: expert ``g`` is the codes ``qb[g]``
    and its scale as they are (``sb`` ``(E,)`` for ``tensor``, else ``sb[g]`` the layout's
    grid); only ``a``'s rows are quantized."""

    def expert(g: int) -> tuple[torch.Tensor, torch.Tensor]:
        return qb[g], sb[g : g + 1] if granularity_b == "tensor" else sb[g]

    ga, gb = granularity_a, granularity_b
    return _by_group(a, qb.shape[1], bounds, expert, (ga, gb, fmt_a, rule, margin, out_dtype))


def _by_group(
    a: torch.Tensor,
    n: int,
    bounds: list[tuple[int, int]],
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    how: tuple[Granularity, Granularity, Fp8Format, StepRule, int, torch.dtype],
) -> torch.Tensor:
    # Each non-empty group's rows of ``a`` quantized, times its expert's codes (``expert(g)``,
    # asked only for a group with rows).
    ga, gb, fmt_a, rule, margin, out_dtype = how
    out = a.new_zeros((a.shape[0], n), dtype=out_dtype)
    for g, (start, end) in enumerate(bounds):
        if end == start:
            continue
        qa, sa = quantize_operand(a[start:end], fmt_a, ga, rule, margin)
        qb, sb = expert(g)
        out[start:end] = scaled_gemm(qa, sa, ga, qb, sb, gb, out_dtype)
    return out


def reference_grouped_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    bounds: list[tuple[int, int]],
    granularity: Granularity,
    fmt_dy: Fp8Format,
    fmt_x: Fp8Format,
    rule: StepRule,
    margin: int,
    high_precision: bool = False,
) -> torch.Tensor:
    """float32 ``[E, N, K]``: ``dW[g] = dY[rows of g]ᵀ · X[rows of g]`` (module docstring)."""
    out = dy.new_zeros((len(bounds), dy.shape[1], x.shape[1]), dtype=torch.float32)
    for g, (start, end) in enumerate(bounds):
        if end == start:
            continue
        dyt, xt = dy[start:end].t(), x[start:end].t()
        if high_precision:
            out[g] = torch.mm(dyt.to(torch.float32), xt.to(torch.float32).t())
            continue
        qd, sd = quantize_operand(dyt, fmt_dy, granularity, rule, margin)
        qx, sx = quantize_operand(xt, fmt_x, granularity, rule, margin)
        out[g] = scaled_gemm(qd, sd, granularity, qx, sx, granularity, torch.float32)
    return out
