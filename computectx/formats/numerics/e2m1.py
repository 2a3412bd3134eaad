"""The 4-bit element: E2M1 codes by round-to-nearest-even or stochastic rounding, their
packing into ``torch.float4_e2m1fn_x2``, the counter-based random bits, and the 16-point
random Hadamard transform. Pure torch; the block formats built on it are in
``numerics.fp4``.

**E2M1** (OCP FP4): a sign bit and a 3-bit magnitude code ``m`` whose values are
``E2M1_VALUES[m] = 0, 0.5, 1, 1.5, 2, 3, 4, 6``. ``e2m1_codes`` rounds as Blackwell's
``cvt.rn.satfinite.e2m1x2.f32`` does (CUDA's ``__nv_cvt_float_to_fp4`` states the same
rule for its host path):

- round to nearest, ties to the even code, so the midpoints alternate down and up:
  0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4;
- a magnitude above 6, ±inf included, saturates to ±6 (``satfinite``);
- the sign is kept, on zero too: ``-0.0`` and ``-0.1`` give code ``0x8`` (negative zero);
- NaN gives ``0x7`` (+6): E2M1 has no NaN, and the hardware writes positive max-norm.

Packing (``pack_codes``): element ``2j`` in the low nibble of byte ``j``, element ``2j + 1``
in the high nibble (the kernels' and ``torch.float4_e2m1fn_x2``'s order).

**Stochastic rounding** (``stochastic_codes``): a finite magnitude ``a`` (clamped to 6)
between grid neighbours ``lo <= a < hi`` is coded ``hi`` with probability
``ceil((a - lo) / (hi - lo) * 2**32) / 2**32`` and ``lo`` otherwise: each value becomes one
of its two neighbours, and ``E[value] - a`` is at most ``2**-32 (hi - lo)`` (exactly 0 when
the fraction has at most 32 bits, as every float32 above ``2**-9`` does). Element ``i`` of the
operand (row-major, as stored) draws the 32-bit word ``philox_randint(seed, offset + i)``:
the first output of Philox-4x32-10 with key ``seed`` and counter ``(offset + i, 0, 0)``, which
is Triton's ``tl.randint(seed, offset + i)``, so a kernel can draw the same bits. The bits
are ours, not TransformerEngine's (its own generator is internal to its kernels): stochastic
rounding is held to its distribution, and to itself from a seed. NaN and ±inf are coded as by
round-to-nearest.

**The random Hadamard transform** (``hadamard16``): each run of 16 elements along the last
dimension is multiplied by ``diag(signs) @ H16 / 4`` (``H16`` the Sylvester Hadamard matrix,
``H[i, j] = (-1)**popcount(i & j)``; orthogonal, so ``(a T) (b T)^T = a b^T`` when both GEMM
operands are transformed along the contracted dimension), with the fixed sign vector
``WGRAD_SIGNS`` that TransformerEngine uses for its weight-gradient operands. The result is
rounded to bf16, TE's RHT output dtype: each output ``(±x_0 ± ... ± x_15) / 4`` is summed in
float64 (exact for bf16 inputs, and for float32 runs spanning fewer than about 25 binades),
rounded to float32 (the accumulator's width) and then to bf16. A kernel that accumulates in
float32, in any order, agrees whenever its float32 sums are exact: for bf16 inputs, whenever
the 16 inputs of a run span at most 12 binades (8 significant bits, 4 of carries).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch

from computectx.fp4_recipe import WGRAD_SIGNS  # the policy records it: its home is the core

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "HADAMARD_SIZE",
    "NAN_CODE",
    "WGRAD_SIGNS",
    "Stochastic",
    "code_values",
    "e2m1_codes",
    "hadamard16",
    "hadamard_matrix",
    "pack_codes",
    "packed_values",
    "philox_randint",
    "stochastic_codes",
    "unpack_codes",
]

E2M1_MAX: Final[float] = 6.0
"""The largest E2M1 magnitude."""
E2M1_VALUES: Final[tuple[float, ...]] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitude of each 3-bit code; bit 3 of a code is the sign."""
NAN_CODE: Final[int] = 0x7
"""The code a NaN input gets (+6, as ``cvt.rn.satfinite.e2m1x2.f32`` writes it)."""
HADAMARD_SIZE: Final[int] = 16
"""The length of the runs the Hadamard transform mixes."""

_SIGN = 0x8
_U32 = 0xFFFFFFFF
# Philox-4x32's multipliers and key increments (Salmon et al., SC'11; Triton's values).
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10


@dataclass(frozen=True)
class Stochastic:
    """Stochastic rounding's key: element ``i`` of the operand draws
    ``philox_randint(seed, offset + i)``. A caller advances ``offset`` by the operand's size
    (or draws a fresh seed) per use, so no two quantizations share bits."""

    seed: int
    """The Philox key, an integer in ``[0, 2**64)``."""
    offset: int = 0
    """The counter of element 0, an integer in ``[0, 2**62)`` (an operand's counters stay
    below ``2**63``)."""

    def __post_init__(self) -> None:
        for name, bits in (("seed", 64), ("offset", 62)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**bits:
                raise ValueError(f"{name} must be an integer in [0, 2**{bits}), got {value!r}")


def _magnitude_codes(a: torch.Tensor) -> torch.Tensor:
    """The 3-bit code of each float32 magnitude ``a`` (not NaN) by round-to-nearest-even:
    one step per midpoint passed, ``>`` where the midpoint rounds down (to an even code)
    and ``>=`` where it rounds up; 6 and above (inf) is code 7."""
    c = (a > 0.25).to(torch.uint8)
    c += a >= 0.75
    c += a > 1.25
    c += a >= 1.75
    c += a > 2.5
    c += a >= 3.5
    c += a > 5.0
    return c


def _signed(magnitude: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``magnitude`` codes with ``v``'s sign bit (negative zero kept); NaN is ``NAN_CODE``."""
    codes = torch.where(torch.signbit(v), magnitude | _SIGN, magnitude)
    return torch.where(torch.isnan(v), torch.full_like(codes, NAN_CODE), codes)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """The E2M1 code (uint8, one per element) of each float32 ``v``, round-to-nearest-even
    with saturation, as ``cvt.rn.satfinite.e2m1x2.f32`` (module docstring)."""
    v = v.float()
    return _signed(_magnitude_codes(v.abs()), v)


_CONSTANTS: dict[tuple[object, ...], torch.Tensor] = {}
_TRACING_MODES = tuple(torch._C._TorchDispatchModeKey.__members__.values())  # fake, proxy, ...


def _constant(
    key: tuple[object, ...], device: torch.device, build: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``build()`` on ``device``, kept per ``(key, device)``: a table made from host data is a
    copy to a GPU, once per process rather than once per GEMM. Never written to; made outside
    ``inference_mode`` (it may be saved for a backward). Traced code (``torch.compile``, a
    fake, proxy or functional mode) and a CUDA graph capture (whose copy is filled only when
    the graph replays) build their own, neither reading nor keeping one."""
    if (
        torch.compiler.is_compiling()
        or any(torch._C._get_dispatch_mode(k) is not None for k in _TRACING_MODES)
        or _capturing(device)
    ):
        return build().to(device)
    full = (*key, device)
    cached = _CONSTANTS.get(full)
    if cached is None:
        with torch.inference_mode(False), torch.no_grad():
            cached = _CONSTANTS[full] = build().to(device)
    return cached


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream captures a graph (``device`` a CUDA one)."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


def _code_table(device: torch.device) -> torch.Tensor:
    """float32 value of each of the 16 codes (``0x8`` is ``-0.0``)."""

    def build() -> torch.Tensor:
        magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        return torch.cat((magnitude, -magnitude))

    return _constant(("codes",), device, build)


def _pair_table(device: torch.device) -> torch.Tensor:
    """float32 ``[256, 2]``: the values of each byte's low and high code."""

    def build() -> torch.Tensor:
        table = _code_table(torch.device("cpu"))
        return torch.stack((table.repeat(16), table.repeat_interleave(16)), dim=1)

    return _constant(("pairs",), device, build)


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of each E2M1 code (uint8, one per element; ``0x8`` is ``-0.0``)."""
    index = (codes & 0xF).reshape(-1).to(torch.int32)
    return _code_table(codes.device).index_select(0, index).reshape(codes.shape)


def packed_values(packed: torch.Tensor) -> torch.Tensor:
    """``code_values(unpack_codes(packed))`` in one table look-up per byte: the float32
    values of ``pack_codes``'s bytes, the last dimension doubled."""
    b = packed.view(torch.uint8)
    pairs = _pair_table(b.device)  # [byte] lo, hi
    values = pairs.index_select(0, b.reshape(-1).to(torch.int32))
    return values.reshape(*b.shape[:-1], b.shape[-1] * 2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte (even element low), as ``torch.float4_e2m1fn_x2``; the last
    dimension halves (it must be even)."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous().view(torch.float4_e2m1fn_x2)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The codes (uint8, one per element) of ``pack_codes``'s bytes; the last dimension
    doubles."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


_CHUNK = 1 << 15  # counters per pass of philox_randint: its working set stays in cache


def philox_randint(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """The first 32-bit word (int64 in ``[0, 2**32)``) of Philox-4x32-10 with key ``seed``
    (low, high words) at each counter ``(c & 0xffffffff, c >> 32, 0, 0)``: Triton's
    ``tl.randint(seed, c)`` for int64 counters ``c`` in ``[0, 2**63)``."""
    c = counters.to(torch.int64)
    flat = c.reshape(-1)
    if flat.device.type != "cpu":  # a GPU: one pass (chunks would be launches, not cache)
        return _philox_chunk(seed, flat).reshape(c.shape)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), _CHUNK):
        out[start : start + _CHUNK] = _philox_chunk(seed, flat[start : start + _CHUNK])
    return out.reshape(c.shape)


def _philox_chunk(seed: int, c: torch.Tensor) -> torch.Tensor:
    # Each 32x32-bit product is one int64 product, which wraps modulo 2**64 (two's
    # complement, as torch's integer kernels compute), so its bit pattern is the exact
    # unsigned product: ``p >> 32`` holds the high word in its low 32 bits and ``p`` the low
    # word. The words carry garbage above bit 31 until the XORs that combine them, which
    # are masked once; only the multiplicands (c0, c2) must be clean.
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    # Round 1 with c2 = c3 = 0 (the B product is 0).
    c0 = c & _U32
    p_a = c0 * _ROUND_A
    c0 = (c >> 32).bitwise_xor_(k0).bitwise_and_(_U32)
    c2 = (p_a >> 32).bitwise_xor_(k1).bitwise_and_(_U32)
    c1, c3 = torch.zeros_like(c0), p_a
    for _ in range(_ROUNDS - 1):
        k0, k1 = (k0 + _KEY_A) & _U32, (k1 + _KEY_B) & _U32
        p_b, p_a = c2 * _ROUND_B, c0 * _ROUND_A
        c0 = (p_b >> 32).bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(_U32)
        c2 = (p_a >> 32).bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(_U32)
        c1, c3 = p_b, p_a
    return c0


def stochastic_codes(v: torch.Tensor, key: Stochastic) -> torch.Tensor:
    """The E2M1 code of each float32 ``v`` by stochastic rounding (module docstring), element
    ``i`` of ``v`` (row-major) drawing ``philox_randint(key.seed, key.offset + i)``."""
    v = v.float()
    counters = key.offset + torch.arange(v.numel(), dtype=torch.int64, device=v.device)
    bits = philox_randint(key.seed, counters).view(v.shape)
    a = v.abs().clamp(max=E2M1_MAX)  # satfinite; NaN stays NaN and is coded by _signed
    # The grid's spacing is 0.5 below 2, 1 on [2, 4) and 2 on [4, 6]: dividing by it is
    # exact, so t's fraction is the exact distance to the lower neighbour, in steps.
    spacing = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    t = a / spacing
    low = torch.floor(t)
    # float64 holds the 32-bit draw and the fraction times 2**32 exactly: P(up) is
    # ceil(frac * 2**32) / 2**32.
    up = bits.double() < (t - low).double() * 2.0**32
    magnitude = _magnitude_codes((low + up.float()) * spacing)  # an exact grid value
    return _signed(magnitude, v)


def hadamard_matrix(
    signs: tuple[int, ...] = WGRAD_SIGNS, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``diag(signs) @ H16 / 4``: 16 x 16, entries ±0.25 (exact in any float dtype)."""
    if len(signs) != HADAMARD_SIZE or any(s not in (1, -1) for s in signs):
        raise ValueError(f"signs must be {HADAMARD_SIZE} values each 1 or -1, got {signs!r}")
    i = torch.arange(HADAMARD_SIZE)
    parity = torch.zeros(HADAMARD_SIZE, HADAMARD_SIZE, dtype=torch.int64)
    bits = i[:, None] & i[None, :]
    for b in range(4):
        parity ^= (bits >> b) & 1
    h = 1.0 - 2.0 * parity.double()
    return (torch.tensor(signs, dtype=torch.float64)[:, None] * h / 4.0).to(dtype)


def hadamard16(x: torch.Tensor, signs: tuple[int, ...] = WGRAD_SIGNS) -> torch.Tensor:
    """The random Hadamard transform of every run of 16 along ``x``'s last dimension (a
    multiple of 16), in bf16 (module docstring: exact, then float32, then bf16)."""
    k = x.shape[-1]
    if k % HADAMARD_SIZE:
        raise ValueError(
            f"the Hadamard transform mixes runs of {HADAMARD_SIZE}: the last dimension "
            f"must be a multiple of {HADAMARD_SIZE}, got shape {tuple(x.shape)}"
        )
    t = _constant(("hadamard", tuple(signs)), x.device, lambda: hadamard_matrix(signs))
    y = x.double().reshape(-1, HADAMARD_SIZE) @ t
    return y.float().to(torch.bfloat16).reshape(x.shape)
