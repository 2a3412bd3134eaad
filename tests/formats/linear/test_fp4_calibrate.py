"""Static NVFP4 W4A4 serving: ``calibrate_fp4_activations`` records each static layer's input
amax, and ``FrozenFp4Linear(activation_amax="static")`` quantizes every call with it (bit for
bit the twin chain with ``S_enc`` from that amax, batch-invariant, saturating above it)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats import Fp4Linear, Fp4Recipe, calibrate_fp4_activations
from computectx.formats.linear.fp4_freeze import freeze_fp4_for_serving
from computectx.formats.linear.fp4_frozen import FrozenFp4Linear
from computectx.formats.linear.fp4_serving import check_serving
from computectx.formats.numerics.fp4 import quantize_nvfp4, tensor_amax
from computectx.formats.numerics.fp4_gemm import reference_fp4_mm


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def fp4_layer(recipe: str = "nvfp4", seed: int = 0, n: int = 32, k: int = 64) -> Fp4Linear:
    torch.manual_seed(seed)
    ctx = ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=Fp4Recipe.parse(recipe))
    lin = Fp4Linear(k, n, ctx=ctx)
    with torch.no_grad():
        lin.bias.normal_()
    return lin


def static_layer(amax: float | None = 2.5) -> FrozenFp4Linear:
    frozen = FrozenFp4Linear.from_fp4_linear(fp4_layer(), "w4a4", activation_amax="static")
    if amax is not None:
        frozen.set_input_amax(torch.tensor([amax]))
    return frozen


def twin(frozen: FrozenFp4Linear, x2: torch.Tensor) -> torch.Tensor:
    """The reference chain: the activation by ``quantize_nvfp4`` at the calibrated amax."""
    qx = quantize_nvfp4(x2, amax=frozen.input_amax)
    return reference_fp4_mm(qx, frozen.weight_operand, x2.dtype, frozen.bias)


def test_static_is_the_twin_chain_at_the_calibrated_amax_and_batch_invariant() -> None:
    frozen = static_layer(2.5)
    torch.manual_seed(1)
    x = (torch.randn(6, 64) * 1.5).to(torch.bfloat16)  # some elements above 2.5: saturate
    assert bool((x.float().abs() > 2.5).any())
    with torch.no_grad():
        y = frozen(x)
        assert same(y, twin(frozen, x))
        for i in range(x.shape[0]):  # each row alone: the same bits
            assert same(frozen(x[i : i + 1]), y[i : i + 1])
        # Against per_tensor (the batch's own amax) the codes differ: the static amax is used.
        dynamic = FrozenFp4Linear.from_fp4_linear(fp4_layer(), "w4a4", activation_amax="per_tensor")
        assert not same(dynamic(x), y)


def test_above_the_amax_saturates_and_nan_inf_follow_the_dynamic_rule() -> None:
    amax = torch.tensor([3.0])
    x = torch.zeros(3, 64)
    x[0, :16] = 3.0
    x[1, :16] = 3000.0  # far above: E4M3 scale at 448, codes at 6 -> 6 * 448 / S_enc
    x[2, 0], x[2, 16] = float("nan"), float("inf")
    q = quantize_nvfp4(x, amax=amax)
    from computectx.formats.numerics.fp4 import dequantize_nvfp4

    d = dequantize_nvfp4(q)
    limit = 6 * 448 / (448 * 6 / 3.0)
    assert torch.equal(d[1, :16], torch.full((16,), limit))
    assert torch.equal(d[0, :16], d[1, :16])  # the amax itself and far above: one value
    assert bool(d[2, :16].isnan().all()) and torch.equal(d[2, 16:32].abs().max(), torch.tensor(3.0))
    frozen = static_layer(3.0)
    with torch.no_grad():
        y = frozen(x)
    assert same(y, twin(frozen, x))
    assert bool(y[2].isnan().all()) and bool(y[:2].isfinite().all())


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = fp4_layer(seed=2, n=64), fp4_layer(seed=3)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        y: torch.Tensor = self.b(torch.relu(self.a(x)) * scale)
        return y


def test_calibration_records_each_layers_input_amax_over_the_batches() -> None:
    model = Two()
    assert freeze_fp4_for_serving(model, "w4a4", activation_amax="static") == ("a", "b")
    batches = [torch.randn(4, 64) * s for s in (1.0, 3.0, 2.0)]
    with pytest.raises(RuntimeError, match="not calibrated"):
        model(batches[0])
    names = calibrate_fp4_activations(model, [batches[0], (batches[1],), {"x": batches[2]}])
    assert names == ("a", "b")
    assert isinstance(model.a, FrozenFp4Linear) and isinstance(model.b, FrozenFp4Linear)
    want_a = max(float(tensor_amax(b)) for b in batches)
    assert model.a.input_amax.tolist() == [want_a] and model.a.input_amax.dtype == torch.float32
    # b's input is a's weight-only output (activations unquantized while calibrating).
    with torch.no_grad():
        want_b = max(float(tensor_amax(torch.relu(_weight_only(model.a, b)))) for b in batches)
    assert model.b.input_amax.tolist() == [want_b]
    assert model.a.calibrating is None and model.a.input_calibrated
    model(batches[0])  # serves now


def _weight_only(layer: FrozenFp4Linear, x: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor = torch.nn.functional.linear(x, layer.dequantized_weight(x.dtype), layer.bias)
    return y


def test_a_refused_calibration_installs_nothing() -> None:
    model = Two()
    freeze_fp4_for_serving(model, "w4a4", activation_amax="static")
    assert isinstance(model.a, FrozenFp4Linear)
    model.a.set_input_amax(torch.tensor([1.0]))

    def bad() -> object:
        yield torch.randn(2, 64)
        raise KeyError("the data loader failed")

    with pytest.raises(KeyError):
        calibrate_fp4_activations(model, bad())
    with pytest.raises(ValueError, match="held no batch"):
        calibrate_fp4_activations(model, [])
    assert model.a.input_amax.tolist() == [1.0] and model.a.calibrating is None
    with pytest.raises(ValueError, match="no FrozenFp4Linear with activation_amax='static'"):
        calibrate_fp4_activations(nn.Sequential(FrozenFp4Linear.from_fp4_linear(fp4_layer())), [])


def test_the_amax_is_saved_loaded_and_checked(tmp_path: pathlib.Path) -> None:
    frozen = static_layer(2.0)
    state = frozen.state_dict()
    assert state["input_amax"].dtype == torch.float32 and state["input_amax"].shape == (1,)
    other = static_layer(None)
    other.load_state_dict(state)
    assert other.input_calibrated and other.input_amax.tolist() == [2.0]
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert same(other(x), frozen(x))
    fresh = static_layer(None)
    for bad, why in [
        (torch.tensor([float("inf")]), "finite"),
        (torch.tensor([-1.0]), "> 0"),
        (torch.tensor([0.0]), "serve the bias alone"),
        (torch.tensor([2.0], dtype=torch.float64), "float32 tensor \\(1,\\)"),
        (torch.tensor(2.0), "float32 tensor \\(1,\\)"),
    ]:
        with pytest.raises(ValueError, match=why):
            fresh.load_state_dict({**state, "input_amax": bad})
        assert not fresh.input_calibrated and bool(fresh.input_amax.isnan().all())
    with pytest.raises(RuntimeError, match="input_amax is not calibrated"):
        fresh(x)
    fresh.half()  # a module-wide cast keeps the amax float32
    assert fresh.input_amax.dtype == torch.float32


def test_static_is_nvfp4_and_a_linears_rule_only() -> None:
    with pytest.raises(ValueError, match="MXFP4 has none"):
        FrozenFp4Linear.from_fp4_linear(fp4_layer("mxfp4"), "w4a4", activation_amax="static")
    with pytest.raises(ValueError, match="a calibrated amax is 'static''s"):
        FrozenFp4Linear.from_fp4_linear(fp4_layer()).set_input_amax(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="FrozenFp4Linear's only"):  # what 4-bit experts check
        check_serving("w4a4", "static", "FrozenFp4Experts")


def test_a_static_layer_compiles_whole_and_serves_the_eager_bits() -> None:
    torch._dynamo.reset()
    frozen = static_layer(2.0)
    x = torch.randn(5, 64).to(torch.bfloat16)
    compiled = torch.compile(frozen, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        assert same(compiled(x), frozen(x))
    torch._dynamo.reset()


def test_load_weights_installs_the_amax(tmp_path: pathlib.Path) -> None:
    from computectx.memory import load_weights, save_weights

    layer = static_layer(None)
    path = save_weights(nn.Sequential(static_layer(2.0)), tmp_path / "w.safetensors")
    load_weights(nn.Sequential(layer), path, ComputeCtx.from_flag("nvfp4", "cpu"))
    assert layer.input_calibrated and layer.input_amax.tolist() == [2.0]


def test_an_amax_of_zero_is_refused_naming_the_layer() -> None:
    """Inputs with no finite non-zero element give an amax of 0, with which a layer serves its
    bias alone (alpha = 0): calibration refuses naming it; set and load refuse 0 and -0.0."""
    model = Two()
    freeze_fp4_for_serving(model, "w4a4", activation_amax="static")
    assert isinstance(model.a, FrozenFp4Linear)
    model.a.set_input_amax(torch.tensor([1.0]))
    # Zeros: a serves its bias, b's input is not 0. NaN, inf: never in an amax; NaN on to b.
    for fill, named in [(0.0, "'a'\\]"), (float("nan"), "'a', 'b'"), (float("inf"), "'a', 'b'")]:
        with pytest.raises(ValueError, match=f"inputs of 'a' held no finite non-zero .*\\[{named}"):
            calibrate_fp4_activations(model, [torch.full((2, 64), fill)])
        assert model.a.input_amax.tolist() == [1.0] and model.a.input_calibrated
    for zero in (0.0, -0.0):
        with pytest.raises(ValueError, match=r"> 0 .* serve the bias alone"):
            model.a.set_input_amax(torch.tensor([zero]))
        with pytest.raises(ValueError, match="serve the bias alone"):
            model.load_state_dict({**model.state_dict(), "a.input_amax": torch.tensor([zero])})
    assert model.a.input_amax.tolist() == [1.0]


def test_an_uncalibrated_state_loads_back_uncalibrated(tmp_path: pathlib.Path) -> None:
    """A static layer saved before calibration (input_amax NaN) loads back, by load_state_dict
    and memory.load_weights, as not calibrated, whatever the layer held."""
    from computectx.memory import load_weights, save_weights

    state = static_layer(None).state_dict()
    layer = static_layer(2.0)
    layer.load_state_dict(state)
    assert not layer.input_calibrated and bool(layer.input_amax.isnan().all())
    path = save_weights(nn.Sequential(static_layer(None)), tmp_path / "w.safetensors")
    layer = static_layer(2.0)
    load_weights(nn.Sequential(layer), path, ComputeCtx.from_flag("nvfp4", "cpu"))
    assert not layer.input_calibrated and bool(layer.input_amax.isnan().all())
    with pytest.raises(RuntimeError, match="not calibrated"):
        layer(torch.randn(2, 64))
    with pytest.raises(ValueError, match=r"finite and > 0 \(a calibrated max \|x\|\), got NaN$"):
        layer.set_input_amax(torch.tensor([float("nan")]))  # NaN is a load's marker only
    with pytest.raises(ValueError, match=r"finite and > 0 .*or NaN: not calibrated\), got -inf$"):
        layer.load_state_dict({**state, "input_amax": torch.tensor([-float("inf")])})


def test_new_weights_without_an_amax_leave_the_layer_uncalibrated(tmp_path: pathlib.Path) -> None:
    """A calibrated amax belongs to the weights it was calibrated with: new weights loaded
    without one (strict=False, memory.load_weights) clear it, as import_pretrained does."""
    from computectx.memory import load_weights, save_weights

    other = FrozenFp4Linear.from_fp4_linear(fp4_layer(seed=5), "w4a4")  # per_row: no amax
    layer = static_layer(2.0)
    layer.load_state_dict(other.state_dict(), strict=False)
    assert not layer.input_calibrated and bool(layer.input_amax.isnan().all())
    assert same(layer.weight_fp4, other.weight_fp4)
    layer = static_layer(2.0)
    layer.load_state_dict({"bias": torch.zeros(32)}, strict=False)  # no weight: kept
    assert layer.input_calibrated and layer.input_amax.tolist() == [2.0]
    path = save_weights(nn.Sequential(other), tmp_path / "w.safetensors")
    load_weights(nn.Sequential(layer), path, ComputeCtx.from_flag("nvfp4", "cpu"))
    assert not layer.input_calibrated and bool(layer.input_amax.isnan().all())


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.drop = nn.BatchNorm1d(64), nn.Dropout(0.5)
        self.a = fp4_layer(seed=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand_like(x) * 0  # draws in eval mode too
        y: torch.Tensor = self.a(self.drop(self.norm(x + noise)))
        return y


def test_calibration_runs_in_eval_mode_and_changes_no_other_state() -> None:
    """Dropout off and batch norm on its running statistics, as served; each module's
    training flag and torch's RNG state as they were."""
    model = Noisy()
    freeze_fp4_for_serving(model, "w4a4", activation_amax="static")
    model.train()
    model.a.eval()  # a module's own flag, kept
    torch.manual_seed(7)
    batches = [torch.randn(8, 64) * 3 + 1 for _ in range(2)]
    stats = {k: v.clone() for k, v in model.norm.state_dict().items()}
    rng = torch.get_rng_state()
    calibrate_fp4_activations(model, batches)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, stats[k]) for k, v in model.norm.state_dict().items())
    assert [m.training for m in model.modules()] == [True, True, True, False]
    assert isinstance(model.a, FrozenFp4Linear)
    with torch.no_grad():
        want = max(float(tensor_amax(model.norm.eval()(b))) for b in batches)
    assert model.a.input_amax.tolist() == [want]


def test_calibration_names_drop_torch_compiles_wrapper_part() -> None:
    torch._dynamo.reset()
    model = Two()
    freeze_fp4_for_serving(model, "w4a4", activation_amax="static")
    compiled = torch.compile(model, backend="eager")
    assert isinstance(compiled, nn.Module)
    assert calibrate_fp4_activations(compiled, [torch.randn(2, 64)]) == ("a", "b")
    torch._dynamo.reset()
