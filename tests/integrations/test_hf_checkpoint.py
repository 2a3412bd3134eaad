"""``export_pretrained`` proven by the other readers, on tiny transformers models (hidden 256,
2 layers, vocab 512) converted here.

- compressed-tensors: transformers loads the directory through ``compressed_tensors`` (its
  decompression on the CPU: ``CompressedTensorsConfig(dequantize=True)``) to the float32
  weights ``ServingWeight.dequantize`` gives, bit for bit, for the tensor, row, block and mx
  recipes (mx: format ``mxfp8-quantized``, uint8 E8M0 scales as ``compress_mx_scale`` writes
  them, and ``MXFP8QuantizationCompressor.decompress`` called on them directly as well).
- fine-grained FP8: on the CPU transformers can only dequantize such a checkpoint (its fp8
  GEMMs need a GPU), so the proof is that path: the weights it loads equal ours dequantized
  to the model's dtype bit for bit, and its logits equal those of the bf16 model holding
  those weights (and stay close to this library's own fp8 serving logits).
- Qwen3-MoE: the fused experts go to disk per expert under transformers' names, and
  transformers reads them back into its fused experts.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    CompressedTensorsConfig,
    LlamaConfig,
    Qwen3MoeConfig,
)

import computectx.integrations.hf_checkpoint.export as hf_export
from computectx import ComputeCtx
from computectx.formats import Recipe, ServingWeight, convert_to_quantized, serving_weights
from computectx.integrations.hf_checkpoint import export_pretrained

from .conftest import HF_COMMON, HF_RECIPES, skip_unless_installed

# transformers loads an fp8 checkpoint through accelerate (checked, not imported: conftest.py)
skip_unless_installed("compressed_tensors", "accelerate")

COMMON, RECIPES = HF_COMMON, HF_RECIPES
IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))


def ctx_of(recipe: str) -> ComputeCtx:
    return ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse(recipe))


def tiny(config: Any) -> Any:
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny(LlamaConfig(**COMMON, intermediate_size=384))


@pytest.fixture(scope="module")
def llamas(llama: Any) -> dict[str, Any]:
    """The Llama converted under each recipe (the head left in bf16)."""
    out = {}
    for granularity, recipe in RECIPES.items():
        model = copy.deepcopy(llama)
        convert_to_quantized(model, ctx_of(recipe), min_features=16)
        out[granularity] = model
    return out


@pytest.fixture(scope="module")
def qwen3_moe() -> Any:
    config = Qwen3MoeConfig(
        **COMMON,
        intermediate_size=384,
        moe_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = tiny(config)
    convert_to_quantized(model, ctx_of(RECIPES["block"]), min_features=16)
    return model


def load(directory: Path, dtype: torch.dtype, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, attn_implementation="eager", **kwargs
        )


def check_weights(loaded: nn.Module, weights: dict[str, ServingWeight], dtype: torch.dtype) -> None:
    assert weights
    held = dict(loaded.named_parameters())
    for name, w in weights.items():
        assert held[name].dtype == dtype, name
        assert torch.equal(held[name], w.dequantize(dtype)), name


@pytest.mark.parametrize("granularity", list(RECIPES))
def test_compressed_tensors_decompress_to_our_weights(
    llamas: dict[str, Any], granularity: str, tmp_path: Path
) -> None:
    model = llamas[granularity]
    out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    strategy = {"tensor": "tensor", "row": "channel", "block": "block", "mx": "group"}
    assert config["quant_method"] == "compressed-tensors"
    mx = granularity == "mx"
    assert config["format"] == ("mxfp8-quantized" if mx else "float-quantized")
    assert config["config_groups"]["group_0"]["weights"]["strategy"] == strategy[granularity]
    assert config["ignore"] == ["lm_head"]
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
    assert "model.layers.0.self_attn.q_proj.weight_scale" in keys
    assert not [k for k in keys if ".fp8_" in k]
    loaded = load(out, torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    check_weights(loaded, serving_weights(model), torch.float32)
    if mx:
        check_mx_scales_decompress(out, serving_weights(model), config)


def check_mx_scales_decompress(
    out: Path, weights: dict[str, ServingWeight], config: dict[str, Any]
) -> None:
    """MXFP8's scales are uint8 E8M0 exponents, the bytes ``compress_mx_scale`` makes of our
    steps, and ``MXFP8QuantizationCompressor.decompress`` gives our weights from them."""
    from compressed_tensors.compressors import MXFP8QuantizationCompressor  # type: ignore[import-untyped]
    from compressed_tensors.compressors.mx_utils import compress_mx_scale  # type: ignore[import-untyped]
    from compressed_tensors.quantization import QuantizationScheme  # type: ignore[import-untyped]

    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    assert scheme.weights is not None and scheme.weights.group_size == 32
    with safe_open(out / "model.safetensors", "pt") as f:
        for name, w in weights.items():
            codes, scale = f.get_tensor(name), f.get_tensor(name + "_scale")
            assert scale.dtype == torch.uint8 and scale.shape == w.steps.shape, name
            assert torch.equal(scale, compress_mx_scale(w.steps, torch.uint8)), name
            state = {"weight": codes, "weight_scale": scale}
            got = MXFP8QuantizationCompressor.decompress(state, scheme)["weight"]
            assert torch.equal(got.float(), w.dequantize()), name


@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_fine_grained_loads_in_transformers(
    llama: Any, llamas: dict[str, Any], granularity: str, tmp_path: Path
) -> None:
    model = llamas[granularity]
    weights = serving_weights(model)
    out = export_pretrained(model, tmp_path / "fg", format="fine-grained-fp8")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    }
    assert config["architectures"] == ["LlamaForCausalLM"]
    with safe_open(out / "model.safetensors", "pt") as f:
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)  # [256, 384] in 128x128
    loaded = load(out, torch.bfloat16)
    check_weights(loaded, weights, torch.bfloat16)
    reference = copy.deepcopy(llama)
    with torch.no_grad():
        for name, w in weights.items():
            reference.get_parameter(name).copy_(w.dequantize(torch.bfloat16))
        got = loaded(IDS).logits
        assert torch.equal(got, reference(IDS).logits)
        ours = model.eval()(IDS).logits.double()
    sqnr = 10 * math.log10(ours.pow(2).sum() / (got.double() - ours).pow(2).sum())
    assert sqnr > 20, sqnr


def test_moe_experts_go_to_disk_per_expert(
    qwen3_moe: Any, tmp_path: Path, grouped_operands: Callable[[], list[tuple[Any, Any, Any]]]
) -> None:
    weights = serving_weights(qwen3_moe)
    fused = weights["model.layers.1.mlp.experts.gate_up_proj"]
    assert fused.codes.shape == (4, 512, 256) and fused.steps.shape == (4, 4, 2)
    out = export_pretrained(qwen3_moe, tmp_path / "moe", format="fine-grained-fp8")
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        gate = f.get_tensor("model.layers.1.mlp.experts.2.gate_proj.weight")
        up_scale = f.get_tensor("model.layers.1.mlp.experts.2.up_proj.weight_scale_inv")
    assert not [k for k in keys if "gate_up_proj" in k]
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in keys
    assert torch.equal(gate.view(torch.uint8), fused.codes[2, :256].view(torch.uint8))
    assert torch.equal(up_scale, fused.steps[2, 2:])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["modules_to_not_convert"] == [
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
        "lm_head",
    ]
    check_weights(load(out, torch.bfloat16), weights, torch.bfloat16)
    # The codes are those the grouped forward quantizes each expert's weight to.
    seen = grouped_operands()
    with torch.no_grad():
        qwen3_moe.eval()(IDS)
    experts = qwen3_moe.model.layers[1].mlp.experts
    matched = 0
    for x, q, s in seen:
        for e in range(4):
            if x.shape == (512, 256) and torch.equal(x, experts.gate_up_proj[e]):
                assert torch.equal(q.view(torch.uint8), fused.codes[e].view(torch.uint8))
                assert torch.equal(s, fused.steps[e])
                matched += 1
    assert matched == 4  # every expert's gate_up, once


def test_refusals_name_the_recipe_and_the_formats(
    llama: Any, llamas: dict[str, Any], tmp_path: Path
) -> None:
    target = tmp_path / "out"
    with pytest.raises(ValueError, match=r"cannot hold recipe 'e4m3/row.*'compressed-tensors'"):
        export_pretrained(llamas["row"], target, format="fine-grained-fp8")
    with pytest.raises(ValueError, match=r"cannot hold recipe 'e4m3/mx.*'compressed-tensors'"):
        export_pretrained(llamas["mx"], target, format="fine-grained-fp8")
    model = copy.deepcopy(llama)
    convert_to_quantized(model, ctx_of("e5m2/dynamic/0"), min_features=16)
    for fmt in ("fine-grained-fp8", "compressed-tensors"):
        with pytest.raises(ValueError, match=r"none of the formats written here"):
            export_pretrained(model, target, format=fmt)
    with pytest.raises(ValueError, match="unknown checkpoint format 'gguf'"):
        export_pretrained(llamas["block"], target, format="gguf")  # type: ignore[arg-type]
    assert not target.exists() and list(tmp_path.iterdir()) == []  # nothing written


def test_an_existing_directory_is_replaced_only_when_asked(
    llamas: dict[str, Any], tmp_path: Path
) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty; pass overwrite=True"):
        export_pretrained(llamas["tensor"], target, format="compressed-tensors")
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    export_pretrained(
        llamas["tensor"], target, format="compressed-tensors", overwrite=True, max_shard_bytes=2**20
    )
    names = sorted(p.name for p in target.iterdir())
    assert "keep.txt" not in names and "config.json" in names
    assert "model.safetensors.index.json" in names and "model-00001-of-00002.safetensors" in names
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporaries left beside it


def test_a_bad_max_shard_bytes_is_refused_before_writing(
    llamas: dict[str, Any], tmp_path: Path
) -> None:
    target = tmp_path / "out"
    cases: list[tuple[Any, type[Exception], str]] = [
        (0, ValueError, "must be >= 1"),
        (-1, ValueError, "must be >= 1"),
        (1.5, TypeError, "takes an int"),
        (True, TypeError, "takes an int"),
        ("100", TypeError, "takes an int"),
        (None, TypeError, "takes an int"),
    ]
    for value, error, message in cases:
        with pytest.raises(error, match=rf"max_shard_bytes {message} .*got {value!r}$"):
            export_pretrained(
                llamas["tensor"], target, format="compressed-tensors", max_shard_bytes=value
            )
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_symlinked_directory_is_written_through(llamas: dict[str, Any], tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "old.txt").write_text("old")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="not empty; pass overwrite=True"):
        export_pretrained(llamas["block"], link, format="fine-grained-fp8")
    out = export_pretrained(llamas["block"], link, format="fine-grained-fp8", overwrite=True)
    assert out == link
    assert link.is_symlink() and "config.json" in [p.name for p in real.iterdir()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no temporaries
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match="symlink loop"):
        export_pretrained(llamas["block"], loop, format="fine-grained-fp8")


def test_experts_split_inside_a_block_are_refused_before_writing(tmp_path: Path) -> None:
    # moe_intermediate_size 192: up_proj's rows start in the middle of gate_up_proj's second
    # 128-row block, so its file's first block would need two steps; nothing is written.
    config = Qwen3MoeConfig(
        **COMMON,
        intermediate_size=384,
        moe_intermediate_size=192,
        num_experts=2,
        num_experts_per_tok=1,
    )
    model = tiny(config)
    convert_to_quantized(model, ctx_of(RECIPES["block"]), min_features=16)
    with pytest.raises(ValueError, match=r"up_proj\.weight: .* inside a 128x128 block"):
        export_pretrained(model, tmp_path / "moe", format="fine-grained-fp8")
    assert list(tmp_path.iterdir()) == []


def test_a_per_tensor_step_of_fused_experts_on_disk_keeps_one_step_per_expert() -> None:
    # An on-disk weight that stays [E, N, K] (experts a model stores fused) under a per-tensor
    # recipe: the fine-grained scale repeats each expert's own step over its blocks (it took
    # expert 0's for all and dropped the expert dimension).
    codes = torch.zeros(3, 256, 384, dtype=torch.float8_e4m3fn)
    steps = torch.tensor([[0.5], [0.25], [2.0]])
    rows = steps.reshape(3, 1, 1).expand(3, 256, 1)
    scale = hf_export._scale("w", codes, rows, "tensor", "fine-grained-fp8")
    assert scale.shape == (3, 2, 3)
    assert torch.equal(scale, steps.reshape(3, 1, 1).expand(3, 2, 3))
    one = hf_export._scale("w", codes[0], rows[0], "tensor", "fine-grained-fp8")
    assert one.shape == (2, 3) and bool((one == 0.5).all())


@pytest.mark.parametrize("granularity", ["tensor", "row", "block", "mx"])
def test_a_nan_master_is_refused_before_writing(
    llama: Any, granularity: str, tmp_path: Path
) -> None:
    # Before: the block and mx exports wrote a NaN code that their own import refuses.
    model = copy.deepcopy(llama)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[2, 3] = math.nan
    convert_to_quantized(model, ctx_of(RECIPES[granularity]), min_features=16)
    target = tmp_path / "out"
    with pytest.raises(
        ValueError,
        match=r"export_pretrained: model\.layers\.0\.mlp\.up_proj\.weight was given 1 "
        r"non-finite code\(s\)",
    ):
        export_pretrained(model, target, format="compressed-tensors")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_tied_head_frozen_in_fp8_exports_untied(tmp_path: Path) -> None:
    # Before: tie_word_embeddings stayed true while the checkpoint held the head's fp8 codes.
    model = tiny(LlamaConfig(**COMMON, intermediate_size=384, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    convert_to_quantized(model, ctx_of(RECIPES["block"]), min_features=16, include_head=True)
    for layer in model.modules():
        if hasattr(layer, "freeze_for_serving"):
            layer.freeze_for_serving()
    out = export_pretrained(model, tmp_path / "out", format="compressed-tensors")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {"lm_head.weight", "lm_head.weight_scale"} <= set(f.keys())
