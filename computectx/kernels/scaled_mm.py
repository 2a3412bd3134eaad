"""Scaled fp8 GEMM: ``(a * step_a) @ (b * step_b).T (+ bias)`` with float32 accumulation.

``a`` is ``[M, K]`` and ``b`` is ``[N, K]``, each E4M3 or E5M2, with arbitrary strides so the
backward pass can hand in ``.t()`` views; every edge is masked, so any M, N and K work (K
need not be a multiple of 16). The per-tensor steps multiply the float32 accumulator once
in the epilogue, then the bias is added and the sum rounded once to the output dtype.

The pure-torch twin is ``computectx.formats.numerics.tensorwise.scaled_mm``. Under the interpreter
the dot is float32 and results agree within ``numerics.tensorwise.scaled_mm_error_bound`` (the
order of float32 accumulation differs). On sm_90 the tensor cores add one ``BLOCK_K`` tile's
products in a narrower accumulator (about 14 significant bits) before it is promoted to float32:
there the results agree within the wider bound ``numerics.tensorwise.scaled_mm_error_bound(...,
accumulation=numerics.blockwise.NARROW_ACCUMULATION)``, which the tests use on CUDA.

The block-scaled GEMM (``computectx.kernels.scaled_mm_blocks``) runs this module's kernel,
``scaled_tiles``, autotuned with its own configs (``computectx.kernels.autotune``):
per-tensor steps are its ``SCALE_K == 0`` case with one-element steps read at strides of 0
(the same float32 products). The shared pieces: on the host the argument checks
(``check_operands``, ``check_bias_and_out``), the K-major staging (``k_major``), the result
and its trivial cases (``new_result``), the launch (``launch_tiles``) and the grid
(``tile_grid``); in the kernel the operand tiles (``operand_tiles``) and, the grouped GEMMs'
too, the grouped launch order (``grouped_tile``), the scaled K loop (``scaled_dot``, with
``block_steps``) and the epilogue (``store_tile``).
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch
import triton
import triton.language as tl

from computectx.kernels.autotune import fitting_configs, launch_args, tile_configs
from computectx.kernels.fp8_codes import FLOAT_DTYPES, FP8_DTYPES, e8m0_step, round_to_bf16

__all__ = [
    "INTERPRETED",
    "block_steps",
    "check_bias_and_out",
    "check_operands",
    "grouped_tile",
    "k_major",
    "launch_tiles",
    "new_result",
    "operand_tiles",
    "scaled_dot",
    "scaled_mm",
    "scaled_tiles",
    "store_tile",
    "tile_grid",
]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when it
was imported) rather than compiled for a GPU; fixed at import."""


def _configs() -> list[triton.Config]:
    # Interpreted, one 32 x 32 x 32 tile: the interpreter runs every program on the CPU.
    return tile_configs("tensorwise", INTERPRETED, 32, (32,))


def _prune(
    configs: list[triton.Config], named_args: dict[str, Any], **_: Any
) -> list[triton.Config]:
    # Keep the tiles that fit the problem, or the smallest ones when none does.
    m, n = int(named_args["M"]), int(named_args["N"])
    return fitting_configs(configs, m, n) or configs[-1:]


@triton.jit
def grouped_tile(  # type: ignore[no-untyped-def]
    M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr
):
    # This program's (pid_m, pid_n) in grouped launch order: GROUP_M row-tiles share each
    # column-tile while it is in L2.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def operand_tiles(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    M,
    N,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # This program's tile (grouped_tile): its row, column and K offsets, the pointers to
    # its first BLOCK_K slice of a ([BLOCK_M, BLOCK_K]) and of b (read as [BLOCK_K,
    # BLOCK_N]), and its row and column masks.
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # 64-bit row/column offsets: M * stride_am may exceed 2**31 for large operands.
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N
    return offs_m, offs_n, offs_k, a_ptrs, b_ptrs, mask_m, mask_n


@triton.jit
def block_steps(  # type: ignore[no-untyped-def]
    ptr, rows, ok, stride_r, kb, stride_k, BLOCK_ROWS: tl.constexpr, E8M0: tl.constexpr
):
    # The float32 step of each of ``rows`` (row block rows // BLOCK_ROWS) in scale column
    # ``kb``; 1 where ``ok`` is false. E8M0 bytes become 2**(byte - 127) exactly.
    offs = (rows // BLOCK_ROWS).to(tl.int64) * stride_r + kb * stride_k
    if E8M0:
        steps = e8m0_step(tl.load(ptr + offs, mask=ok, other=127).to(tl.int32))
    else:
        steps = tl.load(ptr + offs, mask=ok, other=1.0)
    return steps


@triton.jit
def scaled_dot(  # type: ignore[no-untyped-def]
    a_ptrs,
    b_ptrs,
    stride_a_k,
    stride_b_k,
    mask_m,
    mask_n,
    offs_k,
    k_len,
    k_tiles,
    sa_ptr,
    rows_a,
    ok_a,
    stride_sa_r,
    stride_sa_k,
    sb_ptr,
    rows_b,
    ok_b,
    stride_sb_r,
    stride_sb_k,
    kb0,
    SCALE_K: tl.constexpr,
    BLOCK_ROWS_A: tl.constexpr,
    BLOCK_ROWS_B: tl.constexpr,
    E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The scaled float32 [BLOCK_M, BLOCK_N] tile over the first k_tiles BLOCK_K steps of a
    # contraction of k_len (a_ptrs, b_ptrs at its first step; the pointers advance by
    # stride_a_k and stride_b_k). Steps come from block_steps, scale column kb0 first:
    # SCALE_K 0, one step per row (a per-tensor step is a row stride of 0) multiplying the
    # accumulator once at the end; else each step's partial dot promoted with its block's
    # two scales, column kb0 + k // SCALE_K.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in tl.range(0, k_tiles):
        k_left = k_len - kt * BLOCK_K
        # Masked lanes load 0, which adds nothing: K needs no padding to a multiple of 16,
        # and a partial last block sums what is there.
        a = tl.load(a_ptrs, mask=mask_m & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n, other=0.0)
        # Products of fp8 values are exact in float32. Hopper's fp8 MMA adds one tile's
        # products in a narrower accumulator (about 14 significant bits), not in float32;
        # max_num_imprecise_acc=BLOCK_K promotes that partial into float32 after every K
        # tile, so the narrow sums span at most BLOCK_K products and only the tiles'
        # partials are summed in float32 (numerics.tensorwise.scaled_mm_error_bound with
        # accumulation=numerics.blockwise.NARROW_ACCUMULATION bounds it). The
        # interpreter's dot is float32 throughout.
        if SCALE_K == 0:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
        else:
            # This step's partial sum on its own, promoted with its block's two scales.
            part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=BLOCK_K)
            kb = kb0 + (kt * BLOCK_K) // SCALE_K
            sa = block_steps(sa_ptr, rows_a, ok_a, stride_sa_r, kb, stride_sa_k, BLOCK_ROWS_A, E8M0)
            sb = block_steps(sb_ptr, rows_b, ok_b, stride_sb_r, kb, stride_sb_k, BLOCK_ROWS_B, E8M0)
            acc = acc + part * (sa[:, None] * sb[None, :])
        a_ptrs += BLOCK_K * stride_a_k
        b_ptrs += BLOCK_K * stride_b_k
    if SCALE_K == 0:
        sa = block_steps(sa_ptr, rows_a, ok_a, stride_sa_r, kb0, stride_sa_k, 1, False)
        sb = block_steps(sb_ptr, rows_b, ok_b, stride_sb_r, kb0, stride_sb_k, 1, False)
        acc = acc * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def store_tile(  # type: ignore[no-untyped-def]
    c_ptr,
    out,
    bias_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    N,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    # The epilogue after the scaling: the bias added in float32, one rounding to c's dtype
    # (bf16 rounded on the bits), the masked store.
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        out = out + bias[None, :]
    if OUT_BF16:
        out = round_to_bf16(out)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask_m & mask_n)


@triton.jit
def scaled_tiles(  # type: ignore[no-untyped-def]
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
    # The dense GEMM's program, per-tensor and block-scaled alike (each module autotunes
    # it with its own configs): one BLOCK_M x BLOCK_N tile of the result, its K loop and
    # scales (scaled_dot), the epilogue (store_tile). Per-tensor steps are one-element
    # tensors read with strides of 0, SCALE_K 0.
    offs_m, offs_n, offs_k, a_ptrs, b_ptrs, mask_m, mask_n = operand_tiles(
        a_ptr, b_ptr, M, N, stride_am, stride_ak, stride_bn, stride_bk,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    )  # fmt: skip
    out = scaled_dot(
        a_ptrs,
        b_ptrs,
        stride_ak,
        stride_bk,
        mask_m,
        mask_n,
        offs_k,
        K,
        tl.cdiv(K, BLOCK_K),
        sa_ptr,
        offs_m,
        offs_m < M,
        stride_sa_r,
        stride_sa_k,
        sb_ptr,
        offs_n,
        offs_n < N,
        stride_sb_r,
        stride_sb_k,
        0,
        SCALE_K,
        BLOCK_ROWS_A,
        BLOCK_ROWS_B,
        E8M0,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    store_tile(
        c_ptr, out, bias_ptr, offs_m, offs_n, mask_m, mask_n, N, stride_cm, stride_cn,
        HAS_BIAS, OUT_BF16,
    )  # fmt: skip


_scaled_mm_kernel = triton.autotune(
    configs=_configs(),
    # Tuned per power-of-two bucket of M (token counts vary from call to call; N and K are
    # a layer's shape) and per operand layout, so a new batch size does not retune.
    key=["m_bucket", "N", "K", "layout", "HAS_BIAS", "OUT_BF16"],
    prune_configs_by={"early_config_prune": _prune},
)(scaled_tiles)


def scaled_mm(
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * step_a) @ (b * step_b).T (+ bias)`` as a new ``[M, N]`` tensor of ``out_dtype``."""
    check_operands(a, b)
    for s in (step_a, step_b):
        if s.dtype != torch.float32 or s.numel() != 1 or s.device != a.device:
            raise ValueError(f"steps are float32 tensors of one element on {a.device}")
    check_bias_and_out(a, b, bias, out_dtype)

    a, b = k_major(a, b)
    c, done = new_result(a, b, bias, out_dtype)
    if done:
        return c
    launch_tiles(_scaled_mm_kernel, a, b, c, bias, (step_a, 0, 0), (step_b, 0, 0))
    return c


def check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    """``ValueError`` unless ``a`` ``[M, K]`` and ``b`` ``[N, K]`` are 2-D fp8 tensors that
    agree on K."""
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES or a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"a and b are 2-D fp8 tensors; got {a.dtype} {a.shape}, {b.dtype} {b.shape}"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] disagree on K: {tuple(a.shape)}, {tuple(b.shape)}")


def check_bias_and_out(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> None:
    """``ValueError`` unless ``bias`` is ``None`` or ``(N,)`` on ``a``'s device, and
    ``out_dtype`` bf16, fp16 or fp32."""
    if bias is not None and (bias.shape != (b.shape[0],) or bias.device != a.device):
        raise ValueError(f"bias must have shape ({b.shape[0]},) on {a.device}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")


def k_major(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` with K stride 1 for a GPU build (a copy of an operand that has
    another); as they are under the interpreter."""
    if INTERPRETED:
        # Under the interpreter the strided path itself runs, so the tests cover it.
        return a, b
    # Hopper's fp8 wgmma reads both operands K-major from shared memory. Compiled for
    # sm_90, a tile whose K stride is not 1 is not staged with asynchronous copies and the
    # main loop waits on every load of it; a K-major copy costs one read and one write of a
    # 1-byte operand, a few percent of the GEMM at LLM shapes.
    return (
        a if a.stride(1) == 1 else a.contiguous(),
        b if b.stride(1) == 1 else b.contiguous(),
    )


def new_result(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> tuple[torch.Tensor, bool]:
    """The new ``[M, N]`` result of ``out_dtype``, and whether it is already complete, with
    nothing to launch: no output tile (M or N is 0), or an empty sum over K (K is 0: the
    result is the bias, or zero, rounded once)."""
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c, True
    if k == 0:
        # An empty operand may have no storage to point at: no launch.
        c.copy_(torch.zeros(n, device=a.device) if bias is None else bias.float().expand(m, n))
        return c, True
    return c, False


def launch_tiles(
    kernel: Any,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor | None,
    scale_a: tuple[torch.Tensor, int, int],
    scale_b: tuple[torch.Tensor, int, int],
    *,
    scale_k: int = 0,
    block_rows_a: int = 1,
    block_rows_b: int = 1,
) -> None:
    """Launch ``kernel`` (``scaled_tiles`` autotuned) into ``c``, the ``new_result`` of
    checked K-major operands. ``scale_a``/``scale_b``: each operand's steps and their
    (row, K-block) strides; E8M0 steps (``scale_k`` 32) as their bytes."""
    m, k = a.shape
    n = b.shape[0]
    (sa, *sa_strides), (sb, *sb_strides) = scale_a, scale_b
    kernel[tile_grid(m, n)](
        a,
        b,
        c,
        bias if bias is not None else c,
        sa,
        sb,
        m,
        n,
        k,
        *launch_args(a, b, c, sa_strides, sb_strides, m),  # 2-D: (row, column) strides
        SCALE_K=scale_k,
        BLOCK_ROWS_A=block_rows_a,
        BLOCK_ROWS_B=block_rows_b,
        E8M0=scale_k == 32,
        HAS_BIAS=bias is not None,
        OUT_BF16=c.dtype == torch.bfloat16,
    )


def tile_grid(m: int, n: int) -> Callable[[dict[str, Any]], tuple[int]]:
    """The launch grid of an ``m x n`` result: one program per ``BLOCK_M x BLOCK_N`` tile."""

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    return grid
