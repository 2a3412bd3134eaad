"""fp8 training and serving: policy, scaling state, reference twins, autograd, modules.

This package reads the core (``ComputeCtx``, the recipe types in ``computectx.recipes``)
and nothing in the core reads it. Importing it changes nothing in torch: fp8 runs only in
an ``Fp8Linear`` or inside an ``fp8_autocast`` region.
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
from computectx.fp8.granular import Granularity, MxRounding
from computectx.fp8.linear import Fp8Linear
from computectx.fp8.ops import fp8_dequantize, fp8_quantize
from computectx.fp8.quantized import Fp8BlockWeight, Fp8Weight
from computectx.fp8.recompute import fp8_checkpoint_context_fn, fp8_checkpoint_policy
from computectx.fp8.region import fp8_autocast
from computectx.fp8.scaling import Fp8ScalingState
from computectx.fp8.stats import Fp8LayerStats, Fp8OperandStats, fp8_stats
from computectx.fp8.world import Fp8ScalingNotSyncedWarning
from computectx.recipes import DelayedScaling, DynamicScaling, Fp8Policy, Fp8Scheme

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FEATURE_MULTIPLE",
    "HEAD_NAMES",
    "DelayedScaling",
    "DynamicScaling",
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
    "fp8_quantize",
    "fp8_stats",
    "select_backend",
]
