"""The 4-bit block formats' twins: NVFP4 and MXFP4 quantize and dequantize in pure torch,
with TransformerEngine's arithmetic (NVFP4) and torchao's ``MXTensor`` bytes (MXFP4).

Elements are E2M1 codes (``numerics.e2m1``), two a byte in ``torch.float4_e2m1fn_x2``. An
operand is 2-D, ``rows x K`` with K (the last dimension) contracted by its GEMM; a tensor of
more dimensions is read as ``prod(leading) x K``.

**NVFP4** (``quantize_nvfp4``): one E4M3 scale per block of 16 consecutive elements along K
(``"1x16"``: activations, gradients; weights as an option) or per 16 x 16 tile (``"16x16"``:
weights, TE's default; a 2-D operand), and one float32 per-tensor amax. In float32, every
operation rounded to nearest even, in this order (TE's ``core_nvfp4.cuh`` as torchao's
``nvfp4_reference.py`` transcribes it)::

    S_enc  = min(448 * 6 / amax, FLT_MAX)          1 when amax is 0 or S_enc is 0
    S_dec  = e4m3(min(block_amax * (S_enc * (1/6)), 448))          rounded once
    encode = min(1 / (f32(S_dec) * (1 / S_enc)), FLT_MAX)
    code   = e2m1(x * encode)                      round to nearest even, or stochastic

There is no lower clamp on ``S_dec``: a zero block, or one whose scale underflows E4M3
(``block_amax * S_enc / 6 <= 2**-10``), gets the zero scale (byte 0), ``encode = FLT_MAX``,
and codes that dequantize to 0 (its nonzero elements code ±6 or less times a zero scale).
``(block_amax / 6) * S_enc`` (two roundings) and a lower clamp at E4M3's smallest normal
(torchao's ``NVFP4Tensor``) are other recipes. Dequantize: ``e2m1 * (f32(S_dec) * (1 /
S_enc))``, one float32 product per element.

**MXFP4** (``quantize_mxfp4``): one E8M0 scale ``2**(byte - 127)`` per 32 consecutive
elements along K, no per-tensor scale; the byte from the block amax by

- ``"floor"`` (OCP): ``floor(log2(amax)) - 2`` (read from the float32 exponent field: -127
  for a zero or subnormal amax), clamped to ``[-127, 127]``; elements are multiplied by
  ``2**(127 - byte)``, at most ``2**126`` (torchao's floor at float32's smallest normal for
  byte 0);
- ``"rceil"`` (cuBLAS, TE): ``ceil(log2(amax / 6))``, exactly (``cvt.rp``'s rounding),
  clamped to ``[-127, 127]``; elements are multiplied by ``2**(127 - byte)``, and by 1 for
  byte 0 (as torchao does, citing TE's ``ptx.cuh``).

A zero block gets byte 0. The bytes are torchao 0.18's ``MXTensor.to_mx(x,
torch.float4_e2m1fn_x2, 32, scaling_mode)`` for finite and infinite inputs (torchao's eager
``"rceil"`` takes ``ceil(torch.log2(.))`` in float32, which can miss by one where ``amax / 6``
lies within a few ulps above a power of two; ours is the exact ceiling).

**Non-finite inputs** (one rule for both formats): NaN and ±inf never enter the per-tensor
amax (``tensor_amax`` is over finite elements), so they change no other block. A block
holding a NaN gets the NaN scale (E4M3 ``0x7F``, E8M0 ``0xFF``), so it dequantizes to NaN,
and every code in it is ``0x7`` (its encode factor is NaN). A block holding ±inf and no NaN
has amax inf: NVFP4's scale saturates at 448 and ±inf codes ±6 (it dequantizes to about
±amax of the finite elements); MXFP4's byte is 253 (``"floor"``) or 254 (``"rceil"``).
torchao codes a NaN element 0x3 and lets a NaN into the NVFP4 amax; TE's reference does not
state a rule.

**Finite inputs past float32 under** ``"rceil"``: a finite element with ``|x| >= 7 * 2**125``
(float32 ``0x7F600000``, about 2.9775e38) sits in a block of byte 253 (``amax / 6`` is at most
``FLT_MAX / 6 < 2**126``) and codes ±4 (``x / 2**126`` lies in ``[3.5, 4)``; 3.5 ties to the
even code), which decodes to ``±2**128 = ±inf`` (torchao's bytes and dequantized values too).
``"floor"`` gives such blocks byte 252 and saturates them at ``6 * 2**125``: finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import torch

from computectx._checks import fault
from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.numerics.e2m1 import (
    E2M1_MAX,
    WGRAD_SIGNS,
    Stochastic,
    e2m1_codes,
    hadamard16,
    pack_codes,
    packed_values,
    stochastic_codes,
)

__all__ = [
    "E4M3_MAX",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "MxRounding",
    "Mxfp4Operand",
    "Nvfp4Operand",
    "Nvfp4Tile",
    "check_amax",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "global_encode_scale",
    "mx_scale_bytes",
    "nvfp4_block_scales",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_nvfp4_rows",
    "quantize_wgrad_operand",
    "tensor_amax",
]

NVFP4_BLOCK: Final[int] = 16
"""Elements per NVFP4 block along K (and the side of a ``"16x16"`` tile)."""
MXFP4_BLOCK: Final[int] = 32
"""Elements per MXFP4 block along K."""
E4M3_MAX: Final[float] = 448.0
"""The largest E4M3 value: the top of an NVFP4 block scale."""
_FLT_MAX: Final[float] = torch.finfo(torch.float32).max
_SIXTH: Final[float] = float(torch.tensor(1.0) / torch.tensor(6.0))  # float32 1/6, as TE's
_E8M0_BIAS: Final[int] = 127

Nvfp4Tile = Literal["1x16", "16x16"]
"""An NVFP4 operand's block: 1 x 16 along K, or a 16 x 16 tile (weights)."""
MxRounding = Literal["floor", "rceil"]
"""How an MXFP4 block's E8M0 exponent is chosen from its amax."""


@dataclass(frozen=True)
class Nvfp4Operand:
    """An NVFP4 operand: codes, E4M3 block scales and the per-tensor amax."""

    codes: torch.Tensor
    """``torch.float4_e2m1fn_x2``, ``rows x K/2`` (element ``2j`` in byte ``j``'s low nibble)."""
    scale: torch.Tensor
    """``float8_e4m3fn`` ``S_dec`` per block: ``rows x K/16`` (``"1x16"``) or
    ``rows/16 x K/16`` (``"16x16"``)."""
    amax: torch.Tensor
    """The float32 per-tensor amax (shape ``()``) that ``S_enc`` is computed from."""
    tile: Nvfp4Tile
    """The block: ``"1x16"`` or ``"16x16"``."""

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, scales and the 4-byte amax."""
        return self.codes.nbytes + self.scale.nbytes + self.amax.nbytes


@dataclass(frozen=True)
class Mxfp4Operand:
    """An MXFP4 operand: codes and E8M0 block scales."""

    codes: torch.Tensor
    """``torch.float4_e2m1fn_x2``, ``rows x K/2``."""
    scale: torch.Tensor
    """``float8_e8m0fnu`` per 1 x 32 block, ``rows x K/32``."""

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes and scales."""
        return self.codes.nbytes + self.scale.nbytes


def _rows(x: torch.Tensor, block: int, who: str) -> torch.Tensor:
    """``x`` as a float32 ``rows x K`` view, K a multiple of ``block``."""
    if x.dim() < 1 or x.shape[-1] % block:
        raise ValueError(
            f"{who} needs a last dimension (K) that is a multiple of {block}, got shape "
            f"{tuple(x.shape)}"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{who} takes bf16, f16 or f32 values, got {x.dtype}")
    return x.detach().float().reshape(-1, x.shape[-1])


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """float32 ``max |x|`` over the finite elements (0 if none): the per-tensor amax."""
    a = x.detach().float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax()


def check_amax(amax: object, who: str, *, check_values: bool = True) -> torch.Tensor:
    """``amax`` as ``()`` if it is a per-tensor amax given from outside: a float32 tensor of
    shape ``()`` or ``(1,)``, finite and ``>= 0`` (a max ``|x|``; 0 stands for an all-zero
    tensor). ``ValueError`` naming what it is otherwise. The values take one host read, skipped
    where ``check_values`` is False (an amax its caller made, so known good) and while
    ``torch.compile`` traces."""
    if (
        not isinstance(amax, torch.Tensor)
        or amax.dtype != torch.float32
        or tuple(amax.shape) not in ((), (1,))
    ):
        got = (
            f"{str(amax.dtype).removeprefix('torch.')} {tuple(amax.shape)}"
            if isinstance(amax, torch.Tensor)
            else type(amax).__name__
        )
        raise ValueError(f"{who}: amax must be a float32 tensor of shape () or (1,), got {got}")
    read = check_values and not amax.is_meta and not torch.compiler.is_compiling()
    if read and not bool((torch.isfinite(amax) & (amax >= 0)).all()):
        raise ValueError(f"{who}: amax must be finite and >= 0 (a max |x|), got {fault(amax)}")
    return amax.detach().reshape(())


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = min(448 * 6 / amax, FLT_MAX)``, 1 when ``amax`` is 0 or ``S_enc`` is 0."""
    amax = amax.float()
    s = (torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax).clamp(max=_FLT_MAX)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def nvfp4_block_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """``S_dec = e4m3(min(block_amax * (S_enc * (1/6)), 448))``: one rounding of the
    product, an upper clamp only (NaN stays NaN)."""
    scale = block_amax * (s_enc * _SIXTH)
    return torch.where(scale > E4M3_MAX, E4M3_MAX, scale).to(torch.float8_e4m3fn)


def _decode_factor(scale: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """``f32(S_dec) * (1 / S_enc)``: a block's effective dequantize factor."""
    return scale.float() * (1.0 / s_enc)


def _block_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """float32 amax of each ``rows x cols`` block of the 2-D ``x`` (NaN propagates)."""
    r, k = x.shape
    return x.abs().reshape(r // rows, rows, k // cols, cols).amax(dim=(1, 3))


def _apply(x: torch.Tensor, per_block: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x * per_block`` with each block's factor broadcast over its ``rows x cols``."""
    r, k = x.shape
    blocks = x.reshape(r // rows, rows, k // cols, cols) * per_block[:, None, :, None]
    return blocks.reshape(r, k)


def _codes(scaled: torch.Tensor, stochastic: Stochastic | None) -> torch.Tensor:
    if stochastic is None:
        return pack_codes(e2m1_codes(scaled))
    return pack_codes(stochastic_codes(scaled, stochastic))


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    tile: Nvfp4Tile = "1x16",
    amax: torch.Tensor | None = None,
    stochastic: Stochastic | None = None,
    check_amax_values: bool = True,
) -> Nvfp4Operand:
    """NVFP4 codes and scales of ``x`` (bf16/f16/f32, K a multiple of 16; 2-D with rows a
    multiple of 16 for ``"16x16"``) by TE's chain (module docstring). ``amax`` is the
    per-tensor amax (default ``tensor_amax(x)``; pass one agreed across ranks to share it);
    ``stochastic`` rounds the codes stochastically instead of to nearest. A given ``amax`` is
    checked (``check_amax``: float32 ``()`` or ``(1,)``, finite, ``>= 0``; its values only
    where ``check_amax_values``)."""
    x2 = _rows(x, NVFP4_BLOCK, "quantize_nvfp4")
    rows = {"1x16": 1, "16x16": NVFP4_BLOCK}.get(tile)
    if rows is None:
        raise ValueError(f"tile must be '1x16' or '16x16', got {tile!r}")
    if rows > 1 and (x.dim() != 2 or x.shape[0] % rows):
        raise ValueError(
            f"tile '16x16' needs a 2-D x with rows a multiple of 16, got {tuple(x.shape)}"
        )
    if amax is None:
        amax = tensor_amax(x)
    else:
        amax = check_amax(amax, "quantize_nvfp4", check_values=check_amax_values)
    s_enc = global_encode_scale(amax)
    scale = nvfp4_block_scales(_block_amax(x2, rows, NVFP4_BLOCK), s_enc)
    encode = (1.0 / _decode_factor(scale, s_enc)).clamp(max=_FLT_MAX)
    scaled = _apply(x2, encode, rows, NVFP4_BLOCK)
    codes = _codes(scaled, stochastic).reshape(*x.shape[:-1], x.shape[-1] // 2)
    return Nvfp4Operand(codes=codes, scale=scale, amax=amax, tile=tile)


def quantize_nvfp4_rows(
    x: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of the 2-D ``x`` (bf16/f16/f32, K a multiple of 16) quantized as
    ``quantize_nvfp4`` quantizes that row alone: 1x16 blocks, round to nearest, ``S_enc`` from
    the row's own amax (over its finite elements), or from ``amax`` (one float32 value: a
    static, calibrated amax, every row's; elements above it saturate, block scale at 448 and
    codes at ±6). Returns the codes ``[rows, K/2]``, the E4M3 scales ``[rows, K/16]`` and the
    rows' float32 amaxes ``(rows,)``: a row's codes and scales never depend on the other rows
    (batch-invariant serving quantizes so)."""
    x2 = _rows(x, NVFP4_BLOCK, "quantize_nvfp4_rows")
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4_rows takes a 2-D tensor, got shape {tuple(x.shape)}")
    mag = x2.abs()
    if amax is not None:
        amax = amax.detach().float().reshape(()).expand(x2.shape[0]).clone()
    else:
        amax = torch.where(torch.isfinite(mag), mag, torch.zeros_like(mag)).amax(dim=1)
    s_enc = global_encode_scale(amax)[:, None]  # one per row, broadcast over its blocks
    scale = nvfp4_block_scales(_block_amax(x2, 1, NVFP4_BLOCK), s_enc)  # NaN propagates
    encode = (1.0 / _decode_factor(scale, s_enc)).clamp(max=_FLT_MAX)
    codes = _codes(_apply(x2, encode, 1, NVFP4_BLOCK), None)
    return codes, scale, amax


def dequantize_nvfp4(q: Nvfp4Operand, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for: ``e2m1 * (f32(S_dec) * (1 / S_enc))`` per element."""
    values = packed_values(q.codes)
    v2 = values.reshape(-1, values.shape[-1])
    rows = NVFP4_BLOCK if q.tile == "16x16" else 1
    factor = _decode_factor(q.scale, global_encode_scale(q.amax))
    return _apply(v2, factor, rows, NVFP4_BLOCK).reshape(values.shape).to(dtype)


def quantize_wgrad_operand(
    x: torch.Tensor,
    *,
    hadamard: bool = True,
    signs: tuple[int, ...] = WGRAD_SIGNS,
    amax: torch.Tensor | None = None,
    stochastic: Stochastic | None = None,
) -> Nvfp4Operand:
    """The column-wise NVFP4 operand of the weight-gradient GEMM from a 2-D ``x`` of
    ``M x K`` (an input or an output gradient, M the tokens): ``x.t()``, ``K x M``, in 1x16
    blocks along M, after the random Hadamard transform along M (bf16, ``hadamard16``) unless
    ``hadamard=False``. The amax (default) is the transformed tensor's, as TE's."""
    if x.dim() != 2:
        raise ValueError(f"quantize_wgrad_operand takes a 2-D M x K tensor, got {tuple(x.shape)}")
    xt = x.t()
    if hadamard:
        xt = hadamard16(xt, signs)
    return quantize_nvfp4(xt, tile="1x16", amax=amax, stochastic=stochastic)


def mx_scale_bytes(block_amax: torch.Tensor, rounding: MxRounding) -> torch.Tensor:
    """The E8M0 byte (int32, 0..255) of each float32 block amax (module docstring)."""
    if rounding == "floor":
        # The exponent field: floor(log2) of a normal amax, -127 for 0 or a subnormal one,
        # 128 for inf; E2M1's largest power of two is 2**2.
        e = ((block_amax.view(torch.int32) >> 23) & 0xFF) - 127 - 2
    elif rounding == "rceil":
        d = block_amax / E2M1_MAX
        b = d.view(torch.int32)
        biased, frac = (b >> 23) & 0xFF, b & 0x7FFFFF
        # ceil(log2(d)) exactly: the exponent, plus one unless d is a power of two; a
        # subnormal d lies in (2**-127, 2**-126) -> -126 or at most 2**-127 -> -127 (clamped).
        e = torch.where(
            biased > 0,
            biased - 127 + (frac != 0).to(torch.int32),
            torch.where(frac > (1 << 22), -126, -127),
        )
    else:
        raise ValueError(f"rounding must be 'floor' or 'rceil', got {rounding!r}")
    byte = (e.clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS).to(torch.int32)
    return torch.where(torch.isnan(block_amax), 255, byte)


def _mx_encode(byte: torch.Tensor, rounding: MxRounding) -> torch.Tensor:
    """The float32 factor elements are multiplied by: ``2**(127 - byte)`` (exact), at most
    ``2**126`` for ``"floor"``, 1 for byte 0 under ``"rceil"``; NaN for byte 255."""
    # 2**(127 - byte) is the E8M0 value of byte 254 - byte (exact, 2**-127 included).
    inverse = (254 - byte.clamp(1, 254)).to(torch.uint8).view(torch.float8_e8m0fnu).float()
    if rounding == "rceil":
        inverse = torch.where(byte == 0, 1.0, inverse)
    return torch.where(byte == 255, torch.nan, inverse)


def quantize_mxfp4(
    x: torch.Tensor, *, rounding: MxRounding = "rceil", stochastic: Stochastic | None = None
) -> Mxfp4Operand:
    """MXFP4 codes and E8M0 scales of ``x`` (bf16/f16/f32, K a multiple of 32) in 1x32
    blocks along K (module docstring); ``stochastic`` rounds the codes stochastically."""
    x2 = _rows(x, MXFP4_BLOCK, "quantize_mxfp4")
    byte = mx_scale_bytes(_block_amax(x2, 1, MXFP4_BLOCK), rounding)
    scaled = _apply(x2, _mx_encode(byte, rounding), 1, MXFP4_BLOCK)
    codes = _codes(scaled, stochastic).reshape(*x.shape[:-1], x.shape[-1] // 2)
    scale = byte.to(torch.uint8).view(torch.float8_e8m0fnu)
    return Mxfp4Operand(codes=codes, scale=scale.reshape(*x.shape[:-1], -1))


def dequantize_mxfp4(q: Mxfp4Operand, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for: ``e2m1 * 2**(byte - 127)`` (NaN for byte 255)."""
    values = packed_values(q.codes)
    v2 = values.reshape(-1, values.shape[-1])
    scale = q.scale.float().reshape(v2.shape[0], -1)
    return _apply(v2, scale, 1, MXFP4_BLOCK).reshape(values.shape).to(dtype)
