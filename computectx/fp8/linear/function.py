"""``fp8_linear``: the router every fp8 linear call goes through.

It takes the input, the weight (a parameter, an ``Fp8Weight`` or ``Fp8BlockWeight``, or a
DTensor under tensor parallelism) and the plan, and sends the call to the tensor-wise
autograd function (``linear.tensorwise``) or the block-wise one (``linear.blockwise``) by the
policy's granularity, or to the DTensor linear when a weight is sharded.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from computectx.fp8.backend import Fp8Backend
from computectx.fp8.linear.blockwise import blockwise_linear
from computectx.fp8.linear.plan import Fp8LinearPlan, autocast_dtype, dtensor_linears, is_dtensor
from computectx.fp8.linear.recompute import checkpoint_site, delayed_quantize_in_compiled_checkpoint
from computectx.fp8.linear.tensorwise import (
    TensorwiseLinearFunction,
    dequantized,
    saving_the_quantize,
    unsaveable,
)
from computectx.recipes import DelayedScaling

__all__ = ["fp8_linear"]


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    plan: Fp8LinearPlan,
) -> torch.Tensor:
    """``x Wᵀ + b`` in fp8 for ``x`` of any leading shape; the result has ``x``'s dtype, or
    under ``torch.autocast`` for ``x``'s device the autocast dtype, as ``nn.Linear``'s has.

    ``weight`` is the high-precision weight (``None`` when ``plan.frozen_weight`` holds a
    pre-quantized one). Inputs are assumed checked by the caller (dtype in
    ``FLOAT_DTYPES``, matching ``in_features``).
    """
    lowered = autocast_dtype(x)
    if lowered is not None:
        # As autocast runs a linear: the input at the autocast dtype (what is quantized, and
        # the output's dtype); the weight stays as it is (it is quantized from its own
        # dtype). Autocast is then off inside, so it cannot also lower the fp8 path's
        # float32 work (the reference GEMM's matmul, the amaxes).
        with torch.autocast(x.device.type, enabled=False):
            return fp8_linear(x.to(lowered), weight, bias, plan)
    if is_dtensor(x) or is_dtensor(weight) or is_dtensor(bias):
        # Tensor parallelism (or any DTensor activations): the handler runs this call on
        # the local shards, each amax the whole tensor's.
        if not dtensor_linears:
            raise TypeError(
                "an fp8 linear got DTensor operands (tensor parallelism); import "
                "computectx.distributed, which computes it on the local shards"
            )
        return dtensor_linears[0](x, weight, bias, plan)
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if plan.policy.granularity != "tensor":  # blockwise_linear: dynamic, no history
        if x2.shape[0] == 0:
            return _empty_linear(x, weight, bias, plan)
        y_fine = blockwise_linear(x2, weight, bias, plan)
        out_fine: torch.Tensor = torch.ops.aten._unsafe_view(y_fine, (*lead, y_fine.shape[-1]))
        return out_fine
    site = checkpoint_site(plan.record)
    if x2.shape[0] == 0:
        checkpointed = site is not None and site.kind != "backward"
        if plan.reduces() or plan.lockstep:
            # No rows on this rank, but the group's other ranks quantize theirs: this rank
            # takes part in every reduction they issue (forward and backward) and records
            # what they record, through the same path, so its history moves in step with
            # theirs (an amax of 0 is MAX's identity).
            pass
        elif checkpointed:
            # A checkpointed region's call and its recomputation must take the same path
            # (the recomputation cannot know whether the original was armed): the function,
            # recording nothing here, as the matmul below would not.
            plan = replace(plan, record=False)
        else:
            # No rows: nothing to measure, and an empty amax (0) must not enter the
            # history. A matmul, not F.linear, so an open region's dispatch does not see it.
            return _empty_linear(x, weight, bias, plan)
        # On the pure-torch twins: a kernel launch over no elements is not worth a case.
        plan = replace(plan, backend=Fp8Backend.REFERENCE)
    y2: torch.Tensor
    if (
        torch.compiler.is_compiling()
        and plan.record
        and isinstance(plan.policy.scaling, DelayedScaling)
        and delayed_quantize_in_compiled_checkpoint(unsaveable(plan)) == "unsaved"
    ):
        y2 = saving_the_quantize(x2, weight, bias, plan)
    else:
        y2 = TensorwiseLinearFunction.apply(x2, weight, bias, plan, site)  # type: ignore[no-untyped-call]
    # Back to x's leading shape as a new tensor, not a view of the 2-D product (what
    # torch.matmul does for N-D inputs): wrappers that hook module outputs (FSDP2's
    # pre-backward hook) warn that an in-place op on a view would drop their hook.
    out: torch.Tensor = torch.ops.aten._unsafe_view(y2, (*lead, y2.shape[-1]))
    return out


def _empty_linear(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, plan: Fp8LinearPlan
) -> torch.Tensor:
    # No rows: nothing to measure, and an empty amax (0) must not enter the history. A
    # matmul, not F.linear, so an open region's dispatch does not see it.
    w = weight if weight is not None else dequantized(plan, x.dtype)
    y = x.matmul(w.to(x.dtype).t())
    return y if bias is None else y + bias.to(x.dtype)
