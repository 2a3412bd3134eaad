"""One-process checks of the amax sync's world-size bookkeeping (no ranks spawned)."""

from __future__ import annotations

import pytest
import torch

from computectx import ComputeCtx
from computectx.distributed import sync_scaling
from computectx.distributed.fp8_amax_sync import rescale_grad_ledger
from computectx.formats import QuantizedLinear
from computectx.formats.numerics.ledger import ledger_history, ledger_step

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")


def _trained_layer() -> QuantizedLinear:
    torch.manual_seed(0)
    layer = QuantizedLinear(16, 16, ctx=CTX, backend="reference")
    for _ in range(3):
        layer(torch.randn(4, 16)).square().mean().backward()
    return layer


def test_a_per_rank_loss_rescales_only_the_gradient_ledger_by_the_world_ratio() -> None:
    layer = _trained_layer()
    before = {role: op.ledger.clone() for role, op in layer.scaling.operands.items()}
    assert layer.scaling.world_size == 1
    rescale_grad_ledger(layer, 4)
    grad = layer.scaling.grad.ledger
    assert torch.equal(ledger_history(grad), 4 * ledger_history(before["grad"]))
    assert torch.equal(ledger_step(grad), 4 * ledger_step(before["grad"]))
    assert torch.equal(layer.scaling.input.ledger, before["input"])
    assert torch.equal(layer.scaling.weight.ledger, before["weight"])
    assert layer.scaling.world_size == 4
    rescale_grad_ledger(layer, 2)  # back down: halved, exactly
    assert torch.equal(ledger_history(grad), 2 * ledger_history(before["grad"]))


def test_a_global_loss_changes_nothing_but_the_stamp() -> None:
    layer = _trained_layer()
    before = layer.scaling.grad.ledger.clone()
    rescale_grad_ledger(layer, 2, "global")
    assert torch.equal(layer.scaling.grad.ledger, before)
    assert layer.scaling.world_size == 2


def test_the_world_size_travels_with_the_checkpoint_and_is_checked() -> None:
    layer = _trained_layer()
    rescale_grad_ledger(layer, 2)
    state = layer.state_dict()
    fresh = QuantizedLinear(16, 16, ctx=CTX, backend="reference")
    fresh.load_state_dict(state)
    assert fresh.scaling.world_size == 2
    assert torch.equal(fresh.scaling.grad.ledger, layer.scaling.grad.ledger)
    bad = dict(state)
    bad["fp8_meta"] = state["fp8_meta"].clone()
    bad["fp8_meta"][1] = 0  # the world size's slot
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        fresh.load_state_dict(bad)
    assert fresh.scaling.world_size == 2  # unchanged


def test_a_bad_loss_normalization_is_refused_by_name_before_any_collective() -> None:
    with pytest.raises(ValueError, match=r"'per_rank' or 'global', got 'mean'"):
        sync_scaling(_trained_layer(), loss_normalization="mean")  # type: ignore[arg-type]


def test_a_sync_in_one_process_merges_nothing_and_detaches() -> None:
    # No process group: nothing to merge, no hooks, and remove() still works.
    layer = _trained_layer()
    before = layer.scaling.input.ledger.clone()
    sync = sync_scaling(layer)
    assert sync.current_amax == "local"  # a plain module: the rank's own
    sync.sync()
    sync.remove()
    assert sync.merged_state(layer) == {}
    assert torch.equal(layer.scaling.input.ledger, before)
