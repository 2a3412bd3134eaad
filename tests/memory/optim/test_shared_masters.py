"""OffloadedOptimizer over a model that already is its masters (f32 on the CPU, f32 masters
on the CPU): the masters share the model's storage, so no copy-back runs, and every
behaviour is the one of separate masters."""

from __future__ import annotations

import warnings

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import OffloadedOptimizer
from computectx.memory.accumulator import Transfer

CPU = ComputeCtx.parity("cpu")


def model_of(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)).to(dtype)


def backward(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    dtype = next(iter(model.parameters())).dtype
    loss = model(torch.randn(4, 6, dtype=dtype)).float().pow(2).mean()
    loss.backward()


def shares(opt: OffloadedOptimizer) -> list[bool]:
    return [
        p.data_ptr() == m.data_ptr()
        for p, m in zip(opt.compute_params, opt.master_params, strict=True)
    ]


def test_an_f32_cpu_model_is_its_own_masters_memory_and_steps_as_torch_fused() -> None:
    model, ref = model_of(), model_of()
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    assert all(shares(opt))
    assert all(m is not p for p, m in zip(opt.compute_params, opt.master_params, strict=True))
    for step in range(4):
        backward(model, step)
        backward(ref, step)
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
            assert p.grad is None
    assert all(shares(opt))


def test_a_skipped_step_leaves_a_shared_model_unchanged_bit_for_bit() -> None:
    model = model_of()
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)
    backward(model, 0)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
    backward(model, 1)
    next(iter(model.parameters())).grad[0, 0] = float("nan")  # type: ignore[index]
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert opt.last_step_skipped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    after = {k: v for s in opt.state.values() for k, v in s.items()}
    assert all(torch.equal(after[k], v) for k, v in state.items())


def test_param_data_swapped_parts_the_master_and_the_copy_back_resumes() -> None:
    model, ref = model_of(), model_of()
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    first = next(iter(model.parameters()))
    with torch.no_grad():
        first.data = first.detach().clone() + 1.0  # a new storage: an outside edit
        next(iter(ref.parameters())).add_(1.0)
    assert shares(opt)[0] is False
    for step in range(3):
        backward(model, step)
        backward(ref, step)
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
    assert torch.equal(opt.master_params[0], first)


@pytest.mark.parametrize(
    "case", ["bf16 model", "staged", "non-contiguous", "bf16 master", "view of a buffer"]
)
def test_masters_are_copies_where_the_model_is_not_what_they_would_be(case: str) -> None:
    model = model_of(torch.bfloat16 if case == "bf16 model" else torch.float32)
    if case == "non-contiguous":
        with torch.no_grad():
            lin = next(iter(model.children()))
            assert isinstance(lin, torch.nn.Linear)
            lin.weight = torch.nn.Parameter(lin.weight.detach().t().contiguous().t())
    if case == "view of a buffer":
        params = list(model.parameters())
        flat = torch.cat([q.detach().reshape(-1) for q in params])
        parts = torch.split(flat, [q.numel() for q in params])
        for q, part in zip(params, parts, strict=True):
            q.data = part.view_as(q)
    ctx = CPU.replace(master=DType.BF16) if case == "bf16 master" else CPU
    transfer: Transfer = "staged" if case == "staged" else "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = OffloadedOptimizer(model.parameters(), ctx, lr=1e-2, transfer=transfer)
    assert shares(opt)[0] is False
    backward(model, 0)
    opt.step()
    for p, m in zip(opt.compute_params, opt.master_params, strict=True):
        assert torch.equal(p, m.to(p.dtype))


def test_a_gradient_of_other_strides_reaches_the_master_in_its_layout() -> None:
    # A weight moved to channels_last (or given `.data` of other strides) after the optimizer
    # was built has gradients of its new strides; handed to torch's fused kernel with the
    # master's contiguous strides they were read element by element in the wrong places
    # (0.06 from torch's own AdamW after 3 steps). Now only the backward's own rounding of the
    # other layout remains (below 1e-6 here).
    from computectx.memory.optim._grad_ingest import add_grad

    master = torch.zeros(6, 4)
    g = torch.arange(24.0).reshape(4, 6).t()  # values [6, 4], transposed strides
    add_grad(master, g)
    assert master.grad is not None and master.grad.stride() == master.stride()
    assert torch.equal(master.grad, g)

    ctx = ComputeCtx.new(DType.F32, "cpu").replace(master=DType.F32, offload=torch.device("cpu"))

    def conv() -> torch.nn.Conv2d:
        torch.manual_seed(0)
        return torch.nn.Conv2d(4, 8, 3)

    model, ref = conv(), conv()
    opt = OffloadedOptimizer(model.parameters(), ctx, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    model.weight.data = model.weight.data.contiguous(memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 4, 10, 10, generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert (model.weight - ref.weight).abs().max() < 1e-6
