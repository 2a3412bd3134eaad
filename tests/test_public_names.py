"""The public names of computectx 0.1.0 still import from their package faces (CHANGELOG.md,
docs/migrating.md): each old name is there, silently, as itself or as a plain alias of its new
name; ``computectx.fp8`` is now ``computectx.formats``. The table is the 0.1.0 release's own
``__all__`` lists, read off that commit (it was tests/test_moved_paths.py's): the contract, not a
computed result. The renamed ones are aliases and so not in ``__all__``; they go in 0.3.0.
"""

from __future__ import annotations

import importlib
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


FACE = {"computectx.fp8": "computectx.formats"}  # the package renamed in 0.2.0


@pytest.mark.parametrize("package", sorted(PUBLIC_0_1_0))
def test_every_public_name_of_0_1_0_imports_from_its_package_without_a_warning(
    package: str,
) -> None:
    module = importlib.import_module(FACE.get(package, package))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing = [n for n in PUBLIC_0_1_0[package] if not hasattr(module, n)]
    assert missing == []


def test_an_old_name_is_the_new_object() -> None:
    from computectx import formats

    assert formats.Fp8Linear is formats.QuantizedLinear
    assert formats.convert_to_fp8 is formats.convert_to_quantized
