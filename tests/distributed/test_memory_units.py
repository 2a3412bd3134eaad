"""One-process checks of what the memory policy adds for many ranks (no ranks spawned).

The hand-over check of ``OffloadedOptimizer.ingest_grads``, ``LowPrecGradAccumulator.set_sum``,
and the ``sharding=`` arithmetic of ``OffloadedOptimizer`` driven by a stand-in ``Sharding``
whose "other rank" contributes known numbers.
"""

from __future__ import annotations

import math
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from computectx import ComputeCtx, DType
from computectx.distributed import DataParallelGradAccumulator, ShardedParams
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer

CPU = ComputeCtx.parity("cpu")


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped


def model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


class OtherRank:
    """A ``Sharding`` for one process: a second rank adds ``other`` to sums and maxima."""

    def __init__(self, other: float) -> None:
        self.other = other
        self.calls: list[str] = []

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce(self, values: torch.Tensor, op: Literal["sum", "max"]) -> torch.Tensor:
        self.calls.append(op)
        other = torch.full_like(values, self.other)
        return values + other if op == "sum" else torch.maximum(values, other)


def test_ingest_refuses_gradients_written_after_the_accumulator_drained_them() -> None:
    net = model()
    acc = LowPrecGradAccumulator(net.parameters(), CPU.replace(grad=DType.BF16))
    opt = OffloadedOptimizer(net.parameters(), CPU, torch.optim.SGD, lr=0.1)
    backward(net(torch.randn(3, 5)).sum())
    sums = [acc.peek(p).clone() for p in net.parameters()]  # type: ignore[union-attr]
    late = torch.zeros(2)
    net[2].bias.grad = late  # what DDP's reducer does after the hook: a write after the drain
    with pytest.raises(RuntimeError, match=r"indices \[3\].*DataParallelGradAccumulator"):
        opt.ingest_grads(acc)
    # Nothing was ingested: the sums, the late gradient and the masters are as they were.
    assert all(m.grad is None for m in opt.master_params)
    assert net[2].bias.grad is late
    for p, s in zip(net.parameters(), sums, strict=True):
        assert torch.equal(acc.peek(p), s)  # type: ignore[arg-type]
    late.fill_(0.5)
    acc.close()  # a closed accumulator drains nothing: param.grad is the user's again
    opt.ingest_grads(acc)  # the sum, then param.grad added to it
    assert torch.equal(opt.master_params[3].grad, sums[3].float() + 0.5)  # type: ignore[arg-type]


def test_set_sum_rounds_once_into_the_buffer_and_checks_the_shape() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    acc = LowPrecGradAccumulator([p], CPU.replace(grad=DType.BF16))
    value = torch.tensor([1.0 + 2**-10, 3.0, -2.0])
    acc.set_sum(p, value)
    buf = acc.peek(p)
    assert buf is not None and buf.dtype == torch.bfloat16
    assert torch.equal(buf, value.to(torch.bfloat16)) and acc.count(p) == 1
    value.fill_(7.0)  # the buffer does not alias the caller's tensor
    assert torch.equal(buf, torch.tensor([1.0, 3.0, -2.0], dtype=torch.bfloat16))
    acc.set_sum(p, torch.full((3,), 0.5))
    assert acc.peek(p) is buf and torch.equal(buf, torch.full((3,), 0.5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"shape \(3,\), got \(2,\)"):
        acc.set_sum(p, torch.zeros(2))
    with pytest.raises(ValueError, match="not tracked"):
        acc.set_sum(torch.nn.Parameter(torch.zeros(3)), torch.zeros(3))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_sharded_clip_measures_the_global_norm(norm_type: float) -> None:
    net = model()
    other = 3.0  # the other rank's sum of |g|^p (its max |g| for p=inf)
    sharding = OtherRank(other)
    opt = OffloadedOptimizer(net.parameters(), CPU, torch.optim.SGD, sharding=sharding, lr=0.1)
    backward(net(torch.randn(4, 5)).pow(2).sum())
    grads = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    flat = torch.cat([g.reshape(-1) for g in grads]).double()
    if math.isinf(norm_type):
        want = max(float(flat.abs().max()), other)
    else:
        want = (float(flat.abs().pow(norm_type).sum()) + other) ** (1 / norm_type)
    norm = opt.clip_grad_norm(0.25, norm_type)
    assert norm == pytest.approx(want, rel=1e-6)
    assert sharding.calls == ["max" if math.isinf(norm_type) else "sum"]
    coef = 0.25 / (norm + 1e-6)
    for m, g in zip(opt.master_params, grads, strict=True):
        torch.testing.assert_close(m.grad, g * coef, rtol=1e-6, atol=0)
    # step() reuses the global verdict of the clip: no second collective.
    opt.step()
    assert sharding.calls == ["max" if math.isinf(norm_type) else "sum"]


def test_sharded_step_skips_when_another_rank_saw_inf() -> None:
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    sharding = OtherRank(1.0)  # the other rank's verdict: non-finite
    opt = OffloadedOptimizer(net.parameters(), CPU, torch.optim.SGD, sharding=sharding, lr=0.1)
    backward(net(torch.randn(4, 5)).sum())
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert sharding.calls == ["max"] and opt.skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
    sharding.other = 0.0  # every rank finite: the step is taken
    backward(net(torch.randn(4, 5)).sum())
    opt.step()
    assert not opt.last_step_skipped
    assert not torch.equal(next(net.parameters()), before[0])


def test_bad_sharding_and_uninitialised_groups_are_named() -> None:
    with pytest.raises(TypeError, match=r"sharding must be a Sharding.*got object"):
        OffloadedOptimizer(model().parameters(), CPU, sharding=object())  # type: ignore[arg-type]
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DataParallelGradAccumulator(model(), CPU)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedParams()
