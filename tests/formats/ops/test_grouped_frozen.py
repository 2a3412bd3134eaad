"""Frozen experts (``formats.ops.grouped_frozen``): the codes the grouped forward makes, held
and multiplied as they are, the output the unfrozen one's bit for bit; given codes held bit for
bit; a refused freeze changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from computectx.formats import (
    Backend,
    QuantizedExperts,
    Recipe,
    ServingWeight,
    quantized_grouped_mm,
)
from computectx.formats.ops.grouped_frozen import (
    experts_serving_weight,
    freeze_experts,
    frozen_experts_mm,
    held_experts,
)

RECIPES = {
    "tensor": "e4m3/tensor/dynamic/0",
    "hybrid-delayed": "hybrid/tensor/delayed/2",  # margin 2: the experts' dynamic steps
    "row": "e4m3/row/dynamic/0",
    "block": "e4m3/block/dynamic/0",
}
SIZES = [0, 37, 5, 150]  # an empty group, ragged ones, one past a 128-row block
K, N = 160, 144  # both ragged against 128x128 blocks


def operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SIZES) + 3, K, generator=g).to(dtype)
    w = (torch.randn(len(SIZES), N, K, generator=g) * 0.05).to(dtype)
    offs = torch.tensor(SIZES, dtype=torch.int32).cumsum(0).to(torch.int32)
    return x, w, offs


class Experts(nn.Module):
    """One expert weight ``w [E, N, K]``."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_codes_give_the_unfrozen_output_and_input_gradient(
    name: str, dtype: torch.dtype
) -> None:
    qe = QuantizedExperts(Recipe.parse(RECIPES[name]), Backend.REFERENCE)
    x, w, offs = operands(dtype)
    held = experts_serving_weight(w, qe)
    layout = {"row": "row", "block": "128x128"}.get(name, "tensor")
    assert held.codes.shape == w.shape and held.layout == layout

    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = quantized_grouped_mm(xa, w, offs, qe.policy, backend="reference")
    got = frozen_experts_mm(qe, xb, held, offs)
    assert got.dtype == dtype and torch.equal(got, want)
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want.backward(dy)  # type: ignore[no-untyped-call]
    got.backward(dy)  # type: ignore[no-untyped-call]
    assert xa.grad is not None and xb.grad is not None
    if name == "row":
        # Row blocks do not transpose: Wᵀ is quantized along N from the codes times their
        # steps in float32, as the frozen row linear's dgrad.
        xc = x.clone().requires_grad_()
        deq = held.dequantize(torch.float32)
        quantized_grouped_mm(xc, deq, offs, qe.policy, backend="reference").backward(dy)  # type: ignore[no-untyped-call]
        assert torch.equal(xb.grad, xc.grad)  # type: ignore[arg-type]
    else:  # the codes transposed are Wᵀ's: the unfrozen dgrad bit for bit
        assert torch.equal(xb.grad, xa.grad)


@pytest.mark.parametrize("name", ["tensor", "row", "block"])
def test_freeze_drops_the_weight_and_the_module_serves_from_buffers(name: str) -> None:
    qe = QuantizedExperts(Recipe.parse(RECIPES[name]), Backend.REFERENCE)
    x, w, offs = operands(torch.bfloat16)
    module = Experts(w)
    want = experts_serving_weight(module.w, qe)
    freeze_experts(module, qe, {"w": module.w})
    assert module.w is None and list(module.state_dict()) == ["w_fp8", "w_step"]
    held = held_experts(module, "w", qe)
    assert held is not None
    assert torch.equal(held.codes.view(torch.uint8), want.codes.view(torch.uint8))
    assert torch.equal(held.steps, want.steps)
    y = frozen_experts_mm(qe, x, held, offs)
    assert torch.equal(y, quantized_grouped_mm(x, w, offs, qe.policy, backend="reference"))

    # A second freeze without codes keeps what is held; a state dict round trip restores it.
    freeze_experts(module, qe, {"w": module.get_buffer("w_fp8")})
    again = held_experts(module, "w", qe)
    assert again is not None and again.codes.data_ptr() == held.codes.data_ptr()
    other = Experts(w * 2)
    freeze_experts(other, qe, {"w": other.w})
    other.load_state_dict(module.state_dict())
    again = held_experts(other, "w", qe)
    assert again is not None and again.codes.data_ptr() != held.codes.data_ptr()
    assert torch.equal(frozen_experts_mm(qe, x, again, offs), y)


def test_given_codes_are_held_bit_for_bit_and_copied() -> None:
    qe = QuantizedExperts(Recipe.parse(RECIPES["block"]), Backend.REFERENCE)
    _, w, _ = operands(torch.bfloat16)
    source = experts_serving_weight(w * 3, qe)  # other codes than the module's weight makes
    module = Experts(w)
    freeze_experts(module, qe, {"w": module.w}, {"w": source})
    held = held_experts(module, "w", qe)
    assert held is not None
    assert torch.equal(held.codes.view(torch.uint8), source.codes.view(torch.uint8))
    assert torch.equal(held.steps, source.steps)
    assert held.codes.data_ptr() != source.codes.data_ptr()  # a copy, not the given storage
    # Into frozen experts: the new codes replace the held ones.
    fresh = experts_serving_weight(w, qe)
    freeze_experts(module, qe, {"w": module.get_buffer("w_fp8")}, {"w": fresh})
    codes = module.get_buffer("w_fp8")
    assert torch.equal(codes.view(torch.uint8), fresh.codes.view(torch.uint8))


def _refusals(w: torch.Tensor, qe: QuantizedExperts) -> list[tuple[object, type, str]]:
    good = experts_serving_weight(w, qe)
    row = QuantizedExperts(Recipe.parse(RECIPES["row"]), Backend.REFERENCE)
    bad_steps = good.steps.clone()
    bad_steps[1, 0, 0] = -1.0
    return [
        ([good], TypeError, "takes a mapping"),
        ({}, ValueError, r"not given: \['w'\]"),
        ({"w": good, "v": good}, ValueError, r"unknown: \['v'\]"),
        ({"w": good.codes}, TypeError, "must be a ServingWeight"),
        ({"w": experts_serving_weight(w, row)}, ValueError, "laid out '128x128'.*laid out 'row'"),
        ({"w": good.expert(0)}, ValueError, r"shape \(4, 144, 160\)"),
        ({"w": ServingWeight(good.codes, bad_steps, good.layout)}, ValueError, "not finite and"),
    ]


def test_a_refused_freeze_changes_nothing() -> None:
    qe = QuantizedExperts(Recipe.parse(RECIPES["block"]), Backend.REFERENCE)
    _, w, _ = operands(torch.bfloat16)
    module = Experts(w)
    before = copy.deepcopy(module.state_dict())
    for given, error, match in _refusals(w, qe):
        with pytest.raises(error, match=match):
            freeze_experts(module, qe, {"w": module.w}, given)  # type: ignore[arg-type]
        assert isinstance(module.w, nn.Parameter) and list(module.state_dict()) == ["w"]
        assert torch.equal(module.w, before["w"]) and held_experts(module, "w", qe) is None


def test_cast_codes_are_refused_loudly() -> None:
    qe = QuantizedExperts(Recipe.parse(RECIPES["tensor"]), Backend.REFERENCE)
    _, w, _ = operands(torch.float32)
    module = Experts(w)
    freeze_experts(module, qe, {"w": module.w})
    module.half()  # fp8 counts as floating point: the codes are widened
    with pytest.raises(ValueError, match="cast the model before freezing"):
        held_experts(module, "w", qe)
