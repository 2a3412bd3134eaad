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
from computectx.fp8.linear.module import Fp8Linear
from computectx.fp8.linear.recompute import fp8_checkpoint_context_fn, fp8_checkpoint_policy
from computectx.fp8.linear.unsynced import Fp8ScalingNotSyncedWarning
from computectx.fp8.linear.weights import Fp8BlockWeight, Fp8Weight
from computectx.fp8.numerics.layouts import Granularity, MxRounding
from computectx.fp8.ops.blockwise import fp8_dequantize, fp8_quantize
from computectx.fp8.ops.grouped import ExpertsFp8, fp8_grouped_mm
from computectx.fp8.scaling.layer import Fp8ScalingState
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
