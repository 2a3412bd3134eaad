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

The twin is ``computectx.fp8.block_gemm.reference_scaled_mm``. Under the interpreter the dot
is float32 and results agree within ``block_gemm.scaled_mm_error_bound`` (splitting a block
into sub-steps only reorders the float32 sums the bound allows). On sm_90 the tensor cores
add one ``BLOCK_K`` step's products in a narrower accumulator (about 14 significant bits)
before it is promoted, as in DeepSeek-V3 and the per-tensor kernel: there the results agree
within the wider bound for that accumulation, ``scaled_mm_error_bound(...,
accumulation=block_gemm.NARROW_ACCUMULATION)``, which the tests use on CUDA.
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

from typing import Any, Final

import torch
import triton
import triton.language as tl

from computectx.kernels.fp8_codes import round_to_bf16

__all__ = ["INTERPRETED", "scaled_mm_blocks"]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` when it
was imported); fixed at import."""

_FP8: Final = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT: Final = (torch.bfloat16, torch.float16, torch.float32)


def _configs() -> list[triton.Config]:
    if INTERPRETED:
        # Small tiles, so test shapes span several programs; BLOCK_K 64 splits a 128-wide
        # block in two (the scale read twice), 32 serves MX. _prune keeps one.
        return [
            triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": bk, "GROUP_M": 4})
            for bk in (64, 32)
        ]
    # Hopper: 64-row warpgroup tiles; one 128-wide scale block per K step where it fits in
    # shared memory, else two 64-wide steps; 32-wide steps for MX.
    shapes = [
        (128, 128, 128, 4, 8),
        (128, 256, 128, 3, 8),
        (256, 128, 128, 3, 8),
        (128, 256, 64, 4, 8),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (128, 128, 32, 5, 4),
        (128, 256, 32, 4, 8),
        (64, 64, 32, 4, 4),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_stages=stages,
            num_warps=warps,
        )
        for bm, bn, bk, stages, warps in shapes
    ]


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
    fits = [
        c for c in ok if c.kwargs["BLOCK_M"] <= max(64, m) and c.kwargs["BLOCK_N"] <= max(64, n)
    ]
    return fits or [min(ok, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


@triton.jit
def _steps(ptr, rows, R, stride_r, kb, stride_k, BLOCK_ROWS: tl.constexpr, E8M0: tl.constexpr):  # type: ignore[no-untyped-def]
    # The float32 step of each of ``rows`` in K block ``kb`` (1 where masked).
    offs = (rows // BLOCK_ROWS).to(tl.int64) * stride_r + kb * stride_k
    if E8M0:
        byte = tl.load(ptr + offs, mask=rows < R, other=127).to(tl.int32)
        bits = tl.where(byte == 255, 0x7FC00000, tl.where(byte == 0, 0x400000, byte << 23))
        steps = bits.to(tl.float32, bitcast=True)
    else:
        steps = tl.load(ptr + offs, mask=rows < R, other=1.0)
    return steps


@triton.autotune(
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
)
@triton.jit
def _scaled_mm_blocks_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    sa_ptr,
    sb_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_sa_r,
    stride_sa_k,
    stride_sb_r,
    stride_sb_k,
    m_bucket,  # autotune key only
    layout,  # autotune key only
    SCALE_K: tl.constexpr,
    BLOCK_ROWS_A: tl.constexpr,
    BLOCK_ROWS_B: tl.constexpr,
    E8M0: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row-tiles share each column-tile while it is in L2.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kt * BLOCK_K
        # Masked lanes load 0, which adds nothing: a partial last block sums what is there.
        a = tl.load(a_ptrs, mask=mask_m & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n, other=0.0)
        if SCALE_K == 0:
            # Row-wise: one float32 sum over K, scaled in the epilogue.
            acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        else:
            # This step's partial sum on its own, promoted with its block's two scales.
            part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
            kb = (kt * BLOCK_K) // SCALE_K
            sa = _steps(sa_ptr, offs_m, M, stride_sa_r, kb, stride_sa_k, BLOCK_ROWS_A, E8M0)
            sb = _steps(sb_ptr, offs_n, N, stride_sb_r, kb, stride_sb_k, BLOCK_ROWS_B, E8M0)
            acc = acc + part * (sa[:, None] * sb[None, :])
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    out = acc
    if SCALE_K == 0:
        sa = _steps(sa_ptr, offs_m, M, stride_sa_r, 0, 0, 1, False)
        sb = _steps(sb_ptr, offs_n, N, stride_sb_r, 0, 0, 1, False)
        out = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        out = out + bias[None, :]
    if OUT_BF16:
        out = round_to_bf16(out)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask_m & mask_n)


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
    if a.dtype not in _FP8 or b.dtype not in _FP8 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"a and b are 2-D fp8 tensors; got {a.dtype} {a.shape}, {b.dtype} {b.shape}"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] disagree on K: {tuple(a.shape)}, {tuple(b.shape)}")
    if block_k not in (0, 32, 128) or block_rows_a not in (1, 128) or block_rows_b not in (1, 128):
        raise ValueError(
            f"blocks are rows x K, 1 x 32, 1 x 128 or 128 x 128; got block_k={block_k}, "
            f"block_rows_a={block_rows_a}, block_rows_b={block_rows_b}"
        )
    m, k = a.shape
    n = b.shape[0]
    sa = _scale_arg("scale_a", scale_a, m, block_rows_a, block_k, k)
    sb = _scale_arg("scale_b", scale_b, n, block_rows_b, block_k, k)
    if bias is not None and (bias.shape != (n,) or bias.device != a.device):
        raise ValueError(f"bias must have shape ({n},) on {a.device}")
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if not INTERPRETED:
        # K-major operands stage with asynchronous copies on sm_90 (see kernels.scaled_mm).
        a = a if a.stride(1) == 1 else a.contiguous()
        b = b if b.stride(1) == 1 else b.contiguous()
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        # The sum over K is empty: the result is the bias (or zero), rounded once.
        c.copy_(torch.zeros(n, device=a.device) if bias is None else bias.float().expand(m, n))
        return c

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _scaled_mm_blocks_kernel[grid](
        a,
        b,
        c,
        bias if bias is not None else c,
        sa,
        sb,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        sa.stride(0),
        sa.stride(1),
        sb.stride(0),
        sb.stride(1),
        triton.next_power_of_2(m),
        int(a.stride(1) == 1) + 2 * int(b.stride(1) == 1),
        SCALE_K=block_k,
        BLOCK_ROWS_A=block_rows_a,
        BLOCK_ROWS_B=block_rows_b,
        E8M0=block_k == 32,
        HAS_BIAS=bias is not None,
        OUT_BF16=out_dtype == torch.bfloat16,
    )
    return c
