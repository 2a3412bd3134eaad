"""``parallelize`` in one process: a world of one, its choices, and its refusals."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from computectx import ComputeCtx, DType
from computectx.distributed import parallelize
from computectx.formats import QuantizedLinear
from computectx.formats.numerics.ledger import ledger_step
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def test_one_process_needs_no_process_group() -> None:
    model = _mlp()
    par = parallelize(model, CTX, fp8_filter=lambda m, fqn: True, lr=1e-3)
    assert par.world_size == 1 and par.model is model and par.module is model
    assert par.sync is None and par.accumulator is None
    assert isinstance(model[0], QuantizedLinear) and type(par.optimizer) is torch.optim.AdamW
    par.model(torch.randn(4, 32)).square().mean().backward()
    before = model[0].weight.detach().clone()
    assert par.step(max_norm=1.0) is not None
    assert not torch.equal(before, model[0].weight)
    assert all(p.grad is None for p in model.parameters())


def test_one_process_loading_a_many_rank_checkpoint_rescales_its_gradient_ledger() -> None:
    # A state recorded on 2 ranks under a per-rank loss holds output gradients twice the
    # whole batch's; loaded in one process (no sync to do it at a first merge), its gradient
    # history and step are brought to this world at once, not left 2x too large.
    model = _mlp()
    par = parallelize(model, CTX, fp8_filter=lambda m, fqn: True, lr=1e-3)
    par.model(torch.randn(4, 32)).square().mean().backward()
    par.step()
    layer = model[0]
    assert isinstance(layer, QuantizedLinear)
    layer.scaling.world_size = 2  # as if saved on 2 ranks
    saved = par.state_dict()
    grad_step = ledger_step(layer.scaling.grad.ledger).clone()
    assert float(grad_step) > 0

    other = _mlp()
    fresh = parallelize(other, CTX, fp8_filter=lambda m, fqn: True, lr=1e-3)
    fresh.load_state_dict(saved)
    loaded = other[0]
    assert isinstance(loaded, QuantizedLinear)
    assert loaded.scaling.world_size == 1
    assert torch.equal(ledger_step(loaded.scaling.grad.ledger), grad_step / 2)


def test_the_ctx_asks_for_the_memory_policys_pieces() -> None:
    ctx = CTX.replace(grad=DType.BF16, offload=torch.device("cpu"))
    par = parallelize(_mlp(), ctx, fp8_filter=lambda m, fqn: True, lr=1e-3)
    assert isinstance(par.optimizer, OffloadedOptimizer)
    assert isinstance(par.accumulator, LowPrecGradAccumulator)
    forced = parallelize(
        _mlp(), ctx, fp8_filter=lambda m, fqn: True, accumulate=False, offload=False, lr=1e-3
    )
    assert forced.accumulator is None and type(forced.optimizer) is torch.optim.AdamW


def test_compact_optimizer_state_is_kept_or_refused_never_dropped() -> None:
    ctx = CTX.with_optim_state("int8/min=0")
    par = parallelize(_mlp(), ctx, fp8_filter=lambda m, fqn: True, lr=1e-3)
    assert isinstance(par.optimizer, OffloadedOptimizer)
    par.model(torch.randn(4, 32)).square().mean().backward()
    par.step(max_norm=1.0)
    names = {k for entry in par.optimizer.state.values() for k in entry}
    assert "exp_avg.codes" in names and "exp_avg" not in names
    model = _mlp()
    with pytest.raises(ValueError, match=r"optim_state=int8/min=0 .* offload=False would build"):
        parallelize(model, ctx, fp8_filter=lambda m, fqn: True, offload=False, lr=1e-3)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_a_bad_optimizer_argument_leaves_the_model_unchanged() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="learning rate"):
        parallelize(model, CTX, fp8_filter=lambda m, fqn: True, lr=-1.0)
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "zero3"}, "strategy must be 'ddp' or 'fsdp', got 'zero3'"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parallelize(_mlp(), CTX, **kwargs)  # type: ignore[arg-type]


def test_a_wrapped_model_is_refused() -> None:
    with pytest.raises(TypeError, match=r"ctx must be a computectx\.ComputeCtx"):
        parallelize(_mlp(), "fp8_hybrid")  # type: ignore[arg-type]


def test_an_empty_input_records_nothing_on_a_rank_scaling_on_its_own() -> None:
    # After sync.remove() (RankLocal) the ranks' ledgers are not merged slot by slot, so an
    # empty call must not push an amax of 0 into this rank's history, as in one process.
    from computectx.distributed.collectives import RankLocal
    from computectx.formats.numerics.ledger import ledger_history

    layer = QuantizedLinear(32, 32, ctx=CTX)
    layer.amax_reduce = RankLocal()
    layer(torch.randn(4, 32) * 3).sum().backward()
    before = ledger_history(layer.scaling.input.ledger).clone()
    layer(torch.randn(0, 32)).sum().backward()
    assert torch.equal(ledger_history(layer.scaling.input.ledger), before)


@pytest.mark.parametrize(
    ("max_norm", "error"),
    [(float("nan"), ValueError), (-1.0, ValueError), ("1", TypeError), (True, TypeError)],
)
def test_step_refuses_a_bad_max_norm_before_any_gradient_moves(
    max_norm: object, error: type[Exception]
) -> None:
    model = _mlp()
    par = parallelize(model, ComputeCtx.from_flag("fp32", "cpu"), lr=1e-3)
    par.model(torch.randn(4, 32)).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=r"max_norm must be a real number > 0"):
        par.step(max_norm=max_norm)  # type: ignore[arg-type]
    now = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(now) == len(grads) and all(map(torch.equal, now, grads))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    # inf measures without clipping, as in torch.
    assert par.step(max_norm=float("inf")) is not None


def test_a_join_timeout_past_what_a_timedelta_holds_is_refused_at_setup() -> None:
    with pytest.raises(ValueError, match=r"join_timeout must be a number of seconds in \(0, "):
        parallelize(_mlp(), CTX, join_timeout=10**30)


def _bad_model_part(sd: dict[str, Any]) -> None:
    sd["model"]["0.weight"] = torch.zeros(3, 3)


def _bad_optimizer_part(sd: dict[str, Any]) -> None:
    state = sd["optimizer"]["state"]
    state[next(iter(state))]["step"] = torch.tensor(float("nan"))


@pytest.mark.parametrize(
    ("spoil", "match"),
    [
        (_bad_optimizer_part, r"\['step'\] is nan"),
        (
            _bad_model_part,
            r"'model'\['0.weight'\] is torch.float32 \(3, 3\) on cpu; accepted: a tensor of "
            r"the model's shape \(64, 32\)",
        ),
    ],
    ids=["optimizer step NaN", "model shape"],
)
def test_a_refused_load_changes_neither_the_model_nor_the_optimizer(
    spoil: Callable[[dict[str, Any]], None], match: str
) -> None:
    """One part valid (every model weight moved by 1, or the optimizer's own state), the
    other bad: refused before either part loads (the model had loaded before the optimizer's
    step was refused; torch's strict load copies the other keys before a shape mismatch)."""
    ctx = ComputeCtx.new(DType.F32, "cpu").with_optim_state("int8/block=32/min=0")
    par = parallelize(_mlp(), ctx, lr=1e-2)
    par.model(torch.randn(4, 32)).square().mean().backward()
    par.step(max_norm=1.0)
    assert isinstance(par.optimizer, OffloadedOptimizer)
    sd = copy.deepcopy(par.state_dict())
    sd["model"] = {k: v + 1.0 for k, v in sd["model"].items()}
    spoil(sd)
    weights = [p.detach().clone() for p in par.module.parameters()]
    masters = [m.detach().clone() for m in par.optimizer.master_params]
    state = copy.deepcopy(par.optimizer.state_dict()["state"])
    with pytest.raises(ValueError, match=match):
        par.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(weights, par.module.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(masters, par.optimizer.master_params, strict=True))
    now = par.optimizer.state_dict()["state"]
    assert all(torch.equal(state[i][k], now[i][k]) for i in state for k in state[i])
