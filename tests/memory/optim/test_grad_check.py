"""The non-finite check of the step (``_grad_health.all_applicable``): true exactly when every
gradient element is finite with a finite float32 square (``|g| < 2**64``), whichever bound
clears a tensor first (a float32 dot product, or a 2-norm)."""

from __future__ import annotations

import pytest
import torch

from computectx.memory.optim._grad_health import SQUARE_OVERFLOW, all_applicable

BELOW = SQUARE_OVERFLOW * (1 - 2.0**-24)  # the largest float32 below 2**64


def with_value(value: float, dtype: torch.dtype, layout: str) -> torch.Tensor:
    t = torch.randn(64, 48).to(dtype)
    t[5, 7] = value
    if layout == "non-contiguous":
        return t.t()
    if layout == "sparse":
        return t.to_sparse()
    return t


@pytest.mark.parametrize("layout", ["contiguous", "non-contiguous", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    ("value", "applicable"),
    [
        (1.0, True),
        (float("nan"), False),
        (float("inf"), False),
        (float("-inf"), False),
        (SQUARE_OVERFLOW, False),
        (-SQUARE_OVERFLOW, False),
        (3.0e38, False),
        (BELOW, True),
        (-BELOW, True),
    ],
)
def test_the_verdict_is_exact_for_each_element(
    value: float, applicable: bool, dtype: torch.dtype, layout: str
) -> None:
    t = with_value(value, dtype, layout)
    stored = t.coalesce().values() if t.is_sparse else t
    # bf16 rounds the value; the verdict follows the stored element.
    expected = bool((stored.double().abs() < SQUARE_OVERFLOW).all())
    if dtype != torch.bfloat16:
        assert expected == applicable
    assert all_applicable([torch.ones(3), t]) is expected
    assert all_applicable([t, torch.ones(3)]) is expected


def test_many_large_applicable_elements_whose_sum_overflows_are_applied() -> None:
    big = torch.full((4096,), BELOW)  # each square finite, their sum not
    assert torch.isinf(torch.dot(big, big))
    assert all_applicable([big]) is True
    big[-1] = float("nan")
    assert all_applicable([big]) is False


def test_no_tensors_and_empty_tensors_are_applicable() -> None:
    assert all_applicable([]) is True
    assert all_applicable([torch.zeros(0), torch.zeros(0, 3).t()]) is True
