"""The scaling ledger's layout, owned by ``computectx.formats.numerics.ledger``: constructor, views,
reads."""

from __future__ import annotations

import pytest
import torch

from computectx.formats.numerics.ledger import (
    LEDGER_NONFINITE,
    LEDGER_SATURATED,
    LEDGER_SHAPE,
    LEDGER_STEP,
    LEDGER_TAIL,
    is_ledger,
    ledger_from_parts,
    ledger_history,
    ledger_history_len,
    ledger_new,
    ledger_nonfinite,
    ledger_saturated,
    ledger_slot,
    ledger_step,
    ledger_tail,
    ledger_with_history,
    read_ledger,
)


def test_the_documented_layout() -> None:
    # docs/fp8.md and the module docstring: history, then step, non-finite, saturated.
    assert (LEDGER_STEP, LEDGER_NONFINITE, LEDGER_SATURATED, LEDGER_TAIL) == (0, 1, 2, 3)
    ledger = ledger_new(4, "cpu")
    assert ledger.dtype == torch.float32 and ledger.shape == (7,) and ledger.is_contiguous()
    assert ledger.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert ledger_history_len(ledger) == 4
    assert "history_len + 3 >= 4" in LEDGER_SHAPE


def test_views_write_through_to_their_slots() -> None:
    ledger = ledger_new(3, "cpu")
    ledger_history(ledger).copy_(torch.tensor([1.0, 2.0, 3.0]))
    ledger_slot(ledger, 1).fill_(5.0)
    ledger_step(ledger).fill_(0.25)
    ledger_nonfinite(ledger).add_(2.0)
    ledger_saturated(ledger).add_(7.0)
    assert ledger.tolist() == [1.0, 5.0, 3.0, 0.25, 2.0, 7.0]
    assert ledger_tail(ledger).tolist() == [0.25, 2.0, 7.0]
    for view in (
        ledger_slot(ledger, 0),
        ledger_step(ledger),
        ledger_nonfinite(ledger),
        ledger_saturated(ledger),
    ):
        assert view.shape == (1,)
        assert view.untyped_storage().data_ptr() == ledger.untyped_storage().data_ptr()


def test_read_ledger_is_one_host_copy_of_every_field() -> None:
    ledger = ledger_new(2, "cpu")
    ledger.copy_(torch.tensor([3.0, 4.0, 0.5, 1.0, 9.0]))
    values = read_ledger(ledger)
    assert values.history == (3.0, 4.0)
    assert (values.step, values.nonfinite, values.saturated) == (0.5, 1.0, 9.0)


def test_ledger_with_history_keeps_the_tail() -> None:
    ledger = ledger_new(2, "cpu")
    ledger_tail(ledger).copy_(torch.tensor([0.5, 1.0, 9.0]))
    longer = ledger_with_history(ledger, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert longer.tolist() == [1.0, 2.0, 3.0, 4.0, 0.5, 1.0, 9.0]
    assert longer.untyped_storage().data_ptr() != ledger.untyped_storage().data_ptr()


def test_ledgers_made_inside_inference_mode_can_be_updated_after_it() -> None:
    with torch.inference_mode():
        ledger = ledger_new(2, "cpu")
        grown = ledger_with_history(ledger, torch.ones(3))
    for r in (ledger, grown):
        assert not r.is_inference()
        ledger_step(r).fill_(2.0)  # an in-place update outside inference mode
        assert ledger_step(r).item() == 2.0


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
def test_is_ledger(value: object, expected: bool) -> None:
    assert is_ledger(value) is expected


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_ledger_new_refuses_a_bad_history_len(bad: object) -> None:
    with pytest.raises(ValueError, match=f"history_len must be an int >= 1, got {bad!r}"):
        ledger_new(bad, "cpu")  # type: ignore[arg-type]


def test_ledger_new_reads_the_device_with_the_ctx_parser() -> None:
    assert ledger_new(1, " cpu ").device == torch.device("cpu")
    with pytest.raises(ValueError, match="bad device 'gpu0'; accepted: 'cpu'"):
        ledger_new(1, "gpu0")


def test_ledger_from_parts_places_each_part_at_its_offset() -> None:
    history = torch.tensor([1.0, 2.0, 3.0])
    step, nonfinite, saturated = torch.tensor([0.5]), torch.tensor([7.0]), torch.tensor([9.0])
    built = ledger_from_parts(history, step, nonfinite, saturated)
    assert is_ledger(built) and ledger_history_len(built) == 3
    assert torch.equal(ledger_history(built), history)
    assert torch.equal(ledger_step(built), step)
    assert torch.equal(ledger_nonfinite(built), nonfinite)
    assert torch.equal(ledger_saturated(built), saturated)
