"""The paths and names of computectx 0.1.0 still import (docs/migrating.md, "Module paths of
0.1.0").

The public names of the packages import from where they did, silently. A module path that moved
warns with a ``DeprecationWarning`` naming the new path, and every name its ``__all__`` listed
resolves to the very object the new module holds. The two tables are the 0.1.0 release's own
``__all__`` lists, read off that commit: they are the contract, not a computed result.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

import pytest

PUBLIC_0_1_0: dict[str, tuple[str, ...]] = {
    "computectx": (
        "ComputeCtx",
        "DType",
        "Fp8Format",
        "KvFp8",
        "PromotionError",
        "Residency",
        "__version__",
        "available_bytes",
        "cast_if",
        "dtype_of",
        "promote",
        "promoted",
    ),
    "computectx.distributed": (
        "DataParallelGradAccumulator",
        "Fp8AmaxSync",
        "Fp8GatherFallbackWarning",
        "Parallel",
        "ShardedParams",
        "Strategy",
        "WeightGatheredAsFp8",
        "check_same_policy",
        "data_parallel_group",
        "dtensor_fp8_linear",
        "enable_fp8_all_gather",
        "fp8_buffer_names",
        "fsdp_mixed_precision",
        "gathers_as_fp8",
        "optimizer_state_dict",
        "parallelize",
        "rescale_grad_ledger",
        "set_optimizer_state_dict",
        "sync_fp8_scaling",
    ),
    "computectx.fp8": (
        "DEFAULT_MIN_FEATURES",
        "DelayedScaling",
        "DynamicScaling",
        "FEATURE_MULTIPLE",
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
        "HEAD_NAMES",
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
    ),
    "computectx.memory": (
        "LowPrecGradAccumulator",
        "MemoryReport",
        "OffloadedOptimizer",
        "load_weights",
        "memory_report",
        "save_weights",
    ),
    "computectx.nn": (
        "Attention",
        "BYTE_VOCAB",
        "ByteLM",
        "DecodeKernelFallbackWarning",
        "DecodeStep",
        "DecoderBlock",
        "Float32MatmulPrecisionWarning",
        "Gemm",
        "GemmPath",
        "KVCache",
        "LMConfig",
        "MLP",
        "RMSNorm",
        "RotaryEmbedding",
        "apply_fp8_policy",
        "apply_rope",
        "calibrate_kv",
        "decode_bytes",
        "decode_logits",
        "encode_bytes",
        "forced_gemm_path",
        "generate",
        "kv_bytes_per_token",
        "next_token",
        "rms_norm",
        "rope_tables",
        "softmax",
    ),
}

MODULES_0_1_0: dict[str, tuple[str, ...]] = {
    "computectx.distributed.accumulate": (
        "DEFAULT_BUCKET_MIB",
        "DataParallelGradAccumulator",
    ),
    "computectx.distributed.amax": (
        "CurrentAmax",
        "Fp8AmaxSync",
        "LossNormalization",
        "fp8_buffer_names",
        "rescale_grad_ledger",
        "sync_fp8_scaling",
    ),
    "computectx.distributed.checkpoint": (
        "MASTER_WEIGHTS",
        "check_saved_optimizer",
        "optimizer_state_dict",
        "parameter_fqns",
        "set_optimizer_state_dict",
    ),
    "computectx.distributed.fsdp": (
        "FP8_GATHER_GRANULARITIES",
        "Fp8GatherFallbackWarning",
        "WeightGatheredAsFp8",
        "blocks_align",
        "enable_fp8_all_gather",
        "gathers_as_fp8",
        "parameter_holders",
        "sharded_weight_of",
    ),
    "computectx.fp8.autograd": (
        "ACTIVATION_DTYPES",
        "DTensorLinear",
        "Fp8LinearPlan",
        "autocast_dtype",
        "fp8_linear",
        "gemm_dtype_for",
        "is_dtensor",
        "set_dtensor_linear",
    ),
    "computectx.fp8.block_gemm": (
        "GemmGranularity",
        "NARROW_ACCUMULATION",
        "OUT_DTYPES",
        "PAIRS",
        "block_scaled_mm",
        "block_width",
        "check_args",
        "reference_scaled_mm",
        "row_steps",
        "scaled_mm_error_bound",
    ),
    "computectx.fp8.block_gemm_ops": (
        "RECIPES",
        "cublas_recipes",
        "cublas_scales",
        "recipe_of",
        "run",
    ),
    "computectx.fp8.custom_ops": (
        "CUBLAS_MULTIPLE",
        "TALLY_ELEMENTS",
        "TALLY_LEN",
        "TALLY_SEEDED",
        "count",
        "cublas_bias",
        "cublas_gemm_dtype",
        "cublas_operand",
        "cublas_result",
        "delayed_call",
        "dequantize",
        "quantize_delayed",
        "quantize_delayed_at",
        "quantize_dynamic",
        "quantize_dynamic_with",
        "quantize_with_step",
        "round_up",
        "scaled_mm",
        "tally_new",
        "triton_imports",
        "uses_kernels",
    ),
    "computectx.fp8.decode_attention": (
        "DECODE_QUERY_DTYPES",
        "KERNEL_BLOCK_T",
        "KERNEL_HEAD_DIMS",
        "KV_CODE_DTYPES",
        "KV_VALUE_DTYPES",
        "check_decode_attention",
        "check_kernel_head_dim",
        "decode_attention",
        "decode_attention_error_bound",
        "decode_attention_reference",
        "step_layout",
    ),
    "computectx.fp8.granular": (
        "BlockLayout",
        "E8M0",
        "GRANULARITIES",
        "Granularity",
        "MX_BLOCK",
        "MxRounding",
        "StepRule",
        "TILE",
        "block_amax",
        "block_shape",
        "block_steps",
        "check_granularity_widths",
        "check_scale",
        "dequantize",
        "e8m0_of_steps",
        "expand_steps",
        "layout_of",
        "power_of_two_steps",
        "quantize",
        "quantize_with_steps",
        "saturated_count",
        "saturation_threshold",
        "scale_grid",
        "steps_of_scale",
    ),
    "computectx.fp8.granular_linear": (
        "OPERAND_GRANULARITY",
        "granular_linear",
        "step_rule_of",
    ),
    "computectx.fp8.granular_ops": (
        "dequantize",
        "granularity_arg",
        "is_block_scale",
        "quantize",
        "step_rule",
    ),
    "computectx.fp8.inline": (
        "OLD_SPELLING",
        "QUANTIZE_IMPLS",
        "QuantizeImpl",
        "parse_quantize",
        "quantize_delayed",
        "quantize_dynamic",
    ),
    "computectx.fp8.kv_quant": (
        "dequantize_kv",
        "kv_step",
        "quantize_kv",
        "static_kv_steps",
        "step_layout",
    ),
    "computectx.fp8.ledger": (
        "LEDGER_NONFINITE",
        "LEDGER_SATURATED",
        "LEDGER_SHAPE",
        "LEDGER_STEP",
        "LEDGER_TAIL",
        "LedgerValues",
        "is_ledger",
        "ledger_from_parts",
        "ledger_history",
        "ledger_history_len",
        "ledger_new",
        "ledger_nonfinite",
        "ledger_saturated",
        "ledger_slot",
        "ledger_step",
        "ledger_tail",
        "ledger_with_history",
        "read_ledger",
    ),
    "computectx.fp8.linear": (
        "FEATURE_MULTIPLE",
        "Fp8Linear",
        "SCALING_PREFIX",
        "check_fp8_widths",
        "check_granularity_widths",
    ),
    "computectx.fp8.modules": (
        "DEFAULT_MIN_FEATURES",
        "FEATURE_MULTIPLE",
        "Fp8ConversionReport",
        "Fp8Linear",
        "SkippedLinear",
        "convert_to_fp8",
    ),
    "computectx.fp8.operand": (
        "AmaxReduce",
        "OperandScaling",
        "Store",
        "held_tensor",
        "replicated_value",
    ),
    "computectx.fp8.ops": (
        "Fp8Backend",
        "QUANTIZABLE_DTYPES",
        "fp8_dequantize",
        "fp8_quantize",
        "ledger_new",
        "quantize_delayed",
        "quantize_dynamic",
        "quantize_granular",
        "quantize_operand",
        "quantize_with_step",
        "scaled_mm",
        "seed_ledger",
        "select_backend",
    ),
    "computectx.fp8.quantized": (
        "FP8_DTYPES",
        "Fp8BlockWeight",
        "Fp8Weight",
    ),
    "computectx.fp8.recompute": (
        "CheckpointSite",
        "StepsUsed",
        "checkpoint_site",
        "delayed_quantize_in_compiled_checkpoint",
        "fp8_checkpoint_context_fn",
        "fp8_checkpoint_policy",
        "in_reentrant_checkpoint_forward",
        "live_regions",
        "selective_modes_set_aside",
        "warn_nothing_to_replay",
    ),
    "computectx.fp8.reference": (
        "UNIT_ROUNDOFF",
        "accumulation_gamma",
        "advance_ledger",
        "amax",
        "dequantize",
        "quantize_delayed",
        "quantize_dynamic",
        "quantize_with_step",
        "saturated_count",
        "scaled_mm",
        "scaled_mm_error_bound",
        "seed_ledger",
        "step_from_amax",
    ),
    "computectx.fp8.region": (
        "fp8_autocast",
        "region_fp8_enabled",
        "region_scaling_state",
    ),
    "computectx.fp8.saved_state": (
        "CAST_TAG",
        "META_LEN",
        "META_WORLD",
        "ROLES",
        "Role",
        "STATE_CODE",
        "STATE_VERSION",
        "SavedScaling",
        "check_same_recipe",
        "history_len_of",
        "meta_new",
        "read_meta",
        "read_saved_dict",
        "read_saved_tensors",
        "resize_ledger",
        "same_recipe",
        "tensor_names",
    ),
    "computectx.fp8.scaling": (
        "AmaxReduce",
        "Fp8ScalingState",
        "OperandScaling",
        "ROLES",
        "Role",
        "STATE_VERSION",
        "Store",
        "history_len_of",
    ),
    "computectx.fp8.state_load": (
        "LEGACY_KEY",
        "ScalingLoad",
        "check_held_dtypes",
        "check_state_dtypes",
        "guard_whole_loads",
        "plan_scaling_load",
    ),
    "computectx.fp8.world": (
        "Fp8ScalingNotSyncedWarning",
        "warn_if_unsynced",
    ),
    "computectx.nn.linears": (
        "apply_fp8_policy",
        "param_dtype",
    ),
    "computectx.nn.ops": (
        "apply_rope",
        "rms_norm",
        "rope_tables",
        "softmax",
    ),
}

# Names that moved into the core's dtype sets, or were renamed with their module.
RENAMED = {
    "QUANTIZABLE_DTYPES": "FLOAT_DTYPES",
    "OUT_DTYPES": "FLOAT_DTYPES",
    "ACTIVATION_DTYPES": "FLOAT_DTYPES",
    "KV_VALUE_DTYPES": "FLOAT_DTYPES",
    "DECODE_QUERY_DTYPES": "FLOAT_DTYPES",
    "KV_CODE_DTYPES": "FP8_DTYPES",
    "GemmGranularity": "BlockGranularity",
}

# Names renamed with their module (docs/migrating.md, "renamed names").
MODULE_RENAMED = {
    ("computectx.fp8.custom_ops", "quantize_delayed"): "fp8_quantize_delayed",
    ("computectx.fp8.custom_ops", "quantize_dynamic"): "fp8_quantize_dynamic",
    ("computectx.fp8.custom_ops", "quantize_with_step"): "fp8_quantize_with_step",
    ("computectx.fp8.custom_ops", "scaled_mm"): "fp8_scaled_mm",
    ("computectx.fp8.custom_ops", "dequantize"): "fp8_dequantize",
    ("computectx.fp8.granular_ops", "quantize"): "quantize_blocks",
    ("computectx.fp8.granular_ops", "dequantize"): "dequantize_blocks",
    ("computectx.fp8.granular_linear", "granular_linear"): "blockwise_linear",
}

# 0.1.0 modules whose name is now a package (their names are read off the package).
BECAME_PACKAGES = {"computectx.fp8.linear", "computectx.fp8.ops"}


@pytest.mark.parametrize("package", sorted(PUBLIC_0_1_0))
def test_every_public_name_of_0_1_0_imports_from_its_package_without_a_warning(
    package: str,
) -> None:
    module = importlib.import_module(package)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        missing = [n for n in PUBLIC_0_1_0[package] if not hasattr(module, n)]
    assert missing == []
    assert set(PUBLIC_0_1_0[package]) <= set(module.__all__)


def _fresh_import(name: str) -> types.ModuleType:
    for key in [k for k in sys.modules if k == name]:
        del sys.modules[key]
    return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(set(MODULES_0_1_0) - BECAME_PACKAGES))
def test_a_moved_module_path_warns_naming_the_new_one_and_serves_its_names(old: str) -> None:
    with pytest.warns(DeprecationWarning, match=r"moved: import from computectx\."):
        module = _fresh_import(old)
    served = {name: getattr(module, name) for name in MODULES_0_1_0[old]}
    # Each name is the object its new home holds, not a copy.
    for name, value in served.items():
        homes = [importlib.import_module(t) for t in getattr(module, "_moved_targets", ())] + [
            importlib.import_module("computectx.dtypes")
        ]
        wanted = MODULE_RENAMED.get((old, name), RENAMED.get(name, name))
        assert any(getattr(h, wanted, None) is value for h in homes), (old, name)


NEW_HOMES = {
    "computectx.fp8.linear": ("computectx.fp8.linear.module",),
    "computectx.fp8.ops": (
        "computectx.fp8.ops.quantize",
        "computectx.fp8.ops.gemm",
        "computectx.dtypes",
    ),
}


@pytest.mark.parametrize("old", sorted(BECAME_PACKAGES))
def test_a_module_that_became_a_package_serves_its_old_names_with_a_warning(old: str) -> None:
    package = importlib.import_module(old)
    homes = [importlib.import_module(t) for t in NEW_HOMES[old]]
    for name in MODULES_0_1_0[old]:
        with pytest.warns(DeprecationWarning, match="became a package"):
            value = getattr(package, name)
        wanted = RENAMED.get(name, name)
        assert any(getattr(h, wanted, None) is value for h in homes), (old, name)


def test_an_unknown_name_of_a_moved_module_is_an_attribute_error_naming_the_new_homes() -> None:
    with pytest.warns(DeprecationWarning, match="block_gemm moved"):
        module = _fresh_import("computectx.fp8.block_gemm")
    with pytest.raises(AttributeError, match=r"computectx\.fp8\.ops\.gemm.*no 'nonsense'"):
        module.nonsense  # noqa: B018


def test_the_new_paths_import_without_a_warning() -> None:
    import subprocess

    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import computectx.fp8, computectx.fp8.seam, computectx.nn, computectx.distributed\n"
        "import computectx.fp8.linear.module, computectx.fp8.ops.gemm, computectx.cli\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
