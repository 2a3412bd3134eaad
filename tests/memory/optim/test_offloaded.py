"""OffloadedOptimizer: differential tests against torch.optim, schedulers, checkpoints."""

from __future__ import annotations

import copy
import io
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, DType, Residency
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer, load_weights, save_weights
from computectx.memory.accumulator import Transfer

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


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Bitwise equal parameters: with f32 masters on the CPU the offloaded step runs the very
    kernels of the plain one (built with ``fused=True``, the kernel the f32 step runs) on the
    very same values."""
    same = [torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True)]
    assert all(same), f"parameters {same} differ by up to {max_diff(a, b)}"


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
    ref_opt = torch.optim.AdamW(groups_of(ref), betas=(0.9, 0.99), fused=True)
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
    assert_same_weights(ref, ours)
    # The LR really moved (the scheduler drove the master optimizer).
    if sched != "none":
        assert opt.param_groups[1]["lr"] != 1e-2


@pytest.mark.parametrize(
    ("cls", "kwargs", "how"),
    [
        # Unset fused/foreach: torch's fused kernel where the class has one, else foreach.
        (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}, {"fused": True}),
        (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "nesterov": True}, {"fused": True}),
        (torch.optim.RMSprop, {"lr": 1e-3}, {"foreach": True}),
        # The user's own choice runs as given.
        (torch.optim.AdamW, {"lr": 1e-2, "fused": True}, {}),
        (torch.optim.AdamW, {"lr": 1e-2, "foreach": False}, {}),
    ],
)
def test_any_torch_optimizer_class_matches_its_plain_twin(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], how: dict[str, bool]
) -> None:
    ref, data = model_and_data(1)
    ours, _ = model_and_data(1)
    build: Any = cls
    ref_opt = build(ref.parameters(), **kwargs, **how)
    opt = OffloadedOptimizer(ours.parameters(), CPU, cls, **kwargs)
    assert isinstance(opt.inner, cls)
    for x in data[:STEPS]:
        for m, o in ((ref, ref_opt), (ours, opt)):
            backward(loss_of(m, x))
            o.step()
            o.zero_grad()
    assert_same_weights(ref, ours)


def test_explicit_ingest_clip_step_matches_clip_grad_norm() -> None:
    ref, data = model_and_data(2)
    ours, _ = model_and_data(2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
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
        assert norm == ref_norm
    assert_same_weights(ref, ours)


def test_closure_is_evaluated_and_its_grads_ingested() -> None:
    ref, data = model_and_data(3)
    ours, _ = model_and_data(3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, fused=True)
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
    assert_same_weights(ref, ours)
    assert max_diff(ref, model_and_data(3)[0]) > 0


# ----- the accumulator path --------------------------------------------------------------


def test_f32_accumulator_with_three_micro_batches_matches_fp32_accumulation() -> None:
    ref, data = model_and_data(4)
    ours, _ = model_and_data(4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
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
    assert_same_weights(ref, ours)


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
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
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
    assert_same_weights(ref, ours)
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
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
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
            assert_same_weights(ref, ours)
        for m, o in ((ref, ref_opt), (ours, opt)):
            backward(loss_of(m, x))
            o.step()
            o.zero_grad()
    assert_same_weights(ref, ours)  # the old masters did not overwrite the new weights
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


@pytest.mark.parametrize("how", ["step", "clip", "accumulator"])
def test_a_step_with_non_finite_gradients_is_skipped_and_leaves_no_trace(how: str) -> None:
    # good, bad, good for ours; good, good for the reference: if the bad step is skipped and
    # touched neither weights nor optimizer state (AdamW's step count included), the two
    # end bitwise equal, without any call beyond the usual loop.
    ref, data = model_and_data(6)
    ours, _ = model_and_data(6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = OffloadedOptimizer(ours.parameters(), CPU, lr=1e-2)
    acc = None
    if how == "accumulator":
        acc = LowPrecGradAccumulator(ours.parameters(), CPU.replace(grad=DType.F32))

    def train_step(x: torch.Tensor, scale: float) -> float:
        backward(loss_of(ours, x) * scale)  # * inf: every gradient element inf or NaN
        if acc is not None:
            opt.ingest_grads(acc)
        norm = opt.clip_grad_norm(1.0) if how == "clip" else 0.0
        opt.step()
        opt.zero_grad()
        return norm

    for x in (data[0], data[2]):
        backward(loss_of(ref, x))
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()

    train_step(data[0], 1.0)
    after_first = [p.detach().clone() for p in ours.parameters()]
    state_steps = [float(st["step"]) for st in opt.state.values()]
    with pytest.warns(RuntimeWarning, match=r"skipped the update.*inf or NaN"):
        norm = train_step(data[1], math.inf)
    assert how != "clip" or not math.isfinite(norm)
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(after_first, ours.parameters(), strict=True))
    assert [float(st["step"]) for st in opt.state.values()] == state_steps
    assert all(mp.grad is None for mp in opt.master_params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(data[2], 1.0)
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    assert_same_weights(ref, ours)
    if acc is not None:
        acc.close()


def test_a_non_finite_norm_dropped_with_zero_grad_leaves_nothing_pending() -> None:
    # The caller may drop a bad step itself, as with a plain torch optimizer; the next good
    # gradients are then applied, not eaten by a skip left over from the bad norm.
    ref, data = model_and_data(19)
    ours, _ = model_and_data(19)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = OffloadedOptimizer(ours.parameters(), CPU, lr=1e-2)
    backward(loss_of(ours, data[0]) * math.inf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not math.isfinite(opt.clip_grad_norm(1.0))
        opt.zero_grad()
        backward(loss_of(ours, data[1]))
        opt.step()
    backward(loss_of(ref, data[1]))
    ref_opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 0
    assert_same_weights(ref, ours)
    assert [str(w.message) for w in caught] == []  # nothing was skipped, nothing to say


def test_step_decides_by_the_clip_norm_only_while_the_gradients_are_unchanged() -> None:
    # Finite gradients of ~1e30 overflow the 2-norm: clip_grad_norm reports inf (and scales
    # them to zero). A step decided by that norm skips; a step that looks at the (zero)
    # gradients themselves applies them, so the two decisions can be told apart.
    model, data = model_and_data(20)
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)

    def huge_gradients(x: torch.Tensor) -> None:
        backward(loss_of(model, x) * 1e30)
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
        assert math.isinf(opt.clip_grad_norm(1.0))

    before = [p.detach().clone() for p in model.parameters()]
    huge_gradients(data[0])
    with pytest.warns(RuntimeWarning, match="skipped the update"):
        opt.step()  # unchanged since clipping: the clip norm decides
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    huge_gradients(data[1])
    grad = opt.master_params[0].grad
    assert grad is not None
    grad.mul_(1.0)  # an in-place edit after clipping: the clip norm no longer applies
    opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.zero_grad()

    # Finite when clipped, then poisoned in place: the stale verdict is not used.
    backward(loss_of(model, data[2]))
    assert math.isfinite(opt.clip_grad_norm(math.inf))
    grad = opt.master_params[0].grad
    assert grad is not None
    grad[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="skipped the update"):
        opt.step()
    assert opt.skipped_steps == 2
    # Finite when clipped, then non-finite gradients ingested on top: checked again.
    backward(loss_of(model, data[3]))
    assert math.isfinite(opt.clip_grad_norm(math.inf))
    backward(loss_of(model, data[4]) * math.inf)
    with pytest.warns(RuntimeWarning, match="skipped the update"):
        opt.step()
    assert opt.skipped_steps == 3


def test_a_gradient_whose_norm_overflows_but_whose_squares_do_not_is_applied() -> None:
    # The unclipped check takes each gradient's norm; a gradient whose norm overflows while
    # every element's square is finite (|g| < 2**64) must still be applied, as torch does.
    p, ref = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt = OffloadedOptimizer([p], CPU, torch.optim.SGD, lr=1e-30)
    ref_opt = torch.optim.SGD([ref], lr=1e-30, fused=True)
    p.grad, ref.grad = torch.full((4,), 1.5e19), torch.full((4,), 1.5e19)
    assert math.isinf(float(torch.linalg.vector_norm(p.grad)))
    opt.step()
    ref_opt.step()
    assert not opt.last_step_skipped
    assert torch.equal(p, ref) and bool((p < 0).all())


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


@pytest.mark.parametrize("order", ["model_first", "optimizer_first", "optimizer_then_load_weights"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_state_dict_resume_is_bitwise_in_either_order(
    compute: torch.dtype, order: str, tmp_path: Any
) -> None:
    # The optimizer loaded first writes its masters into the model, and the model's load
    # then writes the same (rounded) weights again: an outside edit that changes nothing,
    # which must not replace the f32 masters by the bf16 weights.
    model, data = model_and_data(7)
    model.to(compute)
    opt = OffloadedOptimizer(model.parameters(), CPU, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    _train(model, opt, sched, data[:5])
    saved = _roundtrip(
        {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    )
    path = save_weights(model, tmp_path / "w.safetensors")
    _train(model, opt, sched, data[5:10])
    expected = [p.detach().clone() for p in model.parameters()]

    fresh, _ = model_and_data(99)  # different init: everything must come from the checkpoint
    fresh.to(compute)
    opt2 = OffloadedOptimizer(fresh.parameters(), CPU, lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.7)
    if order == "model_first":
        fresh.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
    elif order == "optimizer_first":
        opt2.load_state_dict(saved["opt"])
        fresh.load_state_dict(saved["model"])
    else:
        opt2.load_state_dict(saved["opt"])
        load_weights(fresh, path, CPU.replace(residency=Residency.DEVICE))  # swaps param.data
    sched2.load_state_dict(saved["sched"])
    _train(fresh, opt2, sched2, data[5:10])
    for a, b in zip(expected, fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resumes_from_a_plain_adamw_state_dict() -> None:
    ref, data = model_and_data(8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
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
    assert_same_weights(ref, ours)


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
    with pytest.raises(ValueError, match=r"'master_weights'\]\[0\] has shape \[3\], but the"):
        opt.load_state_dict(bad)
    half = dict(sd)
    half["master_weights"] = {**sd["master_weights"], 1: sd["master_weights"][1].half()}
    with pytest.raises(ValueError, match=r"\[1\] is torch.float16\[16\].*ctx.master=f32"):
        opt.load_state_dict(half)
    nan = dict(sd)
    nan["master_weights"] = {**sd["master_weights"], 2: sd["master_weights"][2].clone()}
    nan["master_weights"][2][3, 4] = math.nan
    with pytest.raises(
        ValueError, match=r"inf or NaN in 1 master weight.*: \[2\] \(shape \[16, 16\]\); every"
    ):
        opt.load_state_dict(nan)
    missing = dict(sd)
    missing["master_weights"] = {**sd["master_weights"], 3: [0.0] * 16}
    with pytest.raises(TypeError, match=r"\[3\] must be a tensor, got list"):
        opt.load_state_dict(missing)
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


def test_a_frozen_parameter_may_hold_inf_through_a_checkpoint() -> None:
    # Only trainable masters must be finite: a frozen parameter can be a mask of -inf.
    model, data = model_and_data(3)
    mask = torch.nn.Parameter(torch.tensor([0.0, -math.inf]), requires_grad=False)
    opt = OffloadedOptimizer([*model.parameters(), mask], CPU, lr=1e-2)
    backward(loss_of(model, data[0]))
    opt.step()
    sd = _roundtrip(opt.state_dict())
    mask.data = torch.zeros(2)
    opt.load_state_dict(sd)
    assert torch.equal(mask, torch.tensor([0.0, -math.inf]))
    sd["master_weights"][0] = sd["master_weights"][0].clone()
    sd["master_weights"][0][0, 0] = -math.inf  # a trainable one is refused
    with pytest.raises(ValueError, match=r"inf or NaN in 1 master weight"):
        opt.load_state_dict(sd)


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
    # Loading a state dict installs new groups and state; they stay shared, so a scheduler
    # built before the load still drives the learning rate the master step reads.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.load_state_dict(_roundtrip(opt.state_dict()))
    assert opt.param_groups is opt.inner.param_groups and opt.state is opt.inner.state
    assert opt.defaults is opt.inner.defaults
    backward(loss_of(model, data[1]))
    opt.step()
    sched.step()
    assert opt.inner.param_groups[0]["lr"] == 5e-3


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
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("saved"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("loading"))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "saved", "loading"]


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


def staging_addresses(opt: OffloadedOptimizer) -> set[int]:
    return {t.data_ptr() for role, t in opt.memory_tensors() if role == "staging"}


@pytest.mark.parametrize("transfer", ["staged", "blocking", "auto"])
def test_each_transfer_matches_plain_adamw_and_staging_reuses_its_buffers(
    transfer: Transfer,
) -> None:
    # "staged" takes the CUDA <-> CPU code path (staging buffers and their events) between
    # CPU tensors; "auto" and "blocking" copy directly, as auto does for any CPU pair.
    ref, data = model_and_data(13)
    ours, _ = model_and_data(13)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = OffloadedOptimizer(ours.parameters(), CPU, lr=1e-2, transfer=transfer)
    assert opt.transfer == transfer
    addresses: set[int] = set()
    for x in data[:STEPS]:
        for m, o in ((ref, ref_opt), (ours, opt)):
            backward(loss_of(m, x))
            o.step()
            o.zero_grad()
        addresses |= staging_addresses(opt)
    assert_same_weights(ref, ours)
    staged = 2 * len(opt.master_params) if transfer == "staged" else 0
    assert len(addresses) == staged  # one grad + one param buffer each, reused every step
    assert len(staging_addresses(opt)) == staged


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
    with pytest.raises(ValueError, match=r"'async'; accepted: 'auto', 'staged', 'blocking'"):
        OffloadedOptimizer(params, CPU, transfer="async")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown transfer None"):
        OffloadedOptimizer(params, CPU, transfer=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own check
        OffloadedOptimizer(params, CPU, lr=-1.0)
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


def _trained(cls: type[torch.optim.Optimizer], **kwargs: Any) -> OffloadedOptimizer:
    model, data = model_and_data(10)
    opt = OffloadedOptimizer(model.parameters(), CPU, cls, **kwargs)
    for x in data[:2]:
        backward(loss_of(model, x))
        opt.step()
        opt.zero_grad()
    return opt


def _step(opt: OffloadedOptimizer) -> None:
    for cp in opt.compute_params:
        cp.grad = torch.full_like(cp, 0.01)
    opt.step()


def _everything(opt: OffloadedOptimizer) -> list[Any]:
    sd = opt.state_dict()
    tensors = [mp.detach().clone() for mp in opt.master_params]
    tensors += [t.clone() for per in opt.state.values() for t in per.values()]
    tensors += [cp.detach().clone() for cp in opt.compute_params]
    return [tensors, [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]]


def _same_state(a: list[Any], b: list[Any]) -> bool:
    same_tensors = all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    return same_tensors and len(a[0]) == len(b[0]) and a[1] == b[1]


@pytest.mark.parametrize(
    ("saved_by", "saved_kwargs", "loaded_by", "loaded_kwargs"),
    [
        (torch.optim.AdamW, {}, torch.optim.SGD, {"momentum": 0.9}),
        (torch.optim.SGD, {"momentum": 0.9}, torch.optim.AdamW, {}),
        (torch.optim.Adamax, {}, torch.optim.Adam, {}),  # Adamax's options are a subset of Adam's
        (torch.optim.RAdam, {}, torch.optim.NAdam, {}),
    ],
)
def test_another_optimizer_classs_state_is_refused_naming_both(
    saved_by: type[torch.optim.Optimizer],
    saved_kwargs: dict[str, Any],
    loaded_by: type[torch.optim.Optimizer],
    loaded_kwargs: dict[str, Any],
) -> None:
    # torch optimizer state dicts name no class: without the check, torch's load_state_dict
    # replaced the groups with another class's and the next step failed (SGD: KeyError
    # 'momentum'). Refused before anything changes, ours and a plain torch optimizer's.
    saved = _roundtrip(_trained(saved_by, **saved_kwargs).state_dict())
    model, _ = model_and_data(11)
    plain = saved_by(model.parameters(), **saved_kwargs)
    backward(loss_of(model, torch.randn(8, 6)))
    plain.step()
    target = _trained(loaded_by, **loaded_kwargs)
    before = _everything(target)
    want = f"saved by torch.optim.{saved_by.__name__}, not torch.optim.{loaded_by.__name__}"
    for state in (saved, _roundtrip(plain.state_dict())):
        with pytest.raises(ValueError, match=re.escape(want)):
            target.load_state_dict(state)
        assert _same_state(_everything(target), before)
    _step(target)  # still steps with its own options


def test_the_same_class_loads_from_any_torch_version_and_with_a_scheduler() -> None:
    # What the class check must let through: a state of the same class whose groups lack an
    # option a newer torch added (an older checkpoint), carry a scheduler's keys, or come
    # from Adam into AdamW (the same options; AdamW is Adam with decoupled_weight_decay=True,
    # which loads as saved, as torch loads lr).
    source = _trained(torch.optim.AdamW, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(source, step_size=1)
    _step(source)
    scheduler.step()
    saved = _roundtrip(source.state_dict())
    assert "initial_lr" in saved["param_groups"][0]
    older = _roundtrip(source.state_dict())
    for group in older["param_groups"]:
        del group["decoupled_weight_decay"], group["fused"]
    adam = _roundtrip(_trained(torch.optim.Adam, lr=1e-2).state_dict())
    for state in (saved, older, adam):
        target = _trained(torch.optim.AdamW, lr=1e-2)
        target.load_state_dict(state)
        _step(target)
    sgd = _trained(torch.optim.SGD, momentum=0.9)
    sgd.load_state_dict(_roundtrip(_trained(torch.optim.SGD, momentum=0.5).state_dict()))
    assert sgd.param_groups[0]["momentum"] == 0.5  # a hyper-parameter loads as saved
