"""``convert_to_quantized`` on grouped experts under a 4-bit recipe (``formats.convert_experts``):
``computectx.nn``'s experts get an ``Fp4Experts`` (never fp8's ``QuantizedExperts``), the
recipe's ``hp``/``hp_last`` keep experts high as they keep linears, a second call is a no-op,
another recipe (fp8 or 4-bit) is refused naming both, and a framework whose converter runs fp8
only is refused with ``NotImplementedError`` before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats import (
    Fp4Experts,
    Fp4Linear,
    Fp4Recipe,
    QuantizedExperts,
    convert_to_quantized,
)
from computectx.formats import convert_experts as ce
from computectx.nn import ByteLM, GroupedExperts, LMConfig, MoE

BF16 = ComputeCtx.from_flag("bf16", "cpu")
CFG = LMConfig(d_model=64, n_layers=3, n_heads=2, n_experts=4, top_k=2, moe_hidden=32, max_len=16)


def _ctx(recipe: Fp4Recipe) -> ComputeCtx:
    return ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=recipe)


def _settings(model: nn.Module) -> list[object]:
    return [m.experts.fp8 for m in model.modules() if isinstance(m, MoE)]


def test_experts_convert_to_4_bits_with_the_recipes_own_rules() -> None:
    torch.manual_seed(0)
    model = ByteLM(BF16, CFG)
    ctx = _ctx(Fp4Recipe(hp_last=1, hp=("blocks.0.mlp.*",)))
    report = convert_to_quantized(model, ctx, min_features=16)
    assert report.experts == ("blocks.1.mlp.experts",)
    rules = {s.fqn: s.rule for s in report.skipped}
    assert rules["blocks.0.mlp.experts"] == "kept_high"  # the hp pattern
    assert rules["blocks.2.mlp.experts"] == rules["blocks.2.attn.qkv"] == "kept_high"  # hp_last
    assert isinstance(model.get_submodule("blocks.1.attn.qkv"), Fp4Linear)
    fp4, kept_0, kept_2 = _settings(model)[1], _settings(model)[0], _settings(model)[2]
    assert isinstance(fp4, Fp4Experts) and fp4.recipe == ctx.recipe
    assert kept_0 is None and kept_2 is None
    assert not any(isinstance(s, QuantizedExperts) for s in _settings(model))
    ids = torch.randint(0, 256, (2, 9))
    with ctx.autocast():
        torch.autograd.backward(model.loss(ids[:, :-1], ids[:, 1:]))
    experts = model.get_submodule("blocks.1.mlp.experts")
    assert int(fp4.sr_key[1]) > 0 and isinstance(experts, GroupedExperts)
    assert experts.gate_up.grad is not None
    assert "blocks.1.mlp.experts.fp8._extra_state" in model.state_dict()
    again = convert_to_quantized(model, ctx, min_features=16)
    assert "blocks.1.mlp.experts" in again.already_fp8 and again.experts == ()


def test_an_moe_built_under_a_4_bit_ctx_runs_4_bit_experts_and_shared_linears() -> None:
    moe = MoE(ComputeCtx.from_flag("mxfp4", "cpu"), 64, 32, 4, 2, n_shared=1)
    assert isinstance(moe.experts.fp8, Fp4Experts) and moe.experts.fp8.recipe.format == "mxfp4"
    assert isinstance(moe.shared, nn.Module) and isinstance(moe.shared.up, Fp4Linear)
    moe(torch.randn(2, 5, 64)).float().square().sum().backward()
    assert moe.experts.down.grad is not None


def test_fp8_and_4_bit_experts_refuse_each_other() -> None:
    fp8 = MoE(ComputeCtx.from_flag("fp8_rowwise", "cpu"), 32, 32, 4, 2)
    with pytest.raises(ValueError, match=r"already run in fp8 under e4m3/row.* asks for nvfp4"):
        convert_to_quantized(nn.Sequential(fp8), _ctx(Fp4Recipe()), min_features=16)
    four = MoE(ComputeCtx.from_flag("nvfp4", "cpu"), 32, 32, 4, 2)
    with pytest.raises(ValueError, match=r"already run in 4 bits under nvfp4, but .* e4m3/row"):
        convert_to_quantized(
            nn.Sequential(four), ComputeCtx.from_flag("fp8_rowwise", "cpu"), min_features=16
        )
    with pytest.raises(ValueError, match=r"already run in 4 bits under nvfp4, .* nvfp4\+seed=1"):
        convert_to_quantized(nn.Sequential(four), _ctx(Fp4Recipe(seed=1)), min_features=16)
    assert isinstance(four.experts.fp8, Fp4Experts) and four.experts.fp8.recipe == Fp4Recipe()


class _Fp8OnlyExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 32, 32))


class _Fp8OnlyConverter:
    def weights(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        return {"w": module.w} if isinstance(module, _Fp8OnlyExperts) else None

    def current(self, module: nn.Module) -> QuantizedExperts | None:
        return None

    def convert(self, module: nn.Module, fp8: QuantizedExperts | None) -> None:
        raise AssertionError("never called under a 4-bit recipe")


def test_experts_whose_converter_runs_fp8_only_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        ce, "_CONVERTERS", [*ce.experts_converters(nn.Module()), _Fp8OnlyConverter()]
    )
    model = nn.ModuleDict(
        {"proj": nn.Linear(32, 32), "experts": _Fp8OnlyExperts(), "x": nn.Linear(32, 16)}
    )
    with pytest.raises(NotImplementedError, match=r"'experts' holds grouped experts .* fp8 only"):
        convert_to_quantized(model, _ctx(Fp4Recipe()), min_features=16)
    assert type(model["proj"]) is nn.Linear  # nothing changed
    kept = convert_to_quantized(model, _ctx(Fp4Recipe()), lambda m, fqn: fqn != "experts")
    assert kept.converted == ("proj", "x") and kept.experts == ()


def test_a_grouped_experts_module_alone_converts_and_keeps_high_by_pattern() -> None:
    model = nn.ModuleDict({"experts": GroupedExperts(BF16, 32, 32, 4)})
    report = convert_to_quantized(model, _ctx(Fp4Recipe(format="mxfp4")), min_features=16)
    assert report.experts == ("experts",)
    model = nn.ModuleDict({"experts": GroupedExperts(BF16, 32, 32, 4)})
    with pytest.warns(UserWarning, match="converted none"):
        report = convert_to_quantized(model, _ctx(Fp4Recipe(hp=("exp*",))), min_features=16)
    assert [s.rule for s in report.skipped] == ["kept_high"]


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 32), nn.Linear(32, 32)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(32, 32)
        self.experts = nn.ModuleList(_Mlp() for _ in range(4))  # more experts than layers
        self.grouped = GroupedExperts(BF16, 32, 32, 4)


def test_hp_last_keeps_the_last_layer_when_experts_are_a_longer_list_inside_each_layer() -> None:
    # transformers 4's Mixtral/Qwen-MoE: the longest list holding linears was layer 0's experts,
    # so hp_last=1 kept layers.0.experts.3 high and ran the whole last layer in 4 bits, silently.
    model = nn.ModuleDict(
        {"layers": nn.ModuleList(_Layer() for _ in range(3)), "lm_head": nn.Linear(32, 64)}
    )
    report = convert_to_quantized(model, _ctx(Fp4Recipe(hp_last=1)), min_features=16)
    kept = {s.fqn for s in report.skipped if s.rule == "kept_high"}
    assert kept == {
        "layers.2.attn",
        "layers.2.grouped",
        *(f"layers.2.experts.{e}.{n}" for e in range(4) for n in ("up", "down")),
    }
    assert report.experts == ("layers.0.grouped", "layers.1.grouped")
    assert isinstance(model.get_submodule("layers.0.experts.3.up"), Fp4Linear)


@pytest.mark.parametrize(
    "option", [{"backend": "triton"}, {"backend": "bogus"}, {"quantize": "inline"}]
)
def test_fp8_only_options_are_refused_under_4_bits(option: dict[str, str]) -> None:
    # They were ignored silently (a backend of any name converted the model).
    moe = MoE(BF16, 32, 32, 4, 2)
    model = nn.Sequential(nn.Linear(32, 32), moe, nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"=.* set the fp8 GEMMs; under the 4-bit recipe nvfp4"):
        convert_to_quantized(model, _ctx(Fp4Recipe()), min_features=16, **option)  # type: ignore[arg-type]
    assert type(model[0]) is nn.Linear and moe.experts.fp8 is None


def test_an_hp_pattern_a_block_built_under_the_ctx_cannot_match_says_why() -> None:
    # Each block converts alone as the model is built: 'blocks.2.*' never matches there, and
    # the warning offered 'blocks.0.*' as the kind of pattern that works.
    with pytest.warns(UserWarning, match=r"hp='blocks\.2\.\*' matches no") as caught:
        model = ByteLM(_ctx(Fp4Recipe(hp=("blocks.2.*",))), CFG)
    assert "sees only its own names ('attn.qkv', not 'blocks.2.attn.qkv')" in str(caught[0].message)
    assert isinstance(model.get_submodule("blocks.2.attn.qkv"), Fp4Linear)
    model = ByteLM(BF16, CFG)
    with pytest.warns(UserWarning, match=r"hp='\*\.nothing' matches no") as caught:
        convert_to_quantized(model, _ctx(Fp4Recipe(hp=("*.nothing",))), min_features=16)
    assert "on its own" not in str(caught[0].message)  # a model with a block list
