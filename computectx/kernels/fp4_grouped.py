"""The 4-bit grouped GEMMs of mixture-of-experts layers on block-scaled tensor cores: the
forward/dgrad (``fp4_grouped_scaled_mm``) and the wgrad (``fp4_grouped_scaled_wgrad``), each
group exactly the dense kernel of ``computectx.kernels.fp4_gemm`` on its own rows.

Both take operands already quantized per group, as the twins make them
(``numerics.fp4_gemm.reference_fp4_grouped_mm`` and ``reference_fp4_grouped_wgrad``): each
group's rows quantized with their own per-tensor amax (NVFP4), so the amaxes are one per
group, float32 ``(E,)``, and NVFP4's tensor-scale factor is the group's,
``(amax_a[g] * amax_b[g]) * f32(1 / (6 * 6 * 448 * 448))``. MXFP4 has no amax (``None``).

**Forward and dgrad**: ``a`` ``[M, K / 2]`` codes (tokens sorted by expert, 1x16 or 1x32 row
blocks), ``b`` ``[E, N, K / 2]`` (expert ``g``'s matrix at the weight tile: 1x16 or 16x16,
1x32), ``offs`` int32 ``(E,)`` each group's end row (torch's ``F.grouped_mm`` convention, as
``computectx.kernels.grouped_mm``): group ``g`` is rows ``offs[g-1]:offs[g]``, rows past
``offs[E-1]`` come out zero. The grid is an upper bound with no host synchronisation,
``cdiv(M, BLOCK_M) + E`` row tiles by the column tiles, each program finding its group and
rows from ``offs`` (``grouped_mm.group_row_tile``).

**Wgrad**: ``dW[g] = dY[rows of g]ᵀ X[rows of g]``, float32 ``[E, N, K]``, from the two
column-wise operands: ``a`` ``[N, P / 2]`` (dYᵀ) and ``b`` ``[K, P / 2]`` (Xᵀ), the groups'
padded token columns side by side (each group zero-padded to a multiple of the block, and of 16
under the Hadamard transform, as ``numerics.fp4_gemm.wgrad_operand`` pads it), ``offs`` int32
``(E,)`` each group's end column in that padded layout. Each group starts on a block boundary,
so its scale columns start at ``start / block``. One program per ``[N, K]`` tile of each
expert (``program_id(1)`` the group); an empty group gives zeros.

The values of ``offs`` are not read on the host (that would synchronise): they must be
non-decreasing, within the operand, and (wgrad) multiples of the block. The arithmetic, the
devices and the interpreter's E4M3 scales are the dense kernel's (its module docstring).
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

from typing import Any, Final

import torch
import triton
import triton.language as tl

from computectx.kernels.autotune import launch_args
from computectx.kernels.fp4_args import (
    FP4_TILES,
    amax_arg,
    check_scale_devices,
    codes_pair,
    scale_arg,
)
from computectx.kernels.fp4_gemm import (
    ALPHA_FACTOR_INV,
    BUILD_OPTIONS,
    check_device,
    e4m3_scales_interpreted,
    fp4_block_dot,
    fp4_configs,
    tensor_alpha,
)
from computectx.kernels.fp8_codes import FLOAT_DTYPES
from computectx.kernels.grouped_mm import check_offsets, group_span, group_tile
from computectx.kernels.scaled_mm import grouped_tile, store_tile

__all__ = ["INTERPRETED", "fp4_grouped_scaled_mm", "fp4_grouped_scaled_wgrad"]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernels run in Triton's interpreter; fixed at import."""


_CONFIGS = fp4_configs(interpreted_block_m=16)
"""Interpreted: 16-row tiles, so small test groups span several programs."""


@triton.jit
def _group_alpha(  # type: ignore[no-untyped-def]
    amax_a_ptr, amax_b_ptr, g, VEC: tl.constexpr, ALPHA_INV: tl.constexpr
):
    # NVFP4: group g's tensor-scale factor, as the dense kernel's; MXFP4: 1.
    if VEC == 16:
        return tensor_alpha(tl.load(amax_a_ptr + g), tl.load(amax_b_ptr + g), ALPHA_INV)
    return 1.0


@triton.autotune(
    configs=_CONFIGS,
    key=["m_bucket", "N", "K_BYTES", "E", "layout", "VEC", "ROWS_B", "OUT_BF16"],
)
@triton.jit
def _fp4_grouped_mm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    amax_a_ptr,
    amax_b_ptr,
    offs_ptr,
    M,
    N,
    K_BYTES,
    E,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_sa_r,
    stride_sa_k,
    stride_sb_e,
    stride_sb_r,
    stride_sb_k,
    m_bucket,  # autotune key only
    layout,  # autotune key only
    VEC: tl.constexpr,
    ROWS_B: tl.constexpr,
    ALPHA_INV: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # One row tile of one group (or of the tail: zeros; or spare: nothing) by BLOCK_N columns.
    active, ge, offs_m, offs_n, rows_ok = group_tile(
        offs_ptr, E, M, N, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = fp4_block_dot(
        acc, a_ptr, b_ptr + ge * stride_be, sa_ptr, sb_ptr + ge * stride_sb_e,
        offs_m, rows_ok, offs_n, offs_n < N, tl.where(active, K_BYTES, 0),
        stride_am, stride_ak, stride_bn, stride_bk, stride_sa_r, stride_sa_k, stride_sb_r,
        stride_sb_k, VEC, 1, ROWS_B, BLOCK_K,
    )  # fmt: skip
    acc = tl.where(active, acc * _group_alpha(amax_a_ptr, amax_b_ptr, ge, VEC, ALPHA_INV), 0.0)
    store_tile(
        c_ptr, acc, c_ptr, offs_m, offs_n, rows_ok[:, None], offs_n[None, :] < N, N, stride_cm,
        stride_cn, False, OUT_BF16,
    )  # fmt: skip


def fp4_grouped_scaled_mm(
    *,
    a: torch.Tensor,
    scale_a: torch.Tensor,
    amax_a: torch.Tensor | None,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    amax_b: torch.Tensor | None,
    tile_b: str,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The new ``[M, N]`` ``out_dtype`` result: group ``g``'s rows of ``a`` times ``b[g].T``
    (module docstring). ``a`` ``[M, K / 2]`` codes with scales ``[M, K / w]`` (NVFP4 1x16, or
    MXFP4 1x32 when ``tile_b`` is ``"1x32"``); ``b`` ``[E, N, K / 2]`` with scales ``[E, N /
    tile rows, K / w]``; ``amax_a``/``amax_b`` float32 ``(E,)`` (NVFP4) or ``None``; ``offs``
    int32 ``(E,)``. ``ValueError`` naming any argument of the wrong kind or shape, or a device
    without FP4 tensor cores (compiled)."""
    if tile_b not in FP4_TILES:
        raise ValueError(f"tile_b must be one of {tuple(FP4_TILES)}, got {tile_b!r}")
    nvfp4 = tile_b != "1x32"
    a8, b8 = codes_pair(a, b, ("[M, K / 2]", "[E, N, K / 2]", "K"), b_dims=3)
    m, k = a.shape[0], 2 * a.shape[1]
    e, n = b.shape[0], b.shape[1]
    sa = scale_arg("scale_a", scale_a, m, k, "1x16" if nvfp4 else "1x32")
    sb = scale_arg("scale_b", scale_b, n, k, tile_b, groups=e)
    am = amax_arg("amax_a", amax_a, nvfp4, a.device, e)
    bm = amax_arg("amax_b", amax_b, nvfp4, a.device, e)
    check_offsets("offs", offs, e, a.device)
    check_scale_devices(sa, sb, a.device)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    check_device(a.device)  # last: every argument's own error first, on any device
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0 or e == 0:
        # An empty sum (and codes with no storage), or no groups: every row is zero.
        return c.zero_()

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return ((triton.cdiv(m, meta["BLOCK_M"]) + e) * triton.cdiv(n, meta["BLOCK_N"]),)

    with e4m3_scales_interpreted():
        _fp4_grouped_mm_kernel[grid](
            a8, b8, c, sa, sb, am if am is not None else c, bm if bm is not None else c, offs,
            m, n, k // 2, e, *launch_args(a8, b8, c, sa.stride(), sb.stride(), m),
            VEC=FP4_TILES[tile_b][1], ROWS_B=FP4_TILES[tile_b][0], ALPHA_INV=ALPHA_FACTOR_INV,
            OUT_BF16=out_dtype == torch.bfloat16, BLOCK_E=triton.next_power_of_2(e + 1),
            **BUILD_OPTIONS,
        )  # fmt: skip
    return c


@triton.autotune(configs=_CONFIGS, key=["m_bucket", "N", "K", "layout", "VEC"])
@triton.jit
def _fp4_grouped_wgrad_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    amax_a_ptr,
    amax_b_ptr,
    offs_ptr,
    N,
    K,
    stride_an,
    stride_ap,
    stride_bk,
    stride_bp,
    stride_ce,
    stride_cn,
    stride_ck,
    stride_sa_r,
    stride_sa_c,
    stride_sb_r,
    stride_sb_c,
    m_bucket,  # autotune key only
    layout,  # autotune key only
    VEC: tl.constexpr,
    ALPHA_INV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # This program's [BLOCK_M, BLOCK_N] tile of dW[g] ([N, K]), g = program_id(1): the
    # contraction over the group's padded columns start:end, block-aligned.
    g = tl.program_id(1)
    pid_m, pid_n = grouped_tile(N, K, BLOCK_M, BLOCK_N, GROUP_M)
    start, size = group_span(offs_ptr, g)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    byte0 = (start // 2).to(tl.int64)
    col0 = (start // VEC).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = fp4_block_dot(
        acc, a_ptr + byte0 * stride_ap, b_ptr + byte0 * stride_bp, sa_ptr + col0 * stride_sa_c,
        sb_ptr + col0 * stride_sb_c, offs_m, offs_m < N, offs_n, offs_n < K,
        tl.maximum(size, 0) // 2, stride_an, stride_ap, stride_bk, stride_bp, stride_sa_r,
        stride_sa_c, stride_sb_r, stride_sb_c, VEC, 1, 1, BLOCK_K,
    )  # fmt: skip
    acc = tl.where(size > 0, acc * _group_alpha(amax_a_ptr, amax_b_ptr, g, VEC, ALPHA_INV), 0.0)
    store_tile(
        c_ptr + g.to(tl.int64) * stride_ce, acc, c_ptr, offs_m, offs_n, offs_m[:, None] < N,
        offs_n[None, :] < K, K, stride_cn, stride_ck, False, False,
    )  # fmt: skip


def fp4_grouped_scaled_wgrad(
    *,
    a: torch.Tensor,
    scale_a: torch.Tensor,
    amax_a: torch.Tensor | None,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    amax_b: torch.Tensor | None,
    tile: str,
    offs: torch.Tensor,
) -> torch.Tensor:
    """The new float32 ``[E, N, K]`` result: ``dW[g]``, group ``g``'s padded columns of ``a``
    ``[N, P / 2]`` times those of ``b`` ``[K, P / 2]``, transposed (module docstring); scales
    ``[N, P / w]`` and ``[K, P / w]`` at ``tile`` (``"1x16"``: NVFP4, ``"1x32"``: MXFP4);
    ``amax_a``/``amax_b`` float32 ``(E,)`` (NVFP4) or ``None``; ``offs`` int32 ``(E,)`` the
    groups' end columns (multiples of the block). ``ValueError`` as ``fp4_grouped_scaled_mm``."""
    if tile not in ("1x16", "1x32"):
        raise ValueError(f"tile must be '1x16' (NVFP4) or '1x32' (MXFP4), got {tile!r}")
    nvfp4 = tile == "1x16"
    a8, b8 = codes_pair(a, b, ("[N, P / 2]", "[K, P / 2]", "P"))
    n, k, p = a.shape[0], b.shape[0], 2 * a.shape[1]
    check_offsets("offs", offs, None, a.device)
    e = offs.shape[0]
    sa = scale_arg("scale_a", scale_a, n, p, tile)
    sb = scale_arg("scale_b", scale_b, k, p, tile)
    am = amax_arg("amax_a", amax_a, nvfp4, a.device, e)
    bm = amax_arg("amax_b", amax_b, nvfp4, a.device, e)
    check_scale_devices(sa, sb, a.device)
    check_device(a.device)
    c = torch.empty((e, n, k), dtype=torch.float32, device=a.device)
    if e == 0 or n == 0 or k == 0:
        return c
    if p == 0:
        return c.zero_()

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]), e)

    with e4m3_scales_interpreted():
        _fp4_grouped_wgrad_kernel[grid](
            a8, b8, c, sa, sb, am if am is not None else c, bm if bm is not None else c, offs,
            n, k, a8.stride(0), a8.stride(1), b8.stride(0), b8.stride(1), *c.stride(),
            *sa.stride(), *sb.stride(), triton.next_power_of_2(p),
            int(a8.stride(1) == 1) + 2 * int(b8.stride(1) == 1),
            VEC=FP4_TILES[tile][1], ALPHA_INV=ALPHA_FACTOR_INV, **BUILD_OPTIONS,
        )  # fmt: skip
    return c
