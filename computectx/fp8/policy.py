"""The fp8 recipe types (re-exported from the core) and ``policy_of``, the ctx check.

The recipe is data the policy carries, so it lives in the core module
``computectx.recipes``; this module keeps the import path ``computectx.fp8.policy``
working. ``policy_of`` is how every fp8 entry point (``Fp8Linear``, ``convert_to_fp8``,
``fp8_autocast``) reads the policy from the ctx it is given.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from computectx.ctx import ComputeCtx
from computectx.fp8.numerics.layouts import check_granularity_widths
from computectx.recipes import (
    DelayedScaling,
    DynamicScaling,
    Fp8Policy,
    Fp8Scheme,
    Scaling,
)

__all__ = [
    "DelayedScaling",
    "DynamicScaling",
    "Fp8Policy",
    "Fp8Scheme",
    "Scaling",
    "check_quantize",
    "checked_layer_ctx",
    "describe",
    "policy_of",
]

_Q = TypeVar("_Q", bound=str)


def describe(value: object, limit: int = 60) -> str:
    """``value`` for an error message: its type and a repr cut to ``limit`` characters."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def policy_of(ctx: object, who: str) -> Fp8Policy:
    """``ctx.fp8`` of a ``ComputeCtx`` that has one; ``who`` names the caller in errors.

    Raises ``TypeError`` when ``ctx`` is not a ``ComputeCtx`` and ``ValueError`` when its
    ``fp8`` is ``None``; the messages say what is accepted. Every granularity the policy can
    name runs (``computectx.fp8.linear.blockwise`` runs row, block and mx).
    """
    if not isinstance(ctx, ComputeCtx):
        raise TypeError(
            f"{who} needs a computectx.ComputeCtx with an fp8 policy, got {describe(ctx)}; "
            f"e.g. ComputeCtx.from_flag('fp8_hybrid', device)"
        )
    if ctx.fp8 is None:
        raise ValueError(
            f"{who} needs a ctx with an fp8 policy, but {str(ctx)!r} has fp8=None; use e.g. "
            f"ctx.replace(fp8=Fp8Policy()) or ComputeCtx.from_flag('fp8_hybrid', device)"
        )
    return ctx.fp8


def check_quantize(quantize: _Q, policy: Fp8Policy) -> _Q:
    """``quantize`` (an ``Fp8Linear``'s ``"op"`` or ``"inline"``) if ``policy`` runs it;
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
    frozen: torch.dtype | None,
) -> ComputeCtx:
    """``ctx`` if an ``Fp8Linear`` of these widths, quantizing as ``quantize``, can run under
    it: the rules its construction applies (``policy_of``, ``check_granularity_widths``,
    ``check_quantize``), and for a layer frozen for serving (``frozen``, the dtype its weight
    codes are held in) a per-tensor policy of that forward format. ``TypeError`` or
    ``ValueError`` naming the layer's shape and the rule otherwise (``layer.ctx = ...``
    changes nothing then)."""
    shape = f"Fp8Linear(in_features={in_features}, out_features={out_features})"
    policy = policy_of(ctx, f"{shape}.ctx")
    try:
        check_granularity_widths(policy.granularity, in_features, out_features)
        check_quantize(quantize, policy)
        if frozen is not None and (
            policy.granularity != "tensor" or policy.format.forward.torch != frozen
        ):
            raise ValueError(
                f"the layer is frozen for serving, its weight held as per-tensor {frozen} "
                f"codes, so a new policy must be per tensor with that forward format"
            )
    except ValueError as e:
        raise ValueError(
            f"{shape} cannot take the ctx with fp8={policy}: {e}. The layer keeps its ctx"
        ) from None
    assert isinstance(ctx, ComputeCtx)  # policy_of refuses anything else
    return ctx
