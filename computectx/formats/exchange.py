"""What a converted model exchanges with serving formats: its weights as ``ServingWeight``.

``serving_weights(model)`` gives, for each ``QuantizedLinear``'s ``weight`` and each converted
experts module's expert weights (by fully qualified name), the fp8 codes and float32 steps the
layer itself serves with, format-neutral: no files, no framework. The checkpoint writers
(``computectx.integrations.hf_checkpoint``) lay them out as their formats say.

============  ============  ===========================================================
granularity   layout        the codes and steps
============  ============  ===========================================================
``tensor``    ``tensor``    a linear: ``freeze_for_serving``'s (one step from the weight's
                            amax, no margin, the layer's backend); experts: each expert's
                            one step as the grouped forward takes it (the recipe's margin)
``row``       ``row``       one step per output row, by the recipe's step rule
                            (``power_of_two``), the forward's block quantize
``block``     ``128x128``   one step per 128x128 block, the forward's block quantize
``mx``        (refused)     MXFP8's E8M0 steps over 1x32 blocks: no serving layout yet
============  ============  ===========================================================

A frozen linear (``freeze_for_serving``) gives its own ``weight_fp8`` and ``weight_step``
buffers as they are. A trainable one is quantized here by the very operator and rule its
forward quantizes the weight with, so the codes are those its fp8 GEMM multiplies by (for
``tensor``, those freezing would keep; a delayed recipe's training forward reads its ledger's
step instead). Nothing in the model changes.
"""

from __future__ import annotations

from typing import Final

import torch
from torch import nn

from computectx.formats.convert_experts import experts_converters
from computectx.formats.linear.module import QuantizedLinear
from computectx.formats.numerics import grouped
from computectx.formats.numerics.layouts import OPERAND_GRANULARITY, Granularity, step_rule_of
from computectx.formats.ops import blockwise as block_ops
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.formats.ops.grouped import QuantizedExperts
from computectx.formats.serving import WEIGHT_LAYOUTS, ServingWeight
from computectx.recipes import Recipe

__all__ = ["LAYOUT_OF_GRANULARITY", "serving_layout", "serving_recipes", "serving_weights"]

LAYOUT_OF_GRANULARITY: Final[dict[str, Granularity]] = {
    "tensor": "tensor",
    "row": "row",
    "block": "128x128",
}
"""A recipe's granularity -> the ``ServingWeight`` layout its weights serve in (``mx`` has
none)."""


def serving_layout(recipe: Recipe) -> Granularity:
    """The ``ServingWeight`` layout of ``recipe``'s weights; ``ValueError`` naming the recipe
    and the layouts that exist when it has none (``mx``)."""
    layout = LAYOUT_OF_GRANULARITY.get(recipe.granularity)
    if layout is None:
        held = ", ".join(f"{g!r} ({layout})" for g, layout in LAYOUT_OF_GRANULARITY.items())
        raise ValueError(
            f"recipe {str(recipe)!r} (granularity {recipe.granularity!r}) has no serving weight "
            f"layout: serving formats hold granularities {held} (layouts "
            f"{', '.join(WEIGHT_LAYOUTS)})"
        )
    return layout


def serving_recipes(model: nn.Module) -> dict[str, Recipe]:
    """The recipe of each weight ``serving_weights`` gives, by the same names, without
    quantizing anything: what a checkpoint writer checks before it asks for the weights."""
    out = {_join(f, "weight"): m.policy for f, m in _linears(model)}
    for fqn, experts, weights in _converted_experts(model):
        out.update({_join(fqn, name): experts.policy for name in weights})
    return out


def serving_weights(model: nn.Module) -> dict[str, ServingWeight]:
    """fqn -> ``ServingWeight`` of each ``QuantizedLinear``'s ``weight`` (``"{fqn}.weight"``)
    and each converted experts module's expert weights (``"{fqn}.{parameter}"``, ``[E, N,
    K]`` as the module multiplies them), in module order (module docstring). ``ValueError``
    naming the weight and its recipe when a recipe has no serving layout (``mx``), before
    anything is quantized."""
    for name, recipe in serving_recipes(model).items():
        try:
            serving_layout(recipe)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    out = {_join(f, "weight"): _linear_weight(m) for f, m in _linears(model)}
    for fqn, experts, weights in _converted_experts(model):
        for name, w in weights.items():
            out[_join(fqn, name)] = _experts_weight(w, experts)
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _linears(model: nn.Module) -> list[tuple[str, QuantizedLinear]]:
    return [(f, m) for f, m in model.named_modules() if isinstance(m, QuantizedLinear)]


def _converted_experts(
    model: nn.Module,
) -> list[tuple[str, QuantizedExperts, dict[str, torch.Tensor]]]:
    """``(fqn, settings, weights)`` of each converted experts module: the first converter
    that knows the module answers, as ``convert_to_quantized`` asks them."""
    converters = experts_converters(model)
    found = []
    for fqn, module in model.named_modules():
        for converter in converters:
            weights = converter.weights(module)
            if weights is None:
                continue
            current = converter.current(module)
            if current is not None:
                found.append((fqn, current, weights))
            break
    return found


def _linear_weight(linear: QuantizedLinear) -> ServingWeight:
    """The codes and steps ``linear`` serves with (module docstring)."""
    recipe = linear.policy
    layout = serving_layout(recipe)
    if linear.frozen:
        step = linear.weight_step
        return ServingWeight(
            linear.weight_fp8, step.reshape(1) if layout == "tensor" else step, layout
        )
    w = linear.weight.detach()
    fmt = recipe.format.forward
    with torch.no_grad():
        if layout == "tensor":
            # freeze_for_serving's quantize: the weight's own amax, no margin (a frozen
            # weight never grows, so headroom would only cost precision).
            codes, step, _ = tensor_ops.quantize_dynamic(w, fmt, 0, backend=linear.backend)
            return ServingWeight(codes, step.reshape(1), layout)
        # The forward's weight quantize (linear.blockwise): the block operator on the
        # weight's granularity with the recipe's step rule; its scale is the dequantize step.
        granularity = OPERAND_GRANULARITY[recipe.granularity][1]
        codes, scale, _, _ = block_ops.fp8_quantize_blocks(
            w, fmt.torch, granularity, step_rule_of(recipe), linear.backend.value, False
        )
    return ServingWeight(codes, scale, layout)


def _experts_weight(w: torch.Tensor, experts: QuantizedExperts) -> ServingWeight:
    """Experts ``w [E, N, K]`` quantized per expert as the grouped forward quantizes them
    (``ops.grouped``: dynamic with the recipe's margin for ``tensor``, the block operator
    with its step rule otherwise)."""
    recipe = experts.policy
    layout = serving_layout(recipe)
    fmt, rule = recipe.format.forward, step_rule_of(recipe)
    codes, steps = [], []
    with torch.no_grad():
        for e in range(w.shape[0]):
            if layout == "tensor":
                q, s = grouped.quantize_operand(
                    w[e].detach(), fmt, "tensor", rule, recipe.scaling.margin
                )
            else:
                granularity = OPERAND_GRANULARITY[recipe.granularity][1]
                q, s = block_ops.quantize_blocks(
                    w[e].detach(), fmt, granularity, rule, None, backend=experts.backend
                )
            codes.append(q)
            steps.append(s.reshape(1) if layout == "tensor" else s)
    return ServingWeight(torch.stack(codes), torch.stack(steps), layout)
