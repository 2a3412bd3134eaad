"""The checkpoint formats ``export_pretrained`` writes and ``import_pretrained`` reads: their
names, the weight layouts each holds exactly, their tensor names and ``quantization_config``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, get_args

import torch

from computectx.formats import ServingWeight
from computectx.recipes import Recipe

__all__ = [
    "BLOCK",
    "EXPORT_FORMATS",
    "FORMAT_LAYOUTS",
    "SCALE_SUFFIX",
    "ExportFormat",
    "check_recipes",
    "format_arg",
    "quantization_config",
]

ExportFormat = Literal["fine-grained-fp8", "compressed-tensors"]
"""The checkpoint formats ``export_pretrained`` writes."""
EXPORT_FORMATS: Final[tuple[ExportFormat, ...]] = get_args(ExportFormat)

FORMAT_LAYOUTS: Final[dict[ExportFormat, tuple[str, ...]]] = {
    "fine-grained-fp8": ("tensor", "128x128"),
    "compressed-tensors": ("tensor", "row", "128x128"),
}
"""The ``ServingWeight`` layouts each format holds exactly."""

BLOCK: Final = 128
SCALE_SUFFIX: Final[dict[ExportFormat, str]] = {
    "fine-grained-fp8": "_scale_inv",
    "compressed-tensors": "_scale",
}
"""A weight's scale is stored under the weight's name with this suffix."""
_STRATEGY: Final[dict[str, str]] = {"tensor": "tensor", "row": "channel", "128x128": "block"}


def format_arg(format: object) -> ExportFormat:
    for f in EXPORT_FORMATS:
        if format == f:
            return f
    accepted = ", ".join(repr(f) for f in EXPORT_FORMATS)
    raise ValueError(f"unknown checkpoint format {format!r}; accepted: {accepted}")


def _formats_holding(recipe: Recipe) -> list[ExportFormat]:
    if recipe.format.forward.torch != torch.float8_e4m3fn:
        return []
    layout = {"tensor": "tensor", "row": "row", "block": "128x128"}.get(recipe.granularity)
    return [f for f in EXPORT_FORMATS if layout in FORMAT_LAYOUTS[f]]


def check_recipes(recipes: Mapping[str, Recipe], fmt: ExportFormat) -> None:
    """``ValueError`` naming the first recipe ``fmt`` cannot hold and the formats that can."""
    if not recipes:
        raise ValueError(
            "export_pretrained: the model holds no quantized layer; convert it with "
            "computectx.formats.convert_to_quantized first"
        )
    for fqn, recipe in recipes.items():
        holding = _formats_holding(recipe)
        if fmt in holding:
            continue
        why = (
            f"its forward format is {recipe.format.forward.value} and both formats store "
            f"float8_e4m3fn weights"
            if recipe.format.forward.torch != torch.float8_e4m3fn
            else f"granularity {recipe.granularity!r}"
        )
        can = ", ".join(repr(f) for f in holding) or "none of the formats written here"
        raise ValueError(
            f"format {fmt!r} cannot hold recipe {str(recipe)!r} ({fqn}: {why}); formats "
            f"that hold it exactly: {can}"
        )
    layouts = {str(recipe.granularity) for recipe in recipes.values()}
    if fmt == "compressed-tensors" and len(layouts) > 1:
        raise ValueError(
            f"format 'compressed-tensors' is written with one weight strategy for every "
            f"quantized layer; this model mixes granularities {sorted(layouts)}"
        )


def quantization_config(
    fmt: ExportFormat, weights: Mapping[str, ServingWeight], ignore: list[str]
) -> dict[str, Any]:
    if fmt == "fine-grained-fp8":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": ignore,
        }
    return _compressed_tensors_config(next(iter(weights.values())).layout, ignore)


def _compressed_tensors_config(layout: str, ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors' ``quantization_config`` for weights of ``layout``, as its
    ``ModelCompressor.update_config`` writes one."""
    try:
        import compressed_tensors  # type: ignore[import-untyped]
        from compressed_tensors.config import CompressionFormat  # type: ignore[import-untyped]
        from compressed_tensors.quantization import (  # type: ignore[import-untyped]
            QuantizationArgs,
            QuantizationConfig,
            QuantizationScheme,
            QuantizationStatus,
        )
    except ImportError as e:
        raise ImportError(
            "format 'compressed-tensors' builds its config with the compressed-tensors "
            "package: pip install compressed-tensors"
        ) from e
    strategy = _STRATEGY[layout]
    block = layout == "128x128"
    weights = QuantizationArgs(
        num_bits=8,
        type="float",
        strategy=strategy,
        symmetric=True,
        dynamic=False,
        block_structure=[BLOCK, BLOCK] if block else None,
    )
    activations = QuantizationArgs(
        num_bits=8,
        type="float",
        strategy="group" if block else "token",
        symmetric=True,
        dynamic=True,
        group_size=BLOCK if block else None,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=CompressionFormat.float_quantized.value,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **config.model_dump(exclude={"quant_method"}),
    }
