"""fp8 quantize kernel: cast with a per-tensor step, amax in the same pass, ring finalize.

One kernel serves three recipes, chosen by constexpr flags:

- ``quantize_with_step``: cast ``x / step`` to fp8 and measure ``amax(x)``;
- ``quantize_delayed``: the same with the step read from the operand's ring; the last
  program to finish (an atomic ticket) writes the amax into the history, reduces the window
  and publishes the next step into the ring: no host sync, no second launch;
- ``quantize_dynamic``: an amax-only launch that also publishes the step, then a cast-only
  launch that reads it.

The pure-torch twins are in ``computectx.fp8.reference``; quantized bytes agree bit for bit.
"""

# ruff: noqa: N803, N806  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRETED", "quantize_delayed", "quantize_dynamic", "quantize_with_step"]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when it
was imported) rather than compiled for a GPU; fixed at import."""
# Under the interpreter every program runs in turn on the CPU: small tiles and few programs
# make small test tensors exercise the grid-stride loop and the last-program finalize.
_BLOCK: Final[int] = 64 if INTERPRETED else 4096
_WARPS: Final[int] = 4 if INTERPRETED else 8
_PROGRAMS_PER_SM: Final[int] = 8
_INTERPRET_PROGRAMS: Final[int] = 3
# The history window is reduced RBLOCK slots at a time; small under the interpreter so
# that short test histories exercise the loop.
_RBLOCK: Final[int] = 16 if INTERPRETED else 1024

# What the last program does after the pass.
_REDUCE_NONE: Final[int] = 0  # nothing: cast only
_REDUCE_AMAX: Final[int] = 1  # write amax
_REDUCE_DYNAMIC: Final[int] = 2  # write amax and the step derived from it
_REDUCE_RING: Final[int] = 3  # delayed scaling: history, window, next step, counts

_FP8_DTYPES: Final = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _fp8_bits(  # type: ignore[no-untyped-def]
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
def _quantize_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    q_ptr,
    step_ptr,
    n_elements,
    scratch_ptr,
    amax_out_ptr,
    step_out_ptr,
    ring_ptr,
    ring_idx,
    n_hist,
    FMAX: tl.constexpr,
    FLT_MAX: tl.constexpr,
    TARGET: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL_BITS: tl.constexpr,
    SUB_MAGIC: tl.constexpr,
    SUB_MAGIC_BITS: tl.constexpr,
    X_BF16: tl.constexpr,
    CAST: tl.constexpr,
    REDUCE: tl.constexpr,
    ALGO_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if CAST:
        step = tl.load(step_ptr)
        if REDUCE == 3:  # noqa: SIM102  (constexpr test, then a run-time one)
            if pid == 0:
                tl.store(step_out_ptr, step)
    # |x| as int32 bits: for non-negative floats the integer order is the float order and
    # every NaN sorts above inf, so an integer max is a NaN-propagating float max.
    amax_bits = tl.zeros((BLOCK,), dtype=tl.int32)
    n_sat = tl.zeros((BLOCK,), dtype=tl.int32)
    num_tiles = tl.cdiv(n_elements, BLOCK)
    for tile in tl.range(pid, num_tiles, nprog):
        offs = tl.cast(tile, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        if X_BF16:
            # bf16 arrives as int16 bits; widening is a 16-bit shift, exact for every value.
            # (The interpreter's own bf16 -> float32 conversion flushes subnormals.)
            raw = tl.load(x_ptr + offs, mask=mask, other=0)
            x = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if REDUCE != 0:
            amax_bits = tl.maximum(amax_bits, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        if CAST:
            # IEEE division, as the twin does: x / step, not x * (1 / step).
            s = tl.div_rn(x, step)
            if REDUCE == 3:
                n_sat += ((s > FMAX) | (s < -FMAX)).to(tl.int32)
            # Comparisons are false for NaN, so NaN passes through; ±inf becomes ±max.
            s = tl.where(s > FMAX, FMAX, tl.where(s < -FMAX, -FMAX, s))
            code = _fp8_bits(s, MANT, BIAS, MIN_NORMAL_BITS, SUB_MAGIC, SUB_MAGIC_BITS)
            tl.store(q_ptr + offs, code, mask=mask)
    if REDUCE != 0:
        # Cross-program traffic is scalar atomics only, issued in program order by one
        # thread: fold this program's amax and saturation count into the scratch, then take
        # a ticket with acq_rel, which publishes both to whoever draws the last ticket.
        tl.atomic_max(scratch_ptr + 1, tl.max(amax_bits, axis=0), sem="relaxed")
        if REDUCE == 3:
            tl.atomic_add(scratch_ptr + 2, tl.sum(n_sat, axis=0), sem="relaxed")
        ticket = tl.atomic_add(scratch_ptr, 1, sem="acq_rel")
        if ticket == nprog - 1:
            # Read-and-zero every slot: the scratch is ready for the next launch.
            bits = tl.atomic_xchg(scratch_ptr + 1, 0, sem="acq_rel")
            sat_count = tl.atomic_xchg(scratch_ptr + 2, 0, sem="acq_rel")
            tl.atomic_xchg(scratch_ptr, 0, sem="acq_rel")
            # One NaN for every NaN input (the twin's): payloads carry no information.
            bits = tl.where(bits > 0x7F800000, 0x7FC00000, bits)
            amax = bits.to(tl.float32, bitcast=True)
            finite = bits < 0x7F800000
            if REDUCE == 1:
                tl.store(amax_out_ptr, amax)
            if REDUCE == 2:
                tl.store(amax_out_ptr, amax)
                # NaN, inf, underflow to 0 and overflow to inf all fail this test.
                step_new = tl.div_rn(amax, TARGET)
                ok = (step_new > 0.0) & (step_new <= FLT_MAX)
                tl.store(step_out_ptr, tl.where(ok, step_new, 1.0))
            if REDUCE == 3:
                # The window with this amax in slot ring_idx, built in registers (the ring
                # itself is written once, below).
                window = tl.zeros((RBLOCK,), dtype=tl.float32)
                for hstart in tl.range(0, n_hist, RBLOCK):
                    h_offs = hstart + tl.arange(0, RBLOCK)
                    h = tl.load(ring_ptr + h_offs, mask=h_offs < n_hist, other=0.0)
                    h = tl.where(h_offs == ring_idx, amax, h)
                    window = tl.maximum(window, h)
                chosen = tl.max(window, axis=0) if ALGO_MAX else amax
                step_new = tl.div_rn(chosen, TARGET)
                ok = (step_new > 0.0) & (step_new <= FLT_MAX)
                step_new = tl.where(ok, step_new, 1.0)
                old_hist = tl.load(ring_ptr + ring_idx)
                old_step = tl.load(ring_ptr + n_hist)
                n_bad = tl.load(ring_ptr + n_hist + 1)
                n_sat_old = tl.load(ring_ptr + n_hist + 2)
                tl.store(ring_ptr + ring_idx, tl.where(finite, amax, old_hist))
                tl.store(ring_ptr + n_hist, tl.where(finite, step_new, old_step))
                tl.store(ring_ptr + n_hist + 1, n_bad + tl.where(finite, 0.0, 1.0))
                tl.store(ring_ptr + n_hist + 2, n_sat_old + sat_count.to(tl.float32))


# ---------------------------------------------------------------------------------------
# Launchers: check constraints, allocate, launch.

_SCRATCH: dict[tuple[torch.device, int], torch.Tensor] = {}


def _scratch(device: torch.device) -> torch.Tensor:
    # int32 [ticket, amax bits, saturated count] per (device, stream), zeroed once and
    # zeroed again by the last program of every launch: launches on one stream run in
    # order, so the cached scratch needs no memset launch of its own.
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    t = _SCRATCH.get(key)
    if t is None:
        t = torch.zeros(3, dtype=torch.int32, device=device)
        _SCRATCH[key] = t
    return t


def _num_programs(x: torch.Tensor) -> int:
    tiles = max(1, triton.cdiv(x.numel(), _BLOCK))
    if INTERPRETED or x.device.type != "cuda":
        return min(tiles, _INTERPRET_PROGRAMS)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return min(tiles, sms * _PROGRAMS_PER_SM)


def _check(x: torch.Tensor, fp8: torch.dtype, *scalars: torch.Tensor) -> None:
    if fp8 not in _FP8_DTYPES:
        raise ValueError(f"quantize writes float8_e4m3fn or float8_e5m2, got {fp8}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize reads bf16, fp16 or fp32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("quantize kernels read contiguous tensors; pass x.contiguous()")
    for s in scalars:
        if s.dtype != torch.float32 or s.device != x.device or not s.is_contiguous():
            raise ValueError(
                f"steps and rings are contiguous float32 on {x.device}; got {s.dtype} on {s.device}"
            )


def _f32_bits(value: float) -> int:
    bits: int = struct.unpack("<i", struct.pack("<f", value))[0]
    return bits


@functools.cache
def _fmt_constants(fp8: torch.dtype, margin: int) -> Mapping[str, object]:
    # Everything derives from torch.finfo, so this module needs only torch and triton:
    # eps = 2**-mantissa_bits, and the smallest subnormal is one eps of the smallest normal.
    # Cached: it runs before every launch, and a run uses a handful of (format, margin).
    fi = torch.finfo(fp8)
    mant = round(-math.log2(fi.eps))
    exponent_bits = fi.bits - 1 - mant
    min_subnormal = fi.smallest_normal * fi.eps
    sub_magic = min_subnormal * 2.0**23
    return MappingProxyType(
        {
            "FMAX": fi.max,
            "FLT_MAX": torch.finfo(torch.float32).max,
            # fmax / 2**margin is exact, so the step is a single rounded division.
            "TARGET": fi.max / 2.0**margin,
            "MANT": mant,
            "BIAS": 2 ** (exponent_bits - 1) - 1,
            "MIN_NORMAL_BITS": _f32_bits(fi.smallest_normal),
            "SUB_MAGIC": sub_magic,
            "SUB_MAGIC_BITS": _f32_bits(sub_magic),
        }
    )


def _launch(
    x: torch.Tensor,
    q: torch.Tensor,
    step: torch.Tensor,
    amax_out: torch.Tensor,
    step_out: torch.Tensor,
    ring: torch.Tensor,
    ring_idx: int,
    n_hist: int,
    fp8: torch.dtype,
    margin: int,
    cast: bool,
    reduce: int,
    algo_max: bool,
) -> None:
    nprog = _num_programs(x)
    n = x.numel()
    if n == 0:  # nothing to read or write, but the reduction (amax 0) still runs
        x, q = x.new_empty(1), q.new_empty(1)
    _quantize_kernel[(nprog,)](
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        q.view(torch.uint8),
        step,
        n,
        _scratch(x.device),
        amax_out,
        step_out,
        ring,
        ring_idx,
        n_hist,
        X_BF16=x.dtype == torch.bfloat16,
        CAST=cast,
        REDUCE=reduce,
        ALGO_MAX=algo_max,
        BLOCK=_BLOCK,
        RBLOCK=_RBLOCK,
        num_warps=_WARPS,
        **_fmt_constants(fp8, margin),
    )


def quantize_with_step(
    x: torch.Tensor, fp8: torch.dtype, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8(clamp(x / step)), amax(x))`` in one pass; ``step`` is float32 ``(1,)``.

    ``fp8`` is ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (as in every launcher here).
    """
    _check(x, fp8, step)
    q = torch.empty(x.shape, dtype=fp8, device=x.device)
    amax = torch.empty(1, dtype=torch.float32, device=x.device)
    _launch(x, q, step, amax, amax, step, 0, 0, fp8, 0, True, _REDUCE_AMAX, False)
    return q, amax


def quantize_dynamic(
    x: torch.Tensor, fp8: torch.dtype, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, step, amax)``: an amax launch that publishes the step, then a cast launch."""
    _check(x, fp8)
    q = torch.empty(x.shape, dtype=fp8, device=x.device)
    amax = torch.empty(1, dtype=torch.float32, device=x.device)
    step = torch.empty(1, dtype=torch.float32, device=x.device)
    _launch(x, q, step, amax, step, step, 0, 0, fp8, margin, False, _REDUCE_DYNAMIC, False)
    _launch(x, q, step, amax, step, step, 0, 0, fp8, margin, True, _REDUCE_NONE, False)
    return q, step, amax


def quantize_delayed(
    x: torch.Tensor,
    fp8: torch.dtype,
    ring: torch.Tensor,
    idx: int,
    algo: Literal["max", "most_recent"],
    margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, step_used)``, quantizing with ``ring[n]`` and advancing the ring in-kernel."""
    _check(x, fp8, ring)
    n = ring.numel() - 3
    if not 0 <= idx < n:
        raise ValueError(f"ring index {idx} is outside the history [0, {n})")
    q = torch.empty(x.shape, dtype=fp8, device=x.device)
    step_used = torch.empty(1, dtype=torch.float32, device=x.device)
    step_slot = ring[n : n + 1]
    _launch(
        x, q, step_slot, step_used, step_used, ring, idx, n, fp8, margin, True,
        _REDUCE_RING, algo == "max",
    )  # fmt: skip
    return q, step_used
