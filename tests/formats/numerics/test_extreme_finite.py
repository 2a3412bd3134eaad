"""Extreme finite values through every fp8 quantizer granularity: finite in, finite out.

Over the whole float32 range (1e-45 to 3.4e38, both signs, subnormals, zeros): the per-tensor
dynamic quantize and the block quantizes (``row``, ``1x128``, ``128x128``, ``mx``, each step
rule) give no NaN code, a finite positive step for every block, and a finite dequantized value
within the documented saturation (``|x_hat| <= fmt.max * step``); a step above about
``FLT_MAX / fmt.max`` lowers the saturation to the largest code whose product is finite.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from computectx import Fp8Format
from computectx.formats.numerics import blockwise, tensorwise
from computectx.formats.numerics.layouts import layout_of

FINITE = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
EXTREMES = st.sampled_from([3.4e38, -3.4e38, 1e38, 3e25, 1.8e19, 1e-45, -1e-45, 1e-38, 0.0])
VALUES = st.lists(st.one_of(FINITE, EXTREMES), min_size=1, max_size=24)
CASES = [
    ("row", "pow2"),
    ("1x128", "amax"),
    ("128x128", "amax"),
    ("1x128", "pow2"),
    ("mx", "mx_rceil"),
    ("mx", "mx_floor"),
]


def _matrix(values: list[float], seed: int) -> torch.Tensor:
    # The drawn values spread over an 8 x 64 matrix in a drawn order (zeros elsewhere), so
    # blocks see them alone and together.
    flat = torch.zeros(8 * 64, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    at = torch.randperm(8 * 64, generator=gen)[: len(values)]
    flat[at] = torch.tensor(values, dtype=torch.float32)
    return flat.reshape(8, 64)


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=["e4m3", "e5m2"])
@settings(max_examples=25, deadline=None)
@given(values=VALUES, seed=st.integers(0, 2**16))
def test_every_granularity_keeps_finite_values_finite(
    fmt: Fp8Format, values: list[float], seed: int
) -> None:
    x = _matrix(values, seed)
    q, step, _ = tensorwise.quantize_dynamic(x, fmt, 0)
    assert torch.isfinite(step).all() and (step > 0).all()
    assert not torch.isnan(q.to(torch.float32)).any()
    x_hat = tensorwise.dequantize(q, step, torch.float32)
    assert torch.isfinite(x_hat).all()
    for granularity, rule in CASES:
        layout = layout_of(granularity, x.shape)  # type: ignore[arg-type]
        q, scale = blockwise.quantize(x, fmt, layout, rule)  # type: ignore[arg-type]
        steps = blockwise.steps_of_scale(scale)
        assert torch.isfinite(steps).all() and (steps > 0).all(), (granularity, rule)
        assert not torch.isnan(q.to(torch.float32)).any(), (granularity, rule)
        x_hat = blockwise.dequantize(q, scale, layout, torch.float32)
        assert not torch.isnan(x_hat).any(), (granularity, rule)
        assert torch.isfinite(x_hat).all(), (granularity, rule)
        bound = blockwise.expand_steps(steps, layout).double() * fmt.max * (1 + 2**-22)
        fin = torch.isfinite(x_hat)
        assert (x_hat.double().abs()[fin] <= bound[fin]).all(), (granularity, rule)


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("granularity", "rule"), [("row", "pow2"), ("mx", "mx_rceil")])
def test_float32_max_dequantizes_finite_under_power_of_two_steps(
    granularity: str, rule: str, fmt: Fp8Format
) -> None:
    # Found by the property test above: amax 3.4e38 takes step 2**120 in E4M3 (amax / 448
    # rounded up), x / step = 255.8 would round to the code 256, and 256 * 2**120 = 2**128
    # is inf. The step stays the rule's; the code is the largest whose product is finite.
    x = torch.zeros(8, 64)
    x[3, 5], x[4, 7], x[5, 9] = 3.4e38, -3.4e38, torch.finfo(torch.float32).max
    layout = layout_of(granularity, x.shape)  # type: ignore[arg-type]
    q, scale = blockwise.quantize(x, fmt, layout, rule)  # type: ignore[arg-type]
    x_hat = blockwise.dequantize(q, scale, layout, torch.float32)
    assert torch.isfinite(x_hat).all()
    step = float(blockwise.steps_of_scale(scale).reshape(layout.grid)[3, 0])
    assert step == 2.0 ** (120 if fmt is Fp8Format.E4M3 else 113)
    top = 240.0 if fmt is Fp8Format.E4M3 else 28672.0  # the grid value below 256 / 32768
    assert x_hat[3, 5].item() == top * step and x_hat[4, 7].item() == -top * step


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=["e4m3", "e5m2"])
def test_per_tensor_step_past_float32_range_keeps_codes_finite(fmt: Fp8Format) -> None:
    # A delayed step from an older, smaller amax with a margin (or any given step) can
    # exceed FLT_MAX / fmt.max: a value the step quantizes to fmt.max would dequantize to
    # inf. margin 4 with amax 3e38: step 1.07e37, and 3.4e38 / step = 31.7 rounds to 32.
    x = torch.tensor([3.4e38, -3.4e38, 1.0, 0.0, float("inf"), float("nan")])
    for step_value in (2.0**120, 3e38 / (fmt.max / 16), 1e38, 3.4e38):
        step = torch.tensor([step_value])
        q, _ = tensorwise.quantize_with_step(x, fmt, step)
        x_hat = tensorwise.dequantize(q, step, torch.float32)
        assert torch.isfinite(x_hat[:5]).all() and torch.isnan(x_hat[5]), step_value
    q, step, _ = tensorwise.quantize_dynamic(torch.tensor([3.4e38, 3.39e38]), fmt, 4)
    assert torch.isfinite(tensorwise.dequantize(q, step, torch.float32)).all()


@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2], ids=["e4m3", "e5m2"])
def test_code_bound_is_the_largest_finite_grid_value(fmt: Fp8Format) -> None:
    # Exhaustive where it matters: a step's bound is below fmt.max only when it exceeds
    # FLT_MAX / fmt.max, and then FLT_MAX / step rounds onto (or just above) a grid value v
    # only for steps within a few ulps of FLT_MAX / v. For every grid value v >= 1 and the
    # 257 float32 steps around FLT_MAX / v: bound * step is finite, and the next grid value
    # above the bound (when there is one below fmt.max) gives inf.
    codes = torch.arange(0, 128, dtype=torch.uint8).view(fmt.torch).to(torch.float32)
    grid = torch.unique(codes[torch.isfinite(codes)])
    flt_max = torch.finfo(torch.float32).max
    centre = (torch.full_like(grid[grid >= 1], flt_max) / grid[grid >= 1]).view(torch.int32)
    steps = (centre[:, None] + torch.arange(-128, 129, dtype=torch.int32)).view(torch.float32)
    steps = steps.reshape(-1)[torch.isfinite(steps.reshape(-1))]  # past FLT_MAX: not steps
    steps = torch.cat([steps, torch.tensor([flt_max, 2.0**-126, 1.0])])
    bound = tensorwise.code_bound(steps, fmt)
    assert torch.isin(bound, grid).all()
    assert torch.isfinite(bound * steps).all()
    above = grid[torch.searchsorted(grid, bound, right=True).clamp(max=grid.numel() - 1)]
    lower = bound < fmt.max
    assert torch.isinf(above[lower] * steps[lower]).all()
    assert lower.any() and not lower[-2:].any()
