"""One-process checks of the amax sync's world-size bookkeeping (no ranks spawned)."""

from __future__ import annotations

import pytest
import torch

from computectx import ComputeCtx
from computectx.distributed import sync_fp8_scaling
from computectx.distributed.amax import rescale_grad_ring
from computectx.fp8 import Fp8Linear
from computectx.fp8.ring import ring_history, ring_step

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")


def _trained_layer() -> Fp8Linear:
    torch.manual_seed(0)
    layer = Fp8Linear(16, 16, ctx=CTX, backend="reference")
    for _ in range(3):
        layer(torch.randn(4, 16)).square().mean().backward()
    return layer


def test_a_per_rank_loss_rescales_only_the_gradient_ring_by_the_world_ratio() -> None:
    layer = _trained_layer()
    before = {role: op.ring.clone() for role, op in layer.scaling.operands.items()}
    assert layer.scaling.world_size == 1
    rescale_grad_ring(layer, 4)
    grad = layer.scaling.grad.ring
    assert torch.equal(ring_history(grad), 4 * ring_history(before["grad"]))
    assert torch.equal(ring_step(grad), 4 * ring_step(before["grad"]))
    assert torch.equal(layer.scaling.input.ring, before["input"])
    assert torch.equal(layer.scaling.weight.ring, before["weight"])
    assert layer.scaling.world_size == 4
    rescale_grad_ring(layer, 2)  # back down: halved, exactly
    assert torch.equal(ring_history(grad), 2 * ring_history(before["grad"]))


def test_a_global_loss_changes_nothing_but_the_stamp() -> None:
    layer = _trained_layer()
    before = layer.scaling.grad.ring.clone()
    rescale_grad_ring(layer, 2, "global")
    assert torch.equal(layer.scaling.grad.ring, before)
    assert layer.scaling.world_size == 2


def test_the_world_size_travels_with_the_checkpoint_and_is_checked() -> None:
    layer = _trained_layer()
    rescale_grad_ring(layer, 2)
    state = layer.state_dict()
    fresh = Fp8Linear(16, 16, ctx=CTX, backend="reference")
    fresh.load_state_dict(state)
    assert fresh.scaling.world_size == 2
    assert torch.equal(fresh.scaling.grad.ring, layer.scaling.grad.ring)
    bad = dict(state["_extra_state"], world_size=0)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        fresh.set_extra_state(bad)
    assert fresh.scaling.world_size == 2  # unchanged
    # A state saved before the field existed was recorded in one process.
    old = dict(state["_extra_state"])
    del old["world_size"]
    fresh.set_extra_state(old)
    assert fresh.scaling.world_size == 1


def test_a_bad_loss_normalization_is_refused_by_name_before_any_collective() -> None:
    with pytest.raises(ValueError, match=r"'per_rank' or 'global', got 'mean'"):
        sync_fp8_scaling(_trained_layer(), loss_normalization="mean")  # type: ignore[arg-type]
