"""What ``nn``, ``distributed``, ``integrations`` and the CLI read of fp8's insides: the one door.

``computectx.fp8`` is the public face (what users import); this module is the other door, for
the packages built on fp8: the backend checks, the ledger's layout, the operand scaling state
and its reduce hook, the weight-gather quantizes, the tensor-parallel linear, and the serving
quantizes and decode attention, and the grouped GEMM's input checks (the high-precision
grouped experts share them). Outside ``computectx.fp8`` nothing imports a deeper module
(``tests/test_layering.py`` keeps it so), so fp8's rooms can move without touching the
packages above; a name added here is a promise to them.
"""

from __future__ import annotations

from computectx.fp8.backend import check_backend, default_backend, parse_backend, uses_kernels
from computectx.fp8.linear.function import fp8_linear, set_dtensor_linear
from computectx.fp8.linear.plan import Fp8LinearPlan
from computectx.fp8.numerics.kv_quant import dequantize_kv, quantize_kv, static_kv_steps
from computectx.fp8.numerics.layouts import step_rule_of
from computectx.fp8.numerics.ledger import (
    TALLY_ELEMENTS,
    ledger_history,
    ledger_nonfinite,
    ledger_saturated,
    ledger_step,
)
from computectx.fp8.numerics.tensorwise import step_from_amax
from computectx.fp8.ops.attention import (
    KERNEL_HEAD_DIMS,
    check_kernel_head_dim,
    decode_attention,
)
from computectx.fp8.ops.blockwise import cublas_recipes, quantize_blocks
from computectx.fp8.ops.grouped import check_grouped, checked_bounds
from computectx.fp8.ops.tensorwise import quantize_with_step
from computectx.fp8.scaling.load import guard_whole_loads
from computectx.fp8.scaling.operand import AmaxReduce, OperandScaling
from computectx.fp8.scaling.saved import ROLES, Role

__all__ = [
    "KERNEL_HEAD_DIMS",
    "ROLES",
    "TALLY_ELEMENTS",
    "AmaxReduce",
    "Fp8LinearPlan",
    "OperandScaling",
    "Role",
    "check_backend",
    "check_grouped",
    "check_kernel_head_dim",
    "checked_bounds",
    "cublas_recipes",
    "decode_attention",
    "default_backend",
    "dequantize_kv",
    "fp8_linear",
    "guard_whole_loads",
    "ledger_history",
    "ledger_nonfinite",
    "ledger_saturated",
    "ledger_step",
    "parse_backend",
    "quantize_blocks",
    "quantize_kv",
    "quantize_with_step",
    "set_dtensor_linear",
    "static_kv_steps",
    "step_from_amax",
    "step_rule_of",
    "uses_kernels",
]
