"""KV-cache scales in ``export_pretrained`` (``hf_checkpoint.kv``), on a tiny Llama (hidden 256,
2 layers, 2 key/value heads) converted here and calibrated with ``calibrate_transformers_kv``.

- A static fp8 KV scheme writes each layer's ``k_scale`` / ``v_scale``: the steps
  ``CtxStaticCache`` serves with, bit for bit (``amax / 448`` in float32; per tensor the
  largest head's), in the shapes compressed_tensors itself registers for its ``kv_cache_scheme``
  strategy (its own ``initialize_qparams``), with the scheme its own classes parse.
- ``read_kv_scales`` gives back a scheme and an amax from which the cache serves exactly the
  written steps.
- A dynamic or absent KV scheme writes no scales; a wrong amax is refused before anything is
  written.
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

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig

from computectx import ComputeCtx
from computectx.dtypes import DType, Fp8Format
from computectx.formats import Recipe, convert_to_quantized
from computectx.formats.seam import static_kv_steps
from computectx.integrations.hf_checkpoint import (
    ExportFormat,
    export_pretrained,
    import_kv_calibration,
    import_pretrained,
)
from computectx.integrations.hf_checkpoint.kv import (
    KvCalibration,
    kv_cache_scheme,
    kv_scale_tensors,
    read_kv_scales,
)
from computectx.integrations.transformers_cache import CtxStaticCache, calibrate_transformers_kv
from computectx.kv_policy import KvFp8
from computectx.nn.kv_steps import held_steps, widen_steps

from .conftest import skip_unless_installed

skip_unless_installed("compressed_tensors", "accelerate")  # checked, not imported (conftest.py)

HEADS = 2
ATTN = "model.layers.{}.self_attn"


@pytest.fixture(scope="module")
def llama() -> Any:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        head_dim=64,
        max_position_embeddings=64,
        intermediate_size=384,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    ctx = ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse("e4m3/block/dynamic/0"))
    convert_to_quantized(model, ctx, min_features=16)
    return model


@pytest.fixture(scope="module")
def amax(llama: Any) -> torch.Tensor:
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    found = calibrate_transformers_kv(llama, [ids])
    assert found.shape == (2, 2, HEADS)
    return found


def scales_of(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    return tensors, config


def served_steps(config: Any, kv: KvFp8, amax: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's (2, S) held steps as ``CtxStaticCache`` builds its stores from ``amax``."""
    ctx = ComputeCtx.serving("cpu").with_kv(kv)
    cache = CtxStaticCache(config, ctx, 4, kv_amax=amax)
    out = []
    for layer in cache.layers:
        cache_layer: Any = layer
        k, v = cache_layer.steps
        out.append(torch.stack([widen_steps(held_steps(s, kv.step)) for s in (k, v)]))
    return out


CASES = [
    ("compressed-tensors", KvFp8(scaling="per_tensor")),
    ("compressed-tensors", KvFp8(scaling="per_head")),
    ("fine-grained-fp8", KvFp8(scaling="per_head", step="bf16")),
]


@pytest.mark.parametrize(("fmt", "kv"), CASES, ids=["ct-tensor", "ct-head", "fg-head-bf16"])
def test_scales_are_the_steps_the_cache_serves_with(
    llama: Any, amax: torch.Tensor, fmt: ExportFormat, kv: KvFp8, tmp_path: Path
) -> None:
    out = export_pretrained(llama, tmp_path / "out", format=fmt, kv=kv, kv_amax=amax)
    tensors, config = scales_of(out)
    quant = config["quantization_config"]
    ct = fmt == "compressed-tensors"
    per_head = ct and kv.scaling == "per_head"
    shape = (HEADS, 1, 1) if per_head else (1,) if ct else ()
    served = served_steps(llama.config, kv, amax)
    for layer in range(2):
        for row, name in enumerate(("k_scale", "v_scale")):
            got = tensors[f"{ATTN.format(layer)}.{name}"]
            assert got.dtype == torch.float32 and tuple(got.shape) == shape
            # The float32 division the policy computes its steps with, bit for bit.
            want = amax[layer, row] / 448.0
            if kv.scaling == "per_tensor" or not ct:  # fine-grained: the largest head's
                want = want.amax(dim=-1, keepdim=True)
            want = widen_steps(held_steps(want, kv.step))
            assert torch.equal(got.reshape(-1), want), (layer, name)
            here = served[layer][row]  # fine-grained: the largest head's
            assert torch.equal(got.reshape(-1), here if ct else here.amax(-1, keepdim=True))
    assert not [k for k in tensors if k.endswith("q_scale")]
    if ct:
        # compressed_tensors' own classes parse the fragment, and its own initialization
        # registers scales of exactly the shape written (imported here: its import is
        # 3 CPU-s, paid at collection by every xdist worker if it were at the top).
        from compressed_tensors.quantization import (  # type: ignore[import-untyped]
            QuantizationArgs,
            QuantizationConfig,
        )
        from compressed_tensors.quantization.lifecycle.initialize import (  # type: ignore[import-untyped]
            initialize_qparams,
        )

        parsed = QuantizationConfig.model_validate(quant).kv_cache_scheme
        assert parsed == QuantizationArgs.model_validate(quant["kv_cache_scheme"])
        assert parsed.strategy == ("attn_head" if per_head else "tensor")
        assert (parsed.type, parsed.num_bits, parsed.dynamic) == ("float", 8, False)
        holder = nn.Module()
        initialize_qparams(holder, "k", parsed, (HEADS, None, 64), torch.float32)
        registered: torch.Tensor = getattr(holder, "k_scale")  # noqa: B009
        assert tuple(registered.shape) == shape
    else:
        assert "kv_cache_scheme" not in quant
    # Read back: the cache built from the amax read serves the written steps exactly.
    back = read_kv_scales(tensors, config, llama)
    assert isinstance(back, KvCalibration)
    assert back.kv == KvFp8(scaling="per_head" if per_head else "per_tensor")
    assert back.amax.shape == amax.shape and back.amax.dtype == torch.float32
    for layer, steps in enumerate(served_steps(llama.config, back.kv, back.amax)):
        for row, name in enumerate(("k_scale", "v_scale")):
            assert torch.equal(steps[row], tensors[f"{ATTN.format(layer)}.{name}"].reshape(-1))


def test_transformers_loads_a_directory_with_kv_scales(
    llama: Any, amax: torch.Tensor, tmp_path: Path
) -> None:
    """transformers 5.24 with compressed-tensors 0.20.1 loads the directory; the scales are
    left unused (its attention's forward takes ``cache``, not the ``past_key_values`` that
    compressed_tensors looks for before it attaches a KV scheme), as docs/serving.md says."""
    kv = KvFp8(scaling="per_head")
    out = export_pretrained(
        llama, tmp_path / "ct", format="compressed-tensors", kv=kv, kv_amax=amax
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = AutoModelForCausalLM.from_pretrained(
            out,
            dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(dequantize=True),
        )
    assert not hasattr(loaded.model.layers[0].self_attn, "k_scale")


def test_a_dynamic_or_absent_kv_scheme_writes_no_scales(
    llama: Any, amax: torch.Tensor, tmp_path: Path
) -> None:
    for kv in (None, DType.BF16, KvFp8()):
        assert kv_scale_tensors(llama, "compressed-tensors", kv, None) == {}
        assert kv_cache_scheme("compressed-tensors", kv) is None
    out = export_pretrained(llama, tmp_path / "out", format="compressed-tensors", kv=KvFp8())
    tensors, config = scales_of(out)
    assert not [k for k in tensors if k.endswith(("k_scale", "v_scale"))]
    assert config["quantization_config"]["kv_cache_scheme"] is None
    assert read_kv_scales(tensors, config, llama) is None


def test_a_wrong_kv_setting_is_refused_before_writing(
    llama: Any, amax: torch.Tensor, tmp_path: Path
) -> None:
    target = tmp_path / "out"
    static = KvFp8(scaling="per_head")
    bad = amax.clone()
    bad[1, 0, 1] = float("inf")
    cases: list[tuple[Any, Any, str]] = [
        (static, amax[:, :, :1], r"kv_amax must have shape .* \(2, 2, 2\).* got \(2, 2, 1\)"),
        (static, amax[0], r"kv_amax must have shape"),
        (static, bad, r"finite and positive: layer 1 keys of head 1 is inf"),
        (static, None, r"static scheme and no kv_amax was given"),
        (KvFp8(), amax, r"takes no kv_amax"),
        (None, amax, r"takes no kv_amax"),
        (KvFp8(format=Fp8Format.E5M2, scaling="per_tensor"), amax, r"e4m3 codes"),
        ("e4m3/per_head", amax, r"takes a KvFp8, a DType or None"),
    ]
    for kv, kv_amax, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            export_pretrained(llama, target, format="fine-grained-fp8", kv=kv, kv_amax=kv_amax)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_read_refuses_scales_that_do_not_fit_the_model(llama: Any, amax: torch.Tensor) -> None:
    kv = KvFp8(scaling="per_head")
    tensors = kv_scale_tensors(llama, "compressed-tensors", kv, amax)
    fragment = kv_cache_scheme("compressed-tensors", kv)
    assert fragment is not None
    config = {
        "quantization_config": {"quant_method": "compressed-tensors", "kv_cache_scheme": fragment}
    }
    assert read_kv_scales(tensors, config, llama) is not None
    missing = {k: v for k, v in tensors.items() if not k.startswith(ATTN.format(1))}
    with pytest.raises(ValueError, match=r"do not match the model's 2 attention modules"):
        read_kv_scales(missing, config, llama)
    name = f"{ATTN.format(0)}.v_scale"
    with pytest.raises(ValueError, match=rf"KV scale {name}: per_head scales are 2"):
        read_kv_scales({**tensors, name: torch.ones(3)}, config, llama)
    zero = torch.tensor([0.0, 1.0]).reshape(2, 1, 1)
    with pytest.raises(
        ValueError, match=rf"KV scale {name}.*whose head 0's scale is 0 \(1 of 2 refused\)$"
    ):
        read_kv_scales({**tensors, name: zero}, config, llama)
    # attn_head scales are (H, 1, 1) exactly: the same two values in another shape are refused.
    for shape in [(2,), (1, 2), (2, 1)]:
        got = re.escape(f"of shape (2, 1, 1), got torch.float32 {shape}")
        with pytest.raises(ValueError, match=got):
            read_kv_scales({**tensors, name: tensors[name].reshape(shape)}, config, llama)
    # float64 scales: read when each value is a float32, refused off that grid; ints refused.
    wide = {k: v.double() for k, v in tensors.items()}
    back64, back32 = read_kv_scales(wide, config, llama), read_kv_scales(tensors, config, llama)
    assert back64 is not None and back32 is not None and torch.equal(back64.amax, back32.amax)
    with pytest.raises(ValueError, match=rf"KV scale {name}: a float64 scale with 2 value"):
        read_kv_scales({**tensors, name: tensors[name].double() * (1 + 1e-12)}, config, llama)
    with pytest.raises(ValueError, match=rf"KV scale {name}: the scale is torch.int64"):
        read_kv_scales({**tensors, name: torch.ones(2, 1, 1, dtype=torch.long)}, config, llama)
    with pytest.raises(ValueError, match="has no k_scale / v_scale tensors"):
        read_kv_scales({}, config, llama)
    dynamic = {**config["quantization_config"], "kv_cache_scheme": {**fragment, "dynamic": True}}
    with pytest.raises(ValueError, match="is not a KV scheme read here"):
        read_kv_scales(tensors, {"quantization_config": dynamic}, llama)
    # A fine-grained checkpoint's scalar scales read as per tensor.
    scalars = kv_scale_tensors(llama, "fine-grained-fp8", kv, amax)
    back = read_kv_scales(scalars, {"quantization_config": {"quant_method": "fp8"}}, llama)
    assert back is not None and back.kv == KvFp8(scaling="per_tensor")
    assert torch.equal(
        static_kv_steps(back.amax[0], back.kv)[0], scalars[f"{ATTN.format(0)}.k_scale"].reshape(1)
    )
    # Per tensor: () (fine-grained, vLLM) or (1,) (compressed-tensors) are read, nothing else.
    ones = {k: v.reshape(1) for k, v in scalars.items()}
    again = read_kv_scales(ones, {"quantization_config": {"quant_method": "fp8"}}, llama)
    assert again is not None and torch.equal(again.amax, back.amax)
    k0 = f"{ATTN.format(0)}.k_scale"
    with pytest.raises(ValueError, match=r"per_tensor scales are 1 .* of shape \(\) or \(1,\)"):
        read_kv_scales(
            {**scalars, k0: scalars[k0].reshape(1, 1, 1)},
            {"quantization_config": {"quant_method": "fp8"}},
            llama,
        )


def test_an_imported_checkpoint_serves_with_its_kv_scales(
    llama: Any, amax: torch.Tensor, tmp_path: Path
) -> None:
    # export -> import_pretrained (the scales checked, the weights loaded) and
    # import_kv_calibration (only the scales read): the cache built from what it returns
    # serves with the written steps, bit for bit.
    kv = KvFp8(scaling="per_head")
    out = export_pretrained(
        llama, tmp_path / "out", format="compressed-tensors", kv=kv, kv_amax=amax
    )
    copy_ = copy.deepcopy(llama)
    import_pretrained(copy_, out, mode="train")
    cal = import_kv_calibration(copy_, out)
    assert cal is not None and cal.kv == kv
    tensors, _ = scales_of(out)
    for layer, steps in enumerate(served_steps(llama.config, cal.kv, cal.amax)):
        for row, name in enumerate(("k_scale", "v_scale")):
            assert torch.equal(steps[row], tensors[f"{ATTN.format(layer)}.{name}"].reshape(-1))
    plain = export_pretrained(llama, tmp_path / "plain", format="compressed-tensors")
    assert import_kv_calibration(copy_, plain) is None
