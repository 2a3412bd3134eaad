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
``mx``        ``mx``        one power-of-two step per 1x32 group along K (MXFP8's E8M0
                            scales, widened to float32 exactly), the forward's block quantize
                            under the recipe's ``mx_rounding``
============  ============  ===========================================================

A frozen linear (``freeze_for_serving``) gives its own ``weight_fp8`` and ``weight_step``
buffers as they are, and frozen experts (``ops.grouped_frozen``) their ``{name}_fp8`` and
``{name}_step``. A trainable one is quantized here by the very operator and rule its
forward quantizes the weight with, so the codes are those its fp8 GEMM multiplies by (for
``tensor``, those freezing would keep; a delayed recipe's training forward reads its ledger's
step instead). Nothing in the model changes.

``load_serving_weights(model, weights, mode=...)`` is the way back: every quantized weight of
the model given under the names ``serving_weights`` uses, each checked against its layer (the
layout of its recipe, the codes' format, the shape) before anything is written, then taken
as it is. ``mode="serve"`` freezes each linear with exactly those codes and steps
(``freeze_for_serving(weight=...)``), and each converted experts module whose framework's
forward reads frozen codes (``computectx.nn.GroupedExperts``, transformers' experts: its
converter's ``serves_frozen``) with its experts' (``ops.grouped_frozen.freeze_experts``: the
parameters dropped); other experts (torchtitan's) are refused in that mode, naming
``"train"``. ``mode="train"`` writes each
weight dequantized (``ServingWeight.dequantize`` to the weight's dtype) into the
high-precision weight in place, the master the policy trains and quantizes again, and
gives the linears a fresh scaling state (their ledgers measured other weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

import torch
from torch import nn

from computectx.formats.convert_experts import experts_converters
from computectx.formats.linear.frozen_ddp import check_unwrapped, exclude_frozen_from_ddp
from computectx.formats.linear.module import QuantizedLinear
from computectx.formats.ops.grouped import QuantizedExperts
from computectx.formats.ops.grouped_frozen import (
    experts_serving_weight,
    freeze_experts,
    held_experts,
)
from computectx.formats.scaling.load import guard_whole_loads
from computectx.formats.serving import ServingWeight, recipe_layout
from computectx.recipes import Recipe

__all__ = [
    "LOAD_MODES",
    "LoadMode",
    "load_serving_weights",
    "serving_recipes",
    "serving_weights",
]

LoadMode = Literal["serve", "train"]
"""What ``load_serving_weights`` makes of the weights: frozen codes, or trainable masters."""
LOAD_MODES: Final[tuple[LoadMode, ...]] = ("serve", "train")


def serving_recipes(model: nn.Module) -> dict[str, Recipe]:
    """The recipe of each weight ``serving_weights`` gives, by the same names, without
    quantizing anything: what a checkpoint writer checks before it asks for the weights."""
    out = {_join(f, "weight"): m.policy for f, m in _linears(model)}
    for at in _converted_experts(model):
        out.update({_join(at.fqn, name): at.settings.policy for name in at.weights})
    return out


def serving_weights(model: nn.Module) -> dict[str, ServingWeight]:
    """fqn -> ``ServingWeight`` of each ``QuantizedLinear``'s ``weight`` (``"{fqn}.weight"``)
    and each converted experts module's expert weights (``"{fqn}.{parameter}"``, ``[E, N,
    K]`` as the module multiplies them), in module order (module docstring). ``ValueError``
    naming the weight and its recipe when a recipe has no serving layout, before anything
    is quantized."""
    for name, recipe in serving_recipes(model).items():
        try:
            recipe_layout(recipe)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    out = {_join(f, "weight"): m.serving_weight() for f, m in _linears(model)}
    for at in _converted_experts(model):
        for name, w in at.weights.items():
            held = held_experts(at.module, name, at.settings)  # frozen: its codes as they are
            sw = held if held is not None else experts_serving_weight(w, at.settings)
            out[_join(at.fqn, name)] = sw
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _linears(model: nn.Module) -> list[tuple[str, QuantizedLinear]]:
    return [(f, m) for f, m in model.named_modules() if isinstance(m, QuantizedLinear)]


@dataclass(frozen=True)
class _ExpertsAt:
    fqn: str
    module: nn.Module
    settings: QuantizedExperts
    weights: dict[str, torch.Tensor]
    serves_frozen: bool  # its framework's forward reads frozen codes (ops.grouped_frozen)


def _converted_experts(model: nn.Module) -> list[_ExpertsAt]:
    """Each converted experts module, its settings and weights (a frozen one's codes): the
    first converter that knows the module answers, as ``convert_to_quantized`` asks them."""
    converters = experts_converters(model)
    found = []
    for fqn, module in model.named_modules():
        for converter in converters:
            weights = converter.weights(module)
            if weights is None:
                continue
            current = converter.current(module)
            if current is not None:
                freezes = getattr(converter, "serves_frozen", False) is True
                found.append(_ExpertsAt(fqn, module, current, weights, freezes))
            break
    return found


def load_serving_weights(
    model: nn.Module, weights: Mapping[str, ServingWeight], *, mode: LoadMode
) -> None:
    """Load ``weights`` (the names ``serving_weights(model)`` gives) into ``model`` as
    ``mode`` says (module docstring): ``"serve"``, each linear and experts module frozen with
    exactly the given codes and steps; ``"train"``, each weight := the given one dequantized
    to its dtype, in place (the same ``Parameter`` objects, so an optimizer built before
    keeps working).

    Everything is checked first; ``ValueError`` naming the weight, what was given and what
    the layer takes, with nothing changed, for: an unknown mode; a quantized weight of the
    model not given, or a name the model has no quantized weight under; a layout other
    than the recipe's (``tensor``, ``row``, ``128x128``, ``mx`` for granularity ``tensor``,
    ``row``, ``block``, ``mx``); codes in another format than the recipe's forward format;
    another shape; steps that are not finite and positive (``mx``: not powers of two in
    E8M0's range); ``"train"`` into a layer frozen for serving (it holds no high-precision
    weight); ``"serve"`` for converted experts whose forward reads their weights (no frozen
    form: torchtitan's). Codes and steps on another device are moved to the layer's.
    ``"serve"`` into a model that is or holds a ``DistributedDataParallel``: ``TypeError``
    (load into its ``.module``, then wrap).

    ``"serve"`` adds the frozen weights' buffers to ``model``'s list of what
    ``DistributedDataParallel`` leaves out (``exclude_frozen_from_ddp``):
    ``DistributedDataParallel(model)`` then wraps the served model instead of failing in its
    first broadcast (gloo sends no float8)."""
    if mode not in LOAD_MODES:
        raise ValueError(f"load_serving_weights: unknown mode {mode!r}; accepted: 'serve', 'train'")
    if mode == "serve":
        check_unwrapped(
            model,
            "load_serving_weights(mode='serve')",
            "load into the model inside it (its .module) before wrapping: DDP's reducer holds "
            "the high-precision weights a freeze drops, and its broadcasts miss the codes",
        )
    targets = _load_targets(model)
    missing = [name for name in targets if name not in weights]
    unknown = [name for name in weights if name not in targets]
    if missing or unknown:
        raise ValueError(
            f"load_serving_weights: the weights given do not match the model's quantized "
            f"weights; not given: {missing or 'none'}; unknown to the model: {unknown or 'none'}. "
            f"Nothing was changed"
        )
    placed = {name: target.check(name, weights[name], mode) for name, target in targets.items()}
    with torch.no_grad():
        for name, target in targets.items():
            target.write(placed[name], mode)
    if mode == "serve":
        exclude_frozen_from_ddp(model)  # DDP(model) wraps it: gloo sends no float8


class _Target:
    """One quantized weight of the model: its recipe, the tensor it is held in (a linear's
    ``weight``, or an experts module's ``[E, N, K]`` view), its shape and device."""

    def __init__(
        self,
        recipe: Recipe,
        held: torch.Tensor | None,
        linear: QuantizedLinear | None,
        experts: tuple[_ExpertsAt, str] | None = None,
    ):
        self.recipe, self.held, self.linear, self.experts = recipe, held, linear, experts

    def _frozen(self) -> bool:
        if self.experts is not None:
            at, name = self.experts
            return held_experts(at.module, name, at.settings) is not None
        return self.linear is not None and self.linear.frozen

    def _shape_device(self) -> tuple[tuple[int, ...], torch.device]:
        if self.linear is not None:
            device = (self.linear.weight_fp8 if self.linear.frozen else self.linear.weight).device
            return (self.linear.out_features, self.linear.in_features), device
        assert self.held is not None
        return tuple(self.held.shape), self.held.device

    def check(self, name: str, given: ServingWeight, mode: LoadMode) -> ServingWeight:
        """``given`` moved to the layer's device, once it fits the layer and ``mode``
        (``load_serving_weights``' refusals); reads nothing but ``given`` and the layer."""
        if not isinstance(given, ServingWeight):
            raise TypeError(
                f"load_serving_weights: {name} must be a ServingWeight, got {type(given).__name__}"
            )
        recipe = self.recipe
        shape, device = self._shape_device()
        fmt = recipe.format.forward.torch
        try:
            layout = recipe_layout(recipe)
        except ValueError as e:
            raise ValueError(f"load_serving_weights: {name}: {e}") from None
        given.check_fits(
            f"load_serving_weights: {name} under recipe {str(recipe)!r}", fmt, shape, layout
        )
        if mode == "train" and self._frozen():
            raise ValueError(
                f"load_serving_weights: {name} is frozen for serving (it holds codes, no "
                f"high-precision weight), so mode='train' cannot write its master; load into "
                f"a model converted without freezing, or use mode='serve'. Nothing was changed"
            )
        if mode == "serve" and self.experts is not None and not self.experts[0].serves_frozen:
            raise ValueError(
                f"load_serving_weights: {name} belongs to converted experts whose forward "
                f"reads their weights ({type(self.experts[0].module).__name__}: no frozen "
                f"(serving) form); load with mode='train' (the experts' weights become the "
                f"dequantized codes, which their forward quantizes again). Nothing was changed"
            )
        return ServingWeight(given.codes.to(device), given.steps.to(device), given.layout)

    def write(self, given: ServingWeight, mode: LoadMode) -> None:
        linear = self.linear
        if mode == "serve" and self.experts is not None:
            at, name = self.experts
            assert self.held is not None
            freeze_experts(at.module, at.settings, {name: self.held}, {name: given})
            # Its load_state_dict then checks held codes and steps before any load, as the
            # experts' own freeze_for_serving makes it do.
            guard_whole_loads(at.module)
            return
        if mode == "serve":
            assert linear is not None
            # The layer's own scaling state was measured for other weights (its earlier
            # forwards): it starts fresh, so what the import serves depends on the checkpoint
            # alone (inputs then take each request's own amax until calibrated again).
            linear.scaling.reset(given.codes.device)
            linear.freeze_for_serving(weight=given)
            return
        held = linear.weight if linear is not None else self.held
        assert held is not None
        held.copy_(given.dequantize(held.dtype))
        if linear is not None:
            linear.scaling.reset(held.device)


def _load_targets(model: nn.Module) -> dict[str, _Target]:
    """The model's quantized weights by ``serving_weights``' names, in its order."""
    out = {_join(f, "weight"): _Target(m.policy, None, m) for f, m in _linears(model)}
    for at in _converted_experts(model):
        for n, w in at.weights.items():
            out[_join(at.fqn, n)] = _Target(at.settings.policy, w, None, (at, n))
    return out
