"""``computectx.formats.serving.ServingWeight``: the checked pair of codes and steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from computectx.formats import Recipe, quantize_tensor
from computectx.formats.serving import ServingWeight

LAYOUTS = ["tensor", "row", "128x128", "mx"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_weight_dequantizes_as_quantize_tensor_made_it(layout: str) -> None:
    w = torch.randn(200, 264, generator=torch.Generator().manual_seed(0))
    codes, scale = quantize_tensor(w, "e4m3", granularity=layout)  # type: ignore[arg-type]
    steps = scale.float()  # mx: E8M0 exponents widened, exactly
    if layout == "mx":
        assert torch.equal(
            steps.to(torch.float8_e8m0fnu).view(torch.uint8), scale.view(torch.uint8)
        )
        assert steps.shape == (200, 9)  # a partial last group of 8
    sw = ServingWeight(codes, steps, layout)  # type: ignore[arg-type]
    want = (codes.float() * steps) if layout in ("tensor", "row") else None
    got = sw.dequantize()
    if want is not None:
        assert torch.equal(got, want)
    # Every element within half a code's spacing of w (e4m3: 3 mantissa bits).
    assert ((got - w).abs() <= w.abs() * 2.0**-4 + steps.max() * 2.0**-6).all()
    assert sw.experts is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_experts_are_linears_stacked(layout: str) -> None:
    gen = torch.Generator().manual_seed(1)
    g: Any = layout
    pairs = [
        quantize_tensor(torch.randn(128, 256, generator=gen) * m, "e4m3", granularity=g)
        for m in (1.0, 9.0)
    ]
    codes = torch.stack([c for c, _ in pairs])
    pairs = [(c, s.float()) for c, s in pairs]
    steps = torch.stack([s.reshape(1) if layout == "tensor" else s for _, s in pairs])
    sw = ServingWeight(codes, steps, layout)  # type: ignore[arg-type]
    assert sw.experts == 2
    for e, (c, s) in enumerate(pairs):
        assert torch.equal(sw.dequantize()[e], ServingWeight(c, s, layout).dequantize())  # type: ignore[arg-type]


def test_bad_pairs_are_refused_naming_what_the_layout_takes() -> None:
    codes, steps = quantize_tensor(torch.randn(256, 128), "e4m3", granularity="128x128")
    with pytest.raises(ValueError, match=r"shape \(2, 1\) on cpu, got torch.float32 \(1,\)"):
        ServingWeight(codes, steps.reshape(-1)[:1], "128x128")
    with pytest.raises(
        ValueError, match="layout must be one of tensor, row, 128x128, mx, got '1x128'"
    ):
        ServingWeight(codes, steps, "1x128")
    with pytest.raises(ValueError, match=r"laid out 'mx' must be .* shape \(256, 4\)"):
        ServingWeight(codes, steps, "mx")
    with pytest.raises(ValueError, match=r"granularity 'mx' needs K .* >= 32"):
        ServingWeight(codes[:, :16], torch.ones(256, 1), "mx")
    with pytest.raises(
        ValueError, match=r"float8_e4m3fn or float8_e5m2 tensor, got torch\.bfloat16"
    ):
        ServingWeight(codes.bfloat16(), steps, "128x128")
    with pytest.raises(ValueError, match="must be a float32 tensor"):
        ServingWeight(codes, steps.double(), "128x128")


def test_each_recipe_serves_in_its_forwards_weight_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    from computectx.formats import serving
    from computectx.formats.serving import recipe_layout

    for text, layout in [
        ("e4m3/dynamic/0", "tensor"),
        ("hybrid/row/dynamic/0", "row"),
        ("e4m3/block+pow2/dynamic/0", "128x128"),
        ("e4m3/mx/dynamic/0", "mx"),
        ("e4m3/mx+floor/dynamic/0", "mx"),
    ]:
        assert recipe_layout(Recipe.parse(text)) == layout
    # A granularity with no layout (as the 4-bit recipes will be until a format holds them).
    monkeypatch.delitem(serving.LAYOUT_OF_GRANULARITY, "mx")
    with pytest.raises(ValueError, match=r"recipe 'e4m3/mx/dynamic/0' \(granularity 'mx'\) has no"):
        recipe_layout(Recipe.parse("e4m3/mx/dynamic/0"))


def test_check_fits_names_what_fits_and_what_was_given() -> None:
    codes, steps = quantize_tensor(torch.randn(256, 128), "e4m3", granularity="row")
    sw = ServingWeight(codes, steps, "row")
    sw.check_fits("L", torch.float8_e4m3fn, (256, 128), "row", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^L takes float8_e4m3fn codes of shape \(128, 256\)"):
        sw.check_fits("L", torch.float8_e4m3fn, (128, 256), "row")  # same size, other shape
    with pytest.raises(ValueError, match=r"laid out 'row' on meta; given float8_e4m3fn .* on cpu"):
        sw.check_fits("L", torch.float8_e4m3fn, (256, 128), "row", torch.device("meta"))
    bad = ServingWeight(codes, steps.clone().index_fill_(0, torch.tensor([3]), float("inf")), "row")
    with pytest.raises(
        ValueError, match=r"^L was given 1 step\(s\) that are not finite and positive among 256"
    ):
        bad.check_fits("L", torch.float8_e4m3fn, (256, 128), "row")


@pytest.mark.parametrize("bad", ["zero step", "negative step", "nan code"])
def test_check_fits_refuses_steps_that_zero_or_flip_and_nan_codes(bad: str) -> None:
    # A negative step served the weight sign-flipped, a zero one zeroed it, a NaN code made
    # NaN outputs: all were accepted when only the steps' finiteness was checked.
    codes, steps = quantize_tensor(torch.randn(128, 128), "e4m3", granularity="128x128")
    if bad == "zero step":
        steps = torch.zeros_like(steps)
    elif bad == "negative step":
        steps = -steps
    else:
        codes = codes.clone()
        codes.view(torch.uint8)[5, 7] = 0x7F  # e4m3fn's NaN
    sw = ServingWeight(codes, steps, "128x128")
    what = "non-finite code" if bad == "nan code" else "not finite and positive"
    with pytest.raises(ValueError, match=what):
        sw.check_fits("L", torch.float8_e4m3fn, (128, 128), "128x128")


def test_check_fits_refuses_mx_steps_no_e8m0_byte_holds() -> None:
    codes, scale = quantize_tensor(torch.randn(64, 96), "e4m3", granularity="mx")
    steps = scale.float()
    ServingWeight(codes, steps, "mx").check_fits("L", torch.float8_e4m3fn, (64, 96), "mx")
    # Powers of two at both ends of E8M0's range fit (2**-127 is a float32 subnormal).
    ends = steps.clone()
    ends[0, 0], ends[0, 1] = 2.0**-127, 2.0**127
    # Under a step of 2**127 only codes below 2 in magnitude stay finite in float32.
    small = codes.clone()
    small[0, 32:64] = codes[0, 32:64].float().clamp(-1, 1).to(codes.dtype)
    ServingWeight(small, ends, "mx").check_fits("L", torch.float8_e4m3fn, (64, 96), "mx")
    for bad in (1.5, 2.0**-128, 3.0 * 2.0**-10):
        odd = steps.clone()
        odd[3, 2] = bad
        with pytest.raises(ValueError, match=r"^L was given 1 'mx' step\(s\) that are not powers"):
            ServingWeight(codes, odd, "mx").check_fits("L", torch.float8_e4m3fn, (64, 96), "mx")


@pytest.mark.parametrize(
    ("layout", "step"), [("mx", 2.0**127), ("tensor", 3e38), ("row", 3e38), ("128x128", 3e38)]
)
def test_codes_whose_value_overflows_float32_are_refused_counted(layout: str, step: float) -> None:
    # A valid step (an E8M0 byte of 254 under mx) times a large code is inf in float32.
    g: Any = layout
    codes = torch.full((64, 64), 2.0).to(torch.float8_e4m3fn)
    codes[0, :3] = 448.0
    steps = ServingWeight(codes, torch.ones(_steps_of(layout)), g).steps.clone()
    steps.view(-1)[0] = step
    sw = ServingWeight(codes, steps, g)
    with pytest.raises(ValueError, match=r"was given (\d+) code\(s\) .*overflows float32 to inf"):
        sw.check_fits("w", torch.float8_e4m3fn, (64, 64), g)
    sw.steps.view(-1)[0] = 1.0
    sw.check_fits("w", torch.float8_e4m3fn, (64, 64), g)  # finite again: fits


def _steps_of(layout: str) -> tuple[int, ...]:
    return {"tensor": (1,), "row": (64, 1), "128x128": (1, 1), "mx": (64, 2)}[layout]
