"""The scaling ring of one fp8 operand: its layout, its constructor and views into it.

Everything delayed scaling keeps about one operand lives in one float32 vector on the
operand's device, of length ``history_len + RING_TAIL``::

    ring[:n]                    the amax history (n = history_len)
    ring[n + RING_STEP]         the step the next quantize uses
    ring[n + RING_NONFINITE]    calls whose amax was NaN or inf
    ring[n + RING_SATURATED]    elements that saturated

One tensor, so that the quantize kernel updates all of it in place in the launch that
quantizes (no host sync, no second launch), and so that a device move or a checkpoint
handles one object. The counts are float32 because the kernel adds them in the same
vector; they are exact up to 2**24.

This module is the one place that knows the layout: the reference twin, the scaling state
and the statistics use the views below, and ``computectx.fp8.ops`` passes the offsets to
the Triton kernel as constexpr arguments (the kernels import nothing from computectx).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from typing_extensions import TypeIs

from computectx.ctx import parse_device

__all__ = [
    "RING_NONFINITE",
    "RING_SATURATED",
    "RING_SHAPE",
    "RING_STEP",
    "RING_TAIL",
    "RingValues",
    "is_ring",
    "read_ring",
    "ring_from_parts",
    "ring_history",
    "ring_history_len",
    "ring_new",
    "ring_nonfinite",
    "ring_saturated",
    "ring_slot",
    "ring_step",
    "ring_tail",
    "ring_with_history",
]

RING_STEP = 0
"""Offset after the history of the current step."""
RING_NONFINITE = 1
"""Offset after the history of the count of non-finite amaxes."""
RING_SATURATED = 2
"""Offset after the history of the count of saturated elements."""
RING_TAIL = 3
"""Number of slots after the history: the step and the two counts."""

RING_SHAPE = f"a 1-D float32 tensor of length history_len + {RING_TAIL} >= {RING_TAIL + 1}"
"""What a ring is, for error messages."""


def ring_new(history_len: int, device: torch.device | str) -> torch.Tensor:
    """A fresh ring on ``device``: zero history and counts, step 1.0.

    Never an inference tensor, even when called inside ``torch.inference_mode``: rings
    outlive any one mode and are updated in place, which inference tensors forbid outside
    inference mode. ``ValueError`` for a ``history_len`` that is not an int >= 1 or a
    device ``computectx.ctx.parse_device`` does not read.
    """
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"history_len must be an int >= 1, got {history_len!r}")
    dev = parse_device(device)
    with torch.inference_mode(False):
        ring = torch.zeros(history_len + RING_TAIL, dtype=torch.float32, device=dev)
        ring[history_len + RING_STEP] = 1.0
    return ring


def is_ring(value: object) -> TypeIs[torch.Tensor]:
    """Whether ``value`` has a ring's shape and dtype (``RING_SHAPE``); values unread."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.dim() == 1
        and value.numel() > RING_TAIL
    )


def ring_history_len(ring: torch.Tensor) -> int:
    """The length of the amax history."""
    return ring.numel() - RING_TAIL


def ring_history(ring: torch.Tensor) -> torch.Tensor:
    """The amax history, a view of ``ring[:history_len]``."""
    return ring[: ring_history_len(ring)]


def ring_slot(ring: torch.Tensor, idx: int) -> torch.Tensor:
    """History slot ``idx``, a view of shape ``(1,)``."""
    return ring[idx : idx + 1]


def _tail_slot(ring: torch.Tensor, offset: int) -> torch.Tensor:
    at = ring_history_len(ring) + offset
    return ring[at : at + 1]


def ring_step(ring: torch.Tensor) -> torch.Tensor:
    """The current step, a view of shape ``(1,)``."""
    return _tail_slot(ring, RING_STEP)


def ring_nonfinite(ring: torch.Tensor) -> torch.Tensor:
    """The count of non-finite amaxes, a view of shape ``(1,)``."""
    return _tail_slot(ring, RING_NONFINITE)


def ring_saturated(ring: torch.Tensor) -> torch.Tensor:
    """The count of saturated elements, a view of shape ``(1,)``."""
    return _tail_slot(ring, RING_SATURATED)


def ring_tail(ring: torch.Tensor) -> torch.Tensor:
    """The step and the counts, a view of the ``RING_TAIL`` slots after the history."""
    return ring[ring_history_len(ring) :]


def ring_with_history(ring: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """A new contiguous ring holding ``history`` and ``ring``'s step and counts.

    ``history`` (1-D float32, length >= 1, on ``ring``'s device) sets the new history
    length. Like ``ring_new``, never an inference tensor.
    """
    with torch.inference_mode(False):
        return torch.cat([history, ring_tail(ring)]).contiguous()


def ring_from_parts(
    history: torch.Tensor, step: torch.Tensor, nonfinite: torch.Tensor, saturated: torch.Tensor
) -> torch.Tensor:
    """A new ring from its parts (``history``, then three ``(1,)`` float32 tensors) in this
    layout's order, built out of place: for code that must not write a ring piecewise (the
    fused quantize, which writes it back with one ``copy_``)."""
    tail: list[torch.Tensor] = [step] * RING_TAIL
    tail[RING_STEP], tail[RING_NONFINITE], tail[RING_SATURATED] = step, nonfinite, saturated
    return torch.cat([history, *tail])


@dataclass(frozen=True)
class RingValues:
    """A ring's values read on the host (``read_ring``)."""

    history: tuple[float, ...]
    step: float
    nonfinite: float
    saturated: float


def read_ring(ring: torch.Tensor) -> RingValues:
    """The ring's values as Python floats: one device-to-host copy (a device sync)."""
    values = ring.detach().tolist()
    n = ring_history_len(ring)
    return RingValues(
        history=tuple(values[:n]),
        step=values[n + RING_STEP],
        nonfinite=values[n + RING_NONFINITE],
        saturated=values[n + RING_SATURATED],
    )
