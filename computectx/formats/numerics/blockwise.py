"""Fine-grained fp8 scaling: block layouts, the pure-torch twins of the block quantize and of
the block-scaled GEMM, and the GEMM's error bound.

A *granularity* says which elements share one step (the dequantize factor, as everywhere in
computectx: ``x ≈ data * step``). For a 2-D ``x`` of ``rows x K`` (K, the last dimension,
is the contraction dimension):

===========  =============  ==============================  ==============================
granularity  block          scale shape                     step of a block
===========  =============  ==============================  ==============================
``tensor``   the tensor     ``(1,)`` float32                ``amax / fmt.max``
``row``      ``1 x K``      ``(rows, 1)`` float32           power of two by default
``1x128``    ``1 x 128``    ``(rows, ceil(K/128))`` f32     ``amax / fmt.max``; power of
``128x128``  ``128 x 128``  ``(ceil(rows/128),``            two optional
                            ``ceil(K/128))`` float32
``mx``       ``1 x 32``     ``(rows, ceil(K/32))``          ``2**e`` (OCP MX), rounding
                            ``float8_e8m0fnu``              ``"rceil"`` or ``"floor"``
===========  =============  ==============================  ==============================

Ragged edges are **partial blocks**: the last block of a row (or the last 128 rows) holds
the elements there are, and its step comes from their amax. That is the same as padding
with zeros (a zero never changes an amax), but nothing is allocated or returned padded:
``data`` has ``x``'s shape. ``row``, ``1x128`` and ``mx`` read any tensor of two or more
dimensions as ``prod(leading) x K`` and keep the leading dimensions in the scale's shape;
``128x128`` needs a 2-D tensor; ``mx`` needs ``K >= 32``.

How a block's amax becomes its step (a *step rule*), every step float32:

- ``"amax"``: ``amax / fmt.max`` (one IEEE division), the per-tensor rule
  (``numerics.tensorwise.step_from_amax``): a step below float32's smallest normal (``2**-126``, an
  amax under about ``5e-36`` in E4M3) keeps too few bits to scale by and is raised to it;
- ``"pow2"``: that step rounded up to a power of two, the smallest ``2**e >= amax /
  fmt.max``: no element saturates, and multiplying by the step is exact;
- ``"mx_rceil"``: the same power of two as an E8M0 exponent ``e`` clamped to
  ``[-127, 127]`` (TransformerEngine's and cuBLAS's rule);
- ``"mx_floor"``: ``e = floor(log2(amax)) - emax`` with ``emax = floor(log2(fmt.max))``
  (8 for E4M3, 15 for E5M2), clamped to ``[-127, 127]`` (the OCP MX rule): the largest
  elements of a block may exceed ``fmt.max`` by up to ``2**(1 - m)`` and saturate.

A block whose amax is zero or not finite (a NaN or ±inf in it), or whose ``amax /
fmt.max`` underflows to zero under ``"amax"``/``"pow2"``, gets step 1 (E8M0 byte 127),
exactly the per-tensor rule applied to that block alone: its NaN elements become the fp8 NaN
(byte ``0x7F``), ±inf saturates to ``±fmt.max``, its finite elements are quantized with step
1; every other block is untouched. The E8M0 NaN byte (255) is never produced.

Elements are then quantized as the per-tensor twin does
(``numerics.tensorwise.quantize_with_step``): ``fp8(clamp(x / step, ±fmt.max))``, one IEEE float32
division, round to nearest even, NaN to ``0x7F``. Where ``fmt.max * step`` would overflow
float32 (a step above about ``FLT_MAX / fmt.max``: ``"pow2"`` and ``"mx_rceil"`` give one to a
block whose amax is above ``1.75 * 2**127``, about 2.98e38), the clamp is at
``tensorwise.code_bound(step)`` instead, the largest grid value whose product with the step is
finite: 3.4e38 keeps its step ``2**120`` and takes the code 240 (``3.19e38``), not 256
(``2**128``, inf). The step, and so the scale byte, is the rule's.

The functions here take the 2-D view and assume validated inputs
(``computectx.formats.ops.blockwise`` checks them and reshapes); their Triton twins are in
``computectx.kernels.quantize_blocks``, bit for bit.

**The block-scaled GEMM** (``reference_scaled_mm``; checked by ``ops.blockwise``, run there
on the kernel ``computectx.kernels.scaled_mm_blocks`` or cuBLAS):
``block_scaled_mm(a, b, scale_a, granularity_a, scale_b, granularity_b, bias, out_dtype)``
computes ``(a * steps_a) @ (b * steps_b).T (+ bias)`` for fp8 codes ``a [M, K]`` and
``b [N, K]`` (K, the last dimension of both, is contracted), each scaled at a granularity of
``computectx.formats.numerics.layouts``, with the scale ``quantize_tensor`` returns for the 2-D
operand:

==========  ===========================================  =============================
name        scale of an operand of ``rows x K``          accepted with
==========  ===========================================  =============================
``row``     ``(rows, 1)`` float32                        ``row``
``1x128``   ``(rows, ceil(K/128))`` float32              ``1x128``, ``128x128``
``128x128`` ``(ceil(rows/128), ceil(K/128))`` float32    ``1x128``
``mx``      ``(rows, ceil(K/32))`` ``float8_e8m0fnu``    ``mx``
==========  ===========================================  =============================

The accepted ``(granularity_a, granularity_b)`` pairs are ``PAIRS``. Ragged K is a partial
last K block (as above): its step came from the elements there are, and the GEMM
sums just those. Anything else (another pair, a scale of the wrong shape or dtype, K that
differs between the operands, a non-fp8 operand) is a ``ValueError`` naming the values and
what is accepted; nothing runs.

**Semantics (the twin, ``reference_scaled_mm``)**

- ``row`` x ``row``: exactly ``numerics.tensorwise.scaled_mm`` with per-row steps (the same
function,
  called): a float32 sum over all of K, ``acc * (step_a[i] * step_b[j])`` once, then bias.
- The block pairs: K is cut into blocks of the scale's width ``W`` (128 for ``1x128`` and
  ``128x128``, 32 for ``mx``). For each block ``kb``, in order, the partial sum of the exact
  fp8 products over the block is formed in float32, multiplied by the block's scale
  ``s = step_a[i, kb] * step_b[j, kb]`` (one float32 product), and added to a float32
  accumulator: ``acc = acc + partial_kb * s``. This is DeepSeek-V3's recipe on Hopper: each
  128-wide partial sum is promoted to float32 with its scales. A ``128x128`` operand's step
  is its block's, the same for the 128 rows in the block. E8M0 scales are the exact powers
  of two ``2**(byte - 127)``. Then the bias is added in float32 and the sum rounded once to
  ``out_dtype``.

**The bound** (``scaled_mm_error_bound``): fp8 products are exact in float32, so the error
of any implementation that sums each block (or any split of it into sub-blocks, as a kernel
with a narrower K step does) in float32 in any order, scales each partial sum in float32 and
sums the scaled partials in float32 in any order is at most::

    e = gamma_n * (sum_kb |s_kb| * sum_{k in kb} |a_ik| |b_jk| + |bias_j|)
        + 2**-148 * (sum_k |a_ik| |b_jk| + n_kb)
    bound = e + u_out * (|exact| + e) + tiny(out_dtype)

with ``gamma_n = n u / (1 - n u)``, ``u = 2**-24``, ``n = K + n_kb + 4`` (a sub-block of
width ``w`` costs ``w - 1`` additions and the ``ceil(K / w)`` scaled partials ``ceil(K / w)``
more; at most ``K + n_kb + 2`` for ``1 <= w <= W``, plus the two roundings of the scaling);
the absolute term covers a scale product ``s`` or a scaled partial that falls below
float32's normal range; ``u_out`` is half an ulp of ``out_dtype`` (``2**-8`` bf16,
``2**-11`` fp16, ``2**-24`` fp32). A scale product that overflows float32 is outside the
bound (the result is then inf). For ``row`` x ``row`` the bound is
``numerics.tensorwise.scaled_mm_error_bound``.

**A narrower accumulator** (the Triton kernel on a GPU; ``NARROW_ACCUMULATION``). Hopper's
fp8 tensor cores sum the products of one ``BLOCK_K`` step (``max_num_imprecise_acc=
BLOCK_K``, at most ``w = 128`` products, never more than one scale block) in an accumulator
of about 14 significant bits before the kernel promotes the step's partial to float32. With
each of that step's ``w' - 1`` additions (``w' = min(w, block width)``; the whole of K for
``row``) of relative error at most ``u_h = 2**-13``, the step's partial ``P^`` is within
``gamma_h * sum |a_ik||b_jk|`` of its exact ``P``, ``gamma_h = (w'-1) u_h / (1 - (w'-1)
u_h)``. Everything after is the float32 computation above applied to ``P^``, whose
magnitudes are at most ``(1 + gamma_h)`` times the exact ones, so ``gamma_n`` becomes::

    gamma = gamma_h + gamma_n * (1 + gamma_h)

(``gamma_h`` is about 0.0157 for ``w' = 128``, against ``gamma_n`` about 1.8e-5 for
``K = 300``), for every pair, ``row`` included; ``scaled_mm_error_bound(accumulation=(w,
u_h))`` computes it, with ``numerics.tensorwise.accumulation_gamma`` (shared with the per-tensor
bound, ``numerics.tensorwise.scaled_mm_error_bound``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Final

import torch

from computectx.dtypes import Fp8Format
from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.layouts import (
    E8M0,
    TILE,
    BlockGranularity,
    BlockLayout,
    StepRule,
    block_width,
)

__all__ = [
    "NARROW_ACCUMULATION",
    "BlockGemmArgs",
    "block_amax",
    "block_steps",
    "dequantize",
    "e8m0_of_steps",
    "expand_steps",
    "power_of_two_steps",
    "quantize",
    "quantize_with_steps",
    "reference_scaled_mm",
    "row_steps",
    "saturated_count",
    "saturation_threshold",
    "scaled_mm_error_bound",
    "steps_of_scale",
]


_E8M0_MIN, _E8M0_MAX = -127, 127


# ---------------------------------------------------------------------------------------
# Steps. Integer arithmetic on float32 bit patterns, as the kernels do: exact, and the same
# on every device.


def _ceil_log2(q: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(q))`` exactly, int32, for finite float32 ``q >= 0`` (-150 for 0)."""
    b = q.view(torch.int32)
    biased = b >> 23
    frac = b & 0x7FFFFF
    normal = biased - 127 + (frac != 0).to(torch.int32)
    # A subnormal is frac * 2**-149; frac converts to float32 exactly (it is below 2**23),
    # and the same rule on its bits gives ceil(log2(frac)).
    f = frac.to(torch.float32).view(torch.int32)
    sub = (f >> 23) - 127 + ((f & 0x7FFFFF) != 0).to(torch.int32) - 149
    return torch.where(biased > 0, normal, torch.where(frac > 0, sub, -150))


def _exp2(e: torch.Tensor) -> torch.Tensor:
    """float32 ``2**e`` for int32 ``e`` in ``[-149, 127]``, built from its bits (exact)."""
    normal = (e + 127).clamp(min=1) << 23
    sub = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, sub).view(torch.float32)


def power_of_two_steps(step: torch.Tensor) -> torch.Tensor:
    """Each positive finite float32 step rounded up to a power of two (exact)."""
    return _exp2(_ceil_log2(step))


def block_steps(amax: torch.Tensor, fmt: Fp8Format, rule: StepRule) -> torch.Tensor:
    """The float32 step of each block from its float32 amax, by ``rule`` (module docstring)."""
    if rule in ("amax", "pow2"):
        # The per-tensor rule, elementwise: amax / fmt.max (one IEEE division); 1.0 for an
        # amax of 0, inf or NaN and for a step that underflows to 0; a subnormal step is
        # raised to float32's smallest normal.
        step = tensorwise.step_from_amax(amax, fmt, 0)
        return power_of_two_steps(step) if rule == "pow2" else step
    usable = torch.isfinite(amax) & (amax > 0)
    a = torch.where(usable, amax, torch.ones_like(amax))  # keeps the bit tricks finite
    if rule == "mx_rceil":
        e = _ceil_log2(a / torch.full_like(a, tensorwise.FORMATS[fmt].max))
    else:  # mx_floor: floor(log2(amax)) - emax; subnormal amaxes clamp to -127 anyway
        emax = math.floor(math.log2(tensorwise.FORMATS[fmt].max))
        e = ((a.view(torch.int32) >> 23) - 127) - emax
    e = torch.where(usable, e.clamp(_E8M0_MIN, _E8M0_MAX), torch.zeros_like(e))
    return _exp2(e)


def e8m0_of_steps(steps: torch.Tensor) -> torch.Tensor:
    """The E8M0 scale of power-of-two steps in ``[2**-127, 2**127]`` (exact): the biased
    exponent of a normal step, and 0 for ``2**-127``, whose float32 exponent field is 0."""
    return (steps.view(torch.int32) >> 23).to(torch.uint8).view(E8M0)


def steps_of_scale(scale: torch.Tensor) -> torch.Tensor:
    """A returned scale as float32 steps: E8M0 bytes widened (255 is NaN), float32 as is."""
    return scale.to(torch.float32)


# ---------------------------------------------------------------------------------------
# The twins, on the 2-D view.


def block_amax(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """float32 ``max |x|`` of every block (``layout.grid``); NaN where a block holds one."""
    br, bc = layout.block_rows, layout.block_cols
    n_r, n_c = layout.grid
    a = x.detach().to(torch.float32).abs()
    # Zero padding to whole blocks: a zero changes no amax, and torch.amax propagates NaN.
    a = torch.nn.functional.pad(a, (0, n_c * bc - layout.cols, 0, n_r * br - layout.rows))
    return a.reshape(n_r, br, n_c, bc).amax(dim=(1, 3))


def expand_steps(steps: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The per-block ``steps`` (``layout.grid``) broadcast to one per element of the 2-D view."""
    s = steps.repeat_interleave(layout.block_rows, dim=0)[: layout.rows]
    return s.repeat_interleave(layout.block_cols, dim=1)[:, : layout.cols]


def quantize_with_steps(
    x: torch.Tensor, fmt: Fp8Format, steps: torch.Tensor, layout: BlockLayout
) -> torch.Tensor:
    """``fp8(clamp(x / step))`` with each element's block step: the fp8 codes of ``x``."""
    # contiguous: the codes of x.t() are written as a tensor of their own, as the kernels do.
    steps = steps.to(torch.float32)
    scaled = (x.to(torch.float32) / expand_steps(steps, layout)).contiguous()
    # The per-tensor twin owns the cast's rules, the bound included.
    bound = expand_steps(tensorwise.code_bound(steps, fmt), layout)
    return tensorwise.fp8_codes(scaled, fmt, bound)


def saturation_threshold(fmt: Fp8Format) -> float:
    """The magnitude of ``x / step`` above which the clamp to ``fmt.max`` changes a code
    beyond rounding: halfway from ``fmt.max`` to the next magnitude the format's precision
    would give (464 for E4M3, 61440 for E5M2)."""
    c = tensorwise.FORMATS[fmt]
    top_ulp = 2.0 ** (math.floor(math.log2(c.max)) - c.mantissa_bits)
    return c.max + top_ulp / 2


def saturated_count(
    x: torch.Tensor, fmt: Fp8Format, scale: torch.Tensor, layout: BlockLayout
) -> torch.Tensor:
    """How many elements of the 2-D ``x`` saturate when quantized with ``scale``, float32
    ``(1,)``: ``|x / step| > saturation_threshold(fmt)``, the division the quantize does
    (±inf counts; NaN does not). A step from the block's own amax never saturates under
    ``"amax"``, ``"pow2"`` and ``"mx_rceil"``; ``"mx_floor"`` may (module docstring)."""
    steps = expand_steps(steps_of_scale(scale).reshape(layout.grid), layout)
    q = (x.to(torch.float32) / steps).abs()
    return (q > saturation_threshold(fmt)).sum().to(torch.float32).reshape(1)


def quantize(
    x: torch.Tensor,
    fmt: Fp8Format,
    layout: BlockLayout,
    rule: StepRule,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the 2-D ``x`` block by block: ``(data, scale)``, scale shaped ``layout.grid``.

    ``scale=None`` measures every block's amax and applies ``rule``; a given scale (float32,
    or E8M0 for the MX rules) is used as is. The scale comes back as E8M0 for the MX rules,
    float32 otherwise.
    """
    if scale is None:
        steps = block_steps(block_amax(x, layout), fmt, rule)
        scale = e8m0_of_steps(steps) if rule.startswith("mx") else steps
    else:
        steps = steps_of_scale(scale)
    return quantize_with_steps(x, fmt, steps, layout), scale


def dequantize(
    data: torch.Tensor, scale: torch.Tensor, layout: BlockLayout, dtype: torch.dtype
) -> torch.Tensor:
    """``data * step`` of each element's block, formed in float32 (exact for power-of-two
    steps, one rounding otherwise) and rounded once to ``dtype``; 2-D ``data``."""
    steps = expand_steps(steps_of_scale(scale).reshape(layout.grid), layout)
    return (data.to(torch.float32) * steps).to(dtype)


NARROW_ACCUMULATION: Final[tuple[int, float]] = (128, 2.0**-13)
"""How the Triton kernels (the block-scaled one and the per-tensor one) sum on a GPU, for
``scaled_mm_error_bound(accumulation=)`` here and in ``numerics.tensorwise``: at most 128 products
(one ``BLOCK_K`` step, ``max_num_imprecise_acc=BLOCK_K``) in the fp8 tensor cores'
accumulator, each addition with relative error at most ``2**-13`` (14 significant bits,
truncated: the "around 14 bits" DeepSeek-V3 measured on H800), then promoted to float32."""


def row_steps(scale: torch.Tensor, granularity: BlockGranularity, rows: int) -> torch.Tensor:
    """float32 steps of one operand, one per row and K block: ``(rows, n_kb)`` (a
    ``128x128`` block's step repeated over its rows; E8M0 widened exactly)."""
    steps = steps_of_scale(scale)
    if granularity == "128x128":
        steps = steps.repeat_interleave(TILE, dim=0)[:rows]
    return steps


def _block_partials(
    a: torch.Tensor, b: torch.Tensor, width: int, first: int, last: int
) -> torch.Tensor:
    # The float32 partial sums of K blocks first..last-1: (blocks, M, N). fp8 values widen
    # exactly and their products are exact in float32 (TF32 too: 4 significant bits).
    k = a.shape[1]
    lo, hi = first * width, min(k, last * width)
    pad = (last - first) * width - (hi - lo)
    a3 = torch.nn.functional.pad(a[:, lo:hi].to(torch.float32), (0, pad))
    b3 = torch.nn.functional.pad(b[:, lo:hi].to(torch.float32), (0, pad))
    a3 = a3.reshape(a.shape[0], last - first, width).transpose(0, 1)
    b3 = b3.reshape(b.shape[0], last - first, width).permute(1, 2, 0)
    return torch.bmm(a3, b3)


@dataclasses.dataclass(frozen=True)
class BlockGemmArgs:
    """``computectx::fp8_block_scaled_mm``'s arguments but the backend, checked
    (``ops.blockwise.check_args``): what the twin (``reference_scaled_mm``), its error bound and
    cuBLAS's launcher (as its keywords) take. The operator's schema and this class are the
    argument list's two spellings."""

    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    granularity_a: BlockGranularity
    scale_b: torch.Tensor
    granularity_b: BlockGranularity
    bias: torch.Tensor | None
    out_dtype: torch.dtype

    def per_row(self) -> tensorwise.GemmArgs:
        """The ``row`` x ``row`` call as the per-tensor twin's, with per-row steps."""
        return tensorwise.GemmArgs(
            self.a, self.b, self.scale_a, self.scale_b, self.bias, self.out_dtype
        )

    def row_steps(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Both operands' ``row_steps`` in ``dtype`` (widening float32 is exact):
        ``(M, n_kb)`` and ``(N, n_kb)``."""
        sa = row_steps(self.scale_a, self.granularity_a, self.a.shape[0])
        sb = row_steps(self.scale_b, self.granularity_b, self.b.shape[0])
        return sa.to(dtype), sb.to(dtype)


def _twin_blocks(args: BlockGemmArgs) -> torch.Tensor:
    a, b = args.a, args.b
    m, k = a.shape
    n = b.shape[0]
    width = block_width(args.granularity_a, k)
    sa, sb = args.row_steps(torch.float32)
    n_kb = sa.shape[1]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    # Blocks in groups, so the (group, M, N) partials stay near 2**24 elements.
    group = max(1, 2**24 // max(1, m * n))
    for first in range(0, n_kb, group):
        last = min(n_kb, first + group)
        partials = _block_partials(a, b, width, first, last)
        # Each block's scale step_a[i, kb] * step_b[j, kb] (one float32 product), then
        # partial * scale (one rounding), then the in-order float32 sum.
        scales = sa[:, first:last].t().unsqueeze(2) * sb[:, first:last].t().unsqueeze(1)
        partials.mul_(scales)
        for i in range(last - first):
            acc.add_(partials[i])
    return acc


def reference_scaled_mm(args: BlockGemmArgs) -> torch.Tensor:
    """The twin: ``block_scaled_mm``'s semantics (module docstring) in plain torch, on the
    operands' device. Arguments are assumed checked (``ops.blockwise.check_args``)."""
    if args.granularity_a == "row":
        return tensorwise.scaled_mm(args.per_row())
    with tensorwise.float32_matmuls(args.a.device):
        # An enclosing autocast would run the partial sums in 16 bits.
        acc = _twin_blocks(args)
    return tensorwise.epilogue(acc, args.bias, args.out_dtype)


def scaled_mm_error_bound(
    args: BlockGemmArgs, *, accumulation: tuple[int, float] | None = None
) -> torch.Tensor:
    """The a-priori elementwise bound on ``|block_scaled_mm(...) - exact|`` of the module
    docstring, float64 ``[M, N]`` on the CPU, for checked arguments on any device.

    ``accumulation=(w, u_h)`` widens it for hardware that sums up to ``w`` consecutive
    products of a block in a narrower accumulator, each addition with relative error at most
    ``u_h``, before promoting that partial to float32 (``NARROW_ACCUMULATION``: the Triton
    kernel on a GPU; the module docstring derives the bound)."""
    on_cpu: dict[str, Any] = {
        k: v.cpu() for k, v in vars(args).items() if isinstance(v, torch.Tensor)
    }
    args = dataclasses.replace(args, **on_cpu)
    if args.granularity_a == "row" and accumulation is None:
        return tensorwise.scaled_mm_error_bound(args.per_row())
    m, k = args.a.shape
    n = args.b.shape[0]
    width = block_width(args.granularity_a, k)
    sa, sb = args.row_steps(torch.float64)
    a64, b64 = args.a.to(torch.float64), args.b.to(torch.float64)
    n_kb = sa.shape[1]
    exact = torch.zeros((m, n), dtype=torch.float64)
    mag = torch.zeros((m, n), dtype=torch.float64)
    for kb in range(n_kb):
        sl = slice(kb * width, min(k, (kb + 1) * width))
        s = sa[:, kb : kb + 1] * sb[:, kb].reshape(1, n)  # exact in float64
        exact += (a64[:, sl] @ b64[:, sl].t()) * s
        mag += (a64[:, sl].abs() @ b64[:, sl].abs().t()) * s.abs()
    gamma = tensorwise.accumulation_gamma(k + n_kb + 4, width, accumulation)
    unscaled = a64.abs() @ b64.abs().t()
    absolute = 2.0**-148 * (unscaled + n_kb)
    return tensorwise.output_bound(exact, mag, gamma, args.bias, args.out_dtype, absolute)
