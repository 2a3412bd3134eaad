"""QuantizedLinear: drop-in behaviour, gradients within a bound derived from the formats'
precision, needs_input_grad, from_linear, serving."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional

from computectx import ComputeCtx, DType, Fp8Format
from computectx.formats import (
    Backend,
    DelayedScaling,
    Fp8Scheme,
    QuantizedLinear,
    Recipe,
    convert_to_quantized,
    scaling_stats,
)

from ..conftest import StepOf

# ----- the error bound ----------------------------------------------------------------------


def unit(fmt: Fp8Format) -> float:
    """Relative rounding error bound in the normal range: half an ulp, 2**-(m + 1)."""
    return 2.0 ** -(fmt.mantissa_bits + 1)


def dynamic_step(t: torch.Tensor, fmt: Fp8Format) -> float:
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
    ha = dynamic_step(a, fa) * fa.min_subnormal / 2
    hb = dynamic_step(b, fb) * fb.min_subnormal / 2
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
    n_in=st.sampled_from([16, 32, 48]),  # fp8 widths are multiples of 16 (check_fp8_widths)
    n_out=st.sampled_from([16, 32, 48]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_within_the_derived_bound(
    rows: int, n_in: int, n_out: int, scale: float, seed: int, dynamic_ctx: ComputeCtx
) -> None:
    g = torch.Generator().manual_seed(seed)
    m = QuantizedLinear(n_in, n_out, ctx=dynamic_ctx)
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


def test_drop_in_keys_dtypes_and_leading_shapes(fp8_ctx: ComputeCtx) -> None:
    m = QuantizedLinear(32, 16, ctx=fp8_ctx)
    assert isinstance(m, nn.Linear)
    assert m.weight.dtype == fp8_ctx.master.torch and m.weight.device == fp8_ctx.device
    scaling = [f"fp8_{r}_{t}" for r in ("input", "weight", "grad") for t in ("ledger", "tally")]
    assert list(m.state_dict()) == ["weight", "bias", *scaling, "fp8_meta"]
    assert m.backend is Backend.REFERENCE
    x = torch.randn(2, 3, 5, 32, dtype=torch.bfloat16)
    y = m(x)
    assert y.shape == (2, 3, 5, 16) and y.dtype == torch.bfloat16
    y1 = m(torch.randn(32))
    assert y1.shape == (16,)
    empty = m(torch.randn(0, 32, requires_grad=True))
    assert empty.shape == (0, 16)
    assert m.scaling.input.elements == 2 * 3 * 5 * 32 + 32  # empty input never quantized


def test_bad_inputs_and_ctx_are_clear_errors(fp8_ctx: ComputeCtx) -> None:
    with pytest.raises(ValueError, match="recipe=None"):
        QuantizedLinear(16, 16, ctx=ComputeCtx.new(DType.BF16, "cpu"))
    # Only a ComputeCtx is accepted: an object with the same attributes is not one, and the
    # error names what was passed.
    lookalike: Any = SimpleNamespace(
        recipe=fp8_ctx.recipe, compute=fp8_ctx.compute, device=fp8_ctx.device
    )
    with pytest.raises(
        TypeError, match=r"QuantizedLinear needs a computectx\.ComputeCtx .*namespace"
    ):
        QuantizedLinear(16, 16, ctx=lookalike)
    with pytest.raises(ValueError, match="bad device 'gpu0'; accepted: 'cpu'"):
        QuantizedLinear(16, 16, ctx=fp8_ctx, device="gpu0")
    m = QuantizedLinear(16, 16, ctx=fp8_ctx)
    with pytest.raises(TypeError, match="float64"):
        m(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(\.\.\., 16\)"):
        m(torch.randn(2, 17))
    with pytest.raises(ValueError, match="cannot force the triton"):
        QuantizedLinear(16, 16, ctx=fp8_ctx, backend="triton")
    # Parameters fp8 cannot quantize are refused when the layer is built, not at its
    # first call.
    with pytest.raises(ValueError, match=r"weight from bf16, fp16 or fp32; got torch\.float64"):
        QuantizedLinear(16, 16, ctx=fp8_ctx.replace(master=DType.F64))
    with pytest.raises(ValueError, match=r"weight .* got torch\.float64"):
        QuantizedLinear.from_linear(nn.Linear(16, 16, dtype=torch.float64), fp8_ctx)
    mixed = nn.Linear(16, 16)
    mixed.bias = nn.Parameter(torch.zeros(16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bias .* got torch\.float64"):
        QuantizedLinear.from_linear(mixed, fp8_ctx)


@pytest.mark.parametrize(
    ("x_grad", "w_grad", "b_grad"),
    [(True, False, False), (False, True, True), (False, False, True), (False, False, False)],
)
def test_needs_input_grad_is_respected(
    x_grad: bool, w_grad: bool, b_grad: bool, fp8_ctx: ComputeCtx
) -> None:
    m = QuantizedLinear(16, 16, ctx=fp8_ctx)
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
def test_schemes_pick_forward_and_backward_formats(
    scheme: Fp8Scheme, fp8_ctx: ComputeCtx, step_of: StepOf
) -> None:
    ctx = fp8_ctx.replace(recipe=Recipe(format=scheme, scaling=DelayedScaling()))
    m = QuantizedLinear(16, 16, ctx=ctx)
    x = torch.randn(4, 16)
    x[0, 0] = 8.0
    x[1:] = x[1:].clamp(-4, 4)
    m(x).sum().backward()
    s = scaling_stats(nn.Sequential(m))["0"]
    # Each step is one float32 division by its own format's max: exactly that quotient.
    assert s.input.step == step_of(8.0, scheme.forward)
    assert s.grad.step == step_of(1.0, scheme.backward)


def test_to_moves_ledgers_without_changing_their_dtype(fp8_ctx: ComputeCtx) -> None:
    m = QuantizedLinear(16, 16, ctx=fp8_ctx)
    m(torch.randn(2, 16))
    m.to(torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    for op in m.scaling.operands.values():
        assert op.ledger.dtype == torch.float32
    m.to("meta")
    assert all(op.ledger.device.type == "meta" for op in m.scaling.operands.values())


def test_from_linear_shares_parameters_so_the_optimizer_keeps_training(
    fp8_ctx: ComputeCtx, small_mlp: nn.Sequential
) -> None:
    model = small_mlp
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = model[0]
    assert isinstance(first, nn.Linear)
    w0 = first.weight
    before = w0.detach().clone()
    report = convert_to_quantized(model, fp8_ctx, min_features=16, include_head=True)
    assert report.converted == ("0", "2")
    converted = model[0]
    assert isinstance(converted, QuantizedLinear) and converted.weight is w0
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    assert not torch.equal(converted.weight, before)


# ----- serving ------------------------------------------------------------------------------


def test_serving_weight_is_quantized_once_and_half_the_bytes(dynamic_ctx: ComputeCtx) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    train = QuantizedLinear.from_linear(lin, dynamic_ctx)
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
    other = QuantizedLinear(64, 48, ctx=dynamic_ctx).freeze_for_serving()
    other.load_state_dict(served.state_dict())
    with torch.inference_mode():
        assert torch.equal(other(x), y)


def test_freezing_inside_inference_mode_leaves_a_normal_layer(fp8_ctx: ComputeCtx) -> None:
    # Inference tensors could not be saved for backward or loaded into afterwards.
    m = QuantizedLinear(32, 16, ctx=fp8_ctx)
    with torch.inference_mode():
        m.freeze_for_serving()
        y = m(torch.randn(2, 32))
    assert not m.weight_fp8.is_inference() and not m.weight_step.is_inference()
    assert torch.isfinite(y).all()
    x = torch.randn(3, 32, requires_grad=True)
    m(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    other = QuantizedLinear(32, 16, ctx=fp8_ctx).freeze_for_serving()
    m.load_state_dict(other.state_dict())
    assert torch.equal(m.weight_fp8.view(torch.uint8), other.weight_fp8.view(torch.uint8))


def test_serving_layer_still_passes_input_gradients(fp8_ctx: ComputeCtx) -> None:
    served = QuantizedLinear(32, 16, ctx=fp8_ctx).freeze_for_serving()
    x = torch.randn(3, 32, requires_grad=True)
    served(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    from computectx.formats import autocast

    with autocast(enabled=False):
        plain = served(x.detach())
    # The same dequantized weight and the same F.linear: the same bits.
    w = served.weight_fp8.float() * served.weight_step
    assert torch.equal(plain, functional.linear(x.detach(), w, served.bias))


@pytest.mark.parametrize("flag", ["fp8_e4m3", "fp8_e5m2", "fp8_hybrid"])
def test_from_flag_policies_train(flag: str, step_of: StepOf) -> None:
    ctx = ComputeCtx.from_flag(flag, "cpu")
    assert isinstance(ctx.recipe, Recipe) and ctx.compute is DType.BF16
    m = QuantizedLinear(32, 32, ctx=ctx)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    assert y.dtype == torch.bfloat16
    torch.autograd.backward(y.float().square().sum())
    assert x.grad is not None and m.weight.grad is not None
    assert torch.isfinite(m.weight.grad).all()
    s = scaling_stats(nn.Sequential(m))["0"]
    fwd, bwd = ctx.recipe.format.forward, ctx.recipe.format.backward
    assert s.input.step == step_of(s.input.amax, fwd)
    assert s.grad.step == step_of(s.grad.amax, bwd)


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_module_wide_dtype_casts_leave_a_frozen_weight_alone(
    cast: str, fp8_ctx: ComputeCtx
) -> None:
    # fp8 tensors count as floating point, so nn.Module.to(dtype) / .half() would convert
    # weight_fp8 and round the float32 step if the layer let them.
    served = QuantizedLinear(32, 16, ctx=fp8_ctx).freeze_for_serving()
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
    buffers = dict(served.named_buffers())
    assert list(buffers) == [*served.scaling.tensor_names(), "weight_fp8", "weight_step"]
    assert {str(buffers[k].dtype) for k in served.scaling.tensor_names()} == {
        "torch.float32",
        "torch.int64",
    }
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.isfinite(served(x)).all()
    served.to("meta")  # the device still follows
    assert served.weight_fp8.is_meta and served.weight_step.is_meta
    assert served.weight_fp8.dtype == torch.float8_e4m3fn


def test_the_default_backend_follows_the_weight_however_it_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A layer built on meta and filled by load_state_dict(assign=True) has its weight on
    # another device without _apply running: the next call must look the backend up again.
    import computectx.formats.linear.module as linear_module

    per_device = {"meta": Backend.TRITON, "cpu": Backend.REFERENCE}
    monkeypatch.setattr(linear_module, "default_backend", lambda d: per_device[d.type])
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    layer = QuantizedLinear(16, 16, ctx=ctx, device="meta")
    on_meta = layer.backend
    source = QuantizedLinear(16, 16, ctx=ctx)
    layer.load_state_dict(source.state_dict(), assign=True)
    assert layer.weight.device.type == "cpu"
    on_cpu = layer.backend
    assert (on_meta, on_cpu) == (Backend.TRITON, Backend.REFERENCE)
    assert torch.equal(layer(torch.ones(2, 16)), source(torch.ones(2, 16)))


@pytest.mark.parametrize(("n_in", "n_out"), [(20, 64), (64, 20), (8, 4)])
def test_fp8_linear_refuses_the_widths_conversion_skips_with_the_same_message(
    fp8_ctx: ComputeCtx, n_in: int, n_out: int
) -> None:
    want = (
        rf"in_features={n_in}, out_features={n_out}: both must be multiples of 16 for fp8 GEMM "
        rf"tiles"
    )
    with pytest.raises(ValueError, match=want) as built:
        QuantizedLinear(n_in, n_out, ctx=fp8_ctx)
    with pytest.raises(ValueError, match=want):
        QuantizedLinear.from_linear(nn.Linear(n_in, n_out), fp8_ctx)
    model = nn.Sequential(nn.Linear(n_in, n_out))
    with pytest.warns(UserWarning, match="converted none"):
        report = convert_to_quantized(model, fp8_ctx, lambda module, fqn: True)
    (skipped,) = report.skipped
    assert (skipped.rule, skipped.reason) == ("feature_multiple", str(built.value))


@pytest.mark.parametrize("text", ["row", "block", "block+pow2", "mx", "mx+floor"])
def test_every_granularity_builds_converts_and_runs_in_a_region(text: str) -> None:
    from computectx.formats import autocast

    ctx = ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse(text))
    x = torch.randn(4, 32)
    layer = QuantizedLinear(32, 32, ctx=ctx)
    assert layer(x).shape == (4, 32)
    model = nn.Sequential(nn.Linear(32, 32))
    assert convert_to_quantized(model, ctx, lambda m, fqn: True).converted == ("0",)
    plain = nn.Sequential(nn.Linear(32, 32))
    with autocast(ctx):
        plain(x)
    assert scaling_stats(plain)["0"].input.elements == 4 * 32  # ran in fp8, recorded
    # A layer built per tensor runs such a ctx swapped in later, at its next call.
    swapped = QuantizedLinear(32, 32, ctx=ctx.replace(recipe=Recipe()))
    with torch.no_grad():
        swapped.weight.copy_(layer.weight)
        swapped.bias.copy_(layer.bias)
    swapped.ctx = ctx
    assert torch.equal(swapped(x), layer(x))


@pytest.mark.parametrize(("n_in", "n_out"), [(48, 64), (64, 48), (16, 16)])
def test_mx_refuses_widths_not_a_multiple_of_32_and_conversion_skips_them_so(
    n_in: int, n_out: int
) -> None:
    ctx = ComputeCtx.from_flag("fp8_mx", "cpu")
    want = (
        rf"in_features={n_in}, out_features={n_out}: granularity 'mx' needs both to be "
        rf"multiples of 32"
    )
    with pytest.raises(ValueError, match=want) as built:
        QuantizedLinear(n_in, n_out, ctx=ctx)
    with pytest.warns(UserWarning, match=r"widths the policy's granularity cannot run"):
        report = convert_to_quantized(nn.Sequential(nn.Linear(n_in, n_out)), ctx, lambda m, f: True)
    (skipped,) = report.skipped
    assert (skipped.rule, skipped.reason) == ("granularity", str(built.value))
    # block runs them (partial 128-wide blocks), so the same layer converts under it.
    block = ComputeCtx.from_flag("fp8_block", "cpu")
    assert QuantizedLinear(n_in, n_out, ctx=block)(torch.randn(3, n_in)).shape == (3, n_out)


def test_freezing_a_granularity_without_a_layout_is_refused_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every granularity freezes today (linear/test_frozen.py); one with no serving layout
    # (mx before it had one, as the 4-bit recipes will be) is refused before any change.
    from computectx.formats import serving

    monkeypatch.delitem(serving.LAYOUT_OF_GRANULARITY, "mx")
    layer = QuantizedLinear(64, 32, ctx=ComputeCtx.from_flag("fp8_mx", "cpu"), dtype=torch.float32)
    x = torch.randn(4, 64)
    before = layer(x)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    want = (
        r"freeze_for_serving: recipe .*\(granularity 'mx'\) has no serving weight layout: "
        r".*'row' \(row\), 'block' \(128x128\).*Nothing was changed"
    )
    with pytest.raises(ValueError, match=want):
        layer.freeze_for_serving()
    assert not layer.frozen and isinstance(layer.weight, nn.Parameter)
    after = layer.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert torch.equal(layer(x), before)  # still runs, as it did


@pytest.mark.parametrize("flag", ["fp8_rowwise", "fp8_block", "fp8_mx"])
def test_the_inline_quantize_is_refused_under_fine_grained_policies(flag: str) -> None:
    ctx = ComputeCtx.from_flag(flag, "cpu")
    want = rf"quantize='inline' is a per-tensor option.*'{ctx.recipe.granularity}'"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=want):
        QuantizedLinear(32, 32, ctx=ctx, quantize="inline")
    with pytest.raises(ValueError, match=want):
        QuantizedLinear.from_linear(nn.Linear(32, 32), ctx, quantize="inline")
    layer = QuantizedLinear(32, 32, ctx=ctx)
    with pytest.raises(ValueError, match=want):
        layer.quantize = "inline"
    assert layer.quantize == "op"
    # A per-tensor layer built inline refuses a fine-grained ctx swapped in, when it is set.
    inline = QuantizedLinear(32, 32, ctx=ctx.replace(recipe=Recipe()), quantize="inline")
    with pytest.raises(ValueError, match=want):
        inline.ctx = ctx
    assert inline.policy == Recipe()
    inline(torch.randn(2, 32))
