"""What the two quantize kernels (``computectx.kernels.quantize``, one step per tensor, and
``computectx.kernels.quantize_blocks``, one per block) share: an fp8 format's constants as one
constexpr argument (``Fp8Constants``, from ``fp8_constants``), the check of the format asked
for (``check_fp8``), and the two ends of their cast, ``load_widened`` (x as float32) and
``clamped_byte`` (``x / step`` clamped and written as its fp8 byte, ``fp8_codes.fp8_byte``).
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

import functools
import math
from typing import Final, NamedTuple

import torch
import triton
import triton.language as tl

from computectx.kernels.fp8_codes import FP8_DTYPES, byte_constants, fp8_byte

__all__ = [
    "FLT_MAX",
    "FLT_MIN",
    "INTERPRETED",
    "Fp8Constants",
    "check_fp8",
    "clamped_byte",
    "fp8_constants",
    "load_widened",
]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's functions were decorated for the interpreter."""

FLT_MAX = tl.constexpr(torch.finfo(torch.float32).max)
"""float32's largest finite value (a constexpr global, which a jit function may read)."""
FLT_MIN = tl.constexpr(torch.finfo(torch.float32).tiny)
"""float32's smallest normal, ``2**-126``: a smaller step keeps too few bits."""


class Fp8Constants(NamedTuple):
    """An fp8 format's numbers, all from ``torch.finfo`` (so the kernels need only torch and
    triton), passed to a kernel as one constexpr ``FMT`` and read there as ``FMT.MANT``."""

    FMAX: float
    """The largest finite value."""
    EMAX: int
    """``floor(log2(FMAX))``, the OCP MX ``emax``."""
    MANT: int
    BIAS: int
    MIN_NORMAL_BITS: int
    SUB_MAGIC: float
    SUB_MAGIC_BITS: int
    """These five: ``fp8_codes.fp8_byte``'s constexpr arguments (``byte_constants``)."""


@functools.cache
def fp8_constants(fp8: torch.dtype) -> Fp8Constants:
    """``fp8``'s ``Fp8Constants`` (cached: they are asked for before every launch)."""
    fmax = torch.finfo(fp8).max
    return Fp8Constants(FMAX=fmax, EMAX=math.floor(math.log2(fmax)), **byte_constants(fp8))


def check_fp8(fp8: torch.dtype) -> None:
    """``ValueError`` unless ``fp8`` is a format the quantize kernels write."""
    if fp8 not in FP8_DTYPES:
        raise ValueError(f"quantize writes float8_e4m3fn or float8_e5m2, got {fp8}")


@triton.jit
def load_widened(x_ptr, offs, mask, X_BF16: tl.constexpr):  # type: ignore[no-untyped-def]
    """x at ``offs`` as float32 (0 where masked). bf16 arrives as int16 bits; widening is a
    16-bit shift, exact for every value (the interpreter's own bf16 -> float32 conversion
    flushes subnormals)."""
    if X_BF16:
        raw = tl.load(x_ptr + offs, mask=mask, other=0)
        x = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def clamped_byte(s, bound, FMT: tl.constexpr):  # type: ignore[no-untyped-def]
    """The fp8 byte of ``s = x / step`` clamped to ``±bound`` (``fp8_codes.code_bound``:
    ``±max``, lower only where ``max * step`` would overflow float32), so ±inf becomes
    ±bound. Comparisons are false for NaN, so NaN passes to ``fp8_byte``, which writes 0x7F.
    Rounding is ``fp8_byte``'s, on the bits: never Triton's float -> fp8 conversion."""
    s = tl.where(s > bound, bound, tl.where(s < -bound, -bound, s))
    return fp8_byte(s, FMT.MANT, FMT.BIAS, FMT.MIN_NORMAL_BITS, FMT.SUB_MAGIC, FMT.SUB_MAGIC_BITS)
