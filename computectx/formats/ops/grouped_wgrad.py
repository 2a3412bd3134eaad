"""The grouped GEMMs' kernel halves: the operands quantized as the float32 twin
(``numerics.grouped``) quantizes them, then one launch of a grouped kernel.

``ops.grouped``'s operators check ``offs`` and run the twin where the kernels do not run;
elsewhere they call these. ``kernel_held_mm``: ``held_grouped_mm``'s rows of ``a`` quantized
(the experts came quantized), then ``computectx.kernels.grouped_mm``. ``kernel_wgrad``
(``computectx::fp8_grouped_wgrad``): ``dW[g] = dY[rows of g]ᵀ · X[rows of g]`` contracts over
the group's own rows, so each operand's blocks start at its group's first row
(``group_blocks``), then ``computectx.kernels.grouped_wgrad``. ``quantize_experts``: the
experts quantized as the grouped forward quantizes them (also a frozen module's codes).
"""

from __future__ import annotations

import torch

from computectx.dtypes import Fp8Format
from computectx.formats.backend import Backend
from computectx.formats.numerics import grouped
from computectx.formats.numerics.layouts import MX_BLOCK, Granularity, StepRule, scale_grid
from computectx.formats.ops.blockwise import quantize_blocks

__all__ = ["GemmHow", "group_blocks", "kernel_held_mm", "kernel_wgrad", "quantize_experts"]

GemmHow = tuple[Granularity, Granularity, Fp8Format, StepRule, int, torch.dtype, Backend]
"""The granularities, ``a``'s format, step rule, margin, output dtype, backend of a GEMM."""


def kernel_held_mm(
    a: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    how: GemmHow,
    bounds: list[tuple[int, int]],
) -> torch.Tensor:
    """``[M, N]``: ``ops.grouped.held_grouped_mm`` by the grouped GEMM kernel (``bounds``:
    ``offs``' checked); an ``mx`` contraction under one block is zero-padded to one, as
    ``fp8_grouped_mm`` pads it, the held codes with it (+0 is byte 0)."""
    ga, gb, fa, r, margin, out_dtype, chosen = how
    if ga == "mx" and a.shape[1] < MX_BLOCK:
        pad = (0, MX_BLOCK - a.shape[1])
        a = torch.nn.functional.pad(a, pad)
        qb = torch.nn.functional.pad(qb.view(torch.uint8), pad).view(qb.dtype)
    if ga == "tensor":
        qa = torch.empty_like(a, dtype=fa.torch)
        sa = torch.ones(qb.shape[0], dtype=torch.float32, device=a.device)
        for g, (start, end) in enumerate(bounds):
            if end > start:
                qa[start:end], sa[g : g + 1] = grouped.quantize_operand(
                    a[start:end], fa, ga, r, margin
                )
    else:
        qa, sa = quantize_blocks(a, fa, ga, r, None, backend=chosen)
    from computectx.kernels import grouped_mm as kernel

    return kernel.grouped_scaled_mm(
        a=qa, sa=sa, b=qb, sb=sb, offs=offs, granularity_a=ga, granularity_b=gb,
        out_dtype=out_dtype,
    )  # fmt: skip


def kernel_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    bounds: list[tuple[int, int]],
    g: Granularity,
    formats: tuple[Fp8Format, Fp8Format],
    rule: StepRule,
    margin: int,
    backend: Backend,
) -> torch.Tensor:
    """float32 ``[E, N, K]``: ``dY[rows of g]ᵀ X[rows of g]`` by the grouped wgrad kernel,
    ``dY`` in ``formats[0]`` and ``X`` in ``formats[1]`` (``bounds``: ``offs``' checked)."""
    qd, sd, start = group_blocks(dy.t(), bounds, formats[0], g, rule, margin, backend)
    qx, sx, _ = group_blocks(x.t(), bounds, formats[1], g, rule, margin, backend)
    from computectx.kernels import grouped_wgrad as kernel

    return kernel.grouped_scaled_wgrad(
        a=qd, sa=sd, b=qx, sb=sx, offs=offs, block_start=start, granularity=g
    )


def group_blocks(
    t: torch.Tensor,
    bounds: list[tuple[int, int]],
    fmt: Fp8Format,
    g: Granularity,
    rule: StepRule,
    margin: int,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t [R, M]`` quantized along M in group-local blocks: the codes ``[R, M]``, the scales
    ``[R, C]`` (``[E]`` for ``tensor``) with group ``g``'s blocks from column ``start[g]``."""
    rows, m = t.shape
    codes = torch.zeros((rows, m), dtype=fmt.torch, device=t.device)
    scales: list[torch.Tensor] = []
    starts: list[int] = []
    column = 0
    for start, end in bounds:
        starts.append(column)
        if end == start:
            # tensor and row keep one column per group (the kernel reads column g); the
            # block granularities give an empty group no column (block_start says where).
            if g == "tensor":
                scales.append(torch.ones(1, dtype=torch.float32, device=t.device))
            elif g == "row":
                scales.append(torch.ones((rows, 1), dtype=torch.float32, device=t.device))
            continue
        if g == "tensor":
            q, s = grouped.quantize_operand(t[:, start:end], fmt, g, rule, margin)
        else:
            part = t[:, start:end]
            if g == "mx" and end - start < MX_BLOCK:
                part = torch.nn.functional.pad(part, (0, MX_BLOCK - (end - start)))
            q, s = quantize_blocks(part, fmt, g, rule, None, backend=backend)
            column += s.shape[1]
        codes[:, start:end] = q[:, : end - start]
        scales.append(s)
    if g == "tensor":
        scale = torch.cat(scales).to(torch.float32)
    elif scales:
        scale = torch.cat(scales, dim=1)
    else:
        dtype = torch.float8_e8m0fnu if g == "mx" else torch.float32
        scale = torch.ones((rows, 1), dtype=torch.float32, device=t.device).to(dtype)
    start_t = torch.tensor(starts, dtype=torch.int32, device=t.device)
    return codes, scale, start_t


def quantize_experts(
    b: torch.Tensor,
    fmt: Fp8Format,
    gb: Granularity,
    rule: StepRule,
    margin: int,
    backend: Backend,
    experts: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``b [E, N, K]`` quantized per expert as the grouped forward quantizes it: the codes
    ``[E, N, K]`` and the scales (``(E,)`` for ``tensor``, else ``(E, *grid)``; ``mx``'s
    E8M0). ``experts``: only those (the groups with rows; default all)."""
    # An expert left out is never read (its codes stay uninitialized and the kernel skips its
    # group), so a memory-mapped expert no token chose is not paged in.
    e, n, k = b.shape
    qb = torch.empty((e, n, k), dtype=fmt.torch, device=b.device)
    if gb == "tensor":
        sb = torch.ones(e, dtype=torch.float32, device=b.device)
    else:
        grid = scale_grid(gb, n, k)
        dtype = torch.float8_e8m0fnu if gb == "mx" else torch.float32
        sb = torch.ones((e, *grid), dtype=torch.float32, device=b.device).to(dtype)
    for g in range(e) if experts is None else experts:
        if gb == "tensor":
            qb[g], sb[g : g + 1] = grouped.quantize_operand(b[g], fmt, gb, rule, margin)
        else:
            qb[g], sb[g] = quantize_blocks(b[g], fmt, gb, rule, None, backend=backend)
    return qb, sb
