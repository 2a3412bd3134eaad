"""One-process checks of ``enable_fp4_all_gather`` (the gather itself runs on 2 ranks in
``test_fp4_fsdp.py``): which weights it converts, what it refuses, and that outside FSDP2
nothing changes."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import WeightGatheredFp4, enable_fp4_all_gather
from computectx.formats import Fp4Linear

CTX = ComputeCtx.from_flag("nvfp4", "cpu")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        Fp4Linear(32, 64, ctx=CTX), nn.ReLU(), Fp4Linear(64, 32, ctx=CTX), nn.Linear(32, 8)
    )


def _train(model: nn.Module, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        model(torch.randn(12, 32, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_it_converts_the_4_bit_weights_it_is_asked_to_and_only_once() -> None:
    model = _model()
    assert enable_fp4_all_gather(model, module_filter=lambda m, fqn: fqn != "2") == 1
    assert isinstance(model[0].weight, WeightGatheredFp4)
    assert isinstance(model[0].weight, nn.Parameter)
    assert not isinstance(model[2].weight, WeightGatheredFp4)
    assert enable_fp4_all_gather(model) == 1  # layer 2 now; the nn.Linear never
    assert enable_fp4_all_gather(model) == 0
    assert repr(model[0].weight).startswith("WeightGatheredFp4(0.weight, ")


@pytest.mark.parametrize("bad", ["0", 3, True])
def test_a_filter_that_is_not_callable_or_a_model_that_is_no_module_is_refused(bad: object) -> None:
    model = _model()
    with pytest.raises(TypeError, match=rf"module_filter is a callable.*got {bad!r}"):
        enable_fp4_all_gather(model, module_filter=bad)  # type: ignore[arg-type]
    assert not any(isinstance(p, WeightGatheredFp4) for p in model.parameters())
    with pytest.raises(TypeError, match=r"takes the converted nn.Module, got str"):
        enable_fp4_all_gather("model")  # type: ignore[arg-type]


def test_a_tied_weight_is_refused_naming_both_holders_before_anything_changes() -> None:
    model = _model()
    model.append(Fp4Linear(32, 64, ctx=CTX))
    model[4].weight = model[0].weight
    with pytest.raises(ValueError, match=r"0\.weight and 4\.weight.*fqn != '0'"):
        enable_fp4_all_gather(model)
    assert not any(isinstance(p, WeightGatheredFp4) for p in model.parameters())


def test_outside_fsdp2_a_converted_model_trains_and_saves_as_before() -> None:
    plain, converted = _model(), _model()
    enable_fp4_all_gather(converted)
    for a, b in zip(_train(plain), _train(converted), strict=True):
        assert torch.equal(a, b)
    state = converted.state_dict()
    assert type(state["0.weight"]) is torch.Tensor  # the plain tensor it wraps
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    fresh = _model()
    enable_fp4_all_gather(fresh)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert isinstance(fresh[0].weight, WeightGatheredFp4)  # loading copies into it
    assert isinstance(fresh[0], Fp4Linear) and isinstance(converted[0], Fp4Linear)
    assert torch.equal(fresh[0].sr_key, converted[0].sr_key)
    for key, value in state.items():
        assert torch.equal(fresh.state_dict()[key], value), key
