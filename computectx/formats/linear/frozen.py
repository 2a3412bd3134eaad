"""A ``QuantizedLinear``'s weight frozen for serving: fp8 codes and steps, held as they are.

``QuantizedLinear.freeze_for_serving`` replaces the high-precision weight by two buffers,
``weight_fp8`` (the codes, ``[out_features, in_features]`` in the recipe's forward format)
and ``weight_step`` (their float32 dequantize steps, ``weight ≈ codes * step``), laid out as
the recipe's forward quantizes its weight (``serving.recipe_layout``): one step (``(1,)``) for
``tensor``, one per output row (``(N, 1)``) for ``row``, one per 128x128 block
(``(ceil(N/128), ceil(K/128))``) for ``block``, one per 1x32 group along K (``(N, K/32)``,
powers of two: the E8M0 scales widened exactly) for ``mx``: the steps of a ``ServingWeight``
of that layout, so one state-dict form covers the four.

This module holds what freezing reads: the layout (``weight_layout``), the codes the
forward itself makes of the weight (``quantize_weight``; ``serving_weight``, what
``QuantizedLinear.serving_weight`` gives), the check and copy of codes
given from outside (``check_given``, ``adopt``) and the frozen weight dequantized
(``dequantized``, for a call that runs without fp8). The forward multiplies with the codes
as they are (``linear.tensorwise``; ``linear.blockwise`` for ``row``, ``block`` and ``mx``,
which hands the GEMM an ``mx`` weight's steps as E8M0 bytes again, exactly).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import torch

from computectx.formats.linear.blockwise import quantize_weight_blocks
from computectx.formats.linear.plan import Fp8LinearPlan
from computectx.formats.numerics import blockwise, layouts, tensorwise
from computectx.formats.numerics.layouts import Granularity
from computectx.formats.numerics.ledger import count
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.formats.scaling.operand import record_statistics
from computectx.formats.serving import ServingWeight, check_state_entries, recipe_layout
from computectx.recipes import Recipe

__all__ = [
    "FROZEN_BUFFERS",
    "adopt",
    "check_given",
    "check_loaded",
    "dequantized",
    "quantize_weight",
    "serving_weight",
    "weight_layout",
]

FROZEN_BUFFERS: Final = ("weight_fp8", "weight_step")
"""A frozen layer's buffers: the codes and their steps."""


def weight_layout(policy: Recipe) -> Granularity:
    """The layout ``policy``'s forward quantizes its weight in (``serving.recipe_layout``);
    ``ValueError`` for a granularity that has none a frozen layer can hold."""
    try:
        return recipe_layout(policy)
    except ValueError as e:
        raise ValueError(
            f"freeze_for_serving: {e}. Nothing was changed: serve a copy built with one of "
            f"those granularities (e.g. 'e4m3/dynamic/0' or 'e4m3/block/dynamic/0')"
        ) from None


def quantize_weight(weight: torch.Tensor, plan: Fp8LinearPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, steps)`` of ``weight`` as the layer's forward makes them under ``plan``'s
    recipe (``serving_weight``), with the weight's statistics recorded once into
    ``plan.state.weight``."""
    w = weight.detach()
    data, steps, measured = _quantized(w, plan)
    state = plan.state.weight
    if plan.policy.granularity == "tensor":
        state.record(measured, steps)
        count(state.tally, w)
        return data, steps
    with torch.inference_mode(False), torch.no_grad():
        nothing = torch.zeros(1, dtype=torch.float32, device=steps.device)  # dynamic steps
        record_statistics([(state, w, measured, nothing)])
    return data, steps


def serving_weight(weight: torch.Tensor | None, plan: Fp8LinearPlan) -> ServingWeight:
    """The codes and steps a layer serves with: its frozen ones (``plan.frozen_weight``, as
    they are), else ``weight``'s as its forward makes them under ``plan``'s recipe (nothing
    recorded): per tensor, the step of the weight's own amax with no margin (a frozen
    weight never grows); per row or 128x128 block, the forward's block quantize under the
    recipe's step rule (its ``power_of_two``). Plain tensors even inside
    ``inference_mode`` (a frozen layer is still saved for an input gradient and loaded
    into)."""
    layout = weight_layout(plan.policy)
    if plan.frozen_weight is not None:
        return ServingWeight(*plan.frozen_weight, layout)
    if weight is None:
        raise ValueError("an fp8 linear needs a weight or a frozen (pre-quantized) weight")
    data, steps, _ = _quantized(weight.detach(), plan)
    return ServingWeight(data, steps, layout)


def _quantized(
    w: torch.Tensor, plan: Fp8LinearPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (codes, steps, what the freeze records: the amax per tensor, the largest block step);
    # mx's E8M0 scales as float32 steps (exact).
    with torch.inference_mode(False), torch.no_grad():
        if plan.policy.granularity == "tensor":
            data, step, amax = tensor_ops.quantize_dynamic(w, plan.fwd, 0, backend=plan.backend)
            return data, step.reshape(1).clone(), amax
        data, scale, largest, _ = quantize_weight_blocks(w, plan)
        return data, blockwise.steps_of_scale(scale), largest


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
    given.check_fits(
        f"{who} under policy {str(policy)!r}",
        policy.format.forward.torch,
        shape,
        weight_layout(policy),
        device,
        takes="serves with",
        given="freeze_for_serving was given",
    )
    return given


def check_loaded(
    entries: Mapping[str, object],
    held: tuple[torch.Tensor, torch.Tensor],
    policy: Recipe,
    prefix: str,
) -> None:
    """``ValueError`` unless a frozen layer holding ``held`` (its codes and steps) under
    ``policy`` can load the ``weight_fp8`` and ``weight_step`` among ``entries`` (local names;
    ``prefix`` the layer's key prefix): exactly the held dtypes, each code finite, each step
    finite and positive (a power of two under ``mx``) and each code times its step finite
    (``serving.check_state_entries``). Checked before ``load_state_dict`` copies anything."""
    codes, steps = (prefix + k for k in FROZEN_BUFFERS)
    check_state_entries(
        f"the frozen fp8 layer {prefix.rstrip('.') or '<root>'!r} under policy {str(policy)!r}",
        ServingWeight(*held, weight_layout(policy)),
        (codes, steps),
        entries.get(FROZEN_BUFFERS[0]),
        entries.get(FROZEN_BUFFERS[1]),
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
