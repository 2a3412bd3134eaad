"""Findings of the adversarial pass on optimizer state in the policy (issue 32): a huge
second moment zeroing its block-mates, an inf in a loaded moment, weights the stepper
cannot take, a gradient assigned each step, group options and seeds that cannot be saved
and loaded, and load errors that must name the key and the parameter."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from computectx import ComputeCtx
from computectx.memory import CompactOptimizer, OffloadedOptimizer
from computectx.memory.optim.state.codecs import decode, encode, round_trip_bound
from computectx.optim_state import parse_optim_state

from .test_edges import give_grads, params_of, unchanged

CPU = ComputeCtx.parity("cpu")
PACKED = ["bf16", "int8", "fp8", "int4"]


def ctx_of(fmt: str) -> ComputeCtx:
    return CPU.with_optim_state(fmt if fmt == "f32" else f"{fmt}/min=0")


# ----- 1: one huge second moment must not zero its block-mates' ----------------------------


@pytest.mark.parametrize("fmt", PACKED)
def test_a_positive_second_moment_never_decodes_to_zero(fmt: str) -> None:
    # Block 0: one value at 1e38 and its mates down to the smallest subnormal; block 1 zeros.
    x = torch.cat((torch.tensor([1e38, 1e-3, 1e-30, 1e-40, 1e-45]), torch.zeros(251)))
    x = torch.cat((x, torch.zeros(256)))
    state = parse_optim_state(f"{fmt}/min=0")
    p = encode(x, state, "unsigned")
    y = decode(p)
    assert bool((y[x > 0] > 0).all()), y[:5]
    if fmt != "int4":  # int4's unsigned map has no zero: a zero decodes to s / 16 (0 here)
        assert bool((y[x == 0] == 0).all())
    assert bool(((y.double() - x.double()).abs() <= round_trip_bound(x, state, "unsigned")).all())
    again = encode(y, state, "unsigned")
    for name, t in p.parts.items():
        assert torch.equal(t, again.parts[name]), name


@pytest.mark.parametrize("fmt", PACKED)
def test_block_mates_of_a_gradient_spike_move_no_more_than_adam_does(fmt: str) -> None:
    # The state some 340 steps after one gradient element of 1.5e19 (its square fits
    # float32, so the step applied it): that element's v is still ~1e35 while its m has
    # decayed (beta1 is faster), so the block-mates' m is representable again. Their v is
    # ~1e-7: 1e-42 of the block's scale, which decoded as 0 gave them updates lr * m / eps.
    torch.manual_seed(0)
    m = torch.randn(256) * 1e-3
    v = torch.rand(256) * 1e-7 + 1e-8
    m[0], v[0] = 4e2, 1.6e35
    w0 = torch.randn(256)
    ours = torch.nn.Parameter(w0.clone())
    ref = torch.nn.Parameter(w0.clone())
    opt = CompactOptimizer([ours], ctx_of(fmt), weight_decay=0.0)
    adam = torch.optim.AdamW([ref], weight_decay=0.0)
    entry = {"step": torch.tensor(340.0), "exp_avg": m, "exp_avg_sq": v}
    sd = adam.state_dict()
    adam.load_state_dict({**sd, "state": {0: copy.deepcopy(entry)}})
    with pytest.warns(UserWarning, match="converted"):
        opt.load_state_dict({**sd, "state": {0: copy.deepcopy(entry)}})
    grad = torch.randn(256) * 1e-2
    ours.grad, ref.grad = grad.clone(), grad.clone()
    opt.step()
    adam.step()
    moved = (ours.detach() - w0)[1:].abs().max().item()
    torch_moved = (ref.detach() - w0)[1:].abs().max().item()
    # Adam moves each weight by at most about lr * sqrt(1 / (1 - beta2)) * (1 - beta1) per
    # step; a v decoded above its value can only shrink the update.
    assert moved <= max(torch_moved, 1e-3) * 1.1, (moved, torch_moved)


# ----- 2 and 8: non-finite plain state in a checkpoint -------------------------------------


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_plain_state_in_a_checkpoint_is_refused_naming_key_and_index(
    fmt: str, name: str, bad: float
) -> None:
    params = params_of((64, 80))
    opt = CompactOptimizer(params, ctx_of(fmt))
    give_grads(params, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    entry = {k: v for k, v in sd["state"][0].items() if not k.startswith(f"{name}.")}
    value = torch.rand(64, 80) * 1e-3
    value[5, 7] = bad
    entry[name] = value
    sd = {**sd, "state": {0: entry}}
    give_grads(params, 1)
    match = rf"state_dict\['state'\]\[0\]\['{name}'\] \(the state of parameter 0.*index \[5, 7\]"
    unchanged(opt, params, lambda: opt.load_state_dict(sd), match)


# ----- 3: weights the stepper cannot take --------------------------------------------------


def test_a_float64_weight_is_refused_at_construction_and_in_add_param_group() -> None:
    a = params_of((64, 80))[0]
    b = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\] has dtype "):
        CompactOptimizer([a, b], ctx_of("int8"))
    opt = CompactOptimizer([a], ctx_of("int8"))
    give_grads([a], 0)
    unchanged(
        opt,
        [a],
        lambda: opt.add_param_group({"params": [b]}),
        r"add_param_group: param_groups\[1\]\['params'\]\[0\] has dtype torch.float64.*"
        r"float32, bfloat16 or float16",
    )
    # f32 state and float32/float64 weights: torch's own step, as before.
    plain = CompactOptimizer([params_of((4,))[0]], ctx_of("f32"))
    plain.add_param_group({"params": [b]})
    # A bf16 weight brings the stepper, which would step the float64 one: refused.
    low = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"parameter 1 \(already in this optimizer\)"):
        plain.add_param_group({"params": [low]})


def test_a_weight_whose_dtype_changed_is_refused_by_step_before_anything_changes() -> None:
    params = params_of((64, 80), (8,))
    opt = CompactOptimizer(params, ctx_of("int8"))
    give_grads(params, 0)
    opt.step()
    params[1].data = params[1].data.double()
    give_grads(params, 1)
    unchanged(opt, params, opt.step, r"\['params'\]\[1\] has dtype torch.float64")


# ----- 4: a gradient assigned each step (torch.autograd.grad style) -------------------------


def test_offloaded_gradient_assigned_each_step_without_zero_grad_steps_as_torch() -> None:
    ours, ref = params_of((64, 80))[0], params_of((64, 80))[0]
    opt = OffloadedOptimizer([ours], ctx_of("f32").replace(offload=torch.device("cpu")))
    adam = torch.optim.AdamW([ref], fused=True)  # the f32 step is torch's fused kernel
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        g = torch.randn(64, 80, generator=gen)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        adam.step()
    assert torch.equal(ours.detach(), ref.detach())
    # Gradients ingested between two steps still add up (micro-batches).
    g1, g2 = torch.randn(64, 80, generator=gen), torch.randn(64, 80, generator=gen)
    ours.grad = g1.clone()
    opt.ingest_grads()
    ours.grad = g2.clone()
    ref.grad = g1 + g2
    opt.step()
    adam.step()
    assert torch.equal(ours.detach(), ref.detach())


# ----- 5: group options that could be saved but not loaded ---------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [("lr", -1.0), ("lr", math.nan), ("lr", "1e-3"), ("eps", math.inf), ("betas", (0.9, 1.0))],
)
def test_group_options_a_load_would_refuse_are_refused_when_the_group_is_added(
    key: str, value: Any
) -> None:
    params = params_of((64, 80))
    opt = CompactOptimizer(params, ctx_of("int8"))
    give_grads(params, 0)
    opt.step()
    q = torch.nn.Parameter(torch.randn(8))
    where = r"add_param_group: param_groups\[1\]\['" + key + r"'\]"
    unchanged(opt, params, lambda: opt.add_param_group({"params": [q], key: value}), where)
    with pytest.raises(ValueError, match=r"CompactOptimizer: param_groups\[0\]\['" + key):
        CompactOptimizer([{"params": [q], key: value}], ctx_of("int8"))
    # A group that was accepted saves a checkpoint that loads.
    opt.add_param_group({"params": [q], "lr": 0.5})
    opt.load_state_dict(opt.state_dict())


# ----- 6: seeds that would not come back from a checkpoint ---------------------------------


@pytest.mark.parametrize(
    ("seed", "error"),
    [
        (2**70, ValueError),
        (-1, ValueError),
        (2**63, ValueError),
        (2**64 - 1, ValueError),
        (1.0, TypeError),
        (True, TypeError),
    ],
)
def test_seeds_outside_int64_are_refused_at_construction(seed: object, error: type) -> None:
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    with pytest.raises(error, match="seed"):
        CompactOptimizer([p], ctx_of("int8"), seed=seed)  # type: ignore[arg-type]
    opt = CompactOptimizer([p], ctx_of("int8"), seed=2**63 - 1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert int(opt.state_dict()["master_rounding"]["seed"]) == 2**63 - 1
