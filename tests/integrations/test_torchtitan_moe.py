"""torchtitan's MoE in fp8 (``computectx.integrations.torchtitan_moe``), in one process: the
Qwen3 MoE debug model's config through ``Fp8LinearConverter``, a tiny MoE layer (16 experts
of 64 -> 32, top 2) built with and without it and converted when built, and gpt-oss's
grouped experts (biases, interleaved SwiGLU)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip(
    "torchtitan", reason="torchtitan is in the optional extra: pip install -e '.[integrations]'"
)

from torchtitan.models.common.config_utils import (
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
from torchtitan.models.qwen3 import model_registry

from computectx import ComputeCtx
from computectx.formats import Backend, QuantizedExperts, QuantizedLinear, convert_to_quantized
from computectx.integrations.torchtitan import Fp8LinearConverter
from computectx.integrations.torchtitan_moe import (
    FP8_ATTR,
    TitanExperts,
    fp8_experts_class,
)

DIM, HIDDEN, EXPERTS, TOP_K = 64, 32, 16, 2
HYBRID = ComputeCtx.from_flag("fp8_hybrid", "cpu")
ROWWISE = ComputeCtx.from_flag("fp8_rowwise", "cpu")
INIT = partial(nn.init.normal_, std=0.05)


def tiny_moe_config() -> Any:
    return make_moe_config(
        num_experts=EXPERTS,
        load_balance_coeff=None,
        router=make_router_config(
            dim=DIM,
            num_experts=EXPERTS,  # the gate is 64 -> 16: fp8 widths, yet never converted
            gate_param_init={"weight": INIT},
            top_k=TOP_K,
            score_func="softmax",
            route_norm=True,
        ),
        routed_experts=make_routed_experts_config(
            dim=DIM,
            hidden_dim=HIDDEN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            param_init={"w1_EFD": INIT, "w2_EDF": INIT, "w3_EFD": INIT},
            comm_backend="standard",
        ),
    )


def build(config: Any) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = config.build()
    model.init_states(buffer_device=torch.device("cpu"))  # type: ignore[operator]
    return model


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref64, x64 = ref.detach().double(), x.detach().double()
    return 10 * math.log10(float(ref64.pow(2).sum()) / float((x64 - ref64).pow(2).sum()))


def run(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(2, 24, DIM, generator=torch.Generator().manual_seed(1))
    y = model(x)
    y.pow(2).sum().backward()
    grads = [p.grad for _, p in sorted(model.named_parameters())]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    return y, [g for g in grads if g is not None]


def test_the_converter_turns_the_qwen3_moe_debug_model_experts_to_fp8() -> None:
    converter = Fp8LinearConverter.Config(policy="fp8_hybrid", device="cpu").build()
    spec = model_registry("debugmodel_moe")
    config = converter.convert(spec.model)
    experts = [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(8)]
    assert converter.experts == experts
    assert set(experts) <= set(converter.converted)
    assert not any("router" in fqn for fqn in converter.converted)  # 256 -> 64 gates stay
    assert "lm_head" not in converter.converted
    with torch.device("meta"):
        model = config.build()
    moe = model.get_submodule("layers.0.moe")
    assert type(moe.router.gate) is Linear
    inner = moe.routed_experts.inner_experts
    assert type(inner).__name__ == "Fp8GroupedExperts" and isinstance(inner, GroupedExperts)
    assert getattr(inner, FP8_ATTR) == QuantizedExperts(HYBRID.fp8, Backend.REFERENCE)  # type: ignore[arg-type]
    again = converter.convert(config)  # converting a converted config changes nothing
    assert again is config and converter.experts == experts


def test_a_tiny_moe_built_with_the_converter_runs_its_experts_in_fp8() -> None:
    converter = Fp8LinearConverter.Config(policy="fp8_hybrid", device="cpu").build()
    fp8 = build(converter.convert(tiny_moe_config()))
    plain = build(tiny_moe_config())
    assert converter.experts == ["routed_experts.inner_experts"]
    assert not any(isinstance(m, QuantizedLinear) for m in fp8.modules())  # the gate stays
    y8, g8 = run(fp8)
    y, g = run(plain)
    # The same weights (same seed); e4m3 forward and e5m2 gradients, a step per group, over
    # the three grouped GEMMs of SwiGLU experts (torchtitan runs them at bf16 either way).
    assert 20.0 < sqnr_db(y8, y) < 45.0, sqnr_db(y8, y)
    for a, b in zip(g8, g, strict=True):
        assert sqnr_db(a, b) > 15.0, sqnr_db(a, b)


def test_convert_to_fp8_converts_a_built_torchtitan_moe_in_place_and_back() -> None:
    model = build(tiny_moe_config())
    inner = model.get_submodule("routed_experts.inner_experts")
    weights = dict(inner.named_parameters())
    y, _ = run(model)
    model.zero_grad()
    report = convert_to_quantized(model, HYBRID, module_filter=lambda m, fqn: True)
    assert report.experts == report.converted == ("routed_experts.inner_experts",)
    # The router stays in high precision, whatever the filter says.
    assert [(s.fqn, s.rule) for s in report.skipped] == [("router.gate", "router")]
    assert type(inner) is fp8_experts_class(GroupedExperts)
    assert dict(inner.named_parameters()) == weights  # the same Parameter objects
    y8, _ = run(model)
    assert 20.0 < sqnr_db(y8, y) < 45.0
    TitanExperts().convert(inner, None)
    assert type(inner) is GroupedExperts and TitanExperts().current(inner) is None
    model.zero_grad()
    assert torch.equal(run(model)[0], y)


def test_gpt_oss_grouped_experts_with_biases_convert_too() -> None:
    names = ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED")
    config = GptOssGroupedExperts.Config(
        dim=DIM, hidden_dim=HIDDEN, num_experts=4, param_init=dict.fromkeys(names, INIT)
    )
    model = build(config)
    assert TitanExperts().weights(model) is not None
    x = torch.randn(20, DIM, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor([5, 0, 7, 6])  # an empty expert, and 2 rows past the last group
    want = model(x, counts)[:18]
    TitanExperts().convert(model, QuantizedExperts(ROWWISE.fp8, Backend.REFERENCE))  # type: ignore[arg-type]
    got = model(x, counts)
    assert type(model).__name__ == "Fp8GptOssGroupedExperts"
    assert 20.0 < sqnr_db(got[:18], want) < 45.0, sqnr_db(got[:18], want)
    assert not got[18:].any()  # rows past the groups come out zero


def test_deepseek_v3_load_balancing_keeps_moving_under_the_composed_hook() -> None:
    # Before: the docs set spec.post_optimizer_build_fn = fp8_post_optimizer_build_fn, which
    # replaced DeepSeek-V3's register_moe_load_balancing_hook: the expert biases never moved.
    from types import SimpleNamespace

    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3

    from computectx.integrations.torchtitan import (
        compose_post_optimizer_build_fn,
        fp8_post_optimizer_build_fn,
    )

    converter = Fp8LinearConverter.Config(policy="fp8_rowwise", device="cpu")
    spec = deepseek_v3("debugmodel", converters=[converter])
    spec.model.layers = spec.model.layers[:2]  # tiny: the dense block and one MoE block
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())  # a CPU backward
    own = spec.post_optimizer_build_fn
    spec.post_optimizer_build_fn = compose_post_optimizer_build_fn(spec)
    assert compose_post_optimizer_build_fn(spec) is spec.post_optimizer_build_fn
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    moe = model.layers["1"].moe
    assert moe.load_balance_coeff is not None
    assert type(moe.routed_experts.inner_experts).__name__ == "Fp8GroupedExperts"
    dims = SimpleNamespace(get_optional_mesh=lambda name: None, ep_enabled=False, tp=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="compose_post_optimizer_build_fn"):
        fp8_post_optimizer_build_fn(opt, [model], dims)  # in place of the spec's own: refused
    # Before: any step pre-hook (a logger) passed for torchtitan's load-balancing hook.
    logged = torch.optim.SGD(model.parameters(), lr=1e-3)
    logged.register_step_pre_hook(lambda *_: None)
    with pytest.raises(ValueError, match="register_moe_load_balancing_hook, which is not"):
        fp8_post_optimizer_build_fn(logged, [model], dims)
    # Before: the old line, then compose, composed to a hook that did nothing, silently.
    old_line = SimpleNamespace(post_optimizer_build_fn=fp8_post_optimizer_build_fn)
    over_old = compose_post_optimizer_build_fn(old_line)
    with pytest.raises(ValueError, match="was already fp8_post_optimizer_build_fn"):
        over_old(torch.optim.SGD(model.parameters(), lr=1e-3), [model], dims)
    spec.post_optimizer_build_fn(opt, [model], dims)
    fp8_post_optimizer_build_fn(opt, [model], dims)  # torchtitan's hook is on it: passes
    over_old(opt, [model], dims)
    before = moe.expert_bias_E.clone()
    tokens = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    model(tokens).float().square().mean().backward()
    opt.step()
    assert not torch.equal(moe.expert_bias_E, before)  # the load balancing moved them
    assert torch.isfinite(moe.expert_bias_E).all() and own is not None
