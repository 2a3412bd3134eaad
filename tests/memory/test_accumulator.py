"""LowPrecGradAccumulator: draining during backward, sums, the error bound and its options."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from computectx import ComputeCtx, DType
from computectx.memory import LowPrecGradAccumulator

CPU = ComputeCtx.parity("cpu")


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped


def ctx_with(grad: DType) -> ComputeCtx:
    return CPU.replace(grad=grad)


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def feed(p: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """One backward per gradient: d/dp sum(p * g) = g exactly."""
    for g in grads:
        backward((p * g).sum())


# ----- draining and summing --------------------------------------------------------------


def test_grads_are_drained_into_buffers_of_ctx_grad_dtype() -> None:
    model = small_model()
    ctx = ctx_with(DType.BF16)
    acc = LowPrecGradAccumulator(model.parameters(), ctx)
    seen_during_backward: list[bool] = []

    # A second hook registered after the accumulator's sees param.grad already drained.
    first = next(iter(model.parameters()))
    first.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
        lambda p: seen_during_backward.append(p.grad is None)
    )
    model(torch.randn(4, 6)).sum().backward()
    assert seen_during_backward == [True]
    for p in model.parameters():
        assert p.grad is None
        buf = acc.peek(p)
        assert buf is not None
        assert buf.dtype == torch.bfloat16
        assert buf.device == ctx.offload_device
        assert buf.shape == p.shape
    acc.close()


def test_f32_buffer_sums_micro_batches_exactly_like_torch() -> None:
    ref, model = small_model(), small_model()
    xs = [torch.randn(4, 6) for _ in range(3)]
    for x in xs:
        ref(x).pow(2).mean().backward()  # torch's own f32 accumulation into .grad
    with LowPrecGradAccumulator(model.parameters(), ctx_with(DType.F32)) as acc:
        for x in xs:
            model(x).pow(2).mean().backward()
        assert acc.micro_batches == 3
        acc.flush_to_param_grads()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and r.grad is not None
        assert torch.equal(p.grad, r.grad)


def test_frozen_and_unused_params_are_handled() -> None:
    torch.manual_seed(0)
    used = torch.nn.Linear(3, 3)
    unused = torch.nn.Linear(3, 3)
    frozen = torch.nn.Linear(3, 3).requires_grad_(False)
    params = [*used.parameters(), *unused.parameters(), *frozen.parameters()]
    acc = LowPrecGradAccumulator(params, ctx_with(DType.BF16))
    assert len(acc.params) == 4
    assert not acc.tracks(frozen.weight)
    used(frozen(torch.randn(2, 3))).sum().backward()
    assert acc.count(used.weight) == 1
    assert acc.count(unused.weight) == 0
    assert acc.peek(unused.weight) is None
    acc.flush_to_param_grads(DType.F32)
    assert used.weight.grad is not None
    assert unused.weight.grad is None
    assert frozen.weight.grad is None


def test_flush_checks_every_dtype_before_changing_anything() -> None:
    f32 = torch.nn.Parameter(torch.ones(3))
    b16 = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    acc = LowPrecGradAccumulator([f32, b16], ctx_with(DType.BF16))
    feed(f32, [torch.full((3,), 2.0)])
    feed(b16, [torch.full((3,), 3.0, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"bfloat16.*torch rejects"):
        acc.flush_to_param_grads(DType.F32)
    assert f32.grad is None and b16.grad is None
    assert acc.count(f32) == 1 and acc.count(b16) == 1


def test_flush_adds_to_an_existing_grad_and_empties_buffers() -> None:
    p = torch.nn.Parameter(torch.zeros(4))
    acc = LowPrecGradAccumulator([p], ctx_with(DType.F32))
    feed(p, [torch.full((4,), 1.5), torch.full((4,), 0.5)])
    p.grad = torch.full((4,), 10.0)
    acc.flush_to_param_grads()
    assert torch.equal(p.grad, torch.full((4,), 12.0))
    assert acc.peek(p) is None and acc.micro_batches == 0


def test_reset_close_and_context_manager() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with LowPrecGradAccumulator([p], ctx_with(DType.BF16)) as acc:
        feed(p, [torch.ones(2)])
        acc.reset()
        assert acc.peek(p) is None and acc.count(p) == 0
        feed(p, [torch.full((2,), 4.0)])
        held = acc.peek(p)
        assert held is not None and torch.equal(held, torch.full((2,), 4.0, dtype=torch.bfloat16))
    assert acc.closed
    feed(p, [torch.ones(2)])  # hooks gone: torch accumulates into .grad again
    assert p.grad is not None and torch.equal(p.grad, torch.ones(2))
    kept = acc.pop(p)
    assert kept is not None and torch.equal(kept, torch.full((2,), 4.0, dtype=torch.bfloat16))


def test_non_finite_gradients_are_summed_not_raised() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    acc = LowPrecGradAccumulator([p], ctx_with(DType.BF16), mode="stochastic")
    feed(p, [torch.tensor([1.0, math.inf, 1.0]), torch.tensor([1.0, 1.0, math.nan])])
    buf = acc.peek(p)
    assert buf is not None
    assert buf[0] == 2.0 and buf[1] == math.inf and math.isnan(float(buf[2]))


# ----- the error bound -------------------------------------------------------------------


def _micro_batches(draw: st.DrawFn, lo_exp: int, hi_exp: int, n: int) -> list[torch.Tensor]:
    k = draw(st.integers(1, 64))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(k):
        e = draw(st.integers(lo_exp, hi_exp))
        spread = torch.randint(-6, 1, (n,), generator=gen).float()
        sign = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
        mant = 1 + torch.rand(n, generator=gen)
        grads.append((sign * mant * torch.exp2(spread + e)).float())
    return grads


@st.composite
def bf16_batches(draw: st.DrawFn) -> list[torch.Tensor]:
    # Exponents from the bf16 subnormal range to far above 1, mixed within one sum.
    return _micro_batches(draw, -135, 90, 16)


@st.composite
def f16_batches(draw: st.DrawFn) -> list[torch.Tensor]:
    # Stay below f16 overflow (64 terms of < 2**9 each) while reaching its subnormals.
    return _micro_batches(draw, -26, 8, 16)


def _check_bound(grads: list[torch.Tensor], grad: DType, mode: str) -> None:
    p = torch.nn.Parameter(torch.zeros(grads[0].shape))
    acc = LowPrecGradAccumulator([p], ctx_with(grad), mode=mode)  # type: ignore[arg-type]
    feed(p, grads)
    stacked = torch.stack(grads).double()
    exact = stacked.sum(0)
    buf = acc.pop(p)
    assert buf is not None
    err = (buf.double() - exact).abs()
    bound = LowPrecGradAccumulator.error_bound(
        stacked.abs().sum(0),
        len(grads),
        grad,
        mode,  # type: ignore[arg-type]
    )
    assert bool((err <= bound).all()), f"err {err.max()} > bound {bound[err > bound]}"


@settings(max_examples=40)
@given(bf16_batches(), st.sampled_from(["nearest", "stochastic"]))
def test_bf16_sum_of_up_to_64_micro_batches_is_within_the_documented_bound(
    grads: list[torch.Tensor], mode: str
) -> None:
    _check_bound(grads, DType.BF16, mode)


@settings(max_examples=25)
@given(f16_batches(), st.sampled_from(["nearest", "stochastic"]))
def test_f16_sum_is_within_the_documented_bound(grads: list[torch.Tensor], mode: str) -> None:
    _check_bound(grads, DType.F16, mode)


def test_bound_rejects_a_lost_micro_batch_and_a_too_narrow_buffer() -> None:
    # The property above has teeth: sums that drop a micro-batch, or that accumulate in an
    # 8-bit format, land outside the bf16 bound for the same inputs.
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(256, generator=gen) for _ in range(3)]
    stacked = torch.stack(grads).double()
    exact = stacked.sum(0)
    bound = LowPrecGradAccumulator.error_bound(stacked.abs().sum(0), 3, DType.BF16)
    dropped = stacked[1:].sum(0)
    assert not bool(((dropped - exact).abs() <= bound).all())
    fp8 = torch.zeros(256, dtype=torch.float8_e4m3fn)
    for g in grads:
        fp8 = (fp8.float() + g).to(torch.float8_e4m3fn)
    assert not bool(((fp8.double() - exact).abs() <= bound).all())
    with pytest.raises(ValueError, match="micro_batches"):
        LowPrecGradAccumulator.error_bound(stacked.abs().sum(0), -1, DType.BF16)
    # K*u >= 1: no guarantee left, and the bound says so.
    assert math.isinf(float(LowPrecGradAccumulator.error_bound(torch.ones(1), 256, DType.BF16)))


def _abs_error(grads: list[torch.Tensor], grad: DType, mode: str) -> float:
    p = torch.nn.Parameter(torch.zeros(grads[0].shape))
    acc = LowPrecGradAccumulator([p], ctx_with(grad), mode=mode)  # type: ignore[arg-type]
    feed(p, grads)
    exact = torch.stack(grads).double().sum(0)
    buf = acc.pop(p)
    assert buf is not None
    return float((buf.double() - exact).abs().mean())


def test_options_ordered_by_error_against_the_f64_sum() -> None:
    n, k = 4096, 64
    gen = torch.Generator().manual_seed(1)
    # Stagnation: one large term, then many terms below half a bf16 ulp of the running sum.
    # Nearest rounding drops every small term (biased); stochastic rounding keeps them in
    # expectation; an f32 buffer keeps them outright.
    stagnant = [torch.ones(n)] + [
        (1.5e-3 * (1 + 0.1 * torch.rand(n, generator=gen))) for _ in range(k - 1)
    ]
    e_near = _abs_error(stagnant, DType.BF16, "nearest")
    e_sr = _abs_error(stagnant, DType.BF16, "stochastic")
    e_f32 = _abs_error(stagnant, DType.F32, "nearest")
    print(f"stagnation: nearest {e_near:.3e}  stochastic {e_sr:.3e}  f32 {e_f32:.3e}")
    assert e_f32 < e_sr / 100
    assert e_sr < e_near / 3
    # Zero-mean noise: nothing stagnates, so unbiasedness buys nothing and stochastic
    # rounding's larger per-step variance (errors up to a full ulp) makes it the worse
    # bf16 option; both are orders of magnitude behind an f32 buffer.
    noisy = [torch.randn(n, generator=gen) for _ in range(k)]
    n_near = _abs_error(noisy, DType.BF16, "nearest")
    n_sr = _abs_error(noisy, DType.BF16, "stochastic")
    n_f32 = _abs_error(noisy, DType.F32, "nearest")
    print(f"noise: nearest {n_near:.3e}  stochastic {n_sr:.3e}  f32 {n_f32:.3e}")
    assert n_f32 < n_near / 1000 and n_f32 < n_sr / 1000
    assert n_near < n_sr


@pytest.mark.parametrize("grad", [DType.BF16, DType.F16])
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(grad: DType) -> None:
    x = torch.full((200_000,), 1.0 + 2.0**-10 * 3 + 2.0**-14)  # between two 16-bit values
    acc = LowPrecGradAccumulator([], ctx_with(grad), mode="stochastic", seed=3)
    out = acc._round(x)
    assert out.dtype == grad.torch
    xv = float(x[0])
    nearest = float(x[0].to(grad.torch).float())
    values = sorted(set(out.float().tolist()))
    assert len(values) == 2 and nearest in values
    lo, hi = values
    assert lo < xv < hi and hi - lo <= 2.0**-7  # the two neighbours of x, nothing else
    # Unbiased: the sample mean is within 6 standard errors of x, a window far narrower
    # than the bias of rounding to nearest.
    p_up = (xv - lo) / (hi - lo)
    tol = 6 * (hi - lo) * math.sqrt(p_up * (1 - p_up) / x.numel())
    assert tol < abs(nearest - xv) / 10
    assert abs(float(out.double().mean()) - xv) < tol
    # Values already representable never move; inf and NaN pass through.
    exact = torch.tensor([1.0, -2.5, 0.0, math.inf, -math.inf])
    assert torch.equal(acc._round(exact).float(), exact)
    assert math.isnan(float(acc._round(torch.tensor([math.nan]))[0]))


def test_stochastic_mode_is_reproducible_from_its_seed() -> None:
    grads = [torch.randn(64) for _ in range(5)]
    outs = []
    for _ in range(2):
        p = torch.nn.Parameter(torch.zeros(64))
        acc = LowPrecGradAccumulator([p], ctx_with(DType.BF16), mode="stochastic", seed=7)
        feed(p, grads)
        outs.append(acc.pop(p))
    assert outs[0] is not None and outs[1] is not None
    assert torch.equal(outs[0], outs[1])


# ----- staged transfers on the CPU path --------------------------------------------------


def test_staged_transfer_matches_direct_and_reuses_one_staging_buffer() -> None:
    grads = [torch.randn(32) for _ in range(6)]
    p_direct = torch.nn.Parameter(torch.zeros(32))
    p_staged = torch.nn.Parameter(torch.zeros(32))
    direct = LowPrecGradAccumulator([p_direct], ctx_with(DType.BF16), transfer="blocking")
    # "staged" takes the path of a CUDA -> CPU pair even on one device: same code, host-side
    # events that complete immediately.
    staged = LowPrecGradAccumulator([p_staged], ctx_with(DType.BF16), transfer="staged")
    addresses = set()
    for step in range(2):
        for g in grads:
            feed(p_direct, [g])
            feed(p_staged, [g])
            addresses |= {t.data_ptr() for r, t in staged.memory_tensors() if r == "staging"}
            assert not [r for r, _t in direct.memory_tensors() if r == "staging"]
        a, b = direct.pop(p_direct), staged.pop(p_staged)
        assert a is not None and b is not None
        # Staging rounds the f32 gradient to bf16 before the add: one more rounding per
        # micro-batch, within the same bound, usually but not always bit-identical.
        bound = LowPrecGradAccumulator.error_bound(
            torch.stack(grads).abs().sum(0), len(grads), DType.BF16
        )
        exact = torch.stack(grads).double().sum(0)
        assert bool(((b.double() - exact).abs() <= bound).all()), step
    assert len(addresses) == 1


class _SpyEvent:
    """Records the order of copies and waits around one staging buffer."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self, stream: object = None) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("wait")


def test_staging_is_waited_on_before_it_is_read_or_overwritten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []
    monkeypatch.setattr("computectx.memory._transfer._make_event", lambda peer: _SpyEvent(log))
    p = torch.nn.Parameter(torch.zeros(4))
    acc = LowPrecGradAccumulator([p], ctx_with(DType.F32), transfer="staged")
    feed(p, [torch.ones(4), torch.ones(4), torch.ones(4)])
    # copy 1 recorded; before copy 2 overwrites the buffer, copy 1 is waited on and folded.
    assert log == ["record", "wait", "record", "wait", "record"]
    total = acc.pop(p)
    assert total is not None and torch.equal(total, torch.full((4,), 3.0))
    assert log[-1] == "wait"  # pop waits for the copy still in flight


# ----- bad input -------------------------------------------------------------------------


def test_bad_arguments_raise_clear_errors() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="ComputeCtx"):
        LowPrecGradAccumulator([p], "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'round'.*'nearest', 'stochastic'"):
        LowPrecGradAccumulator([p], CPU, mode="round")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'async'.*'auto', 'staged', 'blocking'"):
        LowPrecGradAccumulator([p], CPU, transfer="async")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grad=f32"):
        LowPrecGradAccumulator([p], CPU, mode="stochastic")
    with pytest.raises(TypeError, match="seed"):
        LowPrecGradAccumulator([p], CPU, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model\.parameters\(\)"):
        LowPrecGradAccumulator(torch.nn.Linear(2, 2), CPU)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"params\[1\]"):
        LowPrecGradAccumulator([p, "w"], CPU)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a leaf"):
        LowPrecGradAccumulator([p * 2], CPU)
    acc = LowPrecGradAccumulator([p], CPU)
    with pytest.raises(ValueError, match="not tracked"):
        acc.count(torch.zeros(2))
    with pytest.raises(ValueError, match="unknown dtype"):
        acc.flush_to_param_grads("int8")  # type: ignore[arg-type]


def test_sparse_gradients_are_rejected_by_name() -> None:
    emb = torch.nn.Embedding(10, 3, sparse=True)
    LowPrecGradAccumulator(emb.parameters(), ctx_with(DType.BF16))
    with pytest.raises(TypeError, match="dense"):
        emb(torch.tensor([1, 2])).sum().backward()
