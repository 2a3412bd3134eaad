"""Fine-grained scaling (``quantize_tensor(..., granularity=)``) on the pure-torch twins.

The twins (``computectx.formats.numerics.blockwise``) are checked against an independent model:
every
block cut out by hand, its step computed in plain Python (``math.frexp`` for the powers of
two and the E8M0 exponents), and the block quantized by the per-tensor twin, which
tests/formats/numerics/test_tensorwise.py pins to the fp8 code tables. They then serve as the
oracle for the Triton kernels (tests/kernels/test_quantize_blocks.py).
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from computectx.dtypes import Fp8Format
from computectx.formats import Backend, dequantize_tensor, quantize_tensor
from computectx.formats.numerics import blockwise, layouts, tensorwise
from computectx.formats.numerics.layouts import Granularity, MxRounding
from computectx.formats.ops import blockwise as block_ops
from computectx.formats.ops import tensorwise as tensor_ops

REF = Backend.REFERENCE
FORMATS = list(Fp8Format)
# Every option set of the block granularities, (granularity, power_of_two, mx_rounding),
# and the step rule the docs give it.
RULE_OF: dict[tuple[Granularity, bool | None, MxRounding | None], str] = {
    ("row", None, None): "pow2",  # row-wise steps are powers of two by default
    ("row", False, None): "amax",
    ("1x128", None, None): "amax",
    ("1x128", True, None): "pow2",
    ("128x128", None, None): "amax",
    ("128x128", True, None): "pow2",
    ("mx", None, None): "mx_rceil",  # MX rounds up by default
    ("mx", None, "floor"): "mx_floor",
}
OPTIONS = list(RULE_OF)
BAD: Any = "ROW"  # typed Any so that the run-time checks run


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


# ---------------------------------------------------------------------------------------
# The independent model of one block's step.


def ceil_log2(q: float) -> int:
    m, e = math.frexp(q)  # q = m * 2**e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def model_step(amax: float, fmt: Fp8Format, rule: str) -> float:
    if not (math.isfinite(amax) and amax > 0):
        return 1.0
    q = float(torch.tensor([amax]) / torch.tensor([fmt.max]))  # one float32 division
    if rule in ("amax", "pow2"):
        if q == 0.0:
            return 1.0
        q = max(q, 2.0**-126)  # a subnormal step is raised to the smallest normal
        return q if rule == "amax" else 2.0 ** ceil_log2(q)
    emax = math.floor(math.log2(fmt.max))
    e = ceil_log2(q) if (rule == "mx_rceil" and q > 0) else -200
    if rule == "mx_floor":
        e = math.frexp(amax)[1] - 1 - emax
    return 2.0 ** min(max(e, -127), 127)


def model_quantize(
    x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int], rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: the step from the model, the codes from the per-tensor twin."""
    rows, cols = x.shape
    br, bc = block
    n_r, n_c = -(-rows // br), -(-cols // bc)
    q = torch.empty(rows, cols, dtype=fmt.torch)
    steps = torch.empty(n_r, n_c, dtype=torch.float32)
    for i in range(n_r):
        for j in range(n_c):
            part = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            a = part.double().abs()
            amax = math.nan if bool(a.isnan().any()) else float(a.max())
            step = model_step(amax, fmt, rule)
            steps[i, j] = step
            qb, _ = tensorwise.quantize_with_step(part, fmt, torch.tensor([step]))
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = qb
    return q, steps


def hard_data(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows of magnitudes 1e-30 .. 1e30, a subnormal row, a zero row, a NaN, ±inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x *= 10.0 ** (torch.rand(rows, 1, generator=gen) * 60 - 30)
    x[0] = torch.randn(cols, generator=gen) * 1e-39  # subnormal float32 amax
    x[1] = 0.0
    x[2, 5] = math.nan
    x[3, cols - 1] = math.inf
    x[4, 0] = -math.inf
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("granularity", "power_of_two", "mx_rounding"), OPTIONS)
def test_twin_matches_the_block_by_block_model(
    fmt: Fp8Format,
    granularity: Granularity,
    power_of_two: bool | None,
    mx_rounding: MxRounding | None,
) -> None:
    shape = (260, 300) if granularity == "128x128" else (23, 200)
    x = hard_data(*shape, seed=len(granularity))
    data, scale = quantize_tensor(
        x, fmt, granularity=granularity, power_of_two=power_of_two, mx_rounding=mx_rounding
    )
    layout = layouts.layout_of(granularity, x.shape)
    rule = RULE_OF[(granularity, power_of_two, mx_rounding)]
    q_model, steps_model = model_quantize(x, fmt, (layout.block_rows, layout.block_cols), rule)
    assert same_bytes(data, q_model)
    assert torch.equal(blockwise.steps_of_scale(scale).reshape(layout.grid), steps_model)


def test_the_model_sees_what_it_should() -> None:
    # Spot checks of the model itself: E4M3, amax 448 * 1.5 = 672.
    assert model_step(672.0, Fp8Format.E4M3, "amax") == 1.5
    assert model_step(672.0, Fp8Format.E4M3, "pow2") == 2.0
    assert model_step(672.0, Fp8Format.E4M3, "mx_rceil") == 2.0
    assert model_step(672.0, Fp8Format.E4M3, "mx_floor") == 2.0  # floor(log2 672) - 8 = 1
    assert model_step(500.0, Fp8Format.E4M3, "mx_floor") == 1.0  # 500 > 448 saturates
    assert model_step(500.0, Fp8Format.E4M3, "mx_rceil") == 2.0  # 500 / 2 = 250 does not
    assert model_step(1000.0, Fp8Format.E4M3, "mx_floor") == 2.0
    assert model_step(1e-40, Fp8Format.E4M3, "mx_rceil") == 2.0**-127
    assert model_step(1e-40, Fp8Format.E4M3, "amax") == 2.0**-126
    assert model_step(1e-44, Fp8Format.E4M3, "amax") == 1.0  # 1e-44 / 448 underflows
    assert model_step(math.nan, Fp8Format.E4M3, "mx_floor") == 1.0


# ---------------------------------------------------------------------------------------
# Layouts, shapes, dtypes


@pytest.mark.parametrize(
    ("shape", "granularity", "scale_shape"),
    [
        ((256, 1024), "row", (256, 1)),
        ((256, 1024), "1x128", (256, 8)),
        ((256, 1024), "128x128", (2, 8)),
        ((256, 1024), "mx", (256, 32)),
        ((130, 257), "1x128", (130, 3)),  # ragged K: a partial last block
        ((130, 257), "128x128", (2, 3)),  # ragged rows and K
        ((130, 40), "mx", (130, 2)),
        ((2, 3, 64), "row", (2, 3, 1)),  # leading dimensions are kept
        ((2, 3, 64), "1x128", (2, 3, 1)),
        ((2, 3, 64), "mx", (2, 3, 2)),
        ((0, 64), "1x128", (0, 1)),
        ((4, 0), "row", (4, 1)),
        ((4, 0), "1x128", (4, 0)),
    ],
)
def test_scale_shapes_are_the_documented_ones(
    shape: tuple[int, ...], granularity: Granularity, scale_shape: tuple[int, ...]
) -> None:
    x = torch.randn(shape)
    data, scale = quantize_tensor(x, "e4m3", granularity=granularity)
    assert data.shape == x.shape and data.dtype == torch.float8_e4m3fn and data.is_contiguous()
    assert tuple(scale.shape) == scale_shape
    want = torch.float8_e8m0fnu if granularity == "mx" else torch.float32
    assert scale.dtype == want
    if granularity == "row" and shape[-1] == 0:
        assert bool((scale == 1.0).all())  # nothing measured: step 1
    back = dequantize_tensor(data, scale, torch.float32)
    assert back.shape == x.shape


def test_leading_dimensions_are_rows() -> None:
    x = torch.randn(2, 3, 96)
    for g in ("row", "1x128", "mx"):
        data, scale = quantize_tensor(x, "e4m3", granularity=g)
        flat_data, flat_scale = quantize_tensor(x.reshape(6, 96), "e4m3", granularity=g)
        assert same_bytes(data.reshape(6, 96), flat_data)
        assert same_bytes(scale.reshape(flat_scale.shape), flat_scale)


@pytest.mark.parametrize(
    ("shape", "granularity", "needles"),
    [
        ((7,), "row", ["(7,)", "'row'"]),
        ((7,), "1x128", ["(7,)", "'1x128'"]),
        ((7,), "128x128", ["(7,)", "'128x128'"]),
        ((64,), "mx", ["(64,)", "'mx'"]),
        ((), "row", ["()", "'row'"]),
        ((2, 3, 4), "128x128", ["(2, 3, 4)", "'128x128'"]),
        ((4, 31), "mx", ["(4, 31)", "'mx'", "32"]),
        ((4, 0), "mx", ["(4, 0)", "'mx'"]),
    ],
)
def test_shapes_a_granularity_cannot_serve_are_refused(
    shape: tuple[int, ...], granularity: Granularity, needles: list[str]
) -> None:
    with pytest.raises(ValueError, match=re.escape(needles[0])) as err:
        quantize_tensor(torch.ones(shape), "e4m3", granularity=granularity)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"granularity": BAD}, ValueError, "'ROW'"),
        ({"granularity": "mx", "power_of_two": False}, ValueError, "power_of_two=False"),
        ({"granularity": "row", "mx_rounding": "floor"}, ValueError, "'row'"),
        ({"granularity": "mx", "mx_rounding": BAD}, ValueError, "'ROW'"),
        ({"granularity": "row", "power_of_two": BAD}, TypeError, "'ROW'"),
        ({"granularity": "tensor", "mx_rounding": "rceil"}, ValueError, "'tensor'"),
        (
            {"granularity": "row", "scale": torch.ones(4, 1), "power_of_two": True},
            ValueError,
            "as is",
        ),
        ({"granularity": "row", "scale": 0.5}, TypeError, "(4, 1)"),
        ({"granularity": "row", "scale": torch.ones(4)}, ValueError, "(4, 1)"),
        (
            {"granularity": "1x128", "scale": torch.ones(4, 1, dtype=torch.float64)},
            ValueError,
            "float64",
        ),
        ({"granularity": "mx", "scale": torch.ones(4, 2)}, ValueError, "float8_e8m0fnu"),
    ],
)
def test_options_are_checked(kwargs: dict[str, Any], exc: type[Exception], needle: str) -> None:
    with pytest.raises(exc) as err:
        quantize_tensor(torch.ones(4, 64), "e4m3", **kwargs)
    assert needle in str(err.value), str(err.value)


def test_dequantize_refuses_a_scale_of_no_granularity() -> None:
    data, _ = quantize_tensor(torch.randn(4, 256), "e4m3", granularity="1x128")
    with pytest.raises(ValueError, match=r"\(4, 3\).*\(4, 256\).*1x128: torch.float32 \(4, 2\)"):
        dequantize_tensor(data, torch.ones(4, 3), torch.float32)
    e8m0 = torch.full((4, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"mx: torch.float8_e8m0fnu \(4, 8\)"):
        dequantize_tensor(data, e8m0, torch.float32)


# ---------------------------------------------------------------------------------------
# Semantics


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_granularity_is_todays_fp8_quantize(fmt: Fp8Format, dtype: torch.dtype) -> None:
    x = (torch.randn(33, 70, generator=torch.Generator().manual_seed(3)) * 7).to(dtype)
    q, step, _ = tensor_ops.quantize_dynamic(x, fmt, 0, backend=REF)
    for data, scale in (quantize_tensor(x, fmt), quantize_tensor(x, fmt, granularity="tensor")):
        assert same_bytes(data, q) and torch.equal(scale, step) and scale.shape == (1,)
    # power_of_two=True: the smallest power of two >= the dynamic step.
    data, scale = quantize_tensor(x, fmt, granularity="tensor", power_of_two=True)
    assert scale.item() == 2.0 ** ceil_log2(step.item())
    assert same_bytes(data, tensorwise.quantize_with_step(x, fmt, scale)[0])


@pytest.mark.parametrize(("granularity", "power_of_two", "mx_rounding"), OPTIONS)
def test_a_given_scale_is_used_as_is(
    granularity: Granularity, power_of_two: bool | None, mx_rounding: MxRounding | None
) -> None:
    x = torch.randn(140, 300, generator=torch.Generator().manual_seed(4))
    data, scale = quantize_tensor(
        x, "e4m3", granularity=granularity, power_of_two=power_of_two, mx_rounding=mx_rounding
    )
    again, same = quantize_tensor(x, "e4m3", scale, granularity=granularity)
    assert same is scale and same_bytes(again, data)
    # Twice the steps: every code changes (up to rounding), so the scale was read.
    doubled = (
        blockwise.e8m0_of_steps(2 * blockwise.steps_of_scale(scale))
        if granularity == "mx"
        else 2 * scale
    )
    half, _ = quantize_tensor(x, "e4m3", doubled, granularity=granularity)
    assert not same_bytes(half, data)


@pytest.mark.parametrize(("granularity", "power_of_two", "mx_rounding"), OPTIONS)
def test_steps_follow_the_rule(
    granularity: Granularity, power_of_two: bool | None, mx_rounding: MxRounding | None
) -> None:
    x = torch.randn(130, 300, generator=torch.Generator().manual_seed(5)) * 3
    _, scale = quantize_tensor(
        x, "e4m3", granularity=granularity, power_of_two=power_of_two, mx_rounding=mx_rounding
    )
    steps = blockwise.steps_of_scale(scale)
    pow2 = bool((torch.frexp(steps).mantissa == 0.5).all())
    assert pow2 == (RULE_OF[(granularity, power_of_two, mx_rounding)] != "amax")


@pytest.mark.parametrize(("granularity", "power_of_two", "mx_rounding"), OPTIONS)
def test_dequantize_is_within_half_an_ulp_of_each_block(
    granularity: Granularity, power_of_two: bool | None, mx_rounding: MxRounding | None
) -> None:
    fmt = Fp8Format.E4M3
    x = torch.randn(130, 300, generator=torch.Generator().manual_seed(6))
    x *= 10.0 ** torch.randint(-3, 4, (130, 1)).float()
    data, scale = quantize_tensor(
        x, fmt, granularity=granularity, power_of_two=power_of_two, mx_rounding=mx_rounding
    )
    back = dequantize_tensor(data, scale, torch.float32)
    layout = layouts.layout_of(granularity, x.shape)
    step = blockwise.expand_steps(blockwise.steps_of_scale(scale).reshape(layout.grid), layout)
    assert torch.equal(back, data.float() * step)
    err = (back.double() - x.double()).abs()
    bound = x.double().abs() * 2.0**-4 + step.double() * fmt.min_subnormal / 2
    # Beyond fmt.max * step an element saturates: by a float32 rounding of amax / fmt.max
    # under every rule but OCP's floor, which maps a block's amax below 2**(emax + 1) = 512.
    excess = (x.double().abs() - fmt.max * step.double()).clamp(min=0)
    assert bool((err <= bound + excess).all())
    top = 512.0 if mx_rounding == "floor" else fmt.max * (1 + 2.0**-23)
    assert bool((x.abs() < top * step).all())
    if mx_rounding == "floor":
        assert bool((excess > 0).any())  # and it does saturate some


@pytest.mark.parametrize(("granularity", "power_of_two", "mx_rounding"), OPTIONS)
def test_a_non_finite_block_is_confined_to_itself(
    granularity: Granularity, power_of_two: bool | None, mx_rounding: MxRounding | None
) -> None:
    fmt = Fp8Format.E4M3
    x = torch.randn(140, 300, generator=torch.Generator().manual_seed(7)) * 1e-3
    kw: dict[str, Any] = {
        "granularity": granularity,
        "power_of_two": power_of_two,
        "mx_rounding": mx_rounding,
    }
    clean_data, clean_scale = quantize_tensor(x, fmt, **kw)
    bad = x.clone()
    bad[5, 7], bad[5, 9], bad[5, 11] = math.nan, math.inf, -math.inf
    data, scale = quantize_tensor(bad, fmt, **kw)
    layout = layouts.layout_of(granularity, x.shape)
    hit = torch.zeros(layout.grid, dtype=torch.bool)
    hit[5 // layout.block_rows, 7 // layout.block_cols] = True
    steps = blockwise.steps_of_scale(scale).reshape(layout.grid)
    clean_steps = blockwise.steps_of_scale(clean_scale).reshape(layout.grid)
    assert bool((steps[hit] == 1.0).all())  # the per-tensor rule, for that block alone
    assert torch.equal(steps[~hit], clean_steps[~hit])
    in_block = blockwise.expand_steps(hit.float(), layout).bool()
    assert torch.equal(data.view(torch.uint8)[~in_block], clean_data.view(torch.uint8)[~in_block])
    codes = data[5, 7:12:2].float().tolist()
    assert math.isnan(codes[0]) and codes[1:] == [fmt.max, -fmt.max]
    # The block's finite elements are quantized with step 1.
    assert same_bytes(
        data[5, 8:9], tensorwise.quantize_with_step(bad[5, 8:9], fmt, torch.ones(1))[0]
    )


def test_columnwise_is_the_quantize_of_the_transpose() -> None:
    x = torch.randn(70, 260, generator=torch.Generator().manual_seed(8))
    for g, pow2, mx in OPTIONS:
        got = block_ops.quantize_granular(
            x, "e4m3", g, power_of_two=pow2, mx_rounding=mx, columnwise=True, backend=REF
        )
        want = quantize_tensor(
            x.t().contiguous(), "e4m3", granularity=g, power_of_two=pow2, mx_rounding=mx
        )
        assert got[0].shape == (260, 70) and got[0].is_contiguous()
        assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    with pytest.raises(ValueError, match=r"2-D.*\(2, 3, 4\)"):
        block_ops.quantize_granular(
            torch.ones(2, 3, 4), "e4m3", "row", columnwise=True, backend=REF
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_quantize_as_their_float32_values(dtype: torch.dtype) -> None:
    x = (torch.randn(40, 200, generator=torch.Generator().manual_seed(9)) * 50).to(dtype)
    for g, pow2, mx in OPTIONS:
        a = quantize_tensor(x, "e5m2", granularity=g, power_of_two=pow2, mx_rounding=mx)
        b = quantize_tensor(x.float(), "e5m2", granularity=g, power_of_two=pow2, mx_rounding=mx)
        assert same_bytes(a[0], b[0]) and same_bytes(a[1], b[1])


def test_power_of_two_and_e8m0_helpers_are_exact() -> None:
    # Every power of two float32 holds, and one ulp either side of each.
    e = torch.arange(-149, 128, dtype=torch.int32)
    p = torch.tensor([2.0**k for k in range(-149, 128)], dtype=torch.float32)
    assert torch.equal(blockwise.power_of_two_steps(p), p)
    up = torch.nextafter(p, torch.full_like(p, math.inf))[:-1]
    assert torch.equal(blockwise.power_of_two_steps(up), p[1:])
    # One ulp below (2**-149 and 2**-148 are one and two ulps above zero: skipped).
    down = torch.nextafter(p[2:], torch.zeros_like(p[2:]))
    assert torch.equal(blockwise.power_of_two_steps(down), p[2:])
    e8 = p[e >= -127]
    assert torch.equal(blockwise.steps_of_scale(blockwise.e8m0_of_steps(e8)), e8)
