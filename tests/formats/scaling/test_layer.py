"""Scale convention and scaling state at the module level: seeding, window, margin,
non-finite and zero amaxes, checkpoints (versioned, other history lengths)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from computectx import ComputeCtx, Fp8Format
from computectx.formats import (
    DelayedScaling,
    DynamicScaling,
    Fp8Scheme,
    QuantizedLinear,
    Recipe,
    dequantize_tensor,
    quantize_tensor,
    scaling_stats,
)
from computectx.formats.backend import Backend
from computectx.formats.numerics.ledger import (
    ledger_history,
    ledger_new,
    ledger_nonfinite,
    ledger_saturated,
    ledger_slot,
    ledger_step,
    ledger_tail,
)
from computectx.formats.scaling.layer import ScalingState
from computectx.formats.scaling.operand import OperandScaling
from computectx.formats.scaling.saved import STATE_CODE

from ..conftest import CtxFor, StepOf

E4M3, E5M2 = Fp8Format.E4M3, Fp8Format.E5M2


def layer(ctx: ComputeCtx, n_in: int = 16, n_out: int = 16) -> QuantizedLinear:
    torch.manual_seed(0)
    return QuantizedLinear(n_in, n_out, ctx=ctx)


def scaled_input(amax: float, rows: int = 4, cols: int = 16) -> torch.Tensor:
    """A float32 input whose amax is exactly ``amax`` (one element pinned to it)."""
    x = torch.rand(rows, cols) * 0.5 * amax
    x[0, 0] = -amax
    return x


# ----- the scale convention (policy.py) ---------------------------------------------------


@settings(max_examples=40)
@given(
    amax=st.floats(1e-3, 1e4, allow_nan=False),
    fmt=st.sampled_from([E4M3, E5M2]),
    margin=st.integers(0, 4),
)
def test_step_is_amax_over_fmt_max_with_margin_headroom(
    amax: float, fmt: Fp8Format, margin: int, ctx_for: CtxFor, step_of: StepOf
) -> None:
    scheme = Fp8Scheme.E4M3 if fmt is E4M3 else Fp8Scheme.E5M2
    m = QuantizedLinear(16, 16, ctx=ctx_for(DynamicScaling(margin=margin), scheme))
    x = scaled_input(amax)
    m(x)
    s = scaling_stats(torch.nn.Sequential(m))["0"]
    assert s.input.step == step_of(amax, fmt, margin)
    # The largest magnitude lands at fmt.max / 2**margin: the headroom is exactly 2**margin.
    xq, _ = quantize_tensor(x, fmt, scale=s.input.step)
    assert float(xq.float().abs().max()) == fmt.max / 2.0**margin


def test_dequantize_is_q_times_step_and_zero_amax_gives_step_one(step_of: StepOf) -> None:
    x = torch.tensor([0.5, -3.0, 7.0, 0.0])
    q, step = quantize_tensor(x, "e4m3")
    assert float(step) == step_of(7.0, E4M3)
    assert torch.equal(dequantize_tensor(q, step, torch.float32), q.float() * step)
    zq, zstep = quantize_tensor(torch.zeros(5), "e5m2")
    assert float(zstep) == 1.0
    assert torch.equal(zq.float(), torch.zeros(5))


def test_zero_input_never_divides_by_zero_in_a_layer(ctx_for: CtxFor) -> None:
    m = layer(ctx_for(DelayedScaling(history_len=4)))
    y = m(torch.zeros(3, 16))
    assert torch.isfinite(y).all()
    s = scaling_stats(torch.nn.Sequential(m))["0"]
    assert s.input.step == 1.0
    assert s.input.amax == 0.0
    assert s.input.nonfinite_count == 0


# ----- delayed scaling at the module level --------------------------------------------------


def test_first_call_seeds_the_whole_window_from_its_own_amax(
    ctx_for: CtxFor, step_of: StepOf
) -> None:
    m = layer(ctx_for(DelayedScaling(history_len=5)))
    m(scaled_input(3.0))
    ledger = m.scaling.input.ledger
    assert torch.equal(ledger_history(ledger), torch.full((5,), 3.0))
    # The first call quantized with the step seeded from its own amax, not with step 1.
    s = scaling_stats(torch.nn.Sequential(m))["0"]
    assert s.input.step == step_of(3.0, E4M3, 0)
    assert s.input.saturated_fraction == 0.0


def test_window_max_keeps_the_largest_recent_amax_until_it_ages_out(
    ctx_for: CtxFor, step_of: StepOf
) -> None:
    n = 3
    m = layer(ctx_for(DelayedScaling(history_len=n, algo="max")))
    seq = [2.0, 8.0, 1.0, 1.0, 1.0, 1.0]
    steps = []
    for a in seq:
        m(scaled_input(a))
        steps.append(scaling_stats(torch.nn.Sequential(m))["0"].input.step)
    # After call i the window holds seq[i-n+1 .. i] (the seed fills older slots with seq[0]).
    for i, got in enumerate(steps):
        window = [seq[0]] * max(0, n - 1 - i) + seq[max(0, i - n + 1) : i + 1]
        assert got == step_of(max(window), E4M3, 0), (i, window)
    assert steps[1] == steps[3] != steps[4]  # 8.0 ages out after n calls


def test_most_recent_follows_the_last_amax(ctx_for: CtxFor, step_of: StepOf) -> None:
    m = layer(ctx_for(DelayedScaling(history_len=4, algo="most_recent")))
    for a in (2.0, 8.0, 1.0):
        m(scaled_input(a))
        s = scaling_stats(torch.nn.Sequential(m))["0"].input
        assert s.step == step_of(a, E4M3, 0)
        assert s.amax == s.window_amax == a


def test_delayed_step_lags_by_one_call_and_saturation_is_counted(
    ctx_for: CtxFor, step_of: StepOf
) -> None:
    m = layer(ctx_for(DelayedScaling(history_len=1)))
    m(scaled_input(1.0))
    # Second call: 4x larger values, quantized with the step from amax 1.0: the elements
    # above 1.0 saturate at 448 and are counted.
    x = scaled_input(4.0)
    m(x)
    s = scaling_stats(torch.nn.Sequential(m))["0"].input
    over = int((x.abs() > 1.0).sum())
    assert over > 0
    assert s.saturated_fraction == over / (2 * x.numel())  # the same division of two counts
    assert s.step == step_of(4.0, E4M3, 0)


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_margin_leaves_two_to_the_margin_of_headroom(
    margin: int, ctx_for: CtxFor, step_of: StepOf
) -> None:
    m = layer(ctx_for(DelayedScaling(history_len=2, margin=margin)))
    m(scaled_input(1.0))
    # 2**margin times the seeded amax still fits unclamped.
    x = scaled_input(2.0**margin)
    m(x)
    s = scaling_stats(torch.nn.Sequential(m))["0"].input
    assert s.saturated_fraction == 0.0
    assert s.step == step_of(2.0**margin, E4M3, margin)
    q, _ = quantize_tensor(x, E4M3, scale=s.step)
    assert float(q.float().abs().max()) == 448.0 / 2.0**margin  # the headroom again


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_amax_keeps_the_step_counts_and_training_goes_on(
    bad: float, ctx_for: CtxFor, step_of: StepOf
) -> None:
    m = layer(ctx_for(DelayedScaling(history_len=4)))
    m(scaled_input(2.0))
    before = scaling_stats(torch.nn.Sequential(m))["0"].input
    x = scaled_input(2.0)
    x[1, 3] = bad
    m(x)
    after = scaling_stats(torch.nn.Sequential(m))["0"].input
    assert after.step == before.step
    assert after.amax == before.amax
    assert after.nonfinite_count == 1
    y = m(scaled_input(3.0))  # the next finite call proceeds normally
    assert torch.isfinite(y).all()
    final = scaling_stats(torch.nn.Sequential(m))["0"].input
    assert final.step == step_of(3.0, E4M3, 0)
    assert final.nonfinite_count == 1


def test_dynamic_counts_nonfinite_and_records_amax(ctx_for: CtxFor) -> None:
    m = layer(ctx_for(DynamicScaling()))
    m(scaled_input(5.0))
    x = scaled_input(5.0)
    x[0, 1] = math.nan
    m(x)
    s = scaling_stats(torch.nn.Sequential(m))["0"].input
    assert s.nonfinite_count == 1
    assert s.amax == 5.0  # the non-finite amax was not recorded
    assert s.saturated_fraction == 0.0


def test_backward_seeds_and_advances_the_grad_ledger_in_the_backward_format(
    ctx_for: CtxFor, step_of: StepOf
) -> None:
    m = layer(ctx_for(DelayedScaling(history_len=4)))
    x = torch.randn(3, 16, requires_grad=True)
    (m(x) * 10.0).sum().backward()
    g = scaling_stats(torch.nn.Sequential(m))["0"].grad
    assert g.amax == 10.0
    assert g.step == step_of(10.0, E5M2, 0)  # HYBRID: gradients in E5M2
    assert g.elements == 3 * 16  # quantized once, shared by dgrad and wgrad
    # Oldest to newest: the seed filled the history, the call's amax is in the last slot.
    assert m.scaling.grad.newest_amax_index() == 3
    assert ledger_history(m.scaling.grad.ledger).tolist() == [10.0] * 4


def test_delayed_history_is_kept_oldest_to_newest(ctx_for: CtxFor) -> None:
    m = layer(ctx_for(DelayedScaling(history_len=3)))
    for scale in (1.0, 2.0, 3.0, 4.0):
        m(scaled_input(scale))
    # Seeded with 1, then 1, 2, 3, 4 written at the end; the oldest falls off the front.
    assert ledger_history(m.scaling.input.ledger).tolist() == [2.0, 3.0, 4.0]
    assert m.scaling.input.idx == 0 and m.scaling.input.elements == 4 * 4 * 16


# ----- resizing and checkpoints ---------------------------------------------------------------


def filled(history: list[float]) -> OperandScaling:
    """An operand whose history is ``history``, oldest to newest."""
    op = OperandScaling(len(history), "cpu")
    ledger_history(op.ledger).copy_(torch.tensor(history))
    ledger_step(op.ledger).fill_(0.25)
    ledger_nonfinite(op.ledger).fill_(2.0)
    ledger_saturated(op.ledger).fill_(7.0)
    op.seeded, op.elements = True, 99
    return op


def test_resize_keeps_the_newest_entries_and_pads_with_the_oldest() -> None:
    # Written in order 1, 2, 3, 4, 5 into a ledger of 4: 2 is the oldest left, 5 the newest.
    op = filled([2.0, 3.0, 4.0, 5.0])
    short = op.resized(2)
    assert ledger_history(short.ledger).tolist() == [4.0, 5.0]
    assert short.idx == 0
    long = op.resized(6)
    assert ledger_history(long.ledger).tolist() == [2.0, 2.0, 2.0, 3.0, 4.0, 5.0]
    for r in (short, long):
        assert ledger_tail(r.ledger).tolist() == [0.25, 2.0, 7.0]  # step and counts kept
        assert (r.seeded, r.elements) == (True, 99)
        assert ledger_history(r.ledger)[r.newest_amax_index()] == 5.0


def trained(ctx: ComputeCtx, calls: int = 3) -> QuantizedLinear:
    m = layer(ctx)
    for i in range(calls):
        x = scaled_input(1.0 + i, rows=2).requires_grad_(True)
        m(x).sum().backward()
    return m


def test_state_dict_round_trip_restores_ledgers_and_counters(ctx_for: CtxFor) -> None:
    m = trained(ctx_for(DelayedScaling(history_len=4)))
    sd = m.state_dict()
    assert sd["fp8_meta"][0] == STATE_CODE
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = layer(ctx_for(DelayedScaling(history_len=4)))
    fresh.load_state_dict(torch.load(buf))  # weights_only: plain data and tensors
    for role in ("input", "weight", "grad"):
        a, b = m.scaling.operands[role], fresh.scaling.operands[role]
        assert torch.equal(a.ledger, b.ledger)
        assert (a.idx, a.seeded, a.elements) == (b.idx, b.seeded, b.elements)
    x = scaled_input(2.5)
    assert torch.equal(m(x), fresh(x))  # same state, same next step, same output


@pytest.mark.parametrize("new_len", [2, 7])
def test_checkpoint_with_another_history_length_loads(new_len: int, ctx_for: CtxFor) -> None:
    m = trained(ctx_for(DelayedScaling(history_len=4)), calls=3)
    other = layer(ctx_for(DelayedScaling(history_len=new_len)))
    other.load_state_dict(m.state_dict())
    for role in ("input", "weight", "grad"):
        src, dst = m.scaling.operands[role], other.scaling.operands[role]
        assert dst.history_len == new_len
        n = src.history_len
        hist = ledger_history(src.ledger)
        chron = torch.cat([hist[src.idx :], hist[: src.idx]])
        kept = ledger_history(dst.ledger)[new_len - min(n, new_len) :]
        assert torch.equal(kept, chron[-new_len:])
        assert torch.equal(ledger_tail(dst.ledger), ledger_tail(src.ledger))


def test_nn_linear_checkpoint_loads_strictly_with_fresh_state(ctx_for: CtxFor) -> None:
    lin = torch.nn.Linear(16, 16)
    m = trained(ctx_for(DelayedScaling(history_len=4)))  # ledgers seeded from the old weights
    m.load_state_dict(lin.state_dict())  # strict by default
    assert torch.equal(m.weight, lin.weight)
    for op in m.scaling.operands.values():
        assert not op.seeded and op.elements == 0 and op.idx == 0
        assert torch.equal(op.ledger, ledger_new(4, "cpu"))
    # The next call seeds the weight ledger from the weights just loaded.
    m(scaled_input(1.0))
    assert ledger_slot(m.scaling.weight.ledger, 0).item() == lin.weight.detach().abs().max().item()


def test_a_state_dict_without_this_layer_leaves_its_state_alone(ctx_for: CtxFor) -> None:
    model = torch.nn.Sequential(
        trained(ctx_for(DelayedScaling(history_len=4))), torch.nn.Linear(16, 4)
    )
    first = model[0]
    assert isinstance(first, QuantizedLinear)
    before = {r: op.ledger.clone() for r, op in first.scaling.operands.items()}
    model.load_state_dict(
        torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(16, 4)).state_dict(), strict=False
    )
    for r, op in first.scaling.operands.items():
        assert torch.equal(op.ledger, before[r]) and op.seeded


def test_state_follows_policy_changes() -> None:
    st_ = ScalingState(Recipe(scaling=DelayedScaling(history_len=3)), "cpu")
    st_.conform(Recipe(scaling=DynamicScaling()), torch.device("cpu"))
    assert all(op.history_len == 1 for op in st_.operands.values())


@settings(max_examples=60)
@given(
    history=st.lists(st.floats(0.0, 1e4, width=32), min_size=1, max_size=12),
    new_len=st.integers(1, 16),
)
def test_resize_laws(history: list[float], new_len: int) -> None:
    op = filled(history)
    out = op.resized(new_len)
    n = len(history)
    chron = history  # oldest to newest
    got = ledger_history(out.ledger).tolist()
    assert got[out.newest_amax_index()] == chron[-1]  # the newest amax survives
    assert got[-min(n, new_len) :] == chron[-min(n, new_len) :]  # newest entries, in order
    if new_len >= n:
        assert max(got) == max(chron)  # padding never changes the window max
        assert got[: new_len - n] == [chron[0]] * (new_len - n)
    assert torch.equal(ledger_tail(out.ledger), ledger_tail(op.ledger))


@pytest.mark.parametrize("scaling", [DelayedScaling(history_len=4), DynamicScaling()])
def test_a_refused_quantize_leaves_the_operand_state_alone(
    scaling: DelayedScaling | DynamicScaling,
) -> None:
    op = OperandScaling(4 if isinstance(scaling, DelayedScaling) else 1, "cpu")
    with pytest.raises(ValueError, match="float64"):
        op.quantize(torch.ones(3, dtype=torch.float64), E4M3, scaling, Backend.REFERENCE)
    assert (op.elements, op.seeded, op.idx) == (0, False, 0)
    assert torch.equal(op.ledger, ledger_new(op.history_len, "cpu"))


def test_the_operands_of_a_scaling_state_are_read_only() -> None:
    state = QuantizedLinear(64, 64, ctx=ComputeCtx.from_flag("fp8_hybrid", "cpu")).scaling
    for role in ("input", "weight", "grad"):
        mine = getattr(state, role)
        with pytest.raises(AttributeError, match=f"ScalingState.{role} cannot be assigned"):
            setattr(state, role, state.operands["grad" if role != "grad" else "input"])
        with pytest.raises(AttributeError, match="cannot be deleted"):
            delattr(state, role)
        assert getattr(state, role) is mine is state.operands[role]
