"""The Triton quantize kernel against its pure-torch twin: fp8 bytes bit for bit.

Runs on an fp8 GPU when there is one, else under ``TRITON_INTERPRET=1`` (see conftest).
The twin's own rounding is pinned by tests/formats/numerics/test_tensorwise.py against the fp8
code tables; here every byte the kernel writes must equal the twin's byte, every amax and step must
have the
same float32 bits, and a ledger must hold the same float32 bits after every step.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Literal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from computectx.dtypes import Fp8Format
from computectx.formats import Backend
from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.ledger import (
    LEDGER_NONFINITE,
    LEDGER_SATURATED,
    LEDGER_STEP,
    ledger_history,
    ledger_new,
    ledger_nonfinite,
    ledger_saturated,
    ledger_step,
    ledger_tail,
)
from computectx.formats.ops import tensorwise as tensor_ops

pytestmark = [
    pytest.mark.interpreter,
    # The interpreter evaluates x / step in numpy, which warns on the inf and NaN that the
    # special-value inputs are meant to produce.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

TRITON = Backend.TRITON
REF = Backend.REFERENCE
FORMATS = list(Fp8Format)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
Algo = Literal["max", "most_recent"]
ALGOS: list[Algo] = ["max", "most_recent"]
BAD_ALGO: Any = "mean"  # typed Any so that the launcher's own check runs


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    g, w = got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}"


def assert_same_f32(got: torch.Tensor, want: torch.Tensor) -> None:
    # Bit equality, so NaN == NaN and 0.0 != -0.0.
    assert torch.equal(got.cpu().view(torch.int32), want.cpu().view(torch.int32)), (got, want)


def specials(dtype: torch.dtype) -> torch.Tensor:
    big = min(torch.finfo(dtype).max, 3e38)
    tiny = torch.finfo(dtype).tiny / 4  # a subnormal of the input dtype
    values = [0.0, -0.0, 1.0, -1.0, big, -big, math.inf, -math.inf, tiny, -tiny, 1e-3, 0.5]
    return torch.tensor(values, dtype=torch.float32).to(dtype)


def rounding_probes(fmt: Fp8Format) -> torch.Tensor:
    """Every fp8 grid value, every midpoint between neighbours, and the float32 values one
    ulp either side of each midpoint: where round-to-nearest-even is decided."""
    codes = torch.arange(0, 128, dtype=torch.uint8).view(fmt.torch).to(torch.float32)
    g = codes[torch.isfinite(codes)]
    mid = (g[:-1] + g[1:]) / 2  # exact: one bit below the fp8 mantissa
    up = torch.nextafter(mid, torch.full_like(mid, math.inf))
    down = torch.nextafter(mid, torch.zeros_like(mid))
    beyond = torch.tensor([fmt.max * 1.0625, fmt.max * 1.125, fmt.max * 1.5])
    x = torch.cat([g, mid, up, down, beyond])
    return torch.cat([x, -x])


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_probes_bit_exact(fmt: Fp8Format, device: torch.device) -> None:
    x = rounding_probes(fmt).to(device)
    one = torch.ones(1, device=device)
    q, a = tensor_ops.quantize_with_step(x, fmt, one, backend=TRITON)
    q_ref, a_ref = tensor_ops.quantize_with_step(x, fmt, one, backend=REF)
    assert_same_bytes(q, q_ref)
    assert_same_f32(a, a_ref)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_bit_patterns_bit_exact(fmt: Fp8Format, device: torch.device) -> None:
    # Every float32 bit pattern class: normals of every exponent, subnormals, inf, NaN
    # payloads of both signs, under a step that moves some of them into fp8 range.
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31, (3000,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32).to(device)
    step = torch.tensor([2.0**-100], device=device)
    q, a = tensor_ops.quantize_with_step(x, fmt, step, backend=TRITON)
    q_ref, a_ref = tensor_ops.quantize_with_step(x, fmt, step, backend=REF)
    assert_same_bytes(q, q_ref)
    assert_same_f32(a, a_ref)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (3, 0), (1000,)])
def test_with_step_bit_exact(
    fmt: Fp8Format, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + len(shape))
    x = torch.randn(shape, generator=gen) * 30
    if x.numel() >= len(specials(dtype)):
        x.view(-1)[: len(specials(dtype))] = specials(dtype).float()
    x = x.to(dtype).to(device)
    for step_value in (0.173, 1.0, 3.1e-3):
        step = torch.tensor([step_value], device=device)
        q, a = tensor_ops.quantize_with_step(x, fmt, step, backend=TRITON)
        q_ref, a_ref = tensor_ops.quantize_with_step(x, fmt, step, backend=REF)
        assert_same_bytes(q, q_ref)
        assert_same_f32(a, a_ref)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("kind", ["randn", "zeros", "empty", "nan", "inf", "tiny"])
def test_dynamic_bit_exact(fmt: Fp8Format, margin: int, kind: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(301, generator=gen).to(torch.bfloat16)
    if kind == "zeros":
        x = torch.zeros(17, dtype=torch.bfloat16)
    elif kind == "empty":
        x = torch.empty(0, 4, dtype=torch.bfloat16)
    elif kind == "nan":
        x[100] = math.nan
    elif kind == "inf":
        x[7] = -math.inf
    elif kind == "tiny":  # amax so small that the step underflows: step 1, all zeros
        x = torch.full((9,), 1e-44, dtype=torch.float32)
    x = x.to(device)
    q, step, a = tensor_ops.quantize_dynamic(x, fmt, margin, backend=TRITON)
    q_ref, step_ref, a_ref = tensor_ops.quantize_dynamic(x, fmt, margin, backend=REF)
    assert_same_bytes(q, q_ref)
    assert_same_f32(step, step_ref)
    assert_same_f32(a, a_ref)
    if kind in ("zeros", "empty", "nan", "inf", "tiny"):
        assert step.item() == 1.0


# A quarter of the profile's examples (25 in CI, 500 under HYPOTHESIS_PROFILE=thorough): each
# launches the kernel interpreted; the fixed rounding probes, bit patterns and specials above
# hold the edges whatever the draw.
@settings(max_examples=max(1, settings().max_examples // 4))
@given(
    values=st.lists(st.floats(width=32), min_size=1, max_size=200),
    step=st.floats(min_value=2.0**-30, max_value=2.0**30, width=32),
    fmt=st.sampled_from(FORMATS),
    dtype=st.sampled_from(DTYPES),
)
def test_with_step_property_bit_exact(
    values: list[float], step: float, fmt: Fp8Format, dtype: torch.dtype, device: torch.device
) -> None:
    x = torch.tensor(values, dtype=torch.float32).to(dtype).to(device)
    s = torch.tensor([step], device=device)
    q, a = tensor_ops.quantize_with_step(x, fmt, s, backend=TRITON)
    q_ref, a_ref = tensor_ops.quantize_with_step(x, fmt, s, backend=REF)
    assert_same_bytes(q, q_ref)
    assert_same_f32(a, a_ref)
    v = q.float()
    finite_in = torch.isfinite(x)
    # Saturation: finite (and infinite) inputs never become inf, and stay within ±max.
    assert bool(torch.isfinite(v[~torch.isnan(x)]).all())
    assert bool((v[finite_in].abs() <= fmt.max).all())
    # Normal range: relative error at most half an fp8 ulp, 2**-4 (E4M3) / 2**-3 (E5M2).
    scaled = x.double() / step
    normal = finite_in & (scaled.abs() >= fmt.min_normal) & (scaled.abs() <= fmt.max)
    rel = (v.double() - scaled).abs() / scaled.abs()
    assert bool((rel[normal] <= 2.0 ** -(fmt.mantissa_bits + 1)).all())


# ---------------------------------------------------------------------------------------
# The delayed-scaling ledger, finalized inside the kernel


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize(("history", "margin"), [(1, 0), (4, 2), (21, 1)])
def test_delayed_ledger_bit_exact(
    fmt: Fp8Format, algo: Algo, history: int, margin: int, device: torch.device
) -> None:
    # A sequence with growth (saturation under the delayed step), a zero tensor, an inf,
    # a NaN, a shrink, and an empty tensor; history 21 exceeds the interpreter's reduction
    # block, so the window loop runs more than once.
    ledger = ledger_new(history, device)
    ledger_ref = ledger_new(history, device)
    x0 = torch.randn(50, generator=torch.Generator().manual_seed(0)).to(device)
    tensor_ops.seed_ledger(ledger, x0, fmt, margin)
    tensor_ops.seed_ledger(ledger_ref, x0, fmt, margin)
    gen = torch.Generator().manual_seed(history + margin)
    plan: list[tuple[float, float | None, int]] = [
        (1.0, None, 257),
        (40.0, None, 130),
        (0.0, None, 31),
        (1.0, math.inf, 64),
        (2.0, None, 65),
        (1.0, math.nan, 9),
        (0.01, None, 200),
        (1.0, None, 0),
        (3.0, None, 77),
    ]
    for i, (scale, special, n) in enumerate(plan):
        x = torch.randn(n, generator=gen) * scale
        if special is not None:
            x[n // 2] = special
        x = x.to(torch.bfloat16).to(device)
        idx = i % history
        q, used = tensor_ops.quantize_delayed(x, fmt, ledger, idx, algo, margin, backend=TRITON)
        q_ref, used_ref = tensor_ops.quantize_delayed(
            x, fmt, ledger_ref, idx, algo, margin, backend=REF
        )
        assert_same_bytes(q, q_ref)
        assert_same_f32(used, used_ref)
        assert_same_f32(ledger, ledger_ref)
    assert ledger_nonfinite(ledger).item() == 2.0
    assert ledger_saturated(ledger).item() > 0.0


# A fifth of the profile's examples (20 in CI, 400 under HYPOTHESIS_PROFILE=thorough): each
# launches up to six interpreted kernels; test_delayed_ledger_bit_exact holds the sequences of
# growth, zeros, inf, NaN, shrink and empty tensors at every format, algorithm and history.
@settings(max_examples=max(1, settings().max_examples // 5))
@given(
    scales=st.lists(
        st.sampled_from([0.0, 1e-3, 0.5, 1.0, 7.0, 300.0, 1e5, math.inf, math.nan]),
        min_size=1,
        max_size=6,
    ),
    history=st.integers(1, 5),
    margin=st.integers(0, 4),
    algo=st.sampled_from(ALGOS),
    fmt=st.sampled_from(FORMATS),
)
def test_delayed_ledger_property(
    scales: list[float],
    history: int,
    margin: int,
    algo: Algo,
    fmt: Fp8Format,
    device: torch.device,
) -> None:
    ledger = ledger_new(history, device)
    ledger_ref = ledger_new(history, device)
    gen = torch.Generator().manual_seed(len(scales))
    for i, sc in enumerate(scales):
        x = torch.randn(23, generator=gen) * (sc if math.isfinite(sc) else 1.0)
        if not math.isfinite(sc):
            x[5] = sc
        x = x.to(device)
        q, used = tensor_ops.quantize_delayed(
            x, fmt, ledger, i % history, algo, margin, backend=TRITON
        )
        q_ref, used_ref = tensor_ops.quantize_delayed(
            x, fmt, ledger_ref, i % history, algo, margin, backend=REF
        )
        assert_same_bytes(q, q_ref)
        assert_same_f32(used, used_ref)
        assert_same_f32(ledger, ledger_ref)
    # The ledger's own invariants: the step is positive and finite, the history finite, the
    # non-finite count equals the number of non-finite inputs.
    assert 0.0 < ledger_step(ledger).item() < math.inf
    assert bool(torch.isfinite(ledger_history(ledger)).all())
    assert ledger_nonfinite(ledger).item() == sum(1 for s in scales if not math.isfinite(s))


def test_scratch_is_rezeroed_after_each_launch(device: torch.device) -> None:
    from computectx.kernels import quantize as kq

    x = torch.randn(700, device=device)
    for _ in range(3):
        _, a = tensor_ops.quantize_with_step(
            x, Fp8Format.E4M3, torch.ones(1, device=device), backend=TRITON
        )
        assert a.item() == x.abs().max().item()
        assert kq._scratch(x.device).tolist() == [0, 0, 0]


def test_launcher_rejects_what_it_cannot_read(device: torch.device) -> None:
    from computectx.kernels import quantize as kq

    one = torch.ones(1, device=device)
    x = torch.ones(4, device=device)
    e4m3 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="contiguous"):
        kq.quantize_with_step(x=torch.ones(4, 4, device=device).t(), fp8=e4m3, step=one)
    with pytest.raises(ValueError, match=r"torch\.float64"):
        kq.quantize_with_step(x=x.double(), fp8=e4m3, step=one)
    with pytest.raises(
        ValueError, match=r"step must be a contiguous float32 .* got torch\.float64"
    ):
        kq.quantize_with_step(x=x, fp8=e4m3, step=one.double())
    with pytest.raises(ValueError, match=r"got torch\.float16"):
        kq.quantize_dynamic(x=x, fp8=torch.float16, margin=0)
    layout = {
        "step_offset": LEDGER_STEP,
        "nonfinite_offset": LEDGER_NONFINITE,
        "saturated_offset": LEDGER_SATURATED,
    }
    ledger = ledger_new(2, device)
    with pytest.raises(ValueError, match=r"slot 5 is outside the history \[0, 2\)"):
        kq.quantize_delayed(
            x=x, fp8=e4m3, ledger=ledger, history_len=2, slot=5, algo="max", margin=0, **layout
        )
    with pytest.raises(ValueError, match=r"distinct slots after the history, in \[0, 3\)"):
        kq.quantize_delayed(
            x=x, fp8=e4m3, ledger=ledger, history_len=2, slot=0, algo="max", margin=0,
            step_offset=0, nonfinite_offset=0, saturated_offset=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"in \[0, 2\) for a ledger of 5 with history_len=3"):
        kq.quantize_delayed(
            x=x, fp8=e4m3, ledger=ledger, history_len=3, slot=0, algo="max", margin=0, **layout
        )
    with pytest.raises(ValueError, match="'mean'"):
        kq.quantize_delayed(
            x=x,
            fp8=e4m3,
            ledger=ledger,
            history_len=2,
            slot=0,
            algo=BAD_ALGO,
            margin=0,
            **layout,
        )
    assert torch.equal(ledger, ledger_new(2, device))  # every refusal left the ledger alone


def test_launchers_are_keyword_only(device: torch.device) -> None:
    # Thirteen positional arguments of one type are easy to pass in the wrong order.
    from computectx.kernels import quantize as kq
    from computectx.kernels import scaled_mm as kg

    x, one = torch.ones(4, device=device), torch.ones(1, device=device)
    with pytest.raises(TypeError, match="positional"):
        kq.quantize_with_step(x, torch.float8_e4m3fn, one)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        kq.quantize_dynamic(x, torch.float8_e4m3fn, 0)  # type: ignore[call-arg]
    a = x.reshape(2, 2).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="positional"):
        kg.scaled_mm(a, a, one, one, None, torch.float32)  # type: ignore[call-arg]


@pytest.mark.parametrize("algo", ALGOS)
def test_the_kernel_follows_the_ledger_layout_it_is_given(algo: Algo, device: torch.device) -> None:
    # The offsets reach the kernel as constexpr arguments. Under a permuted layout (counts
    # first, then the step) the kernel must write each value where that layout says: the
    # same ledger as the twin's after un-permuting, bit for bit.
    n, fmt = 3, Fp8Format.E4M3
    ledger_ref = ledger_new(n, device)
    permuted = ledger_new(n, device)
    tail_ref = ledger_tail(ledger_ref)
    tail = ledger_tail(permuted)
    order = {"step_offset": 2, "nonfinite_offset": 0, "saturated_offset": 1}
    tail.copy_(tail_ref[[LEDGER_NONFINITE, LEDGER_SATURATED, LEDGER_STEP]])
    from computectx.kernels import quantize as kq

    gen = torch.Generator().manual_seed(8)
    for i, special in enumerate([None, 40.0, math.inf, None, math.nan, None]):
        x = torch.randn(150, generator=gen)
        if special is not None:
            x[3] = special
        x = x.to(device)
        q_ref, used_ref = tensor_ops.quantize_delayed(
            x, fmt, ledger_ref, i % n, algo, 1, backend=REF
        )
        q, used = kq.quantize_delayed(
            x=x, fp8=fmt.torch, ledger=permuted, history_len=n, slot=i % n, algo=algo, margin=1,
            **order,
        )  # fmt: skip
        assert_same_bytes(q, q_ref)
        assert_same_f32(used, used_ref)
        assert_same_f32(ledger_history(permuted), ledger_history(ledger_ref))
        at = [order["step_offset"], order["nonfinite_offset"], order["saturated_offset"]]
        assert_same_f32(tail[at], tail_ref[[LEDGER_STEP, LEDGER_NONFINITE, LEDGER_SATURATED]])
    assert ledger_nonfinite(ledger_ref).item() == 2.0
    assert ledger_saturated(ledger_ref).item() > 0.0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("margin", [0, 5])
def test_kernel_constants_match_the_format_table(fmt: Fp8Format, margin: int) -> None:
    # The kernels import only torch and triton, so they derive each format's constants from
    # torch.finfo; these must be the numbers computectx.dtypes publishes.
    from computectx.kernels import quantize as kq
    from computectx.kernels.quantize_cast import fp8_constants

    c = fp8_constants(fmt.torch)
    assert fmt.max == c.FMAX
    assert kq._target(fmt.torch, margin) == fmt.max / 2.0**margin
    assert fmt.mantissa_bits == c.MANT
    assert 2 ** (fmt.exponent_bits - 1) - 1 == c.BIAS
    min_normal_bits = struct.unpack("<i", struct.pack("<f", fmt.min_normal))[0]
    assert min_normal_bits == c.MIN_NORMAL_BITS
    assert fmt.min_subnormal * 2.0**23 == c.SUB_MAGIC


def test_reference_twin_matches_on_the_same_call(device: torch.device) -> None:
    # The twin module is what REF dispatches to: a direct call gives the same bytes. (On
    # the device fixture: CPU tensors reach the Triton backend only under the interpreter.)
    x = torch.randn(40, generator=torch.Generator().manual_seed(9)).to(device)
    step = torch.tensor([0.01], device=device)
    q1, _ = tensorwise.quantize_with_step(x, Fp8Format.E5M2, step)
    q2, _ = tensor_ops.quantize_with_step(x, Fp8Format.E5M2, step, backend=TRITON)
    assert_same_bytes(q2, q1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_steps_past_float32_range_bit_exact_and_finite(
    fmt: Fp8Format, device: torch.device
) -> None:
    # Steps above FLT_MAX / fmt.max (a given one, or a dynamic one with a margin) lower the
    # clamp to the largest code whose product with the step is finite, as the twin does.
    flt_max = torch.finfo(torch.float32).max
    x = torch.tensor([3.4e38, -3.4e38, flt_max, 3.39e38, 1.0, 0.0, math.inf, -math.inf])
    x = x.to(device)
    for step_value in (2.0**120, 2.0**113, 1e37, 3.4e38):
        step = torch.tensor([step_value], device=device)
        q, _ = tensor_ops.quantize_with_step(x, fmt, step, backend=TRITON)
        q_ref, _ = tensor_ops.quantize_with_step(x.cpu(), fmt, step.cpu(), backend=REF)
        assert_same_bytes(q, q_ref)
        assert torch.isfinite(tensorwise.dequantize(q.cpu(), step.cpu(), torch.float32)).all()
    q, step, _ = tensor_ops.quantize_dynamic(x[:4], fmt, 4, backend=TRITON)
    q_ref, step_ref, _ = tensor_ops.quantize_dynamic(x[:4].cpu(), fmt, 4, backend=REF)
    assert_same_bytes(q, q_ref)
    assert_same_f32(step, step_ref)
    assert torch.isfinite(tensorwise.dequantize(q.cpu(), step.cpu(), torch.float32)).all()
