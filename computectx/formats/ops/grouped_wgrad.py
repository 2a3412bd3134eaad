"""The grouped weight gradient's kernel half: ``dY`` and ``X`` quantized in group-local
blocks along the rows, then one launch of ``computectx.kernels.grouped_wgrad``.

``ops.grouped``'s ``grouped_wgrad_op`` (``computectx::fp8_grouped_wgrad``) checks ``offs`` and
runs the float32 twin (``numerics.grouped.reference_grouped_wgrad``) where the kernels do not
run; elsewhere it calls ``kernel_wgrad``. The contraction of ``dW[g] = dY[rows of g]ᵀ ·
X[rows of g]`` runs over the group's own rows, so each operand's blocks start at its group's
first row (``group_blocks``), quantized as the twin quantizes them.
"""

from __future__ import annotations

import torch

from computectx.dtypes import Fp8Format
from computectx.formats.backend import Backend
from computectx.formats.numerics import grouped
from computectx.formats.numerics.layouts import MX_BLOCK, Granularity, StepRule
from computectx.formats.ops.blockwise import quantize_blocks

__all__ = ["group_blocks", "kernel_wgrad"]


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
