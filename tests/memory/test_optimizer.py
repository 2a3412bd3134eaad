"""OffloadedOptimizer: differential tests against torch.optim, schedulers, checkpoints."""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, DType, Residency
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer, load_weights, save_weights
from computectx.memory import optimizer as optimizer_mod

CPU = ComputeCtx.parity("cpu")
STEPS = 12

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped


def model_and_data(seed: int = 0) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2)
    )
    data = [torch.randn(8, 6) for _ in range(3 * STEPS)]
    return model, data


def groups_of(model: torch.nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [
        {"params": params[:2], "lr": 3e-3, "weight_decay": 0.1},
        {"params": params[2:], "lr": 1e-2},
    ]


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    dtype = next(iter(model.parameters())).dtype
    out: torch.Tensor = model(x.to(dtype))
    return out.float().sin().pow(2).mean()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


SCHEDULERS: dict[str, SchedulerFactory | None] = {
    "none": None,
    "steplr": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "lambdalr": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_matches_plain_adamw_step_for_step(sched: str) -> None:
    ref, data = model_and_data()
    ours, _ = model_and_data()
    ref_opt = torch.optim.AdamW(groups_of(ref), betas=(0.9, 0.99))
    opt = OffloadedOptimizer(groups_of(ours), CPU, betas=(0.9, 0.99))
    assert isinstance(opt, torch.optim.Optimizer)
    factory = SCHEDULERS[sched]
    ref_s = factory(ref_opt) if factory else None
    our_s = factory(opt) if factory else None
    for x in data[:STEPS]:
        for m, o, s in ((ref, ref_opt, ref_s), (ours, opt, our_s)):
            backward(loss_of(m, x))
            o.step()
            o.zero_grad()
            if s is not None:
                s.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert max_diff(ref, ours) <= 1e-6
    # The LR really moved (the scheduler drove the master optimizer).
    if sched != "none":
        assert opt.param_groups[1]["lr"] != 1e-2


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
        (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "nesterov": True}),
        (torch.optim.RMSprop, {"lr": 1e-3}),
        (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),  # fast on CPU masters
    ],
)
def test_any_torch_optimizer_class_matches_its_plain_twin(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    ref, data = model_and_data(1)
    ours, _ = model_and_data(1)
    ref_opt = cls(ref.parameters(), **kwargs)
    opt = OffloadedOptimizer(ours.parameters(), CPU, cls, **kwargs)
    assert isinstance(opt.inner, cls)
    for x in data[:STEPS]:
        for m, o in ((ref, ref_opt), (ours, opt)):
            backward(loss_of(m, x))
            o.step()
            o.zero_grad()
    assert max_diff(ref, ours) <= 1e-6


def test_explicit_ingest_clip_step_matches_clip_grad_norm() -> None:
    ref, data = model_and_data(2)
    ours, _ = model_and_data(2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadedOptimizer(ours.parameters(), CPU, lr=1e-2)
    for x in data[:STEPS]:
        backward(loss_of(ref, x))
        ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05))
        ref_opt.step()
        ref_opt.zero_grad()
        backward(loss_of(ours, x))
        opt.ingest_grads()
        assert all(p.grad is None for p in ours.parameters())
        norm = opt.clip_grad_norm(0.05)
        opt.step()
        opt.zero_grad()
        assert norm == pytest.approx(ref_norm, rel=1e-6)
    assert max_diff(ref, ours) <= 1e-6


def test_closure_is_evaluated_and_its_grads_ingested() -> None:
    ref, data = model_and_data(3)
    ours, _ = model_and_data(3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = OffloadedOptimizer(ours.parameters(), CPU, torch.optim.SGD, lr=0.1)
    x = data[0]

    def closure_for(m: torch.nn.Module, o: torch.optim.Optimizer) -> Callable[[], float]:
        def closure() -> float:
            o.zero_grad()
            loss = loss_of(m, x)
            backward(loss)
            return float(loss.detach())

        return closure

    assert opt.step(closure_for(ours, opt)) == ref_opt.step(closure_for(ref, ref_opt))
    assert max_diff(ref, ours) <= 1e-6 and max_diff(ref, model_and_data(3)[0]) > 0


# ----- the accumulator path --------------------------------------------------------------


def test_f32_accumulator_with_three_micro_batches_matches_fp32_accumulation() -> None:
    ref, data = model_and_data(4)
    ours, _ = model_and_data(4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadedOptimizer(ours.parameters(), CPU, lr=1e-2)
    acc = LowPrecGradAccumulator(ours.parameters(), CPU.replace(grad=DType.F32))
    for step in range(STEPS):
        xs = data[3 * step : 3 * step + 3]
        for x in xs:
            backward(loss_of(ref, x))
            backward(loss_of(ours, x))
        ref_opt.step()
        ref_opt.zero_grad()
        opt.ingest_grads(acc)
        opt.step()
        opt.zero_grad()
    assert max_diff(ref, ours) <= 1e-6


def test_bf16_accumulator_grads_stay_within_the_bound_every_step() -> None:
    """Each step's ingested master gradient vs the fp32 sum of the same micro-batches at the
    same weights, against ``error_bound(sum |g_k|, 3, bf16)``; both runs train on."""
    ours, data = model_and_data(5)
    ctx = CPU.replace(grad=DType.BF16)
    opt = OffloadedOptimizer(ours.parameters(), ctx, lr=1e-2)
    acc = LowPrecGradAccumulator(ours.parameters(), ctx)
    worst = 0.0
    for step in range(STEPS):
        xs = data[3 * step : 3 * step + 3]
        # Reference micro-batch gradients in fp32 at the current weights.
        per_batch = [torch.autograd.grad(loss_of(ours, x), list(ours.parameters())) for x in xs]
        for x in xs:
            backward(loss_of(ours, x))
        opt.ingest_grads(acc)
        for i, mp in enumerate(opt.master_params):
            gs = torch.stack([b[i] for b in per_batch]).double()
            assert mp.grad is not None and mp.grad.dtype == torch.float32
            err = (mp.grad.double() - gs.sum(0)).abs()
            bound = LowPrecGradAccumulator.error_bound(gs.abs().sum(0), 3, DType.BF16)
            assert bool((err <= bound).all()), (step, i)
            worst = max(worst, float((err / bound.clamp_min(1e-300)).max()))
        opt.step()
        opt.zero_grad()
    assert 0 < worst <= 1  # bf16 did round somewhere, and never beyond the bound


class TiedWithSpares(torch.nn.Module):
    """An embedding tied to the output head, a layer no forward uses, and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(12, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.head = torch.nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.frozen(self.mid(self.emb(ids)))))
        return out


def test_tied_unused_and_frozen_params_through_accumulator_and_optimizer() -> None:
    torch.manual_seed(15)
    ref = TiedWithSpares()
    ours = copy.deepcopy(ref)
    ids = [torch.randint(0, 12, (4, 5)) for _ in range(3 * 4)]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ctx = CPU.replace(grad=DType.F32)
    acc = LowPrecGradAccumulator(ours.parameters(), ctx)
    opt = OffloadedOptimizer(ours.parameters(), ctx, lr=1e-2)
    assert len(opt.master_params) == len(list(ref.parameters()))  # the tie is one parameter
    assert len(acc.params) == len(opt.master_params) - 2  # frozen weight and bias: no hooks
    unused_before = [p.detach().clone() for p in ours.unused.parameters()]
    for step in range(4):
        for x in ids[3 * step : 3 * step + 3]:
            backward(ref(x).sin().sum())
            backward(ours(x).sin().sum())
        ref_opt.step()
        ref_opt.zero_grad()
        assert acc.count(ours.unused.weight) == 0 and acc.count(ours.emb.weight) == 3
        opt.ingest_grads(acc)
        opt.step()
        opt.zero_grad()
    assert ours.head.weight is ours.emb.weight
    assert max_diff(ref, ours) <= 1e-6
    assert all(
        torch.equal(a, b) for a, b in zip(unused_before, ours.unused.parameters(), strict=True)
    )
    assert all(opt.master_of(p) not in opt.state for p in ours.unused.parameters())
    assert all(opt.master_of(p).grad is None for p in ours.frozen.parameters())
    acc.close()


@pytest.mark.parametrize("how", ["load_state_dict", "load_weights", "in_place", "data"])
def test_weights_changed_outside_the_optimizer_are_adopted(how: str, tmp_path: Any) -> None:
    ref, data = model_and_data(16)
    ours, _ = model_and_data(16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadedOptimizer(ours.parameters(), CPU, lr=1e-2)
    new_weights, _ = model_and_data(17)
    path = save_weights(new_weights, tmp_path / "w.safetensors")
    for step, x in enumerate(data[:6]):
        if step == 3:  # between steps, both models get other weights the same way
            for m in (ref, ours):
                if how == "load_state_dict":
                    m.load_state_dict(new_weights.state_dict())
                elif how == "load_weights":
                    load_weights(m, path, CPU.replace(residency=Residency.DEVICE))
                elif how == "in_place":
                    with torch.no_grad():
                        next(iter(m.parameters())).mul_(-2.0)
                else:
                    last = list(m.parameters())[-1]
                    last.data = last.data * 3.0
            assert max_diff(ref, ours) <= 1e-6
        for m, o in ((ref, ref_opt), (ours, opt)):
            backward(loss_of(m, x))
            o.step()
            o.zero_grad()
    assert max_diff(ref, ours) <= 1e-6  # the old masters did not overwrite the new weights
    assert max_diff(ours, model_and_data(16)[0]) > 0.1


def test_own_syncs_are_not_mistaken_for_outside_edits() -> None:
    # bf16 compute weights: adopting them would round the f32 masters to bf16.
    model, data = model_and_data(18)
    model.to(torch.bfloat16)
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-3)
    for x in data[:4]:
        backward(loss_of(model, x))
        opt.step()
        opt.zero_grad()
        opt.state_dict()
    rounded = [bool(torch.equal(mp, mp.bfloat16().float())) for mp in opt.master_params]
    assert not any(rounded)


# ----- non-finite gradients --------------------------------------------------------------


def test_non_finite_norm_skips_the_next_step_and_says_so() -> None:
    model, data = model_and_data(6)
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    backward(loss_of(model, data[0]))
    first = next(iter(model.parameters()))
    assert first.grad is not None
    first.grad[0, 0] = math.inf
    with pytest.warns(RuntimeWarning, match="next OffloadedOptimizer.step"):
        norm = opt.clip_grad_norm(1.0)
    assert math.isinf(norm) and opt.skip_next_step
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1 and not opt.skip_next_step
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(mp.grad is None for mp in opt.master_params)
    assert not opt.state  # the skipped step created no optimizer state
    loss_of(model, data[1]).backward()
    assert opt.clip_grad_norm(math.inf) > 0
    opt.step()
    assert not opt.last_step_skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ----- checkpoints -----------------------------------------------------------------------


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train(model: torch.nn.Module, opt: Any, sched: Any, xs: list[torch.Tensor]) -> None:
    for x in xs:
        backward(loss_of(model, x))
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_state_dict_resume_is_bitwise(compute: torch.dtype) -> None:
    model, data = model_and_data(7)
    model.to(compute)
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    _train(model, opt, sched, data[:5])
    saved = _roundtrip(
        {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    )
    _train(model, opt, sched, data[5:10])
    expected = [p.detach().clone() for p in model.parameters()]

    fresh, _ = model_and_data(99)  # different init: everything must come from the checkpoint
    fresh.to(compute)
    fresh.load_state_dict(saved["model"])
    opt2 = OffloadedOptimizer(fresh.parameters(), CPU, lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.7)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    _train(fresh, opt2, sched2, data[5:10])
    for a, b in zip(expected, fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resumes_from_a_plain_adamw_state_dict() -> None:
    ref, data = model_and_data(8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x in data[:4]:
        backward(loss_of(ref, x))
        ref_opt.step()
        ref_opt.zero_grad()
    ours, _ = model_and_data(8)
    ours.load_state_dict(ref.state_dict())
    opt = OffloadedOptimizer(ours.parameters(), CPU, lr=1e-2)
    opt.load_state_dict(_roundtrip(ref_opt.state_dict()))
    for x in data[4:8]:
        for m, o in ((ref, ref_opt), (ours, opt)):
            backward(loss_of(m, x))
            o.step()
            o.zero_grad()
    assert max_diff(ref, ours) <= 1e-6


def test_bad_state_dict_changes_nothing() -> None:
    model, data = model_and_data(9)
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)
    backward(loss_of(model, data[0]))
    opt.step()
    sd = _roundtrip(opt.state_dict())
    masters = [mp.detach().clone() for mp in opt.master_params]
    step0 = float(next(iter(opt.state.values()))["step"])
    bad = dict(sd)
    bad["master_weights"] = {**sd["master_weights"], 0: torch.zeros(3)}
    with pytest.raises(ValueError, match=r"master_weights.*\[0\].*float32\[3\]"):
        opt.load_state_dict(bad)
    short = dict(sd)
    short["master_weights"] = {0: sd["master_weights"][0]}
    with pytest.raises(ValueError, match=r"missing indices \[1, 2, 3, 4, 5\]"):
        opt.load_state_dict(short)
    groups = dict(sd)
    groups["param_groups"] = sd["param_groups"][:0]
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict(groups)
    with pytest.raises(ValueError, match="'state'"):
        opt.load_state_dict({"param_groups": sd["param_groups"]})
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_params, strict=True))
    assert float(next(iter(opt.state.values()))["step"]) == step0


# ----- ecosystem details -----------------------------------------------------------------


def test_one_set_of_groups_and_state() -> None:
    model, data = model_and_data(10)
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)
    assert opt.param_groups is opt.inner.param_groups
    assert opt.defaults is opt.inner.defaults
    backward(loss_of(model, data[0]))
    opt.step()
    assert opt.state is opt.inner.state
    keys = list(opt.state)
    assert len(keys) == len(opt.master_params)
    assert all(any(k is mp for mp in opt.master_params) for k in keys)
    assert not any(k is p for k in keys for p in model.parameters())
    assert "OffloadedOptimizer(master=f32, device=cpu" in repr(opt)


def test_step_hooks_fire_and_zero_grad_clears_both_sides() -> None:
    model, data = model_and_data(11)
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    backward(loss_of(model, data[0]))
    opt.ingest_grads()
    backward(loss_of(model, data[1]))  # a second backward leaves grads on the model too
    assert all(mp.grad is not None for mp in opt.master_params)
    opt.zero_grad()
    assert all(mp.grad is None for mp in opt.master_params)
    assert all(p.grad is None for p in model.parameters())
    backward(loss_of(model, data[0]))
    opt.step()
    assert calls == ["pre", "post"]


def test_add_param_group_adds_masters_and_rejects_duplicates() -> None:
    model, data = model_and_data(12)
    params = list(model.parameters())
    opt = OffloadedOptimizer(params[:2], CPU, lr=1e-2)
    opt.add_param_group({"params": params[2:], "lr": 5e-3})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5])
    assert len(opt.param_groups) == 2 and len(opt.master_params) == len(params)
    assert opt.param_groups[1]["lr"] == 5e-3 * 0.5  # the scheduler drives the new group
    with pytest.raises(ValueError, match="more than once"):
        opt.add_param_group({"params": params[:1]})
    with pytest.raises(ValueError, match="'params'"):
        opt.add_param_group({"lr": 1.0})
    assert len(opt.master_params) == len(params)
    before = [p.detach().clone() for p in params]
    backward(loss_of(model, data[0]))
    opt.step()
    sched.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, params, strict=True))


def test_staged_route_on_the_cpu_path_matches_and_reuses_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Force the CUDA <-> CPU code path (staging buffers + events) on CPU tensors.
    ref, data = model_and_data(13)
    ours, _ = model_and_data(13)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = OffloadedOptimizer(ours.parameters(), CPU, lr=1e-2)
    monkeypatch.setattr(optimizer_mod, "_route", lambda compute, host: True)
    addresses: set[int] = set()
    for x in data[:STEPS]:
        for m, o in ((ref, ref_opt), (ours, opt)):
            backward(loss_of(m, x))
            o.step()
            o.zero_grad()
        addresses |= {st.buffer.data_ptr() for st in opt._param_staging.values()}
        addresses |= {st.buffer.data_ptr() for st in opt._grad_staging.values()}
    assert max_diff(ref, ours) <= 1e-6
    assert len(addresses) == 2 * len(opt.master_params)  # one grad + one param buffer each


def test_step_without_ingesting_the_accumulator_warns() -> None:
    model, data = model_and_data(14)
    ctx = CPU.replace(grad=DType.BF16)
    acc = LowPrecGradAccumulator(model.parameters(), ctx)
    opt = OffloadedOptimizer(model.parameters(), ctx, lr=1e-2)
    backward(loss_of(model, data[0]))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match=r"ingest_grads\(accumulator\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.ingest_grads(acc)
    opt.step()
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bad_arguments_raise_clear_errors() -> None:
    model, _ = model_and_data()
    params = list(model.parameters())
    with pytest.raises(TypeError, match="ComputeCtx"):
        OffloadedOptimizer(params, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Optimizer subclass"):
        OffloadedOptimizer(params, CPU, dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="LBFGS"):
        OffloadedOptimizer(params, CPU, torch.optim.LBFGS)
    with pytest.raises(ValueError, match="empty"):
        OffloadedOptimizer([], CPU)
    with pytest.raises(TypeError, match=r"model\.parameters\(\)"):
        OffloadedOptimizer(model, CPU)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a leaf"):
        OffloadedOptimizer([params[0] * 2], CPU)
    with pytest.raises(TypeError, match="int64"):
        OffloadedOptimizer([torch.zeros(2, dtype=torch.int64)], CPU)
    with pytest.raises(ValueError, match="more than once"):
        OffloadedOptimizer([params[0], params[0]], CPU)
    with pytest.raises(TypeError, match="mixes"):
        OffloadedOptimizer([params[0], {"params": params[1:]}], CPU)  # type: ignore[arg-type]
    opt = OffloadedOptimizer(params, CPU)
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm(0.0)
    with pytest.raises(TypeError, match="max_norm"):
        opt.clip_grad_norm("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LowPrecGradAccumulator"):
        opt.ingest_grads(object())  # type: ignore[arg-type]
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="tracks none"):
        opt.ingest_grads(LowPrecGradAccumulator(other.parameters(), CPU))
    with pytest.raises(TypeError, match="pickled"):
        copy.deepcopy(opt)
