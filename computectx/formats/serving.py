"""``ServingWeight``: a weight as the fp8 codes and steps a serving format holds.

The checkpoint formats that serving stacks read (transformers' fine-grained FP8, the
DeepSeek-V3 layout; compressed-tensors' FP8 and MXFP8 schemes, vLLM's main quantized format)
store a linear's weight as ``float8_e4m3fn`` codes and dequantize steps in one of four
layouts: one step for the whole weight, one per output row (a channel), one per 128x128
block, or one per 1x32 group along K (MXFP8: each step a power of two, an E8M0 exponent on
disk). ``ServingWeight`` is that pair under its layout, checked once, for one linear
(``codes`` ``[N, K]``) or a module's experts (``[E, N, K]``, every expert laid out alike): the
value the export writes, the import reads and a frozen layer serves with. ``weight ≈ codes *
step`` of the element's block, formed in float32 (``dequantize``), as ``quantize_tensor``'s
``(data, scale)`` of the same granularity.

| ``layout`` | steps of ``[N, K]`` codes | steps of ``[E, N, K]`` codes |
| --- | --- | --- |
| ``"tensor"`` | ``(1,)`` | ``(E, 1)`` |
| ``"row"`` | ``(N, 1)`` | ``(E, N, 1)`` |
| ``"128x128"`` | ``(ceil(N/128), ceil(K/128))`` | ``(E, ceil(N/128), ceil(K/128))`` |
| ``"mx"`` | ``(N, ceil(K/32))`` | ``(E, N, ceil(K/32))`` |

Steps are float32 in every layout, ``"mx"`` included: an E8M0 exponent ``b`` is the step
``2**(b - 127)``, exact in float32 both ways (``numerics.blockwise.steps_of_scale``,
``e8m0_of_steps``), so a format's bytes are a writer's concern; ``check_fits`` refuses an
``"mx"`` step that is not a power of two in ``[2**-127, 2**127]`` (no E8M0 byte holds it).

A recipe's weights serve in the layout its forward quantizes them in (``recipe_layout``):
granularity ``tensor`` in ``"tensor"``, ``row`` in ``"row"``, ``block`` in ``"128x128"``,
``mx`` in ``"mx"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from computectx._checks import described
from computectx.dtypes import FLOAT_DTYPES, FP8_DTYPES
from computectx.formats.numerics import blockwise, layouts
from computectx.formats.numerics.layouts import Granularity
from computectx.recipes import Recipe

__all__ = [
    "LAYOUT_OF_GRANULARITY",
    "WEIGHT_LAYOUTS",
    "ServingWeight",
    "check_state_entries",
    "recipe_layout",
]

WEIGHT_LAYOUTS: Final[tuple[Granularity, ...]] = ("tensor", "row", "128x128", "mx")
"""The granularities a serving weight is laid out in: which codes share one step (all, a
row's, a 128x128 block's, a 1x32 MX group's)."""


LAYOUT_OF_GRANULARITY: Final[dict[str, Granularity]] = {
    "tensor": "tensor",
    "row": "row",
    "block": "128x128",
    "mx": "mx",
}
"""A recipe's granularity -> the layout its forward quantizes its weights in."""


def recipe_layout(recipe: Recipe) -> Granularity:
    """The layout ``recipe``'s weights serve in; ``ValueError`` naming the recipe and the
    granularities that have one when it has none (every granularity has one today)."""
    layout = LAYOUT_OF_GRANULARITY.get(recipe.granularity)
    if layout is None:
        held = ", ".join(f"{g!r} ({layout})" for g, layout in LAYOUT_OF_GRANULARITY.items())
        raise ValueError(
            f"recipe {str(recipe)!r} (granularity {recipe.granularity!r}) has no serving weight "
            f"layout: serving formats hold granularities {held} (layouts "
            f"{', '.join(WEIGHT_LAYOUTS)})"
        )
    return layout


def _steps_shape(layout: Granularity, shape: tuple[int, ...]) -> tuple[int, ...]:
    # The steps' shape of codes of ``shape`` (2-D, or 3-D: experts first).
    *experts, n, k = shape
    one = (1,) if layout == "tensor" else layouts.layout_of(layout, (n, k)).grid
    return (*experts, *one) if experts or layout != "tensor" else one


@dataclass(frozen=True, eq=False)
class ServingWeight:
    """fp8 ``codes`` (``float8_e4m3fn``/``e5m2``, ``[N, K]`` or experts' ``[E, N, K]``) and
    their float32 ``steps`` on the same device, laid out by ``layout`` (module docstring's
    table). The constructor checks all three and raises ``ValueError`` naming what it got
    and what the layout takes; it copies nothing."""

    codes: torch.Tensor
    steps: torch.Tensor
    layout: Granularity

    def __post_init__(self) -> None:
        codes, steps, layout = self.codes, self.steps, self.layout
        if layout not in WEIGHT_LAYOUTS:
            raise ValueError(
                f"ServingWeight layout must be one of {', '.join(WEIGHT_LAYOUTS)}, got {layout!r}"
            )
        if not isinstance(codes, torch.Tensor) or codes.dtype not in FP8_DTYPES:
            raise ValueError(
                f"ServingWeight codes must be a float8_e4m3fn or float8_e5m2 tensor, got "
                f"{described(codes)}"
            )
        if codes.dim() not in (2, 3):
            raise ValueError(
                f"ServingWeight codes must be 2-D [N, K] (a linear) or 3-D [E, N, K] (experts), "
                f"got shape {tuple(codes.shape)}"
            )
        want = _steps_shape(layout, tuple(codes.shape))
        if (
            not isinstance(steps, torch.Tensor)
            or steps.dtype != torch.float32
            or tuple(steps.shape) != want
            or steps.device != codes.device
        ):
            raise ValueError(
                f"ServingWeight steps of {tuple(codes.shape)} codes laid out {layout!r} must be "
                f"a float32 tensor of shape {want} on {codes.device}, got {described(steps)}"
            )

    def check_fits(
        self,
        who: str,
        fmt: torch.dtype,
        shape: tuple[int, ...],
        layout: Granularity,
        device: torch.device | None = None,
        *,
        takes: str = "takes",
        given: str = "given",
    ) -> None:
        """``ValueError`` unless these are ``fmt`` codes of ``shape`` laid out ``layout`` (on
        ``device``, when given), every code finite and every step finite and positive (under
        ``"mx"``, a power of two in ``[2**-127, 2**127]``, an E8M0 exponent), and every
        code times its step finite in float32: ``"{who} {takes} <what fits>; {given} <what
        these are>. Nothing was changed"``, or the count of bad steps or codes."""

        def described(dtype: torch.dtype, shape: tuple[int, ...], layout: str, at: str) -> str:
            return (
                f"{str(dtype).removeprefix('torch.')} codes of shape {shape} laid out "
                f"{layout!r}{at}"
            )

        here = f" on {self.codes.device}" if device is not None else ""
        want = described(fmt, shape, layout, f" on {device}" if device is not None else "")
        got = described(self.codes.dtype, tuple(self.codes.shape), self.layout, here)
        if got != want:
            raise ValueError(f"{who} {takes} {want}; {given} {got}. Nothing was changed")
        bad = ~(torch.isfinite(self.steps) & (self.steps > 0))
        if bool(bad.any()):
            raise ValueError(
                f"{who} was given {int(bad.sum())} step(s) that are not finite and positive "
                f"among {self.steps.numel()} (a step multiplies its codes: zero or negative "
                f"would zero or flip the weight). Nothing was changed"
            )
        if self.layout == "mx":
            bad = blockwise.steps_of_scale(blockwise.e8m0_of_steps(self.steps)) != self.steps
            if bool(bad.any()):
                raise ValueError(
                    f"{who} was given {int(bad.sum())} 'mx' step(s) that are not powers of two "
                    f"in [2**-127, 2**127] among {self.steps.numel()} (an MX step is an E8M0 "
                    f"exponent). Nothing was changed"
                )
        wide = self.codes.float()  # NaN codes (e4m3fn 0x7f/0xff; e5m2's NaN and inf too)
        bad = ~torch.isfinite(wide)
        if bool(bad.any()):
            raise ValueError(
                f"{who} was given {int(bad.sum())} non-finite code(s) (NaN or inf) among "
                f"{self.codes.numel()}: a weight holds finite values. Nothing was changed"
            )
        bad = ~torch.isfinite(self.dequantize())  # one pass; checked once, at load or freeze
        if bool(bad.any()):
            raise ValueError(
                f"{who} was given {int(bad.sum())} code(s) among {self.codes.numel()} whose "
                f"value (code times step) overflows float32 to inf: a weight holds finite "
                f"values. Nothing was changed"
            )

    @property
    def experts(self) -> int | None:
        """The expert count of experts' codes, ``None`` for a linear's."""
        return self.codes.shape[0] if self.codes.dim() == 3 else None

    def expert(self, e: int) -> ServingWeight:
        """Expert ``e``'s codes and steps (views), as a linear's."""
        if self.codes.dim() != 3:
            raise ValueError("ServingWeight.expert: these are a linear's codes, not experts'")
        steps = self.steps[e].reshape(1) if self.layout == "tensor" else self.steps[e]
        return ServingWeight(self.codes[e], steps, self.layout)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Each code times its step, formed in float32 and rounded once to ``dtype``."""
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dequantize to a float dtype, got {dtype}")
        if self.codes.dim() == 3:
            experts = [self.expert(e).dequantize(dtype) for e in range(self.codes.shape[0])]
            return torch.stack(experts) if experts else self.codes.to(dtype)
        if self.layout == "tensor":
            return (self.codes.float() * self.steps).to(dtype)
        layout = layouts.layout_of(self.layout, self.codes.shape)
        return blockwise.dequantize(self.codes, self.steps, layout, dtype)


def check_state_entries(
    who: str, held: ServingWeight, keys: tuple[str, str], codes: object, steps: object
) -> None:
    """``ValueError`` unless a state dict's ``codes`` and ``steps`` (its entries under
    ``keys``; ``None`` where absent: the held one stands in) can replace ``held``, a frozen
    weight's buffers: tensors of exactly ``held``'s dtypes (``load_state_dict`` would
    ``copy_`` any other in, converted with no sign) that ``check_fits`` ``held``'s format,
    shape and layout, checked on ``held``'s device. What is not a tensor of ``held``'s
    shapes is left to torch's own refusals (a size mismatch)."""
    c = held.codes if codes is None else codes
    s = held.steps if steps is None else steps
    if not isinstance(c, torch.Tensor) or not isinstance(s, torch.Tensor):
        return
    for key, value, own in ((keys[0], c, held.codes), (keys[1], s, held.steps)):
        if value.dtype != own.dtype:
            raise ValueError(
                f"{who}: {key} is {str(value.dtype).removeprefix('torch.')}, but it holds "
                f"{str(own.dtype).removeprefix('torch.')} and loads only at that dtype "
                f"(load_state_dict would convert it with no sign). Nothing was changed"
            )
    devices = (c.device.type, s.device.type, held.codes.device.type)
    if c.shape != held.codes.shape or s.shape != held.steps.shape or "meta" in devices:
        return
    device = held.codes.device
    given = ServingWeight(c.to(device), s.to(device), held.layout)
    given.check_fits(
        who,
        held.codes.dtype,
        tuple(held.codes.shape),
        held.layout,
        takes="holds",
        given="load_state_dict was given",
    )
