"""A 4-bit weight gathered from row shards (``linear.fp4_gathered``): what a shard sends, in
bytes an element, and that the pieces put together are the operands one process quantizing
the whole weight makes, forward and dgrad, bit for bit; an ``Fp4Linear`` multiplying with
them gives its own outputs and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats import Fp4Linear, Fp4Recipe
from computectx.formats.linear.fp4 import fp4_quant
from computectx.formats.linear.fp4_gathered import Fp4GatheredWeight, transposed_tiles
from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Operand, dequantize_operand
from computectx.formats.ops import fp4 as fp4_ops

BYTES = {
    "nvfp4": 0.5 + 1 / 256,
    "nvfp4+w1x16": 2 * (0.5 + 1 / 16),
    "mxfp4+floor": 2 * (0.5 + 1 / 32),
}


def _layer(recipe: str, n: int = 128, k: int = 64) -> Fp4Linear:
    ctx = ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=Fp4Recipe.parse(recipe))
    torch.manual_seed(0)
    layer = Fp4Linear(k, n, ctx=ctx)
    with torch.no_grad():
        layer.weight[5, :16] *= 40.0  # the whole weight's amax sits in one shard
    return layer


def _gathered(layer: Fp4Linear, world: int) -> tuple[Fp4GatheredWeight, float]:
    # What each shard sends, concatenated along dim 0 as FSDP2 gathers; bytes an element.
    spec = layer.weight_gather
    shards = layer.weight.detach().chunk(world)
    amax = None
    if spec.needs_amax:
        amax = torch.stack([spec.shard_amax(s) for s in shards]).amax(0)
    sent = [spec.inputs(s, amax) for s in shards]
    assert all(t.dtype == torch.uint8 for part in sent for t in part)
    per_element = sum(t.numel() for t in sent[0]) / shards[0].numel()
    parts = tuple(torch.cat(pieces) for pieces in zip(*sent, strict=True))
    return spec.weight(parts, amax, layer.weight.dtype), per_element


def _same(a: Fp4Operand, b: Fp4Operand) -> None:
    assert type(a) is type(b)
    assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    if isinstance(a, Nvfp4Operand) and isinstance(b, Nvfp4Operand):
        assert torch.equal(a.amax.reshape(()), b.amax.reshape(())) and a.tile == b.tile


@pytest.mark.parametrize("recipe", sorted(BYTES))
@pytest.mark.parametrize("world", [2, 4])
def test_the_gathered_shards_are_the_whole_weights_operands_bit_for_bit(
    recipe: str, world: int
) -> None:
    layer = _layer(recipe)
    w, per_element = _gathered(layer, world)
    assert per_element == BYTES[recipe]
    if recipe == "nvfp4":
        assert per_element <= 0.6
    _same(w.operand(), layer.quantized_weight())
    whole_t = fp4_ops.quantize(layer.weight.detach().t(), fp4_quant(layer.recipe), weight=True)
    _same(w.dgrad_operand(), whole_t)
    assert w.shape == layer.weight.shape and w.dtype == layer.weight.dtype


def test_a_16x16_tiled_operand_transposed_is_the_transposes_operand() -> None:
    x = torch.randn(48, 32) * torch.logspace(-3, 3, 48)[:, None]
    x[3, 7], x[20, 1] = float("inf"), float("nan")
    how = fp4_quant(Fp4Recipe.parse("nvfp4"))
    q = fp4_ops.quantize(x, how, weight=True)
    assert isinstance(q, Nvfp4Operand)
    _same(transposed_tiles(q), fp4_ops.quantize(x.t(), how, weight=True))
    rows = fp4_ops.quantize(x, how)
    assert isinstance(rows, Nvfp4Operand)
    with pytest.raises(ValueError, match="only 16x16 tiles transpose"):
        transposed_tiles(rows)


@pytest.mark.parametrize("recipe", sorted(BYTES))
def test_a_layer_multiplying_with_a_gathered_weight_gives_its_own_outputs_and_gradients(
    recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, took = _layer(recipe), _layer(recipe)
    took.weight = nn.Parameter(_gathered(took, 2)[0].detach().requires_grad_(True))
    assert isinstance(took.weight, Fp4GatheredWeight)

    def refused(*args: object) -> None:
        raise AssertionError("the layer read the gathered weight's values, not its operands")

    x = torch.randn(24, 64)
    inputs = [x.clone().requires_grad_(True) for _ in range(2)]
    plain(inputs[0]).square().sum().backward()
    with monkeypatch.context() as m:
        m.setattr(Fp4GatheredWeight, "dequantize", refused)
        took(inputs[1]).square().sum().backward()
        assert torch.equal(plain(x.bfloat16()), took(x.bfloat16()))
    assert plain.weight.grad is not None and took.weight.grad is not None
    assert type(took.weight.grad) is torch.Tensor
    assert torch.equal(plain.weight.grad, took.weight.grad)
    assert torch.equal(inputs[0].grad, inputs[1].grad)  # type: ignore[arg-type]
    assert torch.equal(plain.sr_key, took.sr_key)
    _same(took.quantized_weight(), plain.quantized_weight())


def test_other_ops_see_the_dequantized_weight_and_aliases_stay_gathered() -> None:
    layer = _layer("nvfp4", n=32, k=32)
    w, _ = _gathered(layer, 2)
    values = dequantize_operand(layer.quantized_weight())
    assert type(w.to(torch.bfloat16)) is torch.Tensor
    assert torch.equal(w.to(torch.bfloat16), values.bfloat16())
    assert torch.equal(w + 0, values)
    assert isinstance(w.detach(), Fp4GatheredWeight)
    assert isinstance(torch.as_strided(w, w.shape, w.stride(), 0), Fp4GatheredWeight)
    assert type(w.t()) is torch.Tensor  # another layout: its values
    assert "nvfp4 16x16 as torch.float32" in repr(w)
    # An empty batch multiplies nothing in 4 bits: a zero gradient of the weight's shape.
    took = _layer("nvfp4", n=32, k=32)
    took.weight = nn.Parameter(w.detach().requires_grad_(True))
    took(torch.zeros(0, 32)).sum().backward()
    assert took.weight.grad is not None and not took.weight.grad.any()


def test_shards_align_on_whole_blocks_and_refresh_writes_the_amax_in_place() -> None:
    nv, mx = _layer("nvfp4").weight_gather, _layer("mxfp4").weight_gather
    assert nv.aligns(64, 2) and nv.aligns(32, 2) and not nv.aligns(48, 2)  # 24-row shards
    assert mx.aligns(64, 2) and not mx.aligns(32, 2)  # Wᵀ's 32-row blocks
    assert not nv.aligns(48, 5)  # uneven shards
    w, _ = _gathered(_layer("nvfp4"), 2)
    amax = w.per_tensor_amax
    assert amax is not None
    nv.refresh(w, torch.tensor([3.0]))
    assert w.per_tensor_amax is amax and float(amax) == 3.0
    with pytest.raises(TypeError, match="Fp4GatheredWeight gathered before"):
        nv.refresh(torch.zeros(2), None)
