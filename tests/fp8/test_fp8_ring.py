"""The scaling ring's layout, owned by ``computectx.fp8.ring``: constructor, views, reads."""

from __future__ import annotations

import pytest
import torch

from computectx.fp8.ring import (
    RING_NONFINITE,
    RING_SATURATED,
    RING_SHAPE,
    RING_STEP,
    RING_TAIL,
    is_ring,
    read_ring,
    ring_from_parts,
    ring_history,
    ring_history_len,
    ring_new,
    ring_nonfinite,
    ring_saturated,
    ring_slot,
    ring_step,
    ring_tail,
    ring_with_history,
)


def test_the_documented_layout() -> None:
    # docs/fp8.md and the module docstring: history, then step, non-finite, saturated.
    assert (RING_STEP, RING_NONFINITE, RING_SATURATED, RING_TAIL) == (0, 1, 2, 3)
    ring = ring_new(4, "cpu")
    assert ring.dtype == torch.float32 and ring.shape == (7,) and ring.is_contiguous()
    assert ring.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert ring_history_len(ring) == 4
    assert "history_len + 3 >= 4" in RING_SHAPE


def test_views_write_through_to_their_slots() -> None:
    ring = ring_new(3, "cpu")
    ring_history(ring).copy_(torch.tensor([1.0, 2.0, 3.0]))
    ring_slot(ring, 1).fill_(5.0)
    ring_step(ring).fill_(0.25)
    ring_nonfinite(ring).add_(2.0)
    ring_saturated(ring).add_(7.0)
    assert ring.tolist() == [1.0, 5.0, 3.0, 0.25, 2.0, 7.0]
    assert ring_tail(ring).tolist() == [0.25, 2.0, 7.0]
    for view in (ring_slot(ring, 0), ring_step(ring), ring_nonfinite(ring), ring_saturated(ring)):
        assert view.shape == (1,)
        assert view.untyped_storage().data_ptr() == ring.untyped_storage().data_ptr()


def test_read_ring_is_one_host_copy_of_every_field() -> None:
    ring = ring_new(2, "cpu")
    ring.copy_(torch.tensor([3.0, 4.0, 0.5, 1.0, 9.0]))
    values = read_ring(ring)
    assert values.history == (3.0, 4.0)
    assert (values.step, values.nonfinite, values.saturated) == (0.5, 1.0, 9.0)


def test_ring_with_history_keeps_the_tail() -> None:
    ring = ring_new(2, "cpu")
    ring_tail(ring).copy_(torch.tensor([0.5, 1.0, 9.0]))
    longer = ring_with_history(ring, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert longer.tolist() == [1.0, 2.0, 3.0, 4.0, 0.5, 1.0, 9.0]
    assert longer.untyped_storage().data_ptr() != ring.untyped_storage().data_ptr()


def test_rings_made_inside_inference_mode_can_be_updated_after_it() -> None:
    with torch.inference_mode():
        ring = ring_new(2, "cpu")
        grown = ring_with_history(ring, torch.ones(3))
    for r in (ring, grown):
        assert not r.is_inference()
        ring_step(r).fill_(2.0)  # an in-place update outside inference mode
        assert ring_step(r).item() == 2.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (torch.zeros(4), True),
        (torch.zeros(3), False),  # no room for a history
        (torch.zeros(4, dtype=torch.float64), False),
        (torch.zeros(2, 4), False),
        ([0.0] * 4, False),
    ],
)
def test_is_ring(value: object, expected: bool) -> None:
    assert is_ring(value) is expected


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_ring_new_refuses_a_bad_history_len(bad: object) -> None:
    with pytest.raises(ValueError, match=f"history_len must be an int >= 1, got {bad!r}"):
        ring_new(bad, "cpu")  # type: ignore[arg-type]


def test_ring_new_reads_the_device_with_the_ctx_parser() -> None:
    assert ring_new(1, " cpu ").device == torch.device("cpu")
    with pytest.raises(ValueError, match="bad device 'gpu0'; accepted: 'cpu'"):
        ring_new(1, "gpu0")


def test_ring_from_parts_places_each_part_at_its_offset() -> None:
    history = torch.tensor([1.0, 2.0, 3.0])
    step, nonfinite, saturated = torch.tensor([0.5]), torch.tensor([7.0]), torch.tensor([9.0])
    built = ring_from_parts(history, step, nonfinite, saturated)
    assert is_ring(built) and ring_history_len(built) == 3
    assert torch.equal(ring_history(built), history)
    assert torch.equal(ring_step(built), step)
    assert torch.equal(ring_nonfinite(built), nonfinite)
    assert torch.equal(ring_saturated(built), saturated)
