"""Fp8Linear and convert_to_fp8: drop-in behaviour, conversion rules, gradients within a
bound derived from the formats' precision, needs_input_grad, serving."""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional

from computectx import ComputeCtx, DType, Fp8Format
from computectx.fp8 import (
    DEFAULT_MIN_FEATURES,
    DelayedScaling,
    DynamicScaling,
    Fp8Backend,
    Fp8Linear,
    Fp8Policy,
    Fp8Scheme,
    convert_to_fp8,
    fp8_stats,
)

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")
DYN = CTX.replace(fp8=Fp8Policy(scaling=DynamicScaling()))


# ----- the error bound ----------------------------------------------------------------------


def unit(fmt: Fp8Format) -> float:
    """Relative rounding error bound in the normal range: half an ulp, 2**-(m + 1)."""
    return 2.0 ** -(fmt.mantissa_bits + 1)


def step_of(t: torch.Tensor, fmt: Fp8Format) -> float:
    return float(t.abs().max().float() / fmt.max)


def product_bound(
    a: torch.Tensor, fa: Fp8Format, b: torch.Tensor, fb: Fp8Format, out_unit: float
) -> torch.Tensor:
    """Elementwise bound on ``|out - a @ b.T|`` for the fp8 scaled GEMM of ``a`` and ``b``.

    Each element is quantized with ``|q*step - v| <= u|v| + h`` (``u`` half an ulp in the
    normal range, ``h = step * min_subnormal / 2`` in the subnormal range; dynamic steps
    never saturate), so ``|âb̂ - ab| <= (u_a|a| + h_a)((1 + u_b)|b| + h_b) + |a|(u_b|b| + h_b)``
    summed over K. float32 accumulation adds ``K * 2**-24`` of ``Σ|â||b̂|``, the epilogue
    rounds once more to the output dtype (``out_unit``).
    """
    a64, b64 = a.double().abs(), b.double().abs()
    ua, ub = unit(fa), unit(fb)
    ha = step_of(a, fa) * fa.min_subnormal / 2
    hb = step_of(b, fb) * fb.min_subnormal / 2
    quant = (ua * a64 + ha) @ ((1 + ub) * b64 + hb).t() + a64 @ (ub * b64 + hb).t()
    k = a.shape[1]
    accum = (k + 3) * 2.0**-24 * (((1 + ua) * a64 + ha) @ ((1 + ub) * b64 + hb).t())
    exact = (a.double() @ b.double().t()).abs()
    err = quant + accum
    return err + out_unit * (exact + err)


BF16_UNIT = 2.0**-8  # bfloat16 keeps 8 significant bits: half an ulp is 2**-8 relative


@settings(max_examples=15)
@given(
    rows=st.integers(1, 9),
    n_in=st.sampled_from([16, 24, 40]),
    n_out=st.sampled_from([8, 16, 33]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_within_the_derived_bound(
    rows: int, n_in: int, n_out: int, scale: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    m = Fp8Linear(n_in, n_out, ctx=DYN)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n_out, n_in, generator=g) * 0.1)
        m.bias.copy_(torch.randn(n_out, generator=g))
    x = (torch.randn(rows, n_in, generator=g) * scale).requires_grad_(True)
    dy = torch.randn(rows, n_out, generator=g) * scale
    y = m(x)
    torch.autograd.backward(y, dy)
    e4, e5 = Fp8Format.E4M3, Fp8Format.E5M2
    w, b = m.weight.detach(), m.bias.detach()

    exact_y = x.detach().double() @ w.double().t() + b.double()
    bound_y = product_bound(x.detach(), e4, w, e4, BF16_UNIT) + BF16_UNIT * b.double().abs()
    assert ((y.detach().double() - exact_y).abs() <= bound_y).all()

    # dX = dY W: the E5M2 gradient times the E4M3 weight (W's rows are columns here).
    assert x.grad is not None and m.weight.grad is not None and m.bias.grad is not None
    exact_dx = dy.double() @ w.double()
    bound_dx = product_bound(dy, e5, w.t(), e4, BF16_UNIT)
    assert ((x.grad.double() - exact_dx).abs() <= bound_dx).all()
    # dW = dYᵀ X, accumulated and returned in float32.
    exact_dw = dy.double().t() @ x.detach().double()
    bound_dw = product_bound(dy.t(), e5, x.detach().t(), e4, 2.0**-24)
    assert ((m.weight.grad.double() - exact_dw).abs() <= bound_dw).all()
    bound_db = rows * 2.0**-24 * dy.double().abs().sum(0)
    assert ((m.bias.grad.double() - dy.double().sum(0)).abs() <= bound_db).all()


def test_the_bound_is_tight_enough_to_catch_a_wrong_format() -> None:
    # Sanity of the bound itself: treating an E5M2-rounded operand as E4M3 (half its
    # error) must fail somewhere, so the test above really checks which format was used.
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 64, generator=g)
    b = torch.randn(32, 64, generator=g)
    step = a.abs().max() / Fp8Format.E5M2.max
    a_hat = (a / step).to(torch.float8_e5m2).float() * step
    err = (a_hat.double() @ b.double().t() - a.double() @ b.double().t()).abs()
    loose = product_bound(a, Fp8Format.E5M2, b, Fp8Format.E5M2, 0.0)
    wrong = product_bound(a, Fp8Format.E4M3, b, Fp8Format.E5M2, 0.0) - loose
    assert (err <= loose).all()
    assert float(err.max()) > 0.0 and float(wrong.max()) < 0.0


# ----- the module ---------------------------------------------------------------------------


def test_drop_in_keys_dtypes_and_leading_shapes() -> None:
    m = Fp8Linear(32, 16, ctx=CTX)
    assert isinstance(m, nn.Linear)
    assert m.weight.dtype == CTX.master.torch and m.weight.device == CTX.device
    assert set(m.state_dict()) == {"weight", "bias", "_extra_state"}
    assert m.backend is Fp8Backend.REFERENCE
    x = torch.randn(2, 3, 5, 32, dtype=torch.bfloat16)
    y = m(x)
    assert y.shape == (2, 3, 5, 16) and y.dtype == torch.bfloat16
    y1 = m(torch.randn(32))
    assert y1.shape == (16,)
    empty = m(torch.randn(0, 32, requires_grad=True))
    assert empty.shape == (0, 16)
    assert m.scaling.input.elements == 2 * 3 * 5 * 32 + 32  # empty input never quantized


def test_bad_inputs_and_ctx_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="fp8=None"):
        Fp8Linear(16, 16, ctx=ComputeCtx.new(DType.BF16, "cpu"))
    # Only a ComputeCtx is accepted: an object with the same attributes is not one, and the
    # error names what was passed.
    lookalike: Any = SimpleNamespace(fp8=CTX.fp8, compute=CTX.compute, device=CTX.device)
    with pytest.raises(TypeError, match=r"Fp8Linear needs a computectx\.ComputeCtx .*namespace"):
        Fp8Linear(16, 16, ctx=lookalike)
    with pytest.raises(TypeError, match=r"convert_to_fp8 needs .*ComputeCtx.*got str 'fp8_hybrid'"):
        convert_to_fp8(nn.Linear(16, 16), "fp8_hybrid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad device 'gpu0'; accepted: 'cpu'"):
        Fp8Linear(16, 16, ctx=CTX, device="gpu0")
    m = Fp8Linear(16, 16, ctx=CTX)
    with pytest.raises(TypeError, match="float64"):
        m(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(\.\.\., 16\)"):
        m(torch.randn(2, 17))
    with pytest.raises(ValueError, match="cannot force the triton"):
        Fp8Linear(16, 16, ctx=CTX, backend="triton")
    # Parameters fp8 cannot quantize are refused when the layer is built, not at its
    # first call.
    with pytest.raises(ValueError, match=r"weight from bf16, fp16 or fp32; got torch\.float64"):
        Fp8Linear(16, 16, ctx=CTX.replace(master=DType.F64))
    with pytest.raises(ValueError, match=r"weight .* got torch\.float64"):
        Fp8Linear.from_linear(nn.Linear(16, 16, dtype=torch.float64), CTX)
    mixed = nn.Linear(16, 16)
    mixed.bias = nn.Parameter(torch.zeros(16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bias .* got torch\.float64"):
        Fp8Linear.from_linear(mixed, CTX)


@pytest.mark.parametrize(
    ("x_grad", "w_grad", "b_grad"),
    [(True, False, False), (False, True, True), (False, False, True), (False, False, False)],
)
def test_needs_input_grad_is_respected(x_grad: bool, w_grad: bool, b_grad: bool) -> None:
    m = Fp8Linear(16, 16, ctx=CTX)
    m.weight.requires_grad_(w_grad)
    m.bias.requires_grad_(b_grad)
    x = torch.randn(4, 16, requires_grad=x_grad)
    y = m(x)
    if y.requires_grad:
        y.sum().backward()
    assert (x.grad is not None) == x_grad
    assert (m.weight.grad is not None) == w_grad
    assert (m.bias.grad is not None) == b_grad
    # The gradient is quantized only when a GEMM needs it, and then exactly once.
    expect = 4 * 16 if (x_grad or w_grad) else 0
    assert m.scaling.grad.elements == expect


@pytest.mark.parametrize("scheme", list(Fp8Scheme))
def test_schemes_pick_forward_and_backward_formats(scheme: Fp8Scheme) -> None:
    ctx = CTX.replace(fp8=Fp8Policy(format=scheme, scaling=DelayedScaling()))
    m = Fp8Linear(16, 16, ctx=ctx)
    x = torch.randn(4, 16)
    x[0, 0] = 8.0
    x[1:] = x[1:].clamp(-4, 4)
    m(x).sum().backward()
    s = fp8_stats(nn.Sequential(m))["0"]
    assert s.input.step == pytest.approx(8.0 / scheme.forward.max, rel=1e-6)
    assert s.grad.step == pytest.approx(1.0 / scheme.backward.max, rel=1e-6)


def test_to_moves_rings_without_changing_their_dtype() -> None:
    m = Fp8Linear(16, 16, ctx=CTX)
    m(torch.randn(2, 16))
    m.to(torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    for op in m.scaling.operands.values():
        assert op.ring.dtype == torch.float32
    m.to("meta")
    assert all(op.ring.device.type == "meta" for op in m.scaling.operands.values())


def test_from_linear_shares_parameters_so_the_optimizer_keeps_training() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = model[0]
    assert isinstance(first, nn.Linear)
    w0 = first.weight
    before = w0.detach().clone()
    report = convert_to_fp8(model, CTX, min_features=16, include_head=True)
    assert report.converted == ("0", "2")
    converted = model[0]
    assert isinstance(converted, Fp8Linear) and converted.weight is w0
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    assert not torch.equal(converted.weight, before)


# ----- conversion rules ---------------------------------------------------------------------


class Tiny(nn.Module):
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


def reasons(report: Any) -> dict[str, str]:
    return {s.fqn: s.reason for s in report.skipped}


def test_convert_rules_head_shape_filter_and_shared_modules() -> None:
    model = Tiny()
    report = convert_to_fp8(model, CTX, min_features=64)
    r = reasons(report)
    assert set(report.converted) == {"up", "block.0", "shared"}
    assert isinstance(model.block[0], Fp8Linear) and model.shared is model.block[0]
    assert "multiples of 16" in r["odd"]
    assert "min_features=64" in r["narrow"]
    assert "tied to nn.Embedding 'embed'" in r["lm_head"]
    assert "last nn.Linear" in r["out"]
    assert isinstance(model.out, nn.Linear) and not isinstance(model.out, Fp8Linear)
    assert model.lm_head.weight is model.embed.weight
    model(torch.randint(0, 100, (2, 3)))  # still runs

    again = convert_to_fp8(model, CTX, min_features=64)
    assert again.converted == ()
    assert "already an Fp8Linear" in reasons(again)["up"]


def test_a_module_filter_decides_alone() -> None:
    # torchao's module_filter_fn semantics: the filter picks the layers, head and narrow
    # ones included; only what fp8 cannot run is still skipped.
    model = Tiny()
    seen: list[str] = []

    def only_up_out_and_odd(module: nn.Module, fqn: str) -> bool:
        seen.append(fqn)
        return fqn in ("up", "out", "odd")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # something converts: no warning
        report = convert_to_fp8(model, CTX, only_up_out_and_odd)
    assert set(report.converted) == {"up", "out"}  # "out" is the head: the filter wins
    r = reasons(report)
    assert r["block.0"] == "module_filter returned False"
    assert "multiples of 16" in r["odd"]  # chosen, but fp8 GEMM tiles cannot run it
    assert set(seen) == {"up", "odd", "narrow", "block.0", "lm_head", "out"}


def test_a_filter_that_accepts_everything_converts_a_small_model() -> None:
    # Under the old rules (filter AND min_features AND not-the-head) this converted nothing.
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    report = convert_to_fp8(model, CTX, lambda module, fqn: True)
    assert report.converted == ("0", "2")
    assert report.skipped == ()
    assert all(isinstance(m, Fp8Linear) for m in (model[0], model[2]))


def test_a_filter_still_cannot_convert_what_fp8_cannot_run() -> None:
    model = nn.Sequential(
        ScaledLinear(32), nn.Linear(32, 24), nn.Linear(32, 32, dtype=torch.float64)
    )
    with pytest.warns(UserWarning, match="converted none of the 3"):
        report = convert_to_fp8(model, CTX, lambda module, fqn: True)
    assert {s.fqn: s.rule for s in report.skipped} == {
        "0": "subclass",
        "1": "feature_multiple",
        "2": "dtype",
    }
    with pytest.warns(UserWarning, match="the model itself"):
        root = convert_to_fp8(nn.Linear(32, 32), CTX, lambda module, fqn: True)
    assert [s.rule for s in root.skipped] == ["root"]


def test_a_filter_with_include_head_or_min_features_is_refused() -> None:
    model = Tiny()
    with pytest.raises(ValueError, match=r"decides alone .* min_features=64 would be ignored"):
        convert_to_fp8(model, CTX, lambda module, fqn: True, min_features=64)
    with pytest.raises(ValueError, match=r"include_head=False and min_features=16"):
        convert_to_fp8(model, CTX, lambda module, fqn: True, include_head=False, min_features=16)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def test_a_filter_must_return_a_bool() -> None:
    model = Tiny()

    def forgot_return(module: nn.Module, fqn: str) -> Any:
        fqn.startswith("up")  # the return statement is missing: the filter returns None

    with pytest.raises(TypeError, match=r"module_filter must return a bool, got NoneType None"):
        convert_to_fp8(model, CTX, forgot_return)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def test_converting_nothing_warns_naming_the_knobs() -> None:
    # A small model under the defaults: every layer is narrower than min_features=1024 and
    # the last one is the head. This used to convert nothing without a word.
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 32))
    with pytest.warns(UserWarning, match="converted none") as caught:
        report = convert_to_fp8(model, CTX)
    assert report.converted == ()
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "converted none of the 3 nn.Linear layer(s) in Sequential" in text
    assert "2 skipped ('0', '2'): min(in_features, out_features) < min_features=1024" in text
    assert "min_features=16" in text and "module_filter" in text
    assert "1 skipped ('3'): output head; pass include_head=True" in text
    assert caught[0].filename == __file__  # attributed to the caller's line


def test_converting_nothing_warns_for_filters_and_models_without_linears() -> None:
    with pytest.warns(UserWarning, match=r"module_filter returned False; with a filter given"):
        convert_to_fp8(nn.Sequential(nn.Linear(32, 32)), CTX, lambda module, fqn: False)
    with pytest.warns(UserWarning, match=r"found no nn\.Linear in ReLU"):
        convert_to_fp8(nn.ReLU(), CTX)


def test_no_warning_when_the_model_already_runs_fp8() -> None:
    # Converting twice is idempotent: the second call converts nothing, and says nothing.
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    convert_to_fp8(model, CTX, min_features=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = convert_to_fp8(model, CTX, min_features=16)
    assert again.converted == ()
    assert [s.rule for s in again.skipped] == ["already_fp8", "head"]


class ScaledLinear(nn.Linear):
    """A subclass whose forward does more than x Wᵀ + b."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.gain = nn.Parameter(torch.full((n,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain


def test_subclasses_of_nn_linear_are_left_alone() -> None:
    model = nn.Sequential(ScaledLinear(32), nn.Linear(32, 32), nn.Linear(32, 32))
    report = convert_to_fp8(model, CTX, min_features=16)
    assert report.converted == ("1",)
    assert "ScaledLinear is a subclass of nn.Linear" in reasons(report)["0"]
    assert type(model[0]) is ScaledLinear
    mha = nn.MultiheadAttention(32, 2)  # out_proj is a Linear subclass it never calls
    with pytest.warns(UserWarning, match="converted none"):
        report = convert_to_fp8(nn.Sequential(mha, nn.Linear(32, 32)), CTX, min_features=16)
    assert "subclass" in reasons(report)["0.out_proj"]


def test_default_min_features_skips_small_layers() -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(512, 1024), nn.Linear(1024, 8))
    report = convert_to_fp8(copy.deepcopy(model), CTX)
    assert DEFAULT_MIN_FEATURES == 1024
    assert report.converted == ("0",)
    assert "min_features=1024" in reasons(report)["1"]


def test_convert_errors_leave_the_model_untouched() -> None:
    model = Tiny()

    def boom(module: nn.Module, fqn: str) -> bool:
        if fqn == "block.0":
            raise RuntimeError("filter failed")
        return True

    with pytest.raises(RuntimeError, match="filter failed"):
        convert_to_fp8(model, CTX, boom)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    with pytest.raises(ValueError, match="fp8=None"):
        convert_to_fp8(model, ComputeCtx.new(DType.BF16, "cpu"))
    with pytest.raises(ValueError, match="min_features"):
        convert_to_fp8(model, CTX, min_features=0)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        convert_to_fp8("model", CTX)  # type: ignore[arg-type]
    root = nn.Linear(64, 64)
    with pytest.warns(UserWarning, match="the model itself; use Fp8Linear.from_linear"):
        rep = convert_to_fp8(root, CTX, include_head=True, min_features=16)
    assert rep.converted == () and "root module" in reasons(rep)["<root>"]
    assert "converted 0" in str(rep)


# ----- serving ------------------------------------------------------------------------------


def test_serving_weight_is_quantized_once_and_half_the_bytes() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    train = Fp8Linear.from_linear(lin, DYN)
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    before = train(x)
    served = copy.deepcopy(train).freeze_for_serving()
    assert served.frozen and served.weight is None
    bf16_bytes = lin.weight.numel() * 2
    held = sum(
        t.numel() * t.element_size()
        for t in served.state_dict().values()
        if isinstance(t, torch.Tensor) and t.dim() == 2
    )
    assert held * 2 == bf16_bytes
    assert served.weight_fp8.dtype == torch.float8_e4m3fn
    with torch.inference_mode():
        y = served(x)
    # Dynamic scaling: the weight's step is its own amax either way, so outputs agree.
    assert torch.equal(y, before)
    elements = served.scaling.weight.elements
    with torch.inference_mode():
        served(x)
    assert served.scaling.weight.elements == elements  # no per-call weight quantize
    assert "frozen" in repr(served)
    # A serving checkpoint loads into another frozen layer.
    other = Fp8Linear(64, 48, ctx=DYN).freeze_for_serving()
    other.load_state_dict(served.state_dict())
    with torch.inference_mode():
        assert torch.equal(other(x), y)


def test_freezing_inside_inference_mode_leaves_a_normal_layer() -> None:
    # Inference tensors could not be saved for backward or loaded into afterwards.
    m = Fp8Linear(32, 16, ctx=CTX)
    with torch.inference_mode():
        m.freeze_for_serving()
        y = m(torch.randn(2, 32))
    assert not m.weight_fp8.is_inference() and not m.weight_step.is_inference()
    assert torch.isfinite(y).all()
    x = torch.randn(3, 32, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    other = Fp8Linear(32, 16, ctx=CTX).freeze_for_serving()
    m.load_state_dict(other.state_dict())
    assert torch.equal(m.weight_fp8.view(torch.uint8), other.weight_fp8.view(torch.uint8))


def test_serving_layer_still_passes_input_gradients() -> None:
    served = Fp8Linear(32, 16, ctx=CTX).freeze_for_serving()
    x = torch.randn(3, 32, requires_grad=True)
    served(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    from computectx.fp8 import fp8_autocast

    with fp8_autocast(enabled=False):
        plain = served(x.detach())
    w = served.weight_fp8.float() * served.weight_step
    assert torch.allclose(plain, functional.linear(x.detach(), w, served.bias), atol=1e-6)


@pytest.mark.parametrize("flag", ["fp8_e4m3", "fp8_e5m2", "fp8_hybrid"])
def test_from_flag_policies_train(flag: str) -> None:
    ctx = ComputeCtx.from_flag(flag, "cpu")
    assert ctx.fp8 is not None and ctx.compute is DType.BF16
    m = Fp8Linear(32, 32, ctx=ctx)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    assert y.dtype == torch.bfloat16
    torch.autograd.backward(y.float().square().sum())
    assert x.grad is not None and m.weight.grad is not None
    assert torch.isfinite(m.weight.grad).all()
    s = fp8_stats(nn.Sequential(m))["0"]
    fwd, bwd = ctx.fp8.format.forward, ctx.fp8.format.backward
    assert s.input.step == pytest.approx(s.input.amax / fwd.max, rel=1e-6)
    assert s.grad.step == pytest.approx(s.grad.amax / bwd.max, rel=1e-6)


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_module_wide_dtype_casts_leave_a_frozen_weight_alone(cast: str) -> None:
    # fp8 tensors count as floating point, so nn.Module.to(dtype) / .half() would convert
    # weight_fp8 and round the float32 step if the layer let them.
    served = Fp8Linear(32, 16, ctx=CTX).freeze_for_serving()
    data = served.weight_fp8.clone()
    step = served.weight_step.clone()
    wide = nn.Sequential(served)
    if cast == "half":
        wide.half()
    else:
        wide.to(getattr(torch, cast))
    assert served.weight_fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(served.weight_fp8.view(torch.uint8), data.view(torch.uint8))
    assert served.weight_step.dtype == torch.float32 and torch.equal(served.weight_step, step)
    assert served.bias is not None and served.bias.dtype == getattr(torch, cast)
    assert list(dict(served.named_buffers())) == ["weight_fp8", "weight_step"]
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.isfinite(served(x)).all()
    served.to("meta")  # the device still follows
    assert served.weight_fp8.is_meta and served.weight_step.is_meta
    assert served.weight_fp8.dtype == torch.float8_e4m3fn
