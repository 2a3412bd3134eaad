"""The rules an fp8 layer is built under: ``policy_of`` (the ctx check), the widths, the quantize.

The recipe is data the policy carries, so it lives in the core module
``computectx.recipes`` (its types are re-exported here). ``policy_of`` is how every fp8 entry
point (``QuantizedLinear``, ``convert_to_quantized``, ``autocast``) reads the policy from the ctx it
is given; ``check_fp8_widths`` and ``check_granularity_widths`` are the width rules
``QuantizedLinear`` raises and ``convert_to_quantized`` skips by; ``check_quantize`` and
``checked_layer_ctx`` the rules a layer's ``quantize`` and a new ``ctx`` are held to.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from computectx.ctx import ComputeCtx
from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.numerics.layouts import check_granularity_widths
from computectx.fp4_recipe import Fp4Recipe
from computectx.recipes import (
    DelayedScaling,
    DynamicScaling,
    Fp8Scheme,
    Recipe,
    Scaling,
)

__all__ = [
    "FEATURE_MULTIPLE",
    "DelayedScaling",
    "DynamicScaling",
    "Fp4Recipe",
    "Fp8Scheme",
    "Recipe",
    "Scaling",
    "check_fp8_widths",
    "check_granularity_widths",
    "check_param_dtype",
    "check_quantize",
    "checked_layer_ctx",
    "default_device",
    "describe",
    "is_dtensor",
    "policy_of",
    "recipe_of",
    "refuse_sharded",
]

_Q = TypeVar("_Q", bound=str)

FEATURE_MULTIPLE = 16
"""``in_features`` and ``out_features`` must be multiples of this for fp8: fp8 tensor core
tiles (and cuBLASLt's fp8 GEMMs, which refuse other widths) work on 16-element K and N
steps. ``QuantizedLinear`` refuses other widths and ``convert_to_quantized`` skips them, through
the one
check ``check_fp8_widths``."""


def describe(value: object, limit: int = 60) -> str:
    """``value`` for an error message: its type and a repr cut to ``limit`` characters."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def filtered_out(
    module_filter: Callable[[nn.Module, str], bool], module: nn.Module, fqn: str
) -> bool:
    """Whether ``module_filter`` keeps ``module`` (at ``fqn``) out of a conversion;
    ``TypeError`` when it returns anything but a bool (nothing converted yet)."""
    chosen = module_filter(module, fqn)
    if not isinstance(chosen, bool):
        raise TypeError(
            f"module_filter must return a bool, got {describe(chosen)} for "
            f"{fqn or '<root>'!r}; the model was left unchanged"
        )
    return not chosen


def recipe_of(ctx: object, who: str) -> Recipe | Fp4Recipe:
    """``ctx.recipe`` of a ``ComputeCtx`` that has one, fp8 or 4-bit; ``who`` names the caller.

    Raises ``TypeError`` when ``ctx`` is not a ``ComputeCtx`` and ``ValueError`` when its
    ``recipe`` is ``None``; the messages say what is accepted."""
    if not isinstance(ctx, ComputeCtx):
        raise TypeError(
            f"{who} needs a computectx.ComputeCtx with an fp8 policy, got {describe(ctx)}; "
            f"e.g. ComputeCtx.from_flag('fp8_hybrid', device)"
        )
    if ctx.recipe is None:
        raise ValueError(
            f"{who} needs a ctx with a recipe, but {str(ctx)!r} has recipe=None; use e.g. "
            f"ctx.replace(recipe=Recipe()) or ComputeCtx.from_flag('fp8_hybrid', device)"
        )
    return ctx.recipe


def policy_of(ctx: object, who: str) -> Recipe:
    """``ctx.recipe`` of a ``ComputeCtx`` that has an fp8 one (``recipe_of``'s errors).

    ``NotImplementedError`` when it is a 4-bit ``Fp4Recipe`` (``fp4_not_built``: the fp8
    entry points never stand in for 4 bits). Every granularity the fp8 policy can name runs
    (``computectx.formats.linear.blockwise`` runs row, block and mx).
    """
    recipe = recipe_of(ctx, who)
    if isinstance(recipe, Fp4Recipe):
        raise NotImplementedError(fp4_not_built(who, recipe))
    return recipe


def fp4_not_built(who: str, recipe: Fp4Recipe) -> str:
    """The message of a 4-bit recipe refused by ``who``, an fp8 entry point: 4-bit dense
    linears are ``Fp4Linear`` and 4-bit experts ``Fp4Experts`` (``convert_to_quantized``
    converts to them); an fp8 entry point never runs fp8 in their place."""
    return (
        f"{who} runs fp8 recipes; the ctx holds the 4-bit recipe {str(recipe)!r}, whose dense "
        f"linears are Fp4Linear and whose grouped experts are Fp4Experts (convert_to_quantized "
        f"converts to them), and fp8 never runs in their place. Use convert_to_quantized, an "
        f"fp8 recipe (e.g. ComputeCtx.from_flag('fp8_hybrid', device)) or none"
    )


def check_quantize(quantize: _Q, policy: Recipe) -> _Q:
    """``quantize`` (a ``QuantizedLinear``'s ``"op"`` or ``"inline"``) if ``policy`` runs it;
    ``ValueError`` for ``"inline"`` under a ``row``, ``block`` or ``mx`` policy."""
    # The inline quantize traces the per-tensor quantize as plain ops; a fine-grained linear
    # always calls its block-quantize operator, so "inline" would be silently ignored.
    if quantize == "inline" and policy.granularity != "tensor":
        raise ValueError(
            f"quantize='inline' is a per-tensor option; the policy {str(policy)!r} has "
            f"granularity {policy.granularity!r}, whose quantize is always its operator. "
            f"Use quantize='op' (the default)"
        )
    return quantize


def checked_layer_ctx(
    ctx: object,
    in_features: int,
    out_features: int,
    quantize: str,
    frozen: tuple[str, torch.dtype] | None,
) -> ComputeCtx:
    """``ctx`` if a ``QuantizedLinear`` of these widths, quantizing as ``quantize``, can run under
    it: the rules its construction applies (``policy_of``, ``check_granularity_widths``,
    ``check_quantize``), and for a layer frozen for serving (``frozen``: the granularity its
    weight codes are laid out for and their dtype) a policy of that granularity and forward
    format. ``TypeError`` or
    ``ValueError`` naming the layer's shape and the rule otherwise (``layer.ctx = ...``
    changes nothing then)."""
    shape = f"QuantizedLinear(in_features={in_features}, out_features={out_features})"
    policy = policy_of(ctx, f"{shape}.ctx")
    try:
        check_granularity_widths(policy.granularity, in_features, out_features)
        check_quantize(quantize, policy)
        if frozen is not None and (policy.granularity, policy.format.forward.torch) != frozen:
            granularity, dtype = frozen
            held = {"tensor": "per-tensor", "row": "per-row", "mx": "1x32 MX-block"}.get(
                granularity, "128x128-block"
            )
            raise ValueError(
                f"the layer is frozen for serving, its weight held as {held} {dtype} codes, so "
                f"a new policy must have granularity {granularity!r} and that forward format"
            )
    except ValueError as e:
        raise ValueError(
            f"{shape} cannot take the ctx with fp8={policy}: {e}. The layer keeps its ctx"
        ) from None
    assert isinstance(ctx, ComputeCtx)  # policy_of refuses anything else
    return ctx


def check_fp8_widths(in_features: int, out_features: int) -> None:
    """Raise ``ValueError`` unless both widths are multiples of ``FEATURE_MULTIPLE`` (16).

    The one width rule of fp8 layers: ``QuantizedLinear`` raises this error and
    ``convert_to_quantized``
    records its message as the reason it skipped a layer.
    """
    if in_features % FEATURE_MULTIPLE or out_features % FEATURE_MULTIPLE:
        raise ValueError(
            f"in_features={in_features}, out_features={out_features}: both must be multiples "
            f"of {FEATURE_MULTIPLE} for fp8 GEMM tiles"
        )


def check_param_dtype(name: str, dtype: torch.dtype) -> None:
    """``ValueError`` unless a ``QuantizedLinear`` parameter's dtype is bf16, fp16 or fp32.

    Checked when the layer is built: a float64 master weight would otherwise only fail at
    the first forward, deep inside the quantize call."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"QuantizedLinear quantizes its {name} from bf16, fp16 or fp32; got {dtype}. Pass "
            f"dtype=torch.float32 (or a ctx whose master dtype is f32/bf16/f16)"
        )


def default_device(ctx: ComputeCtx) -> torch.device:
    """Where a ``QuantizedLinear`` puts new weights: torch's default device when one is set,
    else ``ctx.device``."""
    # torch's default device when one is set (torch.set_default_device, a `with
    # torch.device(...)` block: "meta" builds a layer to materialise later with to_empty),
    # else the policy's. The CPU is torch's default when none is set, so it never overrides.
    default = torch.get_default_device()
    return default if default.type != "cpu" else ctx.device


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor``, without importing ``torch.distributed.tensor`` (half a
    second at import; where nothing imported it, no tensor can be one)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(t, tensor.DTensor)


def refuse_sharded(who: str, module: nn.Module, managed: bool = False) -> None:
    """``ValueError`` (nothing changed) when ``module`` holds a parameter sharded by FSDP2 (a
    ``DTensor``: ``fully_shard``, ``parallelize(strategy="fsdp")``), or is ``managed`` by an
    FSDP2 module above it (whose parameters a forward may have left unsharded for a while): a
    freeze quantizes each whole weight in place, which a shard is not, and FSDP2 and the
    optimizer would keep the weights it drops. ``who`` names the call and the layer."""
    if managed or any(is_dtensor(p) for p in module.parameters(recurse=False)):
        raise ValueError(
            f"{who}: the layer was sharded by FSDP2 (fully_shard, or parallelize(strategy="
            f"'fsdp'): its weight is a DTensor shard), so it cannot be frozen in place. Freeze "
            f"before sharding; to serve a model trained under FSDP2, gather it "
            f"(torch.distributed.checkpoint, or full_state_dict) into an unsharded model and "
            f"freeze that. Nothing was changed"
        )
