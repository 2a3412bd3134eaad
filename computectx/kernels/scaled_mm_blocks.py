"""Block-scaled fp8 GEMM: ``(a * steps_a) @ (b * steps_b).T (+ bias)``, scales in the K loop.

``a`` is ``[M, K]`` and ``b`` is ``[N, K]`` fp8 codes (E4M3 or E5M2, any strides). Each
operand has one step per row (``block_k == 0``: the row-wise GEMM) or one per block of
``block_rows`` rows by ``block_k`` columns: ``1 x 128`` and ``128 x 128`` (``block_k`` 128,
float32 steps) or ``1 x 32`` (``block_k`` 32, E8M0 scales read as bytes and turned into
``2**(byte - 127)`` exactly; byte 255 is NaN).

The program owns a ``BLOCK_M x BLOCK_N`` tile of the result. Its K loop steps ``BLOCK_K``
columns at a time, ``BLOCK_K`` dividing the scale block (128 or 64 for the 128-wide blocks,
the scale read again for each 64-wide half; 32 for MX): each step's partial dot is formed
on its own in float32, multiplied by ``step_a[i, kb] * step_b[j, kb]`` and added to the
float32 accumulator (the promotion DeepSeek-V3 runs on Hopper). Row steps multiply the
accumulator once, in the epilogue. Then bias, and one rounding to the output dtype (bf16
rounded to nearest even on the bits, ``round_to_bf16``). Every edge is
masked: any M, N and K (a partial last K block sums the columns there are).

The twin is ``computectx.formats.numerics.blockwise.reference_scaled_mm``. Under the interpreter
the dot is float32 and results agree within ``numerics.blockwise.scaled_mm_error_bound``
(splitting a block into sub-steps only reorders the float32 sums the bound allows). On sm_90 the
tensor cores add one ``BLOCK_K`` step's products in a narrower accumulator (about 14 significant
bits) before it is promoted, as in DeepSeek-V3 and the per-tensor kernel: there the results agree
within the wider bound for that accumulation, ``scaled_mm_error_bound(...,
accumulation=numerics.blockwise.NARROW_ACCUMULATION)``, which the tests use on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from computectx.kernels.autotune import fitting_configs, tile_configs
from computectx.kernels.scaled_mm import (
    INTERPRETED,
    check_bias_and_out,
    check_operands,
    k_major,
    launch_tiles,
    new_result,
    scaled_tiles,
)

# INTERPRETED is scaled_mm's: the kernel this module autotunes, scaled_tiles, is decorated
# there (for the interpreter or a GPU, fixed when scaled_mm was imported).
__all__ = ["INTERPRETED", "scaled_mm_blocks"]


def _configs() -> list[triton.Config]:
    # Interpreted, 32 x 32 tiles: BLOCK_K 64 splits a 128-wide block in two (the scale read
    # twice), 32 serves MX; _prune keeps one.
    return tile_configs("blockwise", INTERPRETED, 32, (64, 32))


def _prune(
    configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any
) -> list[triton.Config]:
    # BLOCK_K must divide the scale block (any for row-wise, SCALE_K == 0); tiles far
    # larger than the problem only waste work. (Keyword arguments arrive in kwargs.)
    scale_k = int({**named_args, **kwargs}["SCALE_K"])
    m, n = int(named_args["M"]), int(named_args["N"])
    ok = [c for c in configs if scale_k == 0 or scale_k % c.kwargs["BLOCK_K"] == 0]
    if INTERPRETED:
        return [max(ok, key=lambda c: c.kwargs["BLOCK_K"])]
    return fitting_configs(ok, m, n) or [
        min(ok, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
    ]


_scaled_mm_blocks_kernel = triton.autotune(
    configs=_configs(),
    key=[
        "m_bucket",
        "N",
        "K",
        "layout",
        "SCALE_K",
        "BLOCK_ROWS_A",
        "BLOCK_ROWS_B",
        "E8M0",
        "HAS_BIAS",
        "OUT_BF16",
    ],
    prune_configs_by={"early_config_prune": _prune},
)(scaled_tiles)


def _scale_arg(
    name: str, s: torch.Tensor, rows: int, block_rows: int, block_k: int, k: int
) -> torch.Tensor:
    want_dtype = torch.float8_e8m0fnu if block_k == 32 else torch.float32
    n_kb = 1 if block_k == 0 else -(-k // block_k)
    shape = (-(-rows // block_rows), n_kb)
    if s.dtype != want_dtype or tuple(s.shape) != shape:
        raise ValueError(
            f"{name} must be a {want_dtype} tensor of shape {shape} for blocks of "
            f"{block_rows} x {block_k or 'K'}; got {s.dtype} {tuple(s.shape)}"
        )
    return s.view(torch.uint8) if want_dtype == torch.float8_e8m0fnu else s


def scaled_mm_blocks(
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    block_rows_a: int,
    scale_b: torch.Tensor,
    block_rows_b: int,
    block_k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * steps_a) @ (b * steps_b).T (+ bias)`` as a new ``[M, N]`` ``out_dtype`` tensor.

    ``block_k``: 0 (row-wise: scales ``(M, 1)`` and ``(N, 1)`` float32), 128 (scales
    ``(ceil(rows / block_rows), ceil(K / 128))`` float32, ``block_rows`` 1 or 128) or 32
    (MX: ``(rows, ceil(K / 32))`` ``float8_e8m0fnu``, ``block_rows`` 1).
    """
    check_operands(a, b)
    if block_k not in (0, 32, 128) or block_rows_a not in (1, 128) or block_rows_b not in (1, 128):
        raise ValueError(
            f"blocks are rows x K, 1 x 32, 1 x 128 or 128 x 128; got block_k={block_k}, "
            f"block_rows_a={block_rows_a}, block_rows_b={block_rows_b}"
        )
    m, k = a.shape
    n = b.shape[0]
    sa = _scale_arg("scale_a", scale_a, m, block_rows_a, block_k, k)
    sb = _scale_arg("scale_b", scale_b, n, block_rows_b, block_k, k)
    check_bias_and_out(a, b, bias, out_dtype)
    a, b = k_major(a, b)
    c, done = new_result(a, b, bias, out_dtype)
    if done:
        return c
    launch_tiles(
        _scaled_mm_blocks_kernel,
        a,
        b,
        c,
        bias,
        (sa, sa.stride(0), sa.stride(1)),
        (sb, sb.stride(0), sb.stride(1)),
        scale_k=block_k,
        block_rows_a=block_rows_a,
        block_rows_b=block_rows_b,
    )
    return c
