"""memory_report: bytes per device and role, each storage once; what offload keeps off the
compute device.

What the CPU tests prove: on a CPU-only machine the compute and offload devices cannot both
hold data on distinct real devices, so the tests (1) count by role, which is independent of
placement, (2) use ``offload="meta"`` -- a genuinely distinct device where tensors have shape
and dtype but no data -- for everything up to the optimizer step (backward, draining,
ingest), and (3) check that every tensor the optimizer creates lives on
``ctx.offload_device`` and shares no storage with a compute parameter. The CUDA test at the
end runs the same assertions with compute on the GPU and offload on the host.
"""

from __future__ import annotations

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import (
    LowPrecGradAccumulator,
    MemoryReport,
    OffloadedOptimizer,
    memory_report,
)
from computectx.memory.accounting import MemoryRow


def model_of(dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(
        device=device, dtype=dtype
    )


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_plain_adamw_holds_16_bytes_per_param() -> None:
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    r = memory_report(model, optimizer=opt)
    p = n_params(model)
    assert r.parameters == p
    assert r.bytes(role="params") == 4 * p
    assert r.bytes(role="grads") == 4 * p
    # exp_avg + exp_avg_sq, plus a 4-byte step counter per parameter tensor
    assert r.bytes(role="optimizer_state") == 8 * p + 4 * 4
    assert r.bytes(device="cpu") == r.bytes()
    assert 16 <= r.bytes_per_param("cpu") < 16.1


def test_shared_storage_is_counted_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.Sequential(emb, head)
    view = emb.weight.detach()[:5]  # a view of the same storage
    r = memory_report([*model.parameters(), view])
    assert r.bytes(role="params") == 10 * 4 * 4
    assert r.rows[0].storages == 1
    assert r.parameters == 40 + 20  # elements of the tensors given (view included)


def test_after_backward_the_compute_side_holds_no_f32_gradients() -> None:
    model = model_of(torch.bfloat16)
    ctx = ComputeCtx.new(DType.BF16, "cpu").replace(grad=DType.BF16)
    acc = LowPrecGradAccumulator(model.parameters(), ctx)
    for _ in range(3):
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
    r = memory_report(model, accumulator=acc)
    p = n_params(model)
    assert r.bytes(role="grads") == 0
    assert r.bytes(dtype=torch.float32) == 0
    assert r.bytes(role="accumulator", dtype="bfloat16") == 2 * p
    assert r.bytes(role="accumulator", dtype=DType.BF16) == 2 * p
    assert r.bytes(dtype="bf16") == 4 * p  # weights + sums
    assert r.bytes_per_param(roles=["params", "grads"]) == 2.0
    assert r.bytes_per_param() == 4.0


def test_meta_offload_keeps_every_gradient_and_master_off_the_compute_device() -> None:
    model = model_of(torch.bfloat16)
    ctx = ComputeCtx.new(DType.BF16, "cpu").replace(grad=DType.BF16, offload=torch.device("meta"))
    acc = LowPrecGradAccumulator(model.parameters(), ctx)
    opt = OffloadedOptimizer(model.parameters(), ctx, lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
    p = n_params(model)
    r = memory_report(model, optimizer=opt, accumulator=acc)
    assert r.devices == ("cpu", "meta")
    assert r.by_device()["cpu"] == {
        "params": 2 * p,
        "grads": 0,
        "accumulator": 0,
        "master": 0,
        "optimizer_state": 0,
        "staging": 0,
        "scratch": 0,
    }
    assert r.bytes(device="meta", role="accumulator", dtype="bfloat16") == 2 * p
    assert r.bytes(device="meta", role="master", dtype="float32") == 4 * p
    opt.ingest_grads(acc)
    r = memory_report(model, optimizer=opt, accumulator=acc)
    assert r.bytes(device="cpu") == 2 * p  # still nothing but the bf16 weights
    assert r.bytes(device="meta", role="grads", dtype="float32") == 4 * p
    assert r.bytes(device="meta", role="accumulator") == 0


def test_optimizer_state_and_masters_live_on_the_offload_device_only() -> None:
    model = model_of(torch.bfloat16)
    ctx = ComputeCtx.new(DType.BF16, "cpu").replace(grad=DType.BF16)
    acc = LowPrecGradAccumulator(model.parameters(), ctx)
    opt = OffloadedOptimizer(model.parameters(), ctx, lr=1e-3)
    model(torch.randn(4, 16, dtype=torch.bfloat16)).float().sum().backward()
    opt.ingest_grads(acc)
    opt.step()
    p = n_params(model)
    r = memory_report(model, optimizer=opt, accumulator=acc)
    compute_storages = {q.untyped_storage().data_ptr() for q in model.parameters()}
    held = list(opt.memory_tensors())
    assert {role for role, _t in held} == {"master", "grads", "optimizer_state"}
    offloaded = [t for _role, t in held]
    assert offloaded and all(t.device == ctx.offload_device for t in offloaded)
    assert not {t.untyped_storage().data_ptr() for t in offloaded} & compute_storages
    assert r.bytes(role="params") == 2 * p
    assert r.bytes(role="master", dtype="float32") == 4 * p
    assert r.bytes(role="optimizer_state") >= 8 * p
    assert r.bytes(role="grads") == 4 * p  # the masters' f32 grads, until zero_grad
    opt.zero_grad()
    assert memory_report(model, optimizer=opt).bytes(role="grads") == 0


def test_report_text_and_filters() -> None:
    r = memory_report(model_of())
    assert isinstance(r, MemoryReport)
    text = str(r)
    assert "params" in text and "float32" in text and f"{r.parameters:,}" in text
    with pytest.raises(ValueError, match=r"'weights'.*'params'"):
        r.bytes(role="weights")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        r.bytes(dtype="float99")
    with pytest.raises(TypeError, match="one tensor"):
        memory_report(torch.zeros(3))
    with pytest.raises(TypeError, match="LowPrecGradAccumulator"):
        memory_report(model_of(), accumulator=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Optimizer"):
        memory_report(model_of(), optimizer=object())  # type: ignore[arg-type]
    assert memory_report().bytes() == 0 and memory_report().bytes_per_param() == 0.0


def test_device_filter_matches_devices_as_tensors_name_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rows carry str(tensor.device): CUDA tensors always have an index, CPU ones never do.
    r = MemoryReport(
        rows=(
            MemoryRow(device="cpu", role="master", dtype="float32", bytes=64, storages=1),
            MemoryRow(device="cuda:0", role="params", dtype="bfloat16", bytes=8, storages=1),
            MemoryRow(device="cuda:1", role="params", dtype="bfloat16", bytes=32, storages=1),
        ),
        parameters=4,
    )
    assert r.bytes(device="cpu") == r.bytes(device="cpu:0") == 64
    assert r.bytes(device=torch.device("cpu", 0)) == 64
    assert r.bytes(device="cuda:1") == r.bytes(device=torch.device("cuda", 1)) == 32
    # An index-less "cuda" is the current CUDA device, as torch.device("cuda") means when a
    # tensor is created there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert r.bytes(device="cuda") == r.bytes(device=torch.device("cuda")) == 32
    assert r.bytes_per_param("cuda") == 8.0
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert r.bytes(device="cuda") == 8
    assert r.bytes(device="meta") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_compute_device_holds_only_bf16_weights_after_step() -> None:
    model = model_of(torch.bfloat16, "cuda")
    ctx = ComputeCtx.new(DType.BF16, "cuda").replace(grad=DType.BF16, offload=torch.device("cpu"))
    acc = LowPrecGradAccumulator(model.parameters(), ctx)
    opt = OffloadedOptimizer(model.parameters(), ctx, lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    r = memory_report(model, optimizer=opt, accumulator=acc)
    cuda = str(next(iter(model.parameters())).device)
    assert r.bytes(device="cuda") == r.bytes(device=cuda) > 0
    assert r.bytes(device=cuda, role="grads") == 0
    assert r.bytes(device=cuda, dtype=torch.float32) == 0
    opt.ingest_grads(acc)
    opt.step()
    torch.cuda.synchronize()
    r = memory_report(model, optimizer=opt, accumulator=acc)
    p = n_params(model)
    assert r.by_device()[cuda]["optimizer_state"] == 0
    assert r.bytes(device=cuda) == 2 * p
    assert r.bytes(device="cpu", role="master") == 4 * p
