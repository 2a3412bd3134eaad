"""``serving_weights``: the codes and steps a converted model serves with, taken from the very
GEMM call its forward makes (a probe on the GEMM entry), and a frozen layer's own buffers."""

from __future__ import annotations

import copy
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
    serving_recipes,
    serving_weights,
)

RECIPES = {
    "tensor": "e4m3/dynamic/0",
    "row": "e4m3/row/dynamic/0",
    "block": "e4m3/block/dynamic/0",
}
LAYOUTS = {"tensor": "tensor", "row": "row", "block": "128x128"}


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


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
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
        assert torch.equal(w.steps, steps.reshape(w.steps.shape))
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


def test_mx_has_no_serving_layout(base: nn.Module) -> None:
    model = copy.deepcopy(base)
    convert_to_quantized(model, ctx_of("e4m3/mx/dynamic/0"), module_filter=lambda m, fqn: True)
    with pytest.raises(ValueError, match=r"0\.weight: recipe .*mx.* has no serving weight layout"):
        serving_weights(model)
    assert set(serving_recipes(model)) == {"0.weight", "2.weight"}  # naming them is fine
