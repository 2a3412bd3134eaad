"""What one fp8 linear call needs to know, decided once per call: ``Fp8LinearPlan``.

The plan carries the layer's policy, backend, scaling state and the GEMM's dtype, so the
router (``linear.function``) and the autograd functions (``linear.tensorwise``,
``linear.blockwise``) read one value rather than the module. ``set_dtensor_linear`` is the
seam tensor parallelism fills (``computectx.distributed``); ``autocast_dtype`` reads an open
``torch.autocast`` region.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from computectx.dtypes import FLOAT_DTYPES, DType
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.numerics.inline import QuantizeImpl
from computectx.fp8.scaling.layer import Fp8ScalingState
from computectx.fp8.scaling.operand import AmaxReduce
from computectx.recipes import Fp8Policy

__all__ = [
    "DTensorLinear",
    "Fp8LinearPlan",
    "autocast_dtype",
    "dtensor_linears",
    "gemm_dtype_for",
    "is_dtensor",
    "set_dtensor_linear",
]


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
    (``computectx.fp8.numerics.inline``; eager calls always run the operators). ``amax_reduce``
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

    policy: Fp8Policy
    state: Fp8ScalingState
    backend: Fp8Backend
    gemm_dtype: torch.dtype
    frozen_weight: tuple[torch.Tensor, torch.Tensor] | None = None
    quantize: QuantizeImpl = "op"
    amax_reduce: AmaxReduce | None = None
    record: bool = True
    input_reduce: AmaxReduce | None = None
    weight_reduce: AmaxReduce | None = None
    grad_reduce: AmaxReduce | None = None

    lockstep: bool = False
    """The layer is kept in step with other ranks and this call records: an empty input
    still goes through the recording path, so its history moves with theirs."""

    def reduces(self) -> bool:
        """Whether any quantize of this call reduces its amax with other ranks."""
        return any(
            r is not None
            for r in (self.amax_reduce, self.input_reduce, self.weight_reduce, self.grad_reduce)
        )


DTensorLinear = Callable[
    [torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", Fp8LinearPlan], torch.Tensor
]
"""Computes ``fp8_linear`` of operands some of which are DTensors (the seam
``computectx.distributed`` fills: it runs the call on the local shards)."""


dtensor_linears: list[DTensorLinear] = []


def set_dtensor_linear(fn: DTensorLinear) -> None:
    """Make ``fn`` the handler of fp8 linears whose operands include a DTensor."""
    dtensor_linears[:] = [fn]


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
