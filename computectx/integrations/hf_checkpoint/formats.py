"""The checkpoint formats ``export_pretrained`` writes and ``import_pretrained`` reads: their
names, the weight layouts each holds exactly, their tensor names and ``quantization_config``
(written by ``quantization_config``, read back by ``read_quantization_config``), and a weight's
steps with one row per code row (``steps_of_scale``, ``steps_from_rows``): the form in which
transformers' weight conversions move steps with their codes."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import torch
from torch import nn

from computectx.formats import (
    Fp4Linear,
    FrozenFp4Linear,
    Granularity,
    QuantizedLinear,
    ServingWeight,
    recipe_layout,
)
from computectx.formats.seam import FROZEN_FP4_BUFFERS
from computectx.recipes import Recipe

__all__ = [
    "BLOCK",
    "EXPORT_FORMATS",
    "FORMAT_LAYOUTS",
    "SCALE_SUFFIX",
    "CheckpointScheme",
    "ExportFormat",
    "check_recipes",
    "check_scheme",
    "checkpoint_state",
    "ct_config",
    "float32_scale",
    "format_arg",
    "quantization_config",
    "read_quantization_config",
    "steps_by_row",
    "steps_from_rows",
    "steps_of_scale",
]

ExportFormat = Literal["fine-grained-fp8", "compressed-tensors"]
"""The checkpoint formats ``export_pretrained`` writes."""
EXPORT_FORMATS: Final[tuple[ExportFormat, ...]] = get_args(ExportFormat)

FORMAT_LAYOUTS: Final[dict[ExportFormat, tuple[str, ...]]] = {
    "fine-grained-fp8": ("tensor", "128x128"),
    "compressed-tensors": ("tensor", "row", "128x128", "mx"),
}
"""The ``ServingWeight`` layouts each format holds exactly."""

BLOCK: Final = 128
SCALE_SUFFIX: Final[dict[ExportFormat, str]] = {
    "fine-grained-fp8": "_scale_inv",
    "compressed-tensors": "_scale",
}
"""A weight's scale is stored under the weight's name with this suffix."""
_STRATEGY: Final[dict[str, str]] = {
    "tensor": "tensor",
    "row": "channel",
    "128x128": "block",
    "mx": "group",  # of 32, with uint8 E8M0 scales: compressed-tensors' MXFP8
}
_LAYOUT_OF_STRATEGY: Final[dict[str, Granularity]] = {s: g for g, s in _STRATEGY.items()}  # type: ignore[misc]
MX_GROUP: Final = 32
_CT_FORMAT: Final = {"mx": "mxfp8-quantized"}
"""compressed-tensors' ``format`` by layout (``"float-quantized"`` for the others)."""


def format_arg(format: object) -> ExportFormat:
    for f in EXPORT_FORMATS:
        if format == f:
            return f
    accepted = ", ".join(repr(f) for f in EXPORT_FORMATS)
    raise ValueError(f"unknown checkpoint format {format!r}; accepted: {accepted}")


def _formats_holding(recipe: Recipe) -> list[ExportFormat]:
    if recipe.format.forward.torch != torch.float8_e4m3fn:
        return []
    layout = _layout(recipe)
    return [f for f in EXPORT_FORMATS if layout in FORMAT_LAYOUTS[f]]


def _layout(recipe: Recipe) -> Granularity | None:
    """``recipe``'s serving layout, ``None`` when it has none."""
    try:
        return recipe_layout(recipe)
    except ValueError:
        return None


def _require_quantized(recipes: Mapping[str, Recipe], who: str, under: str) -> None:
    if not recipes:
        raise ValueError(
            f"{who}: the model holds no quantized layer; convert it with "
            f"computectx.formats.convert_to_quantized{under} first"
        )


def check_recipes(recipes: Mapping[str, Recipe], fmt: ExportFormat) -> None:
    """``ValueError`` naming the first recipe ``fmt`` cannot hold and the formats that can."""
    _require_quantized(recipes, "export_pretrained", "")
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
        from compressed_tensors.config import CompressionFormat  # type: ignore[import-untyped]
        from compressed_tensors.quantization import (  # type: ignore[import-untyped]
            QuantizationArgs,
            QuantizationScheme,
            preset_name_to_scheme,
        )
    except ImportError as e:
        raise ImportError(
            "format 'compressed-tensors' builds its config with the compressed-tensors "
            "package: pip install compressed-tensors"
        ) from e
    if layout == "mx":  # its own MXFP8 preset: uint8 E8M0 scales, dynamic 1x32 activations
        mx = preset_name_to_scheme("MXFP8", ["Linear"])
        return ct_config(mx, CompressionFormat.mxfp8_quantized.value, ignore)
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
    return ct_config(scheme, CompressionFormat.float_quantized.value, ignore)


def ct_config(scheme: Any, fmt: str, ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors' ``quantization_config`` of one group ``scheme`` in format ``fmt``."""
    import compressed_tensors  # type: ignore[import-untyped]
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **config.model_dump(mode="json", exclude={"quant_method"}),
    }


def checkpoint_state(model: nn.Module, quantized: Collection[str]) -> dict[str, torch.Tensor]:
    """The model's tensors a checkpoint holds as they are (views of the model's, so writing
    into them loads the model): its state dict without the quantized weights
    (``quantized``), the scaling state (``fp8_*``), the frozen buffers and the tied copies
    (``save_pretrained`` writes a tied weight once). ``ValueError`` when a quantized
    weight is tied to another (a checkpoint holds a tied weight once)."""
    # The quantized weights, and frozen ones' codes and steps (``{weight}_fp8``/``_step``:
    # linears' and experts' alike).
    drop = {f"{name}{suffix}" for name in quantized for suffix in ("", "_fp8", "_step")}
    for fqn, module in model.named_modules():
        names: tuple[str, ...] = ()
        if isinstance(module, QuantizedLinear):
            names = (*module.state_load_keys(), "weight", "weight_fp8", "weight_step")
        elif isinstance(module, (Fp4Linear, FrozenFp4Linear)):  # 4-bit: weight, buffers, state
            names = ("weight", *FROZEN_FP4_BUFFERS, "input_amax", "_extra_state")
        drop.update(f"{fqn}.{n}" if fqn else n for n in names)
    full = model.state_dict()
    state = {k: v for k, v in full.items() if k not in drop}
    tied: Mapping[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    for tied_name, source in tied.items():
        a, b = full.get(tied_name), full.get(source)
        if a is None or b is None or a.data_ptr() != b.data_ptr():
            continue  # not tied in this model (tie_word_embeddings=False)
        if tied_name in quantized or source in quantized:
            raise ValueError(
                f"{tied_name} is tied to {source} and one of them is quantized: a checkpoint "
                f"holds a tied weight once; convert without the head (include_head=False) or "
                f"untie the weights"
            )
        state.pop(tied_name, None)
    return state


# ----- reading -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointScheme:
    """What a checkpoint's ``quantization_config`` says about its weights: the format, the
    layout of every scale on disk (fine-grained: always ``"128x128"``), and the modules it
    leaves in high precision (``modules_to_not_convert`` / ``ignore``)."""

    format: ExportFormat
    layout: Granularity
    ignore: tuple[str, ...]

    @property
    def suffix(self) -> str:
        """A weight's scale is stored under ``{weight name}{suffix}``."""
        return SCALE_SUFFIX[self.format]

    def described(self) -> str:
        if self.format == "fine-grained-fp8":
            return "a fine-grained FP8 checkpoint (one step per 128x128 block)"
        if self.layout == "mx":
            return "a compressed-tensors MXFP8 checkpoint (one E8M0 step per 1x32 group)"
        strategy = _STRATEGY[self.layout]
        return f"a compressed-tensors FP8 checkpoint (weight strategy {strategy!r})"


def read_quantization_config(config: Mapping[str, Any]) -> CheckpointScheme:
    """The ``CheckpointScheme`` of a checkpoint's ``config.json`` (``config``);
    ``ValueError`` naming what the checkpoint holds and what is read here for anything else:
    no or another ``quant_method``; fine-grained FP8 with a block size other than [128, 128]
    or static activations; compressed-tensors other than float-quantized 8-bit symmetric
    weights per tensor, channel or 128x128 block, or mxfp8-quantized (groups of 32 with
    uint8 E8M0 scales), with dynamic (or no) activation quantization (int8, NVFP4, sparsity,
    static activation scales...)."""
    q = config.get("quantization_config")
    if not isinstance(q, Mapping):
        raise ValueError(
            "import_pretrained: config.json has no quantization_config; this reads fp8 "
            "checkpoints ('fine-grained-fp8', 'compressed-tensors'). Load a high-precision "
            "checkpoint with transformers' from_pretrained, then convert_to_quantized"
        )
    method = q.get("quant_method")
    if method == "fp8":
        return _fine_grained_scheme(q)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(q)
    raise ValueError(
        f"import_pretrained: quant_method {method!r} is not read here; accepted: 'fp8' "
        f"(fine-grained FP8) and 'compressed-tensors' (FP8)"
    )


def _fine_grained_scheme(q: Mapping[str, Any]) -> CheckpointScheme:
    block = q.get("weight_block_size")
    if list(block or ()) != [BLOCK, BLOCK]:
        raise ValueError(
            f"import_pretrained: the fine-grained FP8 checkpoint has weight_block_size "
            f"{block!r}; the block recipe (and the per-tensor one, read from blocks) takes "
            f"[{BLOCK}, {BLOCK}]"
        )
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"import_pretrained: the fine-grained FP8 checkpoint has activation_scheme "
            f"{q.get('activation_scheme')!r} (static input scales); only 'dynamic' is read here"
        )
    ignore = tuple(q.get("modules_to_not_convert") or ())
    return CheckpointScheme("fine-grained-fp8", "128x128", ignore)


def _compressed_tensors_scheme(q: Mapping[str, Any]) -> CheckpointScheme:
    fmt = q.get("format")
    if fmt not in ("float-quantized", *_CT_FORMAT.values()):
        raise ValueError(
            f"import_pretrained: the compressed-tensors checkpoint is in format {fmt!r}; only "
            f"'float-quantized' (fp8 weights and scales), 'mxfp8-quantized' and the 4-bit "
            f"'nvfp4-pack-quantized' and 'mxfp4-pack-quantized' are read here"
        )
    if q.get("sparsity_config"):
        raise ValueError(
            "import_pretrained: the compressed-tensors checkpoint is sparse (sparsity_config "
            "is set); only dense float-quantized weights are read here"
        )
    groups = q.get("config_groups") or {}
    layouts = {_group_layout(name, g) for name, g in groups.items()}
    if len(layouts) != 1:
        found = sorted(layouts) or "none"
        raise ValueError(
            f"import_pretrained: the compressed-tensors checkpoint must quantize its weights "
            f"in one strategy (tensor, channel or block); its config_groups give {found}"
        )
    layout = layouts.pop()
    holds = _CT_FORMAT.get(layout, "float-quantized")
    if fmt != holds:
        raise ValueError(
            f"import_pretrained: the compressed-tensors checkpoint's format {fmt!r} does not "
            f"hold its weights' strategy {_STRATEGY[layout]!r} (format {holds!r} does)"
        )
    return CheckpointScheme("compressed-tensors", layout, tuple(q.get("ignore") or ()))


def _group_layout(name: str, group: Mapping[str, Any]) -> Granularity:
    """The layout of one compressed-tensors config group's weights (refusals named)."""
    w = group.get("weights") or {}
    what = f"{w.get('type')!r} {w.get('num_bits')}-bit weights, strategy {w.get('strategy')!r}"
    layout = _LAYOUT_OF_STRATEGY.get(str(w.get("strategy")))
    fp8 = w.get("type") == "float" and w.get("num_bits") == 8 and w.get("symmetric", True)
    block = w.get("block_structure")
    mx = (w.get("group_size"), w.get("scale_dtype")) == (MX_GROUP, "torch.uint8")
    if (
        not fp8
        or layout is None
        or (layout == "128x128" and list(block or ()) != [BLOCK, BLOCK])
        or (layout == "mx" and not mx)
    ):
        extra = f", block_structure {block}" if block else ""
        if layout == "mx":
            extra = f", group_size {w.get('group_size')}, scale_dtype {w.get('scale_dtype')}"
        raise ValueError(
            f"import_pretrained: compressed-tensors group {name!r} holds {what}{extra}; read "
            f"here: 'float' 8-bit symmetric weights, strategy 'tensor', 'channel', 'block' "
            f"({BLOCK}x{BLOCK}) or 'group' ({MX_GROUP}, scale_dtype torch.uint8: MXFP8)"
        )
    for role in ("input_activations", "output_activations"):
        a = group.get(role)
        if a and (role == "output_activations" or not a.get("dynamic")):
            raise ValueError(
                f"import_pretrained: compressed-tensors group {name!r} has {role} "
                f"{'(static scales)' if role == 'input_activations' else ''} {dict(a)}; "
                f"read here: dynamic input activations only"
            )
    return layout


def check_scheme(recipes: Mapping[str, Recipe], scheme: CheckpointScheme) -> None:
    """``ValueError`` naming the model's layer, its recipe and the checkpoint's scheme when
    the checkpoint's steps cannot be the recipe's as they are (fine-grained FP8's blocks hold
    the ``block`` and ``tensor`` recipes; compressed-tensors' strategy must be the recipe's
    layout); also for a model with no quantized layer."""
    _require_quantized(recipes, "import_pretrained", " under the checkpoint's recipe")
    for fqn, recipe in recipes.items():
        holding = _formats_holding(recipe)
        layout = _layout(recipe)
        if scheme.format in holding and (
            scheme.format != "compressed-tensors" or layout == scheme.layout
        ):
            continue
        raise ValueError(
            f"import_pretrained: {fqn} is converted under recipe {str(recipe)!r} (granularity "
            f"{recipe.granularity!r}) and the directory is {scheme.described()}; convert the "
            f"model under the recipe whose steps the checkpoint holds"
        )


def steps_of_scale(
    name: str, codes: torch.Tensor, scale: torch.Tensor, layout: str
) -> torch.Tensor:
    """On-disk weight ``name``'s ``scale`` (laid out ``layout`` for ``codes [..., N, K]``)
    as float32 steps with one row per code row (``[..., N, C]``), exactly as held
    (``float32_scale``; ``mx``'s uint8 E8M0 exponents ``b`` as ``2**(b - 127)``, 255 NaN);
    ``ValueError`` naming the tensor for a shape other than the layout's (naming both), a
    dtype ``float32_scale`` refuses, and steps that are not finite and positive (counted;
    checked before any step is compared with another, so a NaN is never taken for a split
    block)."""
    *lead, n, k = codes.shape
    want: tuple[int, ...] = {
        "tensor": (*lead, 1) if lead else (1,),
        "row": (*lead, n, 1),
        "128x128": (*lead, math.ceil(n / BLOCK), math.ceil(k / BLOCK)),
        "mx": (*lead, n, math.ceil(k / MX_GROUP)),
    }[layout]
    held = tuple(scale.shape)
    if held != want and not (layout == "tensor" and scale.numel() == 1 and not lead):
        raise ValueError(
            f"{name}: scale of shape {held} for {tuple(codes.shape)} codes laid out {layout!r}; "
            f"the layout takes {want}"
        )
    if layout == "mx" and scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)  # compressed-tensors' E8M0 exponents
    steps = float32_scale(name, scale)
    bad = ~(torch.isfinite(steps) & (steps > 0))
    if bool(bad.any()):
        raise ValueError(
            f"{name}: {int(bad.sum())} of the scale's {steps.numel()} steps are not finite "
            f"and positive (the first: {steps[bad][0].item()}); a step multiplies its codes"
        )
    return steps_by_row(steps.reshape(want), layout, tuple(codes.shape))


_SCALE_DTYPES: Final = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def float32_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's scale (weight or KV) ``name`` as the float32 steps it holds, exactly:
    float32 as it is; bfloat16, float16 and float8_e8m0fnu widened (each of their values is a
    float32); float64 only when every value is a float32 (a float64 scale off that grid would
    be rounded: refused). ``ValueError`` naming the tensor and its dtype otherwise."""
    if scale.dtype != torch.float64 and scale.dtype not in _SCALE_DTYPES:
        accepted = ", ".join(str(d).removeprefix("torch.") for d in _SCALE_DTYPES)
        raise ValueError(
            f"{name}: the scale is {scale.dtype}; read here: {accepted}, or float64 holding "
            f"float32 values"
        )
    steps = scale.detach().to(torch.float32)
    if scale.dtype == torch.float64:
        off = (steps.double() != scale) & ~torch.isnan(scale)
        if bool(off.any()):
            raise ValueError(
                f"{name}: a float64 scale with {int(off.sum())} value(s) that are not float32 "
                f"values (the first: {scale[off][0].item()!r}); steps are float32, and "
                f"rounding them would change the weights: store the scale in float32"
            )
    return steps


def steps_by_row(steps: torch.Tensor, layout: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Steps of ``layout`` for codes of ``shape`` (``ServingWeight``'s shapes) with one row
    per code row (``[..., N, C]``): a conversion that splits or stacks the codes' rows (the
    model's weight conversions, either way) moves each row's steps with it."""
    *lead, n, _ = shape
    if layout == "tensor":
        return steps.reshape(*lead, 1, 1).expand(*lead, n, 1)
    if layout in ("row", "mx"):
        return steps
    return steps.repeat_interleave(BLOCK, dim=-2)[..., :n, :]


def steps_from_rows(
    name: str, rows: torch.Tensor, layout: Granularity, scheme: str
) -> torch.Tensor:
    """Steps of ``layout`` (``ServingWeight``'s shapes) from steps with one row per code row
    ``rows [..., N, C]``; ``ValueError`` naming the weight, the layout and ``scheme`` (the
    checkpoint's, described) when the rows differ where the layout holds one step."""
    n = rows.shape[-2]
    if layout == "tensor":
        one = rows.flatten(-2)[..., :1]
        if not torch.equal(rows, one.unsqueeze(-1).expand_as(rows)):
            raise ValueError(
                f"{name}: {scheme} holds several steps for this weight (or one of its "
                f"experts); the model's recipe takes one step per weight ('tensor')"
            )
        return one.reshape(1) if rows.dim() == 2 else one
    if layout == "row":
        if rows.shape[-1] != 1:
            raise ValueError(
                f"{name}: {scheme} holds blocks; the model's recipe takes one step per row"
            )
        return rows.contiguous()
    if layout == "mx":
        return rows.contiguous()  # one row per code row already (ServingWeight checks C)
    blocks = rows[..., ::BLOCK, :].contiguous()
    if not torch.equal(blocks.repeat_interleave(BLOCK, dim=-2)[..., :n, :], rows):
        raise ValueError(
            f"{name}: {scheme} splits this fused weight at a row inside a 128x128 block of "
            f"the weight the model multiplies, so its steps are not the model's blocks"
        )
    return blocks
