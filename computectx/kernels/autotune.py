"""The GEMM kernels' autotune configs: the tile shapes they try on a GPU (``HOPPER_TILES``),
the configs' form compiled and interpreted (``tile_configs``), the filter that keeps the
tiles an output fits (``fitting_configs``) and the launch arguments that carry the strides
and the autotune keys (``launch_args``). Shared by ``scaled_mm``, ``scaled_mm_blocks``,
``grouped_mm`` and ``grouped_wgrad``; plain python, no kernel (each caller says whether its
kernels run interpreted: a module reloaded for the interpreter asks with its own flag)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch
import triton

__all__ = ["HOPPER_TILES", "fitting_configs", "launch_args", "tile_configs"]


HOPPER_TILES: Final[dict[str, tuple[tuple[int, int, int, int, int], ...]]] = {
    # The GEMMs' autotune shapes on a GPU, (BLOCK_M, BLOCK_N, BLOCK_K, num_stages,
    # num_warps). Hopper's fp8 wgmma wants 64-row warpgroup tiles and 128-byte K slices;
    # 3-4 stages of cp.async pipelining hide HBM latency within 228 KB of shared memory per
    # SM. Per-tensor steps:
    "tensorwise": (
        (128, 256, 128, 3, 8),
        (256, 128, 128, 3, 8),
        (128, 256, 64, 4, 8),
        (256, 128, 64, 4, 8),
        (128, 128, 128, 4, 8),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 4, 8),
        (64, 128, 128, 4, 4),
        (64, 64, 128, 4, 4),
    ),
    # Block scales: one 128-wide scale block per K step where it fits in shared memory,
    # else two 64-wide steps; 32-wide steps for MX.
    "blockwise": (
        (128, 128, 128, 4, 8),
        (128, 256, 128, 3, 8),
        (256, 128, 128, 3, 8),
        (128, 256, 64, 4, 8),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (128, 128, 32, 5, 4),
        (128, 256, 32, 4, 8),
        (64, 64, 32, 4, 4),
    ),
    # The grouped GEMMs (forward, dgrad, wgrad): the block shapes with smaller row tiles
    # for an expert's share of the tokens.
    "grouped": (
        (128, 128, 128, 4, 8),
        (128, 256, 128, 3, 8),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 128, 32, 5, 4),
        (64, 128, 32, 4, 4),
        (64, 64, 32, 4, 4),
    ),
}


def tile_configs(
    kernel: str, interpreted: bool, interpreted_m: int, interpreted_k: Sequence[int]
) -> list[triton.Config]:
    """``kernel``'s autotune configs (a key of ``HOPPER_TILES``): compiled, one per shape,
    each launched in groups of ``GROUP_M`` 8 row-tiles; interpreted, ``interpreted_m x 32``
    tiles with each ``BLOCK_K`` of ``interpreted_k`` (small, so test shapes span several
    programs; with one config the autotuner never benchmarks)."""
    if interpreted:
        return [
            triton.Config({"BLOCK_M": interpreted_m, "BLOCK_N": 32, "BLOCK_K": bk, "GROUP_M": 4})
            for bk in interpreted_k
        ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_stages=stages,
            num_warps=warps,
        )
        for bm, bn, bk, stages, warps in HOPPER_TILES[kernel]
    ]


def fitting_configs(configs: list[triton.Config], m: int, n: int) -> list[triton.Config]:
    """Those of ``configs`` whose tile is not far taller or wider than an ``m x n`` result
    (at most ``max(64, m)`` rows and ``max(64, n)`` columns): larger ones only waste work."""
    return [
        c
        for c in configs
        if c.kwargs["BLOCK_M"] <= max(64, m) and c.kwargs["BLOCK_N"] <= max(64, n)
    ]


def launch_args(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    sa_strides: Sequence[int],
    sb_strides: Sequence[int],
    m: int,
) -> tuple[int, ...]:
    """A GEMM kernel's launch arguments after its pointers and sizes: every stride of ``a``,
    ``b`` and ``c``, the scales' strides, then its two autotune keys, ``m_bucket`` (``m``, the
    dimension that changes from call to call, rounded up to a power of two, so a new token
    count does not tune again) and ``layout`` (which operands are contiguous along their last,
    contracted, dimension: 1 for ``a``, 2 for ``b``)."""
    return (
        *a.stride(),
        *b.stride(),
        *c.stride(),
        *sa_strides,
        *sb_strides,
        triton.next_power_of_2(m),
        int(a.stride(-1) == 1) + 2 * int(b.stride(-1) == 1),
    )
