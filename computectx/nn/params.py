"""How the blocks store parameters: at ``compute ⊔ master``, as ``QuantizedLinear`` under fp8;
and the policy they were built under (``BuiltUnder``)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from computectx.ctx import ComputeCtx
from computectx.dtypes import promote
from computectx.formats import FEATURE_MULTIPLE, convert_to_quantized

__all__ = ["BuiltUnder", "apply_recipe", "param_dtype"]


class BuiltUnder:
    """A block whose ``ctx`` is the policy it was built under (listed before ``nn.Module``).

    The ctx decides at construction the parameters' dtypes, which linears became fp8 or 4-bit
    layers and the block's children, each of which keeps its own: assigning another ctx to
    the block would change what its own forward reads and not what its children were built
    as (half a policy). So ``ctx`` is set once, by the constructor; assigning it again is an
    ``AttributeError`` that changes nothing. A ``QuantizedLinear``'s ``ctx`` stays assignable
    (its setter checks the swap)."""

    _ctx: ComputeCtx

    @property
    def ctx(self) -> ComputeCtx:
        """The policy this block was built under (read-only: class docstring)."""
        return self._ctx

    @ctx.setter
    def ctx(self, value: ComputeCtx) -> None:
        if "_ctx" in self.__dict__:
            name = type(self).__name__
            raise AttributeError(
                f"{name}.ctx is the policy it was built under ({self._ctx}); its children, "
                f"parameter dtypes and converted layers were decided by it, so assigning "
                f"{value!s} would apply half a policy. Build a new {name} under the new ctx "
                f"(and load this one's state_dict into it where the formats match)"
            )
        if not isinstance(value, ComputeCtx):
            raise TypeError(f"ctx must be a ComputeCtx, got {type(value).__name__}")
        self._ctx = value


def param_dtype(ctx: ComputeCtx) -> torch.dtype:
    """The dtype the blocks store parameters at: ``ctx.compute ⊔ ctx.master``.

    With the default F32 master that is F32 for F16/BF16/F32 policies (autocast reads the
    F32 copy and computes at ``compute``) and F64 for an F64 policy, whose matmuls need F64
    weights because autocast never raises precision.
    """
    return promote(ctx.compute, ctx.master).torch


def apply_recipe(block: nn.Module, ctx: ComputeCtx) -> None:
    """Swap every ``nn.Linear`` inside ``block`` for a ``QuantizedLinear`` when ``ctx.recipe`` is
    set;
    do nothing otherwise.

    A ctx with an fp8 policy asks for fp8, so the blocks convert at any width: the width
    threshold of ``convert_to_quantized`` is for picking layers of someone else's model. Widths
    that are not multiples of ``FEATURE_MULTIPLE`` (16) cannot run fp8 GEMM tiles and raise
    ``ValueError`` rather than quietly staying in high precision.
    """
    if ctx.recipe is None:
        return
    # convert_to_quantized warns when it converts nothing; here that case raises below with the
    # widths that fp8 refused, so its warnings are replayed only when the block is built.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = convert_to_quantized(block, ctx, include_head=True, min_features=FEATURE_MULTIPLE)
    # Layers a sub-block converted as it was built (fp8 or 4-bit) are skipped as already_fp8;
    # a 4-bit recipe's hp/hp_last keeps layers high by choice (kept_high), not by refusal.
    refused = [s for s in report.skipped if s.rule not in ("already_fp8", "kept_high")]
    if refused:
        raise ValueError(
            f"{type(block).__name__} cannot run its linears in {report.target} under "
            f"{str(ctx)!r}: {'; '.join(f'{s.fqn}: {s.reason}' for s in refused)}. Use widths "
            f"that are multiples of {FEATURE_MULTIPLE}, or a ctx without a recipe"
        )
    for w in caught:
        # With this module's registry, so the default "once per location" filter still holds.
        warnings.warn_explicit(
            w.message,
            w.category,
            w.filename,
            w.lineno,
            module=__name__,
            registry=globals().setdefault("__warningregistry__", {}),
        )
