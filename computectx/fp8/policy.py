"""The fp8 recipe types (re-exported from the core) and ``policy_of``, the ctx check.

The recipe is data the policy carries, so it lives in the core module
``computectx.recipes``; this module keeps the import path ``computectx.fp8.policy``
working. ``policy_of`` is how every fp8 entry point (``Fp8Linear``, ``convert_to_fp8``,
``fp8_autocast``) reads the policy from the ctx it is given.
"""

from __future__ import annotations

from computectx.ctx import ComputeCtx
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
    "describe",
    "policy_of",
]


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
    name runs (``computectx.fp8.granular_linear`` runs row, block and mx).
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
