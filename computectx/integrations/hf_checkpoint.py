"""A converted transformers model as a Hugging Face checkpoint that serving stacks load.

``export_pretrained(model, directory, format=...)`` writes a model that ``convert_to_quantized``
converted as a model directory in one of two published fp8 formats, with the codes and steps
the model serves with (``computectx.formats.serving_weights``: no requantization):

- ``"fine-grained-fp8"``: transformers' ``FineGrainedFP8Config`` layout (DeepSeek-V3's), read by
  transformers and vLLM: each quantized ``{module}.weight`` in ``float8_e4m3fn`` with
  ``{module}.weight_scale_inv``, float32, one per 128x128 block (``ceil(N/128), ceil(K/128)``),
  and ``quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "modules_to_not_convert": [...]}``.
- ``"compressed-tensors"``: llm-compressor's ``float-quantized`` format, read by vLLM and by
  the ``compressed_tensors`` package: ``{module}.weight`` in ``float8_e4m3fn`` with
  ``{module}.weight_scale`` float32, shaped by the strategy (``tensor`` ``(1,)``, ``channel``
  ``(N, 1)``, ``block`` ``(ceil(N/128), ceil(K/128))``), the ``quantization_config`` built with
  ``compressed_tensors``' own classes: one group targeting ``Linear``, dynamic fp8
  activations (per token; per group of 128 for blocks), an ``ignore`` list.

Both scales are dequantize multipliers (``weight ≈ code * scale``), as ``ServingWeight``'s
steps are. Which recipe each format holds, exactly:

============================  ======================  ======================
recipe (granularity)          ``fine-grained-fp8``    ``compressed-tensors``
============================  ======================  ======================
``tensor`` (e4m3 forward)     yes (the step repeated  yes (``tensor``)
                              over every block)
``row``                       refused                 yes (``channel``)
``block``                     yes                     yes (``block``)
``mx``, e5m2 forward          refused                 refused
============================  ======================  ======================

Everything else is written as the model holds it (embeddings, norms, the head, routers, the
linears and experts left unconverted, which the ``modules_to_not_convert`` / ``ignore`` list
names); no scaling state (``fp8_*``). Tensors carry transformers' on-disk names: the model's
own reverse weight conversion (``save_pretrained``'s) lays fused experts out per expert
(``mlp.experts.{e}.gate_proj.weight``, ...), and each scale is its weight's name with the
format's suffix, so reading back is the straight inverse. A tied head is written once, as
``save_pretrained`` writes it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from computectx.formats import QuantizedLinear, ServingWeight, serving_recipes, serving_weights
from computectx.integrations.transformers_moe import TransformersExperts
from computectx.recipes import Recipe

__all__ = ["EXPORT_FORMATS", "FORMAT_LAYOUTS", "ExportFormat", "export_pretrained"]

ExportFormat = Literal["fine-grained-fp8", "compressed-tensors"]
"""The checkpoint formats ``export_pretrained`` writes."""
EXPORT_FORMATS: Final[tuple[ExportFormat, ...]] = get_args(ExportFormat)

FORMAT_LAYOUTS: Final[dict[ExportFormat, tuple[str, ...]]] = {
    "fine-grained-fp8": ("tensor", "128x128"),
    "compressed-tensors": ("tensor", "row", "128x128"),
}
"""The ``ServingWeight`` layouts each format holds exactly."""

_BLOCK: Final = 128
_SCALE_SUFFIX: Final[dict[ExportFormat, str]] = {
    "fine-grained-fp8": "_scale_inv",
    "compressed-tensors": "_scale",
}
_STRATEGY: Final[dict[str, str]] = {"tensor": "tensor", "row": "channel", "128x128": "block"}
_SHARD_BYTES: Final = 5 * 2**30
_TEMP_SUFFIX: Final = ".computectx-tmp"


def export_pretrained(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    format: ExportFormat,
    overwrite: bool = False,
    max_shard_bytes: int = _SHARD_BYTES,
) -> Path:
    """Write ``model`` (a transformers model converted by ``convert_to_quantized``) to
    ``directory`` in ``format`` (module docstring); return the directory.

    Everything is checked and laid out in memory before anything is written; then the files
    go to a new folder beside ``directory``, are fsynced, and the folder is renamed into
    place, so a crash leaves the old directory or the new one. ``ValueError`` (nothing
    written) for: an unknown format; a recipe the format cannot hold (naming the recipe, the
    layer and the formats that can); an existing non-empty ``directory`` without
    ``overwrite=True``; a quantized weight tied to another; experts whose layout the
    model's reverse conversion splits inside a 128x128 block. ``TypeError`` for a model
    that is not a transformers ``PreTrainedModel``. Safetensors files above
    ``max_shard_bytes`` are split in shards with an index, as ``save_pretrained`` does.
    """
    fmt = _format_arg(format)
    target = _target_arg(directory, overwrite)
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"export_pretrained writes a transformers PreTrainedModel (it reads model.config "
            f"and the model's weight conversions), got {type(model).__name__}"
        )
    recipes = serving_recipes(model)
    _check_recipes(recipes, fmt)
    weights = serving_weights(model)
    tensors = _disk_tensors(model, weights, fmt)
    ignore = _not_converted(model, set(weights))
    config = _config(model)
    config["quantization_config"] = _quantization_config(fmt, weights, ignore)
    files = _files(tensors, config, max_shard_bytes)
    _write_directory(target, files, overwrite)
    return target


# ----- checks -------------------------------------------------------------------------------


def _format_arg(format: object) -> ExportFormat:
    for f in EXPORT_FORMATS:
        if format == f:
            return f
    accepted = ", ".join(repr(f) for f in EXPORT_FORMATS)
    raise ValueError(f"unknown checkpoint format {format!r}; accepted: {accepted}")


def _target_arg(directory: object, overwrite: bool) -> Path:
    if not isinstance(directory, (str, os.PathLike)) or os.fspath(directory) in ("", b""):
        raise TypeError(f"export_pretrained takes a directory path, got {directory!r}")
    target = Path(os.fsdecode(directory))
    if target.exists() and not target.is_dir():
        raise ValueError(f"cannot export to {str(target)!r}: it exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(
            f"cannot export to {str(target)!r}: the directory exists and is not empty; pass "
            f"overwrite=True to replace it"
        )
    if not target.absolute().parent.is_dir():
        raise ValueError(f"cannot export to {str(target)!r}: its parent folder does not exist")
    return target


def _formats_holding(recipe: Recipe) -> list[ExportFormat]:
    if recipe.format.forward.torch != torch.float8_e4m3fn:
        return []
    layout = {"tensor": "tensor", "row": "row", "block": "128x128"}.get(recipe.granularity)
    return [f for f in EXPORT_FORMATS if layout in FORMAT_LAYOUTS[f]]


def _check_recipes(recipes: Mapping[str, Recipe], fmt: ExportFormat) -> None:
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


# ----- tensors ------------------------------------------------------------------------------


def _disk_tensors(
    model: PreTrainedModel, weights: Mapping[str, ServingWeight], fmt: ExportFormat
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by its on-disk name: the high-precision state, the
    codes in place of the quantized weights and their scales."""
    from transformers.core_model_loading import revert_weight_conversion

    state = _high_precision_state(model, weights)
    for name, w in weights.items():
        held = state.get(name)
        if held is not None and tuple(held.shape) != tuple(w.codes.shape):
            raise ValueError(
                f"{name}: the model holds it as {tuple(held.shape)} but multiplies it as "
                f"{tuple(w.codes.shape)} (a transposed experts layout); exporting it is not "
                f"supported yet"
            )
        state[name] = w.codes
    out = {k: t.contiguous() for k, t in revert_weight_conversion(model, state).items()}
    # Each weight's steps with one row per code row go through the same conversion (per
    # layout), so they reach the names its codes reach, split or stacked as the rows are.
    for layout in sorted({w.layout for w in weights.values()}):
        by_row = {k: _steps_by_row(w) for k, w in weights.items() if w.layout == layout}
        for name, rows in revert_weight_conversion(model, by_row).items():
            out[name + _SCALE_SUFFIX[fmt]] = _scale(name, out[name], rows, layout, fmt)
    return out


def _high_precision_state(
    model: nn.Module, weights: Mapping[str, ServingWeight]
) -> dict[str, torch.Tensor]:
    """The model's state dict without the scaling state, the frozen buffers and the tied
    copies (``save_pretrained`` writes a tied weight once)."""
    drop: set[str] = set()
    for fqn, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            names = (*module.state_load_keys(), "weight", "weight_fp8", "weight_step")
            drop.update(f"{fqn}.{n}" if fqn else n for n in names)
    full = model.state_dict()
    state = {k: v for k, v in full.items() if k not in drop}
    tied: Mapping[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    for tied_name, source in tied.items():
        a, b = full.get(tied_name), full.get(source)
        if a is None or b is None or a.data_ptr() != b.data_ptr():
            continue  # not tied in this model (tie_word_embeddings=False)
        if tied_name in weights or source in weights:
            raise ValueError(
                f"{tied_name} is tied to {source} and one of them is quantized: a checkpoint "
                f"holds a tied weight once; convert without the head (include_head=False) or "
                f"untie the weights"
            )
        state.pop(tied_name, None)
    return state


def _steps_by_row(w: ServingWeight) -> torch.Tensor:
    """``w``'s steps with one row per code row (``[..., N, C]``), so that a reverse
    conversion splitting or stacking rows moves each row's steps with its codes."""
    *lead, n, _ = w.codes.shape
    if w.layout == "tensor":
        return w.steps.reshape(*lead, 1, 1).expand(*lead, n, 1)
    if w.layout == "row":
        return w.steps
    return w.steps.repeat_interleave(_BLOCK, dim=-2)[..., :n, :]


def _scale(
    name: str, codes: torch.Tensor, rows: torch.Tensor, layout: str, fmt: ExportFormat
) -> torch.Tensor:
    """The format's scale of on-disk weight ``name`` from its steps by row (``[N, C]``)."""
    n, k = codes.shape[-2:]
    grid = (math.ceil(n / _BLOCK), math.ceil(k / _BLOCK))
    if layout == "tensor":
        one = rows.reshape(-1)[:1]
        if not torch.equal(rows, one.expand_as(rows)):
            raise ValueError(f"{name}: a piece of weights with several per-tensor steps")
        return one.expand(grid).contiguous() if fmt == "fine-grained-fp8" else one.clone()
    if layout == "row":
        return rows.contiguous()
    blocks = rows[..., ::_BLOCK, :].contiguous()
    if not torch.equal(blocks.repeat_interleave(_BLOCK, dim=-2)[..., :n, :], rows):
        raise ValueError(
            f"{name}: the checkpoint's layout splits this weight at a row inside a 128x128 "
            f"block of the fused weight the model multiplies (the fused rows per piece must "
            f"be a multiple of 128), so its block steps cannot be written as they are"
        )
    return blocks


# ----- config -------------------------------------------------------------------------------


def _not_converted(model: nn.Module, quantized: set[str]) -> list[str]:
    """Modules a serving stack would take for quantized linears but that are not: linears
    and routers (a 2-D ``weight`` outside an embedding) and experts left in high precision."""
    experts = TransformersExperts()
    names = []
    for fqn, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, nn.Embedding)) or not fqn:
            continue
        own = module._parameters.get("weight")
        is_linear_like = isinstance(own, torch.Tensor) and own.dim() == 2
        weights = experts.weights(module)
        is_hp_experts = weights is not None and not any(f"{fqn}.{n}" in quantized for n in weights)
        if (is_linear_like and f"{fqn}.weight" not in quantized) or is_hp_experts:
            names.append(fqn)
    return names


def _config(model: nn.Module) -> dict[str, Any]:
    config: Any = model.config
    out: dict[str, Any] = config.to_dict()
    out.pop("quantization_config", None)
    if not out.get("architectures"):
        out["architectures"] = [type(model).__name__]
    return out


def _quantization_config(
    fmt: ExportFormat, weights: Mapping[str, ServingWeight], ignore: list[str]
) -> dict[str, Any]:
    if fmt == "fine-grained-fp8":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [_BLOCK, _BLOCK],
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
        block_structure=[_BLOCK, _BLOCK] if block else None,
    )
    activations = QuantizationArgs(
        num_bits=8,
        type="float",
        strategy="group" if block else "token",
        symmetric=True,
        dynamic=True,
        group_size=_BLOCK if block else None,
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


# ----- files --------------------------------------------------------------------------------


def _files(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], max_shard_bytes: int
) -> dict[str, Callable[[Path], None]]:
    """File name -> what writes it: the safetensors (one, or shards and their index) and
    config.json."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files: dict[str, Callable[[Path], None]] = {}
    meta = {"format": "pt"}
    if len(shards) == 1:
        files["model.safetensors"] = lambda p: save_file(shards[0], p, metadata=meta)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            weight_map.update(dict.fromkeys(shard, file))
            files[file] = lambda p, s=shard: save_file(s, p, metadata=meta)  # type: ignore[misc]
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        files["model.safetensors.index.json"] = _json_writer(index)
    files["config.json"] = _json_writer(config)
    return files


def _json_writer(data: Mapping[str, Any]) -> Callable[[Path], None]:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"

    def write(path: Path) -> None:
        path.write_text(text, encoding="utf-8")

    return write


def _fsync(path: Path, *, folder: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if folder else 0)
    if folder and not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_directory(
    target: Path, files: Mapping[str, Callable[[Path], None]], overwrite: bool
) -> None:
    """Write ``files`` into a new folder beside ``target`` and rename it into place (an
    existing ``target`` is moved aside first, then removed)."""
    parent = target.absolute().parent
    tmp = parent / f".{target.name}.{secrets.token_hex(8)}{_TEMP_SUFFIX}"
    tmp.mkdir()
    old: Path | None = None
    try:
        for name, write in files.items():
            write(tmp / name)
            _fsync(tmp / name)
        _fsync(tmp, folder=True)
        if target.exists():
            old = parent / f".{target.name}.{secrets.token_hex(8)}.old{_TEMP_SUFFIX}"
            os.rename(target, old)
        os.rename(tmp, target)
        _fsync(parent, folder=True)
    except BaseException:
        if old is not None and not target.exists():
            os.rename(old, target)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(old)
