"""A ``QuantizedLinear``'s weight frozen for serving: fp8 codes and steps, held as they are.

``QuantizedLinear.freeze_for_serving`` replaces the high-precision weight by two buffers,
``weight_fp8`` (the codes, ``[out_features, in_features]`` in the recipe's forward format)
and ``weight_step`` (their float32 dequantize steps, ``weight ≈ codes * step``), laid out as
the recipe's forward quantizes its weight (``WEIGHT_LAYOUT``): one step (``(1,)``) for
``tensor``, one per output row (``(N, 1)``) for ``row``, one per 128x128 block
(``(ceil(N/128), ceil(K/128))``) for ``block``: the steps of a ``ServingWeight`` of that
layout, so one state-dict form covers the three. ``mx`` has no such layout yet.

This module holds what freezing reads: the layout (``weight_layout``), the codes the
forward itself would make of the weight (``quantize_weight``), the check and copy of codes
given from outside (``check_given``, ``adopt``) and the frozen weight dequantized
(``dequantized``, for a call that runs without fp8). The forward multiplies with the codes
as they are (``linear.tensorwise``; ``linear.blockwise`` for ``row`` and ``block``).
"""

from __future__ import annotations

from typing import Final

import torch

from computectx.formats.linear.blockwise import quantize_weight_blocks
from computectx.formats.linear.plan import Fp8LinearPlan
from computectx.formats.numerics import blockwise, layouts, tensorwise
from computectx.formats.numerics.layouts import Granularity
from computectx.formats.numerics.ledger import count
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.formats.scaling.operand import record_statistics
from computectx.formats.serving import ServingWeight
from computectx.recipes import Recipe

__all__ = [
    "FROZEN_BUFFERS",
    "WEIGHT_LAYOUT",
    "adopt",
    "check_given",
    "dequantized",
    "quantize_weight",
    "weight_layout",
]

FROZEN_BUFFERS: Final = ("weight_fp8", "weight_step")
"""A frozen layer's buffers: the codes and their steps."""

WEIGHT_LAYOUT: Final[dict[str, Granularity]] = {
    "tensor": "tensor",
    "row": "row",
    "block": "128x128",
}
"""A recipe granularity -> the layout its forward quantizes the weight in (a
``ServingWeight`` layout)."""


def weight_layout(policy: Recipe) -> Granularity:
    """The layout ``policy``'s forward quantizes its weight in; ``ValueError`` for a
    granularity that has none a frozen layer can hold (``mx``)."""
    layout = WEIGHT_LAYOUT.get(policy.granularity)
    if layout is None:
        held = ", ".join(f"{g} ({w})" for g, w in WEIGHT_LAYOUT.items())
        raise ValueError(
            f"freeze_for_serving runs the granularities {held}; this layer's policy "
            f"{str(policy)!r} has granularity {policy.granularity!r}, whose weight no serving "
            f"layout holds yet. Nothing was changed: serve a copy built with one of those "
            f"(e.g. 'e4m3/dynamic/0' or 'e4m3/block/dynamic/0')"
        )
    return layout


def quantize_weight(weight: torch.Tensor, plan: Fp8LinearPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, steps)`` of ``weight`` as the layer's forward makes them under ``plan``'s
    recipe, with the weight's statistics recorded once into ``plan.state.weight``:
    per tensor, the step of the weight's own amax with no margin (a frozen weight never
    grows); per row or 128x128 block, the recipe's step rule (its ``power_of_two``), the
    block quantize the forward runs. Plain tensors even inside ``inference_mode`` (a
    frozen layer is still saved for an input gradient and loaded into)."""
    w = weight.detach()
    state = plan.state.weight
    if plan.policy.granularity == "tensor":
        with torch.inference_mode(False), torch.no_grad():
            data, step, amax = tensor_ops.quantize_dynamic(w, plan.fwd, 0, backend=plan.backend)
            step = step.reshape(1).clone()
        state.record(amax, step)
        count(state.tally, w)
        return data, step
    with torch.inference_mode(False), torch.no_grad():
        data, steps, largest, saturated = quantize_weight_blocks(w, plan)
        record_statistics([(state, w, largest, saturated)])
    return data, steps


def check_given(
    given: object, policy: Recipe, shape: tuple[int, int], device: torch.device
) -> ServingWeight:
    """``given`` if a layer of weight ``shape`` (``[out, in]``) on ``device`` under ``policy`` can
    serve with it: a ``ServingWeight`` of that 2-D shape, laid out as ``policy``'s forward
    quantizes the weight (``weight_layout``), its codes in the forward format, on
    ``device``, its steps finite. ``TypeError``/``ValueError`` naming what was given and
    what the layer takes otherwise; reads nothing but ``given``."""
    who = f"QuantizedLinear(in_features={shape[1]}, out_features={shape[0]})"
    if not isinstance(given, ServingWeight):
        raise TypeError(
            f"{who}.freeze_for_serving(weight=...) takes a ServingWeight, got "
            f"{type(given).__name__}"
        )
    codes = given.codes
    want = _described(policy.format.forward.torch, shape, weight_layout(policy), device)
    got = _described(codes.dtype, tuple(codes.shape), given.layout, codes.device)
    if got != want:
        raise ValueError(
            f"{who} under policy {str(policy)!r} serves with {want}; freeze_for_serving was "
            f"given {got}. Nothing was changed"
        )
    finite = torch.isfinite(given.steps)
    if not bool(finite.all()):
        raise ValueError(
            f"{who}.freeze_for_serving was given {want} with "
            f"{int((~finite).sum())} non-finite step(s) among {given.steps.numel()}. Nothing "
            f"was changed"
        )
    return given


def _described(
    dtype: torch.dtype, shape: tuple[int, ...], layout: str, device: torch.device
) -> str:
    return (
        f"{str(dtype).removeprefix('torch.')} codes of shape {shape} laid out {layout!r} "
        f"on {device}"
    )


def adopt(given: ServingWeight, plan: Fp8LinearPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, steps)``: copies of ``given``'s, bit for bit (contiguous plain tensors that
    share no storage with what was given), with the statistics of the weight they hold
    (its dequantized amax, the largest step) recorded once into ``plan.state.weight``."""
    with torch.inference_mode(False), torch.no_grad():
        data = given.codes.clone(memory_format=torch.contiguous_format)
        steps = given.steps.clone(memory_format=torch.contiguous_format)
        held = ServingWeight(data, steps, given.layout).dequantize()
        nothing = torch.zeros(1, dtype=torch.float32, device=steps.device)
        record_statistics([(plan.state.weight, held, steps.amax().reshape(1), nothing)])
    return data, steps


def dequantized(plan: Fp8LinearPlan, dtype: torch.dtype) -> torch.Tensor:
    """The frozen weight of ``plan`` as ``dtype``: each code times its step, formed in
    float32 and rounded once."""
    if plan.frozen_weight is None:
        raise ValueError("an fp8 linear needs a weight or a frozen (pre-quantized) weight")
    data, steps = plan.frozen_weight
    layout = weight_layout(plan.policy)
    if layout == "tensor":
        return tensorwise.dequantize(data, steps, dtype)
    return blockwise.dequantize(data, steps, layouts.layout_of(layout, data.shape), dtype)
