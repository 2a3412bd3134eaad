"""Grouped scaled fp8 wgrad: ``out[g] = (a[:, rows_g] * steps_a) @ (b[:, rows_g] * steps_b).T``,
the contraction over each group's own rows.

``a`` is ``dY.T`` codes ``[N, M]`` and ``b`` ``X.T`` codes ``[K, M]`` (any strides: typically
``.t()`` views), ``offs`` int32 ``(E,)`` the groups' cumulative end offsets along M (rows past
``offs[E-1]`` belong to no group). The result is float32 ``[E, N, K]``; a group with no rows
gives zeros. Scales are group-local along M, in blocks of width ``W`` that restart at each
group's first row (a group's partial last block sums the rows there are):

============  =========================  ====================================================
granularity   ``sa`` / ``sb``            group ``g``'s steps
============  =========================  ====================================================
``row``       ``(N, E)`` / ``(K, E)``    column ``g``: one step per row of the group's GEMM
``1x128``     ``(N, C)`` / ``(K, C)``    columns ``block_start[g] + j``, ``j < ceil(size/128)``
``mx``        ``(N, C)`` / ``(K, C)``    the same with ``W = 32``, ``float8_e8m0fnu``
``tensor``    ``(E,)`` / ``(E,)``        ``sa[g] * sb[g]`` for the group's whole GEMM
============  =========================  ====================================================

``block_start`` (int32 ``(E,)``, the exclusive cumulative sum of ``ceil(size_g / W)``, formed
on the device by the caller) says where each group's columns begin; ``row`` and ``tensor``
ignore it. Group ``g`` is exactly the dense ``numerics.blockwise.reference_scaled_mm`` of
``(a[:, rows_g], b[:, rows_g])`` with those scales (``1x128`` x ``1x128``, ``row`` x ``row``,
``mx`` x ``mx``; ``tensor`` the per-tensor twin ``numerics.tensorwise.scaled_mm``).

The grid is static: the ``[N, K]`` tiles of each expert (``program_id(1)`` the group), so
no host synchronisation; each program reads its group's bounds. The K loop runs over the
group's rows ``BLOCK_K`` at a time from the group's first row, ``BLOCK_K`` dividing ``W``, and
promotes each step's partial as ``computectx.kernels.grouped_mm`` and the dense block kernel
do; the bounds and the bit-for-bit standard are theirs.
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

import math
from typing import Any, Final

import torch
import triton
import triton.language as tl

from computectx.kernels.autotune import launch_args
from computectx.kernels.fp8_codes import FP8_DTYPES
from computectx.kernels.grouped_mm import (
    check_offsets,
    check_scale,
    gemm_configs,
    group_span,
    prune_configs,
)
from computectx.kernels.scaled_mm import grouped_tile, k_major, scaled_dot, store_tile

__all__ = ["INTERPRETED", "grouped_scaled_wgrad"]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` when it
was imported); fixed at import."""

_SCALE_K: Final[dict[str, int]] = {"row": 0, "1x128": 128, "mx": 32, "tensor": 0}


def _prune(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    scale_k = int({**named_args, **kwargs}["SCALE_K"])
    return prune_configs(configs, scale_k, int(named_args["N"]), int(named_args["K"]))


@triton.autotune(
    configs=gemm_configs(32),
    key=["m_bucket", "N", "K", "layout", "SCALE_K", "E8M0"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _grouped_wgrad_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    offs_ptr,
    start_ptr,
    N,
    K,
    stride_an,
    stride_am,
    stride_bk,
    stride_bm,
    stride_ce,
    stride_cn,
    stride_ck,
    stride_sa_r,
    stride_sa_c,
    stride_sb_r,
    stride_sb_c,
    m_bucket,  # autotune key only
    layout,  # autotune key only
    SCALE_K: tl.constexpr,
    E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # This program's [BLOCK_M, BLOCK_N] tile of out[g] ([N, K]), g = program_id(1).
    g = tl.program_id(1)
    pid_m, pid_n = grouped_tile(N, K, BLOCK_M, BLOCK_N, GROUP_M)
    first, size = group_span(offs_ptr, g)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (first + offs_k).to(tl.int64)  # the group's rows of M, BLOCK_K at a time
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_an + rows[None, :] * stride_am
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bk + rows[:, None] * stride_bm
    ok_m = offs_m < N
    ok_n = offs_n < K
    mask_m = ok_m[:, None]
    mask_n = ok_n[None, :]
    # Row and tensor steps: column g; blocks: the group's first column, then one per W rows.
    col = g if SCALE_K == 0 else tl.load(start_ptr + g)

    # The group's partial last block sums the rows there are (masked lanes load 0).
    out = scaled_dot(
        a_ptrs,
        b_ptrs,
        stride_am,
        stride_bm,
        mask_m,
        mask_n,
        offs_k,
        size,
        tl.cdiv(size, BLOCK_K),
        sa_ptr,
        offs_m,
        ok_m,
        stride_sa_r,
        stride_sa_c,
        sb_ptr,
        offs_n,
        ok_n,
        stride_sb_r,
        stride_sb_c,
        col,
        SCALE_K,
        1,
        1,
        E8M0,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    out = tl.where(size > 0, out, 0.0)  # no rows: zeros, whatever the unused steps hold
    store_tile(
        c_ptr + g.to(tl.int64) * stride_ce, out, c_ptr, offs_m, offs_n, mask_m, mask_n, K,
        stride_cn, stride_ck, False, False,
    )  # fmt: skip


def grouped_scaled_wgrad(
    *,
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    block_start: torch.Tensor,
    granularity: str,
) -> torch.Tensor:
    """The new float32 ``[E, N, K]`` result: ``out[g]`` is group ``g``'s rows of ``a [N, M]``
    times those of ``b [K, M]``, transposed, with their group-local scales (the module
    docstring's table). ``ValueError`` for another granularity, operands or scales of the
    wrong dtype or shape, ``offs`` or ``block_start`` not int32 ``(E,)``; their values are
    not checked (nor, for the block granularities, the scales' column count ``C``)."""
    if granularity not in _SCALE_K:
        raise ValueError(
            f"grouped_scaled_wgrad takes granularity {sorted(_SCALE_K)}; got {granularity!r}"
        )
    scale_k = _SCALE_K[granularity]
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES or a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"a [N, M] and b [K, M] are 2-D fp8 tensors; got {a.dtype} {tuple(a.shape)}, "
            f"{b.dtype} {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[1] or b.device != a.device:
        raise ValueError(
            f"a [N, M] and b [K, M] share M and a device; got {tuple(a.shape)} on {a.device}, "
            f"{tuple(b.shape)} on {b.device}"
        )
    n, m = a.shape
    k = b.shape[0]
    check_offsets("offs", offs, None, a.device)
    e = offs.shape[0]
    check_offsets("block_start", block_start, e, a.device)
    e8m0 = scale_k == 32
    if granularity == "tensor":
        sa = check_scale("sa", sa, (e,), False, a.device)
        sb = check_scale("sb", sb, (e,), False, a.device)
        sa_strides, sb_strides = (0, sa.stride(0)), (0, sb.stride(0))
    else:
        cols = e if granularity == "row" else sa.shape[-1]
        sa = check_scale("sa", sa, (n, cols), e8m0, a.device)
        sb = check_scale("sb", sb, (k, cols), e8m0, a.device)
        sa_strides, sb_strides = (sa.stride(0), sa.stride(1)), (sb.stride(0), sb.stride(1))
    c = torch.empty((e, n, k), dtype=torch.float32, device=a.device)
    if c.numel() == 0:
        return c
    if m == 0 or sa.numel() == 0:
        # No rows in any group (block scales then have no columns): nothing to point at.
        return c.zero_()
    a, b = k_major(a, b)  # M-major copies for a GPU build: M is each group's contraction

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(k, meta["BLOCK_N"]), e)

    _grouped_wgrad_kernel[grid](
        a,
        b,
        c,
        sa,
        sb,
        offs,
        block_start,
        n,
        k,
        *launch_args(a, b, c, sa_strides, sb_strides, m),  # a [N, M], b [K, M], c [E, N, K]
        SCALE_K=scale_k,
        E8M0=e8m0,
    )
    if INTERPRETED:
        _nan_through(c, a, b, offs)
    return c


def _nan_through(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    # The interpreter's tl.dot reads the fp8 NaN byte as a number (grouped_mm.nan_through):
    # a NaN in a[j] or b[i] among group g's columns makes out[g][j, :] or out[g][:, i] NaN, as
    # a GPU's fp8 MMA and the twin give. Device ops: per-group counts from prefix sums.
    def per_group(t: torch.Tensor) -> torch.Tensor:  # (E, rows): NaNs among g's columns
        seen = torch.nn.functional.pad(torch.isnan(t.to(torch.float32)).cumsum(1), (1, 0))
        ends = offs.to(torch.int64)
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        return (seen[:, ends] - seen[:, starts]).t() > 0

    mask = per_group(a).unsqueeze(2) | per_group(b).unsqueeze(1)
    c.masked_fill_(mask, math.nan)
