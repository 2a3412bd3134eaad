"""The dispatch layer (``computectx.formats.ops``): the standalone API and its input checks.

Each check raises ``TypeError``/``ValueError`` quoting the bad value and what is accepted,
before anything changes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from computectx.dtypes import DType, Fp8Format
from computectx.formats import Backend
from computectx.formats.numerics.ledger import ledger_new
from computectx.formats.ops import blockwise as block_ops
from computectx.formats.ops import tensorwise as tensor_ops

REF = Backend.REFERENCE
# Wrongly typed arguments, typed Any so the checks run (mypy would reject them as literals).
BAD_SCALE: Any = "1"
BAD_BACKEND: Any = "reference"
BAD_ALGO: Any = "mean"


@pytest.mark.parametrize("fmt", ["e4m3", "fp8_e5m2", Fp8Format.E4M3])
def test_fp8_quantize_round_trip(fmt: Fp8Format | str) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    data, scale = block_ops.quantize_tensor(x, fmt)
    f = Fp8Format.parse(fmt)
    assert data.dtype == f.torch
    assert scale.shape == (1,)
    # Dynamic scale: the amax lands exactly on fmt.max.
    amax = x.float().abs().max()
    assert scale.item() == (amax / f.max).item()
    back = block_ops.dequantize_tensor(data, scale, DType.F32)
    assert torch.equal(back, data.float() * scale)
    # Half an fp8 ulp relative in the normal range, half a subnormal step below it.
    err = (back - x.float()).abs()
    normal = x.float().abs() / scale >= f.min_normal
    assert bool((err[normal] <= x.float().abs()[normal] * 2.0 ** -(f.mantissa_bits + 1)).all())
    assert bool((err[~normal] <= scale * f.min_subnormal / 2).all())
    assert block_ops.dequantize_tensor(data, scale, "bf16").dtype == torch.bfloat16
    data2, scale2 = block_ops.quantize_tensor(x, fmt, 0.5)
    assert scale2.item() == 0.5
    assert torch.equal(data2.float(), (x.float() / 0.5).clamp(-f.max, f.max).to(f.torch).float())


@pytest.mark.parametrize(
    ("call", "exc", "needle"),
    [
        (
            lambda: block_ops.quantize_tensor(torch.ones(2, dtype=torch.float64), "e4m3"),
            ValueError,
            "float64",
        ),
        (lambda: block_ops.quantize_tensor(torch.ones(2), "e3m4"), ValueError, "e3m4"),
        (lambda: block_ops.quantize_tensor(torch.ones(2), "e4m3", -1.0), ValueError, "-1.0"),
        (lambda: block_ops.quantize_tensor(torch.ones(2), "e4m3", BAD_SCALE), TypeError, "str"),
        (lambda: block_ops.dequantize_tensor(torch.ones(2), 1.0, "f32"), ValueError, "float32"),
        (
            lambda: block_ops.dequantize_tensor(
                torch.ones(2).to(torch.float8_e4m3fn), 1.0, torch.int8
            ),
            ValueError,
            "int8",
        ),
        (
            lambda: tensor_ops.quantize_with_step(
                torch.ones(2), Fp8Format.E4M3, torch.ones(2), backend=REF
            ),
            ValueError,
            "(2,)",
        ),
        (
            lambda: tensor_ops.quantize_with_step(
                torch.ones(2), Fp8Format.E4M3, torch.ones(1), backend=BAD_BACKEND
            ),
            TypeError,
            "'reference'",
        ),
        (
            lambda: tensor_ops.quantize_delayed(
                torch.ones(2), Fp8Format.E4M3, ledger_new(2, "cpu"), 2, "max", 0, backend=REF
            ),
            ValueError,
            "[0, 2)",
        ),
        (
            lambda: tensor_ops.quantize_delayed(
                torch.ones(2), Fp8Format.E4M3, ledger_new(2, "cpu"), 0, BAD_ALGO, 0, backend=REF
            ),
            ValueError,
            "'mean'",
        ),
        (
            lambda: tensor_ops.quantize_dynamic(torch.ones(2), Fp8Format.E4M3, -1, backend=REF),
            ValueError,
            "margin must be an int in [0, 64], got -1",
        ),
        (lambda: ledger_new(0, "cpu"), ValueError, "history_len must be an int >= 1, got 0"),
        (
            lambda: tensor_ops.scaled_mm(
                torch.ones(2, 3), torch.ones(2, 3), torch.ones(1), torch.ones(1), backend=REF
            ),
            ValueError,
            "torch.float32",
        ),
        (
            lambda: tensor_ops.scaled_mm(
                torch.ones(2, 3).to(torch.float8_e4m3fn),
                torch.ones(2, 4).to(torch.float8_e4m3fn),
                torch.ones(1),
                torch.ones(1),
                backend=REF,
            ),
            ValueError,
            "(2, 4)",
        ),
        (
            lambda: tensor_ops.scaled_mm(
                torch.ones(2, 3).to(torch.float8_e4m3fn),
                torch.ones(2, 3).to(torch.float8_e4m3fn),
                torch.ones(1),
                torch.ones(1),
                torch.ones(3),
                backend=REF,
            ),
            ValueError,
            "(2,)",
        ),
        (
            lambda: tensor_ops.scaled_mm(
                torch.ones(2, 3).to(torch.float8_e4m3fn),
                torch.ones(2, 3).to(torch.float8_e4m3fn),
                torch.ones(1),
                torch.ones(1),
                None,
                torch.float64,
                backend=REF,
            ),
            ValueError,
            "torch.float64",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(call: object, exc: type[Exception], needle: str) -> None:
    assert callable(call)
    with pytest.raises(exc) as info:
        call()
    assert needle in str(info.value)


def test_bad_input_leaves_ledger_untouched() -> None:
    ledger = ledger_new(2, "cpu")
    before = ledger.clone()
    with pytest.raises(ValueError, match="float64"):
        tensor_ops.quantize_delayed(
            torch.ones(2, dtype=torch.float64), Fp8Format.E4M3, ledger, 0, "max", 0, backend=REF
        )
    assert torch.equal(ledger, before)


def test_non_contiguous_input_quantizes_like_its_copy() -> None:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(2)).t()
    q, _ = tensor_ops.quantize_with_step(x, Fp8Format.E4M3, torch.tensor([0.01]), backend=REF)
    q2, _ = tensor_ops.quantize_with_step(
        x.contiguous(), Fp8Format.E4M3, torch.tensor([0.01]), backend=REF
    )
    assert q.shape == (5, 6)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
