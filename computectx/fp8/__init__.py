"""fp8 training and serving: the public face of the package.

This package reads the core (``ComputeCtx``, the recipe types in ``computectx.recipes``)
and nothing in the core reads it. Importing it changes nothing in torch: fp8 runs only in
an ``Fp8Linear`` or inside an ``fp8_autocast`` region.

Inside, the rooms are split by kind (docs/design.md, "The fp8 house"): ``numerics`` (the
pure-torch twins and the granularity vocabulary), ``ops`` (the operator registry, the checked
entry points, cuBLAS and Triton), ``state`` (scaling state and its saved forms), ``linear``
(the autograd functions and ``Fp8Linear``) and ``serving`` (KV quantization, decode
attention); ``policy``, ``backend``, ``convert``, ``convert_report`` and ``stats`` sit at the
top, and ``seam`` is the one door for the packages built on fp8. The module paths of
computectx 0.1.0 still import, with a ``DeprecationWarning`` naming the new one.
"""

from computectx._moved import redirect
from computectx.fp8.backend import Fp8Backend, select_backend
from computectx.fp8.convert import (
    DEFAULT_MIN_FEATURES,
    FEATURE_MULTIPLE,
    HEAD_NAMES,
    Fp8ConversionReport,
    Fp8Converter,
    SkippedLinear,
    convert_to_fp8,
)
from computectx.fp8.convert_experts import ExpertsConverter, register_experts_converter
from computectx.fp8.linear.autocast import fp8_autocast
from computectx.fp8.linear.grouped import ExpertsFp8, fp8_grouped_mm
from computectx.fp8.linear.module import Fp8Linear
from computectx.fp8.linear.recompute import fp8_checkpoint_context_fn, fp8_checkpoint_policy
from computectx.fp8.linear.unsynced import Fp8ScalingNotSyncedWarning
from computectx.fp8.linear.weights import Fp8BlockWeight, Fp8Weight
from computectx.fp8.numerics.layouts import Granularity, MxRounding
from computectx.fp8.ops.quantize import fp8_dequantize, fp8_quantize
from computectx.fp8.state.layer import Fp8ScalingState
from computectx.fp8.stats import Fp8LayerStats, Fp8OperandStats, fp8_stats
from computectx.recipes import DelayedScaling, DynamicScaling, Fp8Policy, Fp8Scheme

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FEATURE_MULTIPLE",
    "HEAD_NAMES",
    "DelayedScaling",
    "DynamicScaling",
    "ExpertsConverter",
    "ExpertsFp8",
    "Fp8Backend",
    "Fp8BlockWeight",
    "Fp8ConversionReport",
    "Fp8Converter",
    "Fp8LayerStats",
    "Fp8Linear",
    "Fp8OperandStats",
    "Fp8Policy",
    "Fp8ScalingNotSyncedWarning",
    "Fp8ScalingState",
    "Fp8Scheme",
    "Fp8Weight",
    "Granularity",
    "MxRounding",
    "SkippedLinear",
    "convert_to_fp8",
    "fp8_autocast",
    "fp8_checkpoint_context_fn",
    "fp8_checkpoint_policy",
    "fp8_dequantize",
    "fp8_grouped_mm",
    "fp8_quantize",
    "fp8_stats",
    "register_experts_converter",
    "select_backend",
]

_FP8 = "computectx.fp8."
redirect(
    "computectx.fp8",
    {
        old: tuple("computectx.dtypes" if new == "dtypes" else _FP8 + new for new in news)
        for old, news in {
            "reference": ("numerics.tensorwise",),
            "ledger": ("numerics.ledger",),
            "inline": ("numerics.inline",),
            "granular": ("numerics.layouts", "numerics.blockwise"),
            "operand": ("state.operand",),
            "scaling": ("state.layer", "state.operand", "state.saved"),
            "saved_state": ("state.saved",),
            "state_load": ("state.load",),
            "recompute": ("linear.recompute",),
            "region": ("linear.autocast",),
            "quantized": ("linear.weights", "dtypes"),
            "world": ("linear.unsynced",),
            "kv_quant": ("numerics.kv_quant",),
            "decode_attention": ("serving.decode_attention", "numerics.attention", "dtypes"),
            "custom_ops": (
                "ops.registry",
                "numerics.ledger",
                "ops.triton",
                "ops.cublas",
                "ops.ledger_quantize",
            ),
            "block_gemm_ops": ("ops.cublas",),
            "granular_ops": ("ops.block_quantize", "numerics.layouts"),
            "block_gemm": ("ops.gemm", "numerics.layouts", "numerics.blockwise_gemm", "dtypes"),
            "granular_linear": ("linear.blockwise", "numerics.layouts"),
            "autograd": ("linear.function", "linear.plan", "linear.tensorwise", "dtypes"),
            "modules": ("convert", "linear.module"),
        }.items()
    },
    {
        ("block_gemm", "GemmGranularity"): "BlockGranularity",
        ("granular_ops", "quantize"): "quantize_blocks",
        ("granular_ops", "dequantize"): "dequantize_blocks",
        ("custom_ops", "quantize_delayed"): "fp8_quantize_delayed",
        ("custom_ops", "quantize_dynamic"): "fp8_quantize_dynamic",
        ("custom_ops", "quantize_with_step"): "fp8_quantize_with_step",
        ("custom_ops", "scaled_mm"): "fp8_scaled_mm",
        ("custom_ops", "dequantize"): "fp8_dequantize",
        ("autograd", "_Fp8LinearFunction"): "TensorwiseLinearFunction",
        ("decode_attention", "KV_CODE_DTYPES"): "FP8_DTYPES",
        ("decode_attention", "KV_VALUE_DTYPES"): "FLOAT_DTYPES",
        ("decode_attention", "DECODE_QUERY_DTYPES"): "FLOAT_DTYPES",
        ("block_gemm", "OUT_DTYPES"): "FLOAT_DTYPES",
        ("autograd", "ACTIVATION_DTYPES"): "FLOAT_DTYPES",
        ("granular_linear", "granular_linear"): "blockwise_linear",
    },
)
