"""The non-finite check of the step (``_grad_health.all_applicable``): true exactly when every
gradient element is finite with a finite float32 square (``|g| < 2**64``), whichever bound
clears a tensor first (a float32 dot product, or a 2-norm); and the check taken during the
backward (post-accumulate-grad hooks), reused by the step only for a gradient unchanged since."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import CompactOptimizer, LowPrecGradAccumulator, OffloadedOptimizer
from computectx.memory.optim import _grad_health
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


# ----- the check taken during the backward (post-accumulate-grad hooks) ---------------------

CTX = ComputeCtx.parity("cpu")


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(dtype)


def _backward(m: torch.nn.Module, scale: float = 1.0) -> None:
    x = torch.randn(4, 6, dtype=next(m.parameters()).dtype)
    (m(x).square().sum() * scale).backward()


class Reads:
    """Counts the checks (``_cleared``) taken, by phase."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = _grad_health._cleared

        def counted(v: torch.Tensor) -> torch.Tensor:
            self.count += 1
            return real(v)

        monkeypatch.setattr(_grad_health, "_cleared", counted)

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


OPTIMIZERS: dict[str, Callable[[torch.nn.Module], OffloadedOptimizer | CompactOptimizer]] = {
    "offloaded": lambda m: OffloadedOptimizer(m.parameters(), CTX),
    "compact": lambda m: CompactOptimizer(m.parameters(), CTX),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_backward_checks_and_the_step_reads_no_gradient_again(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _model()
    opt = OPTIMIZERS[kind](m)
    reads = Reads(monkeypatch)
    _backward(m)
    assert reads.take() == 4  # one per parameter, in its hook
    opt.step()
    assert reads.take() == 0 and not opt.last_step_skipped


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "change",
    ["in place", "assigned", "data swapped", "torch clip", "hook never fired"],
)
def test_a_gradient_changed_after_its_hook_is_checked_at_the_step(
    kind: str, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _model()
    opt = OPTIMIZERS[kind](m)
    w = next(m.parameters())
    before = [p.detach().clone() for p in m.parameters()]
    _backward(m)
    assert w.grad is not None
    bad = torch.full_like(w.grad, float("nan"))
    if change == "in place":
        w.grad[0, 0] = float("inf")
    elif change == "assigned":
        w.grad = bad
    elif change == "data swapped":
        w.grad.data = bad
    elif change == "torch clip":
        w.grad[0, 0] = SQUARE_OVERFLOW
        torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"), norm_type=1.0)
        w.grad[0, 0] = float("inf")  # measured, then written: the step must see it
    else:
        for p in m.parameters():
            p.grad = None
        w.grad = bad
    reads = Reads(monkeypatch)
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert reads.take() >= 1
    assert opt.last_step_skipped
    for p, b in zip(m.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


def test_accumulation_checks_at_the_last_firing_the_step_before_saw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = _model()
    opt = OffloadedOptimizer(m.parameters(), CTX)
    reads = Reads(monkeypatch)
    for _ in range(3):
        _backward(m)
    assert reads.take() == 12  # nothing learnt yet: each firing may be the last
    opt.step()
    opt.zero_grad()
    assert reads.take() == 0
    for _ in range(3):
        _backward(m)
    assert reads.take() == 4  # only the third firing checks
    opt.step()
    assert reads.take() == 0
    opt.zero_grad()
    # Fewer micro-batches than predicted: no hook checked, so the step does (and skips).
    w = next(m.parameters())
    _backward(m)
    assert reads.take() == 0
    assert w.grad is not None
    w.grad.data[1, 1] = float("nan")  # no version bump: unseen by any stamp but the step's
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert reads.take() == 4


def test_a_widened_copy_carries_the_verdict_and_changes_are_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = _model(torch.bfloat16)  # f32 masters: each gradient is copied, widened
    opt = OffloadedOptimizer(m.parameters(), CTX)
    reads = Reads(monkeypatch)
    _backward(m)
    assert reads.take() == 4
    opt.step()
    assert reads.take() == 0 and not opt.last_step_skipped
    opt.zero_grad()
    _backward(m)
    opt.ingest_grads()
    opt.master_params[0].grad[0, 0] = float("inf")  # type: ignore[index]
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()


def test_an_accumulator_quiets_the_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model()
    opt = OffloadedOptimizer(m.parameters(), CTX)
    acc = LowPrecGradAccumulator(m.parameters(), CTX.replace(grad=DType.F32))
    for _ in range(2):
        _backward(m)
    opt.ingest_grads(acc)
    opt.step()
    reads = Reads(monkeypatch)
    for _ in range(2):
        _backward(m)
    assert reads.take() == 0
    opt.ingest_grads(acc)
    opt.step()
    assert reads.take() == 4 and not opt.last_step_skipped
    acc.close()


def test_the_hooks_go_with_the_optimizer() -> None:
    m = _model()
    opt = OffloadedOptimizer(m.parameters(), CTX)
    w = next(m.parameters())
    assert len(w._post_accumulate_grad_hooks or {}) == 1
    del opt
    gc.collect()
    assert not w._post_accumulate_grad_hooks
    _backward(m)  # no hook left to call
