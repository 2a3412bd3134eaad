"""CompactOptimizer and OffloadedOptimizer over compact state: refusals, schedulers, clipping,
the accumulator, non-finite skips, stochastic rounding of bf16 weights, the scratch bound,
bytes per parameter, identical ranks, the fused path against torch's own update."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import (
    CompactOptimizer,
    LowPrecGradAccumulator,
    OffloadedOptimizer,
    memory_report,
)

CPU = ComputeCtx.parity("cpu")
INT8 = CPU.with_optim_state("int8/min=0")

Optim = CompactOptimizer | OffloadedOptimizer


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def batch(i: int) -> torch.Tensor:
    return torch.randn(8, 12, generator=torch.Generator().manual_seed(100 + i))


def loss_of(model: torch.nn.Module, i: int) -> torch.Tensor:
    x = batch(i)
    out: torch.Tensor = model(x)
    return (out - x[:, :3]).pow(2).mean()


def build(kind: str, model: torch.nn.Module, ctx: ComputeCtx, cls: Any, **kw: Any) -> Optim:
    wrapper = CompactOptimizer if kind == "compact" else OffloadedOptimizer
    return wrapper(model.parameters(), ctx, cls, **kw)


def bits(opt: Optim, model: torch.nn.Module) -> list[torch.Tensor]:
    """Weights, masters and stored state, as raw bytes."""
    out = [p.detach().reshape(-1).view(torch.uint8).clone() for p in model.parameters()]
    if isinstance(opt, OffloadedOptimizer):
        out += [mp.detach().reshape(-1).view(torch.uint8).clone() for mp in opt.master_params]
    for entry in opt.state.values():
        out += [v.reshape(-1).view(torch.uint8).clone() for v in entry.values()]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


KINDS = ["compact", "offloaded"]


# ----- what is refused -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_classes_whose_state_does_not_fit_are_refused_by_name(kind: str) -> None:
    params = torch.nn.Linear(4, 4).parameters
    with pytest.raises(
        ValueError,
        match=r"torch\.optim\.Adafactor keeps state 'row_var' as a tensor of shape \[4, 1\] "
        r"for a parameter of shape \[4, 3\]",
    ):
        build(kind, torch.nn.Linear(4, 4), INT8, torch.optim.Adafactor)
    with pytest.raises(ValueError, match=r"torch\.optim\.SparseAdam is refused: .*sparse"):
        build(kind, torch.nn.Linear(4, 4), INT8, torch.optim.SparseAdam)
    with pytest.raises(ValueError, match="LBFGS"):
        build(kind, torch.nn.Linear(4, 4), INT8, torch.optim.LBFGS)
    # A bf16 weight is stepped by the same engine (stochastic rounding): refused too.
    bf16 = torch.nn.Linear(4, 4).to(torch.bfloat16)
    if kind == "compact":
        with pytest.raises(ValueError, match="Adafactor keeps state 'row_var'"):
            CompactOptimizer(bf16.parameters(), CPU, torch.optim.Adafactor)
    else:
        with pytest.raises(ValueError, match="Adafactor keeps state 'row_var'"):
            OffloadedOptimizer(params(), CPU.replace(master=DType.BF16), torch.optim.Adafactor)
    # f32 state and f32 weights: torch's own step, any class.
    opt = build(kind, torch.nn.Linear(4, 4), CPU, torch.optim.Adafactor)
    assert opt.stepper is None


def test_f32_compact_optimizer_is_the_plain_torch_optimizer() -> None:
    ref, ours = make_model(1), make_model(1)
    # f32 state steps with torch's fused kernel: the plain optimizer built with fused=True.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = CompactOptimizer(ours.parameters(), CPU, lr=1e-2)
    assert opt.stepper is None and opt.param_groups is opt.inner.param_groups
    for i in range(3):
        for m, o in ((ref, ref_opt), (ours, opt)):
            backward(loss_of(m, i))
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), ours.parameters(), strict=True))


def test_bad_arguments() -> None:
    params = list(make_model().parameters())
    with pytest.raises(TypeError, match="seed must be an int"):
        CompactOptimizer(params, INT8, seed=True)
    with pytest.raises(TypeError, match="compile must be True, False or None"):
        OffloadedOptimizer(params, INT8, compile="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ComputeCtx"):
        CompactOptimizer(params, "int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot itself be a CompactOptimizer"):
        CompactOptimizer(params, INT8, CompactOptimizer)
    with pytest.raises(ValueError, match="more than once"):
        CompactOptimizer([params[0], params[0]], INT8)


# ----- composition -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_lr_scheduler_drives_the_step(kind: str) -> None:
    # A scheduler halving lr every step equals halving it by hand, and differs from none.
    runs = []
    for how in ("scheduler", "by_hand", "none"):
        model = make_model(2)
        opt = build(kind, model, INT8, torch.optim.SGD, lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for i in range(4):
            backward(loss_of(model, i))
            opt.step()
            opt.zero_grad()
            if how == "scheduler":
                sched.step()
            elif how == "by_hand":
                opt.param_groups[0]["lr"] *= 0.5
        runs.append(bits(opt, model))
    assert same(runs[0], runs[1]) and not same(runs[0], runs[2])


@pytest.mark.parametrize("kind", KINDS)
def test_clip_grad_norm_clips_what_the_step_reads(kind: str) -> None:
    results, norms = [], []
    for how in ("ours", "torch"):
        model = make_model(3)
        opt = build(kind, model, INT8, torch.optim.AdamW, lr=1e-2)
        for i in range(3):
            backward(loss_of(model, i))
            if how == "ours":
                norms.append(opt.clip_grad_norm(0.05))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.05)))
            opt.step()
            opt.zero_grad()
        results.append(bits(opt, model))
    assert norms[:3] == norms[3:] and min(norms) > 0.05  # it did clip
    assert same(results[0], results[1])


def test_accumulator_ingest_matches_summing_in_param_grad() -> None:
    ctx = INT8.replace(grad=DType.F32)
    results = []
    for use_acc in (True, False):
        model = make_model(4)
        opt = OffloadedOptimizer(model.parameters(), ctx, torch.optim.RMSprop, lr=1e-3)
        acc = LowPrecGradAccumulator(model.parameters(), ctx) if use_acc else None
        for step in range(3):
            for i in range(3):
                backward(loss_of(model, 3 * step + i))
            if acc is not None:
                opt.ingest_grads(acc)
            opt.step()
            opt.zero_grad()
        if acc is not None:
            acc.close()
        results.append(bits(opt, model))
    assert same(results[0], results[1])


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_gradients_skip_without_touching_weights_or_state(kind: str) -> None:
    model = make_model(5)
    opt = build(kind, model, INT8.replace(master=DType.BF16), torch.optim.AdamW, lr=1e-2)
    backward(loss_of(model, 0))
    opt.step()
    opt.zero_grad()
    before = bits(opt, model)
    rounding = opt.state_dict().get("master_rounding")
    backward(loss_of(model, 1) * math.inf)
    with pytest.warns(RuntimeWarning, match=r"skipped the update.*inf or NaN"):
        opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert same(before, bits(opt, model))
    if rounding is not None:  # no rounding was drawn either
        after = opt.state_dict()["master_rounding"]
        assert all(torch.equal(rounding[k], after[k]) for k in rounding)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backward(loss_of(model, 2))
        opt.step()
    assert not opt.last_step_skipped and not same(before, bits(opt, model))


# ----- bf16 weights ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_stochastic_rounding_moves_bf16_weights_where_nearest_stalls(kind: str) -> None:
    # lr * grad = 1e-3 is under half a bf16 ulp of the weights (2**-8 at 1.0, 2**-9 below):
    # round-to-nearest never moves them; stochastic rounding moves them by 1e-3 per step on
    # average. After 40 steps the mean of 4096 weights is 0.96 in expectation, and each
    # step's rounding adds a variance under (ulp/2)**2 per weight: the mean's standard
    # deviation is under sqrt(40) * 2**-9 / sqrt(4096) = 2e-4; 0.004 is 20 of them.
    n, steps, lr = 4096, 40, 1e-3
    plain = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    nearest = torch.optim.SGD([plain], lr=lr)
    weight: torch.Tensor
    if kind == "compact":
        w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
        opt: Optim = CompactOptimizer([w], CPU, torch.optim.SGD, lr=lr, seed=3)
        weight = w
    else:
        w = torch.nn.Parameter(torch.ones(n))
        opt = OffloadedOptimizer([w], CPU.replace(master=DType.BF16), torch.optim.SGD, lr=lr)
        weight = opt.master_params[0]
    assert weight.dtype == torch.bfloat16
    for _ in range(steps):
        plain.grad = torch.ones_like(plain)
        nearest.step()
        w.grad = torch.ones_like(w)
        opt.step()
        opt.zero_grad()
    assert bool((plain == 1.0).all())  # nearest rounding stalled
    mean = float(weight.detach().double().mean())
    assert abs(mean - (1.0 - steps * lr)) < 0.004, mean


def test_the_same_seed_gives_every_rank_the_same_masters() -> None:
    # DDP ranks see the same reduced gradients; with the same seed they draw the same bits
    # and keep identical bf16 masters and state with no collective. Another seed differs.
    ctx = INT8.replace(master=DType.BF16)
    runs = []
    for seed in (7, 7, 8):
        model = make_model(6)
        opt = OffloadedOptimizer(model.parameters(), ctx, torch.optim.AdamW, lr=1e-3, seed=seed)
        for i in range(3):
            backward(loss_of(model, i))
            opt.step()
            opt.zero_grad()
        runs.append(bits(opt, model))
    assert same(runs[0], runs[1]) and not same(runs[0], runs[2])


# ----- memory ----------------------------------------------------------------------------


def test_scratch_is_one_parameter_reused_and_reported() -> None:
    # bf16 masters (working weight + gradient) and centered RMSprop with momentum (three
    # packed states): the scratch holds 5 float32 copies of the largest parameter, no more.
    model = make_model(7)
    opt = OffloadedOptimizer(
        model.parameters(),
        INT8.replace(master=DType.BF16),
        torch.optim.RMSprop,
        lr=1e-3,
        centered=True,
        momentum=0.5,
    )
    largest = max(p.numel() for p in model.parameters())
    seen = []
    for i in range(3):
        backward(loss_of(model, i))
        opt.step()
        opt.zero_grad()
        seen.append({t.data_ptr() for role, t in opt.memory_tensors() if role == "scratch"})
    report = memory_report(model, optimizer=opt)
    assert report.bytes(role="scratch") == 4 * largest * 5
    # The first step has no state to decode yet (torch makes it): the buffer grows once, at
    # the second step, and is reused from then on.
    assert len(seen[1]) == 1 and seen[1] == seen[2]


@pytest.mark.parametrize(("fmt", "low", "high"), [("int8", 4.0, 4.05), ("int4", 3.0, 3.1)])
def test_bf16_master_and_compact_moments_take_4_or_3_bytes_per_param(
    fmt: str, low: float, high: float
) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 128, bias=False), torch.nn.Linear(128, 256, bias=False)
    )
    ctx = CPU.replace(master=DType.BF16).with_optim_state(fmt)
    opt = OffloadedOptimizer(model.parameters(), ctx, torch.optim.AdamW, lr=1e-3)
    backward(model(torch.randn(4, 256)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    report = memory_report(model, optimizer=opt)
    per_param = report.bytes_per_param(roles=["master", "optimizer_state"])
    assert low <= per_param <= high, per_param
    assert report.bytes(role="master", dtype="bfloat16") == 2 * report.parameters


# ----- the fused update ------------------------------------------------------------------


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_the_fused_adam_path_matches_torch_adam_through_the_generic_path(cls: Any) -> None:
    runs = []
    for fused in (True, False):
        model = make_model(8)
        # compile=False: the fused path's twin, whose torch ops equal torch's bit for bit
        opt = CompactOptimizer(
            model.parameters(), INT8, cls, lr=1e-2, weight_decay=0.1, compile=False
        )
        assert opt.stepper is not None and opt.stepper.fused
        opt.stepper.fused = fused
        for i in range(4):
            backward(loss_of(model, i))
            opt.step()
            opt.zero_grad()
        runs.append(bits(opt, model))
    assert same(runs[0], runs[1])


def test_bf16_weights_and_int8_moments_without_masters_take_4_bytes_per_param() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 128, bias=False), torch.nn.Linear(128, 256, bias=False)
    ).to(torch.bfloat16)
    opt = CompactOptimizer(model.parameters(), CPU.with_optim_state("int8"), lr=1e-3)
    backward(model(torch.randn(4, 256, dtype=torch.bfloat16)).float().pow(2).mean())
    opt.step()
    opt.zero_grad()
    report = memory_report(model, optimizer=opt)
    assert report.bytes(role="master") == 0
    assert 4.0 <= report.bytes_per_param(roles=["params", "optimizer_state"]) <= 4.05
    assert "master_rounding" in opt.state_dict()
