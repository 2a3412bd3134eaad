"""``QuantizedWeight``: a weight that reaches a ``QuantizedLinear`` already quantized."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.dtypes import Fp8Format
from computectx.formats import QuantizedBlockWeight, QuantizedLinear, QuantizedWeight
from computectx.formats.backend import Backend
from computectx.formats.numerics import tensorwise
from computectx.formats.ops.tensorwise import quantize_dynamic, quantize_with_step

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    data, step, _ = quantize_dynamic(w, Fp8Format.E4M3, 0, backend=Backend.REFERENCE)
    return data, step.reshape(1)


def test_it_stands_for_its_dequantized_value_in_any_other_op() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 4)
    data, step = _quantized(w)
    fw = QuantizedWeight(data, step, torch.float32)
    assert fw.shape == (6, 4) and fw.dtype == torch.float32
    value = tensorwise.dequantize(data, step, torch.float32)
    assert torch.equal(fw.dequantize(), value)
    assert type(fw + 0) is torch.Tensor
    assert torch.equal(fw + 0, value)
    assert torch.equal(fw.to(torch.bfloat16), value.to(torch.bfloat16))
    # Aliases keep the codes (no dequantize-and-copy).
    for alias in (fw.detach(), fw.view(3, 8), torch.as_strided(fw, (6, 4), (4, 1), 0)):
        assert isinstance(alias, QuantizedWeight)
        assert alias.fp8_data.data_ptr() == data.data_ptr()
        assert alias.fp8_step is step
    param = nn.Parameter(fw)
    assert isinstance(param, QuantizedWeight) and param.requires_grad


@pytest.mark.parametrize(
    ("data", "step", "dtype", "message"),
    [
        (torch.zeros(2, 2), torch.ones(1), torch.float32, "float8"),
        (torch.zeros(2, 2, dtype=torch.float8_e4m3fn), torch.ones(2), torch.float32, "one"),
        (
            torch.zeros(2, 2, dtype=torch.float8_e4m3fn),
            torch.ones(1, dtype=torch.float64),
            torch.float32,
            "float32",
        ),
        (torch.zeros(2, 2, dtype=torch.float8_e4m3fn), torch.ones(1), torch.int32, "bfloat16"),
    ],
)
def test_bad_parts_are_refused_by_name(
    data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype, message: str
) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        QuantizedWeight(data, step, dtype)


def test_fp8_linear_uses_its_codes_and_step_as_they_are() -> None:
    torch.manual_seed(1)
    plain = QuantizedLinear(32, 16, ctx=CTX, backend="reference")
    gathered = QuantizedLinear(32, 16, ctx=CTX, backend="reference")
    gathered.load_state_dict(plain.state_dict())
    w = plain.weight.detach().clone()
    data, step = _quantized(w)
    gathered.weight = nn.Parameter(QuantizedWeight(data, step, torch.float32))
    # The plain layer quantizes its weight with the same step when frozen for serving.
    plain.freeze_for_serving()
    assert torch.equal(plain.weight_fp8, data)
    x = torch.randn(5, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y = gathered(x)
    assert torch.equal(y, plain(x2))
    # The weight ledger is left alone: the codes were made (and recorded) elsewhere.
    assert not gathered.scaling.weight.seeded
    y.sum().backward()
    grad = gathered.weight.grad
    assert grad is not None and type(grad) is torch.Tensor
    assert grad.shape == (16, 32) and grad.dtype == torch.float32
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_backward_reads_the_step_the_codes_carry_then() -> None:
    # FSDP2 refills the gathered codes before the backward and writes their step into the
    # same QuantizedWeight: the input gradient must use that pair, not the forward's step.
    torch.manual_seed(2)
    w = torch.randn(16, 32)
    data, step = _quantized(w)
    layer = QuantizedLinear(32, 16, ctx=CTX, backend="reference")
    layer.weight = nn.Parameter(QuantizedWeight(data, step, torch.float32))
    x = torch.randn(5, 32, requires_grad=True)
    y = layer(x)
    # Refill with the same weight quantized at twice the step (other codes, other step).
    new_step = step * 2
    new_data, _ = quantize_with_step(w, Fp8Format.E4M3, new_step, backend=Backend.REFERENCE)
    with torch.no_grad():
        data.copy_(new_data)
        step.copy_(new_step)
    y.sum().backward()
    ref = QuantizedLinear(32, 16, ctx=CTX, backend="reference")
    ref.weight = nn.Parameter(QuantizedWeight(new_data, new_step, torch.float32))
    x2 = x.detach().clone().requires_grad_(True)
    ref(x2).sum().backward()
    assert x.grad is not None and x2.grad is not None
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize(
    ("data", "got"),
    [
        (torch.zeros(4, 4, dtype=torch.bfloat16), "torch.bfloat16 (4, 4) on cpu"),
        (torch.zeros(2, 4, 4, dtype=torch.float8_e4m3fn), "torch.float8_e4m3fn (2, 4, 4) on cpu"),
        ([[0.0]], "list"),
    ],
)
def test_block_weight_codes_other_than_2d_fp8_are_refused_naming_them(
    data: object, got: str
) -> None:
    scale = torch.ones(1, 1)
    with pytest.raises(TypeError, match="must be a 2-D float8_e4m3fn/e5m2 tensor, got ") as e:
        QuantizedBlockWeight(data, scale, torch.bfloat16)  # type: ignore[arg-type]
    assert str(e.value).endswith(got), str(e.value)
