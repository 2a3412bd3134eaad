"""``import_pretrained``: a fine-grained FP8 or compressed-tensors FP8 directory into a model
converted here, its codes and steps taken as they are.

The straight inverse of ``export_pretrained``: config.json's ``quantization_config`` says the
format and the layout of the scales (``formats.read_quantization_config``); the tensors are
read from the safetensors (one file, or the shards its index names: ``files.read_tensors``);
each scale is expanded to one step per code row (``formats.steps_of_scale``), and the codes,
those steps and every high-precision tensor go through transformers' own forward weight
conversion (what ``from_pretrained`` runs: per-expert tensors stacked and fused into
``gate_up_proj`` ...), so on-disk names become the model's and each row's steps stay with
its codes; the fused steps
are then read back in the model's recipe's layout (``formats.steps_from_rows``). Everything is
checked before anything is written; ``computectx.formats.load_serving_weights`` loads the
quantized weights, the high-precision tensors are copied into the model's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn

from computectx.formats import (
    Fp4Linear,
    FrozenFp4Linear,
    LoadMode,
    ServingWeight,
    load_serving_weights,
    recipe_layout,
    serving_recipes,
)
from computectx.formats.seam import Fp4Operand, Nvfp4Operand, check_weight, dequantized
from computectx.integrations.hf_checkpoint.files import read_tensors
from computectx.integrations.hf_checkpoint.formats import (
    CheckpointScheme,
    check_scheme,
    checkpoint_state,
    read_quantization_config,
    steps_from_rows,
    steps_of_scale,
)
from computectx.integrations.hf_checkpoint.fp4 import (
    AMAX_KEY,
    FP4_CT_FORMATS,
    INPUT_AMAX_KEY,
    Fp4Format,
    input_amax_of_scale,
    operand_of_tensors,
    read_fp4_scheme,
    reads_static_inputs,
)
from computectx.integrations.hf_checkpoint.kv import KvCalibration, read_kv_scales
from computectx.recipes import Recipe

__all__ = ["import_kv_calibration", "import_pretrained"]

_KV_SUFFIXES = (".k_scale", ".v_scale")


def import_pretrained(
    model: nn.Module, directory: str | os.PathLike[str], *, mode: LoadMode = "serve"
) -> nn.Module:
    """Load the checkpoint in ``directory`` (fine-grained FP8, compressed-tensors FP8,
    MXFP8, or weight-only NVFP4 / MXFP4 pack formats, as ``export_pretrained`` writes them or
    as published) into ``model``, a
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
    both sides and changes nothing: a format or scheme not read here (int8, sparse, 4-bit
    with static activation scales,
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

    A 4-bit checkpoint loads into the model's ``Fp4Linear`` / ``FrozenFp4Linear`` layers
    (``_import_fp4``: frozen layers keep their mode; ``"serve"`` freezes an ``Fp4Linear`` as
    ``"weight_only"``, or under a static W4A4 checkpoint as ``"w4a4"`` ``"static"``; ``"train"``
    writes its weight as the dequantized codes), codes, scales, amax and static input amax bit
    for bit; its refusals are ``hf_checkpoint.fp4``'s and ``_fp4_operands``'.
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
    q = config.get("quantization_config")
    if isinstance(q, Mapping) and q.get("quant_method") == "compressed-tensors":
        fp4 = read_fp4_scheme(q)
        if fp4 is not None:
            _import_fp4(model, folder, config, fp4, mode)
            return model
    scheme = read_quantization_config(config)
    recipes = serving_recipes(model)
    check_scheme(recipes, scheme)
    tensors = read_tensors(folder)
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
    kv = read_tensors(folder, lambda name: name.endswith(_KV_SUFFIXES))
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


# ----- 4-bit ----------------------------------------------------------------------------------

_Fp4Layer = Fp4Linear | FrozenFp4Linear
_FP4_PARTS: Final = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


def _import_fp4(
    model: nn.Module, folder: Path, config: Mapping[str, Any], fmt: Fp4Format, mode: LoadMode
) -> None:
    """A compressed-tensors NVFP4 / MXFP4 directory (``fp4``) into ``model``'s 4-bit layers:
    every tensor checked, then written. ``"serve"`` freezes each ``Fp4Linear`` as a
    ``"weight_only"`` ``FrozenFp4Linear`` holding the checkpoint's codes and loads a
    ``FrozenFp4Linear`` (its mode kept); ``"train"`` writes the dequantized codes into each
    ``Fp4Linear``'s weight. A static W4A4 checkpoint (``fp4.reads_static_inputs``) installs each
    calibrated input amax: into a frozen layer of ``activation_amax="static"`` (another is
    refused), or the ``Fp4Linear`` frozen so; a weight-only one leaves a static layer
    uncalibrated (its new weights want a new calibration)."""
    layers = _fp4_targets(model, fmt, mode)
    tensors = read_tensors(folder)
    _check_kv_scales(model, tensors, config)
    static = reads_static_inputs(config["quantization_config"])
    inputs = config.get(INPUT_AMAX_KEY) or {} if static else None
    operands, amaxes = _fp4_operands(model, tensors, layers, fmt, config.get(AMAX_KEY), inputs)
    wrong = [n for n, m in layers.items() if static and _rule(m) not in ("static", None)]
    if wrong:
        raise ValueError(
            f"import_pretrained: the checkpoint is NVFP4 W4A4 with static input scales and "
            f"{wrong[0]} serves activation_amax={_rule(layers[wrong[0]])!r}; freeze it with "
            f"activation_amax='static' (or import into the Fp4Linear model)"
        )
    high = _converted(model, tensors)
    state = checkpoint_state(model, {f"{n}.weight" for n in layers})
    _check_accounted(state, high, set(), set(), set())
    how: dict[str, Any] = {"mode": "w4a4", "activation_amax": "static"} if static else {}
    frozen = {
        n: FrozenFp4Linear(q, layer.bias, mx_rounding=layer.recipe.mx_rounding or "rceil", **how)
        for n, q in operands.items()
        if isinstance(layer := layers[n], Fp4Linear) and mode == "serve"
    }
    with torch.no_grad():  # everything checked: from here on nothing refuses
        for name, q in operands.items():
            _load_fp4(model, name, layers[name], q, frozen.get(name))
            held = frozen.get(name, layers[name])
            if isinstance(held, FrozenFp4Linear) and held.activation_amax == "static":
                if name in amaxes:
                    held.set_input_amax(amaxes[name].to(held.input_amax.device))
                else:
                    held.clear_input_amax()
        for name, tensor in high.items():
            state[name].copy_(tensor)


def _rule(layer: _Fp4Layer) -> str | None:
    return layer.activation_amax if isinstance(layer, FrozenFp4Linear) else None


def _fp4_targets(model: nn.Module, fmt: Fp4Format, mode: LoadMode) -> dict[str, _Fp4Layer]:
    """The model's 4-bit linears by name, checked against the checkpoint's format and
    ``mode``."""
    if mode not in ("serve", "train"):
        raise ValueError(f"import_pretrained: mode must be 'serve' or 'train', got {mode!r}")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (Fp4Linear, FrozenFp4Linear))}
    if not layers:
        raise ValueError(
            f"import_pretrained: the directory holds {fmt} weights ({FP4_CT_FORMATS[fmt]!r}) "
            f"and the model no 4-bit layer; convert it with convert_to_quantized under the "
            f"{fmt} recipe first"
        )
    for name, layer in layers.items():
        held = layer.format if isinstance(layer, FrozenFp4Linear) else layer.recipe.format
        if held != fmt:
            raise ValueError(
                f"import_pretrained: {name} is a {held} layer and the directory holds {fmt} "
                f"weights; convert the model under the {fmt} recipe"
            )
        if mode == "train" and isinstance(layer, FrozenFp4Linear):
            raise ValueError(
                f"import_pretrained: mode='train' writes high-precision weights and {name} is "
                f"frozen (FrozenFp4Linear); import with mode='serve', or into the Fp4Linear model"
            )
    return layers


def _fp4_operands(
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    layers: Mapping[str, _Fp4Layer],
    fmt: Fp4Format,
    amaxes: object,
    inputs: object,
) -> tuple[dict[str, Fp4Operand], dict[str, torch.Tensor]]:
    """Takes each 4-bit weight's tensors out of ``tensors``; returns its checked operand at the
    layer's tile by the layer's name (``ValueError`` for a weight without a layer, a layer
    without a weight, parts without their codes, a bad ``AMAX_KEY`` entry), and with
    ``inputs`` (static W4A4: ``INPUT_AMAX_KEY``'s map) each static input amax by name."""
    if inputs is not None and not isinstance(inputs, Mapping):
        raise ValueError(f"import_pretrained: config.json's {INPUT_AMAX_KEY} must be a mapping")
    if amaxes is not None and not isinstance(amaxes, Mapping):
        raise ValueError(
            f"import_pretrained: config.json's {AMAX_KEY} must map weight names to amaxes, got "
            f"{type(amaxes).__name__}"
        )
    amax_of: Mapping[str, object] = amaxes or {}
    bases = sorted(
        n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")
    )
    parts = {
        b: {p: tensors.pop(f"{b}.{p}") for p in _FP4_PARTS if f"{b}.{p}" in tensors} for b in bases
    }
    orphans = sorted(n for n in tensors if n.endswith(_FP4_PARTS[1:]))
    if orphans:
        raise ValueError(f"import_pretrained: scales without their weight_packed: {orphans}")
    if fmt == "mxfp4" and amaxes is not None:
        raise ValueError(
            f"import_pretrained: config.json holds {AMAX_KEY} (NVFP4's per-tensor amaxes) and "
            f"the checkpoint is MXFP4, which has none: the two were not written together"
        )
    for key, entries in ((AMAX_KEY, amax_of), (INPUT_AMAX_KEY, inputs or {})):
        stray = sorted(set(entries) - set(bases))
        if stray:
            raise ValueError(
                f"import_pretrained: config.json's {key} names {len(stray)} weight(s) the "
                f"checkpoint holds no 4-bit weight for (the first: {stray[0]!r})"
            )
    out: dict[str, Fp4Operand] = {}
    static: dict[str, torch.Tensor] = {}
    unknown = []
    for base, held in parts.items():
        fused = _converted(model, {f"{base}.weight": held["weight_packed"]})
        name = next(iter(fused)).removesuffix(".weight") if len(fused) == 1 else base
        layer = layers.get(name)
        if layer is None:
            unknown.append(base)
            continue
        shape = (layer.out_features, layer.in_features)
        q = operand_of_tensors(base, fmt, held, shape, _tile(layer), amax_of.get(base))
        out[name] = check_weight(q, f"import_pretrained: {base}")
        if isinstance(inputs, Mapping):
            static[name] = input_amax_of_scale(base, held.get(_FP4_PARTS[3]), inputs.get(base))
        elif _FP4_PARTS[3] in held:
            raise ValueError(f"import_pretrained: {base}.input_global_scale without W4A4's config")
    missing = sorted(set(layers) - set(out))
    if unknown or missing:
        raise ValueError(
            f"import_pretrained: the checkpoint's 4-bit weights do not match the model's 4-bit "
            f"layers; in the checkpoint, not 4-bit in the model: {unknown}; 4-bit in the model, "
            f"not in the checkpoint: {missing}. Nothing was changed"
        )
    return out, static


def _tile(layer: _Fp4Layer) -> str:
    if isinstance(layer, FrozenFp4Linear):
        return layer.tile
    return "1x32" if layer.recipe.format == "mxfp4" else (layer.recipe.weight_tile or "16x16")


def _load_fp4(
    model: nn.Module, name: str, layer: _Fp4Layer, q: Fp4Operand, frozen: FrozenFp4Linear | None
) -> None:
    """Writes checked operand ``q`` into layer ``name``: ``frozen`` put in its place, the
    buffers of a ``FrozenFp4Linear`` overwritten, or an ``Fp4Linear``'s weight made the
    dequantized codes."""
    if frozen is not None:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, frozen)
    elif isinstance(layer, FrozenFp4Linear):
        layer.weight_fp4.view(torch.uint8).copy_(q.codes.view(torch.uint8))
        layer.weight_scale.view(torch.uint8).copy_(q.scale.view(torch.uint8))
        if isinstance(q, Nvfp4Operand):
            layer.weight_amax.copy_(q.amax.reshape(1))
    else:
        layer.weight.copy_(dequantized(q, layer.weight.dtype))
