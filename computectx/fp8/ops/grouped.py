"""The grouped fp8 GEMMs behind ``fp8_grouped_mm``: the checks, and each backend's run.

``check_grouped`` is what the entry point checks before anything runs (dimensions, dtypes,
devices, ``offs``' dtype and length: no data is read); ``checked_bounds`` reads ``offs``'
values, inside the operators, so a compiled call checks them as an eager one does (not
negative, not decreasing, not past ``M``). Both raise naming the value and what is accepted.

``grouped_mm`` and ``grouped_wgrad`` run the two operators of ``ops.registry``
(``fp8_grouped_mm``, ``fp8_grouped_wgrad``) on a backend:

- ``REFERENCE``: the float32 twin, ``numerics.grouped``, a loop over the groups.
- ``TRITON``: the operands quantized as the twin quantizes them (the block quantize kernel,
  or the per-tensor twin for ``tensor``: a few torch ops per group), then one launch of the
  grouped kernel (``computectx.kernels.grouped_mm``), which finds each tile's group from
  ``offs`` on the device.
- ``CUBLAS``: ``torch.nn.functional.scaled_grouped_mm`` for the row-wise recipe on CUDA
  (torch's grouped kernel with per-row scales); every other case runs the Triton kernel where
  Triton runs, else the twin (``F.scaled_grouped_mm`` is CUDA only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from computectx.dtypes import FLOAT_DTYPES, Fp8Format
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.numerics import grouped
from computectx.fp8.numerics.layouts import MX_BLOCK, TILE, Granularity, StepRule
from computectx.fp8.ops import block_quantize, triton

__all__ = ["check_grouped", "checked_bounds", "grouped_mm", "grouped_wgrad"]


def check_grouped(
    x: object,
    w: object,
    offs: object,
    *,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    op: str = "fp8_grouped_mm",
) -> tuple[int, int, int, int]:
    """``(M, K, E, N)`` of a grouped GEMM's operands, or ``TypeError``/``ValueError``.

    ``x`` is ``[M, K]`` and ``w`` ``[E, N, K]``, both of ``dtypes`` (bf16, fp16, fp32 for the
    fp8 GEMM: they are quantized) on one device; ``offs`` an int32 ``[E]`` tensor on that
    device. Values are checked by ``checked_bounds``. The one check of these inputs: the fp8
    GEMM and the high-precision grouped experts (``computectx.nn.GroupedExperts``) both call
    it, so they refuse the same inputs with the same message (``op`` names the caller).
    """
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(
            f"{op} takes tensors x [M, K] and w [E, N, K], got "
            f"{type(x).__name__} and {type(w).__name__}"
        )
    if not isinstance(offs, torch.Tensor):
        raise TypeError(
            f"offs must be an int32 tensor of each group's end row, got {type(offs).__name__}"
        )
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"{op} takes x [M, K] (2-D) and w [E, N, K] (3-D: one [N, K] matrix per "
            f"group, as nn.Linear stores a weight), got x {tuple(x.shape)}, w {tuple(w.shape)}"
        )
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    for name, t in (("x", x), ("w", w)):
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be one of {names} for {op}, got {t.dtype}")
    m, k = x.shape
    e, n, kw = w.shape
    if kw != k:
        raise ValueError(f"x is [M, K] = {tuple(x.shape)} but w[g] is [N, K] = ({n}, {kw})")
    if offs.dtype != torch.int32:
        raise TypeError(
            f"offs must be int32 (each group's end row, as F.grouped_mm takes it), got "
            f"{offs.dtype}; use offs.to(torch.int32)"
        )
    if e < 1:
        raise ValueError(f"w must hold at least one group, got shape {tuple(w.shape)}")
    if offs.dim() != 1 or offs.shape[0] != e:
        raise ValueError(
            f"offs must be 1-D with one end row per group (w has E = {e} groups), got shape "
            f"{tuple(offs.shape)}"
        )
    if not (x.device == w.device == offs.device):
        raise ValueError(
            f"x, w and offs must be on one device, got {x.device}, {w.device}, {offs.device}"
        )
    return m, k, e, n


def checked_bounds(offs: torch.Tensor, m: int) -> list[tuple[int, int]]:
    """Each group's ``(start, end)`` rows from ``offs``; ``ValueError`` naming the first bad
    entry when an end is negative, below the one before, or past ``m`` rows."""
    bounds = grouped.bounds_of(offs)
    prev = 0
    for g, (_, end) in enumerate(bounds):
        if end < prev:
            what = "negative" if end < 0 else f"below offs[{g - 1}] = {prev}"
            raise ValueError(
                f"offs must be non-decreasing end rows in [0, M = {m}]; offs[{g}] = {end} is "
                f"{what} (offs = {offs.tolist()})"
            )
        if end > m:
            raise ValueError(
                f"offs[{g}] = {end} is past the {m} rows of x; the ends must be in "
                f"[0, M = {m}] (offs = {offs.tolist()})"
            )
        prev = end
    return bounds


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    ga: Granularity,
    gb: Granularity,
    fmt_a: Fp8Format,
    fmt_b: Fp8Format,
    rule: StepRule,
    margin: int,
    out_dtype: torch.dtype,
    backend: Fp8Backend,
) -> torch.Tensor:
    """``[M, N]``: each group's rows of ``a`` times ``b[g]ᵀ`` in fp8 (module docstring)."""
    bounds = checked_bounds(offs, a.shape[0])
    if backend is Fp8Backend.CUBLAS and ga == "row" and a.is_cuda and out_dtype == torch.bfloat16:
        return _cublas_rowwise(a, b, offs, bounds, fmt_a, fmt_b, rule, out_dtype)
    if not triton.uses_kernels(backend, a):
        return grouped.reference_grouped_mm(
            a, b, bounds, ga, gb, fmt_a, fmt_b, rule, margin, out_dtype
        )
    if ga == "mx" and a.shape[1] < MX_BLOCK:
        # A contraction shorter than one MX block (K < 32 forward, N < 32 in the dgrad) is
        # zero-padded to one block, as the twin's quantize_operand pads it: exact, since a
        # zero changes no amax and adds nothing to a dot product. The block quantize needs one
        # whole block; the padded operands are at most 32 wide.
        pad = (0, MX_BLOCK - a.shape[1])
        a, b = torch.nn.functional.pad(a, pad), torch.nn.functional.pad(b, pad)
    e = b.shape[0]
    if ga == "tensor":
        qa = torch.empty_like(a, dtype=fmt_a.torch)
        sa = torch.ones(e, dtype=torch.float32, device=a.device)
        for g, (start, end) in enumerate(bounds):
            if end > start:
                qa[start:end], sa[g : g + 1] = grouped.quantize_operand(
                    a[start:end], fmt_a, ga, rule, margin
                )
    else:
        qa, sa = block_quantize.quantize_blocks(a, fmt_a, ga, rule, None, backend=backend)
    qb, sb = _quantize_experts(b, bounds, fmt_b, gb, rule, margin, backend)
    return triton.grouped_scaled_mm(
        a=qa, sa=sa, b=qb, sb=sb, offs=offs, granularity_a=ga, granularity_b=gb,
        out_dtype=out_dtype,
    )  # fmt: skip


def grouped_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    granularity: Granularity,
    fmt_dy: Fp8Format,
    fmt_x: Fp8Format,
    rule: StepRule,
    margin: int,
    high_precision: bool,
    backend: Fp8Backend,
) -> torch.Tensor:
    """float32 ``[E, N, K]``: ``dY[rows of g]ᵀ · X[rows of g]`` per group (module docstring)."""
    bounds = checked_bounds(offs, dy.shape[0])
    if high_precision or not triton.uses_kernels(backend, dy):
        return grouped.reference_grouped_wgrad(
            dy, x, bounds, granularity, fmt_dy, fmt_x, rule, margin, high_precision
        )
    qd, sd, start = _group_blocks(dy.t(), bounds, fmt_dy, granularity, rule, margin, backend)
    qx, sx, _ = _group_blocks(x.t(), bounds, fmt_x, granularity, rule, margin, backend)
    return triton.grouped_scaled_wgrad(
        a=qd, sa=sd, b=qx, sb=sx, offs=offs, block_start=start, granularity=granularity
    )


def _quantize_experts(
    b: torch.Tensor,
    bounds: list[tuple[int, int]],
    fmt: Fp8Format,
    gb: Granularity,
    rule: StepRule,
    margin: int,
    backend: Fp8Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Each expert with rows quantized on its own; an empty group's expert is never read (its
    # codes stay uninitialized and the kernel skips its group), so a memory-mapped expert no
    # token chose is not paged in.
    e, n, k = b.shape
    qb = torch.empty((e, n, k), dtype=fmt.torch, device=b.device)
    if gb == "tensor":
        sb = torch.ones(e, dtype=torch.float32, device=b.device)
    else:
        grid = _expert_scale_grid(gb, n, k)
        dtype = torch.float8_e8m0fnu if gb == "mx" else torch.float32
        sb = torch.ones((e, *grid), dtype=torch.float32, device=b.device).to(dtype)
    for g, (start, end) in enumerate(bounds):
        if end == start:
            continue
        if gb == "tensor":
            qb[g], sb[g : g + 1] = grouped.quantize_operand(b[g], fmt, gb, rule, margin)
        else:
            qb[g], sb[g] = block_quantize.quantize_blocks(
                b[g], fmt, gb, rule, None, backend=backend
            )
    return qb, sb


def _expert_scale_grid(g: Granularity, n: int, k: int) -> tuple[int, int]:
    if g == "row":
        return (n, 1)
    if g == "128x128":
        return (-(-n // TILE), -(-k // TILE))
    width = MX_BLOCK if g == "mx" else TILE
    return (n, -(-k // width))


def _group_blocks(
    t: torch.Tensor,
    bounds: list[tuple[int, int]],
    fmt: Fp8Format,
    g: Granularity,
    rule: StepRule,
    margin: int,
    backend: Fp8Backend,
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
            q, s = block_quantize.quantize_blocks(part, fmt, g, rule, None, backend=backend)
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


def _cublas_rowwise(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    bounds: list[tuple[int, int]],
    fmt_a: Fp8Format,
    fmt_b: Fp8Format,
    rule: StepRule,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # torch's grouped fp8 GEMM (CUDA only) with one float32 step per row of a and per row of
    # each b[g], writing bf16; rows past the last group are zeroed (torch leaves them as is).
    f = torch.nn.functional
    # torch/nn/functional.pyi (2.13) does not declare scaled_grouped_mm.
    scaled_grouped_mm: Callable[..., torch.Tensor] = getattr(f, "scaled_grouped_mm")  # noqa: B009
    qa, sa = block_quantize.quantize_blocks(a, fmt_a, "row", rule, None, backend=Fp8Backend.TRITON)
    qb, sb = _quantize_experts(b, bounds, fmt_b, "row", rule, 0, Fp8Backend.TRITON)
    out = scaled_grouped_mm(
        qa, qb.transpose(-2, -1), sa.reshape(-1), f.ScalingType.RowWise,
        sb.reshape(sb.shape[0], -1), f.ScalingType.RowWise, offs=offs, output_dtype=out_dtype,
    )  # fmt: skip
    out[bounds[-1][1] :] = 0
    return out
