"""The 4-bit quantize: NVFP4 and MXFP4 codes and block scales of a row-wise operand, or of the
wgrad's column-wise one with the random Hadamard transform, with round-to-nearest or stochastic
rounding; the arithmetic of the twins (``computectx.formats.numerics.fp4``, ``e2m1`` and
``fp4_gemm.wgrad_operand``), bit for bit.

``fp4_quantize(x, ...)`` takes the operator ``computectx::fp4_quantize``'s arguments and returns
its ``(codes, scale, amax)``: codes ``torch.float4_e2m1fn_x2`` (two a byte, even element low),
NVFP4 scales ``float8_e4m3fn`` per 1x16 block or 16x16 tile with the float32 per-tensor amax,
MXFP4 scales ``float8_e8m0fnu`` per 1x32 block (``"rceil"`` or ``"floor"``) and the amax of
``x``, unused. Up to three launches, no host synchronisation:

1. column-wise with the transform: ``_hadamard_kernel`` writes ``y = hadamard16(pad(x).t())``,
   bf16 ``[K, M_pad]`` (each run of 16 tokens times ``diag(signs) H16 / 4``, summed in float32
   and rounded to bf16 on the bits), and the amax of its finite elements;
2. otherwise, NVFP4: ``_amax_kernel``, the amax of ``x``'s finite elements (any strides);
3. ``_quantize_kernel``: each program's ``TILE_R`` rows by ``GROUPS`` blocks, loaded along the
   unit stride (vector loads) and split into each byte's two elements. A block's amax (NaN if
   it holds a NaN), its scale and encode factor, ``code = e2m1(x * encode)``:

   - NVFP4: ``S_enc = min(2688 / amax, FLT_MAX)`` (1 for 0), ``S_dec = e4m3(min(block_amax *
     (S_enc * f32(1/6)), 448))`` rounded on the bits (``fp8_codes.fp8_byte``, never Triton's
     float -> fp8 cast: the interpreter's mis-rounds a carry into the exponent), ``encode =
     min(1 / (f32(S_dec) * (1 / S_enc)), FLT_MAX)``, every division IEEE (``div_rn``);
   - MXFP4: the E8M0 byte from the block amax's float32 bits (``floor``: the exponent minus 2;
     ``rceil``: the exact ``ceil(log2(amax / 6))``), ``encode = 2**(127 - byte)`` from its bits;
   - round to nearest even by E2M1's midpoints, or stochastically: element ``i`` of the operand
     (row-major, as stored) draws ``tl.randint(seed, counter + i)``, Philox-4x32-10, the twin's
     ``e2m1.philox_randint``; the key, the int64 ``rng`` tensor ``[seed, counter]``, is read
     on the host when it lies on the CPU (plain host memory: the launch takes the two words
     as scalar arguments, nothing copied to the device) and by the kernel when it lies on
     the device (never on the host).

The column-wise operand without the transform is ``x.t()`` read through its strides, its
padding columns loaded as zeros. Every kernel is built without floating-point contraction
(``fp4_gemm.BUILD_OPTIONS``). Where the twin and the kernels can part: the transform's
float32 sums are exact, hence the twin's (float64, then float32, then bf16), whenever the 16
inputs of a run span at most 12 binades in bf16 (``numerics.e2m1``); float32 inputs, or wider
runs, may round differently in the last bf16 place.
"""

# ruff: noqa: N803, N806  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

from typing import Final

import torch
import triton
import triton.language as tl

from computectx.kernels.fp4_gemm import BUILD_OPTIONS
from computectx.kernels.fp8_codes import FLOAT_DTYPES, e8m0_step, fp8_byte, round_to_bf16
from computectx.kernels.quantize_cast import FLT_MAX, fp8_constants, load_widened

__all__ = ["HADAMARD_SIZE", "INTERPRETED", "fp4_quantize", "wgrad_row_multiple"]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernels run in Triton's interpreter; fixed at import."""

HADAMARD_SIZE: Final[int] = 16
"""The runs the transform mixes (``numerics.e2m1.HADAMARD_SIZE``; a test holds them equal)."""


def wgrad_row_multiple(vec: int, hadamard: bool) -> int:
    """What a column-wise (wgrad) operand pads its rows to: the block ``vec``, and a multiple
    of ``HADAMARD_SIZE`` under the transform (``numerics.fp4_gemm.wgrad_row_multiple``'s rule;
    a test holds them equal: kernels import nothing of computectx)."""
    return max(vec, HADAMARD_SIZE) if hadamard else vec


_SIXTH = tl.constexpr(float(torch.tensor(1.0) / torch.tensor(6.0)))  # f32(1/6), as TE's
# Interpreted: small tiles, so test shapes span several programs.
_TILE_R, _GROUPS = (16, 2) if INTERPRETED else (32, 8)
_AMAX_TILE = (32, 64) if INTERPRETED else (64, 256)
_HADAMARD_COLUMNS = 16 if INTERPRETED else 64


@triton.jit
def _nan_where(cond, x):  # type: ignore[no-untyped-def]
    # NaN where cond, else float32 x (from the bits: a NaN constant would not be equal to
    # itself, which Triton's check of the globals a kernel reads refuses).
    bits = tl.where(cond, 0x7FC00000, x.to(tl.int32, bitcast=True))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _magnitude(x):  # type: ignore[no-untyped-def]
    # |x| for float32 x, on the bits (NaN stays NaN).
    return (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _finite_abs_max(x):  # type: ignore[no-untyped-def]
    # The largest |x| over the finite elements of the 2-D x (0 if none), as float32 bits:
    # non-negative floats order as their bits.
    a = _magnitude(x)
    a = tl.where(a <= FLT_MAX, a, 0.0)  # NaN and inf out
    return tl.max(tl.max(a, axis=1), axis=0).to(tl.int32, bitcast=True)


@triton.jit
def _amax_kernel(  # type: ignore[no-untyped-def]
    x_ptr, amax_ptr, R, C, stride_r, stride_c, X_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs = rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
    x = load_widened(x_ptr, offs, (rows[:, None] < R) & (cols[None, :] < C), X_BF16)
    tl.atomic_max(amax_ptr, _finite_abs_max(x), sem="relaxed")


@triton.jit
def _hadamard_kernel(  # type: ignore[no-untyped-def]
    x_ptr, y_ptr, amax_ptr, M, K, M_PAD, stride_m, stride_k, SIGNS: tl.constexpr,
    X_BF16: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Run program_id(0) (16 tokens) of columns program_id(1) * BLOCK_K...: y[k, run] (bf16
    # bits, y [K, M_PAD]) = x[run, k] (zeros past M) times diag(signs) H16 / 4.
    j = tl.arange(0, 16)
    tokens = tl.program_id(0) * 16 + j
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs = tokens[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_k
    x = load_widened(x_ptr, offs, (tokens[:, None] < M) & (cols[None, :] < K), X_BF16)
    # T[j, i] = signs[j] (-1)**popcount(j & i) / 4: entries ±0.25, every product exact.
    both = j[:, None] & j[None, :]
    parity = (both ^ (both >> 1) ^ (both >> 2) ^ (both >> 3)) & 1
    negative = parity ^ ((SIGNS >> j[:, None]) & 1)
    t = tl.where(negative == 1, -0.25, 0.25)
    y = tl.sum(t[:, :, None] * x[:, None, :], axis=0)  # [16 outputs i, BLOCK_K]
    y = round_to_bf16(y)
    tl.atomic_max(amax_ptr, _finite_abs_max(y), sem="relaxed")
    y_offs = cols[None, :].to(tl.int64) * M_PAD + tokens[:, None]
    bits = (y.to(tl.int32, bitcast=True) >> 16).to(tl.int16)  # type: ignore[attr-defined]
    tl.store(y_ptr + y_offs, bits, mask=(cols[None, :] < K) & (tokens[:, None] < M_PAD))


@triton.jit
def _e4m3_value(byte):  # type: ignore[no-untyped-def]
    # The float32 value of an E4M3 byte (int32 0..255), from its bits; 0x7F/0xFF NaN.
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormals: m * 2**-9
    v = tl.where((byte & 0x80) != 0, -v, v)
    return _nan_where((byte & 0x7F) == 0x7F, v)


@triton.jit
def _magnitude_code(a):  # type: ignore[no-untyped-def]
    # The 3-bit code of float32 magnitudes a by round-to-nearest-even (numerics.e2m1's
    # midpoints: > where the tie goes down to an even code, >= where it goes up).
    c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    c += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    return c + (a > 5.0).to(tl.int32)


@triton.jit
def _codes(v, seed, counters, SR: tl.constexpr):  # type: ignore[no-untyped-def]
    # The E2M1 code (int32 0..15) of each float32 v: nearest even or stochastic (the twin's
    # stochastic_codes: P(up) = ceil(frac * 2**32) / 2**32), sign bit kept, NaN 0x7.
    a = _magnitude(v)
    a = tl.where(a > 6.0, 6.0, a)  # satfinite (NaN is coded below)
    if SR:
        # The grid's spacing is 0.5 below 2, 1 on [2, 4), 2 on [4, 6]: a / spacing is exact,
        # its fraction the exact distance to the lower neighbour, in steps; frac * 2**32 is
        # exact, and so is its ceiling (at most 2**32) as an integer.
        inv = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
        spacing = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
        t = a * inv
        low = t.to(tl.int32).to(tl.float32)  # floor: t >= 0
        f = (t - low) * 4294967296.0
        ceil = f.to(tl.int64) + (f.to(tl.int64).to(tl.float32) < f).to(tl.int64)
        bits = tl.randint(seed, counters).to(tl.int64) & 0xFFFFFFFF  # type: ignore[attr-defined]
        a = (low + (bits < ceil).to(tl.float32)) * spacing  # a grid value, exactly
    code = _magnitude_code(a)
    code = tl.where(v.to(tl.int32, bitcast=True) < 0, code | 0x8, code)
    return tl.where(v != v, 0x7, code)


@triton.jit
def _block_scales(  # type: ignore[no-untyped-def]
    bmax, amax_ptr, NVFP4: tl.constexpr, FLOOR: tl.constexpr, FMT: tl.constexpr
):
    # (scale byte int32, encode factor float32) of each block amax (NaN for a block with a
    # NaN): the twins' quantize_nvfp4 and quantize_mxfp4, operation for operation.
    if NVFP4:
        amax = tl.load(amax_ptr)
        s_enc = tl.div_rn(tl.full(bmax.shape, 2688.0, tl.float32), amax)
        s_enc = tl.where(s_enc > FLT_MAX, FLT_MAX, s_enc)
        s_enc = tl.where(s_enc == 0.0, 1.0, tl.where(amax == 0.0, 1.0, s_enc))
        s = bmax * (s_enc * _SIXTH)
        s = tl.where(s > 448.0, 448.0, s)  # an upper clamp only; NaN passes
        byte = fp8_byte(
            s, FMT.MANT, FMT.BIAS, FMT.MIN_NORMAL_BITS, FMT.SUB_MAGIC, FMT.SUB_MAGIC_BITS
        ).to(tl.int32)
        one = tl.full(bmax.shape, 1.0, tl.float32)
        factor = _e4m3_value(byte) * tl.div_rn(one, s_enc)
        encode = tl.div_rn(one, factor)
        encode = tl.where(encode > FLT_MAX, FLT_MAX, encode)
    else:
        if FLOOR:
            # The exponent field: floor(log2) of a normal amax; E2M1's largest is 2**2.
            e = ((bmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 129
        else:
            # ceil(log2(amax / 6)) exactly: a subnormal d lies in (2**-127, 2**-126) -> -126,
            # at most 2**-127 -> -127.
            d = tl.div_rn(bmax, tl.full(bmax.shape, 6.0, tl.float32)).to(tl.int32, bitcast=True)
            biased, frac = (d >> 23) & 0xFF, d & 0x7FFFFF
            sub = tl.where(frac > (1 << 22), -126, -127)
            e = tl.where(biased > 0, biased - 127 + (frac != 0).to(tl.int32), sub)
        e = tl.where(e < -127, -127, tl.where(e > 127, 127, e))
        byte = tl.where(bmax != bmax, 255, e + 127)
        # 2**(127 - byte) is the E8M0 value of byte 254 - byte; rceil leaves byte 0's block.
        clamped = tl.where(byte < 1, 1, tl.where(byte > 254, 254, byte))
        encode = e8m0_step(254 - clamped)
        if not FLOOR:
            encode = tl.where(byte == 0, 1.0, encode)
        encode = _nan_where(byte == 255, encode)
    return byte, encode


# The key's words are values, not shapes: no specialisation on them (a seed or counter of 1,
# or a multiple of 16, would build another kernel).
@triton.jit(do_not_specialize=["seed", "counter"])  # type: ignore[call-arg]  # stub: jit(fn) only
def _quantize_kernel(  # type: ignore[no-untyped-def]
    x_ptr, codes_ptr, scale_ptr, amax_ptr, rng_ptr, seed, counter, R, C, C_VALID, stride_r,
    stride_c, stride_qr, stride_sr, X_BF16: tl.constexpr, NVFP4: tl.constexpr,
    ROWS: tl.constexpr, VEC: tl.constexpr, FLOOR: tl.constexpr, SR: tl.constexpr,
    KEY_IN_MEMORY: tl.constexpr, FMT: tl.constexpr, TILE_R: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    # TILE_R rows by GROUPS blocks of the operand [R, C] (x's columns past C_VALID read as 0):
    # the even and odd elements of each byte apart, the blocks as [rows / ROWS, ROWS, GROUPS,
    # VEC / 2]. The key: the scalars seed and counter, or with KEY_IN_MEMORY the int64
    # [seed, counter] at rng_ptr, its counter plus the scalar counter.
    HALF: tl.constexpr = VEC // 2
    CB: tl.constexpr = GROUPS * HALF
    rows = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    pairs = tl.program_id(1) * CB + tl.arange(0, CB)
    ok_r = rows[:, None] < R
    base = rows[:, None].to(tl.int64) * stride_r
    # One contiguous load of the tile (vector loads along a unit stride), split into the even
    # and odd elements.
    cols = tl.program_id(1) * (2 * CB) + tl.arange(0, 2 * CB)
    offs = base + cols[None, :].to(tl.int64) * stride_c
    x = load_widened(x_ptr, offs, ok_r & (cols[None, :] < C_VALID), X_BF16)
    lo, hi = tl.split(tl.reshape(x, (TILE_R, CB, 2)))  # type: ignore[attr-defined]
    even = (2 * pairs)[None, :].to(tl.int64)
    SHAPE: tl.constexpr = (TILE_R // ROWS, ROWS, GROUPS, HALF)
    lo4, hi4 = tl.reshape(lo, SHAPE), tl.reshape(hi, SHAPE)  # type: ignore[attr-defined]
    mag = tl.maximum(_magnitude(lo4), _magnitude(hi4))
    nan = ((lo4 != lo4) | (hi4 != hi4)).to(tl.int32)
    bmax = tl.max(tl.max(mag, axis=3), axis=1)
    bmax = _nan_where(tl.max(tl.max(nan, axis=3), axis=1) > 0, bmax)
    byte, encode = _block_scales(bmax, amax_ptr, NVFP4, FLOOR, FMT)
    enc = tl.reshape(tl.broadcast_to(encode[:, None, :, None], SHAPE), (TILE_R, CB))  # type: ignore[attr-defined]
    if SR:
        if KEY_IN_MEMORY:
            seed = tl.load(rng_ptr)
            counter = tl.load(rng_ptr + 1) + counter
        # int64 whatever width the launch gave a scalar: a negative seed sign-extends, as
        # the two's complement int64 the key holds (tl.randint reads it as uint64).
        seed = seed.to(tl.int64)
    first = rows[:, None].to(tl.int64) * C + even + counter
    code = _codes(lo * enc, seed, first, SR) | (_codes(hi * enc, seed, first + 1, SR) << 4)
    ok_q = ok_r & (pairs[None, :] < C // 2)
    q_offs = rows[:, None].to(tl.int64) * stride_qr + pairs[None, :]
    tl.store(codes_ptr + q_offs, code.to(tl.uint8), mask=ok_q)
    srows = tl.program_id(0) * (TILE_R // ROWS) + tl.arange(0, TILE_R // ROWS)
    sblocks = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    s_offs = srows[:, None].to(tl.int64) * stride_sr + sblocks[None, :]
    ok_s = (srows[:, None] < R // ROWS) & (sblocks[None, :] < C // VEC)
    tl.store(scale_ptr + s_offs, byte.to(tl.uint8), mask=ok_s)


def _check(
    x: object, fmt: str, tile: str, mx_rounding: str, signs: list[int], rng: object
) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() != 2:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
        raise ValueError(f"x must be a 2-D bf16, fp16 or fp32 tensor, got {got}")
    accepted = {"nvfp4": ("1x16", "16x16"), "mxfp4": ("1x16", "16x16", "1x32")}
    if fmt not in accepted or tile not in accepted[fmt]:
        raise ValueError(
            f"format and tile must be nvfp4 with '1x16' or '16x16', or mxfp4 (1x32 blocks "
            f"whatever the tile says, as the operator), got {fmt!r} and {tile!r}"
        )
    if mx_rounding not in ("rceil", "floor"):
        raise ValueError(f"mx_rounding must be 'rceil' or 'floor', got {mx_rounding!r}")
    if len(signs) != HADAMARD_SIZE or any(s not in (1, -1) for s in signs):
        raise ValueError(f"signs must be {HADAMARD_SIZE} values each 1 or -1, got {signs!r}")
    if rng is not None and (
        not isinstance(rng, torch.Tensor)
        or rng.dtype != torch.int64
        or tuple(rng.shape) != (2,)
        or rng.device not in (x.device, torch.device("cpu"))
    ):
        raise ValueError(
            f"rng must be None or an int64 (2,) [seed, counter] on {x.device} or the CPU: {rng!r}"
        )
    if not INTERPRETED and x.device.type != "cuda":
        raise ValueError(f"the compiled 4-bit quantize runs on a CUDA device, got {x.device}")
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    # bf16 travels as its int16 bits (quantize_cast.load_widened widens them exactly).
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _amax_of(t: torch.Tensor, rows: int, cols: int, strides: tuple[int, int]) -> torch.Tensor:
    # float32 (1,): the largest finite |t| of a rows x cols view with those strides (0 if none).
    bits = torch.zeros(1, dtype=torch.int32, device=t.device)
    br, bc = _AMAX_TILE
    if rows and cols:
        grid = (triton.cdiv(rows, br), triton.cdiv(cols, bc))
        _amax_kernel[grid](
            _bits(t), bits, rows, cols, *strides, X_BF16=t.dtype == torch.bfloat16,
            BLOCK_R=br, BLOCK_C=bc, **BUILD_OPTIONS,
        )  # fmt: skip
    return bits.view(torch.float32)


def _hadamard(x: torch.Tensor, m_pad: int, signs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    # (hadamard16(pad(x).t()) as bf16 [K, m_pad], its finite amax float32 (1,)).
    m, k = x.shape
    y = torch.empty((k, m_pad), dtype=torch.bfloat16, device=x.device)
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    if m_pad and k:
        mask = sum(1 << j for j, s in enumerate(signs) if s == -1)
        grid = (m_pad // HADAMARD_SIZE, triton.cdiv(k, _HADAMARD_COLUMNS))
        _hadamard_kernel[grid](
            _bits(x), y.view(torch.int16), bits, m, k, m_pad, *x.stride(), SIGNS=mask,
            X_BF16=x.dtype == torch.bfloat16, BLOCK_K=_HADAMARD_COLUMNS, **BUILD_OPTIONS,
        )  # fmt: skip
    return y, bits.view(torch.float32)


def _key_args(rng: torch.Tensor | None) -> tuple[torch.Tensor | None, int, int]:
    """``(key tensor the kernel reads, seed, counter)`` of a stochastic-rounding key: a key
    on the CPU (a layer's plain state, the operator's) is read on the host as two ints and
    passed by value (host memory: no device synchronisation, nothing copied to the device);
    a key on the device is read by the kernel, never on the host (``(rng, 0, 0)``)."""
    if rng is None:
        return None, 0, 0
    if rng.device.type == "cpu":
        seed, counter = (int(v) for v in rng.tolist())
        return None, seed, counter
    return rng, 0, 0


def fp4_quantize(
    x: torch.Tensor,
    format: str,
    tile: str,
    mx_rounding: str,
    columnwise: bool,
    hadamard: bool,
    signs: list[int],
    rng: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scale, amax)`` of a 2-D ``x``, as the operator ``computectx::fp4_quantize``
    (its arguments but the backend): the row-wise operand at ``tile`` (NVFP4 ``"1x16"`` or
    ``"16x16"``, MXFP4 1x32 by ``mx_rounding``), or with ``columnwise`` the wgrad's operand of
    ``x.t()`` (tokens zero-padded to the block, and to 16 under ``hadamard``, transformed
    with ``signs``); ``rng`` an int64 ``(2,)`` ``[seed, counter]`` for stochastic rounding,
    on ``x``'s device (read there by the kernel) or the CPU (read on the host, passed to the
    launch as two integers: no copy to the device).
    ``amax`` is float32 ``(1,)``: NVFP4's per-tensor amax (of the transformed tensor under
    the transform), MXFP4's of ``x`` (unused). ``ValueError`` naming a bad argument."""
    x = _check(x, format, tile, mx_rounding, signs, rng)
    in_memory, seed, counter = _key_args(rng)
    nvfp4 = format == "nvfp4"
    vec = 16 if nvfp4 else 32
    rows = 16 if nvfp4 and tile == "16x16" and not columnwise else 1
    m, k = x.shape
    if columnwise:
        multiple = wgrad_row_multiple(vec, hadamard)
        r, c = k, -(-m // multiple) * multiple
        operand, valid, strides = x, m, (x.stride(1), x.stride(0))
    else:
        r, c = m, k
        operand, valid, strides = x, k, (x.stride(0), x.stride(1))
    if c % vec or r % rows:
        raise ValueError(
            f"a {format} {tile if nvfp4 else '1x32'} operand needs the last dimension a multiple "
            f"of {vec} and rows of {rows}, got shape {tuple(x.shape)}"
        )
    amax = _amax_of(x, m, k, (x.stride(0), x.stride(1)))
    if columnwise and hadamard:
        operand, transformed = _hadamard(x, c, signs)
        valid, strides = c, (operand.stride(0), operand.stride(1))
        amax = transformed if nvfp4 else amax
    codes = torch.empty((r, c // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((r // rows, c // vec), dtype=torch.uint8, device=x.device)
    if r and c:
        grid = (triton.cdiv(r, _TILE_R), triton.cdiv(c, _GROUPS * vec))
        _quantize_kernel[grid](
            _bits(operand), codes, scale, amax, amax if in_memory is None else in_memory, seed,
            counter, r, c, valid, *strides, codes.stride(0), scale.stride(0),
            X_BF16=operand.dtype == torch.bfloat16, NVFP4=nvfp4, ROWS=rows, VEC=vec,
            FLOOR=mx_rounding == "floor", SR=rng is not None, KEY_IN_MEMORY=in_memory is not None,
            FMT=fp8_constants(torch.float8_e4m3fn), TILE_R=max(_TILE_R, rows), GROUPS=_GROUPS,
            **BUILD_OPTIONS,
        )  # fmt: skip
    scale_dtype = torch.float8_e4m3fn if nvfp4 else torch.float8_e8m0fnu
    return codes.view(torch.float4_e2m1fn_x2), scale.view(scale_dtype), amax
