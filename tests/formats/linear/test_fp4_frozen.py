"""``FrozenFp4Linear``: built from an ``Fp4Linear`` or from weights given from outside, served
weight-only or W4A4 under ``inference_mode``, saved and loaded through safetensors with the
format checked before anything loads, its bytes per weight element counted by
``memory_report``, its 4-bit work held in operators so ``torch.compile`` (Inductor, CPU)
compiles it whole."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from safetensors.torch import load_file, save_file
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from computectx import ComputeCtx
from computectx.formats import Fp4Linear, Fp4Recipe
from computectx.formats.linear.fp4_frozen import FrozenFp4Linear
from computectx.formats.linear.fp4_serving import ActivationAmax
from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.memory import memory_report

RECIPES = ["nvfp4", "nvfp4+w1x16", "mxfp4", "mxfp4+floor"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def fp4_layer(recipe: str, seed: int = 0, n: int = 64, k: int = 64) -> Fp4Linear:
    torch.manual_seed(seed)
    ctx = ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=Fp4Recipe.parse(recipe))
    lin = Fp4Linear(k, n, ctx=ctx)
    with torch.no_grad():
        lin.bias.normal_()
    return lin


X = torch.linspace(-3.0, 3.0, 3 * 5 * 64).reshape(3, 5, 64).to(torch.bfloat16)


@pytest.mark.parametrize("recipe", RECIPES)
def test_from_fp4_linear_holds_the_forwards_weight_and_shares_the_bias(recipe: str) -> None:
    lin = fp4_layer(recipe)
    frozen = FrozenFp4Linear.from_fp4_linear(lin)
    q = lin.quantized_weight()
    assert same(frozen.weight_fp4, q.codes) and same(frozen.weight_scale, q.scale)
    if isinstance(q, Nvfp4Operand):
        assert same(frozen.weight_amax, q.amax.reshape(1)) and frozen.tile == q.tile
    else:
        assert "weight_amax" not in dict(frozen.named_buffers()) and frozen.tile == "1x32"
    assert frozen.bias is lin.bias
    assert (frozen.in_features, frozen.out_features) == (64, 64)
    assert frozen.weight_fp4.data_ptr() != q.codes.data_ptr()


@pytest.mark.parametrize("recipe", RECIPES)
def test_w4a4_per_tensor_is_the_fp4_linears_forward_and_weight_only_its_dequantized_gemm(
    recipe: str,
) -> None:
    lin = fp4_layer(recipe)
    w4a4 = FrozenFp4Linear.from_fp4_linear(lin, "w4a4", activation_amax="per_tensor")
    weight_only = FrozenFp4Linear.from_fp4_linear(lin, "weight_only")
    lin.train()  # TE's recipe: stochastic rounding on (of gradients only)
    want = lin(X).detach()
    with torch.inference_mode():
        assert same(w4a4(X), want)
        deq = weight_only.dequantized_weight(torch.bfloat16)
        assert same(weight_only(X), F.linear(X, deq, lin.bias.detach().to(torch.bfloat16)))
    # Inside autocast the output has the autocast dtype, as the Fp4Linear's.
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert same(w4a4(X.float()), want)
        assert weight_only(X.float()).dtype == torch.bfloat16


def test_w4a4_per_row_answers_a_request_alike_in_any_batch() -> None:
    lin = fp4_layer("nvfp4")
    frozen = FrozenFp4Linear.from_fp4_linear(lin, "w4a4")
    request = X[0, :1]
    loud = 1000.0 * X[1]
    with torch.inference_mode():
        alone = frozen(request)
        assert same(alone, lin(request))
        assert same(frozen(torch.cat([loud, request]))[-1:], alone)
        per_tensor = FrozenFp4Linear.from_fp4_linear(lin, "w4a4", activation_amax="per_tensor")
        assert not same(per_tensor(torch.cat([loud, request]))[-1:], alone)
        assert frozen(X[:0]).shape == (0, 5, 64)


def test_given_weights_serve_as_the_layer_they_came_from() -> None:
    lin = fp4_layer("nvfp4")
    q = lin.quantized_weight()
    bias = lin.bias.detach().clone()
    given = FrozenFp4Linear(q, bias, mode="w4a4", activation_amax="per_tensor")
    assert isinstance(given.bias, nn.Parameter) and not given.bias.requires_grad
    assert given.bias.data_ptr() != bias.data_ptr()  # copied
    with torch.no_grad():
        assert same(given(X), lin(X))
    with pytest.raises(TypeError, match="takes an Nvfp4Operand or Mxfp4Operand"):
        FrozenFp4Linear(lin.weight)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode must be one of"):
        FrozenFp4Linear(q, mode="w4a16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mx_rounding must be"):
        FrozenFp4Linear(q, mx_rounding="nearest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"bias must be .* \(64,\)"):
        FrozenFp4Linear(q, torch.zeros(32))
    with pytest.raises(TypeError, match="from_fp4_linear takes an Fp4Linear"):
        FrozenFp4Linear.from_fp4_linear(nn.Linear(64, 64))  # type: ignore[arg-type]
    frozen = FrozenFp4Linear(q)
    with pytest.raises(ValueError, match=r"expects inputs of shape \(\.\.\., 64\)"):
        frozen(torch.zeros(2, 32))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        frozen(torch.zeros(2, 64, dtype=torch.int64))


def test_input_gradients_flow_the_weight_needs_none() -> None:
    lin = fp4_layer("nvfp4")
    for mode in ("weight_only", "w4a4"):
        frozen = FrozenFp4Linear.from_fp4_linear(lin, mode)
        x = X.float().reshape(-1, 64).requires_grad_(True)
        dy = torch.linspace(-1, 1, x.shape[0] * 64).reshape(-1, 64)
        (frozen(x) * dy).sum().backward()
        assert x.grad is not None
        # W4A4 passes straight through the activation's rounding.
        assert torch.equal(x.grad, dy @ frozen.dequantized_weight(torch.float32))
        assert lin.bias.grad is not None and torch.equal(lin.bias.grad, dy.sum(0))
        lin.bias.grad = None
        assert not any(t.requires_grad for t in frozen.buffers())


@pytest.mark.parametrize(
    ("recipe", "per_element"),
    [("nvfp4", 0.5 + 1 / 256), ("nvfp4+w1x16", 0.5625), ("mxfp4", 0.53125)],
)
def test_bytes_per_weight_element_by_memory_report(recipe: str, per_element: float) -> None:
    n, k = 256, 512
    frozen = FrozenFp4Linear.from_fp4_linear(fp4_layer(recipe, n=n, k=k))
    report = memory_report(frozen.weight_tensors())
    held = sum(row.bytes for row in report.rows)
    per_tensor = 4 if recipe.startswith("nvfp4") else 0
    assert held == per_element * n * k + per_tensor
    dtypes = {row.dtype for row in report.rows}
    assert "float4_e2m1fn_x2" in str(dtypes)


def test_to_moves_the_frozen_tensors_and_never_casts_them() -> None:
    frozen = FrozenFp4Linear.from_fp4_linear(fp4_layer("nvfp4"))
    before = {k: v.clone() for k, v in frozen.named_buffers()}
    frozen.to(torch.bfloat16)
    frozen.half()
    frozen.to("cpu")
    assert frozen.bias is not None and frozen.bias.dtype == torch.float16
    assert all(same(v, before[k]) for k, v in frozen.named_buffers())


def test_a_meta_skeleton_materialises_and_loads(tmp_path: pathlib.Path) -> None:
    lin = fp4_layer("nvfp4")
    q = lin.quantized_weight()
    assert isinstance(q, Nvfp4Operand)
    meta = Nvfp4Operand(q.codes.to("meta"), q.scale.to("meta"), q.amax.to("meta"), q.tile)
    skeleton = nn.Sequential(FrozenFp4Linear(meta, mode="w4a4", activation_amax="per_tensor"))
    skeleton.to_empty(device="cpu")
    assert all(t.device.type == "cpu" for t in skeleton.buffers())
    served = nn.Sequential(FrozenFp4Linear(q, mode="w4a4", activation_amax="per_tensor"))
    skeleton.load_state_dict(saved(served, tmp_path))
    with torch.no_grad():
        assert same(skeleton(X), served(X))


# ----- saving and loading ---------------------------------------------------------------------


def saved(model: nn.Module, path: pathlib.Path) -> dict[str, torch.Tensor]:
    save_file(model.state_dict(), str(path / "frozen.safetensors"))
    return load_file(str(path / "frozen.safetensors"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_safetensors_round_trip_serves_the_same_bits(recipe: str, tmp_path: pathlib.Path) -> None:
    model = nn.Sequential(FrozenFp4Linear.from_fp4_linear(fp4_layer(recipe), "w4a4"))
    state = saved(model, tmp_path)
    assert state["0.weight_fp4"].dtype == torch.float4_e2m1fn_x2
    fresh = nn.Sequential(FrozenFp4Linear.from_fp4_linear(fp4_layer(recipe, seed=5), "w4a4"))
    with torch.inference_mode():
        assert not same(fresh(X), model(X))
    fresh.load_state_dict(state)
    with torch.inference_mode():
        assert same(fresh(X), model(X))
    # The mode is the layer's: the same weights serve weight-only too.
    other = nn.Sequential(FrozenFp4Linear.from_fp4_linear(fp4_layer(recipe, seed=5)))
    other.load_state_dict(state)
    got, want = other[0], model[0]
    assert isinstance(got, FrozenFp4Linear) and isinstance(want, FrozenFp4Linear)
    assert same(got.dequantized_weight(), want.dequantized_weight())


def _refusals(state: dict[str, torch.Tensor]) -> list[tuple[dict[str, object], str]]:
    nan_scale = state["1.weight_scale"].clone()
    nan_scale.view(torch.uint8)[0, 0] = 0x7F
    w = torch.zeros(64, 64)
    without = {k: v for k, v in state.items() if not k.startswith("1.weight_")}
    return [
        ({**without, "1.weight": w}, "high-precision '?1.weight"),
        ({**state, "1.weight_fp8": w}, "fp8 layer's 1.weight_fp8"),
        ({**state, "1._extra_state": torch.tensor([1, 1])}, "holds mxfp4 weights"),
        ({**state, "1._extra_state": torch.tensor([1, 2])}, "holds nvfp4 weights in 1x16 blocks"),
        ({**state, "1._extra_state": torch.tensor([1, 0, 0, 0])}, "training state"),
        ({**state, "1._extra_state": torch.tensor([9, 0])}, "version 9"),
        ({**state, "1.weight_scale": state["1.weight_scale"].float()}, "weight_scale is"),
        ({**state, "1.weight_fp4": state["1.weight_fp4"][:32]}, "weight_fp4 is"),
        ({**state, "1.weight_scale": nan_scale}, "block scales must be finite"),
        # What is wrong is named, the value never shown.
        ({**state, "1.weight_amax": torch.tensor([float("inf")])}, "amax must be .*got inf$"),
        ({**state, "1.weight_amax": torch.tensor([float("nan")])}, "amax must be .*got NaN$"),
        ({**state, "1.weight_amax": torch.tensor([-2.5])}, "must be .*got a negative value$"),
        ({k: v for k, v in state.items() if k != "1.weight_amax"}, "loads .* whole"),
    ]


def test_a_load_it_refuses_changes_no_layer(tmp_path: pathlib.Path) -> None:
    def model(seed: int) -> nn.Sequential:
        return nn.Sequential(
            FrozenFp4Linear.from_fp4_linear(fp4_layer("nvfp4", seed)),
            FrozenFp4Linear.from_fp4_linear(fp4_layer("nvfp4", seed + 1)),
        )

    state = saved(model(0), tmp_path)
    target = model(7)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    for bad, match in _refusals(state):
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(bad)
        after = target.state_dict()
        assert all(same(v, before[k]) for k, v in after.items()), match
    # An Fp4Linear (training) model refuses the frozen checkpoint too, before loading.
    trained = nn.Sequential(fp4_layer("nvfp4"), fp4_layer("nvfp4"))
    with pytest.raises((ValueError, RuntimeError)):
        trained.load_state_dict(state)
    # MXFP4 layer, NVFP4 checkpoint: the state names both formats.
    mx = nn.Sequential(FrozenFp4Linear.from_fp4_linear(fp4_layer("mxfp4")))
    one = {k[2:]: v for k, v in state.items() if k.startswith("0.")}
    with pytest.raises(ValueError, match=r"mxfp4 weights .* holds nvfp4 weights in 16x16 tiles"):
        mx[0].load_state_dict(one)
    # load_weights' check (the memory layer's seam) is the same one.
    first = target[0]
    assert isinstance(first, FrozenFp4Linear)
    with pytest.raises(ValueError, match="high-precision"):
        first.check_state_tensors({"weight": torch.zeros(64, 64)}, prefix="0.")


# ----- edges found by the adversarial pass --------------------------------------------------


def test_a_refused_input_is_named_by_dtype_and_shape_never_its_values() -> None:
    frozen = FrozenFp4Linear.from_fp4_linear(fp4_layer("nvfp4"))
    with pytest.raises(TypeError, match=r"got float64 \(2, 64\); cast it first") as err:
        frozen(torch.full((2, 64), 0.123456, dtype=torch.float64))
    assert "0.123" not in str(err.value)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mode", ["weight_only", "w4a4"])
def test_no_rows_under_grad_give_an_empty_output_and_zero_gradients(recipe: str, mode: str) -> None:
    lin = fp4_layer(recipe)
    frozen = FrozenFp4Linear.from_fp4_linear(lin, mode)  # type: ignore[arg-type]
    for shape in ((0, 64), (2, 0, 64)):
        x = torch.zeros(shape, requires_grad=True)
        y = frozen(x)
        assert y.shape == (*shape[:-1], 64) and y.dtype == x.dtype
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        assert lin.bias.grad is not None and not lin.bias.grad.any()
        lin.bias.grad = None


@pytest.mark.parametrize("rule", ["per_row", "per_tensor"])
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_a_double_cast_bias_serves_as_before(recipe: str, rule: ActivationAmax) -> None:
    # .double() casts the bias only (the frozen tensors never change dtype); W4A4's epilogue
    # adds it in float32, where the float64 copy of a float32 bias is the same number.
    lin = fp4_layer(recipe)
    frozen = FrozenFp4Linear.from_fp4_linear(lin, "w4a4", activation_amax=rule)
    with torch.no_grad():
        want = frozen(X)
        frozen.double()
        assert frozen.bias is not None and frozen.bias.dtype == torch.float64
        assert same(frozen(X), want)


def test_an_unknown_weight_code_is_named_unknown_not_as_the_layers_own() -> None:
    frozen = FrozenFp4Linear.from_fp4_linear(fp4_layer("mxfp4+floor"))
    state = frozen.state_dict()
    for code in (3, 4, 6, 7):  # a 1x16 bit on MXFP4, a floor bit on NVFP4
        with pytest.raises(ValueError, match=f"<unknown weight code {code}>"):
            frozen.load_state_dict({**state, "_extra_state": torch.tensor([1, code])})


def test_a_meta_extra_state_is_refused_naming_it() -> None:
    frozen = FrozenFp4Linear.from_fp4_linear(fp4_layer("nvfp4"))
    state = frozen.state_dict()
    meta = {**state, "_extra_state": state["_extra_state"].to("meta")}
    with pytest.raises(ValueError, match=r"_extra_state must be .* got int64 \(2,\) on meta"):
        frozen.load_state_dict(meta)


def test_the_layers_own_freeze_and_a_frozen_checkpoint_into_a_training_layer() -> None:
    layer = fp4_layer("nvfp4")
    frozen = layer.freeze_for_serving("w4a4", activation_amax="per_tensor")
    assert isinstance(frozen, FrozenFp4Linear)
    with torch.no_grad():
        assert same(frozen(X), layer(X))
    # A serving checkpoint into a training layer: refused, saying what it is (it said "an fp8
    # layer's state is a dict").
    with pytest.raises(ValueError, match=r"a frozen 4-bit layer's \(FrozenFp4Linear"):
        fp4_layer("nvfp4", 1).load_state_dict(frozen.state_dict())


SERVED = [("nvfp4", "w4a4"), ("nvfp4", "weight_only"), ("mxfp4", "weight_only")]
OPERATORS = {
    "w4a4": ["computectx.fp4_quantize_rows.default", "computectx.fp4_scaled_mm.default"],
    "weight_only": ["computectx.fp4_dequantize.default"],
}


@pytest.mark.parametrize(("recipe", "mode"), SERVED)
def test_a_traced_forward_holds_every_float4_value_inside_operators(recipe: str, mode: str) -> None:
    # Inductor's CPU backend generates no float4_e2m1fn_x2 code and takes no float4 buffer as
    # a kernel argument: traced as plain ops, the per-row quantize's packing (bitwise ops, a
    # view to float4) and the weight's unpacking (a view of the codes) failed to compile.
    frozen = FrozenFp4Linear.from_fp4_linear(fp4_layer(recipe), mode)  # type: ignore[arg-type]
    with torch.no_grad():
        graph = make_fx(frozen)(X).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert [t for t in targets if "computectx" in t] == OPERATORS[mode]
    assert not any("bitwise" in t or "view.dtype" in t for t in targets), targets


@pytest.fixture
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize(("recipe", "mode"), [("nvfp4", "w4a4"), ("mxfp4", "weight_only")])
def test_a_frozen_layer_compiles_whole_and_serves_the_eager_bits(recipe: str, mode: str) -> None:
    frozen = FrozenFp4Linear.from_fp4_linear(fp4_layer(recipe), mode)  # type: ignore[arg-type]

    def serve(x: torch.Tensor) -> torch.Tensor:
        # The input made by a pointwise op, as by a norm before the layer: Inductor fused the
        # traced per-row quantize into it and could not generate the float4 kernel.
        y: torch.Tensor = frozen((x.float() * 3).to(x.dtype))
        return y

    compiled = torch.compile(serve, fullgraph=True)  # Inductor, on the CPU
    with torch.inference_mode():
        assert same(compiled(X), serve(X))
