"""``import_pretrained``: a fine-grained FP8 or compressed-tensors FP8 directory into a model
converted here, its codes and steps taken as they are.

The straight inverse of ``export_pretrained``: config.json's ``quantization_config`` says the
format and the layout of the scales (``formats.read_quantization_config``); the tensors are
read from the safetensors (one file or shards and their index); each scale is expanded to one
step per code row (``formats.steps_of_scale``), and the codes, those steps and every
high-precision tensor go through transformers' own forward weight conversion (what
``from_pretrained`` runs: per-expert tensors stacked and fused into ``gate_up_proj`` ...), so
on-disk names become the model's and each row's steps stay with its codes; the fused steps
are then read back in the model's recipe's layout (``formats.steps_from_rows``). Everything is
checked before anything is written; ``computectx.formats.load_serving_weights`` loads the
quantized weights, the high-precision tensors are copied into the model's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn

from computectx.formats import (
    LoadMode,
    ServingWeight,
    load_serving_weights,
    recipe_layout,
    serving_recipes,
)
from computectx.integrations.hf_checkpoint.formats import (
    CheckpointScheme,
    check_scheme,
    checkpoint_state,
    read_quantization_config,
    steps_from_rows,
    steps_of_scale,
)
from computectx.integrations.hf_checkpoint.kv import KvCalibration, read_kv_scales
from computectx.recipes import Recipe

__all__ = ["import_kv_calibration", "import_pretrained"]

_KV_SUFFIXES = (".k_scale", ".v_scale")


def import_pretrained(
    model: nn.Module, directory: str | os.PathLike[str], *, mode: LoadMode = "serve"
) -> nn.Module:
    """Load the checkpoint in ``directory`` (fine-grained FP8, compressed-tensors FP8 or
    MXFP8, as ``export_pretrained`` writes them or as published) into ``model``, a
    transformers model already converted by ``convert_to_quantized`` under the recipe whose
    steps the checkpoint holds; return ``model``.

    The codes and steps are taken bit for bit: ``mode="serve"`` freezes each quantized
    linear with them; ``mode="train"`` makes each quantized weight the dequantized codes
    in place (the master the policy then trains; the same ``Parameter`` objects, so an
    optimizer built before keeps working); converted experts are frozen alike where their
    forward reads frozen codes (``GroupedExperts``, transformers' experts; torchtitan's are
    refused for ``"serve"``, naming ``"train"``). Every high-precision tensor
    (embeddings, norms, the head, routers, unconverted linears) is copied in too: one held
    in float32, bfloat16, float16 or float64 is cast to the model tensor's dtype (the cast
    ``from_pretrained`` makes), one in the model tensor's own dtype is copied as it is.

    Everything is checked before anything is written, and a refusal (``ValueError``) names
    both sides and changes nothing: a format or scheme not read here (int8, NVFP4, sparse,
    static activations, a block size other than [128, 128]); a layer whose recipe the
    checkpoint's layout does not hold (the model converted per row, the checkpoint in
    blocks); a model tensor the checkpoint lacks or a checkpoint tensor the model has no
    place for (listed); a high-precision tensor of another shape, or of another dtype than
    those above (float8 / float4 / e8m0 codes without a scale, integers, bool, complex:
    listed with their dtypes); a scale of the wrong shape, of a dtype other than float32,
    bfloat16, float16 or e8m0 (float64 only holding float32 values, as it is never rounded),
    or with steps that are not finite and positive (counted; MXFP8's uint8 E8M0 exponents
    are read as their powers of two, byte 255 as NaN); codes in another format or
    shape than the layer takes; a model with parameters or buffers on the meta device
    (materialize it first: ``model.to_empty(device=...)``).
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"import_pretrained loads into a transformers PreTrainedModel (it reads the "
            f"model's weight conversions), got {type(model).__name__}"
        )
    _check_materialized(model)
    folder = Path(os.fsdecode(directory))
    config = json.loads((folder / "config.json").read_text("utf-8"))
    scheme = read_quantization_config(config)
    recipes = serving_recipes(model)
    check_scheme(recipes, scheme)
    tensors = _read_tensors(folder)
    _check_kv_scales(model, tensors, config)
    rows = _split(tensors, scheme)
    converted = _converted(model, tensors)  # the codes in place of their weights
    fused_rows = _converted(model, rows)
    weights = {
        name: _serving_weight(name, converted.pop(name), fused_rows[name], recipe, scheme)
        for name, recipe in recipes.items()
        if name in converted and name in fused_rows
    }
    state = checkpoint_state(model, weights)
    _check_accounted(state, converted, set(weights), set(recipes), set(fused_rows))
    load_serving_weights(model, weights, mode=mode)  # checks, then writes; else nothing
    with torch.no_grad():
        for name, tensor in converted.items():
            state[name].copy_(tensor)
    return model


def import_kv_calibration(
    model: nn.Module, directory: str | os.PathLike[str]
) -> KvCalibration | None:
    """The KV-cache scales of the checkpoint in ``directory`` for ``model``'s attention
    layers, as this library serves them (``KvCalibration``: the scheme and an amax
    ``(layers, 2, key/value heads)`` whose steps are the checkpoint's, bit for bit), or
    ``None`` when it carries none; reads only the scale tensors. Serve with
    ``CtxStaticCache(model.config, ctx.with_kv(cal.kv), max_cache_len, kv_amax=cal.amax)``.
    ``ValueError`` as ``import_pretrained``'s check of them (scales on some layers only, a
    shape other than the scheme's, a step that is not finite and positive)."""
    folder = Path(os.fsdecode(directory))
    config = json.loads((folder / "config.json").read_text("utf-8"))
    kv = _read_tensors(folder, lambda name: name.endswith(_KV_SUFFIXES))
    return read_kv_scales(kv, config, model)


def _check_materialized(model: nn.Module) -> None:
    """``ValueError`` when ``model`` holds tensors on the meta device (nothing to load into)."""
    tensors = (*model.named_parameters(), *model.named_buffers())
    meta = [name for name, t in tensors if t.device.type == "meta"]
    if meta:
        raise ValueError(
            f"import_pretrained: the model has {len(meta)} parameter(s) or buffer(s) on the "
            f"meta device (the first: {meta[0]}); materialize it first "
            f"(model.to_empty(device=...)), then import. Nothing was changed"
        )


def _read_tensors(
    folder: Path, wanted: Callable[[str], bool] = lambda name: True
) -> dict[str, torch.Tensor]:
    """The tensors of the directory's safetensors whose names are ``wanted`` (all, by
    default): ``model.safetensors``, or the shards its ``model.safetensors.index.json``
    names."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: Mapping[str, str] = json.loads(index.read_text("utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"import_pretrained: {str(folder)!r} holds neither model.safetensors nor "
            f"model.safetensors.index.json"
        )
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(folder / file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if wanted(k)})  # noqa: SIM118
    return out


def _check_kv_scales(
    model: nn.Module, tensors: dict[str, torch.Tensor], config: Mapping[str, Any]
) -> None:
    """Takes the KV-cache scales (``*.k_scale``, ``*.v_scale``) out of ``tensors`` and checks
    them against ``model`` and ``config`` (``kv.read_kv_scales``; a refusal comes before
    anything is written). A model holds no KV policy to write them into: the caller reads the
    ``KvCalibration`` with ``import_kv_calibration`` and serves the cache with it."""
    kv = {n: tensors.pop(n) for n in [n for n in tensors if n.endswith(_KV_SUFFIXES)]}
    read_kv_scales(kv, config, model)


def _split(tensors: dict[str, torch.Tensor], scheme: CheckpointScheme) -> dict[str, torch.Tensor]:
    """Takes the scales out of ``tensors``; returns the steps of the weights they scale, one
    row per code row, by the weights' on-disk names."""
    suffix = scheme.suffix
    scaled = {n.removesuffix(suffix) for n in tensors if n.endswith("weight" + suffix)}
    orphans = sorted(n + suffix for n in scaled if n not in tensors)
    if orphans:
        raise ValueError(f"import_pretrained: scales without their weight: {orphans}")
    rows = {
        n: steps_of_scale(n, tensors[n], tensors.pop(n + suffix), scheme.layout) for n in scaled
    }
    return rows


def _serving_weight(
    name: str, codes: torch.Tensor, rows: torch.Tensor, recipe: Recipe, scheme: CheckpointScheme
) -> ServingWeight:
    """Model weight ``name``'s codes and steps in its recipe's layout (``ValueError`` naming
    both when the checkpoint's steps are not of that layout)."""
    layout = recipe_layout(recipe)
    steps = steps_from_rows(name, rows, layout, scheme.described())
    try:
        return ServingWeight(codes, steps, layout)
    except ValueError as e:
        raise ValueError(f"import_pretrained: {name}: {e}") from None


def _check_accounted(
    state: Mapping[str, torch.Tensor],
    high: Mapping[str, torch.Tensor],
    quantized: set[str],
    model_quantized: set[str],
    disk_quantized: set[str],
) -> None:
    """``ValueError`` listing what does not pair up: the model's quantized weights the
    checkpoint holds without scales or not at all, weights scaled on disk the model holds
    in high precision, the model's other tensors missing, the checkpoint's unknown, and
    high-precision tensors of another shape or of a dtype not read (``_reads_as``)."""
    problems = []
    lists = {
        "quantized in the model, not in the checkpoint (no scale)": model_quantized - quantized,
        "quantized in the checkpoint, not in the model": disk_quantized - model_quantized,
        "missing from the checkpoint": set(state) - set(high) - model_quantized,
        "in the checkpoint, unknown to the model": set(high) - set(state) - model_quantized,
    }
    problems = [f"{what}: {sorted(names)}" for what, names in lists.items() if names]
    shapes = [
        f"{n} {tuple(t.shape)} (the model's: {tuple(state[n].shape)})"
        for n, t in high.items()
        if n in state and t.shape != state[n].shape
    ]
    if shapes:
        problems.append(f"of another shape: {shapes}")
    dtypes = [
        f"{n} {t.dtype} (the model's: {state[n].dtype})"
        for n, t in high.items()
        if n in state and not _reads_as(t.dtype, state[n].dtype)
    ]
    if dtypes:
        floats = ", ".join(str(d).removeprefix("torch.") for d in _HIGH_PRECISION)
        problems.append(
            f"of a dtype not read: {dtypes}; a high-precision tensor is read in {floats} "
            f"(cast to the model's dtype) or in the model tensor's own dtype; float8 / float4 "
            f"codes without their scale, integers, bool and complex are not values to cast"
        )
    if problems:
        raise ValueError(
            f"import_pretrained: the checkpoint's tensors do not match the model's; "
            f"{'; '.join(problems)}. Nothing was changed"
        )


_HIGH_PRECISION: Final = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes a high-precision tensor is read in and cast from, as ``from_pretrained`` casts."""


def _reads_as(held: torch.dtype, model: torch.dtype) -> bool:
    """Whether a checkpoint tensor of dtype ``held`` loads into a model tensor of ``model``."""
    return held == model or (held in _HIGH_PRECISION and model.is_floating_point)


def _converted(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (on-disk names) under the model's names, through transformers' forward
    weight conversion (``from_pretrained``'s renamings and converters, the inverse of
    ``revert_weight_conversion``, which ``export_pretrained`` runs)."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    conversions = _conversions(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict[str, Any] = {}
    for key in sorted(tensors, key=dot_natural_key):  # experts in order, as from_pretrained
        renamed, pattern = rename_source_key(key, renamings, converters)
        if pattern is not None:
            mapping = pending.setdefault(renamed, deepcopy(by_pattern[pattern]))
        else:
            mapping = pending.setdefault(renamed, WeightRenaming(key, renamed))
            pattern = key
        mapping.add_tensor(renamed, key, pattern, tensors[key])
    out: dict[str, torch.Tensor] = {}
    for first, mapping in pending.items():
        for name, value in mapping.convert(first, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def _conversions(model: nn.Module) -> list[Any]:
    """The model's weight conversions, as ``revert_weight_conversion`` finds them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    found = getattr(model, "_weight_conversions", None)
    if found is None:
        found = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
        found = [c for c in found if not isinstance(c, PrefixChange)]
    return list(found)
