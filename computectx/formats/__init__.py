"""Scaled low-precision formats for training and serving: the public face of the package.

Today's formats are fp8 (per-tensor, row-wise, 1x128/128x128 blocks, MXFP8); the 4-bit formats
join here. The package reads the core (``ComputeCtx``, the recipe types in
``computectx.recipes``) and nothing in the core reads it. Importing it changes nothing in torch:
a format runs only in a ``QuantizedLinear`` or ``QuantizedExperts``, or inside an ``autocast``
region.

Inside (docs/design.md, "The formats house"): ``ops/`` holds one module per operator family
(``tensorwise``, ``blockwise``, ``grouped``, ``attention``: registrations, fakes, checks and
launchers), ``numerics/`` the pure-torch twin of each family and the granularity vocabulary,
``scaling/`` the scaling state and its saved forms, ``linear/`` the router, the autograd
functions and ``QuantizedLinear``; ``policy``, ``backend``, ``convert``, ``convert_report``
and ``stats`` sit at the top, and ``seam`` is the one door for the packages built on it.
"""

from computectx.formats.backend import Backend, select_backend
from computectx.formats.convert import (
    DEFAULT_MIN_FEATURES,
    FEATURE_MULTIPLE,
    HEAD_NAMES,
    ConversionReport,
    Converter,
    SkippedLinear,
    convert_to_quantized,
)
from computectx.formats.convert_experts import ExpertsConverter, register_experts_converter
from computectx.formats.exchange import (
    LoadMode,
    load_serving_weights,
    serving_recipes,
    serving_weights,
)
from computectx.formats.linear.autocast import autocast
from computectx.formats.linear.fp4 import Fp4Linear
from computectx.formats.linear.fp4_calibrate import calibrate_fp4_activations
from computectx.formats.linear.fp4_experts import Fp4Experts, experts_draw_frame
from computectx.formats.linear.fp4_freeze import freeze_fp4_for_serving
from computectx.formats.linear.fp4_frozen import FrozenFp4Linear
from computectx.formats.linear.fp4_frozen_experts import FrozenFp4Experts
from computectx.formats.linear.fp4_streams import assign_fp4_streams
from computectx.formats.linear.frozen_ddp import exclude_frozen_from_ddp
from computectx.formats.linear.module import QuantizedLinear
from computectx.formats.linear.recompute import checkpoint_context_fn, checkpoint_policy
from computectx.formats.linear.unsynced import ScalingNotSyncedWarning
from computectx.formats.linear.weights import QuantizedBlockWeight, QuantizedWeight
from computectx.formats.numerics.layouts import Granularity, MxRounding
from computectx.formats.ops.blockwise import dequantize_tensor, quantize_tensor
from computectx.formats.ops.grouped import QuantizedExperts, quantized_grouped_mm
from computectx.formats.scaling.layer import ScalingState
from computectx.formats.serving import ServingWeight, recipe_layout
from computectx.formats.stats import LayerStats, OperandStats, scaling_stats
from computectx.fp4_recipe import Fp4Recipe
from computectx.recipes import DelayedScaling, DynamicScaling, Fp8Scheme, Recipe

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FEATURE_MULTIPLE",
    "HEAD_NAMES",
    "Backend",
    "ConversionReport",
    "Converter",
    "DelayedScaling",
    "DynamicScaling",
    "ExpertsConverter",
    "Fp4Experts",
    "Fp4Linear",
    "Fp4Recipe",
    "Fp8Scheme",
    "FrozenFp4Experts",
    "FrozenFp4Linear",
    "Granularity",
    "LayerStats",
    "LoadMode",
    "MxRounding",
    "OperandStats",
    "QuantizedBlockWeight",
    "QuantizedExperts",
    "QuantizedLinear",
    "QuantizedWeight",
    "Recipe",
    "ScalingNotSyncedWarning",
    "ScalingState",
    "ServingWeight",
    "SkippedLinear",
    "assign_fp4_streams",
    "autocast",
    "calibrate_fp4_activations",
    "checkpoint_context_fn",
    "checkpoint_policy",
    "convert_to_quantized",
    "dequantize_tensor",
    "exclude_frozen_from_ddp",
    "experts_draw_frame",
    "freeze_fp4_for_serving",
    "load_serving_weights",
    "quantize_tensor",
    "quantized_grouped_mm",
    "recipe_layout",
    "register_experts_converter",
    "scaling_stats",
    "select_backend",
    "serving_recipes",
    "serving_weights",
]


# The 0.1.0 names, plain aliases of the names above until 0.3.0 (CHANGELOG.md; not in __all__).
ExpertsFp8 = QuantizedExperts
Fp8Backend = Backend
Fp8BlockWeight = QuantizedBlockWeight
Fp8ConversionReport = ConversionReport
Fp8Converter = Converter
Fp8LayerStats = LayerStats
Fp8Linear = QuantizedLinear
Fp8OperandStats = OperandStats
Fp8Policy = Recipe
Fp8ScalingNotSyncedWarning = ScalingNotSyncedWarning
Fp8ScalingState = ScalingState
Fp8Weight = QuantizedWeight
convert_to_fp8 = convert_to_quantized
fp8_autocast = autocast
fp8_checkpoint_context_fn = checkpoint_context_fn
fp8_checkpoint_policy = checkpoint_policy
fp8_dequantize = dequantize_tensor
fp8_grouped_mm = quantized_grouped_mm
fp8_quantize = quantize_tensor
fp8_stats = scaling_stats
