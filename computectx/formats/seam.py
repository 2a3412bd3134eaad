"""What ``nn``, ``distributed``, ``integrations`` and the CLI read of fp8's insides: the one door.

``computectx.formats`` is the public face (what users import); this module is the other door, for
the packages built on fp8: the backend checks, the ledger's layout, the operand scaling state
and its reduce hook, the weight-gather quantizes, the tensor-parallel linear, and the serving
quantizes and decode attention, and the grouped GEMM's input checks (the high-precision
grouped experts share them) and frozen experts (``ops.grouped_frozen``: their codes held,
multiplied as they are), and the frozen weights' buffers DDP must leave out
(``frozen_buffer_names``). Outside ``computectx.formats`` nothing imports a deeper module
(``tests/test_layering.py`` keeps it so), so fp8's rooms can move without touching the
packages above; a name added here is a promise to them.
"""

from __future__ import annotations

from computectx.formats.backend import check_backend, default_backend, parse_backend, uses_kernels
from computectx.formats.convert import check_convertible
from computectx.formats.linear.fp4_frozen import FROZEN_FP4_BUFFERS
from computectx.formats.linear.fp4_frozen_experts import freeze_fp4_experts
from computectx.formats.linear.fp4_serving import (
    ActivationAmax,
    ServeMode,
    check_input_amax,
    check_weight,
    dequantized,
)
from computectx.formats.linear.fp4_streams import shared_streams
from computectx.formats.linear.frozen_ddp import (
    adopt_frozen_written,
    frozen_buffer_names,
    frozen_recipes,
)
from computectx.formats.linear.function import fp8_linear, set_dtensor_linear
from computectx.formats.linear.plan import Fp8LinearPlan
from computectx.formats.numerics.fp4 import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Mxfp4Operand,
    Nvfp4Operand,
    global_encode_scale,
)
from computectx.formats.numerics.fp4_gemm import Fp4Operand
from computectx.formats.numerics.kv_quant import dequantize_kv, quantize_kv, static_kv_steps
from computectx.formats.numerics.layouts import step_rule_of
from computectx.formats.numerics.ledger import (
    TALLY_ELEMENTS,
    ledger_history,
    ledger_nonfinite,
    ledger_saturated,
    ledger_step,
)
from computectx.formats.numerics.tensorwise import step_from_amax
from computectx.formats.ops.attention import (
    KERNEL_HEAD_DIMS,
    check_kernel_head_dim,
    decode_attention,
)
from computectx.formats.ops.blockwise import cublas_recipes, quantize_blocks
from computectx.formats.ops.fp4_backend import fp4_cublas_recipes, select_fp4_backend
from computectx.formats.ops.grouped import check_grouped, checked_bounds
from computectx.formats.ops.grouped_frozen import freeze_experts, frozen_experts_mm, held_experts
from computectx.formats.ops.tensorwise import quantize_with_step
from computectx.formats.policy import refuse_sharded
from computectx.formats.scaling.load import check_layer_entries, guard_whole_loads
from computectx.formats.scaling.operand import AmaxReduce, OperandScaling
from computectx.formats.scaling.saved import ROLES, Role

__all__ = [
    "FROZEN_FP4_BUFFERS",
    "KERNEL_HEAD_DIMS",
    "MXFP4_BLOCK",
    "NVFP4_BLOCK",
    "ROLES",
    "TALLY_ELEMENTS",
    "ActivationAmax",
    "AmaxReduce",
    "Fp4Operand",
    "Fp8LinearPlan",
    "Mxfp4Operand",
    "Nvfp4Operand",
    "OperandScaling",
    "Role",
    "ServeMode",
    "adopt_frozen_written",
    "check_backend",
    "check_convertible",
    "check_grouped",
    "check_input_amax",
    "check_kernel_head_dim",
    "check_layer_entries",
    "check_weight",
    "checked_bounds",
    "cublas_recipes",
    "decode_attention",
    "default_backend",
    "dequantize_kv",
    "dequantized",
    "fp4_cublas_recipes",
    "fp8_linear",
    "freeze_experts",
    "freeze_fp4_experts",
    "frozen_buffer_names",
    "frozen_experts_mm",
    "frozen_recipes",
    "global_encode_scale",
    "guard_whole_loads",
    "held_experts",
    "ledger_history",
    "ledger_nonfinite",
    "ledger_saturated",
    "ledger_step",
    "parse_backend",
    "quantize_blocks",
    "quantize_kv",
    "quantize_with_step",
    "refuse_sharded",
    "select_fp4_backend",
    "set_dtensor_linear",
    "shared_streams",
    "static_kv_steps",
    "step_from_amax",
    "step_rule_of",
    "uses_kernels",
]
