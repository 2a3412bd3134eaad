"""The fused Adam/AdamW update: torch's math, on packed state, compiled in one graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from computectx import ComputeCtx
from computectx.memory import CompactOptimizer
from computectx.memory.optim import fused
from computectx.memory.optim.fused import adam_update
from computectx.memory.optim.state import Packed, decode, encode
from computectx.optim_state import OptimState, StateFormat

F32 = OptimState()
HYPER: dict[str, Any] = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8}


def update(
    p: torch.Tensor,
    g: torch.Tensor,
    m: Packed | torch.Tensor,
    v: Packed | torch.Tensor,
    step: int,
    state: OptimState = F32,
    *,
    decoupled: bool = True,
    weight_decay: float = 0.1,
    maximize: bool = False,
    generator: torch.Generator | None = None,
    compiled: bool = False,
    **over: float,
) -> tuple[Packed | torch.Tensor, Packed | torch.Tensor]:
    return adam_update(
        p,
        g,
        m,
        v,
        step,
        **{**HYPER, **over},
        weight_decay=weight_decay,
        decoupled=decoupled,
        maximize=maximize,
        state=state,
        generator=generator,
        compiled=compiled,
    )


def torch_opt(p: torch.Tensor, decoupled: bool, weight_decay: float, maximize: bool) -> Any:
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(
        [p],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=weight_decay,
        maximize=maximize,
        foreach=False,
    )


# ----- against torch.optim -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("decoupled", "weight_decay", "maximize"),
    [(True, 0.1, False), (False, 0.1, False), (False, 0.0, True), (True, 0.05, True)],
)
@pytest.mark.parametrize("shape", [(37, 19), (101,)])
def test_f32_state_matches_torch_adam_and_adamw_bit_for_bit(
    decoupled: bool, weight_decay: float, maximize: bool, shape: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    p = torch.randn(shape)
    ref = p.clone().requires_grad_()
    opt = torch_opt(ref, decoupled, weight_decay, maximize)
    m, v = torch.zeros(shape), torch.zeros(shape)
    for step in range(1, 6):
        g = torch.randn(shape)
        ref.grad = g.clone()
        opt.step()
        out = update(
            p, g, m, v, step, decoupled=decoupled, weight_decay=weight_decay, maximize=maximize
        )
        assert out[0] is m and out[1] is v  # plain f32 state is updated in place
    state = opt.state[ref]
    assert torch.equal(p, ref.detach())
    assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])


QUANT_CASES: list[tuple[StateFormat, tuple[int, ...]]] = [
    ("bf16", (33, 7)),
    ("int8", (1000,)),
    ("int8", (3, 5, 70)),
    ("fp8", (500,)),
    ("int4", (301,)),
    ("int4", (64, 80)),  # second moment rank-1 normalized
]


@pytest.mark.parametrize(("fmt", "shape"), QUANT_CASES)
def test_packed_step_equals_decode_torch_step_encode(
    fmt: StateFormat, shape: tuple[int, ...]
) -> None:
    """What the generic path does (decode, torch.optim step, encode) gives the same codes."""
    state = OptimState(format=fmt) if fmt == "bf16" else OptimState(format=fmt, block=32)
    torch.manual_seed(1)
    p, g = torch.randn(shape), torch.randn(shape)
    m = encode(torch.randn(shape) * 0.1, state, "signed")
    v = encode(torch.rand(shape) * 0.01, state, "unsigned")
    decoupled = fmt != "fp8"
    ref = p.clone().requires_grad_()
    opt = torch_opt(ref, decoupled, 0.1, maximize=fmt == "int8")
    opt.state[ref] = {
        "step": torch.tensor(4.0),
        "exp_avg": decode(m).clone(),
        "exp_avg_sq": decode(v).clone(),
    }
    ref.grad = g.clone()
    opt.step()
    m2, v2 = update(p, g, m, v, 5, state, decoupled=decoupled, maximize=fmt == "int8")
    assert isinstance(m2, Packed) and isinstance(v2, Packed)
    assert torch.equal(p, ref.detach())
    for new, name, kind in ((m2, "exp_avg", "signed"), (v2, "exp_avg_sq", "unsigned")):
        want = encode(opt.state[ref][name], state, kind)  # type: ignore[arg-type]
        assert (new.shape, new.block, set(new.parts)) == (want.shape, want.block, set(want.parts))
        for part, t in want.parts.items():
            assert torch.equal(new.parts[part], t), (name, part)


def test_compiled_is_one_graph_without_breaks_for_every_size_and_equals_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fused._update, fullgraph=True, dynamic=True, backend=counter)
    monkeypatch.setitem(fused._COMPILED, "counted", compiled)
    monkeypatch.setattr(fused, "COMPILE_BACKEND", "counted")
    state = OptimState(format="int8", block=64)
    torch.manual_seed(2)
    for shape in [(300, 7), (1000,), (5, 6, 77)]:
        p, g = torch.randn(shape), torch.randn(shape)
        m = encode(torch.randn(shape), state, "signed")
        v = encode(torch.rand(shape), state, "unsigned")
        results = []
        for compiled_run in (False, True):
            q = p.clone()
            m2, v2 = update(q, g, m, v, 2, state, compiled=compiled_run)
            assert isinstance(m2, Packed) and isinstance(v2, Packed)
            results.append((q, m2.parts, v2.parts))
        (pe, me, ve), (pc, mc, vc) = results
        assert torch.equal(pe, pc) and not torch.equal(pe, p)
        for eager_parts, comp_parts in ((me, mc), (ve, vc)):
            for name, t in eager_parts.items():
                assert torch.equal(t, comp_parts[name])
    # Through the optimizer: Parameters (a 1-D one is passed flat as it is: it must enter
    # as a plain tensor, not a Parameter) of several sizes, the first step (fresh state)
    # and a later one all run the same graph.
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 80), (1000,), (3, 5, 77)]]
    ctx = ComputeCtx.parity("cpu").with_optim_state(f"{state}/min=0")
    opt = CompactOptimizer(params, ctx, compile=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    # fullgraph=True raises on any graph break; dynamic=True keeps one graph for all sizes.
    assert counter.frame_count == 1


# ----- bf16 parameters: stochastic rounding ------------------------------------------------


def bf16_steps(steps: int, generator: torch.Generator | None, n: int = 20000) -> torch.Tensor:
    """A bf16 parameter at 1.5 (ulp 2**-7) whose every Adam step moves it by 0.3 ulp."""
    p = torch.full((n,), 1.5, dtype=torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.ones(n, dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        # A constant gradient: m_hat / sqrt(v_hat) = 1 each step, so the update is -lr.
        update(p, g, m, v, step, weight_decay=0.0, generator=generator, lr=0.3 * 2.0**-7)
    return p


def test_bf16_param_with_stochastic_rounding_is_unbiased() -> None:
    start = 1.5
    exact = start - 0.3 * 2.0**-7 / (1 + 1e-8)
    p = bf16_steps(1, torch.Generator().manual_seed(0))
    assert set(torch.unique(p.float()).tolist()) == {start - 2.0**-7, start}  # the two neighbours
    sigma = 2.0**-7 * (0.3 * 0.7) ** 0.5 / p.numel() ** 0.5
    assert abs(float(p.float().mean()) - exact) < 5 * sigma
    nearest = bf16_steps(1, None)
    assert bool((nearest == start).all())  # round to nearest loses the 0.3-ulp update


def test_bf16_param_with_stochastic_rounding_accumulates_small_updates() -> None:
    steps = 20
    moved = float(bf16_steps(steps, torch.Generator().manual_seed(1)).float().mean()) - 1.5
    want = -steps * 0.3 * 2.0**-7  # what an f32 master would have moved
    assert moved == pytest.approx(want, rel=0.02)
    assert bool((bf16_steps(steps, None) == 1.5).all())  # nearest: stalled at the start


def test_bf16_param_and_generator_draw_like_the_generic_path() -> None:
    """The fused update rounds the f32 result with _rounding.stochastic_round_keyed, under
    one key drawn from the generator."""
    from computectx.memory._rounding import draw_key, stochastic_round_keyed

    torch.manual_seed(4)
    p = torch.randn(257).to(torch.bfloat16)
    g = torch.randn(257)
    ref = p.float().requires_grad_()
    opt = torch_opt(ref, True, 0.1, False)
    ref.grad = g.clone()
    opt.step()
    key = draw_key(torch.Generator().manual_seed(9))
    want = stochastic_round_keyed(ref.detach(), torch.bfloat16, key)
    gen = torch.Generator().manual_seed(9)
    update(p, g, torch.zeros(257), torch.zeros(257), 1, generator=gen)
    assert torch.equal(p, want)


def test_bad_arguments_are_refused() -> None:
    p = torch.zeros(4, 4)
    int8 = OptimState(format="int8")
    m = encode(torch.ones(4, 4), int8, "signed")
    with pytest.raises(ValueError, match=r"m is packed for shape \[4, 4\].*parameter is \[16\]"):
        update(torch.zeros(16), torch.zeros(16), m, torch.zeros(16), 1, int8)
    with pytest.raises(ValueError, match="packed as int8, but state says fp8"):
        update(p, p.clone(), m, torch.zeros(4, 4), 1, OptimState(format="fp8"))
    with pytest.raises(ValueError, match="plain v must be contiguous float32"):
        update(p, p.clone(), m, torch.zeros(4, 4).t().contiguous().bfloat16(), 1, int8)
    with pytest.raises(ValueError, match=r"step=0; accepted: the step number, >= 1"):
        update(p, p.clone(), m, torch.zeros(4, 4), 0, int8)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 parameter"):
        update(p.double(), p.double(), m, torch.zeros(4, 4), 1, int8)
