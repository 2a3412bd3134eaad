"""fp8 quantize kernels with one step per block: row-wise, 1x128, 128x128 and MX (1x32).

``quantize_blocks`` quantizes a 2-D tensor of any strides, so ``x.t()`` gives the
column-wise (transposed) quantize a backward GEMM needs: the kernel reads the transpose in
place and writes its codes contiguous. Each block's amax becomes its step by a *rule*
(``"amax"``: ``amax / max``, at least ``2**-126``; ``"pow2"``: that rounded up to a power
of two; ``"mx_rceil"`` / ``"mx_floor"``: an E8M0 exponent), then every element is
``fp8(clamp(x / step))``: one IEEE division, round to nearest even on the bits
(``computectx.kernels.fp8_codes.fp8_byte``). A block whose amax is zero or not finite
gets step 1. Ragged edges are partial blocks (masked lanes load 0, which changes no amax).

Two kernels: ``_quantize_blocks_kernel`` (1x32, 1x128, 128x128: a program loads each of its
blocks once, measures, stores the step and the codes) and ``_quantize_rows_kernel`` (one
step per row: a pass for the amax, a pass for the codes). The pure-torch twins are
``computectx.formats.numerics.blockwise``; the bytes and the steps agree bit for bit.
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

from typing import Final, Literal

import torch
import triton
import triton.language as tl

from computectx.kernels.fp8_codes import FLOAT_DTYPES, code_bound, e8m0_step
from computectx.kernels.quantize_cast import (
    FLT_MIN,
    check_fp8,
    clamped_byte,
    fp8_constants,
    load_widened,
)

__all__ = ["INTERPRETED", "RULES", "quantize_blocks"]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether these kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""

Rule = Literal["amax", "pow2", "mx_floor", "mx_rceil"]
RULES: Final[dict[Rule, int]] = {"amax": 0, "pow2": 1, "mx_floor": 2, "mx_rceil": 3}
"""The step rules, by the number the kernels receive."""
_RULE_POW2 = tl.constexpr(1)
_RULE_MX_FLOOR = tl.constexpr(2)

_BLOCKS: Final = ((1, None), (1, 32), (1, 128), (128, 128))
# Per block shape: rows per program, blocks per program along K, warps. Under the
# interpreter, small tiles make small test tensors span several programs and groups.
_TILES: Final[dict[tuple[int, int | None], tuple[int, int, int]]] = {
    (1, 32): (4, 2, 1) if INTERPRETED else (32, 4, 4),
    (1, 128): (4, 1, 1) if INTERPRETED else (32, 1, 4),
    (128, 128): (128, 1, 4) if INTERPRETED else (128, 1, 8),
}
_ROW_TILE: Final = (4, 32, 1) if INTERPRETED else (8, 512, 4)  # rows, chunk of K, warps


@triton.jit
def _load_tile(x_ptr, rows, cols, R, C, stride_r, stride_c, X_BF16: tl.constexpr):  # type: ignore[no-untyped-def]
    # Rows x cols of x as float32 (0 where masked), and the mask.
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
    return load_widened(x_ptr, offs, mask, X_BF16), mask


@triton.jit
def _ceil_log2(q):  # type: ignore[no-untyped-def]
    # ceil(log2(q)) exactly, int32, for finite float32 q >= 0 (-150 for 0).
    b = q.to(tl.int32, bitcast=True)
    biased = b >> 23
    frac = b & 0x7FFFFF
    normal = biased - 127 + (frac != 0).to(tl.int32)
    # A subnormal is frac * 2**-149, and frac (< 2**23) converts to float32 exactly.
    f = frac.to(tl.float32).to(tl.int32, bitcast=True)
    sub = (f >> 23) - 127 + ((f & 0x7FFFFF) != 0).to(tl.int32) - 149
    return tl.where(biased > 0, normal, tl.where(frac > 0, sub, -150))


@triton.jit
def _exp2(e):  # type: ignore[no-untyped-def]
    # float32 2**e for int32 e in [-149, 127], from its bits.
    normal = tl.maximum(e + 127, 1) << 23
    sub = tl.full(e.shape, 1, tl.int32) << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def _steps(amax_bits, FMT: tl.constexpr, RULE: tl.constexpr):  # type: ignore[no-untyped-def]
    # The float32 step of each block from its amax (as int32 bits; NaN sorts above inf).
    usable = (amax_bits > 0) & (amax_bits < 0x7F800000)
    amax = tl.where(usable, amax_bits, 0x3F800000).to(tl.float32, bitcast=True)
    if RULE <= _RULE_POW2:
        # A subnormal step keeps too few bits: it is raised to float32's smallest normal.
        q = tl.div_rn(amax, FMT.FMAX)
        step = tl.where(usable & (q > 0.0), tl.maximum(q, FLT_MIN), 1.0)
        if RULE == _RULE_POW2:
            step = _exp2(_ceil_log2(step))
    else:
        if RULE == _RULE_MX_FLOOR:
            e = ((amax.to(tl.int32, bitcast=True) >> 23) - 127) - FMT.EMAX
        else:
            e = _ceil_log2(tl.div_rn(amax, FMT.FMAX))
        step = _exp2(tl.where(usable, tl.minimum(tl.maximum(e, -127), 127), 0))
    return step


@triton.jit
def _codes(x, step, FMT: tl.constexpr):  # type: ignore[no-untyped-def]
    # fp8(clamp(x / step)), a step per row: IEEE division as in the twin, then the clamp and
    # the byte (quantize_cast.clamped_byte).
    s = tl.div_rn(x, step[:, None])
    return clamped_byte(s, code_bound(step, FMT.FMAX, FMT.MANT)[:, None], FMT)


@triton.jit
def _quantize_blocks_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    q_ptr,
    scale_ptr,
    R,
    C,
    stride_r,
    stride_c,
    n_scale_cols,
    FMT: tl.constexpr,
    X_BF16: tl.constexpr,
    RULE: tl.constexpr,
    GIVEN: tl.constexpr,
    MX_SCALE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUPS: tl.constexpr,
    TILE_R: tl.constexpr,
):
    # Program (i, j) quantizes rows [i*TILE_R, (i+1)*TILE_R) of GROUPS consecutive blocks
    # along K. BLOCK_ROWS is 1 (a step per row of each block) or TILE_R (one step for the
    # whole tile). The scale is a contiguous (ceil(R / BLOCK_ROWS), n_scale_cols) grid:
    # float32 steps, or E8M0 bytes (MX_SCALE) whose biased exponent is the step's.
    lane = tl.arange(0, TILE_R)
    rows = tl.program_id(0) * TILE_R + lane
    s_rows = (rows // BLOCK_ROWS).to(tl.int64)
    for g in tl.range(0, GROUPS):
        sc = tl.program_id(1) * GROUPS + g
        cols = sc * BLOCK_C + tl.arange(0, BLOCK_C)
        x, mask = _load_tile(x_ptr, rows, cols, R, C, stride_r, stride_c, X_BF16)
        # sc as a vector: the interpreter's `vector & scalar` of two masks yields int32,
        # which its masked store refuses.
        s_mask = (rows < R) & (lane * 0 + sc < n_scale_cols)
        if GIVEN:
            if MX_SCALE:
                b = tl.load(scale_ptr + s_rows * n_scale_cols + sc, mask=s_mask, other=127)
                step = e8m0_step(b.to(tl.int32))
            else:
                step = tl.load(scale_ptr + s_rows * n_scale_cols + sc, mask=s_mask, other=1.0)
        else:
            amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
            if BLOCK_ROWS > 1:
                # One block spans the tile: every row gets its amax; lane 0 stores the step.
                amax_bits = tl.zeros((TILE_R,), dtype=tl.int32) + tl.max(amax_bits, axis=0)
                s_mask = s_mask & (lane == 0)
            step = _steps(amax_bits, FMT, RULE)
            if MX_SCALE:
                e8m0 = (step.to(tl.int32, bitcast=True) >> 23).to(tl.uint8)
                tl.store(scale_ptr + s_rows * n_scale_cols + sc, e8m0, mask=s_mask)
            else:
                tl.store(scale_ptr + s_rows * n_scale_cols + sc, step, mask=s_mask)
        code = _codes(x, step, FMT)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], code, mask=mask)


@triton.jit
def _quantize_rows_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    q_ptr,
    step_ptr,
    R,
    C,
    stride_r,
    stride_c,
    FMT: tl.constexpr,
    X_BF16: tl.constexpr,
    RULE: tl.constexpr,
    GIVEN: tl.constexpr,
    TILE_R: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One step per row: the program reads its TILE_R rows CHUNK columns at a time, once for
    # the amax, once for the codes.
    rows = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    r_mask = rows < R
    if GIVEN:
        step = tl.load(step_ptr + rows, mask=r_mask, other=1.0)
    else:
        amax_bits = tl.zeros((TILE_R,), dtype=tl.int32)
        for c0 in tl.range(0, C, CHUNK):
            x, mask = _load_tile(
                x_ptr, rows, c0 + tl.arange(0, CHUNK), R, C, stride_r, stride_c, X_BF16
            )
            bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            amax_bits = tl.maximum(amax_bits, tl.max(bits, axis=1))
        step = _steps(amax_bits, FMT, RULE)
        tl.store(step_ptr + rows, step, mask=r_mask)
    for c0 in tl.range(0, C, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        x, mask = _load_tile(x_ptr, rows, cols, R, C, stride_r, stride_c, X_BF16)
        code = _codes(x, step, FMT)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :], code, mask=mask)


# ---------------------------------------------------------------------------------------
# The launcher: check constraints, allocate, launch.


def _check(
    x: torch.Tensor, fp8: torch.dtype, block: tuple[int, int | None], rule: str
) -> torch.dtype:
    check_fp8(fp8)
    if x.dtype not in FLOAT_DTYPES or x.dim() != 2:
        raise ValueError(
            f"quantize_blocks reads a 2-D bf16, fp16 or fp32 tensor (any strides); got "
            f"{x.dtype}, shape {tuple(x.shape)}"
        )
    if block not in _BLOCKS:
        raise ValueError(f"block (rows, cols) must be one of {_BLOCKS}, got {block}")
    if rule not in RULES:
        raise ValueError(f"unknown step rule {rule!r}; accepted: {', '.join(RULES)}")
    if rule.startswith("mx") and block[1] is None:
        raise ValueError("the MX rules give E8M0 steps to blocks along K, not whole rows")
    return torch.float8_e8m0fnu if rule.startswith("mx") else torch.float32


def quantize_blocks(
    *,
    x: torch.Tensor,
    fp8: torch.dtype,
    block_rows: int,
    block_cols: int | None,
    rule: Rule,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` (2-D, ``R x C``, any strides) quantized block by block.

    A block is ``block_rows x block_cols``: ``(1, None)`` (a whole row), ``(1, 32)``,
    ``(1, 128)`` or ``(128, 128)``. ``q`` is a contiguous ``R x C`` fp8 tensor; ``scale``
    is the contiguous grid ``(ceil(R / block_rows), ceil(C / block_cols))`` (one column for
    whole rows) of float32 steps, or of E8M0 for the MX rules. ``scale=None`` measures each
    block's step by ``rule``; a given grid (float32, or E8M0 for the MX rules) is used as is
    and returned. Pass ``x.t()`` for the column-wise quantize.
    """
    block = (block_rows, block_cols)
    scale_dtype = _check(x, fp8, block, rule)
    rows, cols = x.shape
    grid_shape = (-(-rows // block_rows), 1 if block_cols is None else -(-cols // block_cols))
    if scale is None:
        out = torch.empty(grid_shape, dtype=scale_dtype, device=x.device)
    elif (
        scale.dtype != scale_dtype
        or tuple(scale.shape) != grid_shape
        or scale.device != x.device
        or not scale.is_contiguous()
    ):
        raise ValueError(
            f"scale must be a contiguous {scale_dtype} tensor of shape {grid_shape} on "
            f"{x.device}; got {scale.dtype}, shape {tuple(scale.shape)} on {scale.device}"
        )
    else:
        out = scale
    q = torch.empty((rows, cols), dtype=fp8, device=x.device)
    if rows == 0 or grid_shape[1] == 0:  # nothing to read: an empty grid, or no rows
        return q, out
    args = (
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        q.view(torch.uint8),
        out.view(torch.uint8) if scale_dtype != torch.float32 else out,
        rows,
        cols,
        x.stride(0),
        x.stride(1),
    )
    consts = dict(FMT=fp8_constants(fp8), X_BF16=x.dtype == torch.bfloat16, RULE=RULES[rule])
    if block_cols is None:
        tile_r, chunk, warps = _ROW_TILE
        _quantize_rows_kernel[(triton.cdiv(rows, tile_r),)](
            *args, **consts, GIVEN=scale is not None, TILE_R=tile_r, CHUNK=chunk, num_warps=warps
        )
        return q, out
    tile_r, groups, warps = _TILES[(block_rows, block_cols)]
    _quantize_blocks_kernel[(triton.cdiv(rows, tile_r), triton.cdiv(grid_shape[1], groups))](
        *args,
        grid_shape[1],
        **consts,
        GIVEN=scale is not None,
        MX_SCALE=scale_dtype != torch.float32,
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_cols,
        GROUPS=groups,
        TILE_R=tile_r,
        num_warps=warps,
    )
    return q, out
