"""``FrozenFp4Experts``: 4-bit grouped experts frozen for serving, weight-only and W4A4, under
``inference_mode``: the training forward's bits (W4A4, each group's amax), a request's own bits
whatever the batch (W4A4 per row), the high-precision grouped GEMM of the dequantized weights
(weight-only), empty experts, the bytes held, a safetensors round trip with the format checked
before anything loads, and one ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from computectx import ComputeCtx
from computectx.formats import Fp4Experts, Fp4Recipe, FrozenFp4Experts, freeze_fp4_for_serving
from computectx.formats.linear.fp4_frozen_experts import install_frozen_experts
from computectx.formats.ops import fp4 as fp4_ops
from computectx.memory import load_weights, memory_report, save_weights
from computectx.nn import GroupedExperts

RECIPES = ["nvfp4", "nvfp4+w1x16", "mxfp4", "mxfp4+floor"]
E, DIM, HIDDEN = 4, 32, 32
BF16 = ComputeCtx.from_flag("bf16", "cpu")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def experts(recipe: str = "nvfp4", seed: int = 0) -> GroupedExperts:
    """4-bit experts as ``convert_to_quantized`` leaves them (float32 weights, bf16 compute)."""
    torch.manual_seed(seed)
    module = GroupedExperts(BF16, DIM, HIDDEN, E)
    module.fp8 = Fp4Experts(Fp4Recipe.parse(recipe))
    return module


def frozen(module: GroupedExperts, mode: str = "w4a4", rule: str = "per_tensor") -> GroupedExperts:
    return copy.deepcopy(module).freeze_for_serving(mode=mode, activation_amax=rule)  # type: ignore[arg-type]


def held(module: GroupedExperts) -> FrozenFp4Experts:
    assert isinstance(module.fp8, FrozenFp4Experts)
    return module.fp8


# Groups of 5, 0 (an empty expert), 6 and 3 rows, and two rows past offs[-1].
X = torch.linspace(-3.0, 3.0, 16 * DIM).reshape(16, DIM).to(torch.bfloat16)
OFFS = offsets([5, 0, 6, 3])


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_expert_is_held_as_the_forward_quantizes_it(recipe: str) -> None:
    module = experts(recipe)
    served = frozen(module)
    four = held(served)
    assert isinstance(module.fp8, Fp4Experts)
    how = module.fp8.how
    for name in ("gate_up", "down"):
        w = getattr(module, name)
        for e in range(E):
            q, got = fp4_ops.quantize(w[e].detach(), how, weight=True), four.operand(name, e)
            assert same(got.codes, q.codes) and same(got.scale, q.scale)
            assert (getattr(got, "amax", None) is None) == recipe.startswith("mxfp4")
    assert [n for n, _ in served.named_parameters()] == []  # the high-precision weights left
    assert served.frozen and served.expert_weights()["down"].dtype == torch.float4_e2m1fn_x2


@pytest.mark.parametrize("recipe", RECIPES)
def test_w4a4_is_the_training_forward_and_weight_only_the_dequantized_grouped_gemm(
    recipe: str,
) -> None:
    module = experts(recipe)
    module.train()  # stochastic rounding on (of the gradients only)
    with torch.no_grad():
        want = module(X, OFFS)
    assert not want[14:].any()  # rows past offs[-1]
    w4a4, weight_only = frozen(module), frozen(module, "weight_only")
    high = GroupedExperts(BF16, DIM, HIDDEN, E)  # the same module, in high precision
    with torch.no_grad():
        for name in ("gate_up", "down"):
            getattr(high, name).copy_(held(weight_only).dequantized(name))
    with torch.inference_mode():
        assert same(w4a4(X, OFFS), want)
        assert same(weight_only(X, OFFS), high(X, OFFS))
        assert w4a4(X[:0], offsets([0] * E)).shape == (0, DIM)


def test_w4a4_per_row_answers_a_request_alike_in_any_batch() -> None:
    module = experts("nvfp4")
    per_row, per_tensor = frozen(module, rule="per_row"), frozen(module)
    request = X[3:4]
    loud = torch.cat([1000.0 * X[:4], request])  # the request shares expert 2 with loud rows
    with torch.inference_mode():
        alone = per_row(request, offsets([0, 0, 1, 0]))
        with torch.no_grad():
            assert same(alone, module(request, offsets([0, 0, 1, 0])))
        assert same(per_row(loud, offsets([0, 0, 5, 0]))[-1:], alone)
        assert not same(per_tensor(loud, offsets([0, 0, 5, 0]))[-1:], alone)


def test_mxfp4_rows_are_their_own_under_either_rule() -> None:
    module = experts("mxfp4")
    loud = torch.cat([1000.0 * X[:4], X[3:4]])
    with torch.inference_mode():
        for rule in ("per_row", "per_tensor"):
            served = frozen(module, rule=rule)
            got = served(loud, offsets([0, 0, 5, 0]))[-1:]
            assert same(got, served(X[3:4], offsets([0, 0, 1, 0])))


@pytest.mark.parametrize(
    ("recipe", "per_element"),
    [("nvfp4", 0.5 + 1 / 256), ("nvfp4+w1x16", 0.5625), ("mxfp4", 0.53125)],
)
def test_bytes_per_weight_element_by_memory_report(recipe: str, per_element: float) -> None:
    four = held(frozen(experts(recipe)))
    report = memory_report(four.weight_tensors())
    elements = E * (2 * HIDDEN * DIM + DIM * HIDDEN)
    per_expert = 4 * 2 if recipe.startswith("nvfp4") else 0  # a float32 amax per expert, weight
    assert sum(row.bytes for row in report.rows) == per_element * elements + E * per_expert


def _saved(model: nn.Module, path: pathlib.Path) -> dict[str, torch.Tensor]:
    save_file(model.state_dict(), str(path / "experts.safetensors"))
    return load_file(str(path / "experts.safetensors"))


def test_safetensors_round_trip_and_the_loads_it_refuses(tmp_path: pathlib.Path) -> None:
    model = nn.Sequential(frozen(experts("nvfp4")))
    state = _saved(model, tmp_path)
    assert state["0.fp8.gate_up_fp4"].dtype == torch.float4_e2m1fn_x2
    target = nn.Sequential(frozen(experts("nvfp4", seed=5), "weight_only"))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    training = nn.Sequential(experts("nvfp4")).state_dict()
    nan = state["0.fp8.down_scale"].clone()
    nan.view(torch.uint8)[1, 0, 0] = 0x7F
    negative = state["0.fp8.down_amax"].clone()
    negative[1] = -2.5
    refused = [
        ({**state, "0.fp8._extra_state": training["0.fp8._extra_state"]}, "4-bit training state"),
        ({**state, "0.fp8._extra_state": torch.tensor([1, 1])}, "holds mxfp4 weights"),
        ({**state, "0.fp8.down_scale": state["0.fp8.down_scale"].float()}, "down_scale is"),
        ({**state, "0.fp8.down_scale": nan}, "block scales must be finite"),
        ({**state, "0.fp8.down_amax": negative}, r"down_\* expert 1: amax .*got a negative value$"),
        ({k: v for k, v in state.items() if k != "0.fp8.down_amax"}, "load .* whole"),
    ]
    for bad, match in refused:
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(bad)
        assert all(same(v, before[k]) for k, v in target.state_dict().items()), match
    with pytest.raises(ValueError, match=r"training state .* into the unfrozen model"):
        target.load_state_dict(training)  # a training checkpoint, its high-precision weights
    target.load_state_dict(state)  # the mode is the module's: the same codes serve weight-only
    assert all(same(v, state[k]) for k, v in target.state_dict().items())
    # computectx.memory's save and load path carries them too (F4 codes, E4M3 scales).
    other = nn.Sequential(frozen(experts("nvfp4", seed=6)))
    load_weights(other, save_weights(model, tmp_path / "w.safetensors"), BF16)
    assert all(same(v, state[k]) for k, v in other.state_dict().items())


def test_refused_calls_change_nothing() -> None:
    module = experts("nvfp4")
    with pytest.raises(TypeError, match="weights= takes fp8 experts"):
        module.freeze_for_serving({})
    with pytest.raises(ValueError, match="mode must be one of"):
        module.freeze_for_serving(mode="w8a8")  # type: ignore[arg-type]
    assert isinstance(module.fp8, Fp4Experts) and module.gate_up is not None
    served = frozen(module)
    assert served.freeze_for_serving(mode="w4a4", activation_amax="per_tensor") is served
    with pytest.raises(ValueError, match="frozen already"):
        served.freeze_for_serving(mode="weight_only")
    x = X.float().requires_grad_(True)
    with pytest.raises(RuntimeError, match="pass no gradient"):
        served(x, OFFS)
    with pytest.raises(ValueError, match=r"take x \[M, 32\]"):
        held(served).mm(X[:, :16], "gate_up", OFFS)
    with pytest.raises(ValueError, match=r"offs must be int32 \(4,\)"):
        held(served).mm(X, "gate_up", OFFS[:2])
    high = GroupedExperts(BF16, DIM, HIDDEN, E)
    with pytest.raises(ValueError, match="not fp8 or 4-bit"):
        high.freeze_for_serving()


def test_weight_only_passes_the_input_gradient_and_dtypes_never_change() -> None:
    served = frozen(experts("nvfp4"), "weight_only")
    before = {k: v.clone() for k, v in served.named_buffers()}
    served.half()
    served.to(torch.bfloat16)
    assert all(same(v, before[k]) for k, v in served.named_buffers())
    x = X.float().requires_grad_(True)
    served(x, OFFS).float().sum().backward()
    assert x.grad is not None and x.grad[:14].any() and not x.grad[14:].any()


def test_freeze_fp4_for_serving_freezes_the_experts_too() -> None:
    model = nn.Sequential(experts("nvfp4"))
    with torch.no_grad():
        want = model[0](X, OFFS)
    assert freeze_fp4_for_serving(model, "w4a4", activation_amax="per_tensor") == ("0",)
    assert isinstance(model[0].fp8, FrozenFp4Experts)
    with torch.inference_mode():
        assert same(model[0](X, OFFS), want)


def test_a_compiled_frozen_forward_is_one_graph_with_the_eager_bits() -> None:
    # Dynamo's whole-graph trace, at test speed. aot_eager and Inductor (CPU) were checked once,
    # not here: the same bits (Inductor with emulate_precision_casts: its fused SwiGLU skips
    # eager's roundings otherwise, as for the training experts), 15-25 s of compile a mode.
    from torch._dynamo.utils import counters

    module = experts("nvfp4")
    for mode in ("w4a4", "weight_only"):
        served = frozen(module, mode, "per_row")
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(served, fullgraph=True, backend="eager")
        with torch.inference_mode():
            assert same(compiled(X, OFFS), served(X, OFFS)), mode
        assert not counters["graph_break"], mode


def test_weight_only_without_grouped_checks_offs_as_every_other_path() -> None:
    # Its per-group F.linear took decreasing, negative and past-M offs (rows of another expert).
    for mode in ("weight_only", "w4a4"):
        four = held(frozen(experts("nvfp4"), mode))
        for sizes, match in (([3, -2, 3, 1], "below offs"), ([-1, 4, 0, 2], "negative")):
            with torch.inference_mode(), pytest.raises(ValueError, match=match):
                four.mm(X, "gate_up", offsets(sizes))
        with torch.inference_mode(), pytest.raises(ValueError, match="past the 16 rows"):
            four.mm(X, "gate_up", offsets([5, 0, 6, 9]))


def test_weight_only_dequantizes_only_the_experts_with_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from computectx.formats.linear import fp4_frozen_experts as module

    served = frozen(experts("nvfp4"), "weight_only")
    high = GroupedExperts(BF16, DIM, HIDDEN, E)
    with torch.no_grad():
        for name in ("gate_up", "down"):
            getattr(high, name).copy_(held(served).dequantized(name))
    seen: list[int] = []
    real = module.dequantize_experts  # type: ignore[attr-defined]

    def counted(codes: torch.Tensor, *rest: Any, **named: Any) -> torch.Tensor:
        seen.append(codes.shape[0])
        return real(codes, *rest, **named)

    monkeypatch.setattr(module, "dequantize_experts", counted)
    one = offsets([0, 0, 1, 0])  # one row, on expert 2 of 4
    with torch.inference_mode():
        got = served(X[:1], one)
        assert seen == [1, 1]  # one expert of each weight (was [4, 4])
        assert same(got, high(X[:1], one))
        assert same(served(X, OFFS), high(X, OFFS))  # experts 0, 2, 3: the same bits
        w = held(served).dequantized("down", torch.bfloat16)
        bounds = [(0, 5), (5, 5), (5, 11), (11, 14)]
        rows = [torch.nn.functional.linear(X[a:b], w[g]) for g, (a, b) in enumerate(bounds)]
        seen.clear()  # the default per-group GEMM (no grouped=): experts 0, 2 and 3 only
        assert same(held(served).mm(X, "down", OFFS), torch.cat([*rows, X.new_zeros(2, DIM)]))
        assert seen == [3]


def test_install_refuses_frozen_experts_that_do_not_fit_and_changes_nothing() -> None:
    how = Fp4Experts(Fp4Recipe.parse("nvfp4")).how

    def ops(e: int, n: int, k: int) -> list:  # type: ignore[type-arg]
        return [fp4_ops.quantize(torch.randn(n, k), how, weight=True) for _ in range(e)]

    with pytest.raises(ValueError, match=r"one operand an expert, got \{'gate_up': 4, 'down': 3\}"):
        FrozenFp4Experts({"gate_up": ops(4, 64, 32), "down": ops(3, 32, 32)})
    for weights, match in [
        (
            {"gate_up": ops(8, 64, 32), "down": ops(8, 32, 32)},
            r"\(4, 64, 32\), the frozen .* \(8, 64, 32\)",
        ),
        ({"gate_up": ops(4, 64, 32)}, r"the frozen experts \['gate_up'\]"),
        ({"w1": ops(4, 64, 32), "w2": ops(4, 32, 32)}, r"the frozen experts \['w1', 'w2'\]"),
        ({"gate_up": ops(4, 64, 64), "down": ops(4, 64, 32)}, r"the frozen experts' \(4, 64, 64\)"),
    ]:
        module = experts("nvfp4")
        before = dict(module.state_dict())
        with pytest.raises(ValueError, match=match):
            install_frozen_experts(module, FrozenFp4Experts(weights, mode="w4a4"))
        assert isinstance(module.fp8, Fp4Experts) and module.state_dict().keys() == before.keys()


def test_clear_refusals_around_freezing_and_loading(tmp_path: pathlib.Path) -> None:
    from computectx.formats import convert_to_quantized

    model = nn.Sequential(experts("nvfp4"))
    assert freeze_fp4_for_serving(model, "w4a4") == ("0",)
    assert freeze_fp4_for_serving(model, "w4a4") == ()  # again the same way: nothing to do
    with pytest.raises(ValueError, match=r"'0.fp8' is frozen already \(mode='w4a4'"):
        freeze_fp4_for_serving(model, "weight_only")
    beside = nn.Sequential(nn.Linear(32, 32), model[0])
    report = convert_to_quantized(beside, ComputeCtx.from_flag("nvfp4", "cpu"), min_features=16)
    assert "frozen for serving (FrozenFp4Experts)" in str(report)
    wide = experts("mxfp4")
    wide.gate_up = nn.Parameter(torch.randn(E, 2 * HIDDEN, 48))
    with pytest.raises(
        ValueError, match=r"'gate_up' \[E, N, K\] = \(4, 64, 48\): expert 0 .*mxfp4 1x32"
    ):
        wide.freeze_for_serving(mode="w4a4")
    high = nn.Sequential(GroupedExperts(BF16, DIM, HIDDEN, E)).state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"high-precision 0.gate_up"):
            model.load_state_dict(high, strict=strict)
        assert all(same(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_freezing_reads_the_operands_values_once_a_weight_and_names_a_nan_expert(
    recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # from_fp4_experts checks what it quantized as the constructor checks given operands: every
    # expert's values of a weight in one host read (was one an expert: 2E for two weights),
    # and a NaN still named by weight and expert.
    reads = [0]
    for method in ("tolist", "item", "__bool__"):
        real = getattr(torch.Tensor, method)

        def counted(t: torch.Tensor, *a: Any, real: Any = real) -> Any:
            reads[0] += 1
            return real(t, *a)

        monkeypatch.setattr(torch.Tensor, method, counted)
    trained = Fp4Experts(Fp4Recipe.parse(recipe))
    for e in (2, 6):
        w = {"gate_up": torch.randn(e, 64, 32), "down": torch.randn(e, 32, 32)}
        reads[0] = 0
        FrozenFp4Experts.from_fp4_experts(trained, w, "w4a4", activation_amax="per_tensor")
        assert reads[0] == 2, (e, reads[0])
    w["down"][3, 5, 7] = float("nan")
    with pytest.raises(ValueError, match=r"'down' expert 3: block scales must be finite"):
        FrozenFp4Experts.from_fp4_experts(trained, w)
