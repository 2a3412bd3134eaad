"""The pure-torch twins (``computectx.formats.numerics.tensorwise``): scale convention, rounding,
saturation, the ledger, the GEMM.

These tests check the pure-torch twins against independent models (float64 arithmetic,
plain-Python ledger bookkeeping, the fp8 code tables), so that the twins can then serve as
the oracle for the Triton kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from computectx.dtypes import Fp8Format
from computectx.formats import Backend
from computectx.formats.numerics import blockwise, tensorwise
from computectx.formats.numerics.ledger import (
    ledger_history,
    ledger_new,
    ledger_nonfinite,
    ledger_saturated,
    ledger_step,
)
from computectx.formats.ops import tensorwise as tensor_ops

REF = Backend.REFERENCE
FORMATS = list(Fp8Format)


def grid(fmt: Fp8Format) -> torch.Tensor:
    """Every finite non-negative fp8 value of ``fmt``, ascending, as float64."""
    codes = torch.arange(0, 128, dtype=torch.uint8).view(fmt.torch).to(torch.float64)
    finite = codes[torch.isfinite(codes)]
    return torch.sort(finite).values


def step1() -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# The scale convention


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("margin", [0, 1, 3])
def test_step_is_amax_over_max_over_two_to_the_margin(fmt: Fp8Format, margin: int) -> None:
    a = torch.tensor([3.7], dtype=torch.float32)
    step = tensorwise.step_from_amax(a, fmt, margin)
    expected = torch.tensor([3.7], dtype=torch.float32) / (fmt.max / 2**margin)
    assert step.dtype == torch.float32
    assert torch.equal(step, expected)
    # The amax lands exactly on fmt.max / 2**margin, a value of the fp8 grid: a / step is
    # within a float32 rounding of it, far inside half an fp8 ulp. That is the headroom the
    # margin promises.
    q, _ = tensorwise.quantize_with_step(a, fmt, step)
    assert q.to(torch.float64).item() == fmt.max / 2**margin


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("-inf"), float("nan"), 1e-44])
def test_degenerate_amax_gives_step_one(bad: float) -> None:
    # 1e-44 is a positive float32 subnormal whose step (1e-44 / 448) underflows to zero.
    step = tensorwise.step_from_amax(torch.tensor([bad]), Fp8Format.E4M3, 0)
    assert step.item() == 1.0


# ---------------------------------------------------------------------------------------
# Rounding and saturation of quantize


@pytest.mark.parametrize("fmt", FORMATS)
def test_grid_values_quantize_exactly(fmt: Fp8Format) -> None:
    g = grid(fmt)
    x = torch.cat([g, -g]).to(torch.float32)
    q, a = tensorwise.quantize_with_step(x, fmt, step1())
    assert torch.equal(q.to(torch.float32), x)
    assert a.item() == fmt.max


@pytest.mark.parametrize("fmt", FORMATS)
def test_midpoints_round_to_even(fmt: Fp8Format) -> None:
    g = grid(fmt)
    mid = (g[:-1] + g[1:]) / 2  # exact in float32: one bit below the fp8 mantissa
    codes = torch.arange(0, len(g), dtype=torch.int64)
    # Consecutive grid values alternate even/odd code; the even neighbour's value wins.
    lo_even = (codes[:-1] % 2) == 0
    expected = torch.where(lo_even, g[:-1], g[1:])
    q, _ = tensorwise.quantize_with_step(mid.to(torch.float32), fmt, step1())
    assert torch.equal(q.to(torch.float64), expected)
    qn, _ = tensorwise.quantize_with_step(-mid.to(torch.float32), fmt, step1())
    assert torch.equal(qn.to(torch.float64), -expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_saturates_at_max_and_keeps_nan(fmt: Fp8Format, dtype: torch.dtype) -> None:
    big = min(torch.finfo(dtype).max, 1e30)
    x = torch.tensor([big, -big, math.inf, -math.inf, -math.nan, 0.0, -0.0], dtype=dtype)
    q, a = tensorwise.quantize_with_step(x, fmt, step1())
    v = q.to(torch.float32)
    assert v[:4].tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max]
    assert math.isnan(v[4].item())
    assert q.view(torch.uint8)[4].item() == 0x7F  # the one canonical NaN byte
    assert v[5].item() == 0.0
    # -0.0 keeps its sign bit: the byte pattern of fp8 negative zero is 0x80.
    assert q.view(torch.uint8)[6].item() == 0x80
    assert math.isnan(a.item())  # a NaN input makes the amax NaN, so callers can count it
    n_sat = tensorwise.saturated_count(x, step1(), fmt)
    assert n_sat.item() == 4.0


def test_zero_and_empty_tensors() -> None:
    z = torch.zeros(5, 3, dtype=torch.bfloat16)
    q, step, a = tensorwise.quantize_dynamic(z, Fp8Format.E4M3, 0)
    assert step.item() == 1.0
    assert a.item() == 0.0
    assert torch.equal(q.view(torch.uint8), torch.zeros(5, 3, dtype=torch.uint8))
    e = torch.empty(0, 7, dtype=torch.float16)
    q, step, a = tensorwise.quantize_dynamic(e, Fp8Format.E5M2, 2)
    assert q.shape == (0, 7)
    assert q.dtype == torch.float8_e5m2
    assert (step.item(), a.item()) == (1.0, 0.0)


def _normal_range_values(fmt: Fp8Format) -> st.SearchStrategy[list[float]]:
    return st.lists(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), min_size=1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("margin", [0, 2])
@given(data=st.data())
def test_relative_error_in_normal_range(fmt: Fp8Format, margin: int, data: st.DataObject) -> None:
    values = data.draw(_normal_range_values(fmt))
    x = torch.tensor(values, dtype=torch.float32)
    q, step, _ = tensorwise.quantize_dynamic(x, fmt, margin)
    x_hat = q.to(torch.float64) * step.to(torch.float64)
    scaled = x.to(torch.float64) / step.to(torch.float64)
    normal = scaled.abs() >= fmt.min_normal
    bound = 2.0 ** -(fmt.mantissa_bits + 1)  # half an ulp: 2**-4 (E4M3), 2**-3 (E5M2)
    rel = (x_hat - x.to(torch.float64)).abs() / x.to(torch.float64).abs()
    assert bool((rel[normal] <= bound).all()), rel[normal].max()
    # Below the normal range the error is at most half the smallest subnormal step, plus
    # the float32 rounding of x / step (half a float32 ulp of a value below min_normal,
    # at most min_normal * 2**-24) carried back through the step.
    absolute = (x_hat - x.to(torch.float64)).abs()
    s64 = step.to(torch.float64)
    sub_bound = (fmt.min_subnormal / 2 + fmt.min_normal * 2.0**-24) * s64
    assert bool((absolute[~normal] <= sub_bound).all())
    assert bool(torch.isfinite(q.to(torch.float32)).all())


@pytest.mark.parametrize("fmt", FORMATS)
@given(
    values=st.lists(st.floats(allow_nan=False, allow_infinity=True, width=32), min_size=1),
    step=st.floats(min_value=2.0**-20, max_value=2.0**20, width=32),
)
def test_never_infinite_for_any_finite_step(
    fmt: Fp8Format, values: list[float], step: float
) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    q, _ = tensorwise.quantize_with_step(x, fmt, torch.tensor([step]))
    v = q.to(torch.float32)
    assert bool(torch.isfinite(v).all())
    assert bool((v.abs() <= fmt.max).all())


# ---------------------------------------------------------------------------------------
# The delayed-scaling ledger against a plain-Python model


class LedgerModel:
    """The ledger semantics written out with Python floats (rounded through float32)."""

    def __init__(self, n: int) -> None:
        self.hist = [0.0] * n
        self.step = 1.0
        self.nonfinite = 0.0
        self.saturated = 0.0

    @staticmethod
    def f32(v: float) -> float:
        return torch.tensor(v, dtype=torch.float32).item()

    def step_of(self, a: float, fmt: Fp8Format, margin: int) -> float:
        s = self.f32(a / (fmt.max / 2**margin))
        return s if math.isfinite(a) and s > 0 else 1.0

    def update(self, x: torch.Tensor, fmt: Fp8Format, idx: int, algo: str, margin: int) -> None:
        xs = x.to(torch.float64).flatten().tolist()
        a = max((abs(v) for v in xs), default=0.0)
        if any(math.isnan(v) for v in xs):
            a = math.nan
        self.saturated += sum(1 for v in xs if abs(self.f32(v / self.step)) > fmt.max)
        if not math.isfinite(a):
            self.nonfinite += 1
            return
        self.hist[idx] = self.f32(a)
        window = max(self.hist) if algo == "max" else self.f32(a)
        self.step = self.step_of(window, fmt, margin)

    def matches(self, ledger: torch.Tensor) -> bool:
        """Whether every field of ``ledger`` holds this model's value, bit for bit."""
        return (
            torch.equal(ledger_history(ledger), torch.tensor(self.hist))
            and torch.equal(ledger_step(ledger), torch.tensor([self.step]))
            and torch.equal(ledger_nonfinite(ledger), torch.tensor([self.nonfinite]))
            and torch.equal(ledger_saturated(ledger), torch.tensor([self.saturated]))
        )


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_ledger_follows_model(algo: str, margin: int) -> None:
    n = 4
    fmt = Fp8Format.E4M3
    ledger = ledger_new(n, "cpu")
    model = LedgerModel(n)
    gen = torch.Generator().manual_seed(7)
    scales = [1.0, 30.0, 0.5, 0.0, 2.0, math.inf, 0.25, math.nan, 8.0, 1.0, 0.1]
    for i, sc in enumerate(scales):
        x = torch.randn(37, generator=gen) * (sc if math.isfinite(sc) else 1.0)
        if not math.isfinite(sc):
            x[3] = sc
        step_before = ledger_step(ledger).clone()
        q, used = tensor_ops.quantize_delayed(x, fmt, ledger, i % n, algo, margin, backend=REF)  # type: ignore[arg-type]
        assert torch.equal(used, step_before)
        expected_q, _ = tensorwise.quantize_with_step(x, fmt, step_before)
        assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
        model.update(x, fmt, i % n, algo, margin)
        assert model.matches(ledger), (i, ledger, model.__dict__)
    assert ledger_nonfinite(ledger).item() == 2.0
    assert ledger_saturated(ledger).item() > 0.0


def test_window_max_and_most_recent_differ() -> None:
    fmt = Fp8Format.E5M2
    for algo, expected_amax in (("max", 100.0), ("most_recent", 1.0)):
        ledger = ledger_new(3, "cpu")
        tensor_ops.quantize_delayed(torch.tensor([100.0]), fmt, ledger, 0, algo, 0, backend=REF)  # type: ignore[arg-type]
        tensor_ops.quantize_delayed(torch.tensor([1.0]), fmt, ledger, 1, algo, 0, backend=REF)  # type: ignore[arg-type]
        # One float32 division, so the step is exactly that quotient.
        assert torch.equal(ledger_step(ledger), torch.tensor([expected_amax]) / fmt.max)


def test_zero_amax_step_is_one_and_nonfinite_keeps_state() -> None:
    ledger = ledger_new(2, "cpu")
    tensor_ops.seed_ledger(ledger, torch.tensor([4.0, -8.0]), Fp8Format.E4M3, 1)
    assert ledger_history(ledger).tolist() == [8.0, 8.0]
    # One float32 division of the amax by 448 / 2**margin, exactly.
    assert torch.equal(ledger_step(ledger), torch.tensor([8.0]) / (448 / 2))
    tensor_ops.quantize_delayed(
        torch.zeros(3), Fp8Format.E4M3, ledger, 0, "most_recent", 1, backend=REF
    )
    assert ledger_step(ledger).item() == 1.0
    before = ledger.clone()
    x = torch.tensor([1.0, math.nan])
    tensor_ops.quantize_delayed(x, Fp8Format.E4M3, ledger, 1, "max", 1, backend=REF)
    assert torch.equal(ledger_history(ledger), ledger_history(before))
    assert torch.equal(ledger_step(ledger), ledger_step(before))
    assert ledger_nonfinite(ledger).item() == ledger_nonfinite(before).item() + 1


def test_seed_with_nonfinite_keeps_the_ledger_and_counts_nothing() -> None:
    # The quantize of the same call counts the non-finite amax, once (docs/fp8.md).
    ledger = ledger_new(3, "cpu")
    tensor_ops.seed_ledger(ledger, torch.tensor([1.0, math.inf]), Fp8Format.E4M3, 0)
    assert ledger_history(ledger).tolist() == [0.0, 0.0, 0.0]
    assert (ledger_step(ledger).item(), ledger_nonfinite(ledger).item()) == (1.0, 0.0)
    assert ledger_saturated(ledger).item() == 0.0


def test_saturated_count_accumulates() -> None:
    ledger = ledger_new(1, "cpu")
    x = torch.tensor([500.0, -449.0, 448.0, 3.0])  # step 1: two beyond E4M3's 448
    tensor_ops.quantize_delayed(x, Fp8Format.E4M3, ledger, 0, "max", 0, backend=REF)
    tensor_ops.quantize_delayed(x, Fp8Format.E4M3, ledger, 0, "max", 0, backend=REF)
    assert ledger_saturated(ledger).item() == 2.0  # second call uses step 500/448


# ---------------------------------------------------------------------------------------
# The scaled GEMM against float64


def random_fp8(shape: tuple[int, int], fmt: Fp8Format, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen) * 4
    return x.clamp(-fmt.max, fmt.max).to(fmt.torch)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("fa", "fb"), [(Fp8Format.E4M3, Fp8Format.E4M3), (Fp8Format.E5M2, Fp8Format.E4M3)]
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_within_derived_bound(
    out_dtype: torch.dtype, fa: Fp8Format, fb: Fp8Format, transposed: bool, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(3)
    m, n, k = 13, 9, 37
    a = random_fp8((m, k), fa, gen)
    b = random_fp8((n, k), fb, gen)
    if transposed:  # same values, column-major storage: the .t() views dgrad/wgrad pass
        a = a.t().contiguous().t()
        b = b.t().contiguous().t()
    sa = torch.tensor([0.37])
    sb = torch.tensor([1.9e-3])
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    out = tensor_ops.scaled_mm(a, b, sa, sb, bias, out_dtype, backend=REF)
    assert out.dtype == out_dtype
    assert out.shape == (m, n)
    # The steps as the GEMM sees them: float32 values, multiplied exactly in float64.
    exact = (a.to(torch.float64) @ b.to(torch.float64).t()) * (sa.double() * sb.double())
    if bias is not None:
        exact = exact + bias.to(torch.float64)
    bound = tensorwise.scaled_mm_error_bound(tensorwise.GemmArgs(a, b, sa, sb, bias, out_dtype))
    err = (out.to(torch.float64) - exact).abs()
    assert bool((err <= bound).all()), (err - bound).max()


@given(
    m=st.integers(1, 9),
    n=st.integers(1, 9),
    k=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
    sa=st.floats(1e-4, 1e3),
    sb=st.floats(1e-4, 1e3),
)
def test_scaled_mm_property(m: int, n: int, k: int, seed: int, sa: float, sb: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    a = random_fp8((m, k), Fp8Format.E4M3, gen)
    b = random_fp8((n, k), Fp8Format.E5M2, gen)
    ta, tb = torch.tensor([sa]), torch.tensor([sb])
    out = tensor_ops.scaled_mm(a, b, ta, tb, None, torch.float32, backend=REF)
    exact = (a.double() @ b.double().t()) * (ta.double() * tb.double())
    bound = tensorwise.scaled_mm_error_bound(tensorwise.GemmArgs(a, b, ta, tb, None, torch.float32))
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_scaled_mm_ignores_an_enclosing_autocast() -> None:
    # Under torch.autocast a float32 matmul would run in bf16 and break the bound; the twin
    # keeps its float32 accumulation (the Triton kernel is untouched by autocast anyway).
    gen = torch.Generator().manual_seed(6)
    a = random_fp8((24, 256), Fp8Format.E4M3, gen)
    b = random_fp8((16, 256), Fp8Format.E4M3, gen)
    sa, sb = torch.tensor([0.37]), torch.tensor([0.011])
    plain = tensor_ops.scaled_mm(a, b, sa, sb, None, torch.float32, backend=REF)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = tensor_ops.scaled_mm(a, b, sa, sb, None, torch.float32, backend=REF)
    assert under.dtype == torch.float32
    assert torch.equal(under, plain)


def test_the_bound_is_not_vacuous() -> None:
    # A result one bf16 ulp off must fail the bound: the bound is tight enough to catch it.
    gen = torch.Generator().manual_seed(0)
    a = random_fp8((8, 16), Fp8Format.E4M3, gen)
    b = random_fp8((8, 16), Fp8Format.E4M3, gen)
    one = torch.ones(1)
    out = tensor_ops.scaled_mm(a, b, one, one, None, torch.bfloat16, backend=REF).double()
    exact = a.double() @ b.double().t()
    bound = tensorwise.scaled_mm_error_bound(
        tensorwise.GemmArgs(a, b, one, one, None, torch.bfloat16)
    )
    wrong = out + 2 * out.abs() * 2.0**-8 + 1e-3
    assert not bool(((wrong - exact).abs() <= bound).all())


# ---------------------------------------------------------------------------------------
# The bound for a narrower accumulator (the Triton kernel's fp8 dot on sm_90)

NARROW = blockwise.NARROW_ACCUMULATION


@pytest.mark.parametrize("k", [300, 50, 1, 0])
@pytest.mark.parametrize(
    ("out_dtype", "u_out"), [(torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-8)]
)
def test_narrow_accumulation_bound_by_hand(k: int, out_dtype: torch.dtype, u_out: float) -> None:
    # All ones, steps 1/2 and 1/4: exact = sum |a||b| s = k / 8 and the bias 3 adds to both.
    # By the docstring's formula: a tile of w' = min(128, K) products in the narrow
    # accumulator, w' - 1 additions of relative error 2**-13 each, then gamma_{K+3} on top.
    a = torch.ones(4, k).to(torch.float8_e4m3fn)
    b = torch.ones(3, k).to(torch.float8_e4m3fn)
    sa, sb = torch.tensor([0.5]), torch.tensor([0.25])
    bias = torch.full((3,), 3.0)
    adds = max(0, min(128, k) - 1)
    gamma_h = adds * 2.0**-13 / (1 - adds * 2.0**-13)
    gamma_n = (k + 3) * 2.0**-24 / (1 - (k + 3) * 2.0**-24)
    mag = k / 8 + 3
    e = (gamma_h + gamma_n * (1 + gamma_h)) * mag
    tiny = torch.finfo(out_dtype).smallest_normal * u_out * 2
    want = e + u_out * (mag + e) + tiny
    got = tensorwise.scaled_mm_error_bound(
        tensorwise.GemmArgs(a, b, sa, sb, bias, out_dtype), accumulation=NARROW
    )
    assert got.shape == (4, 3) and got.dtype == torch.float64
    assert got.flatten().tolist() == pytest.approx([want] * 12, rel=1e-12)
    # The float32 bound is the same formula with gamma_h = 0, and never wider.
    e32 = gamma_n * mag
    plain = tensorwise.scaled_mm_error_bound(tensorwise.GemmArgs(a, b, sa, sb, bias, out_dtype))
    want32 = e32 + u_out * (mag + e32) + tiny
    assert plain.flatten().tolist() == pytest.approx([want32] * 12, rel=1e-12)
    assert bool((got >= plain).all())


def test_narrow_accumulation_bound_widens_as_the_block_gemms() -> None:
    # One formula for both bounds (accumulation_gamma): the per-tensor one's K + 3 roundings
    # over all of K, the block GEMM's K + n_kb + 4 over one block (K for row x row, 128,
    # 32 for mx), each widened by the same gamma_h of a narrow step of min(128, width).
    k = 300
    for roundings, width in ((k + 3, k), (k + 5, k), (k + 7, 128), (k + 14, 32)):
        adds = min(128, width) - 1
        gamma_h = adds * 2.0**-13 / (1 - adds * 2.0**-13)
        gamma_n = roundings * 2.0**-24 / (1 - roundings * 2.0**-24)
        got = tensorwise.accumulation_gamma(roundings, width, NARROW)
        assert got == pytest.approx(gamma_h + gamma_n * (1 + gamma_h), rel=1e-14)
        assert tensorwise.accumulation_gamma(roundings, width) == pytest.approx(gamma_n, rel=1e-14)
    # The block bound for row x row with the narrow accumulation, on all-ones operands
    # (exact = mag = K, steps 1): its gamma is accumulation_gamma(K + 5, K, NARROW).
    a = torch.ones(2, k).to(torch.float8_e4m3fn)
    b = torch.ones(3, k).to(torch.float8_e4m3fn)
    one_a, one_b = torch.ones(2, 1), torch.ones(3, 1)
    got_block = blockwise.scaled_mm_error_bound(
        blockwise.BlockGemmArgs(a, b, one_a, "row", one_b, "row", None, torch.float32),
        accumulation=NARROW,
    )
    e = tensorwise.accumulation_gamma(k + 5, k, NARROW) * k + 2.0**-148 * (k + 1)
    tiny = torch.finfo(torch.float32).smallest_normal * 2.0**-24 * 2
    assert got_block.flatten().tolist() == pytest.approx([e + 2.0**-24 * (k + e) + tiny] * 6)


def _narrow_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, tile: int
) -> torch.Tensor:
    # A model of the fp8 tensor cores: each tile of `tile` products summed one by one with
    # the running sum truncated to 14 significant bits after every addition, then promoted
    # to a float32 accumulator; the steps multiply it once.
    m, k = a.shape
    n = b.shape[0]
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    acc = torch.zeros(m, n, dtype=torch.float32)
    for lo in range(0, k, tile):
        part = torch.zeros(m, n, dtype=torch.float64)
        for j in range(lo, min(k, lo + tile)):
            part = part + a64[:, j : j + 1] * b64[:, j].reshape(1, n)
            mant, exp = torch.frexp(part)
            part = torch.ldexp(torch.trunc(mant * 2.0**14) / 2.0**14, exp)
        acc = acc + part.to(torch.float32)
    return acc * (sa * sb)


@pytest.mark.parametrize("tile", [128, 64, 32])
def test_narrow_accumulation_bound_holds_for_a_14_bit_accumulator(tile: int) -> None:
    # Same signs, so partial sums grow and the truncation bites: the float32 bound must
    # fail for this model, the NARROW_ACCUMULATION one hold.
    gen = torch.Generator().manual_seed(tile)
    a = random_fp8((12, 300), Fp8Format.E4M3, gen).abs()
    b = random_fp8((10, 300), Fp8Format.E4M3, gen).abs()
    sa, sb = torch.tensor([0.37]), torch.tensor([1.9e-3])
    out = _narrow_scaled_mm(a, b, sa, sb, tile)
    exact = (a.double() @ b.double().t()) * (sa.double() * sb.double())
    err = (out.double() - exact).abs()
    f32 = tensorwise.scaled_mm_error_bound(tensorwise.GemmArgs(a, b, sa, sb, None, torch.float32))
    wide = tensorwise.scaled_mm_error_bound(
        tensorwise.GemmArgs(a, b, sa, sb, None, torch.float32), accumulation=NARROW
    )
    assert bool((err > f32).any()), "the model is within the float32 bound: not a test"
    assert bool((err <= wide).all()), f"worst excess {(err - wide).max().item()}"


@pytest.mark.parametrize("bad", [(0, 2.0**-13), (128, -1.0), (128, 0.01), (128.0, 2.0**-13)])
def test_narrow_accumulation_bound_refuses_a_bad_accumulation(bad: tuple[int, float]) -> None:
    a = torch.ones(2, 4).to(torch.float8_e4m3fn)
    one = torch.ones(1)
    with pytest.raises(ValueError, match=r"accumulation must be \(w, u_h\).*got"):
        tensorwise.scaled_mm_error_bound(
            tensorwise.GemmArgs(a, a, one, one, None, torch.float32), accumulation=bad
        )


@pytest.mark.parametrize("m", [1, 5, 37])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_twin_is_a_function_of_values_not_of_strides(
    out_dtype: torch.dtype, m: int
) -> None:
    # A transposed view of codes and its contiguous copy are the same operand: the twin gives
    # the same bits for both (a CPU GEMM's summation order may follow strides: it did on an
    # AMX machine, where a frozen expert's dgrad, fed contiguous transposed codes, differed in
    # the last bit from the unfrozen one's).
    g = torch.Generator().manual_seed(0)
    step = torch.tensor([0.5])
    for _ in range(8):  # a different order shows on some values only
        a = (torch.randn(m, 144, generator=g) * 4).to(torch.float8_e4m3fn)
        wt = (torch.randn(160, 144, generator=g) * 4).to(torch.float8_e4m3fn)
        view = wt.t().contiguous().t()  # values of wt, column-major
        args = (step, step, None, out_dtype)
        strided = tensorwise.scaled_mm(tensorwise.GemmArgs(a, view, *args))
        packed = tensorwise.scaled_mm(tensorwise.GemmArgs(a, wt, *args))
        assert torch.equal(strided.view(torch.uint8), packed.view(torch.uint8))
