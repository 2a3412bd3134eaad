"""Fine-grained fp8 scaling: block layouts and the pure-torch twins of the block quantizes.

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
(``computectx.fp8.ops.block_quantize`` checks them and reshapes); their Triton twins are in
``computectx.kernels.quantize_blocks``, bit for bit.
"""

from __future__ import annotations

import math

import torch

from computectx.dtypes import Fp8Format
from computectx.fp8.numerics import tensorwise
from computectx.fp8.numerics.layouts import E8M0, BlockLayout, StepRule

__all__ = [
    "block_amax",
    "block_steps",
    "dequantize",
    "e8m0_of_steps",
    "expand_steps",
    "power_of_two_steps",
    "quantize",
    "quantize_with_steps",
    "saturated_count",
    "saturation_threshold",
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
        e = _ceil_log2(a / torch.full_like(a, fmt.max))
    else:  # mx_floor: floor(log2(amax)) - emax; subnormal amaxes clamp to -127 anyway
        e = ((a.view(torch.int32) >> 23) - 127) - math.floor(math.log2(fmt.max))
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
    top_ulp = 2.0 ** (math.floor(math.log2(fmt.max)) - fmt.mantissa_bits)
    return fmt.max + top_ulp / 2


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
