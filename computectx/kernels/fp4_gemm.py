"""The 4-bit GEMM on block-scaled tensor cores: ``a @ b.T (+ bias)`` of two NVFP4 or two MXFP4
operands, with ``tl.dot_scaled`` on packed E2M1 codes.

``a`` is ``[M, K / 2]`` and ``b`` ``[N, K / 2]`` bytes (``torch.float4_e2m1fn_x2``: element
``2j`` in the low nibble of byte ``j``, packed along K); each K block has a scale:

==========  ========================  =========================  ==========================
format      block                     scale                      per tensor
==========  ========================  =========================  ==========================
NVFP4       1 x 16, or 16 x 16 tile   ``float8_e4m3fn`` (E4M3)   float32 amax, ``(1,)``
MXFP4       1 x 32                    ``float8_e8m0fnu`` (E8M0)  none
==========  ========================  =========================  ==========================

Both are what ``tl.dot_scaled`` takes natively in Triton 3.9: E8M0 scales per 32 (``kind::mxf4``)
and E4M3 scales per 16 (``kind::mxf4nvf4 ... block16``, the scale factor deduced from the scale
tile's shape), so nothing is dequantized in the kernel. A ``"16x16"`` tile's scale is read for
each of its 16 rows (the row's index divided by 16). The program owns a ``BLOCK_M x BLOCK_N``
tile of the result; each K step hands one ``BLOCK_K``-element slice of codes and its
``BLOCK_K / block`` scale columns to ``tl.dot_scaled``, accumulating in float32. Masked lanes
(rows past M or N, K past the last block) load code 0 and scale 1: they add nothing. The
epilogue is the twin's (``computectx.formats.numerics.fp4_gemm.reference_fp4_mm``): under NVFP4
``acc * alpha`` with ``alpha = (amax_a * amax_b) * f32(1 / (6 * 6 * 448 * 448))`` (TE's
tensor-scale factor, computed in the kernel in that order), then the bias in float32 and one
rounding to the output dtype. The kernels are built without floating-point contraction
(``BUILD_OPTIONS``, ``enable_fp_fusion=False``): ``acc * alpha + bias`` stays two roundings,
as in the twin.

**Arithmetic.** Each product of two scaled E2M1 values is exact in float32 (NVFP4: at most
2 + 4 significant bits a side); the MMA sums a K step's products, and the steps are added to the
float32 accumulator in K order. Where every partial sum is exact in float32 (small codes, scales
in a few binades) the result is the twin's bit for bit. Otherwise the sums are rounded in
another order than the twin's (its per-block partials ``P_kb`` are exact, the MMA's order is
its own): the twin's bound (``numerics.fp4_gemm.fp4_mm_error_bound``) with its accumulation
term counting all K products' additions holds for any float32 summation order, which is what
the interpreter does. On the GPU it holds if the tensor cores add in float32 or wider: NVIDIA
does not state the block-scaled MMA's internal width (Hopper's fp8 MMA keeps about 14 bits),
and no sm_100 device has measured it here; the tests hold a GPU run to the bound. Under Triton
3.9's interpreter the dot is numpy's float32 matmul of the scaled values; the interpreter
decodes every ``dot_scaled`` scale as an E8M0 byte (``runtime.interpreter.
_dot_scaled_scale_to_f32``: E4M3 1.0, byte 0x38, would read as ``2**-71``), so an interpreted
launch reads E4M3 scales as E4M3 for its duration (``e4m3_scales_interpreted``), as the GPU
build does (``tcgen05.mma`` reads ``ue4m3`` scales; Hopper's emulation decodes them with
``fp_to_fp``). Scale bytes are the quantizer's: non-negative (a negative E4M3 scale is outside
the formats), NaN for a block with a NaN.

**Devices.** The compiled kernel runs on compute capability 10.x and up (Blackwell's FP4 tensor
cores: ``tcgen05.mma ... block_scale`` on sm_100, ``mma.sync ... block_scale`` on sm_120), every
autotune tile 128 rows (a 64-row ``dot_scaled`` compiles to a 16-bit ``kind::f16`` MMA of upcast
operands). On sm_90 Triton would compile ``tl.dot_scaled`` to an
emulation (the codes times their scales upcast to bf16, ``wgmma ... bf16``): ``fp4_scaled_mm``
refuses a device below 10.0 with a ``ValueError`` instead, naming it (``fp4_tensor_cores``).
Interpreted, it runs on the host.
"""

# ruff: noqa: N803, N806  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any, Final

import torch
import triton
import triton.language as tl

from computectx.kernels.autotune import fitting_configs, launch_args
from computectx.kernels.fp4_args import (
    FP4_TILES,
    amax_arg,
    check_scale_devices,
    codes_arg,
    codes_pair,
    scale_arg,
)
from computectx.kernels.scaled_mm import check_bias_and_out, grouped_tile, store_tile, tile_grid

__all__ = [
    "ALPHA_FACTOR_INV",
    "AMAX_FLOOR",
    "BLACKWELL_FP4_TILES",
    "BUILD_OPTIONS",
    "FP4_TILES",
    "INTERPRETED",
    "amax_arg",
    "check_device",
    "check_scale_devices",
    "codes_arg",
    "e4m3_scales_interpreted",
    "fp4_block_dot",
    "fp4_configs",
    "fp4_scaled_mm",
    "fp4_tensor_cores",
    "scale_arg",
    "tensor_alpha",
]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when it
was imported) rather than compiled for a GPU; fixed at import."""

ALPHA_FACTOR_INV: Final[float] = float(
    torch.tensor(1.0 / (6.0 * 6.0 * 448.0 * 448.0), dtype=torch.float32)
)
"""``f32(1 / (6 * 6 * 448 * 448))``: NVFP4's tensor-scale constant (the twin's
``numerics.fp4_gemm.ALPHA_FACTOR_INV``; a test holds the two equal)."""

AMAX_FLOOR: Final[float] = float(
    torch.tensor(6.0 * 448.0) / torch.tensor(torch.finfo(torch.float32).max)
)
"""``f32(2688 / FLT_MAX)``: an NVFP4 amax below it has its ``S_enc`` saturated, and the
epilogue reads it as this floor (the twin's ``numerics.fp4_gemm.AMAX_FLOOR``; a test holds
the two equal)."""
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)

BUILD_OPTIONS: Final[dict[str, bool]] = {"enable_fp_fusion": False}
"""The compile options of every launch: no floating-point contraction (module docstring)."""

BLACKWELL_FP4_TILES: Final[tuple[tuple[int, int, int, int, int], ...]] = (
    # (BLOCK_M, BLOCK_N, BLOCK_K in elements, num_stages, num_warps). tcgen05's block-scaled
    # MMA takes 128-row tiles and 64 E2M1 elements (32 bytes) of K per instruction; 128- or
    # 256-element K steps are 64 or 128 bytes of codes a row, and the accumulator lives in
    # tensor memory. Every tile is 128 rows: Triton 3.9 compiles a 64-row dot_scaled to a
    # 16-bit MMA (``kind::f16``) of upcast operands, not the FP4 tensor cores.
    (128, 256, 256, 3, 8),
    (128, 128, 256, 4, 4),
    (128, 128, 128, 4, 4),
    (128, 64, 256, 4, 4),
    (128, 64, 128, 4, 4),
)
"""The compiled kernels' autotune tiles (sm_100)."""


def fp4_configs(interpreted_block_m: int) -> list[triton.Config]:
    """The 4-bit kernels' autotune configs: ``BLACKWELL_FP4_TILES`` compiled; interpreted,
    one ``interpreted_block_m`` x 32 tile and 64-element K steps (four NVFP4 blocks, two
    MXFP4 ones), so test shapes span several programs and K steps."""
    if INTERPRETED:
        tile = {"BLOCK_M": interpreted_block_m, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 4}
        return [triton.Config(tile)]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
            num_stages=stages,
            num_warps=warps,
        )
        for bm, bn, bk, stages, warps in BLACKWELL_FP4_TILES
    ]


def _prune(
    configs: list[triton.Config], named_args: dict[str, Any], **_: Any
) -> list[triton.Config]:
    # The tiles an output fits, or the smallest one.
    m, n = int(named_args["M"]), int(named_args["N"])
    return fitting_configs(configs, m, n) or [
        min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
    ]


@triton.jit
def fp4_block_dot(  # type: ignore[no-untyped-def]
    acc,
    a_ptr,
    b_ptr,
    sa_ptr,
    sb_ptr,
    rows_a,
    ok_a,
    rows_b,
    ok_b,
    k_bytes,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_sa_r,
    stride_sa_k,
    stride_sb_r,
    stride_sb_k,
    VEC: tl.constexpr,
    ROWS_A: tl.constexpr,
    ROWS_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # acc plus the block-scaled product of a's rows rows_a (valid where ok_a) and b's rows
    # rows_b over k_bytes bytes of codes (2 * k_bytes elements) from a_ptr/b_ptr (column
    # 0 of the contraction), scales from sa_ptr/sb_ptr (scale column 0); a scale serves
    # ROWS rows by VEC elements. E4M3 scales when VEC is 16, E8M0 when 32.
    HALF: tl.constexpr = BLOCK_K // 2
    SCALES: tl.constexpr = BLOCK_K // VEC
    offs_kh = tl.arange(0, HALF)
    offs_s = tl.arange(0, SCALES)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_kh[None, :] * stride_ak
    b_ptrs = b_ptr + rows_b[None, :].to(tl.int64) * stride_bn + offs_kh[:, None] * stride_bk
    sa_ptrs = (
        sa_ptr
        + (rows_a // ROWS_A)[:, None].to(tl.int64) * stride_sa_r
        + offs_s[None, :] * stride_sa_k
    )
    sb_ptrs = (
        sb_ptr
        + (rows_b // ROWS_B)[:, None].to(tl.int64) * stride_sb_r
        + offs_s[None, :] * stride_sb_k
    )
    ONE: tl.constexpr = 0x38 if VEC == 16 else 127  # the scale byte of 1.0 (E4M3, E8M0)
    for kt in tl.range(0, tl.cdiv(k_bytes, HALF)):
        left = k_bytes - kt * HALF  # bytes of codes from this step's first
        a = tl.load(a_ptrs, mask=ok_a[:, None] & (offs_kh[None, :] < left), other=0)
        b = tl.load(b_ptrs, mask=(offs_kh[:, None] < left) & ok_b[None, :], other=0)
        s_left = 2 * left // VEC  # scale columns from this step's first
        sa = tl.load(sa_ptrs, mask=ok_a[:, None] & (offs_s[None, :] < s_left), other=ONE)
        sb = tl.load(sb_ptrs, mask=ok_b[:, None] & (offs_s[None, :] < s_left), other=ONE)
        if VEC == 16:
            acc = tl.dot_scaled(  # type: ignore[attr-defined]
                a,
                sa.to(tl.float8e4nv, bitcast=True),
                "e2m1",
                b,
                sb.to(tl.float8e4nv, bitcast=True),
                "e2m1",
                acc,
            )
        else:
            acc = tl.dot_scaled(a, sa, "e2m1", b, sb, "e2m1", acc)  # type: ignore[attr-defined]
        a_ptrs += HALF * stride_ak
        b_ptrs += HALF * stride_bk
        sa_ptrs += SCALES * stride_sa_k
        sb_ptrs += SCALES * stride_sb_k
    return acc


@triton.jit
def _fp4_mm_tiles(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    sa_ptr,
    sb_ptr,
    amax_a_ptr,
    amax_b_ptr,
    M,
    N,
    K_BYTES,
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
    VEC: tl.constexpr,
    ROWS_A: tl.constexpr,
    ROWS_B: tl.constexpr,
    ALPHA_INV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # One BLOCK_M x BLOCK_N tile of the result (grouped launch order): the K loop
    # (fp4_block_dot), NVFP4's tensor-scale factor, the epilogue (store_tile).
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = fp4_block_dot(
        acc, a_ptr, b_ptr, sa_ptr, sb_ptr, offs_m, offs_m < M, offs_n, offs_n < N, K_BYTES,
        stride_am, stride_ak, stride_bn, stride_bk, stride_sa_r, stride_sa_k, stride_sb_r,
        stride_sb_k, VEC, ROWS_A, ROWS_B, BLOCK_K,
    )  # fmt: skip
    if VEC == 16:
        acc = acc * tensor_alpha(tl.load(amax_a_ptr), tl.load(amax_b_ptr), ALPHA_INV)
    store_tile(
        c_ptr, acc, bias_ptr, offs_m, offs_n, offs_m[:, None] < M, offs_n[None, :] < N, N,
        stride_cm, stride_cn, HAS_BIAS, OUT_BF16,
    )  # fmt: skip


_fp4_mm_kernel = triton.autotune(
    configs=fp4_configs(interpreted_block_m=32),
    # Per power-of-two bucket of M (token counts vary; N and K are a layer's), per layout
    # and operand tiles.
    key=["m_bucket", "N", "K_BYTES", "layout", "VEC", "ROWS_A", "ROWS_B", "HAS_BIAS", "OUT_BF16"],
    prune_configs_by={"early_config_prune": _prune},
)(_fp4_mm_tiles)


# ---------------------------------------------------------------------------------------
# The host side.


def fp4_tensor_cores(device: torch.device) -> str | None:
    """Why the compiled kernels cannot run on ``device``, or ``None`` when they can (a CUDA
    device of compute capability 10.0 or more: FP4 tensor cores)."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device (the compiled 4-bit kernels run on sm_100+)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 10:
        name = torch.cuda.get_device_name(device)
        return (
            f"{name} ({device}) has compute capability {major}.{minor} < 10.0: no FP4 tensor "
            f"cores, and the 4-bit GEMM never falls back to another precision"
        )
    return None


def _e4m3_decoder(original: Any) -> Any:
    def decode(scale_handle: Any, compute_type: Any) -> Any:
        if scale_handle.dtype != tl.float8e4nv:
            return original(scale_handle, compute_type)
        raw = torch.from_numpy(scale_handle.data.view("uint8").copy())
        return raw.view(torch.float8_e4m3fn).float().numpy()

    return decode


@contextlib.contextmanager
def e4m3_scales_interpreted() -> Iterator[None]:
    """For an interpreted launch: Triton 3.9's interpreter reads every ``dot_scaled`` scale as
    an E8M0 byte (module docstring); for the launch's duration its decoder reads
    ``float8e4nv`` scales as E4M3 and hands any other to Triton's own."""
    if not INTERPRETED:
        yield
        return
    interpreter = importlib.import_module("triton.runtime.interpreter")
    name = "_dot_scaled_scale_to_f32"
    original = getattr(interpreter, name)
    setattr(interpreter, name, _e4m3_decoder(original))
    try:
        yield
    finally:
        setattr(interpreter, name, original)


def check_device(device: torch.device) -> None:
    """Compiled: ``ValueError`` unless ``device`` has FP4 tensor cores (``fp4_tensor_cores``);
    interpreted: nothing (the interpreter runs on the host)."""
    if not INTERPRETED:
        refused = fp4_tensor_cores(device)
        if refused is not None:
            raise ValueError(f"the Triton 4-bit GEMM cannot run here: {refused}")


def _alpha_on_host(amax_a: torch.Tensor, amax_b: torch.Tensor) -> torch.Tensor:
    # The kernel's tensor-scale factor (tensor_alpha), for a launch with no K to sum.
    a, b = amax_a.float().clamp(min=AMAX_FLOOR), amax_b.float().clamp(min=AMAX_FLOOR)
    hi, lo = torch.maximum(a, b), torch.minimum(a, b)
    inv = torch.tensor(ALPHA_FACTOR_INV, device=a.device)
    return torch.where(torch.isinf(hi * lo), hi * (lo * inv), (hi * lo) * inv)


@triton.jit
def tensor_alpha(amax_a, amax_b, ALPHA_INV: tl.constexpr):  # type: ignore[no-untyped-def]
    """NVFP4's epilogue factor, the twin's ``tensor_scale_alpha``: TE's ``(amax_a * amax_b) *
    ALPHA_INV`` (two float32 products), an amax below ``AMAX_FLOOR`` (its ``S_enc`` saturated)
    read as the floor, a product past FLT_MAX formed as ``hi * (lo * ALPHA_INV)``."""
    a = tl.maximum(amax_a, _AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    b = tl.maximum(amax_b, _AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    hi = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    lo = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
    product = hi * lo
    return tl.where(product == float("inf"), hi * (lo * ALPHA_INV), product * ALPHA_INV)


def fp4_scaled_mm(
    *,
    a: torch.Tensor,
    scale_a: torch.Tensor,
    amax_a: torch.Tensor | None,
    tile_a: str,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    amax_b: torch.Tensor | None,
    tile_b: str,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` as a new ``[M, N]`` ``out_dtype`` tensor: the arguments of the
    operator ``computectx::fp4_scaled_mm`` (codes, scales, NVFP4's amaxes, tiles).

    ``a`` ``[M, K / 2]`` and ``b`` ``[N, K / 2]`` codes (any strides); ``tile_a``/``tile_b``
    ``"1x16"`` or ``"16x16"`` (NVFP4: E4M3 scales ``[rows / tile rows, K / 16]`` and float32
    amaxes of one element) or both ``"1x32"`` (MXFP4: E8M0 scales ``[rows, K / 32]``, amaxes
    ``None``); ``bias`` ``(N,)`` or ``None``; ``out_dtype`` bf16, fp16 or fp32. Compiled, the
    tensors must be on a CUDA device of compute capability 10.0 or more (``ValueError``
    naming the device otherwise: no fallback)."""
    for name, tile in (("tile_a", tile_a), ("tile_b", tile_b)):
        if tile not in FP4_TILES:
            raise ValueError(f"{name} must be one of {tuple(FP4_TILES)}, got {tile!r}")
    nvfp4 = tile_a != "1x32"
    if (tile_b != "1x32") != nvfp4:
        raise ValueError(
            f"a 4-bit GEMM multiplies two NVFP4 (1x16, 16x16) or two MXFP4 (1x32) operands, "
            f"got tiles {tile_a!r} and {tile_b!r}"
        )
    a8, b8 = codes_pair(a, b, ("[M, K / 2]", "[N, K / 2]", "K"))
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    sa = scale_arg("scale_a", scale_a, m, k, tile_a)
    sb = scale_arg("scale_b", scale_b, n, k, tile_b)
    check_scale_devices(sa, sb, a.device)
    am, bm = (
        amax_arg("amax_a", amax_a, nvfp4, a.device),
        amax_arg("amax_b", amax_b, nvfp4, a.device),
    )
    check_bias_and_out(a, b, bias, out_dtype)
    check_device(a.device)  # last: every argument's own error first, on any device
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        # No K to sum (and codes that may have no storage): the epilogue on a zero sum.
        acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        if am is not None and bm is not None:
            acc = acc * _alpha_on_host(am, bm)
        return c.copy_(acc if bias is None else acc + bias.float())
    with e4m3_scales_interpreted():
        _fp4_mm_kernel[tile_grid(m, n)](
            a8,
            b8,
            c,
            bias if bias is not None else c,
            sa,
            sb,
            am if am is not None else c,
            bm if bm is not None else c,
            m,
            n,
            k // 2,
            *launch_args(a8, b8, c, sa.stride(), sb.stride(), m),
            VEC=FP4_TILES[tile_a][1],
            ROWS_A=FP4_TILES[tile_a][0],
            ROWS_B=FP4_TILES[tile_b][0],
            ALPHA_INV=ALPHA_FACTOR_INV,
            HAS_BIAS=bias is not None,
            OUT_BF16=out_dtype == torch.bfloat16,
            **BUILD_OPTIONS,
        )
    return c
