"""The fp8 byte of a float32 value, in integer arithmetic: one Triton function the quantize
kernels share (``computectx.kernels.quantize`` and ``computectx.kernels.quantize_blocks``);
and ``round_to_bf16``, the bf16 rounding every GEMM and attention epilogue shares.

Never Triton's float -> fp8 conversion: the interpreter's mis-rounds when the rounding carry
reaches the exponent (31.19 becomes 16.0, not 32.0, in E4M3) and writes other NaN bytes than
torch, while this is exact, and identical, on the interpreter and on every GPU.
"""

# ruff: noqa: N803, N806  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

import math
import struct
from typing import Any, Final

import torch
import triton
import triton.language as tl

__all__ = [
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "INTERPRETED",
    "byte_constants",
    "code_bound",
    "e8m0_step",
    "fp8_byte",
    "round_to_bf16",
]

FP8_DTYPES: Final[tuple[torch.dtype, ...]] = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The fp8 dtypes the kernels read and write: ``computectx.dtypes.FP8_DTYPES``, kept here
because the kernels import nothing of computectx (a test holds the two equal)."""
FLOAT_DTYPES: Final[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16, torch.float32)
"""The 16/32-bit dtypes the kernels quantize from and write results at:
``computectx.dtypes.FLOAT_DTYPES`` (a test holds the two equal)."""

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's function was decorated for the interpreter."""


@triton.jit
def fp8_byte(  # type: ignore[no-untyped-def]
    v,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    SUB_MAGIC_BITS: tl.constexpr,
):
    # The fp8 byte of float32 v (already clamped to [-max, max], or NaN), rounded to nearest
    # even, computed in integer arithmetic. No float -> fp8 conversion instruction is
    # involved: the Triton interpreter's conversion mis-rounds when the rounding carry
    # reaches the exponent and does not produce torch's NaN byte, while this is exact
    # (and identical) on the interpreter and on every GPU.
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: adding half-an-ulp-minus-one plus the lowest kept bit, then dropping the
    # low bits, is round-to-nearest-even on the bit pattern; a carry out of the mantissa
    # bumps the exponent as it should. What remains is the float32 exponent and MANT
    # mantissa bits; rebasing the exponent from bias 127 to BIAS gives the fp8 code. The
    # clamp keeps the result at or below max, itself a grid value.
    DROP: tl.constexpr = 23 - MANT
    lsb = (mag >> DROP) & 1
    normal = ((mag + ((1 << (DROP - 1)) - 1) + lsb) >> DROP) - ((127 - BIAS) << MANT)
    # Subnormal range (|v| < min normal): the grid is uniform with spacing min_subnormal.
    # Adding SUB_MAGIC = min_subnormal * 2**23 lands in a binade whose float32 ulp is exactly
    # min_subnormal, so the IEEE add rounds to nearest even on that grid, and the sum's
    # bits minus SUB_MAGIC's bits count the quanta: that count is the fp8 code (the count
    # 2**MANT is the smallest normal, whose code is the same number).
    a = mag.to(tl.float32, bitcast=True)
    sub = (a + SUB_MAGIC).to(tl.int32, bitcast=True) - SUB_MAGIC_BITS
    code = tl.where(mag >= MIN_NORMAL_BITS, normal, sub) | sign
    # Every NaN (any sign, any payload) becomes the positive NaN byte 0x7F: the sign of a
    # NaN produced by x / step is not the same on CPUs and GPUs, so it carries nothing.
    code = tl.where(mag > 0x7F800000, 0x7F, code)
    return code.to(tl.uint8)


@triton.jit
def code_bound(step, FMAX: tl.constexpr, MANT: tl.constexpr):  # type: ignore[no-untyped-def]
    """The largest magnitude a code may take with float32 ``step``: ``FMAX``, or the largest
    grid value whose product with the step is finite (``numerics.tensorwise.code_bound``,
    bit for bit): ``FLT_MAX / |step|`` (IEEE division) with its mantissa cut to ``MANT``
    bits, at most ``FMAX``. Clamping ``x / step`` to it keeps ``code * step`` finite."""
    a = (step.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    r = tl.div_rn(tl.full(a.shape, 3.4028234663852886e38, tl.float32), a)
    CUT: tl.constexpr = (1 << (23 - MANT)) - 1
    v = (r.to(tl.int32, bitcast=True) & ~CUT).to(tl.float32, bitcast=True)
    return tl.where(v < FMAX, v, FMAX)


def _f32_bits(value: float) -> int:
    bits: int = struct.unpack("<i", struct.pack("<f", value))[0]
    return bits


def byte_constants(fp8: torch.dtype) -> dict[str, Any]:
    """The constexpr arguments of ``fp8_byte`` for ``fp8`` (``MANT``, ``BIAS``,
    ``MIN_NORMAL_BITS``, ``SUB_MAGIC``, ``SUB_MAGIC_BITS``), all from ``torch.finfo``: eps
    is ``2**-MANT``, and the smallest subnormal is one eps of the smallest normal."""
    fi = torch.finfo(fp8)
    mant = round(-math.log2(fi.eps))
    exponent_bits = fi.bits - 1 - mant
    sub_magic = fi.smallest_normal * fi.eps * 2.0**23
    return {
        "MANT": mant,
        "BIAS": 2 ** (exponent_bits - 1) - 1,
        "MIN_NORMAL_BITS": _f32_bits(fi.smallest_normal),
        "SUB_MAGIC": sub_magic,
        "SUB_MAGIC_BITS": _f32_bits(sub_magic),
    }


@triton.jit
def round_to_bf16(v):  # type: ignore[no-untyped-def]
    """float32 ``v`` rounded to the nearest bf16 (ties to even), still float32, so the cast
    that follows is exact: a GPU's cast rounds this way, the interpreter's truncates. Adds
    half an ulp of bf16 (``0x7FFF``, plus the kept bit for the tie) to the bits and clears
    the low 16; an overflow becomes inf, as IEEE rounding says; NaN is kept."""
    bits = v.to(tl.int32, bitcast=True)
    keep = (bits >> 16) & 1
    rounded = (bits + (0x7FFF + keep)) & -65536
    return tl.where(v == v, rounded.to(tl.float32, bitcast=True), v)


@triton.jit
def e8m0_step(byte):  # type: ignore[no-untyped-def]
    """The float32 step of an E8M0 scale byte (int32 ``byte`` in 0..255), from its bits:
    ``2**(byte - 127)``, byte 0 the subnormal ``2**-127``, byte 255 NaN."""
    bits = tl.where(byte == 255, 0x7FC00000, tl.where(byte == 0, 0x400000, byte << 23))
    return bits.to(tl.float32, bitcast=True)
