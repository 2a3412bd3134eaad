"""Checks of what the memory policy adds for many ranks, mostly in one process.

The hand-over check of ``OffloadedOptimizer.ingest_grads``, ``LowPrecGradAccumulator.set_sum``,
the ``sharding=`` arithmetic of ``OffloadedOptimizer`` driven by a stand-in ``Sharding`` whose
"other rank" contributes known numbers, and the buckets of ``DataParallelGradAccumulator``
(their sizes checked in one process, their reduction on 2 gloo ranks:
``scenarios_memory.py:dp_buckets``).
"""

from __future__ import annotations

import math
import re
from typing import Literal

import pytest
import torch
import torch.distributed as dist

from computectx import ComputeCtx, DType
from computectx.distributed import DataParallelGradAccumulator, ShardedParams
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer
from computectx.memory.accumulator import AccumMode

from .conftest import RunRanks
from .scenarios_memory import BUCKET_CASES

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


@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_set_sum_in_pieces_is_set_sum_of_the_whole(mode: AccumMode) -> None:
    # A transposed parameter: its gradient is not contiguous, its sum is.
    p = torch.nn.Parameter(torch.zeros(9, 7).t())
    ctx = CPU.replace(grad=DType.BF16)
    whole = LowPrecGradAccumulator([p], ctx, mode=mode, seed=4)
    pieces = LowPrecGradAccumulator([p], ctx, mode=mode, seed=4)
    value = torch.randn(7, 9) * (1 + 2**-9)  # between bf16 neighbours: rounding matters
    whole.set_sum(p, value)
    flat = value.reshape(-1)
    for start, stop in ((0, 5), (5, 40), (40, 63)):
        pieces.set_sum_part(p, start, flat[start:stop])
    got, want = pieces.peek(p), whole.peek(p)
    assert got is not None and want is not None and got.is_contiguous()
    assert torch.equal(got, want) and pieces.count(p) == 1
    half = LowPrecGradAccumulator([p], ctx)
    half.set_sum_part(p, 60, torch.ones(3))  # no sum yet: zeros, then the piece
    part = half.peek(p)
    assert part is not None
    assert torch.equal(part.reshape(-1), torch.cat([torch.zeros(60), torch.ones(3)]).bfloat16())
    with pytest.raises(ValueError, match="outside the parameter's 63 elements"):
        half.set_sum_part(p, 61, torch.ones(3))
    with pytest.raises(ValueError, match="1-D tensor"):
        half.set_sum_part(p, 0, torch.ones(3, 1))
    with pytest.raises(TypeError, match="start must be an int"):
        half.set_sum_part(p, 1.0, torch.ones(3))  # type: ignore[arg-type]


def test_a_non_contiguous_gradient_is_summed_into_a_contiguous_buffer() -> None:
    p = torch.nn.Parameter(torch.randn(9, 7).t())
    modes: tuple[AccumMode, ...] = ("nearest", "stochastic")
    for mode in modes:
        acc = LowPrecGradAccumulator([p], CPU.replace(grad=DType.BF16), mode=mode)
        backward((p * torch.arange(63.0).reshape(7, 9)).sum())
        buf = acc.peek(p)
        assert buf is not None and buf.is_contiguous() and not p.is_contiguous()
        if mode == "nearest":
            assert torch.equal(buf, torch.arange(63.0).reshape(7, 9).bfloat16())
        acc.close()


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
    # step() reuses the clip's verdict (reads no gradient again) but still all-reduces it,
    # one element: whether a kept verdict holds is each rank's own, and every rank must run
    # the same collectives (scenarios_memory's fsdp2 step 2 runs the one-rank case).
    opt.step()
    assert sharding.calls == ["max" if math.isinf(norm_type) else "sum", "max"]


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


# ----- the DP accumulator's buckets -------------------------------------------------------


@pytest.mark.parametrize(
    ("bucket_mib", "error", "message"),
    [
        (0, ValueError, "positive, finite number of MiB"),
        (-25, ValueError, "positive, finite number of MiB"),
        (math.inf, ValueError, "got inf"),
        (math.nan, ValueError, "got nan"),
        ("25", TypeError, "must be a number of MiB"),
        (True, TypeError, "got True"),
        (4 / 2**20, ValueError, "is 4 byte(s); a bucket needs at least 8"),
    ],
)
def test_a_bad_bucket_size_is_named_before_anything_is_hooked(
    bucket_mib: object, error: type[Exception], message: str
) -> None:
    net = model()
    with pytest.raises(error, match=re.escape(message)):
        DataParallelGradAccumulator(net, CPU, bucket_mib=bucket_mib)  # type: ignore[arg-type]
    # No hook was left behind: gradients stay in param.grad.
    backward(net(torch.randn(3, 5)).sum())
    assert all(p.grad is not None for p in net.parameters())


def test_an_f64_bucket_needs_two_f64_elements() -> None:
    with pytest.raises(ValueError, match="is 8 byte"):
        DataParallelGradAccumulator(model(), CPU.replace(grad=DType.F64), bucket_mib=8 / 2**20)


def test_buckets_reduce_as_one_vector_on_two_ranks(run_ranks: RunRanks) -> None:
    """Tiny buckets (most parameters split) and the default 25 MiB give, bitwise, what one
    all-reduce of every sum gave before buckets, for f32 and bf16 sums, nearest and
    stochastic; one collective per bucket on every rank although the ranks hold sums of
    different parameters; and memory_report counts the bucket."""
    r0, r1 = run_ranks("scenarios_memory.py:dp_buckets")
    numels = r0["numels"]
    for case in BUCKET_CASES:
        grad, _ = BUCKET_CASES[case]
        for r in (r0, r1):
            ref = r[f"{case}/ref"]
            # head_a (rank 0 only) and head_b (rank 1 only) are reduced; unused is not.
            absent = [name.startswith("unused.") for name in r0["names"]]
            assert [s is None for s in ref] == absent and any(absent)
            for name in ("tiny", "default"):
                got = r[f"{case}/{name}"]
                assert [s is None for s in got] == [s is None for s in ref]
                for a, b in zip(got, ref, strict=True):
                    assert a is None or (a.dtype == grad.torch and torch.equal(a, b)), (case, name)
            assert r[f"{case}/contiguous"]  # the transposed parameter's sum too
        for name in ("tiny", "default"):
            buckets = r0[f"{case}/{name}_buckets"]
            assert r1[f"{case}/{name}_buckets"] == buckets
            # One collective per bucket, on both ranks.
            assert r0[f"{case}/{name}_calls"] == r1[f"{case}/{name}_calls"] == len(buckets)
            # Every element and one flag per parameter, no bucket over its size.
            assert sum(buckets) == sum(numels) + len(numels)
            capacity = r0[f"{case}/{name}_bucket_bytes"] // 4
            assert max(buckets) <= capacity
            # memory_report counts the bucket once it exists, and not after close().
            assert r0[f"{case}/{name}_counted_before"] == 0
            assert r0[f"{case}/{name}_counted_extra"] == 4 * max(buckets)
            assert r0[f"{case}/{name}_counted_closed"] == 0
        assert r0[f"{case}/tiny_bucket_bytes"] == 40 and len(r0[f"{case}/tiny_buckets"]) > 20
        # The default bucket is 25 MiB at most, and no bigger than the model needs.
        assert r0[f"{case}/default_bucket_bytes"] == 25 * 2**20
        assert r0[f"{case}/default_buckets"] == [sum(numels) + len(numels)]
    # A LowPrecGradAccumulator on FSDP2 parameters: refused at the hand-over, naming what to do.
    for r in (r0, r1):
        assert "are DTensors (FSDP2 fully_shard)" in r["fsdp2_error"]
        assert "build no accumulator" in r["fsdp2_error"] and r["fsdp2_untouched"]
