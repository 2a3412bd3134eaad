"""How the blocks store parameters: at ``compute ⊔ master``, as ``QuantizedLinear`` under fp8."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from computectx.ctx import ComputeCtx
from computectx.dtypes import promote
from computectx.formats import FEATURE_MULTIPLE, convert_to_quantized

__all__ = ["apply_recipe", "param_dtype"]


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
