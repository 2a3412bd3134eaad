"""The compact optimizers at their edges: gradients whose square overflows float32, state
saved for another shape, bad scalars in a checkpoint, and every refused call leaving every
tensor and attribute as it was (fault injection, one check at a time)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import CompactOptimizer, OffloadedOptimizer

CPU = ComputeCtx.parity("cpu")
FORMATS = ["f32", "bf16", "int8", "fp8", "int4"]
KINDS = ["compact", "offloaded"]

Optim = CompactOptimizer | OffloadedOptimizer


def ctx_of(fmt: str, master: DType = DType.F32) -> ComputeCtx:
    ctx = CPU.with_optim_state(fmt if fmt == "f32" else f"{fmt}/min=0")
    return ctx if master == DType.F32 else ctx.replace(master=master)


def build(kind: str, params: list[torch.Tensor], ctx: ComputeCtx, **kw: Any) -> Optim:
    wrapper = CompactOptimizer if kind == "compact" else OffloadedOptimizer
    return wrapper(params, ctx, kw.pop("cls", torch.optim.AdamW), **kw)


def params_of(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def give_grads(params: Sequence[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


# ----- a snapshot of everything an optimizer call could change ----------------------------


def _frozen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().clone())
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_frozen(v) for v in value]
    return copy.deepcopy(value)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return (
            isinstance(b, tuple)
            and a[:3] == b[:3]
            and torch.equal(a[3].reshape(-1).view(torch.uint8), b[3].reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def snapshot(opt: Optim, params: list[torch.Tensor]) -> dict[str, Any]:
    """Every tensor (params, grads, masters and their grads, state) and attribute."""
    masters = list(opt.master_params) if isinstance(opt, OffloadedOptimizer) else []
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    stepper = opt.stepper
    out: dict[str, Any] = _frozen(
        {
            "params": [p.detach() for p in params],
            "grads": [p.grad for p in params],
            "masters": [m.detach() for m in masters],
            "master_grads": [m.grad for m in masters],
            "state": [dict(opt.state[p]) for g in opt.param_groups for p in g["params"]],
            "groups": groups,
            "n_params": [len(g["params"]) for g in opt.param_groups],
            "skipped": (opt.skipped_steps, opt.last_step_skipped),
            "rounding": None if stepper is None else stepper.rounding.state_dict(),
            "stepper": stepper is None,
        }
    )
    return out


def unchanged(
    opt: Optim, params: list[torch.Tensor], call: Callable[[], object], match: str
) -> None:
    """``call`` raises (ValueError/TypeError matching ``match``) and changes nothing."""
    before = snapshot(opt, params)
    with pytest.raises((ValueError, TypeError), match=match):
        call()
    after = snapshot(opt, params)
    for key in before:
        assert _equal(before[key], after[key]), f"{match}: {key} changed"


# ----- item 2: a finite gradient whose square overflows float32 ---------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_a_gradient_whose_square_overflows_skips_the_step_and_keeps_weights_finite(
    kind: str, fmt: str, first: bool
) -> None:
    params = params_of((512,), (8, 64))
    opt = build(kind, params, ctx_of(fmt), lr=1e-2)
    if not first:
        give_grads(params, 1)
        opt.step()
        opt.zero_grad()
    for huge in (1e38, 2.0**64, -3e25):
        give_grads(params, 2)
        assert params[0].grad is not None
        params[0].grad[3] = huge
        before = snapshot(opt, params)
        with pytest.warns(RuntimeWarning, match=r"skipped the update.*square overflows float32"):
            opt.step()
        assert opt.last_step_skipped
        after = snapshot(opt, params)
        for key in ("params", "masters", "state", "rounding"):
            assert _equal(before[key], after[key]), (huge, key)
        assert all(p.grad is None for p in params)
    # Training goes on, every weight finite; a gradient just below 2**64 is applied.
    for i in range(3):
        give_grads(params, 10 + i)
        assert params[1].grad is not None
        params[1].grad[0, 0] = 1.8e19
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        assert not opt.last_step_skipped
        opt.zero_grad()
    assert all(bool(torch.isfinite(p).all()) for p in params)
    assert opt.skipped_steps == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_that_overflows_in_torchs_arithmetic_saturates_and_weights_stay_finite(
    fmt: str,
) -> None:
    # Adagrad sums squares: applicable gradients (|g| < 2**64) overflow the sum after a few
    # steps. float32 state then holds inf (torch's arithmetic: that weight stops moving);
    # the compact formats store the largest finite value, which moves it by as little.
    ref = params_of((300,), seed=3)
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = CompactOptimizer(params, ctx_of(fmt), torch.optim.Adagrad, lr=0.1)
    # f32 state is stepped by torch's fused kernel, the compact formats by torch's default.
    torch_opt = torch.optim.Adagrad(ref, lr=0.1, **({"fused": True} if fmt == "f32" else {}))
    for i in range(6):
        give_grads(params, 20 + i)
        give_grads(ref, 20 + i)
        for p in (params[0], ref[0]):
            assert p.grad is not None
            p.grad[:4] = 1.5e19
        opt.step()
        torch_opt.step()
    assert math.isinf(float(torch_opt.state[ref[0]]["sum"][0]))
    assert all(bool(torch.isfinite(p).all()) for p in params)
    # Everywhere, the spike's block included, the weights follow torch's within the format's error.
    assert float((params[0] - ref[0]).detach().abs().max()) < 0.5
    if fmt == "f32":  # torch's own arithmetic: the same weights, bit for bit
        assert "sum" in opt.state_dict()["state"][0]
        assert all(torch.equal(p, r) for p, r in zip(params, ref, strict=True))
        return
    # Outside the spike's block (whose mates' sums decode at least the block's smallest code,
    # so they move less than torch's; bf16 has no blocks: outside the spiked elements) the
    # weights follow torch's within one step's length (lr; measured 2e-4 bf16, 1e-3 int8,
    # 5e-3 fp8, 6e-2 int4).
    first = ctx_of(fmt).optim_state.block_size or 4
    assert float((params[0] - ref[0]).detach()[first:].abs().max()) < 0.1


# ----- item 3: state saved for another shape ---------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4", "bf16", "f32"])
def test_state_of_another_shape_with_the_same_count_is_refused_naming_both(
    kind: str, fmt: str
) -> None:
    a, b = params_of((64, 80), (80, 64))
    opt = build(kind, [a, b], ctx_of(fmt))
    give_grads([a, b], 0)
    opt.step()
    sd = opt.state_dict()
    # Into a parameter of the transposed shape.
    (c,) = params_of((80, 64), seed=1)
    (d,) = params_of((64, 80), seed=1)
    one = build(kind, [c], ctx_of(fmt))
    single = {
        **sd,
        "state": {0: sd["state"][0]},
        "param_groups": [dict(sd["param_groups"][0], params=[0])],
    }
    if "param_shapes" in sd:
        single["param_shapes"] = {0: sd["param_shapes"][0]}
    if "master_weights" in sd:
        single["master_weights"] = {0: sd["master_weights"][0]}
    unchanged(one, [c], lambda: one.load_state_dict(single), r"\[64, 80\].*\[80, 64\]")
    # Both parameters in the other order: each would get the other's moments.
    swapped = build(
        kind,
        [b.detach().clone().requires_grad_(), a.detach().clone().requires_grad_()],
        ctx_of(fmt),
    )
    with pytest.raises(ValueError, match=r"\[64, 80\].*\[80, 64\]"):
        swapped.load_state_dict(sd)
    # The same shape loads.
    same = build(kind, [d, c], ctx_of(fmt))
    same.load_state_dict(sd)


def test_a_checkpoint_without_shapes_still_loads() -> None:
    # Checkpoints saved before shapes were recorded are checked by size only, as before.
    (a,) = params_of((64, 80))
    opt = CompactOptimizer([a], ctx_of("int8"))
    give_grads([a], 0)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_shapes"] == {0: [64, 80]}
    del sd["param_shapes"]
    fresh = CompactOptimizer(params_of((64, 80), seed=2), ctx_of("int8"))
    fresh.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"param_shapes.*accepted: an int index -> a list of ints"):
        fresh.load_state_dict({**opt.state_dict(), "param_shapes": {0: "64x80"}})


# ----- item 13: bad scalars in a checkpoint, and in the state itself ---------------------


BAD_STEPS = [math.nan, -1.0, math.inf, 2.5, -math.inf]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["f32", "int8"])
def test_a_bad_step_is_refused_by_load_and_by_step_before_anything_changes(
    kind: str, fmt: str
) -> None:
    params = params_of((64,), (64,))
    opt = build(kind, params, ctx_of(fmt))
    give_grads(params, 0)
    opt.step()
    for bad in BAD_STEPS:
        sd = opt.state_dict()
        sd["state"][1] = {**sd["state"][1], "step": torch.tensor(bad)}
        give_grads(params, 1)
        unchanged(
            opt,
            params,
            lambda sd=sd: opt.load_state_dict(sd),  # type: ignore[misc]
            rf"state_dict\['state'\]\[1\]\['step'\] is {bad!r}; accepted: a whole number >= 0",
        )
    # State edited in place: step() refuses before any gradient moves or weight changes.
    entry = opt.state[opt.param_groups[0]["params"][1]]
    saved = entry["step"].clone()
    entry["step"].fill_(math.nan)
    give_grads(params, 2)
    unchanged(opt, params, opt.step, r"\['params'\]\[1\]\['step'\] is nan")
    entry["step"].copy_(saved)
    opt.step()


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("lr", math.nan, r"\['lr'\] is nan; accepted: a finite number >= 0"),
        ("lr", -1e-3, r"\['lr'\] is -0.001; accepted: a finite number >= 0"),
        ("eps", math.inf, r"\['eps'\] is inf"),
        ("weight_decay", -0.1, r"\['weight_decay'\] is -0.1"),
        ("betas", (0.9, 1.0), r"\['betas'\]\[1\] is 1.0; accepted: each in \[0, 1\)"),
        ("betas", (math.nan, 0.99), r"\['betas'\]\[0\] is nan"),
    ],
)
def test_bad_group_options_in_a_checkpoint_are_refused(key: str, value: Any, match: str) -> None:
    params = params_of((64,))
    opt = CompactOptimizer(params, ctx_of("int8"))
    give_grads(params, 0)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"] = [{**sd["param_groups"][0], key: value}]
    unchanged(opt, params, lambda: opt.load_state_dict(sd), match)


# ----- validate, then write: each check of each mutating call, in turn --------------------


def _bad_loads(opt: Optim, sd: dict[str, Any]) -> list[tuple[object, str]]:
    """(state dict, the error it must raise) for each check of load_state_dict."""
    state0 = dict(sd["state"][0])
    codes = next(k for k in state0 if k.endswith(".codes"))
    out: list[tuple[object, str]] = [
        ([1, 2], "must be a mapping"),
        (torch.optim.SGD(params_of((64, 80)), lr=0.1, momentum=0.9).state_dict(), "saved by"),
        ({**sd, "optim_state": "int9"}, "is not a format"),
        ({k: v for k, v in sd.items() if k != "state"}, "no 'state' entry"),
        ({**sd, "param_groups": sd["param_groups"] * 2}, "different number of parameter groups"),
        ({**sd, "state": {**sd["state"], 7: state0}}, "no parameter has index 7"),
        (
            {**sd, "state": {0: {**state0, codes: state0[codes].int()}}},
            "part 'codes' is torch.int32",
        ),
        ({**sd, "param_shapes": {0: [80, 64], 1: [64]}}, r"\[80, 64\].*\[64, 80\]"),
        ({**sd, "param_shapes": [1]}, "must be a dict index -> shape"),
        (
            {**sd, "state": {**sd["state"], 0: {**state0, "step": torch.tensor(0.5)}}},
            "whole number",
        ),
        ({**sd, "param_groups": [{**sd["param_groups"][0], "lr": math.nan}]}, r"\['lr'\] is nan"),
        ({**sd, "master_rounding": [1]}, "master_rounding"),
    ]
    if isinstance(opt, OffloadedOptimizer):
        masters = sd["master_weights"]
        out += [
            ({**sd, "master_weights": {0: masters[0]}}, "missing indices"),
            ({**sd, "master_weights": {0: masters[0].T, 1: masters[1]}}, "has shape"),
            ({**sd, "master_weights": {0: masters[0] * math.inf, 1: masters[1]}}, "inf or NaN"),
        ]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_each_refused_load_changes_nothing(kind: str) -> None:
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in params_of((64, 80), (64,))]
    if kind == "offloaded":
        params = params_of((64, 80), (64,))
    opt = build(kind, params, ctx_of("int8", DType.BF16 if kind == "offloaded" else DType.F32))
    give_grads(params, 0)
    opt.step()
    sd = opt.state_dict()
    give_grads(params, 1)
    for bad, match in _bad_loads(opt, sd):
        unchanged(opt, params, lambda bad=bad: opt.load_state_dict(bad), match)  # type: ignore[misc]
    opt.load_state_dict(sd)


@pytest.mark.parametrize("kind", KINDS)
def test_each_refused_step_changes_nothing(kind: str) -> None:
    params = params_of((64, 80), (64,))
    opt = build(kind, params, ctx_of("int4"))
    give_grads(params, 0)
    opt.step()
    entry = opt.state[opt.param_groups[0]["params"][0]]
    give_grads(params, 1)
    # A packed part replaced by a bad one; a step count edited in place.
    codes = next(k for k in entry if k.endswith(".codes"))
    good = entry[codes]
    entry[codes] = good.to(torch.int16)
    unchanged(opt, params, opt.step, "part 'codes' is torch.int16")
    entry[codes] = good
    entry["step"].fill_(-2.0)
    unchanged(opt, params, opt.step, r"\['step'\] is -2.0")
    entry["step"].fill_(1.0)
    opt.step()
    assert not opt.last_step_skipped


@pytest.mark.parametrize("kind", KINDS)
def test_each_refused_add_param_group_changes_nothing(kind: str) -> None:
    params = params_of((64, 80))
    opt = build(kind, params, ctx_of("f32"), cls=torch.optim.Adafactor)
    give_grads(params, 0)
    opt.step()
    assert opt.stepper is None
    leaf = torch.nn.Parameter(torch.randn(4))
    bad_groups: list[tuple[object, str]] = [
        ([leaf], "param_group must be a dict"),
        ({"lr": 0.1}, "has no 'params' key"),
        ({"params": [leaf, "w"]}, r"\['params'\]\[1\] is a str"),
        ({"params": [leaf * 2]}, "not a leaf tensor"),
        ({"params": [torch.zeros(3, dtype=torch.int64)]}, "only floating tensors"),
        ({"params": [leaf, leaf]}, "appears more than once"),
        ({"params": [params[0]]}, "appears more than once"),
    ]
    if kind == "compact":
        # The first bf16 weight needs the stepper, which Adafactor's factored state cannot
        # use: refused before the group joins.
        low = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))
        bad_groups.append(({"params": [low]}, "Adafactor keeps state 'row_var'"))
    for group, match in bad_groups:
        unchanged(opt, params, lambda g=group: opt.add_param_group(g), match)  # type: ignore[misc]
    opt.add_param_group({"params": [leaf]})
    assert len(opt.param_groups) == 2
