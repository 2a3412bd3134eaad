"""The scaling ledger of one fp8 operand: its layout, its constructor and views into it.

Everything delayed scaling keeps about one operand lives in one float32 vector on the
operand's device, of length ``history_len + LEDGER_TAIL``::

    ledger[:n]                      the amax history (n = history_len)
    ledger[n + LEDGER_STEP]         the step the next quantize uses
    ledger[n + LEDGER_NONFINITE]    calls whose amax was NaN or inf
    ledger[n + LEDGER_SATURATED]    elements that saturated

A *ledger* because it is the record of what was quantized through the operand: the
amaxes measured, the step in use, and the counts of non-finite amaxes and saturated
elements. (Earlier versions named it after the circular ring its history was, written at
a moving index; the history is now kept oldest to newest, with no index.)

One tensor, so that the quantize kernel updates all of it in place in the launch that
quantizes (no host sync, no second launch), and so that a device move or a checkpoint
handles one object. The counts are float32 because the kernel adds them in the same
vector; they are exact up to 2**24.

This module is the one place that knows the layout: the reference twin, the scaling state
and the statistics use the views below, and ``computectx.formats.ops`` passes the offsets to
the Triton kernel as constexpr arguments (the kernels import nothing from computectx).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from typing_extensions import TypeIs

from computectx.residency import parse_device

__all__ = [
    "LEDGER_NONFINITE",
    "LEDGER_SATURATED",
    "LEDGER_SHAPE",
    "LEDGER_STEP",
    "LEDGER_TAIL",
    "TALLY_ELEMENTS",
    "TALLY_LEN",
    "TALLY_SEEDED",
    "LedgerParts",
    "LedgerValues",
    "check_ledger",
    "check_tally",
    "count",
    "is_ledger",
    "ledger_from_parts",
    "ledger_history",
    "ledger_history_len",
    "ledger_new",
    "ledger_nonfinite",
    "ledger_parts",
    "ledger_saturated",
    "ledger_slot",
    "ledger_step",
    "ledger_tail",
    "ledger_with_history",
    "read_ledger",
    "record",
    "tally_new",
]

LEDGER_STEP = 0
"""Offset after the history of the current step."""
LEDGER_NONFINITE = 1
"""Offset after the history of the count of non-finite amaxes."""
LEDGER_SATURATED = 2
"""Offset after the history of the count of saturated elements."""
LEDGER_TAIL = 3
"""Number of slots after the history: the step and the two counts."""

LEDGER_SHAPE = f"a 1-D float32 tensor of length history_len + {LEDGER_TAIL} >= {LEDGER_TAIL + 1}"
"""What a ledger is, for error messages."""


def ledger_new(history_len: int, device: torch.device | str) -> torch.Tensor:
    """A fresh ledger on ``device``: zero history and counts, step 1.0.

    Never an inference tensor, even when called inside ``torch.inference_mode``: ledgers
    outlive any one mode and are updated in place, which inference tensors forbid outside
    inference mode. ``ValueError`` for a ``history_len`` that is not an int >= 1 or a
    device ``computectx.residency.parse_device`` does not read.
    """
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"history_len must be an int >= 1, got {history_len!r}")
    dev = parse_device(device)
    with torch.inference_mode(False):
        ledger = torch.zeros(history_len + LEDGER_TAIL, dtype=torch.float32, device=dev)
        ledger[history_len + LEDGER_STEP] = 1.0
    return ledger


def is_ledger(value: object) -> TypeIs[torch.Tensor]:
    """Whether ``value`` has a ledger's shape and dtype (``LEDGER_SHAPE``); values unread."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.dim() == 1
        and value.numel() > LEDGER_TAIL
    )


def check_ledger(ledger: object, idx: object, device: torch.device) -> int:
    """The history length of ``ledger`` when it is a contiguous ledger on ``device`` and
    ``idx`` one of its history slots; ``TypeError``/``ValueError`` quoting what is wrong
    otherwise. Values unread."""
    if not isinstance(ledger, torch.Tensor):
        raise TypeError(f"ledger must be a tensor from ledger_new, got {type(ledger).__name__}")
    if not is_ledger(ledger):
        raise ValueError(
            f"ledger must be {LEDGER_SHAPE} (ledger_new); "
            f"got dtype {ledger.dtype}, shape {tuple(ledger.shape)}"
        )
    if not ledger.is_contiguous():
        raise ValueError("ledger must be contiguous (it is updated in place)")
    if ledger.device != device:
        raise ValueError(f"ledger is on {ledger.device} but the data is on {device}")
    n = ledger_history_len(ledger)
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
        raise ValueError(f"ledger index must be an int in [0, {n}), got {idx!r}")
    return n


def ledger_history_len(ledger: torch.Tensor) -> int:
    """The length of the amax history."""
    return ledger.numel() - LEDGER_TAIL


def ledger_history(ledger: torch.Tensor) -> torch.Tensor:
    """The amax history, a view of ``ledger[:history_len]``."""
    return ledger[: ledger_history_len(ledger)]


def ledger_slot(ledger: torch.Tensor, idx: int) -> torch.Tensor:
    """History slot ``idx``, a view of shape ``(1,)``."""
    return ledger[idx : idx + 1]


def _tail_slot(ledger: torch.Tensor, offset: int) -> torch.Tensor:
    at = ledger_history_len(ledger) + offset
    return ledger[at : at + 1]


def ledger_step(ledger: torch.Tensor) -> torch.Tensor:
    """The current step, a view of shape ``(1,)``."""
    return _tail_slot(ledger, LEDGER_STEP)


def ledger_nonfinite(ledger: torch.Tensor) -> torch.Tensor:
    """The count of non-finite amaxes, a view of shape ``(1,)``."""
    return _tail_slot(ledger, LEDGER_NONFINITE)


def ledger_saturated(ledger: torch.Tensor) -> torch.Tensor:
    """The count of saturated elements, a view of shape ``(1,)``."""
    return _tail_slot(ledger, LEDGER_SATURATED)


class LedgerParts(NamedTuple):
    """Views of every part of one ledger (``ledger_parts``)."""

    history: torch.Tensor
    step: torch.Tensor
    nonfinite: torch.Tensor
    saturated: torch.Tensor


def ledger_parts(ledger: torch.Tensor) -> LedgerParts:
    """The history and the three ``(1,)`` tail slots as views, in one call: for code that
    reads and writes several parts of a ledger in one pass (the twin's delayed quantize)."""
    n = ledger_history_len(ledger)
    s, f, t = n + LEDGER_STEP, n + LEDGER_NONFINITE, n + LEDGER_SATURATED
    return LedgerParts(ledger[:n], ledger[s : s + 1], ledger[f : f + 1], ledger[t : t + 1])


def ledger_tail(ledger: torch.Tensor) -> torch.Tensor:
    """The step and the counts, a view of the ``LEDGER_TAIL`` slots after the history."""
    return ledger[ledger_history_len(ledger) :]


def ledger_with_history(ledger: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """A new contiguous ledger holding ``history`` and ``ledger``'s step and counts.

    ``history`` (1-D float32, length >= 1, on ``ledger``'s device) sets the new history
    length. Like ``ledger_new``, never an inference tensor.
    """
    with torch.inference_mode(False):
        return torch.cat([history, ledger_tail(ledger)]).contiguous()


def ledger_from_parts(
    history: torch.Tensor, step: torch.Tensor, nonfinite: torch.Tensor, saturated: torch.Tensor
) -> torch.Tensor:
    """A new ledger from its parts (``history``, then three ``(1,)`` float32 tensors) in this
    layout's order, built out of place: for code that must not write a ledger piecewise (the
    inline quantize, which writes it back with one ``copy_``)."""
    tail: list[torch.Tensor] = [step] * LEDGER_TAIL
    tail[LEDGER_STEP], tail[LEDGER_NONFINITE], tail[LEDGER_SATURATED] = step, nonfinite, saturated
    return torch.cat([history, *tail])


@dataclass(frozen=True)
class LedgerValues:
    """A ledger's values read on the host (``read_ledger``)."""

    history: tuple[float, ...]
    step: float
    nonfinite: float
    saturated: float


def read_ledger(ledger: torch.Tensor) -> LedgerValues:
    """The ledger's values as Python floats: one device-to-host copy (a device sync)."""
    values = ledger.detach().tolist()
    n = ledger_history_len(ledger)
    return LedgerValues(
        history=tuple(values[:n]),
        step=values[n + LEDGER_STEP],
        nonfinite=values[n + LEDGER_NONFINITE],
        saturated=values[n + LEDGER_SATURATED],
    )


TALLY_SEEDED = 0
"""Tally slot: 1 once the operand's first call has run (its ledger was seeded), else 0."""


TALLY_ELEMENTS = 1
"""Tally slot: elements quantized through the operand so far."""


TALLY_LEN = 2


def tally_new(device: torch.device) -> torch.Tensor:
    """A fresh tally on ``device``: not seeded, no elements (int64 ``[seeded, elements]``).

    Never an inference tensor (it is updated in place, as the ledger is).
    """
    with torch.inference_mode(False):
        return torch.zeros(TALLY_LEN, dtype=torch.int64, device=device)


def check_tally(tally: object, device: torch.device) -> None:
    """``ValueError`` unless ``tally`` is a tally (``tally_new``) on ``device``."""
    if isinstance(tally, torch.Tensor):
        shape = tuple(tally.shape)
        if tally.dtype == torch.int64 and shape == (TALLY_LEN,) and tally.device == device:
            return
        got = f"{tally.dtype} {shape} on {tally.device}"
    else:
        got = type(tally).__name__
    raise ValueError(
        f"tally must be an int64 tensor of shape ({TALLY_LEN},) on {device} "
        f"(computectx.formats.numerics.ledger.tally_new); got {got}"
    )


def count(tally: torch.Tensor, x: torch.Tensor) -> None:
    """Mark the tally seeded and add ``x``'s elements: a fill and an add on the device, no
    host read."""
    tally[TALLY_SEEDED : TALLY_SEEDED + 1].fill_(1)
    tally[TALLY_ELEMENTS : TALLY_ELEMENTS + 1].add_(x.numel())


def record(ledger: torch.Tensor, amax: torch.Tensor, step: torch.Tensor) -> None:
    """Write an amax (into the newest history slot) and the step used with it; a
    non-finite amax is counted and leaves the recorded amax as it was. Device ops only."""
    a = amax.reshape(1).to(device=ledger.device, dtype=torch.float32)
    finite = torch.isfinite(a)
    slot = ledger_slot(ledger, ledger_history_len(ledger) - 1)
    slot.copy_(torch.where(finite, a, slot))
    ledger_step(ledger).copy_(step.reshape(1))
    ledger_nonfinite(ledger).add_((~finite).to(torch.float32))
