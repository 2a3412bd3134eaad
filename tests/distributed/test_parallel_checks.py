"""``Parallel.load_state_dict`` refuses another optimizer class's state before anything loads
(issue 21, item 3), in one process: a world of one through ``parallelize``."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import Parallel, parallelize
from computectx.memory import OffloadedOptimizer

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")


def _parallel(optimizer: type[torch.optim.Optimizer], offload: bool, **kw: Any) -> Parallel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return parallelize(
        model,
        CTX,
        fp8_filter=lambda m, fqn: True,
        optimizer_class=optimizer,
        offload=offload,
        accumulate=False,
        lr=1e-3,
        **kw,
    )


def _train(par: Parallel, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        par.model(torch.randn(8, 32, generator=g)).square().mean().backward()
        par.step()


def _checkpoint(par: Parallel) -> dict[str, Any]:
    """``par.state_dict()`` as a file holds it (no storage shared with the live model)."""
    buffer = io.BytesIO()
    torch.save(par.state_dict(), buffer)
    buffer.seek(0)
    out: dict[str, Any] = torch.load(buffer, weights_only=True)
    return out


def _snapshot(par: Parallel) -> list[Any]:
    """Everything loading could change: the model's state (fp8 ledgers included) and the
    optimizer's groups and state."""
    model = [t.clone() for t in par.module.state_dict().values()]
    opt = par.optimizer.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    state = [
        (i, name, v.clone() if isinstance(v, torch.Tensor) else v)
        for i, per in opt["state"].items()
        for name, v in per.items()
    ]
    return [model, groups, state]


def _same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y, strict=True))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return bool(x == y)

    return eq(a, b)


@pytest.mark.parametrize("offload", [False, True], ids=["torch optimizer", "OffloadedOptimizer"])
def test_another_optimizers_checkpoint_is_refused_before_anything_loads(offload: bool) -> None:
    # An AdamW checkpoint into an SGD Parallel was accepted: SGD's groups became AdamW's and
    # the next step died on KeyError 'momentum'. Both directions, with a trained target (it
    # has state and fp8 ledgers that a partial load would change).
    adamw = _parallel(torch.optim.AdamW, offload)
    _train(adamw)
    saved_adamw, adamw_at_save = _checkpoint(adamw), _snapshot(adamw)
    sgd = _parallel(torch.optim.SGD, offload, momentum=0.9)
    assert isinstance(sgd.optimizer, OffloadedOptimizer) is offload
    _train(sgd, 1)
    saved_sgd = _checkpoint(sgd)
    for target, saved, theirs, ours in (
        (sgd, saved_adamw, "torch.optim.AdamW", "torch.optim.SGD"),
        (adamw, saved_sgd, "torch.optim.SGD", "torch.optim.AdamW"),
    ):
        before = _snapshot(target)
        with pytest.raises(ValueError, match=r"Parallel\.load_state_dict") as caught:
            target.load_state_dict(saved)
        message = str(caught.value)
        assert f"saved by {theirs}, not {ours}" in message, message
        assert _same(_snapshot(target), before)
        _train(target, 1)  # still steps with its own options
    # The same class loads, as before.
    again = _parallel(torch.optim.AdamW, offload)
    again.load_state_dict(saved_adamw)
    assert _same(_snapshot(again), adamw_at_save)


def test_a_model_part_of_another_shape_is_refused_naming_both() -> None:
    # A same-keys checkpoint of another width: refused before anything loads, naming the key,
    # what it holds and the model's shape.
    par = _parallel(torch.optim.SGD, False)
    saved = _checkpoint(par)
    key = next(k for k, v in saved["model"].items() if isinstance(v, torch.Tensor) and v.dim() == 2)
    own = tuple(saved["model"][key].shape)
    saved["model"][key] = torch.zeros(own[0] + 1, own[1])
    before = _snapshot(par)
    with pytest.raises(ValueError, match="nothing was loaded") as caught:
        par.load_state_dict(saved)
    message = str(caught.value)
    assert f"'model'[{key!r}] is torch.float32 {(own[0] + 1, own[1])} on cpu" in message, message
    assert f"a tensor of the model's shape {own}; nothing was loaded" in message, message
    assert _same(_snapshot(par), before)


def test_the_ranks_saved_streams_in_another_order_are_named_not_a_stop_iteration() -> None:
    # The same (key, stream) entries in another order on rank 1: the first position that
    # differs is named (parallel_checks' own first-difference raised StopIteration before).
    from computectx.distributed.parallel_checks import check_same_saved_streams

    zero = [("a._extra_state", 1), ("b._extra_state", 2)]
    check_same_saved_streams([zero, list(zero)])
    with pytest.raises(ValueError, match=r"rank\(s\) 1 differ from rank 0; the first is "
                       r"'a._extra_state': stream 1 at position 0 on rank 0"):  # fmt: skip
        check_same_saved_streams([zero, zero[::-1]])
    with pytest.raises(ValueError, match="stream 2 on rank 0, none on rank 2"):
        check_same_saved_streams([zero, zero, zero[:1]])
