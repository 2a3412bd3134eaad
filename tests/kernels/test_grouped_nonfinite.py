"""Non-finite operands through the Triton grouped GEMMs: what the reference twin gives.

``quantized_grouped_mm(backend="triton")`` against ``backend="reference"`` (each group the dense
fp8 linear, tests/formats/ops/test_grouped.py) with a NaN and a ±inf in one expert's weight and in
the input rows of one group, forward, dgrad and wgrad, at every recipe: the same NaN
positions (a NaN operand element makes its output row, column or gradient NaN), ±inf
saturating to ``±fmt.max`` as the dense quantize does (docs/fp8.md), and the finite values
within float32 summation-order rounding. Under the interpreter, whose ``tl.dot`` reads the
fp8 NaN byte as 480, the launchers restore the NaN (``kernels.grouped_mm.nan_through``).
Tiny shapes: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from computectx.formats import Recipe, quantized_grouped_mm

pytestmark = pytest.mark.interpreter

RECIPES = [f"e4m3/{g}/dynamic/0" for g in ("tensor", "row", "block", "mx")]


@pytest.mark.parametrize("recipe", RECIPES)
def test_nan_and_inf_in_one_expert_and_one_group_as_the_twin(
    recipe: str, device: torch.device
) -> None:
    policy = Recipe.parse(recipe)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 32, 32, generator=gen)
    x = torch.randn(6, 32, generator=gen)
    w[2, 3, 5], w[0, 1, 2] = float("nan"), float("inf")  # experts 2 and 0
    x[0, 7], x[4, 9] = float("nan"), -float("inf")  # groups 0 and 2
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)  # an empty group, a row past the end
    results = []
    for backend in ("reference", "triton"):
        xg = x.to(device).requires_grad_()
        wg = w.to(device).requires_grad_()
        y = quantized_grouped_mm(xg, wg, offs.to(device), policy, backend=backend)
        y.backward(torch.ones_like(y))  # type: ignore[no-untyped-call]
        assert xg.grad is not None and wg.grad is not None
        results.append((y.cpu(), xg.grad.cpu(), wg.grad.cpu()))
    (y_ref, dx_ref, dw_ref), (y, dx, dw) = results
    assert torch.isnan(y_ref[0]).all() and torch.isnan(y_ref[2:5, 3]).all()
    assert torch.isfinite(y_ref[1]).all() and not torch.isnan(y_ref[2:5]).all()
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3, equal_nan=True)
