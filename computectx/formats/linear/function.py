"""``fp8_linear``: the router every fp8 linear call goes through.

It takes the input, the weight (a parameter, a ``QuantizedWeight`` or ``QuantizedBlockWeight``, or a
DTensor under tensor parallelism) and the plan, decides the call's path once, and hands the
2-D call to its family's autograd function: ``linear.tensorwise`` for per-tensor policies,
``linear.blockwise`` for ``row``, ``block`` and ``mx``. Before that it lowers the input to an
open ``torch.autocast`` region's dtype, sends a call with DTensor operands to the handler
``computectx.distributed`` registered (``set_dtensor_linear``), answers a call with no rows,
and finds where the call sits with respect to activation checkpointing
(``linear.recompute.checkpoint_site``, asked only when a region can be open).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.backend import Backend
from computectx.formats.linear.blockwise import blockwise_linear
from computectx.formats.linear.frozen import dequantized
from computectx.formats.linear.plan import Fp8LinearPlan
from computectx.formats.linear.recompute import CheckpointSite, checkpoint_site
from computectx.formats.linear.tensorwise import tensorwise_linear
from computectx.saved import SAVING

__all__ = [
    "DTensorLinear",
    "autocast_dtype",
    "dtensor_linears",
    "fp8_linear",
    "is_dtensor",
    "set_dtensor_linear",
]

DTensorLinear = Callable[
    [torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", Fp8LinearPlan], torch.Tensor
]
"""Computes ``fp8_linear`` of operands some of which are DTensors (the seam
``computectx.distributed`` fills: it runs the call on the local shards)."""


dtensor_linears: list[DTensorLinear] = []


def set_dtensor_linear(fn: DTensorLinear) -> None:
    """Make ``fn`` the handler of fp8 linears whose operands include a DTensor."""
    dtensor_linears[:] = [fn]


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
    if torch.compiler.is_compiling():  # a compiled graph's saves carry no kind
        return _linear_2d(x, weight, bias, plan)
    token = SAVING.set("linear")  # what the linear keeps counts under its kind, whatever the mode
    try:
        return _linear_2d(x, weight, bias, plan)
    finally:
        SAVING.reset(token)


def _linear_2d(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, plan: Fp8LinearPlan
) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    site = _checkpoint_site(plan.record)
    y2: torch.Tensor
    if plan.policy.granularity != "tensor":  # dynamic, no history
        if x2.shape[0] == 0:
            return _empty_linear(x, weight, bias, plan)
        y2 = blockwise_linear(x2, weight, bias, plan, site)
    else:
        if x2.shape[0] == 0:
            empty = _empty_plan(plan, site)
            if empty is None:
                return _empty_linear(x, weight, bias, plan)
            plan = empty
        y2 = tensorwise_linear(x2, weight, bias, plan, site)
    # Back to x's leading shape as a new tensor, not a view of the 2-D product (what
    # torch.matmul does for N-D inputs): wrappers that hook module outputs (FSDP2's
    # pre-backward hook) warn that an in-place op on a view would drop their hook.
    out: torch.Tensor = torch.ops.aten._unsafe_view(y2, (*lead, y2.shape[-1]))
    return out


def _checkpoint_site(record: bool) -> CheckpointSite | None:
    """``checkpoint_site(record)``, asked only when a checkpointed region can be open.

    The same preconditions ``checkpoint_site`` starts from, read here from torch alone: a
    non-reentrant region's forward or recomputation runs under saved-tensor hooks, a
    reentrant one's recomputation inside a backward (a graph task), and a reentrant
    region's original forward under no_grad (looked up only for a call that records).
    While compiling there is no site (a compiled region's recomputation is AOTAutograd's).
    """
    if torch.compiler.is_compiling():
        return None
    if (
        torch._C._autograd._top_saved_tensors_default_hooks(True) is None
        and torch._C._current_graph_task_id() == -1
        and not (record and not torch.is_grad_enabled())
    ):
        return None
    return checkpoint_site(record)


def _empty_plan(plan: Fp8LinearPlan, site: CheckpointSite | None) -> Fp8LinearPlan | None:
    """The plan a per-tensor call with no rows runs under, or ``None`` to skip fp8."""
    if plan.reduces or plan.lockstep:
        # No rows on this rank, but the group's other ranks quantize theirs: this rank
        # takes part in every reduction they issue (forward and backward) and records
        # what they record, through the same path, so its history moves in step with
        # theirs (an amax of 0 is MAX's identity).
        pass
    elif site is not None and site.kind != "backward":
        # A checkpointed region's call and its recomputation must take the same path
        # (the recomputation cannot know whether the original was armed): the function,
        # recording nothing here, as the matmul below would not.
        plan = replace(plan, record=False)
    else:
        return None
    # On the pure-torch twins: a kernel launch over no elements is not worth a case.
    return replace(plan, backend=Backend.REFERENCE)


def _empty_linear(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, plan: Fp8LinearPlan
) -> torch.Tensor:
    # No rows: nothing to measure, and an empty amax (0) must not enter the history. A
    # matmul, not F.linear, so an open region's dispatch does not see it.
    w = weight if weight is not None else dequantized(plan, x.dtype)
    y = x.matmul(w.to(x.dtype).t())
    return y if bias is None else y + bias.to(x.dtype)


def is_dtensor(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (no import for plain tensors)."""
    if t is None or type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` would run a linear of ``x`` at, when it is on for ``x``'s
    device and that dtype is not ``x``'s; else ``None``."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype != x.dtype and dtype in FLOAT_DTYPES else None
