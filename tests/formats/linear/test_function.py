"""fp8 layers under ``torch.autocast`` return the autocast dtype, as ``nn.Linear`` does.

accelerate's ``mixed_precision="bf16"`` (and Lightning's ``precision="bf16-mixed"``) run the
forward under ``torch.autocast``: an ``nn.Linear`` with float32 weights then returns bf16, and
so must an fp8 layer. What it computes is what it computes for a bf16 input without autocast:
the input is lowered to the autocast dtype, the weight is quantized from its own dtype, and
autocast does not reach inside (the float32 work of the fp8 path stays float32).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, autocast, convert_to_quantized

FLAGS = ["fp8_hybrid", "fp8_hybrid_dynamic", "fp8_rowwise"]  # per tensor (two recipes), per row


def _layer(flag: str) -> QuantizedLinear:
    torch.manual_seed(0)
    return QuantizedLinear(64, 32, ctx=ComputeCtx.from_flag(flag, "cpu"), dtype=torch.float32)


@pytest.mark.parametrize("flag", FLAGS)
def test_an_fp8_linear_under_autocast_is_one_at_the_autocast_dtype(flag: str) -> None:
    layer = _layer(flag)
    same = copy.deepcopy(layer)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    xa = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xa)
        assert nn.functional.linear(xa, layer.weight).dtype == torch.bfloat16  # as nn.Linear
    assert y.dtype == torch.bfloat16
    (y.float() * probe).sum().backward()
    # Without autocast, the same layer given the input at bf16: the same output bits, the
    # same gradients (the input's at its own float32, the weight's at the weight's).
    xb = x.clone().requires_grad_()
    want = same(xb.bfloat16())
    (want.float() * probe).sum().backward()
    assert torch.equal(y, want)
    assert xa.grad is not None and xb.grad is not None and xa.grad.dtype == torch.float32
    assert torch.equal(xa.grad, xb.grad)
    assert layer.weight.grad is not None and same.weight.grad is not None
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, same.weight.grad)
    for role, op in layer.scaling.operands.items():  # recorded the same amaxes
        assert torch.equal(op.ledger, same.scaling.operands[role].ledger), role


def test_autocast_at_fp16_and_a_bf16_input_and_eval() -> None:
    layer = _layer("fp8_hybrid").eval()
    x = torch.randn(4, 64).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        y = layer(x)
    assert y.dtype == torch.float16  # autocast lowers every input to its dtype
    with torch.no_grad():
        assert torch.equal(y, layer(x.half()))
        assert layer(x).dtype == torch.bfloat16  # no autocast: the input's dtype, as before


def test_autocast_off_for_the_device_or_fp8_off_keeps_the_usual_dtypes() -> None:
    layer = _layer("fp8_hybrid")
    x = torch.randn(4, 64)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False):
        assert layer(x).dtype == torch.float32
    # The plain linear inside autocast(enabled=False) is F.linear, which autocast lowers.
    with autocast(enabled=False), torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16


def test_a_converted_model_under_autocast_returns_bf16_throughout() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))  # 128x128 blocks
    ctx = ComputeCtx.from_flag("fp8_block", "cpu")
    convert_to_quantized(model, ctx, min_features=16, include_head=True)
    assert all(isinstance(m, QuantizedLinear) for m in (model[0], model[2]))
    seen: list[torch.dtype] = []
    for m in (model[0], model[2]):
        m.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 128))
    assert out.dtype == torch.bfloat16 and seen == [torch.bfloat16, torch.bfloat16]
