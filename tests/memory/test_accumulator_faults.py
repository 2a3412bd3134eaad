"""Fault injection for the gradient accumulators' mutating calls: each check fails in turn,
and every tensor (sums, parameters, their ``grad`` and hooks) and every attribute of the
accumulator, the parameters and the optimizer stays as it was (the ``freeze`` fixture,
tests/conftest.py).

``LowPrecGradAccumulator``: construction (no hook left behind), ``set_sum``,
``set_sum_part``, ``flush_to_param_grads``, ``load_state_dict``, ``state_dict`` while sums
are held; ``OffloadedOptimizer.ingest_grads(acc)``; ``DataParallelGradAccumulator`` in a gloo
world of one (construction, a hand-over with a gradient written after the drain)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from computectx import ComputeCtx, DType
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer

Freeze = Callable[..., object]
BF16 = ComputeCtx.parity("cpu").replace(grad=DType.BF16)


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]


def _backward(params: list[nn.Parameter]) -> None:
    sum((p * torch.randn_like(p)).sum() for p in params).backward()  # type: ignore[union-attr]


@pytest.fixture
def held() -> tuple[list[nn.Parameter], LowPrecGradAccumulator]:
    """Two parameters, a stochastic bf16 accumulator holding one backward's sums, and a
    ``param.grad`` already on the first (``flush`` adds to it)."""
    params = _params()
    acc = LowPrecGradAccumulator(params, BF16, mode="stochastic", seed=3)
    _backward(params)
    params[0].grad = torch.ones(3, 4)
    return params, acc


def _refused(
    freeze: Freeze,
    objects: tuple[object, ...],
    call: Callable[[], object],
    error: type[BaseException],
    match: str,
) -> None:
    before = freeze(*objects)
    with pytest.raises(error, match=match):
        call()
    assert freeze(*objects) == before


def test_refused_construction_leaves_no_hook(freeze: Freeze) -> None:
    params = _params()
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    leafless = params[0] * 2
    bad: list[tuple[Callable[[], object], type[BaseException], str]] = [
        (lambda: LowPrecGradAccumulator(params, "cpu"), TypeError, "ComputeCtx"),  # type: ignore[arg-type]
        (lambda: LowPrecGradAccumulator(params, BF16, mode="up"), ValueError, "unknown mode"),  # type: ignore[arg-type]
        (lambda: LowPrecGradAccumulator(params, BF16, transfer="x"), ValueError, "transfer"),  # type: ignore[arg-type]
        (
            lambda: LowPrecGradAccumulator(params, ComputeCtx.parity("cpu"), mode="stochastic"),
            ValueError,
            "16-bit",
        ),
        (lambda: LowPrecGradAccumulator(params, BF16, seed=True), TypeError, "seed"),
        (lambda: LowPrecGradAccumulator(params[0], BF16), TypeError, "iterable of tensors"),
        (lambda: LowPrecGradAccumulator([*params, "w"], BF16), TypeError, r"params\[2\]"),  # type: ignore[list-item]
        (lambda: LowPrecGradAccumulator([*params, frozen, leafless], BF16), ValueError, "leaf"),
    ]
    for call, error, match in bad:
        _refused(freeze, (params, frozen), call, error, match)


def test_refused_set_sum_and_set_sum_part_change_nothing(
    held: tuple[list[nn.Parameter], LowPrecGradAccumulator], freeze: Freeze
) -> None:
    params, acc = held
    stranger = nn.Parameter(torch.zeros(5))
    bad: list[tuple[Callable[[], object], type[BaseException], str]] = [
        (lambda: acc.set_sum(stranger, torch.zeros(5)), ValueError, "not tracked"),
        (lambda: acc.set_sum(params[1], torch.zeros(4)), ValueError, r"shape \(5,\)"),
        (lambda: acc.set_sum(params[1], [0.0] * 5), ValueError, "list"),  # type: ignore[arg-type]
        (lambda: acc.set_sum_part(stranger, 0, torch.zeros(2)), ValueError, "not tracked"),
        (lambda: acc.set_sum_part(params[0], 0, torch.zeros(2, 2)), ValueError, "1-D"),
        (lambda: acc.set_sum_part(params[0], 1.0, torch.zeros(2)), TypeError, "start"),  # type: ignore[arg-type]
        (lambda: acc.set_sum_part(params[0], True, torch.zeros(2)), TypeError, "start"),
        (lambda: acc.set_sum_part(params[0], -1, torch.zeros(2)), ValueError, "outside"),
        (lambda: acc.set_sum_part(params[0], 11, torch.zeros(2)), ValueError, "outside"),
    ]
    for call, error, match in bad:
        _refused(freeze, (acc, params), call, error, match)


def test_a_refused_flush_changes_nothing(
    held: tuple[list[nn.Parameter], LowPrecGradAccumulator], freeze: Freeze
) -> None:
    params, acc = held
    objects = (acc, params)
    _refused(freeze, objects, lambda: acc.flush_to_param_grads("f9"), ValueError, "f9")  # type: ignore[arg-type]
    _refused(freeze, objects, lambda: acc.flush_to_param_grads(DType.BF16), ValueError, "dtype")
    # A sparse param.grad cannot take a dense sum in place: refused before any parameter's
    # gradient is written or any sum forgotten (it used to write parameter 0's, then fail
    # on parameter 1 with torch's "add(sparse, dense)" after popping its sum: lost).
    params[1].grad = torch.zeros(5).to_sparse()
    _refused(freeze, objects, lambda: acc.flush_to_param_grads(), ValueError, r"\[1\].*sparse")
    params[1].grad = None
    sums = [acc.peek(p).clone() for p in params]  # type: ignore[union-attr]
    acc.flush_to_param_grads()
    assert torch.equal(params[0].grad, 1 + sums[0].float())  # type: ignore[arg-type]
    assert torch.equal(params[1].grad, sums[1].float())  # type: ignore[arg-type]
    assert acc.micro_batches == 0 and acc.peek(params[0]) is None


def test_refused_checkpoints_change_nothing(
    held: tuple[list[nn.Parameter], LowPrecGradAccumulator], freeze: Freeze
) -> None:
    params, acc = held
    objects = (acc, params)
    _refused(freeze, objects, acc.state_dict, ValueError, "hold gradient sums")
    acc.reset()
    good = acc.state_dict()
    assert set(good) >= {"seed"}
    gen = next(k for k in good if k.startswith("generator."))
    bad: list[tuple[dict[str, Any], str]] = [
        ({k: v for k, v in good.items() if k != "seed"}, "seed"),
        ({**good, "seed": torch.tensor(1.5)}, "seed"),
        ({**good, "other": torch.zeros(1)}, "other"),
        ({**good, gen: torch.zeros(3, dtype=torch.uint8)}, gen),
        ({**good, gen: good[gen].float()}, gen),
        ({**good, "generator.meta": good[gen]}, "meta"),
    ]
    for state, match in bad:

        def load(s: dict[str, Any] = state) -> None:
            acc.load_state_dict(s)

        _refused(freeze, objects, load, ValueError, match)
    nearest = LowPrecGradAccumulator(params, BF16, seed=3)
    _refused(
        freeze, (nearest, params), lambda: nearest.load_state_dict(good), ValueError, "nearest"
    )


def test_a_refused_ingest_changes_neither_side(freeze: Freeze) -> None:
    params = _params()
    opt = OffloadedOptimizer(params, BF16, torch.optim.AdamW, lr=0.1)
    acc = LowPrecGradAccumulator(params, BF16)
    _backward(params)
    objects = (opt, acc, params)
    _refused(freeze, objects, lambda: opt.ingest_grads(object()), TypeError, "accumulator")  # type: ignore[arg-type]
    others = LowPrecGradAccumulator(_params(), BF16)
    _refused(freeze, objects, lambda: opt.ingest_grads(others), ValueError, "tracks none")
    params[1].grad = torch.ones(5)  # written after the drain
    _refused(freeze, objects, lambda: opt.ingest_grads(acc), RuntimeError, "written after")
    params[1].grad = None
    opt.ingest_grads(acc)
    assert acc.micro_batches == 0


# ----- DataParallelGradAccumulator in a world of one -------------------------------------------


def test_data_parallel_refusals_change_nothing(world_of_one: None, freeze: Freeze) -> None:
    from computectx.distributed import DataParallelGradAccumulator

    params = _params()
    model = nn.ParameterList(params)
    bad: list[tuple[Callable[[], object], type[BaseException], str]] = [
        (lambda: DataParallelGradAccumulator(model, "cpu"), TypeError, "ComputeCtx"),  # type: ignore[arg-type]
        (lambda: DataParallelGradAccumulator(model, BF16, bucket_mib=0), ValueError, "bucket"),
        (lambda: DataParallelGradAccumulator(model, BF16, bucket_mib="1"), TypeError, "bucket"),  # type: ignore[arg-type]
        (lambda: DataParallelGradAccumulator(model, BF16, bucket_mib=1e-9), ValueError, "byte"),
        (lambda: DataParallelGradAccumulator(params[0], BF16), TypeError, "single Tensor"),
        (lambda: DataParallelGradAccumulator(model, BF16, mode="up"), ValueError, "mode"),  # type: ignore[arg-type]
    ]
    for call, error, match in bad:
        _refused(freeze, (model,), call, error, match)

    acc = DataParallelGradAccumulator(model, BF16, bucket_mib=16 / 2**20)
    _backward(params)
    params[0].grad = torch.ones(3, 4)  # written after the drain, not by DDP
    objects = (acc, params)
    for call in (acc.sync, lambda: acc.peek(params[1]), acc.flush_to_param_grads):
        _refused(freeze, objects, call, RuntimeError, "written after")
    params[0].grad = None
    acc.flush_to_param_grads()
    assert params[0].grad is not None and acc.micro_batches == 0
