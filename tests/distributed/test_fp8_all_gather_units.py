"""One-process checks of ``enable_quantized_all_gather`` (the gather itself runs on 2 ranks in
test_fsdp_fp8.py): which weights it converts, and that outside FSDP2 nothing changes."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import (
    WeightGatheredQuantized,
    enable_quantized_all_gather,
    sync_scaling,
)
from computectx.formats import QuantizedLinear

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        QuantizedLinear(16, 32, ctx=CTX),
        nn.ReLU(),
        QuantizedLinear(32, 16, ctx=CTX),
        QuantizedLinear(16, 16, ctx=CTX),
    )


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_it_converts_the_fp8_weights_it_is_asked_to_and_only_once() -> None:
    model = _model()
    last = model[3]
    assert isinstance(last, QuantizedLinear)
    last.freeze_for_serving()
    assert enable_quantized_all_gather(model, module_filter=lambda module, fqn: fqn != "2") == 1
    assert isinstance(model[0].weight, WeightGatheredQuantized)
    assert isinstance(model[0].weight, nn.Parameter)
    assert not isinstance(model[2].weight, WeightGatheredQuantized)
    assert enable_quantized_all_gather(model) == 1  # layer 2 now; layer 0 already; 3 is frozen
    assert enable_quantized_all_gather(model) == 0


def test_outside_fsdp2_a_converted_model_trains_bit_for_bit_as_before() -> None:
    plain, converted = _model(), _model()
    enable_quantized_all_gather(converted)
    assert _train(converted) == _train(plain)
    for (name, p), q in zip(plain.named_parameters(), converted.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_its_state_dict_holds_plain_tensors_that_load_back_weights_only() -> None:
    model = _model()
    enable_quantized_all_gather(model)
    _train(model, steps=1)
    state = model.state_dict()
    assert type(state["0.weight"]) is torch.Tensor
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = _model()
    enable_quantized_all_gather(fresh)
    fresh.load_state_dict(loaded)
    assert isinstance(fresh[0].weight, WeightGatheredQuantized)  # loading copies into it
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(fresh.state_dict()[key], value), key
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_a_bad_current_amax_is_refused_by_name_before_any_collective() -> None:
    with pytest.raises(
        ValueError, match=r"current_amax must be 'group' or 'local' \(or None.*got 'batch'"
    ):
        sync_scaling(_model(), current_amax="batch")  # type: ignore[arg-type]


def test_a_module_dtype_conversion_converts_the_tensor_it_wraps() -> None:
    # module.to(dtype) swaps the whole subclass: setting .data would leave the wrapped
    # float32 tensor behind a bfloat16 face.
    model = _model()
    enable_quantized_all_gather(model)
    weight = model[0].weight
    model.to(torch.bfloat16)
    assert model[0].weight is weight  # the same Parameter object, now bfloat16 inside too
    assert isinstance(weight, WeightGatheredQuantized)
    assert weight.dtype == weight.hp.dtype == torch.bfloat16
    model(torch.randn(2, 16, dtype=torch.bfloat16)).sum().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16
