"""``serving_weights``: the codes and steps a converted model serves with, taken from the very
GEMM call its forward makes (a probe on the GEMM entry), and a frozen layer's own buffers."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import computectx.formats.linear.blockwise as linear_blockwise
import computectx.formats.ops.tensorwise as tensor_ops
from computectx import ComputeCtx
from computectx.formats import (
    QuantizedLinear,
    Recipe,
    ServingWeight,
    convert_to_quantized,
    load_serving_weights,
    serving,
    serving_recipes,
    serving_weights,
)
from computectx.nn import GroupedExperts

RECIPES = {
    "tensor": "e4m3/dynamic/0",
    "row": "e4m3/row/dynamic/0",
    "block": "e4m3/block/dynamic/0",
    "mx": "e4m3/mx/dynamic/0",
}
LAYOUTS = {"tensor": "tensor", "row": "row", "block": "128x128", "mx": "mx"}


def ctx_of(recipe: str) -> ComputeCtx:
    return ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse(recipe))


@pytest.fixture(scope="module")
def base() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 256)).bfloat16()


def converted(base: nn.Module, granularity: str) -> Any:
    model: Any = copy.deepcopy(base)
    convert_to_quantized(model, ctx_of(RECIPES[granularity]), module_filter=lambda m, fqn: True)
    assert all(isinstance(model[i], QuantizedLinear) for i in (0, 2))
    return model


def forward_weight_operands(
    model: nn.Module, granularity: str, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(codes, steps)`` of the weight each GEMM of an eval forward multiplies by."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    if granularity == "tensor":
        real = tensor_ops.scaled_mm

        def probe(xq: Any, wq: Any, sx: Any, sw: Any, *rest: Any, **kw: Any) -> Any:
            seen.append((wq, sw))
            return real(xq, wq, sx, sw, *rest, **kw)

        monkeypatch.setattr(tensor_ops, "scaled_mm", probe)
    else:
        real_mm = linear_blockwise.block_scaled_mm  # type: ignore[attr-defined]

        def probe_mm(xq: Any, wq: Any, sx: Any, ga: Any, sw: Any, *rest: Any, **kw: Any) -> Any:
            seen.append((wq, sw))
            return real_mm(xq, wq, sx, ga, sw, *rest, **kw)

        monkeypatch.setattr(linear_blockwise, "block_scaled_mm", probe_mm)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        model.eval()(x)
    return seen


@pytest.mark.parametrize("granularity", list(RECIPES))
def test_codes_are_what_the_forward_multiplies(
    base: nn.Module, granularity: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model: Any = converted(base, granularity)
    weights = serving_weights(model)
    assert list(weights) == ["0.weight", "2.weight"]
    assert {name: str(r) for name, r in serving_recipes(model).items()} == dict.fromkeys(
        weights, str(Recipe.parse(RECIPES[granularity]))
    )
    seen = forward_weight_operands(model, granularity, monkeypatch)
    assert len(seen) == 2
    for w, (codes, steps) in zip(weights.values(), seen, strict=True):
        assert isinstance(w, ServingWeight) and w.layout == LAYOUTS[granularity]
        assert w.codes.dtype == torch.float8_e4m3fn
        assert torch.equal(w.codes.view(torch.uint8), codes.view(torch.uint8))
        # mx: the GEMM's E8M0 scale bytes are the float32 steps' exactly.
        assert torch.equal(w.steps, steps.float().reshape(w.steps.shape))
        if granularity == "mx":
            assert torch.equal(w.steps.to(steps.dtype).view(torch.uint8), steps.view(torch.uint8))
    # Nothing in the model changed: still trainable, no frozen buffers.
    assert not model[0].frozen and model[0].weight is not None


def test_a_frozen_layer_gives_its_own_buffers(base: nn.Module) -> None:
    model: Any = converted(base, "tensor")
    trainable = serving_weights(model)
    for i in (0, 2):
        model[i].freeze_for_serving()
    frozen = serving_weights(model)
    for name, w in frozen.items():
        layer = model[int(name.split(".")[0])]
        assert w.codes is layer.weight_fp8
        assert w.steps.data_ptr() == layer.weight_step.data_ptr()
        # The trainable layer's codes are those freezing keeps (same op, same rule).
        assert torch.equal(w.codes.view(torch.uint8), trainable[name].codes.view(torch.uint8))
        assert torch.equal(w.steps, trainable[name].steps)


def test_a_granularity_without_a_layout_is_refused_naming_the_weight(
    base: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every granularity has a layout today; one without (the 4-bit recipes until a format
    # holds them) is refused before anything is quantized, naming the weight.
    model = converted(base, "mx")
    monkeypatch.delitem(serving.LAYOUT_OF_GRANULARITY, "mx")
    with pytest.raises(ValueError, match=r"0\.weight: recipe .*mx.* has no serving weight layout"):
        serving_weights(model)
    assert set(serving_recipes(model)) == {"0.weight", "2.weight"}  # naming them is fine


@pytest.mark.parametrize("granularity", list(RECIPES))
def test_load_serving_weights_serves_and_trains_with_the_given_codes(
    base: nn.Module, granularity: str
) -> None:
    source = converted(base, granularity)
    given = serving_weights(source)
    served = converted(base, granularity)
    with torch.no_grad():
        for i in (0, 2):
            served[i].weight.mul_(3)  # other weights: the codes must come from `given`
    trained = copy.deepcopy(served)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        want = source.eval()(x)
    load_serving_weights(served, given, mode="serve")
    assert served[0].frozen and served[2].frozen
    with torch.no_grad():
        assert torch.equal(served.eval()(x), want)  # the source's own eval output
    for name, w in serving_weights(served).items():
        assert torch.equal(w.codes.view(torch.uint8), given[name].codes.view(torch.uint8))
        assert torch.equal(w.steps, given[name].steps)
    params = [trained[0].weight, trained[2].weight]
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    load_serving_weights(trained, given, mode="train")
    assert [trained[0].weight, trained[2].weight] == params  # in place, same Parameters
    for name, w in given.items():
        assert torch.equal(trained.get_parameter(name), w.dequantize(torch.bfloat16))
    trained(torch.randn(4, 256).bfloat16()).float().pow(2).mean().backward()
    opt.step()


def test_load_serving_weights_refusals_change_nothing(base: nn.Module) -> None:
    model = converted(base, "block")
    given = serving_weights(converted(base, "block"))
    row = serving_weights(converted(base, "row"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    w = given["0.weight"]
    e5m2 = ServingWeight(w.codes.float().to(torch.float8_e5m2), w.steps, w.layout)
    short = ServingWeight(w.codes[:256], w.steps[:2], w.layout)
    nan = ServingWeight(w.codes, w.steps.clone().fill_(float("nan")), w.layout)
    mx = serving_weights(converted(base, "mx"))["0.weight"]
    cases = [
        ({"0.weight": w}, r"not given: \['2\.weight'\]"),
        ({**given, "1.weight": w}, r"unknown to the model: \['1\.weight'\]"),
        ({**given, "0.weight": row["0.weight"]}, r"0\.weight.*takes .*'128x128'; given .*'row'"),
        ({**given, "0.weight": e5m2}, r"takes float8_e4m3fn codes.*given float8_e5m2"),
        ({**given, "0.weight": short}, r"shape \(384, 256\).*given .*shape \(256, 256\)"),
        ({**given, "0.weight": nan}, r"not finite and positive"),
        ({**given, "0.weight": mx}, r"0\.weight.*takes .*'128x128'; given .*'mx'"),
    ]
    for weights, match in cases:
        with pytest.raises(ValueError, match=match):
            load_serving_weights(model, weights, mode="serve")
    with pytest.raises(ValueError, match="unknown mode 'eval'"):
        load_serving_weights(model, given, mode="eval")  # type: ignore[arg-type]
    assert not model[0].frozen and list(model.state_dict()) == list(before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    frozen = converted(base, "block")
    frozen[0].freeze_for_serving()
    with pytest.raises(ValueError, match=r"0\.weight is frozen for serving.*mode='train'"):
        load_serving_weights(frozen, given, mode="train")
    assert frozen[2].weight is not None and not frozen[2].frozen


def test_a_serve_load_does_not_keep_the_targets_own_scaling_state(base: nn.Module) -> None:
    # Under delayed scaling a model that ran training forwards holds input ledgers measured
    # for its own weights; a serve load kept them, so the same checkpoint served other numbers
    # in a used model than in a fresh one (the adversarial pass saw 0.086 apart).
    recipe = "e4m3/delayed/16/0/max"
    given = serving_weights(converted(base, "tensor"))
    fresh: Any = copy.deepcopy(base)
    used: Any = copy.deepcopy(base)
    for model in (fresh, used):
        convert_to_quantized(model, ctx_of(recipe), module_filter=lambda m, fqn: True)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # training forwards seed the input ledgers with other amaxes
        used(torch.randn(8, 256, generator=gen).bfloat16() * 40).float().sum().backward()
    for model in (fresh, used):
        load_serving_weights(model, given, mode="serve")
    x = torch.randn(4, 256, generator=gen).bfloat16()
    with torch.no_grad():
        assert torch.equal(fresh(x), used(x))


def test_mx_refuses_steps_no_e8m0_byte_holds(base: nn.Module) -> None:
    model = converted(base, "mx")
    given = serving_weights(converted(base, "mx"))
    w = given["0.weight"]
    odd = ServingWeight(w.codes, w.steps * 3, "mx")
    for mode in ("serve", "train"):
        with pytest.raises(ValueError, match=r"0\.weight .*'mx' step\(s\) that are not powers"):
            load_serving_weights(model, {**given, "0.weight": odd}, mode=mode)
    assert not model[0].frozen


@pytest.mark.parametrize("granularity", list(RECIPES))
def test_experts_codes_are_what_the_grouped_forward_multiplies(
    granularity: str, grouped_operands: Callable[[], list[tuple[Any, Any, Any]]]
) -> None:
    model = experts_model(ctx_of(RECIPES[granularity]), 0)
    weights = serving_weights(model)
    assert list(weights) == ["experts.gate_up", "experts.down"]
    seen = grouped_operands()
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    offs = torch.tensor([3, 6, 9], dtype=torch.int32)
    with torch.no_grad():
        model["experts"](x, offs)
    matched = 0
    for name, w in weights.items():
        assert w.layout == LAYOUTS[granularity] and w.experts == 3
        held = model.get_parameter(name)
        for e in range(3):
            for operand, q, s in seen:
                if operand.shape == held[e].shape and torch.equal(operand, held[e]):
                    assert torch.equal(q.view(torch.uint8), w.codes[e].view(torch.uint8))
                    assert torch.equal(s.float().reshape(w.steps[e].shape), w.steps[e])
                    matched += 1
                    break
    assert matched == 6  # every expert's two weights


def experts_model(ctx: ComputeCtx, seed: int) -> nn.ModuleDict:
    torch.manual_seed(seed)
    model = nn.ModuleDict({"experts": GroupedExperts(ctx.replace(recipe=None), 64, 96, 3)})
    convert_to_quantized(model, ctx, module_filter=lambda m, fqn: True)
    return model


@pytest.mark.parametrize("granularity", list(RECIPES))
def test_a_serve_load_freezes_experts_with_the_given_codes(granularity: str) -> None:
    ctx = ctx_of(RECIPES[granularity])
    source, served = experts_model(ctx, 0), experts_model(ctx, 1)
    given = serving_weights(source)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    with torch.no_grad():
        want = source["experts"](x, offs)
    load_serving_weights(served, given, mode="serve")
    experts = served["experts"]
    assert isinstance(experts, GroupedExperts) and experts.frozen and experts.gate_up is None
    with torch.no_grad():
        assert torch.equal(experts(x, offs), want)  # the source's own output
    again = serving_weights(served)  # frozen experts give their held codes as they are
    for name, w in given.items():
        assert torch.equal(again[name].codes.view(torch.uint8), w.codes.view(torch.uint8))
        assert torch.equal(again[name].steps, w.steps) and again[name].layout == w.layout
    with pytest.raises(ValueError, match=r"experts\.gate_up is frozen for serving"):
        load_serving_weights(served, given, mode="train")
    load_serving_weights(served, serving_weights(experts_model(ctx, 2)), mode="serve")
    assert not torch.equal(experts(x, offs), want)  # into frozen experts: the new codes
    # Frozen by the load, the experts refuse a state dict of bad steps before any load, as
    # when frozen by their own freeze_for_serving (they were left unguarded).
    bad = {k: v.clone() for k, v in experts.state_dict().items()}
    bad["down_step"].view(-1)[0] = -1.0
    before = {k: v.clone() for k, v in experts.state_dict().items()}
    with pytest.raises(ValueError, match="not finite and positive"):
        experts.load_state_dict(bad)
    for k, v in experts.state_dict().items():
        assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)), k
