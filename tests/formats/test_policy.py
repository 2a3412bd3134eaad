"""Inputs an fp8 layer once accepted silently (issue 21, item 3): a margin on row, block or mx,
and a ``layer.ctx`` swapped to a policy its construction would refuse."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, Recipe, convert_to_quantized
from computectx.formats.scaling.saved import META_MARGIN

FINE = ["e4m3/row/dynamic", "e4m3/row+gw_hp/dynamic", "e4m3/block/dynamic", "hybrid/mx/dynamic"]


def ctx_of(text: str) -> ComputeCtx:
    return ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse(text))


def state_of(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in layer.state_dict().items()}


@pytest.mark.parametrize("text", FINE)
def test_a_margin_on_a_fine_granularity_is_refused_where_a_layer_is_made(text: str) -> None:
    # It was accepted and ignored (bit-identical to margin 0); now no such policy exists, so
    # neither QuantizedLinear, convert_to_quantized nor a ctx string can carry one.
    rule = "margin=3 applies to per-tensor scaling only"
    with pytest.raises(ValueError, match=re.escape(rule)):
        ctx_of(f"{text}/3")
    with pytest.raises(ValueError, match=re.escape(rule)):
        ComputeCtx.parse(f"compute=bf16,device=cpu,fp8={text}/3")
    # Per tensor the margin is applied: the step leaves 2**margin of headroom.
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    steps = []
    for margin in (0, 3):
        layer = QuantizedLinear(64, 32, ctx=ctx_of(f"e4m3/dynamic/{margin}")).train()
        layer(x)
        steps.append(float(layer.scaling.input.ledger[-3]))
    assert steps[1] == steps[0] * 8


@pytest.mark.parametrize("text", FINE)
def test_an_old_fine_checkpoint_saved_with_a_margin_loads_as_margin_0(text: str) -> None:
    # Before the rule a row/block/mx layer could be built with a margin and saved with it in
    # fp8_meta; its state is exactly a margin-0 state (the margin was never applied), so it
    # loads into the margin-0 layer, bit for bit, instead of being refused.
    torch.manual_seed(0)
    saved = QuantizedLinear(64, 32, ctx=ctx_of(f"{text}/0")).train()
    saved(torch.randn(8, 64)).sum().backward()
    old = state_of(saved)
    old["fp8_meta"][META_MARGIN] = 3  # what the layer under `{text}/3` wrote
    fresh = QuantizedLinear(64, 32, ctx=ctx_of(f"{text}/0"))
    fresh.load_state_dict(old)
    assert all(torch.equal(fresh.state_dict()[k], saved.state_dict()[k]) for k in old)
    # A per-tensor margin is still part of the recipe: another one is refused, naming both.
    tensor = QuantizedLinear(64, 32, ctx=ctx_of("e4m3/dynamic/0"))
    other = state_of(tensor)
    other["fp8_meta"][META_MARGIN] = 3
    before = state_of(tensor)
    with pytest.raises(ValueError, match=r"e4m3/dynamic/3, but this layer runs e4m3/dynamic/0"):
        tensor.load_state_dict(other)
    assert all(torch.equal(tensor.state_dict()[k], v) for k, v in before.items())


def test_swapping_a_layers_ctx_is_checked_as_construction_is() -> None:
    # mx needs both widths to be multiples of 32: construction refuses a 48-wide layer, and
    # so does assigning the ctx afterwards, naming the layer's shape and the rule.
    mx = ctx_of("e4m3/mx/dynamic/0")
    with pytest.raises(ValueError, match="in_features=48, out_features=64: granularity 'mx'"):
        QuantizedLinear(48, 64, ctx=mx)
    layer = QuantizedLinear(48, 64, ctx=ctx_of("e4m3/row/dynamic/0"))
    before, ctx = state_of(layer), layer.ctx
    with pytest.raises(ValueError, match="cannot take the ctx") as caught:
        layer.ctx = mx
    message = str(caught.value)
    assert "QuantizedLinear(in_features=48, out_features=64) cannot take the ctx with " in message
    assert "fp8=e4m3/mx/dynamic/0" in message and "multiples of 32" in message, message
    assert layer.ctx is ctx and layer.policy == Recipe.parse("e4m3/row/dynamic/0")
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in before.items())
    layer(torch.randn(2, 48, dtype=torch.bfloat16))  # still runs its own policy
    # Not a ctx, or a ctx without fp8: refused as construction refuses them.
    with pytest.raises(TypeError, match=r"QuantizedLinear\(in_features=48, out_features=64\)\.ctx"):
        layer.ctx = "fp8_mx"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="has recipe=None"):
        layer.ctx = ComputeCtx.from_flag("bf16", "cpu")
    assert layer.ctx is ctx
    # What construction accepts is accepted, and runs.
    layer.ctx = ctx_of("e4m3/block/dynamic/0")
    assert layer.policy.granularity == "block"
    layer(torch.randn(2, 48, dtype=torch.bfloat16))


def test_a_swapped_ctx_keeps_the_layers_other_settings_valid() -> None:
    # quantize="inline" is per tensor only (refused at construction under row); a frozen
    # layer holds per-tensor codes of its forward format and keeps that format.
    inline = QuantizedLinear(64, 64, ctx=ctx_of("e4m3/dynamic/0"), quantize="inline")
    with pytest.raises(ValueError, match="quantize='inline' is a per-tensor option"):
        inline.ctx = ctx_of("e4m3/row/dynamic/0")
    assert inline.policy == Recipe.parse("e4m3/dynamic/0")
    frozen = QuantizedLinear(64, 64, ctx=ctx_of("e4m3/dynamic/0")).freeze_for_serving()
    for refused in ("e5m2/dynamic/0", "e4m3/row/dynamic/0"):
        with pytest.raises(ValueError, match="frozen for serving"):
            frozen.ctx = ctx_of(refused)
    frozen.ctx = ctx_of("hybrid/dynamic/0")  # E4M3 forward, as the codes are
    assert frozen.policy.format.forward.torch == frozen.weight_fp8.dtype


def test_convert_to_fp8_layers_validate_their_ctx_too() -> None:
    model = nn.Sequential(nn.Linear(64, 48))
    convert_to_quantized(model, ctx_of("e4m3/row/dynamic/0"), include_head=True, min_features=16)
    layer = model[0]
    assert isinstance(layer, QuantizedLinear)
    with pytest.raises(ValueError, match="out_features=48: granularity 'mx'"):
        layer.ctx = ctx_of("e4m3/mx/dynamic/0")
