"""``import_pretrained``, the inverse of ``export_pretrained``, on tiny transformers models
(hidden 256, 2 layers, vocab 512) converted here.

- Round trips: a directory exported here imports into a model converted under the same recipe
  (from other random weights) with the codes, the steps and every other tensor bit for bit,
  for tensor / row / block / mx in each format that holds them, dense Llama and Qwen3-MoE (its
  experts come back fused from per-expert tensors); ``mode="serve"`` gives the exporting
  model's frozen serving logits bit for bit; ``mode="train"`` makes the masters the
  dequantized codes, in place, and trains.
- A DeepSeek-V3-layout checkpoint written by transformers' own code on the CPU: its
  fine-grained FP8 quantizer's ``Fp8Quantize`` op (the op ``save_pretrained`` runs to write
  fp8 weights and ``weight_scale_inv``; quantizing a model on load needs a GPU), applied to
  the tensors under the names ``save_pretrained`` gives them (experts per expert, by the
  model's reverse weight conversion), with ``FineGrainedFP8Config``'s own config.
- Refusals, each naming both sides and changing nothing (a state snapshot).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, LlamaConfig, Qwen3MoeConfig
from transformers.core_model_loading import revert_weight_conversion
from transformers.integrations.finegrained_fp8 import Fp8Quantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

import computectx.integrations.hf_checkpoint.load as hf_load
from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, Recipe, ServingWeight, convert_to_quantized
from computectx.formats import load_serving_weights as real_load
from computectx.formats import serving_weights as model_serving_weights
from computectx.integrations.hf_checkpoint import (
    ExportFormat,
    export_pretrained,
    import_pretrained,
)
from computectx.integrations.hf_checkpoint.files import read_tensors
from computectx.integrations.transformers_moe import (
    TransformersExperts,
    freeze_experts_for_serving,
)

from .conftest import HF_COMMON, HF_RECIPES, skip_unless_installed

skip_unless_installed("compressed_tensors")  # checked, not imported (see conftest.py)

COMMON, RECIPES = HF_COMMON, HF_RECIPES
HELD: list[tuple[str, ExportFormat]] = [
    ("tensor", "fine-grained-fp8"),
    ("tensor", "compressed-tensors"),
    ("row", "compressed-tensors"),
    ("block", "fine-grained-fp8"),
    ("block", "compressed-tensors"),
    ("mx", "compressed-tensors"),
]
IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))


def ctx_of(recipe: str) -> ComputeCtx:
    return ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse(recipe))


def llama_config() -> Any:
    return LlamaConfig(**COMMON, intermediate_size=384)


def moe_config() -> Any:
    return Qwen3MoeConfig(
        **COMMON,
        intermediate_size=384,
        moe_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
    )


def tiny(config: Any, seed: int, granularity: str | None = None) -> Any:
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if granularity is not None:
        convert_to_quantized(model, ctx_of(RECIPES[granularity]), min_features=16)
    return model


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Any]:
    """(model, granularity, format) -> (the exporting model, its directory)."""
    out: dict[tuple[str, str, str], Any] = {}
    root = tmp_path_factory.mktemp("exported")
    for kind, config in (("llama", llama_config), ("moe", moe_config)):
        for granularity in RECIPES if kind == "llama" else ("tensor", "block", "mx"):
            model = tiny(config(), 0, granularity)
            for g, fmt in HELD:
                if g == granularity:
                    target = root / f"{kind}-{g}-{fmt}"
                    out[kind, g, fmt] = (model, export_pretrained(model, target, format=fmt))
    return out


def same_weights(a: dict[str, ServingWeight], b: dict[str, ServingWeight]) -> None:
    assert list(a) == list(b) and a
    for name, w in a.items():
        assert w.layout == b[name].layout, name
        assert torch.equal(w.codes.view(torch.uint8), b[name].codes.view(torch.uint8)), name
        assert torch.equal(w.steps, b[name].steps), name


def high_precision(model: Any) -> dict[str, torch.Tensor]:
    weights = set(model_serving_weights(model))
    drop = ("weight_fp8", "weight_step")
    return {
        k: v
        for k, v in model.state_dict().items()
        if k not in weights and ".fp8_" not in k and not k.endswith(drop)
    }


def snapshot(model: Any) -> dict[str, Any]:
    frozen = [m.frozen for m in model.modules() if isinstance(m, QuantizedLinear)]
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "frozen": frozen}


def unchanged(model: Any, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["frozen"] == before["frozen"]
    assert list(after["state"]) == list(before["state"])
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k


@pytest.mark.parametrize(("granularity", "fmt"), HELD)
def test_dense_round_trip_serves_bit_for_bit(
    exported: dict[tuple[str, str, str], Any], granularity: str, fmt: ExportFormat
) -> None:
    model, directory = exported["llama", granularity, fmt]
    loaded = tiny(llama_config(), 1, granularity)
    assert import_pretrained(loaded, directory) is loaded  # mode="serve"
    same_weights(model_serving_weights(model), model_serving_weights(loaded))
    assert all(m.frozen for m in loaded.modules() if isinstance(m, QuantizedLinear))
    theirs, ours = high_precision(model), high_precision(loaded)
    assert list(theirs) == list(ours)
    for name, t in theirs.items():
        assert torch.equal(t, ours[name]), name
    frozen = copy.deepcopy(model)
    for m in frozen.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS).logits, frozen.eval()(IDS).logits)


def test_train_mode_writes_the_masters_in_place_and_trains(
    exported: dict[tuple[str, str, str], Any],
) -> None:
    model, directory = exported["llama", "block", "fine-grained-fp8"]
    loaded = tiny(llama_config(), 1, "block")
    params = dict(loaded.named_parameters())
    opt = torch.optim.SGD(loaded.parameters(), lr=1e-2)
    import_pretrained(loaded, directory, mode="train")
    assert dict(loaded.named_parameters()) == params  # the same Parameter objects
    for name, w in model_serving_weights(model).items():
        assert torch.equal(params[name], w.dequantize(torch.bfloat16)), name
    before = params["model.layers.0.mlp.up_proj.weight"].clone()
    loss = loaded.train()(IDS, labels=IDS).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(
        params["model.layers.0.mlp.up_proj.weight"], before
    )


@pytest.mark.parametrize(
    ("granularity", "fmt"),
    [
        ("tensor", "compressed-tensors"),
        ("block", "fine-grained-fp8"),
        ("block", "compressed-tensors"),
        ("mx", "compressed-tensors"),
    ],
)
def test_moe_round_trip(
    exported: dict[tuple[str, str, str], Any],
    granularity: str,
    fmt: ExportFormat,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The experts come back fused with their codes and steps as exported (what the import
    hands ``load_serving_weights``): in serve mode frozen with them, the exporting model's
    frozen logits bit for bit; in train mode they become the dequantized codes."""
    model, directory = exported["moe", granularity, fmt]
    served = tiny(moe_config(), 1, granularity)
    assert import_pretrained(served, directory) is served  # mode="serve"
    same_weights(model_serving_weights(model), model_serving_weights(served))
    experts = [m for m in served.modules() if TransformersExperts().current(m) is not None]
    assert experts and all(m.gate_up_proj is None and m.down_proj is None for m in experts)
    frozen = copy.deepcopy(model)
    for m in frozen.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
        elif TransformersExperts().current(m) is not None:
            freeze_experts_for_serving(m)
    with torch.no_grad():
        assert torch.equal(served.eval()(IDS).logits, frozen.eval()(IDS).logits)
    # The served model, experts frozen, exports the same files again (its frozen codes are
    # written as codes, not as high-precision tensors beside them).
    again = export_pretrained(served, directory.parent / f"{directory.name}-again", format=fmt)
    first, second = (
        load_file(directory / "model.safetensors"),
        load_file(again / "model.safetensors"),
    )
    assert sorted(first) == sorted(second)
    for key, t in first.items():
        assert t.dtype == second[key].dtype and torch.equal(
            t.view(torch.uint8), second[key].view(torch.uint8)
        ), key
    loaded = tiny(moe_config(), 1, granularity)
    given: list[dict[str, ServingWeight]] = []

    def probe(m: Any, weights: dict[str, ServingWeight], *, mode: Any) -> None:
        given.append(dict(weights))
        real_load(m, weights, mode=mode)

    monkeypatch.setattr(hf_load, "load_serving_weights", probe)
    import_pretrained(loaded, directory, mode="train")
    theirs = model_serving_weights(model)
    same_weights(theirs, given[-1])
    params = dict(loaded.named_parameters())
    gate_up = "model.layers.1.mlp.experts.gate_up_proj"
    assert theirs[gate_up].codes.shape == (4, 512, 256)
    for name, w in theirs.items():
        assert torch.equal(params[name], w.dequantize(torch.bfloat16)), name
    hp_theirs, hp_ours = high_precision(model), high_precision(loaded)
    assert list(hp_theirs) == list(hp_ours)
    for name, t in hp_theirs.items():
        assert torch.equal(t, hp_ours[name]), name


def write_with_transformers(model: Any, directory: Path) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-layout checkpoint of bf16 ``model`` by transformers' own code: the names
    ``save_pretrained`` writes (its reverse weight conversion: experts per expert), each
    linear's weight (not the head, the embeddings or the routers) through the fine-grained
    FP8 quantizer's ``Fp8Quantize``, and ``FineGrainedFP8Config``'s config."""
    quant = FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=["lm_head"])
    op = Fp8Quantize(FineGrainedFP8HfQuantizer(quant))
    disk = revert_weight_conversion(model, dict(model.state_dict()))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in disk.items():
        linear = t.dim() == 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight"))
        if linear and ".mlp.gate." not in name:
            tensors.update(op.convert({name: t.contiguous()}))
        else:
            tensors[name] = t.contiguous()
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = json.loads(quant.to_json_string())
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_a_checkpoint_transformers_writes_imports_bit_for_bit(kind: str, tmp_path: Path) -> None:
    config = llama_config() if kind == "llama" else moe_config()
    written = write_with_transformers(tiny(config, 2), tmp_path / "ds")
    loaded = tiny(config, 1, "block")
    if kind == "llama":
        import_pretrained(loaded, tmp_path / "ds")
        got = model_serving_weights(loaded)
        for name in (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
        ):
            assert torch.equal(got[name].codes.view(torch.uint8), written[name].view(torch.uint8))
            assert torch.equal(got[name].steps, written[name + "_scale_inv"])
        assert len(got) == 14
        return
    import_pretrained(loaded, tmp_path / "ds", mode="train")
    experts = loaded.model.layers[0].mlp.experts
    for e in range(4):
        for i, part in enumerate(("gate_proj", "up_proj")):
            prefix = f"model.layers.0.mlp.experts.{e}.{part}.weight"
            w = ServingWeight(written[prefix], written[prefix + "_scale_inv"], "128x128")
            got = experts.gate_up_proj[e, i * 256 : (i + 1) * 256]
            assert torch.equal(got, w.dequantize(torch.bfloat16))


def rewrite(
    directory: Path, target: Path, edit_config: Any = None, edit_tensors: Any = None
) -> Path:
    shutil.copytree(directory, target)
    if edit_config is not None:
        config = json.loads((target / "config.json").read_text())
        edit_config(config["quantization_config"])
        (target / "config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        tensors = load_file(target / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "model.safetensors")
    return target


def int8(q: dict[str, Any]) -> None:
    q["config_groups"]["group_0"]["weights"]["type"] = "int"


def static(q: dict[str, Any]) -> None:
    q["config_groups"]["group_0"]["input_activations"]["dynamic"] = False


def block64(q: dict[str, Any]) -> None:
    q["weight_block_size"] = [64, 64]


def drop(t: dict[str, torch.Tensor]) -> None:
    del t["model.layers.1.self_attn.o_proj.weight_scale"]


def extra(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.1.self_attn.extra.bias"] = torch.zeros(4)


def missing(t: dict[str, torch.Tensor]) -> None:
    del t["model.norm.weight"]


def bad_scale(t: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    t[name] = t[name][:, :1].contiguous()


def fp4_norm(t: dict[str, torch.Tensor]) -> None:
    # Of the model's shape: only the dtype tells it is no norm (copy_ cannot cast it).
    t["model.norm.weight"] = torch.full((256,), 0x22, dtype=torch.uint8).view(
        torch.float4_e2m1fn_x2
    )


def fp8_head(t: dict[str, torch.Tensor]) -> None:
    t["lm_head.weight"] = t["lm_head.weight"].to(torch.float8_e4m3fn)  # codes, no scale


def int_norm(t: dict[str, torch.Tensor]) -> None:
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)


def edit_scale(suffix: str, edit: Any) -> Any:
    def edit_tensors(t: dict[str, torch.Tensor]) -> None:
        name = "model.layers.0.self_attn.q_proj.weight" + suffix
        t[name] = edit(t[name].clone())

    return edit_tensors


def nan_first(s: torch.Tensor) -> torch.Tensor:
    s.view(-1)[0] = float("nan")
    return s


def off_grid(s: torch.Tensor) -> torch.Tensor:
    return s.double() * (1 + 1e-12)


def e8m0_nan(s: torch.Tensor) -> torch.Tensor:
    s.view(-1)[3] = 255  # E8M0's NaN byte
    return s


def mx_as_float(q: dict[str, Any]) -> None:
    q["format"] = "float-quantized"


def mx_group16(q: dict[str, Any]) -> None:
    q["config_groups"]["group_0"]["weights"]["group_size"] = 16


@pytest.mark.parametrize(
    ("model_granularity", "source", "edit_config", "edit_tensors", "match"),
    [
        (
            "block",
            ("block", "fine-grained-fp8"),
            block64,
            None,
            r"weight_block_size \[64, 64\].*\[128, 128\]",
        ),
        ("row", ("block", "fine-grained-fp8"), None, None, r"'e4m3/row.*fine-grained FP8.*128x128"),
        ("tensor", ("block", "compressed-tensors"), None, None, r"'e4m3/dynamic.*strategy 'block'"),
        (
            "tensor",
            ("block", "fine-grained-fp8"),
            None,
            None,
            r"several steps.*one step per weight",
        ),
        ("block", ("block", "compressed-tensors"), int8, None, r"'int' 8-bit weights"),
        ("block", ("block", "compressed-tensors"), static, None, r"static scales"),
        (
            "row",
            ("row", "compressed-tensors"),
            None,
            drop,
            r"not in the checkpoint \(no scale\).*o_proj",
        ),
        ("row", ("row", "compressed-tensors"), None, extra, r"unknown to the model.*extra\.bias"),
        (
            "row",
            ("row", "compressed-tensors"),
            None,
            missing,
            r"missing from the checkpoint.*model\.norm",
        ),
        (
            "block",
            ("block", "fine-grained-fp8"),
            None,
            bad_scale,
            r"up_proj.*\(3, 1\).*takes \(3, 2\)",
        ),
        (
            "block",
            ("block", "fine-grained-fp8"),
            None,
            fp4_norm,
            r"dtype not read: \[\"model\.norm\.weight torch\.float4_e2m1fn_x2 \(the model's: "
            r"torch\.bfloat16\)\"\]; .* float32, bfloat16, float16, float64",
        ),
        ("block", ("block", "fine-grained-fp8"), None, fp8_head, r"lm_head\.weight torch\.float8"),
        ("row", ("row", "compressed-tensors"), None, int_norm, r"model\.norm\.weight torch\.int32"),
        (
            "block",
            ("block", "fine-grained-fp8"),
            None,
            edit_scale("_scale_inv", nan_first),
            r"q_proj\.weight: 1 of the scale's 4 steps are not finite and positive \(.*nan\)",
        ),
        (
            "tensor",
            ("tensor", "compressed-tensors"),
            None,
            edit_scale("_scale", nan_first),
            r"q_proj\.weight: 1 of the scale's 1 steps are not finite and positive",
        ),
        (
            "tensor",
            ("tensor", "compressed-tensors"),
            None,
            edit_scale("_scale", lambda s: -s),
            r"q_proj\.weight: 1 of the scale's 1 steps are not finite and positive",
        ),
        (
            "block",
            ("block", "fine-grained-fp8"),
            None,
            edit_scale("_scale_inv", off_grid),
            r"q_proj\.weight: a float64 scale with 4 value\(s\) that are not float32 values",
        ),
        (
            "row",
            ("row", "compressed-tensors"),
            None,
            edit_scale("_scale", lambda s: s.to(torch.int32)),
            r"q_proj\.weight: the scale is torch\.int32; read here: float32",
        ),
        ("mx", ("block", "compressed-tensors"), None, None, r"'e4m3/mx.*strategy 'block'"),
        ("block", ("mx", "compressed-tensors"), None, None, r"'e4m3/block.*MXFP8.*1x32"),
        ("row", ("mx", "compressed-tensors"), None, None, r"'e4m3/row.*MXFP8"),
        (
            "mx",
            ("mx", "compressed-tensors"),
            None,
            edit_scale("_scale", e8m0_nan),
            r"q_proj\.weight: 1 of the scale's 2048 steps are not finite and positive",
        ),
        (
            "mx",
            ("mx", "compressed-tensors"),
            mx_as_float,
            None,
            r"format 'float-quantized' does not hold its weights' strategy 'group'.*'mxfp8",
        ),
        ("mx", ("mx", "compressed-tensors"), mx_group16, None, r"group_size 16, scale_dtype"),
    ],
)
def test_refusals_name_both_sides_and_change_nothing(
    exported: dict[tuple[str, str, str], Any],
    tmp_path: Path,
    model_granularity: str,
    source: tuple[str, str],
    edit_config: Any,
    edit_tensors: Any,
    match: str,
) -> None:
    _, directory = exported[("llama", *source)]
    target = rewrite(directory, tmp_path / "edited", edit_config, edit_tensors)
    loaded = tiny(llama_config(), 1, model_granularity)
    before = snapshot(loaded)
    with pytest.raises(ValueError, match=match):
        import_pretrained(loaded, target)
    unchanged(loaded, before)


def test_float64_tensors_on_the_float32_grid_import_exactly(
    exported: dict[tuple[str, str, str], Any], tmp_path: Path
) -> None:
    # A float64 scale holding float32 values and a float64 norm (cast to the model's dtype,
    # as from_pretrained casts it) import as the float32 / bf16 originals do.
    model, directory = exported["llama", "block", "fine-grained-fp8"]

    def widen(t: dict[str, torch.Tensor]) -> None:
        for name in ("model.layers.0.self_attn.q_proj.weight_scale_inv", "model.norm.weight"):
            t[name] = t[name].double()

    target = rewrite(directory, tmp_path / "f64", None, widen)
    loaded = tiny(llama_config(), 1, "block")
    import_pretrained(loaded, target)
    same_weights(model_serving_weights(model), model_serving_weights(loaded))
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)


@pytest.mark.parametrize("mode", ["serve", "train"])
def test_a_model_on_the_meta_device_is_refused(
    exported: dict[tuple[str, str, str], Any], mode: Any
) -> None:
    _, directory = exported["llama", "block", "fine-grained-fp8"]
    with torch.device("meta"):
        loaded = tiny(llama_config(), 1, "block")
    with pytest.raises(ValueError, match=r"on the meta device .*model\.to_empty\(device=\.\.\.\)"):
        import_pretrained(loaded, directory, mode=mode)
    assert {t.device.type for t in loaded.state_dict().values()} == {"meta"}
    assert not any(m.frozen for m in loaded.modules() if isinstance(m, QuantizedLinear))


# ----- sharded directories: the index and the shards must agree -----------------------------


def shards(folder: Path, files: dict[str, dict[str, float]], weight_map: dict[str, str]) -> Path:
    """Writes each file's scalar tensors and an index holding ``weight_map``."""
    folder.mkdir()
    for file, tensors in files.items():
        save_file({k: torch.tensor([v]) for k, v in tensors.items()}, folder / file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
GOOD = {A: {"x": 1.0, "y": 2.0}, B: {"z": 3.0}}
MAP = {"x": A, "y": A, "z": B}


def test_a_sharded_directory_reads_by_its_index(tmp_path: Path) -> None:
    folder = shards(tmp_path / "ok", GOOD, MAP)
    got = read_tensors(folder)
    assert {k: v.item() for k, v in got.items()} == {"x": 1.0, "y": 2.0, "z": 3.0}
    assert list(read_tensors(folder, lambda name: name == "z")) == ["z"]


@pytest.mark.parametrize(
    ("files", "weight_map", "match"),
    [
        # Before: the last shard read won (y = 0), whatever the index said.
        (
            {A: {"x": 1.0, "y": 2.0}, B: {"y": 0.0, "z": 3.0}},
            MAP,
            rf"'y' is in two shards, '{A}' and '{B}'",
        ),
        (GOOD, {**MAP, "ghost": A}, rf"lists 1 tensor\(s\) no shard holds .*'ghost', in '{A}'"),
        (GOOD, {"x": A, "z": B}, rf"the shard '{A}' holds 'y', but the index does not list it"),
        (GOOD, {**MAP, "y": B}, rf"the shard '{A}' holds 'y', but the index names '{B}'"),
        (GOOD, {**MAP, "w": "model-00003-of-00002.safetensors"}, r"names the shard 'model-00003"),
        (GOOD, {**MAP, "w": "../x.safetensors"}, r"names the shard '\.\./x\.safetensors'"),
    ],
    ids=["duplicate", "ghost-entry", "unlisted", "misplaced", "missing-shard", "outside"],
)
def test_an_index_its_shards_contradict_is_refused(
    tmp_path: Path, files: dict[str, dict[str, float]], weight_map: dict[str, str], match: str
) -> None:
    folder = shards(tmp_path / "bad", files, weight_map)
    with pytest.raises(ValueError, match=match):
        read_tensors(folder)


def test_a_missing_shard_or_a_bad_index_is_a_value_error(tmp_path: Path) -> None:
    folder = shards(tmp_path / "gone", GOOD, MAP)
    (folder / B).unlink()  # before: FileNotFoundError from safetensors
    with pytest.raises(ValueError, match=rf"names the shard '{B}' \(for 'z' and others\)"):
        read_tensors(folder)
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"index\.json' is not JSON"):
        read_tensors(folder)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(ValueError, match=r"holds no weight_map of tensor names"):
        read_tensors(folder)


def test_import_pretrained_refuses_a_tensor_in_two_shards(
    exported: dict[tuple[str, str, str], Any], tmp_path: Path
) -> None:
    model, _ = exported["llama", "tensor", "compressed-tensors"]
    out = export_pretrained(
        model, tmp_path / "sharded", format="compressed-tensors", max_shard_bytes=2**18
    )
    first, second = sorted(out.glob("model-*.safetensors"))[:2]
    one, two = load_file(first), load_file(second)
    name = sorted(one)[-1]
    save_file({**two, name: torch.zeros_like(one[name])}, second)  # before: the last copy won
    loaded = tiny(llama_config(), 1, "tensor")
    before = snapshot(loaded)
    with pytest.raises(
        ValueError, match=rf"'{name}' is in two shards, '{first.name}' and '{second.name}'"
    ):
        import_pretrained(loaded, out)
    unchanged(loaded, before)
