"""4-bit models as compressed-tensors NVFP4 / MXFP4 checkpoints (``hf_checkpoint.fp4``), on a
tiny Llama (hidden 64, 1 layer, vocab 128) converted here under ``nvfp4`` and ``mxfp4``.

- compressed-tensors decodes the exported tensors (its own ``NVFP4PackedCompressor`` /
  ``MXFP4PackedCompressor.decompress`` on the CPU, directly and through transformers'
  ``CompressedTensorsConfig(dequantize=True)``) to our dequantized weights at bfloat16, bit for
  bit, including a layer whose ``S_enc`` compressed-tensors' division would decode otherwise;
- the round trip: export, import into a model converted alike gives the same codes, scales and
  amax bit for bit, and the same logits;
- the refusals come before anything changes.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig

from computectx import ComputeCtx
from computectx.formats import (
    FrozenFp4Linear,
    calibrate_fp4_activations,
    convert_to_quantized,
    freeze_fp4_for_serving,
)
from computectx.formats.numerics.fp4 import Nvfp4Operand, global_encode_scale
from computectx.integrations.hf_checkpoint import export_pretrained, import_pretrained
from computectx.integrations.hf_checkpoint.fp4 import AMAX_KEY, INPUT_AMAX_KEY

from .conftest import skip_unless_installed

skip_unless_installed("compressed_tensors")  # checked, not imported (see conftest.py)

# Every NVFP4 export of the Llama warns that vLLM would fuse q/k/v and gate/up under one global
# scale (asserted in test_compressed_tensors_decodes_to_our_weights).
pytestmark = pytest.mark.filterwarnings("ignore:export_pretrained.*vLLM fuses:UserWarning")
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
FLAGS = ("nvfp4", "mxfp4")


@pytest.fixture(scope="module")
def base() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def converted(base: Any, flag: str) -> Any:
    model = copy.deepcopy(base)
    convert_to_quantized(model, ComputeCtx.from_flag(flag, "cpu"), min_features=16)
    return model


def frozen_layers(model: nn.Module) -> dict[str, FrozenFp4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FrozenFp4Linear)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.uint8)


def decompress(out: Path, name: str) -> torch.Tensor:
    """compressed-tensors' own decompressor of the directory's layer ``name`` (bfloat16)."""
    from compressed_tensors.compressors import BaseCompressor  # type: ignore[import-untyped]
    from compressed_tensors.quantization import QuantizationScheme  # type: ignore[import-untyped]

    q = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(q["config_groups"]["group_0"])
    tensors = load_file(out / "model.safetensors")
    state = {k.removeprefix(name + "."): t for k, t in tensors.items() if k.startswith(name + ".")}
    compressor = BaseCompressor.get_value_from_registry(q["format"])
    weight: torch.Tensor = compressor.decompress(state, scheme)["weight"]
    return weight


@pytest.mark.parametrize("flag", FLAGS)
def test_compressed_tensors_decodes_to_our_weights(base: Any, flag: str, tmp_path: Path) -> None:
    model = converted(base, flag)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    fused = [str(w.message) for w in caught if "vLLM fuses" in str(w.message)]
    # NVFP4: q/k/v and gate/up quantized with their own amaxes: vLLM's one global scale warned
    assert len(fused) == (flag == "nvfp4") and (not fused or "2 group(s)" in fused[0])
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["format"] == f"{flag}-pack-quantized" and q["ignore"] == ["lm_head"]
    group = q["config_groups"]["group_0"]
    assert group["input_activations"] is None  # weight-only: no static activation scale here
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["group_size"]) == (
        4, "float", 16 if flag == "nvfp4" else 32,
    )  # fmt: skip
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.up_proj"
    assert tensors[f"{name}.weight_packed"].dtype == torch.uint8
    assert tensors[f"{name}.weight_packed"].shape == (128, 32)
    scale_dtype = torch.float8_e4m3fn if flag == "nvfp4" else torch.uint8
    assert tensors[f"{name}.weight_scale"].dtype == scale_dtype
    assert (f"{name}.weight_global_scale" in tensors) == (flag == "nvfp4")
    assert (AMAX_KEY in config) == (flag == "nvfp4")
    freeze_fp4_for_serving(model)
    ours = {n: m.dequantized_weight(torch.bfloat16) for n, m in frozen_layers(model).items()}
    assert len(ours) == 7
    for n, w in ours.items():
        assert torch.equal(bits(decompress(out, n)), bits(w)), n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
    held = dict(loaded.named_parameters())
    for n, w in ours.items():
        assert torch.equal(held[f"{n}.weight"], w.float()), n


def test_the_global_scale_moves_where_division_would_round_another_way(
    base: Any, tmp_path: Path
) -> None:
    """amax 41.71875: S_enc = 2688 / amax is a float32 for which ``scale / S_enc`` (theirs)
    and ``scale * (1 / S_enc)`` (ours) round some code times scale to different bfloat16s, so
    the export writes a neighbour of S_enc, and compressed-tensors decodes our weight."""
    model = converted(base, "nvfp4")
    freeze_fp4_for_serving(model)
    codes = torch.randint(0, 256, (64, 32), dtype=torch.uint8, generator=torch.Generator())
    scale = (torch.arange(64 * 4) % 126 + 1).to(torch.uint8).reshape(64, 4)  # every E4M3 > 0
    amax = torch.tensor(41.71875)
    q = Nvfp4Operand(
        codes.view(torch.float4_e2m1fn_x2), scale.view(torch.float8_e4m3fn), amax, "1x16"
    )
    name = "model.layers.0.self_attn.q_proj"
    model.get_submodule("model.layers.0.self_attn").q_proj = FrozenFp4Linear(q)
    out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    tensors = load_file(out / "model.safetensors")
    g = tensors[f"{name}.weight_global_scale"]
    s_enc = global_encode_scale(amax).reshape(1)
    assert not torch.equal(g, s_enc) and abs(g.item() / s_enc.item() - 1) < 1e-6
    ours = model.get_submodule(name).dequantized_weight(torch.bfloat16)
    assert torch.equal(bits(decompress(out, name)), bits(ours))
    # With S_enc itself, compressed-tensors' decode is not ours: the neighbour is needed.
    tensors[f"{name}.weight_global_scale"] = s_enc
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert not torch.equal(bits(decompress(out, name)), bits(ours))


def test_where_no_global_scale_decodes_alike_the_export_warns_and_round_trips(
    base: Any, tmp_path: Path
) -> None:
    """amax 41.7375: S_enc's ties round oppositely under the two decodes for different scales,
    and no float32 near it decodes every scale and code alike: the export writes the closest
    (fewest pairs apart), warns, and the round trip is still bit for bit."""
    model = converted(base, "nvfp4")
    freeze_fp4_for_serving(model)
    codes = torch.arange(64 * 32, dtype=torch.int64).remainder(256).to(torch.uint8)
    scale = (torch.arange(64 * 4) % 126 + 1).to(torch.uint8).reshape(64, 4)
    amax = torch.tensor(0x4226F334, dtype=torch.int32).view(torch.float32)  # 41.7375...
    q = Nvfp4Operand(
        codes.reshape(64, 32).view(torch.float4_e2m1fn_x2),
        scale.view(torch.float8_e4m3fn),
        amax,
        "1x16",
    )
    name = "model.layers.0.self_attn.q_proj"
    model.get_submodule("model.layers.0.self_attn").q_proj = FrozenFp4Linear(q)
    with pytest.warns(UserWarning, match=r"q_proj: no float32 weight_global_scale.*48 \(scale"):
        out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    ours = model.get_submodule(name).dequantized_weight(torch.bfloat16)
    theirs = decompress(out, name)
    apart = bits(theirs) != bits(ours)
    assert int(apart.sum()) > 0 and bool(
        ((bits(theirs).int() - bits(ours).int()).abs()[apart] == 1).all()
    )  # one bfloat16 step apart, where apart
    served = converted(base, "nvfp4")
    freeze_fp4_for_serving(served)
    served.get_submodule("model.layers.0.self_attn").q_proj = FrozenFp4Linear(q)
    held = served.get_submodule(name)
    held.weight_amax.zero_()
    import_pretrained(served, out)
    assert held.weight_amax.view(torch.int32).item() == 0x4226F334


@pytest.mark.parametrize("flag", FLAGS)
def test_the_round_trip_is_bit_for_bit(base: Any, flag: str, tmp_path: Path) -> None:
    trained = converted(base, flag)
    out = export_pretrained(trained, tmp_path / "ct", format="compressed-tensors")
    served = converted(base, flag)
    freeze_fp4_for_serving(served, "w4a4")  # the import keeps the frozen layers' mode
    assert import_pretrained(served, out) is served
    plain = converted(base, flag)  # Fp4Linear layers: frozen weight-only by the import
    import_pretrained(plain, out)
    train = converted(base, flag)
    import_pretrained(train, out, mode="train")
    freeze_fp4_for_serving(trained, "w4a4")
    theirs, ours = frozen_layers(trained), frozen_layers(served)
    assert set(ours) == set(theirs) == set(frozen_layers(plain))
    for n, layer in theirs.items():
        for a, b in zip(layer.weight_tensors(), ours[n].weight_tensors(), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
        assert frozen_layers(plain)[n].mode == "weight_only" and ours[n].mode == "w4a4"
        w = layer.dequantized_weight(torch.bfloat16)
        assert torch.equal(train.get_submodule(n).weight, w), n
    with torch.no_grad():
        assert torch.equal(trained(IDS).logits, served(IDS).logits)
        weight_only = converted(base, flag)
        freeze_fp4_for_serving(weight_only)
        import_pretrained(weight_only, out)
        assert torch.equal(weight_only(IDS).logits, plain(IDS).logits)


def test_a_checkpoint_without_our_amax_is_read_from_its_global_scale(
    base: Any, tmp_path: Path
) -> None:
    """llm-compressor's checkpoints carry no amax: the import takes one whose decode is
    compressed-tensors' at bfloat16."""
    model = converted(base, "nvfp4")
    out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    del config[AMAX_KEY]
    (out / "config.json").write_text(json.dumps(config))
    served = converted(base, "nvfp4")
    import_pretrained(served, out)
    for n, layer in frozen_layers(served).items():
        assert torch.equal(bits(decompress(out, n)), bits(layer.dequantized_weight(torch.bfloat16)))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return set(after) == set(before) and all(
        torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))
        if before[k].dtype in (torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float8_e8m0fnu)
        else torch.equal(before[k], after[k])
        for k in before
    )


def test_refusals(base: Any, tmp_path: Path) -> None:
    nv = converted(base, "nvfp4")
    with pytest.raises(ValueError, match=r"cannot hold 4-bit weights.*'compressed-tensors'"):
        export_pretrained(nv, tmp_path / "fg", format="fine-grained-fp8")
    assert not (tmp_path / "fg").exists()
    out = export_pretrained(nv, tmp_path / "ct", format="compressed-tensors")
    config = json.loads((out / "config.json").read_text())

    def refused(model: nn.Module, match: str, edit: dict[str, Any] | None = None) -> None:
        if edit is not None:
            (out / "config.json").write_text(json.dumps({**config, **edit}))
        before = _state(model)
        with pytest.raises(ValueError, match=match):
            import_pretrained(model, out)
        assert _unchanged(model, before)
        (out / "config.json").write_text(json.dumps(config))

    served = converted(base, "nvfp4")
    freeze_fp4_for_serving(served)
    refused(converted(base, "mxfp4"), "is a mxfp4 layer and the directory holds nvfp4")
    static = copy.deepcopy(config["quantization_config"])
    static["config_groups"]["group_0"]["input_activations"] = {"dynamic": "local", "num_bits": 4}
    refused(served, "static scales.*weight-only", {"quantization_config": static})
    amax = dict(config[AMAX_KEY])
    amax["model.layers.0.mlp.up_proj"] *= 2
    refused(served, "were not written together", {AMAX_KEY: amax})
    one_row = converted(base, "nvfp4")
    nv_ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    assert nv_ctx.recipe is not None
    convert_ctx = nv_ctx.replace(recipe=nv_ctx.recipe.model_copy(update={"weight_tile": "1x16"}))
    rows = copy.deepcopy(base)
    convert_to_quantized(rows, convert_ctx, min_features=16)
    rows_out = export_pretrained(rows, tmp_path / "rows", format="compressed-tensors")
    before = _state(one_row)
    with pytest.raises(ValueError, match="differ within a 16x16 tile"):
        import_pretrained(one_row, rows_out)
    assert _unchanged(one_row, before)
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_global_scale"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    refused(served, "weight_global_scale is missing")


def static_w4a4(base: Any) -> Any:
    """The NVFP4 Llama frozen for static W4A4 and calibrated on two batches."""
    model = converted(base, "nvfp4")
    freeze_fp4_for_serving(model, "w4a4", activation_amax="static")
    calibrate_fp4_activations(model, [IDS, IDS.flip(1)])
    return model


def test_static_w4a4_exports_as_compressed_tensors_nvfp4_and_round_trips(
    base: Any, tmp_path: Path
) -> None:
    from compressed_tensors.quantization import QuantizationScheme

    model = static_w4a4(base)
    out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    a = QuantizationScheme.model_validate(group).input_activations
    assert (a.dynamic, a.strategy, a.group_size, a.num_bits) == ("local", "tensor_group", 16, 4)
    tensors = load_file(out / "model.safetensors")
    layers = frozen_layers(model)
    for n, layer in layers.items():  # the encode scale of the calibrated amax, as G is
        g = tensors[f"{n}.input_global_scale"]
        assert g.dtype == torch.float32 and torch.equal(g, global_encode_scale(layer.input_amax))
        assert config[INPUT_AMAX_KEY][n] == layer.input_amax.item()
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    for fused in ([f"{attn}.{p}_proj" for p in "qkv"], [f"{mlp}.gate_proj", f"{mlp}.up_proj"]):
        # vLLM fuses these: they read one input, so one calibrated amax and one global scale.
        assert len({tensors[f"{n}.input_global_scale"].item() for n in fused}) == 1
    plain = converted(base, "nvfp4")  # Fp4Linear layers: frozen static W4A4 by the import
    import_pretrained(plain, out)
    served = converted(base, "nvfp4")
    freeze_fp4_for_serving(served, "w4a4", activation_amax="static")  # not calibrated
    import_pretrained(served, out)
    for into in (plain, served):
        got = frozen_layers(into)
        assert set(got) == set(layers)
        for n, layer in layers.items():
            assert (got[n].mode, got[n].activation_amax) == ("w4a4", "static")
            for x, y in zip(layer.weight_tensors(), got[n].weight_tensors(), strict=True):
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), n
            assert got[n].input_calibrated and torch.equal(got[n].input_amax, layer.input_amax)
        with torch.no_grad():
            assert torch.equal(into(IDS).logits, model(IDS).logits)


UP = "model.layers.0.mlp.up_proj"


def test_static_w4a4_without_our_amax_and_its_refusals(base: Any, tmp_path: Path) -> None:
    model = static_w4a4(base)
    out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    bare = {k: v for k, v in config.items() if k != INPUT_AMAX_KEY}  # ModelOpt's, converted
    (out / "config.json").write_text(json.dumps(bare))
    plain = converted(base, "nvfp4")
    import_pretrained(plain, out)
    tensors = load_file(out / "model.safetensors")
    for n, layer in frozen_layers(plain).items():  # an amax whose S_enc is the checkpoint's G
        assert torch.equal(
            global_encode_scale(layer.input_amax), tensors[f"{n}.input_global_scale"]
        )
    (out / "config.json").write_text(json.dumps(config))
    per_row = converted(base, "nvfp4")
    freeze_fp4_for_serving(per_row, "w4a4")
    for target, edit, match in [
        (per_row, {}, "static input scales and .* serves activation_amax='per_row'"),
        (
            converted(base, "nvfp4"),
            {INPUT_AMAX_KEY: {**config[INPUT_AMAX_KEY], UP: 1e9}},
            "were not written together",
        ),
    ]:
        (out / "config.json").write_text(json.dumps({**config, **edit}))
        before = _state(target)
        with pytest.raises(ValueError, match=match):
            import_pretrained(target, out)
        assert _unchanged(target, before)
    # An input amax of 0 (S_enc 1: the pair is consistent) is a static layer's refusal: named
    # before anything installs (before: raised inside the install, earlier layers written).
    zero = {**tensors, f"{UP}.input_global_scale": torch.ones(1)}
    save_file(zero, out / "model.safetensors", metadata={"format": "pt"})
    for amax in (0.0, -0.0):
        (out / "config.json").write_text(
            json.dumps({**config, INPUT_AMAX_KEY: {**config[INPUT_AMAX_KEY], UP: amax}})
        )
        target = converted(base, "nvfp4")
        before = _state(target)
        with pytest.raises(ValueError, match=f"{UP} .*input_amax must be finite and > 0"):
            import_pretrained(target, out)
        assert _unchanged(target, before)
    (out / "config.json").write_text(json.dumps(config))
    del tensors["model.layers.0.mlp.up_proj.input_global_scale"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="input_global_scale is missing"):
        import_pretrained(converted(base, "nvfp4"), out)
    raw = converted(base, "nvfp4")
    freeze_fp4_for_serving(raw, "w4a4", activation_amax="static")
    with pytest.raises(ValueError, match="not calibrated"):
        export_pretrained(raw, tmp_path / "raw", format="compressed-tensors")
    assert not (tmp_path / "raw").exists()
    weight_only = export_pretrained(
        converted(base, "nvfp4"), tmp_path / "wo", format="compressed-tensors"
    )
    import_pretrained(model, weight_only)  # new weights: the old calibration is not theirs
    assert not any(m.input_calibrated for m in frozen_layers(model).values())


def test_bad_scales_and_amax_entries_are_named(base: Any, tmp_path: Path) -> None:
    """A NaN or negative block scale is named as such (before the 16x16-tile check); an amax
    entry that is not a finite float32 >= 0 is named invalid, one naming no weight and one on
    an MXFP4 checkpoint are refused; ``symmetric: false`` is named."""
    out = export_pretrained(converted(base, "nvfp4"), tmp_path / "ct", format="compressed-tensors")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    up = "model.layers.0.mlp.up_proj"

    def refused(
        match: str, cfg: dict[str, Any], edit: dict[str, torch.Tensor] | None = None
    ) -> None:
        (out / "config.json").write_text(json.dumps(cfg))
        save_file({**tensors, **(edit or {})}, out / "model.safetensors", metadata={"format": "pt"})
        model = converted(base, "nvfp4")  # 16x16 tiles
        before = _state(model)
        with pytest.raises(ValueError, match=match):
            import_pretrained(model, out)
        assert _unchanged(model, before)

    for byte in (0x7F, 0xB8):  # NaN, -1.0
        scale = tensors[f"{up}.weight_scale"].clone()
        scale.view(torch.uint8)[0, 0] = byte
        refused(
            r"up_proj: block scales must be finite and >= 0", config, {f"{up}.weight_scale": scale}
        )
    for amax in (-1.0, float("nan"), float("inf"), 1e39, 0.1):  # 0.1 is not a float32
        bad = {**config, AMAX_KEY: {**config[AMAX_KEY], up: amax}}
        refused(rf"{AMAX_KEY}\['{up}'\] is an invalid amax {re.escape(repr(amax))}: ", bad)
    stray = {**config, AMAX_KEY: {**config[AMAX_KEY], "model.layers.0.mlp.typo_proj": 1.0}}
    refused(r"names 1 weight\(s\) .*no 4-bit weight for \(the first: '.*typo_proj'\)", stray)
    q = copy.deepcopy(config["quantization_config"])
    q["config_groups"]["group_0"]["weights"]["symmetric"] = False
    refused(
        r"strategy, symmetric\) = \(.*, False\); read here: \(.*, True\)",
        {**config, "quantization_config": q},
    )
    mx = export_pretrained(converted(base, "mxfp4"), tmp_path / "mx", format="compressed-tensors")
    mx_config = json.loads((mx / "config.json").read_text())
    (mx / "config.json").write_text(json.dumps({**mx_config, AMAX_KEY: config[AMAX_KEY]}))
    with pytest.raises(ValueError, match=rf"holds {AMAX_KEY} .* the checkpoint is MXFP4"):
        import_pretrained(converted(base, "mxfp4"), mx)


def test_a_global_scale_is_read_as_the_fp8_scales_are(base: Any, tmp_path: Path) -> None:
    """``G`` in float64 holding a float32 value, or of shape ``()``, imports bit for bit; a
    float64 no float32 holds, or shape ``(1, 1)``, is refused naming it."""
    model = converted(base, "nvfp4")
    out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight_global_scale"
    g = tensors[name]
    freeze_fp4_for_serving(model)
    for edit in (g.double(), g.reshape(())):
        save_file({**tensors, name: edit}, out / "model.safetensors", metadata={"format": "pt"})
        served = converted(base, "nvfp4")
        import_pretrained(served, out)
        for n, layer in frozen_layers(served).items():
            held = frozen_layers(model)[n]
            assert all(
                torch.equal(bits(a), bits(b))
                for a, b in zip(held.weight_tensors(), layer.weight_tensors(), strict=True)
            )
    off = g.double() * (1 + 2.0**-40)
    for edit, match in (
        (off, rf"{name} is float64 \(1,\), a value no float32 holds"),
        (g.reshape(1, 1), rf"{name} is float32 \(1, 1\); read here: shape \(1,\) or \(\)"),
    ):
        save_file({**tensors, name: edit}, out / "model.safetensors", metadata={"format": "pt"})
        served = converted(base, "nvfp4")
        before = _state(served)
        with pytest.raises(ValueError, match=match):
            import_pretrained(served, out)
        assert _unchanged(served, before)


def test_a_tied_head_frozen_in_4_bit_exports_untied(base: Any, tmp_path: Path) -> None:
    """Frozen, a converted tied head holds its own codes: config.json says
    ``tie_word_embeddings: false`` (before: true, contradicting the checkpoint's 4-bit head)."""
    config = copy.deepcopy(base.config)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    model = copy.deepcopy(tied)
    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    convert_to_quantized(model, ctx, min_features=16, include_head=True)
    with pytest.raises(ValueError, match=r"lm_head\.weight is tied to model\.embed_tokens\.weight"):
        export_pretrained(model, tmp_path / "unfrozen", format="compressed-tensors")
    freeze_fp4_for_serving(model)
    out = export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight_packed" in load_file(out / "model.safetensors")
    served = copy.deepcopy(tied)
    convert_to_quantized(served, ctx, min_features=16, include_head=True)
    freeze_fp4_for_serving(served)
    import_pretrained(served, out)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, served(IDS).logits)


@pytest.mark.parametrize(
    ("flag", "parts", "want"),
    [
        # k/v (q_proj high precision): before, no warning at all
        (
            "nvfp4",
            ("k_proj", "v_proj", "up_proj"),
            ["self_attn.{k_proj,v_proj}", "mlp: {gate_proj,up_proj} with {gate_proj}"],
        ),
        ("mxfp4", ("q_proj", "k_proj"), ["self_attn: {q_proj,k_proj,v_proj} with {v_proj}"]),
    ],
)
def test_fused_groups_warn_for_any_two_4_bit_parts_and_for_mixed_precision(
    base: Any, tmp_path: Path, flag: str, parts: tuple[str, ...], want: list[str]
) -> None:
    model = copy.deepcopy(base)
    ctx = ComputeCtx.from_flag(flag, "cpu")
    convert_to_quantized(model, ctx, module_filter=lambda _, name: name.endswith(parts))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_pretrained(model, tmp_path / "ct", format="compressed-tensors")
    said = [str(w.message) for w in caught if "vLLM fuses" in str(w.message)]
    assert len(said) == len(want)
    for message, first in zip(said, want, strict=True):
        assert f"(the first: model.layers.0.{first}" in message
    assert all("vLLM refuses to load" in m for m in said if "high-precision" in m)


def test_a_compressed_tensors_input_global_scale_imports_with_its_nearest_amax() -> None:
    # compressed-tensors' generate_gparam computes 448 * 6 / amax as torch's float / tensor,
    # fl(fl(1 / amax) * 2688): for some of its scales no float32 amax has S_enc equal to G.
    # Each imports (refused before), with an S_enc at most one float32 place from G, and a
    # warning naming the layer exactly where the S_enc is not G.
    from compressed_tensors.quantization.utils.helpers import generate_gparam  # type: ignore[import-untyped]

    from computectx.integrations.hf_checkpoint.fp4 import input_amax_of_scale

    torch.manual_seed(0)
    amaxes = torch.exp(torch.randn(400) * 3).float()
    inexact = 0
    for a in amaxes:
        g = generate_gparam(-a.reshape(1), a.reshape(1)).float().reshape(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = input_amax_of_scale("model.layers.0.mlp.up_proj", g, None)
        s_enc = global_encode_scale(got)
        apart = int((s_enc.view(torch.int32) - g.view(torch.int32)).abs())
        assert got.dtype == torch.float32 and got.shape == (1,) and apart <= 1
        named = [w for w in caught if "model.layers.0.mlp.up_proj" in str(w.message)]
        assert len(named) == (1 if apart else 0)
        inexact += apart
    assert inexact > 0  # the case the test is for occurs in the sample


def test_fused_parts_with_different_input_global_scales_warn(base: Any, tmp_path: Path) -> None:
    # One input, so calibrated together q/k/v share one input global scale (no input warning);
    # set apart by hand, vLLM would quantize the fused input with the largest: warned.
    model = static_w4a4(base)
    k = frozen_layers(model)["model.layers.0.self_attn.k_proj"]
    said = []
    for amax in (None, 2 * float(k.input_amax)):
        if amax is not None:
            k.set_input_amax(torch.tensor([amax]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            export_pretrained(model, tmp_path / f"ct{amax}", format="compressed-tensors")
        said += [str(w.message) for w in caught if "weight or input global" in str(w.message)]
    assert len(said) == 2
    assert "input global scales: 0)" in said[0] and "input global scales: 1)" in said[1]
