"""fp8 experts in transformers 5 MoE models (``computectx.integrations.transformers_moe``), on
tiny random Qwen3-MoE, Mixtral and gpt-oss models (hidden 64, 4 experts, top 2, 2 layers).

The references are transformers' own: its ``grouped_mm`` experts function (the default
``experts_implementation``) for the wiring and the numbers, and the unconverted bf16 model for
training. gpt-oss's experts differ in layout (transposed ``(E, in, out)`` weights, biases,
interleaved gate/up columns, a clamped gate): they convert too, and are checked here at the
module level (its sliding-window layers are not what ``CtxStaticCache`` serves).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GptOssConfig,
    MixtralConfig,
    PreTrainedConfig,
    Qwen3MoeConfig,
)
from transformers.integrations.moe import grouped_mm_experts_forward

from computectx import ComputeCtx
from computectx.activations import SaveMode
from computectx.formats import Backend, QuantizedExperts, convert_to_quantized
from computectx.integrations.transformers_cache import CtxStaticCache, CtxStaticLayer
from computectx.integrations.transformers_moe import (
    FP8_ATTR,
    IMPLEMENTATION,
    TransformersExperts,
    freeze_experts_for_serving,
    load_fp8_pretrained,
)
from computectx.kv_policy import KvFp8

VOCAB, HIDDEN, EXPERTS, TOP_K = 128, 64, 4, 2
HYBRID = ComputeCtx.from_flag("fp8_hybrid", "cpu")
ROWWISE = ComputeCtx.from_flag("fp8_rowwise", "cpu")
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts_per_tok": TOP_K,
    "max_position_embeddings": 64,
    "attn_implementation": "eager",  # a PreTrainedConfig keyword
}


def tiny(kind: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A random model at ``dtype`` as ``from_pretrained`` builds one (rotary tables float32)."""
    config: PreTrainedConfig
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            **COMMON, intermediate_size=128, moe_intermediate_size=32, num_experts=EXPERTS
        )
    elif kind == "mixtral":
        config = MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=EXPERTS)
    else:
        config = GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=EXPERTS)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def experts_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if TransformersExperts().weights(m) is not None]


def only_experts(module: nn.Module, fqn: str) -> bool:
    return fqn.endswith(".experts")


def first_experts(module: nn.Module, fqn: str) -> bool:
    return fqn == "model.layers.0.mlp.experts"


def ids_of(seed: int, batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def routing(seed: int, tokens: int, sentinel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 of 4 experts per token, expert 3 never chosen (an empty group); with
    ``sentinel``, some slots point past the experts (expert parallelism's sentinels), their
    weights zero as transformers' EP dispatch leaves them."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS - 1, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g).softmax(-1)
    if sentinel:
        index[::3, 1] = EXPERTS
        weights[::3, 1] = 0.0
    return index, weights


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref64, x64 = ref.detach().double(), x.detach().double()
    return 10 * math.log10(float(ref64.pow(2).sum()) / float((x64 - ref64).pow(2).sum()))


class ExactMm(QuantizedExperts):
    """A ``QuantizedExperts`` whose ``mm`` is torch's bf16 grouped GEMM: the fp8 function's
    routing,
    layout, bias, gate and combine, compared with transformers' ``grouped_mm`` path alone."""

    def mm(
        self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, save: SaveMode = "keep"
    ) -> torch.Tensor:
        return torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=offs)


class Counting(QuantizedExperts):
    """``QuantizedExperts`` itself, recording the weight shape of every call."""

    shapes: ClassVar[list[tuple[int, ...]]] = []

    def mm(
        self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, save: SaveMode = "keep"
    ) -> torch.Tensor:
        Counting.shapes.append(tuple(w.shape))
        return super().mm(x, w, offs, save)


@pytest.mark.parametrize(
    ("kind", "sentinel"),
    [("qwen3_moe", False), ("mixtral", False), ("gpt_oss", False), ("qwen3_moe", True)],
)
def test_the_fp8_function_is_transformers_grouped_mm_with_other_gemms(
    kind: str, sentinel: bool
) -> None:
    model = tiny(kind)
    module: Any = experts_of(model)[0]
    module._is_expert_parallel = sentinel
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    index, weights = routing(2, 24, sentinel)
    want = grouped_mm_experts_forward(module, x, index, weights.bfloat16())
    TransformersExperts().convert(module, ExactMm(HYBRID.fp8, Backend.REFERENCE))  # type: ignore[arg-type]
    assert module.config._experts_implementation == IMPLEMENTATION
    got = module(x, index, weights.bfloat16())
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_converted_experts_run_their_gemms_in_fp8(kind: str) -> None:
    model = tiny(kind)
    report = convert_to_quantized(model, HYBRID, module_filter=only_experts)
    modules = experts_of(model)
    assert report.experts == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert set(report.experts) <= set(report.converted)
    module: Any = modules[0]
    fp8 = TransformersExperts().current(module)
    assert fp8 == QuantizedExperts(HYBRID.fp8, Backend.REFERENCE)  # type: ignore[arg-type]
    assert fp8 is not None
    Counting.shapes.clear()
    TransformersExperts().convert(module, Counting(fp8.policy, fp8.backend))

    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, HIDDEN, generator=g).bfloat16().requires_grad_()
    index, weights = routing(2, 24)
    got = module(x, index, weights.bfloat16())
    got.float().pow(2).sum().backward()
    # gate_up, then down, each as [E, N, K] (gpt-oss's transposed weights as views).
    assert Counting.shapes == [(EXPERTS, 64, HIDDEN), (EXPERTS, HIDDEN, 32)]
    grads = [x.grad, *(p.grad for p in module.parameters())]
    x.grad = None
    module.zero_grad()
    TransformersExperts().convert(module, None)  # back to transformers' grouped_mm
    assert module.config is model.config and FP8_ATTR not in vars(module)
    want = module(x, index, weights.bfloat16())
    want.float().pow(2).sum().backward()
    # e4m3 forward, e5m2 gradients, a step per group: about 30 dB per GEMM, two in a row.
    assert 20.0 < sqnr_db(got, want) < 45.0, sqnr_db(got, want)  # < 45: fp8 really ran
    for g8, ref in zip(grads, [x.grad, *(p.grad for p in module.parameters())], strict=True):
        assert g8 is not None and ref is not None
        assert sqnr_db(g8, ref) > 15.0, sqnr_db(g8, ref)


def test_conversion_leaves_the_model_config_routers_and_other_experts_alone() -> None:
    model = tiny("qwen3_moe")
    first: Any = experts_of(model)[0]
    report = convert_to_quantized(model, HYBRID, module_filter=first_experts)
    assert report.experts == ("model.layers.0.mlp.experts",)
    assert not any("gate" in fqn for fqn in report.converted)  # routers are not linears here
    # The model's config (what save_pretrained writes) still names transformers' default;
    # the converted module reads its own copy.
    assert model.config._experts_implementation == "grouped_mm"
    assert first.config._experts_implementation == IMPLEMENTATION
    assert experts_of(model)[1].config is model.config  # filtered out: as it was
    model.set_experts_implementation("batched_mm")  # does not undo the conversion
    assert first.config._experts_implementation == IMPLEMENTATION
    again = convert_to_quantized(model, HYBRID, module_filter=first_experts)
    assert "model.layers.0.mlp.experts" in again.already_fp8 and not again.experts
    with pytest.raises(ValueError, match="already run in fp8"):
        convert_to_quantized(model, ROWWISE, module_filter=only_experts)
    # Naming the implementation without converting: a clear error, not bf16 in disguise.
    plain = tiny("mixtral")
    plain.set_experts_implementation(IMPLEMENTATION)
    with pytest.raises(RuntimeError, match="holds no QuantizedExperts"):
        plain(ids_of(0))


def train(model: Any, steps: int = 20) -> list[float]:
    ids = ids_of(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(("kind", "ctx"), [("qwen3_moe", HYBRID), ("mixtral", ROWWISE)])
def test_twenty_steps_with_fp8_experts_end_within_1_percent_of_bf16(
    kind: str, ctx: ComputeCtx
) -> None:
    want = train(tiny(kind))
    model = tiny(kind)
    report = convert_to_quantized(model, ctx, module_filter=only_experts)
    assert len(report.experts) == 2
    got = train(model)
    assert want[-1] < 0.5 * want[0]  # it learns (one batch, memorized)
    assert abs(got[-1] - want[-1]) <= 0.01 * want[-1], (got[-1], want[-1])
    assert got != want  # the experts did run in fp8


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_generate_with_fp8_experts_and_an_fp8_kv_cache(kind: str) -> None:
    model = tiny(kind)
    convert_to_quantized(model, HYBRID, module_filter=only_experts)
    model.eval()
    prompt = ids_of(3, length=5)
    new = 8
    kw: dict[str, Any] = {
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": new,
        "do_sample": False,
    }
    want = model.generate(prompt, past_key_values=DynamicCache(config=model.config), **kw)
    length = prompt.shape[1] + new
    bf16 = CtxStaticCache(model.config, HYBRID.with_kv(HYBRID.compute), length)
    # The static cache stores bf16 keys exactly: the same tokens, fp8 experts and all.
    assert torch.equal(model.generate(prompt, past_key_values=bf16, **kw), want)
    cache8 = CtxStaticCache(model.config, HYBRID.with_kv(KvFp8()), length)
    got = model.generate(prompt, past_key_values=cache8, **kw)
    assert got.shape == want.shape and torch.equal(got[:, :5], prompt)
    assert int(cache8.get_seq_length()) == length - 1
    for layer in cache8.layers:
        assert isinstance(layer, CtxStaticLayer) and layer.store is not None
        assert layer.store.k.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_save_pretrained_from_pretrained_convert_load_gives_the_same_logits(
    kind: str, tmp_path: Path
) -> None:
    model = tiny(kind)
    convert_to_quantized(model, HYBRID, min_features=16)  # attention linears too: they hold state
    train(model, steps=2)
    model.save_pretrained(tmp_path)
    model.eval()
    probe = ids_of(9, batch=1)
    with torch.no_grad():
        before = model(input_ids=probe).logits
    assert IMPLEMENTATION not in (tmp_path / "config.json").read_text()

    # Experts merged back from their per-expert keys; the attention as the model ran it.
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="eager")
    assert loaded.config._experts_implementation == "grouped_mm"
    report = convert_to_quantized(loaded, HYBRID, min_features=16)
    assert len(report.experts) == 2
    saved = load_file(tmp_path / "model.safetensors")
    own = loaded.state_dict()
    # transformers saves the MoE block under its checkpoint names (experts one by one,
    # experts.0.gate_proj.weight, ...; Mixtral's block_sparse_moe): from_pretrained loaded
    # those. Everything else, the linears' fp8 scaling state included, loads here.
    result = loaded.load_state_dict({k: v for k, v in saved.items() if k in own}, strict=False)
    assert result.missing_keys and all(".mlp." in k for k in result.missing_keys)
    assert any(".fp8_" in k for k in own)
    loaded.eval()
    with torch.no_grad():
        after = loaded(input_ids=probe).logits
    assert torch.equal(after, before)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_load_fp8_pretrained_is_the_one_call_reload(kind: str, tmp_path: Path) -> None:
    # Before: the documented load_state_dict(load_file(...)) raised missing/unexpected keys
    # (save_pretrained de-fuses the experts) and no one call reloaded the fp8 state.
    model = tiny(kind)
    convert_to_quantized(model, HYBRID, min_features=16)
    train(model, steps=1)
    model.save_pretrained(tmp_path)
    model.eval()
    probe = ids_of(9, batch=1)
    with torch.no_grad():
        before = model(input_ids=probe).logits
    loaded = type(model).from_pretrained(tmp_path, attn_implementation="eager")
    with pytest.raises(ValueError, match="holds no fp8 scaling state"):
        load_fp8_pretrained(loaded, tmp_path)
    convert_to_quantized(loaded, HYBRID, min_features=16)
    keys = load_fp8_pretrained(loaded, tmp_path)
    assert keys and all(".fp8_" in k for k in keys)
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=probe).logits, before)
    # Converted otherwise (only the first layer): refused, naming the keys; nothing loads.
    other = type(model).from_pretrained(tmp_path, attn_implementation="eager")
    convert_to_quantized(
        other, HYBRID, module_filter=lambda m, f: "layers.0" in f and "head" not in f
    )
    state = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="not in the model"):
        load_fp8_pretrained(other, tmp_path)
    assert all(torch.equal(v, state[k]) for k, v in other.state_dict().items())


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_frozen_experts_serve_the_same_logits_from_fp8_codes(kind: str) -> None:
    # gpt-oss: transposed weights (codes held [E, out, in]) and biases (kept as they are).
    model = tiny(kind).eval()
    convert_to_quantized(model, ROWWISE, module_filter=only_experts)
    ids = ids_of(3)
    with torch.no_grad():
        want = model(ids).logits
    modules = experts_of(model)
    names = list(TransformersExperts().weights(modules[0]) or {})
    for module in modules:
        assert freeze_experts_for_serving(module) is module
    first: Any = modules[0]
    assert all(getattr(first, n) is None for n in names)  # the parameters are gone
    held = [k for k in first.state_dict() if k.endswith(("_fp8", "_step"))]
    assert held == [f"{n}{s}" for n in names for s in ("_fp8", "_step")]
    assert experts_of(model) == modules  # still known as experts, by their codes
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    with pytest.raises(ValueError, match="frozen for serving"):
        TransformersExperts().convert(first, None)
    with pytest.raises(ValueError, match="converted by convert_to_quantized"):
        freeze_experts_for_serving(tiny(kind).model.layers[0].mlp.experts)


def test_frozen_experts_refuse_a_state_dict_of_bad_codes_or_steps_and_change_nothing() -> None:
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = tiny("qwen3_moe").eval()
        convert_to_quantized(model, ROWWISE, module_filter=only_experts)
        for module in experts_of(model):
            freeze_experts_for_serving(module)
        models.append(model)
    model, source = models[0], models[1].state_dict()
    key = next(k for k in source if k.endswith("down_proj_step"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = source[key].clone()
    steps.view(-1)[0] = float("nan")
    codes = source[key.replace("_step", "_fp8")].to(torch.float8_e5m2)
    for bad, match in (
        ({key: steps}, r"step\(s\) that are not finite"),
        ({key.replace("_step", "_fp8"): codes}, "loads only at that dtype"),
    ):
        with pytest.raises(ValueError, match=match):
            model.load_state_dict({**source, **bad})
        after = model.state_dict()
        assert all(
            torch.equal(
                after[k].view(torch.uint8) if v.element_size() == 1 else after[k],
                v.view(torch.uint8) if v.element_size() == 1 else v,
            )
            for k, v in before.items()
        )
    module = experts_of(model)[0]
    module.load_state_dict(experts_of(models[1])[0].state_dict())  # a good one loads
