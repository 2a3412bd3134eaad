"""A layer frozen for serving (``freeze_for_serving``, ``linear.frozen``) under each weight
layout: per tensor, per row, per 128x128 block, per 1x32 MX group. The codes are the ones
the layer's own forward makes (or the ones given, bit for bit), later calls multiply with
them as they are, and the frozen weight survives state dicts, casts, moves and
``torch.compile``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, Recipe, autocast, quantize_tensor
from computectx.formats.ops import blockwise as block_ops
from computectx.formats.serving import ServingWeight

# granularity -> (recipe, the ServingWeight layout it freezes to, the steps of a 224x160 weight)
LAYOUTS: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "tensor": ("e4m3/dynamic/0", "tensor", (1,)),
    "row": ("e4m3/row/dynamic/0", "row", (224, 1)),
    "row+no_pow2": ("hybrid/row+no_pow2/dynamic/0", "row", (224, 1)),
    "block": ("e4m3/block/dynamic/0", "128x128", (2, 2)),
    "block+pow2": ("hybrid/block+pow2/dynamic/0", "128x128", (2, 2)),
    "mx": ("e4m3/mx/dynamic/0", "mx", (224, 5)),
    "mx+floor": ("hybrid/mx+floor/dynamic/0", "mx", (224, 5)),
}
K, N = 160, 224  # ragged for 128x128 blocks (a 2x2 grid of partial ones), whole 1x32 groups
EVERY = ["tensor", "row", "block", "mx"]
FINE = ["row", "block", "mx"]


def layer_of(name: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> QuantizedLinear:
    ctx = ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse(LAYOUTS[name][0]))
    torch.manual_seed(seed)
    return QuantizedLinear(K, N, ctx=ctx, dtype=dtype)


def request(rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(3), dtype=torch.bfloat16)


def codes_of(layer: QuantizedLinear) -> ServingWeight:
    layout: Any = LAYOUTS_OF[layer.policy.granularity]
    return ServingWeight(layer.weight_fp8, layer.weight_step, layout)


LAYOUTS_OF = {"tensor": "tensor", "row": "row", "block": "128x128", "mx": "mx"}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def snapshot(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in layer.state_dict().items()}


def unchanged(layer: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = layer.state_dict()
    return after.keys() == before.keys() and all(
        a.dtype == b.dtype and torch.equal(bits(a), bits(b))
        for a, b in zip(after.values(), before.values(), strict=True)
    )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_frozen_layer_answers_as_its_own_forward(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = layer_of(name).eval()
    x = request()
    want = live(x)
    served = copy.deepcopy(live).freeze_for_serving()
    _, layout, steps = LAYOUTS[name]
    assert served.frozen and served.weight is None
    assert served.weight_fp8.shape == (N, K) and served.weight_fp8.dtype == torch.float8_e4m3fn
    assert served.weight_step.shape == steps and served.weight_step.dtype == torch.float32
    # The codes are the public quantize's of the weight, under the recipe's rule (mx: its
    # E8M0 scales widened to float32 steps, exactly).
    rule: dict[str, Any] = (
        {"mx_rounding": live.policy.mx_rounding}
        if layout == "mx"
        else {"power_of_two": live.policy.power_of_two if layout != "tensor" else None}
    )
    codes, scale = quantize_tensor(live.weight.detach(), "e4m3", granularity=layout, **rule)
    assert torch.equal(bits(served.weight_fp8), bits(codes))
    assert torch.equal(served.weight_step, scale.float().reshape(steps))
    blocks: list[int] = []
    real = block_ops.fp8_quantize_blocks

    def counted(x: torch.Tensor, *args: Any) -> Any:
        blocks.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(block_ops, "fp8_quantize_blocks", counted)
    assert torch.equal(served(x), want)  # bit for bit
    # Only the input is quantized: the weight's codes are multiplied as they are.
    assert blocks == ([] if name == "tensor" else [x.shape[0]])


@pytest.mark.parametrize("name", EVERY)
def test_given_codes_are_held_bit_for_bit_and_multiplied_as_they_are(name: str) -> None:
    own, layer = layer_of(name, seed=1).eval(), layer_of(name, seed=2).eval()
    for m in (own, layer):
        nn.init.zeros_(m.bias)
    mine = codes_of(own.freeze_for_serving())
    codes = mine.codes.clone()
    codes[7] = 0  # an output row of zero codes: a zero column
    steps = mine.steps * 2.0**-3  # steps that quantizing would not give these codes
    given = ServingWeight(codes, steps, mine.layout)
    layer.freeze_for_serving(weight=given)
    assert torch.equal(bits(layer.weight_fp8), bits(codes))
    assert torch.equal(layer.weight_step, steps)
    assert layer.weight_fp8.data_ptr() != codes.data_ptr()  # a copy, not the tensor given
    x = request()
    y, want = layer(x), own(x)
    assert torch.equal(y[:, 7], torch.zeros_like(y[:, 7]))
    keep = torch.arange(N) != 7
    # Steps an exact power of two smaller: every other output exactly that much smaller.
    assert torch.equal(y[:, keep] * 8, want[:, keep])
    # A frozen layer takes new codes too: its own codes give its own answers.
    layer.freeze_for_serving(weight=mine)
    assert torch.equal(layer(x), want)


@pytest.mark.parametrize("name", EVERY)
def test_given_codes_that_do_not_fit_the_layer_are_refused_naming_both(name: str) -> None:
    layer = layer_of(name)
    before = snapshot(layer)
    mine = codes_of(copy.deepcopy(layer).freeze_for_serving())
    other = "128x128" if name != "block" else "row"
    other_steps = quantize_tensor(mine.dequantize(), "e4m3", granularity=other)[1]  # type: ignore[arg-type]
    refused: list[tuple[Any, str]] = [
        (ServingWeight(mine.codes.t(), _steps_for(mine, (K, N)), mine.layout), rf"\({K}, {N}\)"),
        (ServingWeight(mine.codes, other_steps, other), f"laid out '{other}'"),  # type: ignore[arg-type]
        (ServingWeight(mine.codes.float().to(torch.float8_e5m2), mine.steps, mine.layout), "e5m2"),
        (ServingWeight(mine.codes.to("meta"), mine.steps.to("meta"), mine.layout), "on meta"),
    ]
    takes = rf"float8_e4m3fn codes of shape \({N}, {K}\) laid out '{mine.layout}' on cpu"
    for given, got in refused:
        with pytest.raises(ValueError, match=rf"serves with {takes}; .* given .*{got}"):
            layer.freeze_for_serving(weight=given)
    nan = mine.steps.clone()
    nan.view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=r"1 step\(s\) that are not finite and positive"):
        layer.freeze_for_serving(weight=ServingWeight(mine.codes, nan, mine.layout))
    if mine.layout == "mx":  # an MX step is an E8M0 exponent: a power of two
        odd = ServingWeight(mine.codes, mine.steps * 1.5, "mx")
        with pytest.raises(ValueError, match=r"1120 'mx' step\(s\) that are not powers of two"):
            layer.freeze_for_serving(weight=odd)
    with pytest.raises(TypeError, match="takes a ServingWeight, got tuple"):
        layer.freeze_for_serving(weight=(mine.codes, mine.steps))  # type: ignore[arg-type]
    assert not layer.frozen and isinstance(layer.weight, nn.Parameter)
    assert unchanged(layer, before)
    # A frozen layer refuses as well, and keeps its codes.
    layer.freeze_for_serving()
    before = snapshot(layer)
    with pytest.raises(ValueError, match=takes):
        layer.freeze_for_serving(weight=refused[1][0])
    assert unchanged(layer, before)


def _steps_for(sw: ServingWeight, shape: tuple[int, int]) -> torch.Tensor:
    # Steps of sw's layout for codes of another shape (transposed codes).
    if sw.layout == "tensor":
        return sw.steps
    return quantize_tensor(torch.ones(shape), "e4m3", granularity=sw.layout)[1].float()


@pytest.mark.parametrize("name", FINE)
def test_a_frozen_state_dict_loads_into_a_frozen_layer_of_its_layout_only(name: str) -> None:
    served = layer_of(name).freeze_for_serving()
    state = served.state_dict()
    assert {"weight_fp8", "weight_step"} <= state.keys() and "weight" not in state
    assert state["weight_step"].shape == LAYOUTS[name][2]
    other = layer_of(name, seed=5).freeze_for_serving()
    other.load_state_dict(state)
    assert torch.equal(bits(other.weight_fp8), bits(served.weight_fp8))
    assert torch.equal(other(request()), served(request()))
    # Per-tensor codes of the same shape: the steps do not fit, and nothing loads (no
    # weight_fp8 without its steps).
    per_tensor = layer_of("tensor", seed=6).freeze_for_serving().state_dict()
    before = snapshot(other)
    with pytest.raises(ValueError, match="recorded under the fp8 policy e4m3/dynamic/0"):
        other.load_state_dict(per_tensor)  # its scaling state names its recipe
    weights = {k: v for k, v in per_tensor.items() if not k.startswith("fp8_")}
    with pytest.raises(RuntimeError, match="size mismatch for weight_step"):
        other.load_state_dict(weights)
    assert unchanged(other, before)


@pytest.mark.parametrize("name", FINE)
def test_a_frozen_weight_keeps_its_bytes_through_casts_and_moves(name: str) -> None:
    served = layer_of(name).freeze_for_serving()
    x = request()
    want = served(x)
    data, steps = served.weight_fp8.clone(), served.weight_step.clone()
    bias = served.bias.detach().clone()
    nn.Sequential(served).half()
    assert torch.equal(bits(served.weight_fp8), bits(data))
    assert served.weight_step.dtype == torch.float32 and torch.equal(served.weight_step, steps)
    served.to(torch.bfloat16)
    with torch.no_grad():
        served.bias.copy_(bias)
    assert torch.equal(served(x), want)
    moved = copy.deepcopy(served).to("meta")
    assert moved.weight_fp8.device.type == "meta" and moved.weight_step.shape == steps.shape
    assert moved.weight_fp8.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("name", FINE)
def test_a_frozen_layer_passes_input_gradients_and_records_nothing(name: str) -> None:
    live = layer_of(name, dtype=torch.float32)
    served = copy.deepcopy(live).freeze_for_serving()
    # The unfrozen twin of the frozen weight: its high-precision weight is the codes times
    # their steps, from which the row dgrad quantizes Wᵀ (block: the same codes transposed).
    twin = copy.deepcopy(live)
    with torch.no_grad():
        twin.weight.copy_(codes_of(served).dequantize())
    if name == "block":
        twin = live
    x = request().float().requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    before = [t.clone() for t in served.buffers()]
    served(x).sum().backward()
    twin(x2).sum().backward()
    assert x.grad is not None and x2.grad is not None and torch.equal(x.grad, x2.grad)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(served.buffers(), before, strict=True))
    # Without fp8 (a disabled region) and with no rows, the dequantized weight.
    with autocast(enabled=False):
        plain = served(x.detach())
    w = codes_of(served).dequantize()
    assert torch.equal(plain, functional.linear(x.detach(), w, served.bias))
    assert served(x[:0]).shape == (0, N)


def test_a_frozen_layers_ctx_keeps_its_layout_and_format() -> None:
    served = layer_of("row").freeze_for_serving()
    served.ctx = served.ctx.replace(recipe=Recipe.parse("e4m3/row+no_pow2/dynamic/0"))
    assert not served.policy.power_of_two  # the codes stay; inputs take the new rule
    for refused in ("e4m3/block/dynamic/0", "e4m3/dynamic/0", "e5m2/row/dynamic/0"):
        with pytest.raises(ValueError, match=r"held as per-row torch\.float8_e4m3fn codes"):
            served.ctx = served.ctx.replace(recipe=Recipe.parse(refused))
    assert served.policy.granularity == "row"
    mx = layer_of("mx").freeze_for_serving()
    mx.ctx = mx.ctx.replace(recipe=Recipe.parse("e4m3/mx+floor/dynamic/0"))
    with pytest.raises(ValueError, match=r"held as 1x32 MX-block torch\.float8_e4m3fn codes"):
        mx.ctx = mx.ctx.replace(recipe=Recipe.parse("e4m3/row/dynamic/0"))


@pytest.mark.parametrize("name", FINE)
def test_a_frozen_layer_compiles_whole(name: str) -> None:
    served = layer_of(name).eval().freeze_for_serving()
    x = request()
    want = served(x)
    compiled = torch.compile(served, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), want)


@pytest.mark.parametrize("name", EVERY)
def test_serving_weight_is_what_the_layer_serves_with(name: str) -> None:
    layer = layer_of(name)
    before = snapshot(layer)
    live = layer.serving_weight()
    assert unchanged(layer, before)  # a trainable layer's codes, nothing recorded
    assert live.layout == LAYOUTS[name][1] and not layer.frozen
    layer.freeze_for_serving()
    assert torch.equal(bits(live.codes), bits(layer.weight_fp8))
    assert torch.equal(live.steps, layer.weight_step)
    held = layer.serving_weight()
    assert held.codes is layer.weight_fp8 and held.steps is layer.weight_step


@pytest.mark.parametrize("name", EVERY)
def test_a_frozen_state_dict_with_bad_steps_is_refused_and_nothing_loads(name: str) -> None:
    state = layer_of(name, seed=1).freeze_for_serving().state_dict()
    other = layer_of(name).freeze_for_serving()
    before = snapshot(other)
    bad = [float("nan"), float("inf"), 0.0, -1.0] + ([3.0] if name == "mx" else [])
    for value in bad:
        steps = state["weight_step"].clone()
        steps.view(-1)[0] = value
        with pytest.raises(ValueError, match=r"step\(s\) that are not .*Nothing was changed"):
            other.load_state_dict({**state, "weight_step": steps})
        assert unchanged(other, before)
