"""What one fp8 linear call needs to know besides its tensors: ``Fp8LinearPlan``.

The plan carries the layer's policy, backend, scaling state and the GEMM's dtype, so the
router (``linear.function``) and the autograd functions (``linear.tensorwise``,
``linear.blockwise``) read one value rather than the module. It is data: nothing on a call's
forward's path calls into this module (a ``QuantizedLinear`` builds its plans when its ctx or
device changes, and what the plan derives from the policy is read once, then held); the
backwards end in ``linear_grads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from computectx.activations import SaveMode
from computectx.dtypes import DType, Fp8Format
from computectx.formats.backend import Backend
from computectx.formats.numerics.inline import QuantizeImpl
from computectx.formats.numerics.layouts import StepRule, step_rule_of
from computectx.formats.scaling.layer import ScalingState
from computectx.formats.scaling.operand import AmaxReduce
from computectx.recipes import Recipe

__all__ = ["Fp8LinearPlan", "LinearGrads", "gemm_dtype_for", "linear_grads"]

LinearGrads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]
"""What an fp8 linear's autograd function returns from its backward: ``(dX, dW, db)`` (each
``None`` where not needed), then nothing for the plan and the call's last argument."""


def linear_grads(
    dx: torch.Tensor | None, dw: torch.Tensor | None, dy: torch.Tensor, b_dtype: torch.dtype | None
) -> LinearGrads:
    """A backward's ``LinearGrads``: ``dx``, ``dw`` and, when ``b_dtype`` (the bias's dtype)
    says the bias needs one, its gradient. The bias never goes through fp8: its gradient
    sums the unquantized ``dy`` in float32, then rounds once to ``b_dtype``."""
    db = None if b_dtype is None else dy.sum(0, dtype=torch.float32).to(b_dtype)
    return dx, dw, db, None, None


def gemm_dtype_for(compute: DType) -> torch.dtype:
    """Dtype the GEMM epilogue writes for a ctx's compute dtype.

    BF16 and F16 activations come out of the epilogue at that dtype (one rounding of the
    float32 accumulator); F32/F64 policies get float32, the widest the kernels write.
    """
    if compute is DType.BF16:
        return torch.bfloat16
    if compute is DType.F16:
        return torch.float16
    return torch.float32


@dataclass(frozen=True, eq=False)
class Fp8LinearPlan:
    """Everything one fp8 linear call needs besides its tensors.

    ``frozen_weight`` is ``(data_fp8, step)`` for a weight quantized once for serving;
    the weight ledger is then left alone. ``quantize`` says how a compiled call quantizes
    (``computectx.formats.numerics.inline``; eager calls always run the operators). ``amax_reduce``
    makes dynamic scaling of the input and the output gradient use a group's amax
    (``OperandScaling.quantize``). ``record=False`` is a call outside training: every
    operand is quantized from the state as it is and nothing is written
    (``OperandScaling.quantize_unrecorded``); ``amax_reduce`` is then ``None``.

    ``input_reduce``, ``weight_reduce`` and ``grad_reduce`` are set for operands that are
    shards of a larger tensor (tensor parallelism: ``computectx.distributed`` computes a
    linear of DTensors on the local shards): each turns its operand's amax into the whole
    tensor's (including ``amax_reduce``'s group when that is set), every call quantizes
    that operand with the whole tensor's step and records the whole amax
    (``OperandScaling.quantize_sharded``), and a call outside training uses it where it
    needs the current amax.
    """

    policy: Recipe
    state: ScalingState
    backend: Backend
    gemm_dtype: torch.dtype
    frozen_weight: tuple[torch.Tensor, torch.Tensor] | None = None
    quantize: QuantizeImpl = "op"
    amax_reduce: AmaxReduce | None = None
    record: bool = True
    input_reduce: AmaxReduce | None = None
    weight_reduce: AmaxReduce | None = None
    grad_reduce: AmaxReduce | None = None

    save: SaveMode = "keep"
    """How the backward keeps the input (``ctx.activations.linear``, read when the plan is
    made): ``keep`` as each family saves it, ``fp8`` the quantized operand the backward needs
    (``linear.blockwise``; the per-tensor linear keeps its fp8 codes under either)."""

    lockstep: bool = False
    """The layer is kept in step with other ranks and this call records: an empty input
    still goes through the recording path, so its history moves with theirs."""

    fwd: Fp8Format = field(init=False, repr=False)
    """The policy's forward format (inputs and weights)."""
    bwd: Fp8Format = field(init=False, repr=False)
    """The policy's backward format (output gradients)."""
    step_rule: StepRule = field(init=False, repr=False)
    """How a fine-grained policy's blocks turn their amax into a step (``step_rule_of``)."""
    reduces: bool = field(init=False, repr=False)
    """Whether any quantize of this call reduces its amax with other ranks."""

    def __post_init__(self) -> None:
        # What a call reads of the policy, derived once when the plan is made (a QuantizedLinear
        # keeps its plans), so the call reads attributes. Set here as a frozen dataclass's
        # own __init__ sets its fields; dataclasses.replace derives them again.
        derived = {
            "fwd": self.policy.format.forward,
            "bwd": self.policy.format.backward,
            "step_rule": step_rule_of(self.policy),
            "reduces": any(
                r is not None
                for r in (self.amax_reduce, self.input_reduce, self.weight_reduce, self.grad_reduce)
            ),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
