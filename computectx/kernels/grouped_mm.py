"""Grouped scaled fp8 GEMM (the MoE forward and dgrad): row ``i`` of group ``g`` is
``(a[i] * steps_a) @ (b[g] * steps_b).T``, groups given by cumulative end offsets.

``a`` is ``[M, K]`` fp8 codes (tokens sorted by expert) and ``b`` ``[E, N, K]`` fp8 codes
(one ``[N, K]`` matrix per expert; any strides, so dgrad hands in ``w.transpose(1, 2)``:
the last dimension of ``b`` is always contracted with the last of ``a``). ``offs`` is int32
``(E,)``, torch's ``F.grouped_mm`` convention: group ``g`` is rows ``offs[g-1]:offs[g]``
(``offs[-1]`` read as 0); rows past ``offs[E-1]`` come out zero. Each group is exactly the
dense block-scaled GEMM of ``computectx.kernels.scaled_mm_blocks`` (twin:
``numerics.blockwise.reference_scaled_mm``) of its rows with its expert, for the pairs

==================  ==========================  ===================================
``(ga, gb)``        ``sa``                      ``sb``
==================  ==========================  ===================================
``row, row``        ``(M, 1)`` float32          ``(E, N, 1)`` float32
``1x128, 1x128``    ``(M, ceil(K/128))``        ``(E, N, ceil(K/128))``
``1x128, 128x128``  ``(M, ceil(K/128))``        ``(E, ceil(N/128), ceil(K/128))``
``mx, mx``          ``(M, ceil(K/32))`` E8M0    ``(E, N, ceil(K/32))`` E8M0
``tensor, tensor``  ``(E,)`` float32, per group  ``(E,)`` float32, per expert
==================  ==========================  ===================================

``tensor`` is the per-tensor twin ``numerics.tensorwise.scaled_mm`` per group: the float32
sum over K times ``sa[g] * sb[g]`` once, as ``row`` (one step per row) is.

No host synchronisation: the grid is an upper bound, ``cdiv(M, BLOCK_M) + E`` row-tiles (a
group's rows cut into ``BLOCK_M``-row tiles, then the rows past ``offs[E-1]``, cost at most
one partial tile each) by the column tiles. Each program reads ``offs`` and finds its
group and row tile (``group_row_tile``); the tail's programs store zeros, the spare ones
store nothing. The K loop, the scales and the epilogue are the dense block kernel's; the
wgrad, which contracts over each group's rows, is ``computectx.kernels.grouped_wgrad``.
Under the interpreter the dot is float32 and each group agrees with its dense twin within
``numerics.blockwise.scaled_mm_error_bound``, bit for bit when every partial sum is
exact; on sm_90 within the bound for ``NARROW_ACCUMULATION``, as the dense kernels.
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

import math
from typing import Any, Final

import torch
import triton
import triton.language as tl

from computectx.kernels.autotune import fitting_configs, launch_args, tile_configs
from computectx.kernels.fp8_codes import FLOAT_DTYPES, FP8_DTYPES
from computectx.kernels.scaled_mm import (
    grouped_tile,
    scaled_dot,
    store_tile,
)

__all__ = [
    "INTERPRETED",
    "check_offsets",
    "check_scale",
    "gemm_configs",
    "grouped_scaled_mm",
    "nan_through",
    "prune_configs",
    "scale_block",
]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` when it
was imported); fixed at import."""

_FWD_PAIRS: Final[dict[tuple[str, str], tuple[int, int]]] = {
    # (granularity_a, granularity_b) -> (SCALE_K, BLOCK_ROWS_B)
    ("row", "row"): (0, 1),
    ("1x128", "1x128"): (128, 1),
    ("1x128", "128x128"): (128, 128),
    ("mx", "mx"): (32, 1),
    ("tensor", "tensor"): (0, 1),
}


def gemm_configs(block_m: int) -> list[triton.Config]:
    """The autotune configs of the grouped kernels. Interpreted: ``block_m`` x 32 tiles with
    ``BLOCK_K`` 64 (a 128-wide scale block in two steps) or 32 (MX), so small test groups
    span several programs; ``prune_configs`` keeps one. Compiled: ``HOPPER_TILES["grouped"]``
    (64-row warpgroup tiles; 128- or 64-wide K steps, 32 for MX)."""
    return tile_configs("grouped", INTERPRETED, block_m, (64, 32))


def prune_configs(
    configs: list[triton.Config], scale_k: int, m: int, n: int
) -> list[triton.Config]:
    """Those of ``configs`` whose ``BLOCK_K`` divides the scale block ``scale_k`` (any for
    0: one step per row or tensor) and whose tile fits an ``m x n`` result (the smallest
    tile when none does); interpreted, the one with the widest such ``BLOCK_K``."""
    ok = [c for c in configs if scale_k == 0 or scale_k % c.kwargs["BLOCK_K"] == 0]
    if INTERPRETED:
        return [max(ok, key=lambda c: c.kwargs["BLOCK_K"])]
    return fitting_configs(ok, m, n) or [
        min(ok, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
    ]


def _prune(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    # Tiles sized for an average group (M / E rows) by N. (Keyword arguments in kwargs.)
    scale_k = int({**named_args, **kwargs}["SCALE_K"])
    m, e, n = int(named_args["M"]), int(named_args["E"]), int(named_args["N"])
    return prune_configs(configs, scale_k, max(1, m // max(1, e)), n)


@triton.jit
def group_row_tile(  # type: ignore[no-untyped-def]
    offs_ptr, E, M, t, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr
):
    # Row tile t of the launch: (group, first row, end row). Group g < E spans rows
    # offs[g-1]:offs[g] in cdiv(size, BLOCK_M) tiles, in order; "group" E is the tail
    # offs[E-1]:M; a t past every tile gets an end at or before its first row (no rows).
    idx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)
    ends = tl.where(idx < E, ends, M)
    starts = tl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx <= E), other=0)
    starts = tl.where(idx <= E, starts, M)
    tiles = tl.maximum(ends - starts + BLOCK_M - 1, 0) // BLOCK_M
    cum = tl.cumsum(tiles, 0)
    g = tl.sum((cum <= t).to(tl.int32), 0)  # groups whose tiles all come before t
    before = tl.sum(tl.where(idx < g, tiles, 0), 0)
    start = tl.sum(tl.where(idx == g, starts, 0), 0)
    end = tl.sum(tl.where(idx == g, ends, 0), 0)
    return g, start + (t - before) * BLOCK_M, end


@triton.jit
def group_tile(  # type: ignore[no-untyped-def]
    offs_ptr,
    E,
    M,
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # This program's tile of a forward/dgrad launch over cdiv(M, BLOCK_M) + E row tiles (in
    # grouped launch order): (active: a group's tile, not the tail's (zeros) nor a spare
    # program's; the group clamped to E - 1, as int64; its rows, the columns, which rows
    # are the group's and in the operand).
    row_tiles = tl.cdiv(M, BLOCK_M) + E
    t, pid_n = grouped_tile(row_tiles * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    g, row0, end = group_row_tile(offs_ptr, E, M, t, BLOCK_M, BLOCK_E)
    ge = tl.minimum(g, E - 1).to(tl.int64)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = (offs_m >= 0) & (offs_m < end) & (offs_m < M)
    return g < E, ge, offs_m, offs_n, rows_ok


@triton.jit
def group_span(offs_ptr, g):  # type: ignore[no-untyped-def]
    # Group g's (first, size) from offs, each group's end: it starts where g - 1 ends.
    first = tl.load(offs_ptr + tl.maximum(g - 1, 0))
    first = tl.where(g > 0, first, 0)
    return first, tl.load(offs_ptr + g) - first


@triton.autotune(
    configs=gemm_configs(16),
    # Per power-of-two bucket of M (token counts change every step; N, K and E are a
    # layer's), per operand layout and recipe.
    key=["m_bucket", "N", "K", "E", "layout", "SCALE_K", "BLOCK_ROWS_B", "E8M0", "OUT_BF16"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _grouped_mm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    offs_ptr,
    M,
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_sa_e,
    stride_sa_r,
    stride_sa_k,
    stride_sb_e,
    stride_sb_r,
    stride_sb_k,
    m_bucket,  # autotune key only
    layout,  # autotune key only
    SCALE_K: tl.constexpr,
    BLOCK_ROWS_B: tl.constexpr,
    E8M0: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    active, ge, offs_m, offs_n, rows_ok = group_tile(
        offs_ptr, E, M, N, BLOCK_M, BLOCK_N, BLOCK_E, GROUP_M
    )
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows_ok[:, None]
    mask_n = offs_n[None, :] < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (
        b_ptr
        + ge * stride_be
        + offs_n[None, :].to(tl.int64) * stride_bn
        + offs_k[:, None] * stride_bk
    )
    sa_base = sa_ptr + ge * stride_sa_e
    sb_base = sb_ptr + ge * stride_sb_e

    out = scaled_dot(
        a_ptrs,
        b_ptrs,
        stride_ak,
        stride_bk,
        mask_m,
        mask_n,
        offs_k,
        K,
        tl.where(active, tl.cdiv(K, BLOCK_K), 0),
        sa_base,
        offs_m,
        rows_ok,
        stride_sa_r,
        stride_sa_k,
        sb_base,
        offs_n,
        offs_n < N,
        stride_sb_r,
        stride_sb_k,
        0,
        SCALE_K,
        1,
        BLOCK_ROWS_B,
        E8M0,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    out = tl.where(active, out, 0.0)
    store_tile(
        c_ptr, out, c_ptr, offs_m, offs_n, mask_m, mask_n, N, stride_cm, stride_cn,
        False, OUT_BF16,
    )  # fmt: skip


def check_offsets(name: str, t: torch.Tensor, e: int | None, device: torch.device) -> None:
    """``ValueError`` unless ``t`` is a 1-D int32 tensor on ``device``, of ``(e,)`` unless
    ``e`` is None. (Its values are the caller's to check: reading them would synchronise
    with the device.)"""
    shape = "(E,)" if e is None else f"({e},)"
    bad_len = t.dim() == 1 and e is not None and t.shape[0] != e
    if t.dtype != torch.int32 or t.dim() != 1 or bad_len or t.device != device:
        raise ValueError(
            f"{name} must be an int32 tensor of shape {shape} on {device}; got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )


def check_scale(
    name: str, s: torch.Tensor, shape: tuple[int, ...], e8m0: bool, device: torch.device
) -> torch.Tensor:
    """``s`` (E8M0 read as its bytes) when it is a float32 (``e8m0``: ``float8_e8m0fnu``)
    tensor of ``shape`` on ``device``; else ``ValueError`` naming it."""
    want = torch.float8_e8m0fnu if e8m0 else torch.float32
    if s.dtype != want or tuple(s.shape) != shape or s.device != device:
        raise ValueError(
            f"{name} must be a {want} tensor of shape {shape} on {device}; got {s.dtype} "
            f"{tuple(s.shape)} on {s.device}"
        )
    return s.view(torch.uint8) if e8m0 else s


def scale_block(scale_k: int, k: int) -> int:
    """Scale columns along a contraction of ``k``: ``ceil(k / scale_k)``, 1 for 0."""
    return 1 if scale_k == 0 else -(-k // scale_k)


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES or a.dim() != 2 or b.dim() != 3:
        raise ValueError(
            f"a is a 2-D and b a 3-D fp8 tensor; got {a.dtype} {tuple(a.shape)}, "
            f"{b.dtype} {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[2] or b.device != a.device:
        raise ValueError(
            f"a [M, K] and b [E, N, K] share K and a device; got {tuple(a.shape)} on "
            f"{a.device}, {tuple(b.shape)} on {b.device}"
        )


def grouped_scaled_mm(
    *,
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    granularity_a: str,
    granularity_b: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The new ``[M, N]`` ``out_dtype`` result: group ``g``'s rows ``a[offs[g-1]:offs[g]]``
    times ``b[g].T`` with their scales (the module docstring's table), rows past
    ``offs[-1]`` zero. ``ValueError`` for another pair, operands or scales of the wrong
    dtype or shape, ``offs`` not int32 ``(E,)``; the values of ``offs`` are not checked."""
    pair = (granularity_a, granularity_b)
    if pair not in _FWD_PAIRS:
        raise ValueError(f"grouped_scaled_mm multiplies the pairs {sorted(_FWD_PAIRS)}; got {pair}")
    scale_k, rows_b = _FWD_PAIRS[pair]
    _check_operands(a, b)
    m, k = a.shape
    e, n = b.shape[0], b.shape[1]
    check_offsets("offs", offs, e, a.device)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    e8m0 = scale_k == 32
    n_kb = scale_block(scale_k, k)
    if granularity_a == "tensor":
        sa = check_scale("sa", sa, (e,), False, a.device)
        sb = check_scale("sb", sb, (e,), False, a.device)
        sa_strides = (sa.stride(0), 0, 0)
        sb_strides = (sb.stride(0), 0, 0)
    else:
        sa = check_scale("sa", sa, (m, n_kb), e8m0, a.device)
        sb = check_scale("sb", sb, (e, -(-n // rows_b), n_kb), e8m0, a.device)
        sa_strides = (0, sa.stride(0), sa.stride(1))
        sb_strides = (sb.stride(0), sb.stride(1), sb.stride(2))
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0 or e == 0:
        # An empty sum (an empty operand may have no storage to point at), or no groups.
        return c.zero_()
    if not INTERPRETED:
        # Hopper's fp8 wgmma reads K-major tiles (computectx.kernels.scaled_mm.k_major);
        # under the interpreter the strided path itself runs, so the tests cover it.
        a = a if a.stride(1) == 1 else a.contiguous()
        b = b if b.stride(2) == 1 else b.contiguous()

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return ((triton.cdiv(m, meta["BLOCK_M"]) + e) * triton.cdiv(n, meta["BLOCK_N"]),)

    _grouped_mm_kernel[grid](
        a,
        b,
        c,
        sa,
        sb,
        offs,
        m,
        n,
        k,
        e,
        *launch_args(a, b, c, sa_strides, sb_strides, m),  # a [M, K], b [E, N, K], c [M, N]
        SCALE_K=scale_k,
        BLOCK_ROWS_B=rows_b,
        E8M0=e8m0,
        OUT_BF16=out_dtype == torch.bfloat16,
        BLOCK_E=triton.next_power_of_2(e + 1),
    )
    if INTERPRETED:
        nan_through(c, a, b, offs)
    return c


def nan_through(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    """Under the interpreter, NaN where an fp8 NaN code entered ``c``'s sum, in place.

    The interpreter's ``tl.dot`` decodes the fp8 NaN byte as a number (E4M3's ``0x7F`` as
    480), where a GPU's fp8 MMA gives NaN, as the dense twin does: a NaN in ``a``'s row
    makes that output row NaN, one in ``b[g]``'s row ``j`` column ``j`` of group ``g``'s rows.
    Device ops only; rows past ``offs[-1]`` (and the never-written codes of an empty group's
    expert) are left alone."""
    m, e = a.shape[0], b.shape[0]
    rows = torch.arange(m, device=a.device, dtype=torch.int32)
    group = torch.searchsorted(offs, rows, right=True)
    nan_rows = torch.isnan(a.to(torch.float32)).any(1)
    nan_cols = torch.isnan(b.to(torch.float32)).any(2)  # (E, N)
    mask = (nan_rows.unsqueeze(1) | nan_cols[group.clamp(max=e - 1)]) & (group < e).unsqueeze(1)
    c.masked_fill_(mask, math.nan)
