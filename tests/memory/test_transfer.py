"""Staging buffers for non-blocking copies: the ordering rules on the CPU path, and on CUDA
the absence of the failure modes of the naive ``.to("cpu", non_blocking=True)`` version
(stale reads, blocks held by the allocator, a growing pinned cache)."""

from __future__ import annotations

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer
from computectx.memory._transfer import Staging, check_transfer, needs_staging, uses_staging

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped


def test_only_cuda_to_host_pairs_are_staged() -> None:
    assert needs_staging(torch.device("cuda", 0), torch.device("cpu"))
    assert not needs_staging(torch.device("cpu"), torch.device("cpu"))
    assert not needs_staging(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not needs_staging(torch.device("cpu"), torch.device("meta"))


def test_each_transfer_option_decides_staging_by_its_own_rule() -> None:
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    pairs = [(gpu, cpu), (cpu, cpu), (gpu, torch.device("cuda", 1))]
    assert [uses_staging("auto", a, b) for a, b in pairs] == [True, False, False]
    assert [uses_staging("staged", a, b) for a, b in pairs] == [True, True, True]
    assert [uses_staging("blocking", a, b) for a, b in pairs] == [False, False, False]
    assert check_transfer("staged") == "staged"
    for bad in ("Staged", "async", 1, None):
        with pytest.raises(ValueError, match=r"unknown transfer .*; accepted: 'auto', 'staged'"):
            check_transfer(bad)


def test_cpu_staging_round_trip_reuses_its_buffer() -> None:
    st = Staging(
        torch.Size([5]), torch.bfloat16, host=torch.device("cpu"), peer=torch.device("cpu")
    )
    assert not st.buffer.is_pinned()  # pinning needs a CUDA peer
    ptr = st.buffer.data_ptr()
    for k in range(4):
        src = torch.arange(5, dtype=torch.float32) * (k + 1)
        st.fill_from(src)
        assert st.in_flight
        st.wait()
        assert not st.in_flight
        assert torch.equal(st.buffer, src.to(torch.bfloat16))
        out = torch.empty(5, dtype=torch.bfloat16)
        st.drain_to(out)
        st.wait()
        assert torch.equal(out, src.to(torch.bfloat16))
    assert st.buffer.data_ptr() == ptr


@cuda
def test_cuda_staged_gradients_equal_blocking_ones_and_release_device_memory() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    twin = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    twin.load_state_dict(model.state_dict())
    ctx = ComputeCtx.parity("cuda").replace(grad=DType.BF16, offload=torch.device("cpu"))
    staged = LowPrecGradAccumulator(model.parameters(), ctx)  # auto: staged for cuda -> cpu
    blocking = LowPrecGradAccumulator(twin.parameters(), ctx, transfer="blocking")
    xs = [torch.randn(256, 512, device="cuda") for _ in range(8)]
    for m in (model, twin):  # warm-up: cuBLAS workspaces, staging buffers
        m(xs[0]).square().mean().backward()
    staged.reset()
    blocking.reset()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    pinned_before = None
    for _step in range(3):
        for x in xs:
            model(x).square().mean().backward()
            twin(x).square().mean().backward()
            # Every gradient block went back to the allocator: nothing held by pending
            # copies or recorded streams.
            assert torch.cuda.memory_allocated() == baseline
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            a, b = staged.pop(p), blocking.pop(q)
            assert a is not None and b is not None and a.device.type == "cpu"
            # Staging rounds to bf16 before the add (blocking adds the f32 grad): within
            # the bound, not bit-identical.
            diff = float((a.double() - b.double()).norm())
            assert diff <= 0.02 * float(b.double().norm())
        if hasattr(torch.cuda, "host_memory_stats"):
            pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
            if pinned_before is None:
                pinned_before = pinned
            assert pinned == pinned_before, "pinned host memory grew across steps"
    buffers = [t for role, t in staged.memory_tensors() if role == "staging"]
    assert len(buffers) == len(list(model.parameters()))
    assert all(t.is_pinned() for t in buffers)


@cuda
def test_cuda_staged_reads_never_see_a_stale_buffer() -> None:
    # A long kernel queued before the gradient copy makes an unsynchronised host read stale;
    # the staging event must make pop() wait for the copy.
    p = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda"))
    ctx = ComputeCtx.parity("cuda").replace(grad=DType.F32, offload=torch.device("cpu"))
    acc = LowPrecGradAccumulator([p], ctx)
    for k in range(1, 4):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            big = big @ big.T / 4096  # keep the stream busy
        backward((p * float(k)).sum())
        got = acc.pop(p)
        assert got is not None and bool((got == float(k)).all())


@cuda
def test_cuda_offloaded_optimizer_matches_plain_adamw() -> None:
    torch.manual_seed(0)
    ref = torch.nn.Linear(256, 256).cuda()
    ours = torch.nn.Linear(256, 256).cuda()
    ours.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadedOptimizer(
        ours.parameters(), ComputeCtx.parity("cuda").replace(offload=torch.device("cpu")), lr=1e-2
    )
    for _ in range(5):
        x = torch.randn(64, 256, device="cuda")
        for m, o in ((ref, ref_opt), (ours, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    torch.cuda.synchronize()
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        # Not bitwise: the reference steps with CUDA kernels, the masters with CPU ones, and
        # the two round AdamW's divisions and square roots differently in the last bits.
        assert torch.allclose(a, b, atol=1e-5)
    buffers = [t for role, t in opt.memory_tensors() if role == "staging"]
    assert len(buffers) == 4 and all(t.is_pinned() for t in buffers)  # grad + param, each
