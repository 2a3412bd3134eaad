"""Property and model-based tests of optimizer state: every codec over the whole float32 range
(finite in, finite out, within the documented bound or the documented saturation), steps with
extreme gradients, and a randomized sequence of steps, saves, loads, format conversions and
new groups checked against torch's AdamW one step at a time."""

from __future__ import annotations

import random
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from computectx import ComputeCtx
from computectx.memory import CompactOptimizer
from computectx.memory.optim.state import Kind, decode, decode_entry, encode, round_trip_bound
from computectx.optim_state import OptimState

F32_MAX = float(torch.finfo(torch.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
CODECS = [
    (OptimState(format=f, block=None if f == "bf16" else 32), k)
    for f in ("bf16", "int8", "fp8", "int4")
    for k in ("signed", "unsigned")
]
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)

# The whole float32 range: the extremes, subnormals, and anything between, both signs.
EXTREMES = [0.0, 1e-45, 1.4e-45, 1e-40, 1.17e-38, 1e-20, 1.0, 1.8e19, 2.0**64, 3e25, 1e38, F32_MAX]
f32_values = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True),
    st.sampled_from(EXTREMES + [-x for x in EXTREMES]),
)


@pytest.mark.parametrize(("state", "kind"), CODECS, ids=[f"{s.format}-{k}" for s, k in CODECS])
@SETTINGS
@given(values=st.lists(f32_values, min_size=1, max_size=80))
def test_every_finite_float32_encodes_to_finite_values_within_the_bound(
    state: OptimState, kind: Kind, values: list[float]
) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    if kind == "unsigned":
        x = x.abs()
    shapes = [x.shape] + ([(2, x.numel() // 2)] if x.numel() % 2 == 0 and x.numel() >= 4 else [])
    for shape in shapes:
        xs = x.reshape(shape)
        y = decode(encode(xs, state, kind))
        assert bool(torch.isfinite(y).all()), (state.format, kind, xs, y)
        err = (y.double() - xs.double()).abs()
        bound = round_trip_bound(xs, state, kind).double()
        # bf16 saturates what lies beyond its largest value (documented), elsewhere the bound.
        saturated = xs.abs() > BF16_MAX if state.format == "bf16" else torch.zeros_like(xs).bool()
        assert bool((err <= bound)[~saturated].all()), (state.format, kind, xs, y)
        assert bool((y.abs() == BF16_MAX)[saturated].all())


@pytest.mark.parametrize(("state", "kind"), CODECS, ids=[f"{s.format}-{k}" for s, k in CODECS])
def test_inf_saturates_only_when_asked_and_nan_is_always_refused(
    state: OptimState, kind: Kind
) -> None:
    x = torch.tensor([1.0, float("inf"), 2.0, 0.5])
    if kind == "signed":
        x[2] = -float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        encode(x, state, kind)
    y = decode(encode(x, state, kind, saturate=True))
    top = BF16_MAX if state.format == "bf16" else F32_MAX
    assert bool(torch.isfinite(y).all()) and float(y[1]) == top
    with pytest.raises(ValueError, match="NaN"):
        encode(torch.tensor([1.0, float("nan")]), state, kind, saturate=True)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "fp8", "int4"])
@settings(max_examples=8, deadline=None, derandomize=True)
@given(grads=st.lists(st.lists(f32_values, min_size=64, max_size=64), min_size=3, max_size=3))
def test_steps_with_extreme_gradients_keep_every_weight_finite(
    fmt: str, grads: list[list[float]]
) -> None:
    p = torch.nn.Parameter(torch.linspace(-1, 1, 64))
    ctx = ComputeCtx.parity("cpu").with_optim_state(fmt if fmt == "f32" else f"{fmt}/min=0")
    opt = CompactOptimizer([p], ctx, lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # skipped steps warn
        for g in grads:
            p.grad = torch.tensor(g, dtype=torch.float32)
            opt.step()
    assert bool(torch.isfinite(p).all())


# ----- model-based: the compact optimizer against torch's AdamW, one step at a time ------


def _decoded(opt: CompactOptimizer, p: torch.Tensor) -> dict[str, Any]:
    return decode_entry(opt.state[p], p.shape, opt.ctx.optim_state, "state")


def _moments_within_bound(got: dict[str, Any], want: dict[str, Any], fmt: OptimState) -> None:
    assert float(got["step"]) == float(want["step"])
    for name, kind in (("exp_avg", "signed"), ("exp_avg_sq", "unsigned")):
        bound = round_trip_bound(want[name], fmt, kind)  # type: ignore[arg-type]
        assert bool(((got[name] - want[name]).abs() <= bound).all()), name


@pytest.mark.parametrize("seed", range(3))
def test_random_steps_saves_loads_conversions_and_groups_follow_torch_adamw(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    formats = [OptimState.parse(f"{f}/block=32/min=0") for f in ("int8", "fp8", "int4")]
    formats.append(OptimState.parse("bf16/min=0"))
    fmt = rng.choice(formats)
    ctx = ComputeCtx.parity("cpu")
    shapes = [(8, 12), (40,), (3, 5, 4)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes[:2]]
    # compile=False: the twin, whose torch ops equal torch's AdamW bit for bit
    options: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.05}
    opt = CompactOptimizer(params, ctx.with_optim_state(fmt), compile=False, **options)
    for _ in range(14):
        op = rng.choice(["step", "step", "step", "reload", "convert", "group"])
        if op == "step":
            # The model: torch's AdamW started from the decoded state of every parameter.
            twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
            ref = torch.optim.AdamW(twins, foreach=False, **options)
            for p, t in zip(params, twins, strict=True):
                g = torch.randn(p.shape, generator=gen)
                p.grad, t.grad = g.clone(), g.clone()
                if opt.state.get(p):
                    ref.state[t] = {k: v.clone() for k, v in _decoded(opt, p).items()}
            opt.step()
            ref.step()
            for p, t in zip(params, twins, strict=True):
                # The weight is torch's to the bit; the stored moments within one encoding.
                assert torch.equal(p.detach(), t.detach())
                _moments_within_bound(_decoded(opt, p), ref.state[t], fmt)
            opt.zero_grad()
        elif op in ("reload", "convert"):
            # Save, then load into a fresh optimizer (of another format for "convert").
            saved = opt.state_dict()
            before = {i: _decoded(opt, p) for i, p in enumerate(params) if opt.state.get(p)}
            new_fmt = rng.choice(formats) if op == "convert" else fmt
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": g["params"]}
                      for g in opt.param_groups]  # fmt: skip
            fresh = CompactOptimizer(
                groups, ctx.with_optim_state(new_fmt), compile=False, **options
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the conversion's warning
                fresh.load_state_dict(saved)
            for i, want in before.items():
                got = _decoded(fresh, params[i])
                if new_fmt == fmt:
                    assert all(torch.equal(got[k], want[k]) for k in want)
                else:
                    _moments_within_bound(got, want, new_fmt)
            opt, fmt = fresh, new_fmt
        elif len(params) < len(shapes):
            new = torch.nn.Parameter(torch.randn(shapes[len(params)], generator=gen))
            opt.add_param_group({"params": [new]})
            params.append(new)
    assert all(bool(torch.isfinite(p).all()) for p in params)
