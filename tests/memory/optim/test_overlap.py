"""The overlapped offloaded step (``OffloadedOptimizer(..., overlap=True)``), run on the CPU
with ``HostLanes`` standing in for the side stream: a download lands only when waited on and
reads NaN until then, so a step that read a gradient before its copy landed would differ.

Each test runs the same training twice, serial (``overlap=False``) and overlapped, and asserts
the weights, the master gradients' effect and ``state_dict`` equal bit for bit.
"""

from __future__ import annotations

import inspect
import random
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer
from computectx.memory.optim import _masters, offloaded
from computectx.memory.optim._overlap import HostLanes

CTX = ComputeCtx.parity("cpu")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)
        self.unused = torch.nn.Parameter(torch.ones(4))  # never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.tanh(self.a(x)))
        return out


def net(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def batches(step: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 6, generator=gen).to(dtype) for _ in range(k)]


def backward(m: Net, xs: list[torch.Tensor], scale: float = 1.0) -> None:
    for x in xs:
        (m(x).square().mean() * scale).backward()


def state_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            state_equal(x, y)
    else:
        assert a == b or (a != a and b != b), (a, b)


def same(m1: Net, o1: OffloadedOptimizer, m2: Net, o2: OffloadedOptimizer) -> None:
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach())
    state_equal(o1.state_dict(), o2.state_dict())
    assert o1.skipped_steps == o2.skipped_steps


Plan = list[tuple[int, float, float | None, bool]]  # (micro-batches, loss scale, clip, set_to_none)

PLAN: Plan = [
    (1, 1.0, None, True),
    (1, 1.0, 0.05, True),  # a clip that scales
    (3, 1.0, None, True),  # accumulation: the hooks expected 1, the host adds the surplus
    (3, 1.0, 0.05, False),  # ... and now expect 3: autograd sums, one download each
    (3, float("nan"), None, True),  # skipped
    (1, 1.0, 10.0, True),  # a clip that does not scale
    (1, float("inf"), 1.0, True),  # a clip that measures inf: skipped
    (2, 1.0, None, False),
]


def run(
    m: Net,
    opt: OffloadedOptimizer,
    plan: Plan,
    sched: torch.optim.lr_scheduler.LRScheduler | None,
    start: int = 0,
    dtype: torch.dtype = torch.float32,
) -> None:
    for step, (k, scale, clip, to_none) in enumerate(plan, start):
        backward(m, batches(step, k, dtype), scale)
        if clip is not None:
            opt.clip_grad_norm(clip)
        with pytest.warns(RuntimeWarning) if scale != 1.0 else Nothing():
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=to_none)


class Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def pair(
    transfer: str = "staged", ctx: ComputeCtx = CTX, dtype: torch.dtype = torch.float32
) -> tuple[Net, OffloadedOptimizer, Net, OffloadedOptimizer]:
    m1, m2 = net(dtype), net(dtype)
    o1 = OffloadedOptimizer(m1.parameters(), ctx, transfer=transfer, overlap=False, lr=0.05)  # type: ignore[arg-type]
    o2 = OffloadedOptimizer(m2.parameters(), ctx, transfer=transfer, overlap=True, lr=0.05)  # type: ignore[arg-type]
    assert not o1.overlap and o2.overlap
    return m1, o1, m2, o2


@pytest.mark.parametrize("transfer", ["staged", "auto"])
def test_overlapped_equals_serial_bit_for_bit_with_clip_skip_scheduler_accumulation(
    transfer: str,
) -> None:
    m1, o1, m2, o2 = pair(transfer)
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=2, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=2, gamma=0.5)
    for step, entry in enumerate(PLAN):
        run(m1, o1, [entry], s1, start=step)
        run(m2, o2, [entry], s2, start=step)
        same(m1, o1, m2, o2)
    assert o2.skipped_steps == 2
    assert o2.master_of(m2.unused).grad is None


@pytest.mark.parametrize("near_below", [10, 4096])
def test_small_tensors_stepped_where_they_are_equal_serial(
    near_below: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CPU stands in for the device: parameters under near_below elements keep their
    # masters where they are and their gradients are not copied (the biases at 10, all at 4096).
    monkeypatch.setattr(_masters, "NEAR_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(offloaded, "NEAR_BELOW", near_below)
    m1, o1, m2, o2 = pair()
    for step, entry in enumerate(PLAN):
        run(m1, o1, [entry], None, start=step)
        run(m2, o2, [entry], None, start=step)
        same(m1, o1, m2, o2)
    assert o2._overlap is not None
    downloaded = {ptr for lanes in o2._overlap._lanes.values() for _, ptr in lanes.log}  # type: ignore[attr-defined]
    assert len(downloaded) == (2 if near_below == 10 else 0)


def test_a_steady_loop_takes_the_fast_path_and_lands_in_firing_order() -> None:
    m1, o1, m2, o2 = pair()
    run(m1, o1, [(2, 1.0, None, True)] * 3, None)
    run(m2, o2, [(2, 1.0, None, True)] * 2, None)  # the hooks learn: 2 firings a step
    assert o2._overlap is not None
    (lanes,) = o2._overlap._lanes.values()
    assert isinstance(lanes, HostLanes)
    lanes.log.clear()
    backward(m2, batches(2, 2, torch.float32))
    assert o2._fast()  # one download per parameter, nothing else
    downloads = [ptr for what, ptr in lanes.log if what == "download"]
    assert len(downloads) == 4 and not any(what == "landed" for what, _ in lanes.log)
    calls = 0
    inner_step = o2.inner.step

    def counted(*a: Any, **k: Any) -> Any:
        nonlocal calls
        calls += 1
        return inner_step(*a, **k)

    o2.inner.step = counted  # type: ignore[method-assign]
    o2.step()
    o2.zero_grad()
    assert calls == 4  # one inner step per parameter with a gradient, as each lands
    # The backward fired the last layer first; each landed when its turn came.
    assert [ptr for what, ptr in lanes.log if what == "landed"] == downloads
    same(m1, o1, m2, o2)


def test_hooks_firing_in_any_order_step_as_serial() -> None:
    m1, o1, m2, o2 = pair()
    params2 = list(m2.parameters())
    for step in range(4):
        x = batches(step, 1, torch.float32)[0]
        for m in (m1, m2):
            loss = m(x).square().mean()
            grads = torch.autograd.grad(loss, [m.a.weight, m.a.bias, m.b.weight, m.b.bias])
            named = dict(zip(["a.weight", "a.bias", "b.weight", "b.bias"], grads, strict=True))
            order = list(named)
            random.Random(step).shuffle(order)
            for name in order:
                p = m.get_parameter(name)
                p.grad = named[name]
                if m is m2:  # the backward would fire the hooks; here in a shuffled order
                    for hook in list((p._post_accumulate_grad_hooks or {}).values()):
                        hook(p)
        assert all(p.grad is None for p in params2)
        o1.step()
        o2.step()
        same(m1, o1, m2, o2)


def test_resume_from_a_checkpoint_taken_between_overlapped_steps() -> None:
    m1, o1, m2, o2 = pair()
    run(m1, o1, PLAN, None)
    run(m2, o2, PLAN[:4], None)
    sd = o2.state_dict()
    m3 = net()
    m3.load_state_dict(m2.state_dict())
    o3 = OffloadedOptimizer(m3.parameters(), CTX, transfer="staged", overlap=True, lr=0.05)
    o3.load_state_dict(sd)
    run(m3, o3, PLAN[4:], None, start=4)
    same(m1, o1, m3, o3)


def test_a_skipped_overlapped_step_changes_nothing() -> None:
    _, _, m2, o2 = pair()
    run(m2, o2, PLAN[:2], None)
    before = [p.detach().clone() for p in m2.parameters()]
    sd = o2.state_dict()
    backward(m2, batches(9, 1, torch.float32))
    assert o2._fast()
    next(iter(o2._overlap._pending.values())).landing.wait()  # type: ignore[union-attr]
    m2.b.weight.grad = None
    # A NaN arriving in a hook of its own: the norms say so before any master moves.
    m2.b.weight.grad = torch.full_like(m2.b.weight, float("nan"))
    for hook in (m2.b.weight._post_accumulate_grad_hooks or {}).values():
        hook(m2.b.weight)
    with pytest.warns(RuntimeWarning, match="skipped"):
        o2.step()
    for p, b in zip(m2.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)
    state_equal(o2.state_dict(), sd)


def test_a_second_clip_measures_the_clipped_gradients() -> None:
    m1, o1, m2, o2 = pair()
    norms = []
    for m, o in ((m1, o1), (m2, o2)):
        backward(m, batches(0, 1, torch.float32))
        norms.append((o.clip_grad_norm(0.05), o.clip_grad_norm(0.01)))
        o.step()
    assert norms[0] == norms[1] and norms[0][1] < 0.06
    same(m1, o1, m2, o2)


def test_a_group_added_later_is_overlapped_too() -> None:
    m1, o1, m2, o2 = pair()
    extras = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))]
    for o, extra in zip((o1, o2), extras, strict=True):
        o.add_param_group({"params": [extra], "lr": 0.1})
        assert len(extra._post_accumulate_grad_hooks or {}) == (1 if o.overlap else 0)
    for step in range(3):
        for m, o, extra in zip((m1, m2), (o1, o2), extras, strict=True):
            (m(batches(step, 1, torch.float32)[0]).sum() * extra.sum()).backward()
            o.step()
            o.zero_grad()
        same(m1, o1, m2, o2)
        assert torch.equal(extras[0], extras[1])


@pytest.mark.parametrize("k", [1, 2])
def test_a_backward_after_a_clip_adds_to_the_clipped_gradients(k: int) -> None:
    m1, o1, m2, o2 = pair()
    for step in range(3):
        for m, o in ((m1, o1), (m2, o2)):
            backward(m, batches(step, k, torch.float32))
            o.clip_grad_norm(0.05)
            backward(m, batches(step + 10, 1, torch.float32))
            o.step()
            o.zero_grad()
        same(m1, o1, m2, o2)


def test_a_gradient_left_in_param_grad_takes_the_serial_path() -> None:
    m1, o1, m2, o2 = pair()
    for m, o in ((m1, o1), (m2, o2)):
        backward(m, batches(0, 1, torch.float32))
        m.unused.grad = torch.full_like(m.unused, 0.5)  # no hook fired for it
        o.step()
        o.zero_grad(set_to_none=False)
    same(m1, o1, m2, o2)


def test_an_accumulator_keeps_its_parameters() -> None:
    m1, o1, m2, o2 = pair()
    grad_ctx = CTX.replace(grad=DType.F32)
    a1 = LowPrecGradAccumulator(m1.parameters(), grad_ctx)
    a2 = LowPrecGradAccumulator(m2.parameters(), grad_ctx)
    for step in range(2):
        for m, o, a in ((m1, o1, a1), (m2, o2, a2)):
            backward(m, batches(step, 2, torch.float32))
            o.ingest_grads(a)
            o.step()
            o.zero_grad()
    same(m1, o1, m2, o2)
    a1.close()
    a2.close()


@pytest.mark.parametrize("what", ["bf16 model", "int8 state"])
def test_stepper_and_widened_masters_land_then_step_as_serial(what: str) -> None:
    if what == "bf16 model":
        m1, o1, m2, o2 = pair(dtype=torch.bfloat16)
        dtype = torch.bfloat16
    else:
        m1, o1, m2, o2 = pair(ctx=CTX.with_optim_state("int8"))
        dtype = torch.float32
    run(m1, o1, PLAN[:5], None, dtype=dtype)
    run(m2, o2, PLAN[:5], None, dtype=dtype)
    same(m1, o1, m2, o2)


def test_the_option_is_off_by_default_and_checked() -> None:
    m = net()
    default = inspect.signature(OffloadedOptimizer).parameters["overlap"].default
    assert default is False  # opt-in: it changes what the loop sees (param.grad is None)
    assert not OffloadedOptimizer(m.parameters(), CTX).overlap
    assert not any(p._post_accumulate_grad_hooks for p in m.parameters())
    assert OffloadedOptimizer(m.parameters(), CTX, overlap=True).overlap
    for bad in ("yes", None, 1):
        with pytest.raises(TypeError, match="overlap must be True or False"):
            OffloadedOptimizer(m.parameters(), CTX, overlap=bad)  # type: ignore[arg-type]

    class Shards:
        def local(self, t: torch.Tensor) -> torch.Tensor:
            return t

        def all_reduce(self, values: torch.Tensor, op: str) -> torch.Tensor:
            return values

    with pytest.raises(ValueError, match="does not compose with a sharding yet"):
        OffloadedOptimizer(m.parameters(), CTX, sharding=Shards(), overlap=True)
    assert not OffloadedOptimizer(m.parameters(), CTX, sharding=Shards()).overlap


def test_the_gpu_check_section_runs_its_cpu_smoke() -> None:
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[3] / "bench" / "gpu_check_optim.py"
    spec = importlib.util.spec_from_file_location("gpu_check_optim_overlap", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rows = module.section_offload_overlap(torch.device("cpu"), smoke=True, reps=1)
    assert {r["op"] for r in rows} == {
        "no offload (torch AdamW fused on the device)",
        "offload, serial",
        "offload, overlapped",
    }
    assert all(r["step_ms"] > 0 for r in rows)
    assert module.section_offload_overlap(torch.device("cpu"), smoke=False, reps=1) == [
        {"skipped": "no CUDA device"}
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_overlapped_step_equals_the_serial_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(offloaded, "NEAR_BELOW", 10)  # the weights go down, the biases stay
    ctx = ComputeCtx.new(DType.F32, "cuda").replace(offload=torch.device("cpu"))
    models = [net().cuda(), net().cuda()]
    opts = [
        OffloadedOptimizer(m.parameters(), ctx, overlap=overlap, lr=0.05)
        for m, overlap in zip(models, (False, True), strict=True)
    ]
    assert not opts[0].overlap and opts[1].overlap
    assert not OffloadedOptimizer(net().cuda().parameters(), ctx).overlap  # off by default
    devices = [mp.device.type for mp in opts[1].master_params]
    assert devices == ["cuda", "cpu", "cuda", "cpu", "cuda"]  # unused, a.w, a.b, b.w, b.b
    exact = True  # until a clip: the device's norm, not the host's, so the last bits may differ
    for step, (k, scale, clip, to_none) in enumerate(PLAN):
        for m, o in zip(models, opts, strict=True):
            backward(m, [x.cuda() for x in batches(step, k, torch.float32)], scale)
            if o.overlap and o._fast():
                assert all(p.grad is None for p in m.parameters())  # moved down in the hooks
            if clip is not None:
                o.clip_grad_norm(clip)
            with pytest.warns(RuntimeWarning) if scale != 1.0 else Nothing():
                o.step()
            o.zero_grad(set_to_none=to_none)
        torch.cuda.synchronize()
        exact = exact and clip is None
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            if exact:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
