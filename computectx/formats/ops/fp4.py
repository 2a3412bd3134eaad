"""The 4-bit operators (NVFP4, MXFP4): quantize, the dense GEMM, the grouped GEMM and its wgrad,
and serving's per-row quantize and dequantize.

======================================  =========================================================
operator                                semantics
======================================  =========================================================
``fp4_quantize``                        codes, block scales and amax of a row-wise operand, or
                                        of the wgrad's column-wise one (Hadamard-transformed)
``fp4_scaled_mm``                       the GEMM of two quantized operands (``reference_fp4_mm``)
``fp4_grouped_mm``                      each row group times its expert, quantized per group
``fp4_grouped_wgrad``                   each group's ``dYᵀ X`` over its own rows, float32
``fp4_quantize_rows``                   NVFP4 codes, scales and amaxes of each row by its own
                                        amax (``numerics.fp4.quantize_nvfp4_rows``; serving)
``fp4_dequantize``                      the values a 4-bit operand stands for, at a float dtype
                                        (``dequantize_nvfp4``/``dequantize_mxfp4``; serving)
======================================  =========================================================

Semantics, operand table and error bound: ``computectx.formats.numerics.fp4_gemm`` (the twins)
and ``numerics.fp4`` (the quantize). Each operator is a ``torch.library`` custom op with a fake,
so a compiled graph holds it as one opaque node: ``offs`` and the stochastic-rounding key
``rng`` (int64 ``(2,)``: seed, counter of element 0) are data read inside the operator, never
guards, so a compiled caller recompiles neither as the group sizes change nor as its counter
advances. Packed codes cross the operators as ``torch.float4_e2m1fn_x2``, NVFP4 scales as
``float8_e4m3fn`` (per-tensor amax float32 ``(1,)``), MXFP4 scales as ``float8_e8m0fnu``.

**Backends** (``select_fp4_backend``, by the operands' device; ``ops.fp4_backend``):
``"triton"`` on a GPU with FP4 tensor cores (compute capability >= 10.0:
``computectx.kernels.fp4_gemm``, ``fp4_quantize``, ``fp4_grouped_values``: ``tl.dot_scaled`` on
packed E2M1, bit for bit the twins on exact data, otherwise within the twin's bound widened
to K additions: the MMA sums in its own order); ``"cublas"`` there where torch's FP4
``scaled_mm`` runs (probed once per device): the dense GEMM on cuBLAS
(``computectx.kernels.cublas_fp4``, same bound) where its recipe runs, the Triton kernels for
the rest; ``"emulated"`` everywhere else: the pure-torch twins, on the CPU and on any GPU (in
float32 on the device), bit for bit the same function everywhere. An H100/H200 (no FP4 tensor
cores) runs the emulated twins; ``select_fp4_backend`` says which case applies and why. A 4-bit
GEMM never falls back to an 8-bit one: another backend name is a ``ValueError``, as is
``"cublas"`` forced where it cannot run (``cublas_refusal``). ``fp4_quantize_rows`` and
``fp4_dequantize`` have no Triton kernel: they run their twins on every backend. As operators
a compiled graph holds them whole: Inductor's CPU backend generates no ``float4_e2m1fn_x2``
code, nor takes such a buffer as a kernel argument.

The checked entry points (``quantize``, ``scaled_mm``, ``grouped_mm``, ``grouped_wgrad``,
``quantize_rows``, ``dequantize``) take the recipe's plain values (``numerics.fp4_gemm.Fp4Quant``)
and a ``Stochastic`` key, check every argument (``TypeError``/``ValueError`` quoting it; no
tensor's contents are read, except ``offs`` inside the grouped operators), and call the
operators.
"""

from __future__ import annotations

from typing import Final, cast

import torch
from torch.library import custom_op

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.backend import quantizable_arg
from computectx.formats.numerics import fp4_gemm
from computectx.formats.numerics.e2m1 import HADAMARD_SIZE, Stochastic
from computectx.formats.numerics.fp4 import (
    NVFP4_BLOCK,
    Mxfp4Operand,
    MxRounding,
    Nvfp4Operand,
    Nvfp4Tile,
    check_amax,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_nvfp4_rows,
    tensor_amax,
)
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant
from computectx.formats.ops.fp4_backend import (
    CUBLAS,
    EMULATED,
    TRITON,
    backend_of,
    check_2d,
    check_gemm,
    check_how,
    check_scale,
    fp4_tensor_cores,
    rng_arg,
    runs_triton,
    select_fp4_backend,
)
from computectx.formats.ops.grouped import check_grouped, checked_bounds

__all__ = [
    "CUBLAS",
    "EMULATED",
    "TRITON",
    "dequantize",
    "fp4_dequantize",
    "fp4_grouped_mm",
    "fp4_grouped_wgrad",
    "fp4_quantize",
    "fp4_quantize_rows",
    "fp4_scaled_mm",
    "fp4_tensor_cores",
    "grouped_mm",
    "grouped_wgrad",
    "quantize",
    "quantize_rows",
    "scaled_mm",
    "select_fp4_backend",
]

_U64: Final[int] = 2**64


def _key(rng: torch.Tensor | None) -> Stochastic | None:
    # A host read of the two int64s (inside the operator: data, not a guard).
    if rng is None:
        return None
    seed, offset = (int(v) for v in rng.tolist())
    return Stochastic(seed % _U64, offset)


def _how(fmt: str, tile: str, mx_rounding: str, hadamard: bool, signs: list[int]) -> Fp4Quant:
    return Fp4Quant(
        format=cast(fp4_gemm.Fp4Format, fmt),
        weight_tile=cast(Nvfp4Tile, tile),
        mx_rounding=cast(MxRounding, mx_rounding),
        hadamard=hadamard,
        signs=tuple(signs),
    )


# ---------------------------------------------------------------------------------------
# The operators.

Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(codes, scale, amax)``: what ``fp4_quantize`` returns."""


@custom_op("computectx::fp4_quantize", mutates_args=())
def fp4_quantize(
    x: torch.Tensor,
    format: str,
    tile: str,
    mx_rounding: str,
    columnwise: bool,
    hadamard: bool,
    signs: list[int],
    rng: torch.Tensor | None,
    backend: str,
) -> Quantized:
    """A 2-D ``x``'s row-wise operand at ``tile`` (``"1x16"``/``"16x16"``; MXFP4: 1x32), or
    with ``columnwise`` the wgrad's operand of ``x.t()`` (``fp4_gemm.wgrad_operand``):
    ``(codes, scale, amax)``, the amax float32 ``(1,)`` (MXFP4: the tensor's, unused); an
    operand of 0 rows has empty codes and scales and amax 0 on every backend."""
    kernels = runs_triton(backend, x)
    if not x.shape[1 if columnwise else 0]:
        codes, scale, _ = _quantize_fake(x, format, tile, mx_rounding, columnwise, hadamard)
        return codes, scale, x.new_zeros(1, dtype=torch.float32)
    if kernels:
        from computectx.kernels.fp4_quantize import fp4_quantize as kernel

        return kernel(x, format, tile, mx_rounding, columnwise, hadamard, signs, rng)
    how = _how(format, tile, mx_rounding, hadamard, signs)
    key = _key(rng)
    if columnwise:
        q = fp4_gemm.wgrad_operand(x, how, stochastic=key)
    else:
        q = fp4_gemm.quantize_rows(x, how, weight=tile == "16x16", stochastic=key)
    amax = q.amax if isinstance(q, Nvfp4Operand) else tensor_amax(x)
    return q.codes, q.scale, amax.reshape(1).clone()


@fp4_quantize.register_fake
def _quantize_fake(
    x: torch.Tensor,
    format: str,
    tile: str,
    mx_rounding: str,
    columnwise: bool,
    hadamard: bool,
    *_: object,
) -> Quantized:
    how = _how(format, tile, mx_rounding, hadamard, [1] * HADAMARD_SIZE)
    rows, k = (x.shape[1], fp4_gemm.wgrad_rows(x.shape[0], how)) if columnwise else x.shape
    tile_rows = NVFP4_BLOCK if tile == "16x16" and format == "nvfp4" and not columnwise else 1
    scale_dtype = torch.float8_e4m3fn if format == "nvfp4" else torch.float8_e8m0fnu
    codes = x.new_empty((rows, k // 2), dtype=torch.float4_e2m1fn_x2)
    scale = x.new_empty((rows // tile_rows, k // how.block), dtype=scale_dtype)
    return codes, scale, x.new_empty(1, dtype=torch.float32)


def _operand(
    codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, tile: str
) -> Fp4Operand:
    if scale.dtype == torch.float8_e8m0fnu:
        return Mxfp4Operand(codes, scale)
    if amax is None:
        raise ValueError("an NVFP4 operand (an E4M3 scale) needs its per-tensor amax")
    return Nvfp4Operand(codes, scale, amax.reshape(()), cast(Nvfp4Tile, tile))


@custom_op("computectx::fp4_scaled_mm", mutates_args=())
def fp4_scaled_mm(
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
    backend: str,
) -> torch.Tensor:
    """``[M, N]``: ``reference_fp4_mm`` of the operands ``a [M, K]`` and ``b [N, K]`` (codes,
    scales, NVFP4's amaxes, tiles); an empty ``[M, N]`` for M or N = 0 on every backend."""
    check_scale(a, scale_a, tile_a, "a")
    check_scale(b, scale_b, tile_b, "b")
    kernels = runs_triton(backend, a)
    if not (a.shape[0] and b.shape[0]):
        return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
    if backend == CUBLAS and kernels:
        from computectx.kernels import cublas_fp4

        if cublas_fp4.serves(scale_a, bias, out_dtype):
            alpha = None  # NVFP4's epilogue factor, the twin's, handed to cuBLAS
            if amax_a is not None and amax_b is not None:
                alpha = fp4_gemm.tensor_scale_alpha(amax_a, amax_b).reshape(1)
            return cublas_fp4.fp4_scaled_mm(a=a, scale_a=scale_a, tile_a=tile_a, b=b,
                scale_b=scale_b, tile_b=tile_b, alpha=alpha, bias=bias, out_dtype=out_dtype,
            )  # fmt: skip
    if kernels:
        from computectx.kernels.fp4_gemm import fp4_scaled_mm as kernel

        return kernel(a=a, scale_a=scale_a, amax_a=amax_a, tile_a=tile_a, b=b, scale_b=scale_b,
                      amax_b=amax_b, tile_b=tile_b, bias=bias, out_dtype=out_dtype)  # fmt: skip
    qa, qb = _operand(a, scale_a, amax_a, tile_a), _operand(b, scale_b, amax_b, tile_b)
    return fp4_gemm.reference_fp4_mm(qa, qb, out_dtype, bias)


@fp4_scaled_mm.register_fake
def _scaled_mm_fake(a: torch.Tensor, *rest: object) -> torch.Tensor:
    b = cast(torch.Tensor, rest[3])
    return a.new_empty((a.shape[0], b.shape[0]), dtype=cast(torch.dtype, rest[-2]))


@custom_op("computectx::fp4_grouped_mm", mutates_args=())
def fp4_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    format: str,
    weight_tile: str,
    mx_rounding: str,
    rng: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows of ``a [M, K]`` times expert ``b[g]`` (``[E, N, K]``),
    each quantized on its own (``reference_fp4_grouped_mm``)."""
    bounds = checked_bounds(offs, a.shape[0], b.shape[0])
    if runs_triton(backend, a):
        from computectx.kernels.fp4_grouped_values import grouped_mm_values

        args = (format, weight_tile, mx_rounding, rng, out_dtype)
        return grouped_mm_values(a, b, bounds, offs, *args)
    how = _how(format, weight_tile, mx_rounding, False, [1] * HADAMARD_SIZE)
    return fp4_gemm.reference_fp4_grouped_mm(a, b, bounds, how, out_dtype, _key(rng))


@fp4_grouped_mm.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=cast(torch.dtype, rest[-2]))


@custom_op("computectx::fp4_grouped_wgrad", mutates_args=())
def fp4_grouped_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    format: str,
    mx_rounding: str,
    hadamard: bool,
    signs: list[int],
    rng: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """float32 ``[E, N, K]``: ``dY[rows of g]ᵀ X[rows of g]`` from the two column-wise
    operands of each group (``reference_fp4_grouped_wgrad``)."""
    bounds = checked_bounds(offs, dy.shape[0])
    if runs_triton(backend, dy):
        from computectx.kernels.fp4_grouped_values import grouped_wgrad_values

        args = (format, mx_rounding, hadamard, signs, rng)
        return grouped_wgrad_values(dy, x, bounds, offs, *args)
    how = _how(format, "1x16", mx_rounding, hadamard, signs)
    return fp4_gemm.reference_fp4_grouped_wgrad(dy, x, bounds, how, _key(rng))


@fp4_grouped_wgrad.register_fake
def _grouped_wgrad_fake(
    dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, *_: object
) -> torch.Tensor:
    return dy.new_empty((offs.shape[0], dy.shape[1], x.shape[1]), dtype=torch.float32)


@custom_op("computectx::fp4_quantize_rows", mutates_args=())
def fp4_quantize_rows(x: torch.Tensor, backend: str, amax: torch.Tensor | None = None) -> Quantized:
    """A 2-D ``x``'s NVFP4 operand with each row by its own amax, or every row by ``amax``
    (float32 ``(1,)``: a static one) (1x16 blocks, round to nearest): codes ``[M, K/2]``, E4M3
    scales ``[M, K/16]``, the rows' float32 amaxes ``(M,)``. The twin on every backend."""
    runs_triton(backend, x)  # checked; the twin runs on every backend
    return quantize_nvfp4_rows(x, amax)


@fp4_quantize_rows.register_fake
def _quantize_rows_fake(x: torch.Tensor, *_: object) -> Quantized:
    rows, k = x.shape
    return (
        x.new_empty((rows, k // 2), dtype=torch.float4_e2m1fn_x2),
        x.new_empty((rows, k // NVFP4_BLOCK), dtype=torch.float8_e4m3fn),
        x.new_empty((rows,), dtype=torch.float32),
    )


@custom_op("computectx::fp4_dequantize", mutates_args=())
def fp4_dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    tile: str,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``[M, K]`` at ``out_dtype``: the values of the operand ``codes [M, K/2]`` (scales,
    NVFP4's amax, tile) stand for, each formed in float32 and rounded once
    (``dequantize_nvfp4``/``dequantize_mxfp4``). The twin on either backend."""
    runs_triton(backend, codes)  # checked; the twin runs on every backend
    q = _operand(codes, scale, amax, tile)
    if isinstance(q, Nvfp4Operand):
        return dequantize_nvfp4(q, out_dtype)
    return dequantize_mxfp4(q, out_dtype)


@fp4_dequantize.register_fake
def _dequantize_fake(codes: torch.Tensor, *rest: object) -> torch.Tensor:
    shape = (*codes.shape[:-1], 2 * codes.shape[-1])
    return codes.new_empty(shape, dtype=cast(torch.dtype, rest[-2]))


# ---------------------------------------------------------------------------------------
# The checked entry points.


def quantize(
    x: torch.Tensor,
    how: Fp4Quant,
    *,
    weight: bool = False,
    columnwise: bool = False,
    stochastic: Stochastic | torch.Tensor | None = None,
) -> Fp4Operand:
    """The operand of a 2-D ``x``: row-wise (``weight``: at ``how.weight_tile``), or with
    ``columnwise`` the wgrad's operand of ``x.t()`` (rows padded, ``how.hadamard`` applied).
    ``stochastic``: a ``Stochastic`` key or an int64 ``(2,)`` tensor ``[seed, counter]``
    (the seed in two's complement, as a layer keeps it)."""
    h = check_how(how)
    tile = h.weight_tile if weight and h.format == "nvfp4" and not columnwise else "1x16"
    if columnwise:
        t = check_2d(x, 1, 1, "a column-wise 4-bit quantize", k_dim=0)
    else:
        rows = NVFP4_BLOCK if tile == "16x16" else 1
        t = check_2d(x, h.block, rows, f"a {h.format} quantize at {tile}")
    signs = list(h.signs)
    rng, backend = rng_arg(stochastic, t), backend_of(x)
    codes, scale, amax = fp4_quantize(
        x, h.format, tile, h.mx_rounding, columnwise, h.hadamard, signs, rng, backend
    )
    return _operand(codes, scale, amax if h.format == "nvfp4" else None, tile)


def scaled_mm(
    a: Fp4Operand, b: Fp4Operand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` at ``out_dtype`` of two NVFP4 or two MXFP4 operands (``[M, K]``,
    ``[N, K]``; each scale checked against its codes, K > 0; M or N may be 0) through
    ``computectx::fp4_scaled_mm``."""
    ta, tb = check_gemm(a, b, bias, out_dtype)
    amax_a = a.amax.reshape(1) if isinstance(a, Nvfp4Operand) else None
    amax_b = b.amax.reshape(1) if isinstance(b, Nvfp4Operand) else None
    out: torch.Tensor = fp4_scaled_mm(
        a.codes,
        a.scale,
        amax_a,
        ta,
        b.codes,
        b.scale,
        amax_b,
        tb,
        bias,
        out_dtype,
        backend_of(a.codes),
    )
    return out


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    how: Fp4Quant,
    *,
    out_dtype: torch.dtype | None = None,
    stochastic: Stochastic | torch.Tensor | None = None,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows of ``a`` times ``b[g]ᵀ`` in 4 bits (``numerics.fp4_gemm``),
    at ``out_dtype`` (default ``a``'s). ``a [M, K]``, ``b [E, N, K]`` (the dgrad passes
    ``Wᵀ`` per expert), ``offs`` int32 end rows; K a multiple of the block, N of 16 for 16x16
    weight tiles. ``stochastic`` rounds ``a``'s codes (the dgrad's dY): a ``Stochastic`` key
    or an int64 ``(2,)`` tensor ``[seed, counter]`` (a layer's, read inside the operator)."""
    h = check_how(how)
    _, k, _, n = check_grouped(a, b, offs, op="fp4 grouped_mm")
    rows = NVFP4_BLOCK if h.format == "nvfp4" and h.weight_tile == "16x16" else 1
    if k % h.block or n % rows:
        raise ValueError(
            f"{h.format} grouped_mm needs K a multiple of {h.block} and N of {rows}, got "
            f"K = {k}, N = {n}"
        )
    out = a.dtype if out_dtype is None else out_dtype
    if out not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")
    args = (h.format, h.weight_tile, h.mx_rounding, rng_arg(stochastic, a), out, backend_of(a))
    y: torch.Tensor = fp4_grouped_mm(a, b, offs, *args)
    return y


def grouped_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    how: Fp4Quant,
    *,
    stochastic: Stochastic | torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``[E, N, K]``: ``dW[g] = dY[rows of g]ᵀ X[rows of g]`` in 4 bits, each group's
    operands padded and Hadamard-transformed on their own (``numerics.fp4_gemm``); ``offs``
    has E entries. ``stochastic`` rounds dY's codes (a key or tensor, as ``grouped_mm``)."""
    h = check_how(how)
    t_dy, t_x = quantizable_arg(dy), quantizable_arg(x)
    if t_dy.dim() != 2 or t_x.dim() != 2 or t_dy.shape[0] != t_x.shape[0]:
        raise ValueError(
            f"grouped_wgrad takes dy [M, N] and x [M, K] with the same M, got "
            f"{tuple(t_dy.shape)} and {tuple(t_x.shape)}"
        )
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        got = f"{offs.dtype} {tuple(offs.shape)}" if isinstance(offs, torch.Tensor) else offs
        raise TypeError(f"offs must be a 1-D int32 tensor of each group's end row, got {got!r}")
    if not (t_dy.device == t_x.device == offs.device):
        raise ValueError(
            f"dy, x and offs must be on one device, got {t_dy.device}, {t_x.device}, {offs.device}"
        )
    rng = rng_arg(stochastic, t_dy)
    args = (h.format, h.mx_rounding, h.hadamard, list(h.signs), rng, backend_of(dy))
    dw: torch.Tensor = fp4_grouped_wgrad(dy, x, offs, *args)
    return dw


def quantize_rows(
    x: torch.Tensor, amax: torch.Tensor | None = None, *, check_values: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scale, amax)`` of a 2-D ``x`` (bf16/f16/f32, K a multiple of 16), each row
    quantized to NVFP4 as ``quantize_nvfp4`` quantizes it alone (its own amax, or ``amax``: a
    float32 ``(1,)`` on ``x``'s device, finite and ``>= 0``; 1x16 blocks, round to nearest):
    ``amax`` float32 ``(M,)``, one per row, through ``computectx::fp4_quantize_rows``. A given
    ``amax``'s values take one host read (``numerics.fp4.check_amax``), skipped where
    ``check_values`` is False (a static layer's, checked when installed) and while compiling."""
    t = check_2d(x, NVFP4_BLOCK, 1, "a per-row nvfp4 quantize")
    held = None if amax is None else (amax.dtype, tuple(amax.shape), amax.device)
    if held not in (None, (torch.float32, (1,), t.device)):
        got = f"{amax.dtype} {tuple(amax.shape)} on {amax.device}"  # type: ignore[union-attr]
        raise ValueError(f"quantize_rows: amax must be float32 (1,) on {t.device}, got {got}")
    if amax is not None:
        check_amax(amax, "quantize_rows", check_values=check_values)
    q: Quantized = fp4_quantize_rows(t, backend_of(t), amax)
    return q


def dequantize(q: Fp4Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """The values the 2-D operand ``q`` (NVFP4 or MXFP4) stands for at ``out_dtype`` (bf16,
    fp16, fp32 or fp64), each formed in float32 and rounded once, through
    ``computectx::fp4_dequantize``."""
    if not isinstance(q, (Nvfp4Operand, Mxfp4Operand)):
        raise TypeError(f"dequantize takes an Nvfp4Operand or Mxfp4Operand, got {q!r}")
    if q.codes.dim() != 2:
        raise ValueError(f"dequantize takes a 2-D operand, got codes of {tuple(q.codes.shape)}")
    if out_dtype not in (*FLOAT_DTYPES, torch.float64):
        raise ValueError(f"out_dtype must be bf16, fp16, fp32 or fp64, got {out_dtype!r}")
    tile = q.tile if isinstance(q, Nvfp4Operand) else "1x32"
    amax = q.amax.reshape(1) if isinstance(q, Nvfp4Operand) else None
    out: torch.Tensor = fp4_dequantize(q.codes, q.scale, amax, tile, out_dtype, backend_of(q.codes))
    return out
