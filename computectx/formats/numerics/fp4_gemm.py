"""The 4-bit GEMMs' twins: the dense GEMM of two NVFP4 or MXFP4 operands, its error bound, the
operands of the linear's three GEMMs, and the grouped GEMMs of mixture-of-experts layers.

**The dense GEMM** (``reference_fp4_mm(a, b, out_dtype, bias)``): ``a`` is ``M x K`` and
``b`` is ``N x K``, both ``Nvfp4Operand`` (blocks of 16 along K: ``"1x16"`` or a
``"16x16"`` tile, either on either side) or both ``Mxfp4Operand`` (blocks of 32,
``numerics.fp4``); the result is ``a @ b.T (+ bias)``, ``M x N`` at ``out_dtype``. In float32:

    P_kb  = sum over the block's k of e2m1_a[i, k] * e2m1_b[j, k]         exact
    T_kb  = P_kb * (s_a[i, kb] * s_b[j, kb])                            NVFP4: exact
    acc   = ((T_0 + T_1) + T_2) + ...                                   in K order
    alpha = (amax_a * amax_b) * f32(1 / (6 * 6 * 448 * 448))           NVFP4 only (TE's;
            tensor_scale_alpha: an amax below AMAX_FLOOR read as it, a product past FLT_MAX
            formed in another order)
    out   = out_dtype((acc * alpha) + bias)                             one rounding

E2M1 values have at most two significant bits and are multiples of 0.5, so a block's
products and their sum (at most 32 * 36, a multiple of 0.25) are exact in float32 in any
order. ``s`` is a block's scale: NVFP4's E4M3 ``S_dec`` (the tile's, for every row of a
``"16x16"`` tile), MXFP4's E8M0 ``2**(byte - 127)``. Two E4M3 values multiply exactly (at most
8 significant bits, at least ``2**-18``), and so does ``P_kb`` by their product (at most 20
bits): under NVFP4 every term is exact and the only roundings are the float32 sum of the
``K / 16`` terms, ``alpha``, the epilogue product and the bias. ``alpha`` is the tensor-scale
epilogue TransformerEngine hands cuBLAS (``nvte_nvfp4_compute_per_tensor_scale``: the two
per-tensor amaxes times the float32 constant ``1 / (6 * 6 * 448 * 448)``, in that order),
applied once to the accumulator. MXFP4 has no per-tensor scale; ``s_a * s_b`` is one float32
product (as the fp8 ``mx`` twin's), exact unless it leaves float32's range.

**The bound** (``fp4_mm_error_bound``), against ``exact = sum_k deq_a[i, k] * deq_b[j, k]``
over the dequantized operands (``dequantize_nvfp4``/``dequantize_mxfp4``, float32 values,
summed in float64), for finite inputs and results in float32's range::

    e     = gamma_n * (sum_k |deq_a[i, k]| |deq_b[j, k]| + |bias_j|) + absolute
    bound = e + u_out * (|exact| + e) + tiny(out_dtype)

with ``gamma_n = n u / (1 - n u)``, ``u = 2**-24`` and ``u_out`` half an ulp of
``out_dtype``. NVFP4: ``n = n_kb + 16`` (``n_kb - 1`` additions in any order; three roundings
in ``alpha``, one in the product, one for the bias; six separating ``alpha`` from the operands'
decode factors ``f32(S_dec) * (1 / S_enc)``, whose ``S_enc`` and reciprocal are rounded; the
rest for measuring the magnitudes on the dequantized values) and
``absolute = 2**-149 * (sum_kb |T_kb| + 1 + sum_k |e2m1_a e2m1_b| (f_a + f_b + 2**-149))``
(``f`` the decode factors: ``alpha`` or a decode factor that is subnormal); it holds when each
amax is 0 or at least ``2688 * 2**-126`` (about 3.2e-35, so ``1 / S_enc`` is a normal float32;
below ``AMAX_FLOOR``, about 7.9e-36, ``S_enc`` saturates at ``FLT_MAX`` and ``alpha`` reads the
amax as that floor, ``tensor_scale_alpha``). MXFP4: ``n = n_kb + 4`` and ``absolute = 2**-148
* (sum_k |e2m1_a e2m1_b| + n_kb)`` (a scale product or a term that falls below float32's normal
range), as ``numerics.blockwise.scaled_mm_error_bound``.

**The operands of a 4-bit linear** (TransformerEngine's ``NVFP4BlockScaling``; ``col``: the
operand of ``x.t()``, quantized along the tokens M):

=======  ==================================  =========================================
GEMM     a                                   b
=======  ==================================  =========================================
Y        X, 1x16 along K, nearest            W at the weight tile, nearest
dX       dY, 1x16 along N, stochastic        Wᵀ at the weight tile (a 16x16 tile's codes
                                             are the forward's, transposed)
dW       dYᵀ col, Hadamard along M, stoch.   Xᵀ col, Hadamard along M, nearest
=======  ==================================  =========================================

``quantize_rows`` is the row-wise quantize (``format`` ``"nvfp4"``/``"mxfp4"``), and
``wgrad_operand`` the column-wise one: ``x`` ``M x K`` zero-padded to a multiple of 16 (32
for MXFP4) rows, transposed, the random Hadamard transform along M (``hadamard``), quantized
along M with the transformed tensor's amax. The Hadamard transform needs no inverse: both dW
operands are transformed along M and ``(a H)(b H)ᵀ = a bᵀ``; padded zeros change no amax and
add nothing to the product.

**The grouped GEMMs** (``reference_fp4_grouped_mm``, ``reference_fp4_grouped_wgrad``): group
``g`` (rows ``offs[g-1]:offs[g]``, ``numerics.grouped.bounds_of``) is exactly the dense 4-bit
GEMM on its own rows: its rows quantized with their own amax, expert ``g``'s matrix with its
own; the wgrad's operands padded per group and transformed per group. An empty group
quantizes nothing and reads nothing of its expert (its rows do not exist, its dW is zero);
rows past the last group come out zero. ``reference_fp4_grouped_mm_gathered`` takes each expert's
operand already quantized (FSDP2's 4-bit gather of experts) and is otherwise the same call.
Stochastic rounding: the groups draw consecutive
counter ranges in group order, each its operand's element count (``Stochastic.offset`` plus
the elements of the earlier groups' operands), so the forward and dgrad rows draw exactly what
one quantize of the whole row-major tensor would, and a caller advances its counter by
``grouped_counters``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Final, Literal

import torch

from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.e2m1 import (
    HADAMARD_SIZE,
    WGRAD_SIGNS,
    Stochastic,
    hadamard16,
    packed_values,
)
from computectx.formats.numerics.fp4 import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Mxfp4Operand,
    MxRounding,
    Nvfp4Operand,
    Nvfp4Tile,
    dequantize_mxfp4,
    dequantize_nvfp4,
    global_encode_scale,
    quantize_mxfp4,
    quantize_nvfp4,
)

__all__ = [
    "ALPHA_FACTOR_INV",
    "AMAX_FLOOR",
    "Fp4Format",
    "Fp4Operand",
    "Fp4Quant",
    "dequantize_operand",
    "fp4_mm_error_bound",
    "grouped_counters",
    "quantize_rows",
    "reference_fp4_grouped_mm",
    "reference_fp4_grouped_mm_gathered",
    "reference_fp4_grouped_wgrad",
    "reference_fp4_mm",
    "tensor_scale_alpha",
    "wgrad_operand",
    "wgrad_row_multiple",
    "wgrad_rows",
]

Fp4Format = Literal["nvfp4", "mxfp4"]
"""A 4-bit block format."""
Fp4Operand = Nvfp4Operand | Mxfp4Operand
"""A quantized GEMM operand of either format."""

ALPHA_FACTOR_INV: Final[float] = float(torch.tensor(1.0 / (6.0 * 6.0 * 448.0 * 448.0)))
"""``f32(1 / (6 * 6 * 448 * 448))``: TE's constant of the NVFP4 tensor-scale epilogue."""
AMAX_FLOOR: Final[float] = float(
    torch.tensor(6.0 * 448.0) / torch.tensor(torch.finfo(torch.float32).max)
)
"""``f32(2688 / FLT_MAX)``: below it an NVFP4 operand's ``S_enc`` saturates at ``FLT_MAX``, and
``tensor_scale_alpha`` reads the amax as this floor (the decode the encoding used)."""


@dataclasses.dataclass(frozen=True)
class Fp4Quant:
    """How a 4-bit recipe quantizes a GEMM's operands: plain values the twins and operators
    take (the policy's ``Fp4Recipe`` is read into one)."""

    format: Fp4Format = "nvfp4"
    weight_tile: Nvfp4Tile = "16x16"
    """NVFP4 weights' block (activations and gradients are always 1x16); unused by MXFP4."""
    mx_rounding: MxRounding = "rceil"
    """MXFP4's E8M0 rule; unused by NVFP4."""
    hadamard: bool = True
    """The random Hadamard transform on the wgrad operands."""
    signs: tuple[int, ...] = WGRAD_SIGNS
    """The transform's sign vector."""

    def __post_init__(self) -> None:
        checks = (
            ("format", self.format, ("nvfp4", "mxfp4")),
            ("weight_tile", self.weight_tile, ("1x16", "16x16")),
            ("mx_rounding", self.mx_rounding, ("rceil", "floor")),
            ("hadamard", self.hadamard, (True, False)),
        )
        for name, value, accepted in checks:
            if value not in accepted or isinstance(value, bool) != isinstance(accepted[0], bool):
                raise ValueError(f"{name} must be one of {accepted}, got {value!r}")
        if len(self.signs) != HADAMARD_SIZE or any(s not in (1, -1) for s in self.signs):
            raise ValueError(
                f"signs must be {HADAMARD_SIZE} values each 1 or -1, got {self.signs!r}"
            )

    @property
    def block(self) -> int:
        """Elements per block along the contraction: 16 (NVFP4) or 32 (MXFP4)."""
        return NVFP4_BLOCK if self.format == "nvfp4" else MXFP4_BLOCK


# ---------------------------------------------------------------------------------------
# Operands.


def quantize_rows(
    x: torch.Tensor, how: Fp4Quant, *, weight: bool = False, stochastic: Stochastic | None = None
) -> Fp4Operand:
    """The row-wise operand of a 2-D ``x`` (blocks along its last dimension): NVFP4 at 1x16
    (``weight``: at ``how.weight_tile``) or MXFP4 1x32 by ``how.mx_rounding``."""
    if how.format == "mxfp4":
        return quantize_mxfp4(x, rounding=how.mx_rounding, stochastic=stochastic)
    tile: Nvfp4Tile = how.weight_tile if weight else "1x16"
    return quantize_nvfp4(x, tile=tile, stochastic=stochastic)


def _padded_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -x.shape[0] % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def wgrad_row_multiple(how: Fp4Quant) -> int:
    """What the weight-gradient GEMM's column-wise operands pad their rows (M, that GEMM's K)
    to: the block (16; MXFP4 32), and under the Hadamard transform a multiple of its
    ``HADAMARD_SIZE`` (16) rows too, which it mixes. The kernels keep a twin of this rule
    (``kernels.fp4_quantize.wgrad_row_multiple``; a test holds them equal)."""
    return max(how.block, HADAMARD_SIZE) if how.hadamard else how.block


def wgrad_rows(m: int, how: Fp4Quant) -> int:
    """``m`` rows padded up to ``wgrad_row_multiple(how)``."""
    multiple = wgrad_row_multiple(how)
    return -(-m // multiple) * multiple


def wgrad_operand(
    x: torch.Tensor, how: Fp4Quant, *, stochastic: Stochastic | None = None
) -> Fp4Operand:
    """The column-wise operand of the weight-gradient GEMM from a 2-D ``x`` of ``M x K``:
    rows zero-padded to a multiple of the block (and of 16 under the transform), ``x.t()``
    (``K x M_pad``), the Hadamard transform along M when ``how.hadamard`` (bf16), then
    quantized row-wise in 1x16 (1x32) blocks along M with the result's own amax."""
    xt = _padded_rows(x.detach(), wgrad_row_multiple(how)).t()
    if how.hadamard:
        xt = hadamard16(xt, how.signs)
    return quantize_rows(xt, how, stochastic=stochastic)


def dequantize_operand(q: Fp4Operand) -> torch.Tensor:
    """The float32 values ``q`` stands for (``dequantize_nvfp4``/``dequantize_mxfp4``)."""
    if isinstance(q, Nvfp4Operand):
        return dequantize_nvfp4(q)
    return dequantize_mxfp4(q)


# ---------------------------------------------------------------------------------------
# The dense GEMM and its bound.


def tensor_scale_alpha(amax_a: torch.Tensor, amax_b: torch.Tensor) -> torch.Tensor:
    """NVFP4's epilogue factor, float32 (the amaxes broadcast): TE's ``(amax_a * amax_b) *
    ALPHA_FACTOR_INV``, two float32 products, bit for bit wherever TE's is right.

    It is not at the two ends, and there the factor the encoding used is taken instead: an
    amax below ``AMAX_FLOOR`` (about 7.9e-36) saturates its ``S_enc`` at ``FLT_MAX``, so its
    operand is decoded by ``AMAX_FLOOR``, not by the amax (TE's factor comes out up to 1500x
    too small at 1e-38); and a product of two amaxes past ``FLT_MAX`` (an input of 1e38 times
    a weight of amax 8) is inf in TE's order, so the larger amax multiplies the smaller one's
    ``amax * ALPHA_FACTOR_INV`` instead (finite where the factor is)."""
    a = amax_a.float().clamp(min=AMAX_FLOOR)
    b = amax_b.float().clamp(min=AMAX_FLOOR)
    hi, lo = torch.maximum(a, b), torch.minimum(a, b)
    product = hi * lo  # a Python float scales a float32 tensor in float32: no device copy
    return torch.where(
        torch.isinf(product), hi * (lo * ALPHA_FACTOR_INV), product * ALPHA_FACTOR_INV
    )


def _parts(q: Fp4Operand, who: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(e2m1 values [rows, K], block scales [rows, K / w], w)``, float32, one scale per row
    and K block (a 16x16 tile's repeated over its rows)."""
    values = packed_values(q.codes)
    if values.dim() != 2:
        raise ValueError(f"{who} must be a 2-D operand, got codes of shape {tuple(q.codes.shape)}")
    scale = q.scale.float()
    if isinstance(q, Nvfp4Operand):
        if q.tile == "16x16":
            scale = scale.repeat_interleave(NVFP4_BLOCK, dim=0)
        return values, scale.reshape(values.shape[0], -1), NVFP4_BLOCK
    return values, scale.reshape(values.shape[0], -1), MXFP4_BLOCK


def _check_pair(a: Fp4Operand, b: Fp4Operand) -> bool:
    """Whether the pair is NVFP4 (else MXFP4); ``ValueError`` for a mixed pair or two Ks."""
    nv = isinstance(a, Nvfp4Operand)
    if nv != isinstance(b, Nvfp4Operand):
        raise ValueError(
            f"a 4-bit GEMM multiplies two NVFP4 or two MXFP4 operands, got "
            f"{type(a).__name__} and {type(b).__name__}"
        )
    if a.codes.shape[-1] != b.codes.shape[-1]:
        raise ValueError(
            f"a is [M, K] and b is [N, K] with the same K; got codes of shapes "
            f"{tuple(a.codes.shape)} and {tuple(b.codes.shape)} (two values a byte)"
        )
    return nv


def _block_terms(
    va: torch.Tensor, vb: torch.Tensor, width: int, first: int, last: int
) -> torch.Tensor:
    # (blocks, M, N) exact partial sums P_kb of K blocks first..last-1.
    lo, hi = first * width, last * width
    a3 = va[:, lo:hi].reshape(va.shape[0], last - first, width).transpose(0, 1)
    b3 = vb[:, lo:hi].reshape(vb.shape[0], last - first, width).permute(1, 2, 0)
    return torch.bmm(a3, b3)


def _prescale_exact(a: Fp4Operand, b: Fp4Operand, sa: torch.Tensor, sb: torch.Tensor) -> bool:
    """Whether each block's values times its scale are exact float32, and so is every product
    of two such values and every partial sum of a block's products, so the GEMM of the scaled
    values gives each ``T_kb = P_kb * (s_a * s_b)`` exactly, with no product over the ``K /
    w`` partials. Decided without a host read of a device tensor (a synchronisation per
    GEMM on a GPU). NVFP4 (both operands), by the format: an E4M3 scale is 0, NaN or finite
    in ``[2**-9, 448]`` with at most 4 significant bits, so a block's products are multiples
    of ``0.25 * s_a * s_b`` below ``2**12`` of them, ``s_a * s_b`` at most 8 significant bits
    and at least ``2**-18``: exact. A NaN scale makes its block's scaled values NaN, so the
    outputs it reaches are NaN on both routes (a NaN's sign and payload are not specified).
    MXFP4: an E8M0 scale reaches ``2**+-127``, where scaled values or their products leave
    float32's range; when every scale is 0 or within ``[2**-50, 2**50]`` both routes give
    the same bits, so the scales ``sa``/``sb`` are read where that is free (on the CPU) and a
    GPU takes the scale-product route, exact whenever prescaling is and the definition
    otherwise. A zero term's sign may differ; the accumulator starts at +0 and never holds
    -0, so the sum does not."""
    if isinstance(a, Nvfp4Operand) and isinstance(b, Nvfp4Operand):
        return True
    if sa.device.type != "cpu":
        return False
    ok = [(m == 0) | ((m >= 2.0**-50) & (m <= 2.0**50)) for m in (sa.abs(), sb.abs())]
    return bool(ok[0].all() and ok[1].all())


def _scaled_values(values: torch.Tensor, scale: torch.Tensor, width: int) -> torch.Tensor:
    # values[i, k] * scale[i, k // width], exact under _prescale_exact.
    rows, k = values.shape
    return (values.reshape(rows, k // width, width) * scale.unsqueeze(2)).reshape(rows, k)


def reference_fp4_mm(
    a: Fp4Operand, b: Fp4Operand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` at ``out_dtype`` by the module docstring's arithmetic, on the
    operands' device."""
    _check_pair(a, b)
    va, sa, width = _parts(a, "a")
    vb, sb, _ = _parts(b, "b")
    m, n, n_kb = va.shape[0], vb.shape[0], sa.shape[1]
    prescaled = _prescale_exact(a, b, sa, sb)
    if prescaled:
        va = _scaled_values(va, sa, width)
        vb = _scaled_values(vb, sb, width)
    acc = torch.zeros((m, n), dtype=torch.float32, device=va.device)
    group = max(1, 2**24 // max(1, m * n))  # blocks per pass: partials near 2**24 elements
    with tensorwise.float32_matmuls(va.device):
        for first in range(0, n_kb, group):
            last = min(n_kb, first + group)
            terms = _block_terms(va, vb, width, first, last)
            if not prescaled:
                scales = sa[:, first:last].t().unsqueeze(2) * sb[:, first:last].t().unsqueeze(1)
                terms.mul_(scales)
            for i in range(last - first):
                acc.add_(terms[i])
    if isinstance(a, Nvfp4Operand) and isinstance(b, Nvfp4Operand):
        acc = acc * tensor_scale_alpha(a.amax, b.amax)
    return tensorwise.epilogue(acc, bias, out_dtype)


def _on_cpu(q: Fp4Operand) -> Fp4Operand:
    if isinstance(q, Nvfp4Operand):
        return Nvfp4Operand(q.codes.cpu(), q.scale.cpu(), q.amax.cpu(), q.tile)
    return Mxfp4Operand(q.codes.cpu(), q.scale.cpu())


def _decode_factors(q: Nvfp4Operand, rows: int) -> torch.Tensor:
    # float64 |f32(S_dec) * (1 / S_enc)| per row and K block.
    s_enc = global_encode_scale(q.amax)
    scale = q.scale.float()
    if q.tile == "16x16":
        scale = scale.repeat_interleave(NVFP4_BLOCK, dim=0)
    return (scale.reshape(rows, -1) * (1.0 / s_enc)).double().abs()


def fp4_mm_error_bound(
    a: Fp4Operand, b: Fp4Operand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The a-priori elementwise bound on ``|reference_fp4_mm(...) - exact|`` of the module
    docstring, float64 ``[M, N]`` on the CPU."""
    _check_pair(a, b)
    a, b = _on_cpu(a), _on_cpu(b)
    va, sa, width = _parts(a, "a")
    vb, sb, _ = _parts(b, "b")
    da, db = dequantize_operand(a).cpu().double(), dequantize_operand(b).cpu().double()
    exact, mag = da @ db.t(), da.abs() @ db.abs().t()
    ea, eb = va.double().abs(), vb.double().abs()
    n_kb = sa.shape[1]
    unscaled = ea @ eb.t()
    if not (isinstance(a, Nvfp4Operand) and isinstance(b, Nvfp4Operand)):
        gamma = tensorwise.accumulation_gamma(n_kb + 4, width)
        absolute = 2.0**-148 * (unscaled + n_kb)
    else:
        fa, fb = _decode_factors(a, ea.shape[0]), _decode_factors(b, eb.shape[0])
        terms = torch.zeros_like(unscaled)
        cross = torch.zeros_like(unscaled)
        for kb in range(n_kb):
            sl = slice(kb * width, (kb + 1) * width)
            p = ea[:, sl] @ eb[:, sl].t()
            terms += p * (sa[:, kb : kb + 1].double() * sb[:, kb].double().reshape(1, -1)).abs()
            cross += p * (fa[:, kb : kb + 1] + fb[:, kb].reshape(1, -1) + 2.0**-149)
        gamma = tensorwise.accumulation_gamma(n_kb + 16, width)
        absolute = 2.0**-149 * (terms * (1 + gamma) + 1 + cross)
    return tensorwise.output_bound(exact, mag, gamma, bias, out_dtype, absolute)


# ---------------------------------------------------------------------------------------
# The grouped GEMMs.


def grouped_counters(bounds: list[tuple[int, int]], cols: int, how: Fp4Quant, wgrad: bool) -> int:
    """How many stochastic-rounding counters a grouped call draws: ``rows * cols`` of the
    groups' row-wise operands, or the wgrad's padded column-wise ones (``cols`` is N)."""
    if not wgrad:
        return sum(end - start for start, end in bounds) * cols
    return sum(wgrad_rows(end - start, how) for start, end in bounds) * cols


def _key(stochastic: Stochastic | None, consumed: int) -> Stochastic | None:
    if stochastic is None:
        return None
    return Stochastic(stochastic.seed, stochastic.offset + consumed)


def reference_fp4_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: list[tuple[int, int]],
    how: Fp4Quant,
    out_dtype: torch.dtype,
    stochastic: Stochastic | None = None,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows of ``a [M, K]`` quantized row-wise (their own amax;
    ``stochastic`` rounds them) times expert ``b[g]`` (``[N, K]``) quantized at the weight
    tile, by ``reference_fp4_mm``; the forward (``b = W``) and the dgrad (``b = Wᵀ`` per
    expert, ``a = dY``) are this call."""

    def expert(g: int) -> Fp4Operand:
        return quantize_rows(b[g], how, weight=True)

    return _grouped_rows(a, expert, b.shape[1], bounds, how, out_dtype, stochastic)


def reference_fp4_grouped_mm_gathered(
    a: torch.Tensor,
    b: Fp4Operand,
    bounds: list[tuple[int, int]],
    how: Fp4Quant,
    out_dtype: torch.dtype,
    stochastic: Stochastic | None = None,
) -> torch.Tensor:
    """``reference_fp4_grouped_mm`` with each expert's operand given, quantized: ``b`` holds
    the experts' operands stacked (codes ``[E, N, K/2]``, scales ``[E, ...]``, NVFP4's
    amaxes ``(E,)``); expert ``g``'s is ``b``'s ``g``-th entry of each."""

    def expert(g: int) -> Fp4Operand:
        if isinstance(b, Nvfp4Operand):
            return Nvfp4Operand(b.codes[g], b.scale[g], b.amax.reshape(-1)[g], b.tile)
        return Mxfp4Operand(b.codes[g], b.scale[g])

    return _grouped_rows(a, expert, b.codes.shape[1], bounds, how, out_dtype, stochastic)


def _grouped_rows(
    a: torch.Tensor,
    expert: Callable[[int], Fp4Operand],
    n: int,
    bounds: list[tuple[int, int]],
    how: Fp4Quant,
    out_dtype: torch.dtype,
    stochastic: Stochastic | None,
) -> torch.Tensor:
    k = a.shape[1]
    out = a.new_zeros((a.shape[0], n), dtype=out_dtype)
    for g, (start, end) in enumerate(bounds):
        if end == start:
            continue
        qa = quantize_rows(a[start:end], how, stochastic=_key(stochastic, start * k))
        out[start:end] = reference_fp4_mm(qa, expert(g), out_dtype)
    return out


def reference_fp4_grouped_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    bounds: list[tuple[int, int]],
    how: Fp4Quant,
    stochastic: Stochastic | None = None,
) -> torch.Tensor:
    """float32 ``[E, N, K]``: ``dW[g] = dY[rows of g]ᵀ X[rows of g]`` from the two
    column-wise operands of the group's own rows (``wgrad_operand``: padded, transformed and
    amax'd per group; ``stochastic`` rounds dY's)."""
    n = dy.shape[1]
    out = dy.new_zeros((len(bounds), n, x.shape[1]), dtype=torch.float32)
    consumed = 0
    for g, (start, end) in enumerate(bounds):
        if end == start:
            continue
        qd = wgrad_operand(dy[start:end], how, stochastic=_key(stochastic, consumed))
        consumed += qd.codes.shape[-1] * 2 * n
        qx = wgrad_operand(x[start:end], how)
        out[g] = reference_fp4_mm(qd, qx, torch.float32)
    return out
