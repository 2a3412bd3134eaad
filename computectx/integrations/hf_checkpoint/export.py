"""``export_pretrained``: the tensors and config.json of a converted model in a format."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from computectx.dtypes import DType
from computectx.formats import (
    Granularity,
    QuantizedLinear,
    ServingWeight,
    serving_recipes,
    serving_weights,
)
from computectx.formats.seam import Fp4Operand, Nvfp4Operand, global_encode_scale
from computectx.integrations.hf_checkpoint.files import SHARD_BYTES, write_checkpoint
from computectx.integrations.hf_checkpoint.formats import (
    BLOCK,
    SCALE_SUFFIX,
    ExportFormat,
    check_recipes,
    checkpoint_state,
    format_arg,
    quantization_config,
    steps_by_row,
    steps_from_rows,
)
from computectx.integrations.hf_checkpoint.fp4 import (
    AMAX_KEY,
    INPUT_AMAX_KEY,
    fp4_format_of,
    fp4_input_amaxes,
    fp4_layers,
    fp4_quantization_config,
    fp4_tensors,
)
from computectx.integrations.hf_checkpoint.kv import kv_cache_scheme, kv_scale_tensors
from computectx.integrations.transformers_moe import TransformersExperts
from computectx.kv_policy import KvFp8

__all__ = ["export_pretrained"]


def export_pretrained(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    format: ExportFormat,
    overwrite: bool = False,
    max_shard_bytes: int = SHARD_BYTES,
    kv: KvFp8 | DType | None = None,
    kv_amax: torch.Tensor | None = None,
) -> Path:
    """Write ``model`` (a transformers model converted by ``convert_to_quantized``) to
    ``directory`` in ``format`` (module docstring); return the directory.

    Everything is checked and laid out in memory before anything is written; then the files
    go to a new folder beside ``directory``, are fsynced, and the folder is renamed into
    place, so a crash leaves the old directory or the new one. A ``directory`` that is a
    symlink is written through: the folder it points to is replaced, the link stays.
    ``ValueError`` (nothing written) for: an unknown format; a ``max_shard_bytes`` below 1
    (``TypeError`` for one that is not an ``int``); a recipe the format cannot hold (naming
    the recipe, the layer and the formats that can); an existing non-empty ``directory`` without
    ``overwrite=True``; a quantized weight tied to another; experts whose layout the
    model's reverse conversion splits inside a 128x128 block; a 4-bit model in
    ``"fine-grained-fp8"``, one mixing fp8 and 4-bit layers or NVFP4 and MXFP4, 4-bit
    experts (not exported yet); an fp8 weight the import would refuse (a NaN code, from a NaN
    in its master; a step or a value that is not finite). A 4-bit model's layers go to
    compressed-tensors' NVFP4 / MXFP4 pack formats, weight-only (``hf_checkpoint.fp4``), and
    each NVFP4 layer's amax to config.json's ``fp4.AMAX_KEY``; a ``UserWarning`` names the
    projections vLLM fuses (q/k/v, gate/up) whose 4-bit parts' NVFP4 global scales differ
    (vLLM serves them with the largest), another those partly 4-bit (vLLM refuses them).
    ``TypeError`` for a model that is not a transformers ``PreTrainedModel``. Safetensors
    files above ``max_shard_bytes`` are split in shards with an index, as ``save_pretrained``
    does.

    ``kv`` / ``kv_amax``: the KV cache the model is served with here (``ctx.kv``) and, for a
    static fp8 scheme (``per_tensor``, ``per_head``), its calibrated amax ``(layers, 2,
    key/value heads)`` (``calibrate_transformers_kv``, the ``kv_amax`` ``CtxStaticCache``
    takes): the checkpoint then carries each layer's ``k_scale`` / ``v_scale``, the steps that
    cache serves with, as the format holds them (``hf_checkpoint.kv``); any other ``kv``
    writes none and takes no ``kv_amax``. Their refusals (a static scheme without its amax,
    e5m2, a wrong shape) come before anything is written too.
    """
    fmt = format_arg(format)
    target = _target_arg(directory, overwrite)
    shard_bytes = _shard_arg(max_shard_bytes)
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"export_pretrained writes a transformers PreTrainedModel (it reads model.config "
            f"and the model's weight conversions), got {type(model).__name__}"
        )
    recipes = serving_recipes(model)
    fp4 = fp4_layers(model)
    if fp4:
        _check_fp4(fp4, recipes, fmt)
    else:
        check_recipes(recipes, fmt)
    kv_scales = kv_scale_tensors(model, fmt, kv, kv_amax)
    config = _config(model)
    if fp4:
        inputs = fp4_input_amaxes(model, fp4)
        tensors, amax, input_amax = _fp4_disk_tensors(model, fp4, inputs)
        ignore = _not_converted(model, {f"{n}.weight" for n in fp4})
        fmt4 = fp4_format_of(next(iter(fp4.values())))
        config["quantization_config"] = fp4_quantization_config(fmt4, ignore, bool(inputs))
        if amax:
            config[AMAX_KEY] = amax
        if input_amax:
            config[INPUT_AMAX_KEY] = input_amax
    else:
        weights = serving_weights(model)
        for name, w in weights.items():
            # The import's own rule (load_serving_weights): finite codes, finite positive
            # steps, finite values; a NaN in a master weight quantizes to a NaN code.
            shape = tuple(w.codes.shape)
            w.check_fits(f"export_pretrained: {name}", w.codes.dtype, shape, w.layout)
        tensors = _disk_tensors(model, weights, fmt)
        ignore = _not_converted(model, set(weights))
        config["quantization_config"] = quantization_config(fmt, weights, ignore)
    tensors.update(kv_scales)
    scheme = kv_cache_scheme(fmt, kv)
    if scheme is not None:
        config["quantization_config"]["kv_cache_scheme"] = scheme
    write_checkpoint(target, tensors, config, shard_bytes)
    return target


def _target_arg(directory: object, overwrite: bool) -> Path:
    """The directory to write, checked; a symlink is checked as the folder it resolves to
    (the export writes through it: that folder is replaced, the link stays)."""
    if not isinstance(directory, (str, os.PathLike)) or os.fspath(directory) in ("", b""):
        raise TypeError(f"export_pretrained takes a directory path, got {directory!r}")
    target = Path(os.fsdecode(directory))
    real = Path(os.path.realpath(target))
    if real.is_symlink():  # realpath stops inside a loop
        raise ValueError(f"cannot export to {str(target)!r}: it is a symlink loop")
    if real.exists() and not real.is_dir():
        raise ValueError(f"cannot export to {str(target)!r}: it exists and is not a directory")
    if real.is_dir() and any(real.iterdir()) and not overwrite:
        raise ValueError(
            f"cannot export to {str(target)!r}: the directory exists and is not empty; pass "
            f"overwrite=True to replace it"
        )
    if not real.parent.is_dir():
        raise ValueError(f"cannot export to {str(target)!r}: its parent folder does not exist")
    return target


def _shard_arg(max_shard_bytes: object) -> int:
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise TypeError(
            f"export_pretrained max_shard_bytes takes an int (bytes, >= 1), got {max_shard_bytes!r}"
        )
    if max_shard_bytes < 1:
        raise ValueError(
            f"export_pretrained max_shard_bytes must be >= 1 (bytes), got {max_shard_bytes!r}"
        )
    return max_shard_bytes


def _disk_tensors(
    model: PreTrainedModel, weights: Mapping[str, ServingWeight], fmt: ExportFormat
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by its on-disk name: the high-precision state, the
    codes in place of the quantized weights and their scales."""
    from transformers.core_model_loading import revert_weight_conversion

    state = checkpoint_state(model, weights)
    full = model.state_dict()
    for name, w in weights.items():
        held = full.get(name)
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
        by_row = {
            k: steps_by_row(w.steps, w.layout, tuple(w.codes.shape))
            for k, w in weights.items()
            if w.layout == layout
        }
        for name, rows in revert_weight_conversion(model, by_row).items():
            out[name + SCALE_SUFFIX[fmt]] = _scale(name, out[name], rows, layout, fmt)
    return out


def _check_fp4(
    fp4: Mapping[str, Fp4Operand], recipes: Mapping[str, Any], fmt: ExportFormat
) -> None:
    """``ValueError`` unless every quantized layer is 4-bit in one format and ``fmt`` is
    compressed-tensors (its NVFP4 / MXFP4 pack formats)."""
    first = next(iter(fp4))
    if fmt != "compressed-tensors":
        raise ValueError(
            f"format {fmt!r} cannot hold 4-bit weights ({first}: "
            f"{fp4_format_of(fp4[first])}); the format that holds them exactly: "
            f"'compressed-tensors' (nvfp4-pack-quantized, mxfp4-pack-quantized)"
        )
    if recipes:
        raise ValueError(
            f"format 'compressed-tensors' is written with one weight scheme for every quantized "
            f"layer; this model mixes fp8 ({next(iter(recipes))}) and 4-bit ({first}) layers"
        )
    formats = {fp4_format_of(q) for q in fp4.values()}
    if len(formats) > 1:
        raise ValueError(
            f"format 'compressed-tensors' is written with one weight scheme for every quantized "
            f"layer; this model mixes 4-bit formats {sorted(formats)}"
        )


def _fp4_disk_tensors(
    model: PreTrainedModel, fp4: Mapping[str, Fp4Operand], inputs: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, float]]:
    """Every tensor of a 4-bit checkpoint by its on-disk name (the high-precision state, each
    layer's ``weight_packed``, ``weight_scale`` and NVFP4's ``weight_global_scale``; static
    W4A4's ``input_global_scale`` from ``inputs``, the input amaxes by module name), and each
    NVFP4 layer's amax and input amax by its on-disk name (``fp4.AMAX_KEY``,
    ``INPUT_AMAX_KEY``)."""
    from transformers.core_model_loading import revert_weight_conversion

    quantized = {f"{n}.weight" for n in fp4}
    state = checkpoint_state(model, quantized)
    out = {k: t.contiguous() for k, t in revert_weight_conversion(model, state).items()}
    amax: dict[str, float] = {}
    input_amax: dict[str, float] = {}
    for fqn, q in fp4.items():
        packed = q.codes.detach().view(torch.uint8)
        disk = revert_weight_conversion(model, {f"{fqn}.weight": packed})
        if len(disk) != 1 or next(iter(disk.values())).shape != packed.shape:
            raise ValueError(
                f"{fqn}: the model's reverse weight conversion splits or fuses this 4-bit "
                f"weight on disk; exporting it is not supported"
            )
        base = next(iter(disk)).removesuffix(".weight")
        out.update({f"{base}.{k}": t for k, t in fp4_tensors(fqn, q).items()})
        if isinstance(q, Nvfp4Operand):
            amax[base] = float(q.amax.reshape(()).item())
        if fqn in inputs:  # S_enc of the calibrated amax: compressed-tensors' encode scale
            out[f"{base}.input_global_scale"] = global_encode_scale(inputs[fqn]).reshape(1)
            input_amax[base] = float(inputs[fqn].item())
    _warn_fused_global_scales(
        out, [n.removesuffix(".weight_packed") for n in out if n.endswith(".weight_packed")]
    )
    return out, amax, input_amax


_FUSED: Final = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""The projections vLLM fuses into one layer (``qkv_proj``, ``gate_up_proj``)."""


def _warn_fused_global_scales(tensors: Mapping[str, torch.Tensor], layers: list[str]) -> None:
    """``UserWarning`` for the projections vLLM fuses into one layer (``_FUSED``), by group
    (``layers``, the 4-bit ones, and ``tensors``, on-disk names):

    - two or more 4-bit parts whose NVFP4 weight global scales differ (whichever parts they
      are): vLLM serves a fused layer with one, the largest (``weight_global_scale.max()``), so
      the other parts' block scales decode off by ``G_part / G_max`` there; the same for their
      static input global scales (one input, so calibrated together they are equal; set apart
      by hand, vLLM quantizes the input with the largest, the smallest amax);
    - a group with 4-bit and high-precision parts: vLLM refuses to load it ("Found different
      quantization schemes for the shards of ..."). A warning, not a refusal: the checkpoint
      is valid compressed-tensors, and compressed-tensors and transformers read it exactly."""
    differ, mixed = [], []
    groups = {
        (base.rpartition(".")[0], parts)
        for base in layers
        for parts in _FUSED
        if base.rpartition(".")[2] in parts
    }
    for parent, parts in sorted(groups):
        names = [f"{parent}.{p}" for p in parts]
        packed = [n for n in names if n in layers]
        for kind in ("weight_global_scale", "input_global_scale"):
            scales = {float(tensors[f"{n}.{kind}"]) for n in packed if f"{n}.{kind}" in tensors}
            if len(scales) > 1:
                held = ",".join(p for p in parts if f"{parent}.{p}" in packed)
                differ.append(f"{parent}.{{{held}}} ({kind})")
        high = [n.rpartition(".")[2] for n in names if f"{n}.weight" in tensors]
        if high:
            mixed.append(
                f"{parent}: {{{','.join(parts)}}} with {{{','.join(high)}}} high-precision"
            )
    where = "docs/serving-formats.md, '4-bit: NVFP4 and MXFP4'"
    if differ:
        warnings.warn(
            f"export_pretrained: {len(differ)} group(s) of projections that vLLM fuses into one "
            f"layer hold different NVFP4 weight or input global scales (the first: "
            f"{differ[0]}; input global scales: {sum('input_' in d for d in differ)}); vLLM "
            f"serves a fused layer with one global scale of each kind, the largest, so the "
            f"other parts decode (weights) or quantize (inputs) off by G_part / G_max there "
            f"(compressed-tensors and transformers read each part exactly). {where}",
            UserWarning,
            stacklevel=3,
        )
    if mixed:
        warnings.warn(
            f"export_pretrained: {len(mixed)} group(s) of projections that vLLM fuses into one "
            f"layer are partly 4-bit (the first: {mixed[0]}); vLLM refuses to load such a "
            f"checkpoint (every part of a fused layer must share one scheme): convert every "
            f"part alike to serve it there (compressed-tensors and transformers read it as it "
            f"is). {where}",
            UserWarning,
            stacklevel=3,
        )


def _scale(
    name: str, codes: torch.Tensor, rows: torch.Tensor, layout: Granularity, fmt: ExportFormat
) -> torch.Tensor:
    """The format's scale of on-disk weight ``name`` from its steps by row (``[N, C]``):
    ``ServingWeight``'s steps of the piece, a per-tensor step repeated over the blocks in the
    fine-grained format (which holds blocks only), ``mx``'s powers of two as the uint8 E8M0
    exponents compressed-tensors stores (``compress_mx_scale``'s bytes, exactly)."""
    steps = steps_from_rows(name, rows, layout, "the model's reverse weight conversion")
    if layout == "mx":
        return steps.to(torch.float8_e8m0fnu).view(torch.uint8)
    if layout == "tensor" and fmt == "fine-grained-fp8":
        n, k = codes.shape[-2:]
        grid = (math.ceil(n / BLOCK), math.ceil(k / BLOCK))
        lead = steps.shape[:-1]  # experts stored fused on disk keep one step each
        return steps.reshape(*lead, 1, 1).expand(*lead, *grid).contiguous()
    return steps.clone()  # a tensor of its own: safetensors refuses tensors sharing memory


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
    """config.json: the model's config, without a ``quantization_config``, and with
    ``tie_word_embeddings`` false where a pair the model declares tied no longer shares its
    storage (a tied head converted and then frozen holds its own codes: the checkpoint writes
    both, and a reader that ties them would drop the head's)."""
    config: Any = model.config
    out: dict[str, Any] = config.to_dict()
    out.pop("quantization_config", None)
    if not out.get("architectures"):
        out["architectures"] = [type(model).__name__]
    if out.get("tie_word_embeddings") and _untied(model):
        out["tie_word_embeddings"] = False
    return out


def _untied(model: nn.Module) -> list[str]:
    """The weights ``all_tied_weights_keys`` ties that do not share their source's storage
    (a frozen layer holds no ``weight`` at all)."""
    full = model.state_dict()
    tied: Mapping[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    return sorted(
        name
        for name, source in tied.items()
        if name not in full
        or source not in full
        or full[name].data_ptr() != full[source].data_ptr()
    )
