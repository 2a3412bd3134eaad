"""convert_to_quantized: the built-in rules, a module_filter that decides alone, what fp8 cannot
run, the warning when nothing converts, and a model left untouched on error."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from computectx import ComputeCtx, DType
from computectx.formats import (
    DEFAULT_MIN_FEATURES,
    ConversionReport,
    Fp4Recipe,
    QuantizedLinear,
    convert_to_quantized,
)
from computectx.formats.convert import Converter
from computectx.nn import GroupedExperts


class Tiny(nn.Module):
    """A small model with every case the rules meet: an embedding with a tied head, a
    width that is not a multiple of 16, a narrow layer, a linear registered under two
    names, and a last-registered linear that is not the head (the tied one is)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.up = nn.Linear(64, 128)
        self.odd = nn.Linear(64, 40)
        self.narrow = nn.Linear(64, 16)
        self.block = nn.Sequential(nn.Linear(128, 128), nn.GELU())
        self.shared = self.block[0]
        self.lm_head = nn.Linear(64, 100, bias=False)
        self.lm_head.weight = self.embed.weight
        self.out = nn.Linear(128, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.up(self.embed(ids))
        h = self.block(h)
        y: torch.Tensor = self.lm_head(self.out(h))
        return y


def reasons(report: ConversionReport) -> dict[str, str]:
    return {s.fqn: s.reason for s in report.skipped}


def test_convert_rules_head_shape_filter_and_shared_modules(fp8_ctx: ComputeCtx) -> None:
    model = Tiny()
    report = convert_to_quantized(model, fp8_ctx, min_features=64)
    r = reasons(report)
    assert set(report.converted) == {"up", "block.0", "shared", "out"}
    assert isinstance(model.block[0], QuantizedLinear) and model.shared is model.block[0]
    assert "multiples of 16" in r["odd"]
    assert "min_features=64" in r["narrow"]
    assert "tied to nn.Embedding 'embed'" in r["lm_head"]
    assert isinstance(model.out, QuantizedLinear)  # registered last, but the tied layer is the head
    assert model.lm_head.weight is model.embed.weight
    model(torch.randint(0, 100, (2, 3)))  # still runs

    again = convert_to_quantized(model, fp8_ctx, min_features=64)
    assert again.converted == ()
    assert "already a QuantizedLinear" in reasons(again)["up"]


def test_a_module_filter_decides_alone(fp8_ctx: ComputeCtx) -> None:
    # torchao's module_filter_fn semantics: the filter picks the layers, head and narrow
    # ones included; only what fp8 cannot run is still skipped.
    model = Tiny()
    seen: list[str] = []

    def only_up_out_and_odd(module: nn.Module, fqn: str) -> bool:
        seen.append(fqn)
        return fqn in ("up", "out", "odd")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # something converts: no warning
        report = convert_to_quantized(model, fp8_ctx, only_up_out_and_odd)
    assert set(report.converted) == {"up", "out"}  # "out" is the head: the filter wins
    r = reasons(report)
    assert r["block.0"] == "module_filter returned False"
    assert "multiples of 16" in r["odd"]  # chosen, but fp8 GEMM tiles cannot run it
    assert set(seen) == {"up", "odd", "narrow", "block.0", "lm_head", "out"}


def test_a_filter_that_accepts_everything_converts_a_small_model(fp8_ctx: ComputeCtx) -> None:
    # Under the old rules (filter AND min_features AND not-the-head) this converted nothing.
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    report = convert_to_quantized(model, fp8_ctx, lambda module, fqn: True)
    assert report.converted == ("0", "2")
    assert report.skipped == ()
    assert all(isinstance(m, QuantizedLinear) for m in (model[0], model[2]))


def test_a_filter_still_cannot_convert_what_fp8_cannot_run(fp8_ctx: ComputeCtx) -> None:
    model = nn.Sequential(
        ScaledLinear(32), nn.Linear(32, 24), nn.Linear(32, 32, dtype=torch.float64)
    )
    with pytest.warns(UserWarning, match="converted none of the 3"):
        report = convert_to_quantized(model, fp8_ctx, lambda module, fqn: True)
    assert {s.fqn: s.rule for s in report.skipped} == {
        "0": "subclass",
        "1": "feature_multiple",
        "2": "dtype",
    }
    with pytest.warns(UserWarning, match="the model itself"):
        root = convert_to_quantized(nn.Linear(32, 32), fp8_ctx, lambda module, fqn: True)
    assert [s.rule for s in root.skipped] == ["root"]


def test_a_filter_with_include_head_or_min_features_is_refused(fp8_ctx: ComputeCtx) -> None:
    model = Tiny()
    with pytest.raises(ValueError, match=r"decides alone .* min_features=64 would be ignored"):
        convert_to_quantized(model, fp8_ctx, lambda module, fqn: True, min_features=64)
    with pytest.raises(ValueError, match=r"include_head=False and min_features=16"):
        convert_to_quantized(
            model, fp8_ctx, lambda module, fqn: True, include_head=False, min_features=16
        )
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_a_filter_must_return_a_bool(fp8_ctx: ComputeCtx) -> None:
    model = Tiny()

    def forgot_return(module: nn.Module, fqn: str) -> Any:
        fqn.startswith("up")  # the return statement is missing: the filter returns None

    with pytest.raises(TypeError, match=r"module_filter must return a bool, got NoneType None"):
        convert_to_quantized(model, fp8_ctx, forgot_return)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_a_filter_must_return_a_bool_for_experts_too() -> None:
    # The experts' filter answer is checked as the linears' is: a None for the experts alone
    # raises naming them, and nothing is converted (neither the linear nor the experts).
    ctx = ComputeCtx.from_flag("fp8_rowwise", "cpu")
    experts = GroupedExperts(ctx.replace(recipe=None), 32, 32, 3)
    model = nn.ModuleDict({"proj": nn.Linear(32, 32), "experts": experts})

    def forgot_experts(module: nn.Module, fqn: str) -> Any:
        return True if fqn == "proj" else None

    with pytest.raises(TypeError, match=r"must return a bool, got NoneType None for 'experts'"):
        convert_to_quantized(model, ctx, forgot_experts)
    assert isinstance(model["proj"], nn.Linear) and not isinstance(model["proj"], QuantizedLinear)
    assert experts.fp8 is None


def test_converting_nothing_warns_naming_the_knobs(fp8_ctx: ComputeCtx) -> None:
    # A small model under the defaults: every layer is narrower than min_features=1024 and
    # the last one is the head. This used to convert nothing without a word.
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 32))
    with pytest.warns(UserWarning, match="converted none") as caught:
        report = convert_to_quantized(model, fp8_ctx)
    assert report.converted == ()
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "converted none of the 3 nn.Linear layer(s) in Sequential" in text
    assert "2 skipped ('0', '2'): min(in_features, out_features) < min_features=1024" in text
    assert "min_features=16" in text and "module_filter" in text
    assert "1 skipped ('3'): output head; pass include_head=True" in text
    assert caught[0].filename == __file__  # attributed to the caller's line


def test_converting_nothing_warns_for_filters_and_models_without_linears(
    fp8_ctx: ComputeCtx,
) -> None:
    with pytest.warns(UserWarning, match=r"module_filter returned False; with a filter given"):
        convert_to_quantized(nn.Sequential(nn.Linear(32, 32)), fp8_ctx, lambda module, fqn: False)
    with pytest.warns(UserWarning, match=r"found no nn\.Linear in ReLU"):
        convert_to_quantized(nn.ReLU(), fp8_ctx)


def test_no_warning_when_the_model_already_runs_fp8(
    fp8_ctx: ComputeCtx, small_mlp: nn.Sequential
) -> None:
    # Converting twice is idempotent: the second call converts nothing, and says nothing.
    model = small_mlp
    convert_to_quantized(model, fp8_ctx, min_features=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = convert_to_quantized(model, fp8_ctx, min_features=16)
    assert again.converted == ()
    assert [s.rule for s in again.skipped] == ["already_fp8", "head"]


class ScaledLinear(nn.Linear):
    """A subclass whose forward does more than x Wᵀ + b."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.gain = nn.Parameter(torch.full((n,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


def test_subclasses_of_nn_linear_are_left_alone(fp8_ctx: ComputeCtx) -> None:
    model = nn.Sequential(ScaledLinear(32), nn.Linear(32, 32), nn.Linear(32, 32))
    report = convert_to_quantized(model, fp8_ctx, min_features=16)
    assert report.converted == ("1",)
    assert "ScaledLinear is a subclass of nn.Linear" in reasons(report)["0"]
    assert type(model[0]) is ScaledLinear
    mha = nn.MultiheadAttention(32, 2)  # out_proj is a Linear subclass it never calls
    with pytest.warns(UserWarning, match="converted none"):
        report = convert_to_quantized(
            nn.Sequential(mha, nn.Linear(32, 32)), fp8_ctx, min_features=16
        )
    assert "subclass" in reasons(report)["0.out_proj"]


def test_default_min_features_skips_small_layers(fp8_ctx: ComputeCtx) -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(512, 1024), nn.Linear(1024, 8))
    report = convert_to_quantized(copy.deepcopy(model), fp8_ctx)
    assert DEFAULT_MIN_FEATURES == 1024
    assert report.converted == ("0",)
    assert "min_features=1024" in reasons(report)["1"]


def test_convert_errors_leave_the_model_untouched(fp8_ctx: ComputeCtx) -> None:
    model = Tiny()

    def boom(module: nn.Module, fqn: str) -> bool:
        if fqn == "block.0":
            raise RuntimeError("filter failed")
        return True

    with pytest.raises(RuntimeError, match="filter failed"):
        convert_to_quantized(model, fp8_ctx, boom)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    with pytest.raises(ValueError, match="recipe=None"):
        convert_to_quantized(model, ComputeCtx.new(DType.BF16, "cpu"))
    with pytest.raises(ValueError, match="min_features"):
        convert_to_quantized(model, fp8_ctx, min_features=0)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        convert_to_quantized("model", fp8_ctx)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"convert_to_quantized needs .*ComputeCtx.*got str 'fp8_hybrid'"
    ):
        convert_to_quantized(model, "fp8_hybrid")  # type: ignore[arg-type]
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    root = nn.Linear(64, 64)
    with pytest.warns(UserWarning, match="the model itself; use QuantizedLinear.from_linear"):
        rep = convert_to_quantized(root, fp8_ctx, include_head=True, min_features=16)
    assert rep.converted == () and "root module" in reasons(rep)["<root>"]
    assert "converted 0" in str(rep)


# ----- the head by what it is, subclasses, converting again, mixed dtypes ---------------------


class LitBlock(nn.Module):
    """A litgpt-style block: attention projections and an MLP."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.attn = nn.ModuleDict({"attn": nn.Linear(n, 3 * n), "proj": nn.Linear(n, n)})
        self.mlp = nn.ModuleDict({"fc": nn.Linear(n, 4 * n), "proj": nn.Linear(4 * n, n)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn["attn"](x).chunk(3, dim=-1)
        x = x + self.attn["proj"](torch.softmax(q @ k.transpose(-1, -2), -1) @ v)
        y: torch.Tensor = x + self.mlp["proj"](torch.relu(self.mlp["fc"](x)))
        return y


class LitGPT(nn.Module):
    """litgpt's layout: ``lm_head`` registered *first*, then the embedding and the blocks."""

    def __init__(self, vocab: int = 80, n: int = 32, layers: int = 6, head: str = "lm_head"):
        super().__init__()
        self.head_name = head
        self.add_module(head, nn.Linear(n, vocab, bias=False))
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, n),
                "h": nn.ModuleList(LitBlock(n) for _ in range(layers)),
                "ln_f": nn.LayerNorm(n),
            }
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer["wte"](ids)
        for block in self.transformer.get_submodule("h").children():
            x = block(x)
        y: torch.Tensor = self.get_submodule(self.head_name)(self.transformer["ln_f"](x))
        return y


@pytest.mark.parametrize(
    ("head", "why"),
    [
        ("lm_head", "output head (named 'lm_head')"),
        ("Output", "output head (named 'Output')"),
        (
            "decoder",
            "output head (out_features=80, the vocabulary of nn.Embedding 'transformer.wte')",
        ),
    ],
)
def test_the_head_is_found_by_what_it_is_not_where_it_is_registered(
    fp8_ctx: ComputeCtx, head: str, why: str
) -> None:
    model = LitGPT(head=head)
    report = convert_to_quantized(model, fp8_ctx, min_features=16)
    assert [(s.fqn, s.rule) for s in report.skipped] == [(head, "head")]
    assert reasons(report)[head] == f"{why}; pass include_head=True to convert it"
    assert "transformer.h.5.mlp.proj" in report.converted
    assert len(report.converted) == 6 * 4
    assert type(model.get_submodule(head)) is nn.Linear
    assert model(torch.randint(0, 80, (2, 5))).shape == (2, 5, 80)


def test_a_sequential_head_is_its_last_layer(fp8_ctx: ComputeCtx) -> None:
    # Nothing names, ties or sizes a head here: the last layer (also the last to run) is it.
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    report = convert_to_quantized(model, fp8_ctx, min_features=16)
    assert report.converted == ("0", "2")
    assert "the last nn.Linear in registration order: no linear is tied" in reasons(report)["3"]


class Module:
    """torchtitan's mixin for its own modules (an init_weights protocol)."""

    def init_weights(self) -> None:
        pass


class TitanLinear(nn.Linear, Module):
    """torchtitan's ``class Linear(nn.Linear, Module)``: no forward of its own."""


class Counted(nn.Linear):
    """A subclass that adds a buffer, which a QuantizedLinear would drop."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.register_buffer("calls", torch.zeros(()))


def test_subclasses_without_a_forward_of_their_own_convert(fp8_ctx: ComputeCtx) -> None:
    model = nn.Sequential(TitanLinear(32, 32), TitanLinear(32, 32), nn.Linear(32, 16))
    report = convert_to_quantized(model, fp8_ctx, min_features=16)
    assert report.converted == ("0", "1")
    assert all(type(m) is QuantizedLinear for m in (model[0], model[1]))
    model(torch.randn(4, 32))

    def identity(input: torch.Tensor) -> torch.Tensor:
        return input

    replaced = nn.Linear(32, 32)
    replaced.forward = identity  # type: ignore[method-assign]
    parametrized = nn.Linear(32, 32)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", nn.Identity())
    keep = nn.Sequential(Counted(32), replaced, parametrized, nn.Linear(32, 32), nn.Linear(32, 8))
    report = convert_to_quantized(keep, fp8_ctx, min_features=16)
    r = reasons(report)
    assert report.converted == ("3",)
    assert "Counted is a subclass of nn.Linear and it holds 'calls'" in r["0"]
    assert "its forward was replaced on the instance" in r["1"]
    assert "ParametrizedLinear defines its own weight" in r["2"]
    assert "pass converters={ParametrizedLinear: ...} to convert it" in r["2"]


class Fp8Scaled(nn.Module):
    """What a framework's converter may build: fp8 for the GEMM, its own gain kept."""

    def __init__(self, inner: QuantizedLinear, gain: nn.Parameter) -> None:
        super().__init__()
        self.inner = inner
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.inner(x) * self.gain
        return y


def to_fp8_scaled(linear: nn.Linear, ctx: ComputeCtx, *, backend: Any, quantize: Any) -> nn.Module:
    assert isinstance(linear, ScaledLinear)
    inner = QuantizedLinear.from_linear(linear, ctx, backend=backend, quantize=quantize)
    return Fp8Scaled(inner, linear.gain)


def to_none(linear: nn.Linear, ctx: ComputeCtx, *, backend: Any, quantize: Any) -> nn.Module:
    return None  # type: ignore[return-value]  # a converter with a bug


class LoggedLinear(nn.Linear):
    """A forward that only watches: it computes x Wᵀ + b."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_converters_are_the_extension_point_for_subclasses_with_a_forward(
    fp8_ctx: ComputeCtx,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(32), LoggedLinear(32, 32), nn.Linear(32, 16))
    x = torch.randn(4, 32)
    want = model(x)
    gain = model[0].gain
    converters: dict[type[nn.Linear], Converter] = {
        ScaledLinear: to_fp8_scaled,
        LoggedLinear: QuantizedLinear.from_linear,
    }
    report = convert_to_quantized(model, fp8_ctx, min_features=16, converters=converters)
    assert report.converted == ("0", "1")
    assert isinstance(model[0], Fp8Scaled) and type(model[1]) is QuantizedLinear
    assert model[0].gain is gain
    got = model(x)
    assert torch.allclose(got, want, rtol=0.25, atol=0.25)  # fp8: 2**-4 relative per operand

    with pytest.raises(TypeError, match=r"keys must be subclasses of nn\.Linear .* got type"):
        convert_to_quantized(model, fp8_ctx, converters={nn.Linear: QuantizedLinear.from_linear})
    fresh = nn.Sequential(ScaledLinear(32), nn.Linear(32, 16))
    with pytest.raises(TypeError, match=r"returned NoneType None for '0', not an nn\.Module"):
        convert_to_quantized(
            fresh, fp8_ctx, include_head=True, min_features=16, converters={ScaledLinear: to_none}
        )
    assert not any(isinstance(m, QuantizedLinear) for m in fresh.modules())  # left unchanged


def test_converting_again_is_a_no_op_under_the_same_policy_and_refused_under_another(
    fp8_ctx: ComputeCtx, dynamic_ctx: ComputeCtx
) -> None:
    model = LitGPT(layers=2)
    first = convert_to_quantized(model, fp8_ctx, min_features=16)
    layers = {fqn: model.get_submodule(fqn) for fqn in first.converted}
    again = convert_to_quantized(model, fp8_ctx, min_features=16)
    assert again.converted == () and set(again.already_fp8) == set(first.converted)
    assert "already fp8 under this policy, left as they are: 8" in str(again)
    assert all(model.get_submodule(f) is m for f, m in layers.items())

    with pytest.raises(ValueError, match="already a QuantizedLinear under") as caught:
        convert_to_quantized(model, dynamic_ctx, min_features=16)
    text = str(caught.value)
    assert "'transformer.h.0.attn.attn' (and 7 more) is already a QuantizedLinear under " in text
    assert "recipe=hybrid/delayed/16/0/max, compute=bf16" in text
    assert "this call asks for recipe=hybrid/dynamic/0, compute=bf16" in text
    assert all(m.ctx == fp8_ctx for m in layers.values())


def test_a_head_left_at_another_dtype_says_what_to_do(fp8_ctx: ComputeCtx) -> None:
    # A float32 model under a bf16 policy: the fp8 layers return a bf16 input as bf16, and
    # the float32 head then refuses it. The report says so, and the advice works.
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    report = convert_to_quantized(model, fp8_ctx, min_features=16)
    (note,) = report.notes
    assert (
        "the head '2' stays an nn.Linear with torch.float32 weights while ctx.compute is bf16"
        in note
    )
    assert "ctx.autocast()" in note and "include_head=True" in note
    assert "notes:" in str(report)
    x = fp8_ctx.to_compute(torch.randn(4, 32))
    with pytest.raises(RuntimeError, match="dtype"):
        model(x)
    with fp8_ctx.autocast():
        assert model(x).dtype == torch.bfloat16
    same = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    assert convert_to_quantized(same, fp8_ctx, min_features=16).notes == ()


def test_4_bit_rules_that_can_keep_nothing_high_warn_naming_the_rule() -> None:
    # An hp pattern naming no module and hp_last on a model without a block list were silent.
    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    recipe = Fp4Recipe(hp_last=2, hp=("*.attn.*", "0"))
    with pytest.warns(UserWarning, match="keeps nothing in high precision") as caught:
        report = convert_to_quantized(model, ctx.replace(recipe=recipe), min_features=16)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2 and all(w.filename == __file__ for w in caught)
    assert "hp='*.attn.*' matches no linear or experts module" in texts[0]  # '0' matches
    assert "hp_last=2 keeps nothing in high precision: the model has no block list" in texts[1]
    assert report.converted == ("1",) and {s.rule for s in report.skipped} == {"kept_high", "head"}
    blocks = nn.ModuleDict({"blocks": nn.ModuleList(nn.Linear(32, 32) for _ in range(3))})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a block list and a pattern that names a layer: quiet
        recipe = Fp4Recipe(hp_last=1, hp=("blocks.0",))
        report = convert_to_quantized(blocks, ctx.replace(recipe=recipe), min_features=16)
    assert report.converted == ("blocks.1",)


def test_converting_nothing_under_4_bits_names_the_format() -> None:
    ctx = ComputeCtx.from_flag("mxfp4", "cpu")
    with pytest.warns(UserWarning, match="so nothing in it runs in mxfp4:") as caught:
        convert_to_quantized(nn.Sequential(nn.Linear(32, 32)), ctx, min_features=16)
    assert "fp8" not in str(caught[0].message)


@pytest.mark.parametrize("flag", ["fp8_hybrid", "nvfp4", "mxfp4"])
def test_the_report_names_what_the_layers_were_converted_to(flag: str) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    report = convert_to_quantized(
        model, ComputeCtx.from_flag(flag, "cpu"), module_filter=lambda m, f: True
    )
    target = "fp8" if flag.startswith("fp8") else flag
    assert report.target == target
    assert str(report).startswith(f"converted 2 linear(s) to {target}:")
