"""The quantize of one operand as plain torch ops, for Inductor to fuse (``quantize="fused"``).

``computectx::fp8_quantize_delayed`` / ``fp8_quantize_dynamic`` are opaque to a compiled
graph: Inductor cannot fold their amax, step and cast into the norm or activation that
produces ``x``. The functions here compute the same thing from the pure-torch twins'
building blocks (``computectx.fp8.reference``), so a compiled graph sees every op, and write
the ring and the tally back with one ``copy_`` each, which functionalization turns into the
same input mutation the operators declare.

Same bytes as the operators: the quantized data, the step used, the ring and the tally agree
bit for bit with ``fp8_quantize_delayed(..., may_seed=True)`` and ``fp8_quantize_dynamic``
on every backend (the kernels are bit-identical to the twins). Eager callers normally keep
the operators (the Triton kernel is one launch); ``OperandScaling.quantize`` routes to these
only while ``torch.compile`` traces a layer built with ``quantize="fused"``.
"""

from __future__ import annotations

from typing import Literal

import torch

from computectx.dtypes import Fp8Format
from computectx.fp8 import library, reference
from computectx.fp8.ring import (
    ring_from_parts,
    ring_history,
    ring_history_len,
    ring_nonfinite,
    ring_saturated,
    ring_step,
)

__all__ = [
    "QUANTIZE_IMPLS",
    "QuantizeImpl",
    "parse_quantize",
    "quantize_delayed",
    "quantize_dynamic",
]

QuantizeImpl = Literal["op", "fused"]
"""How a compiled fp8 linear quantizes: ``"op"``, the opaque ``computectx::fp8_quantize_*``
operators (the Triton kernel on a GPU); ``"fused"``, plain torch ops Inductor can fuse."""
QUANTIZE_IMPLS: tuple[QuantizeImpl, ...] = ("op", "fused")


def parse_quantize(value: object) -> QuantizeImpl:
    """``value`` if it is ``"op"`` or ``"fused"``; ``ValueError`` naming both otherwise."""
    if value == "op":
        return "op"
    if value == "fused":
        return "fused"
    raise ValueError(f"quantize must be 'op' or 'fused', got {value!r}")


def _counted(tally: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # [seeded, elements] after counting x: seeded becomes 1, elements grows by numel.
    seeded = torch.ones_like(tally[library.TALLY_SEEDED : library.TALLY_SEEDED + 1])
    elements = tally[library.TALLY_ELEMENTS : library.TALLY_ELEMENTS + 1] + x.numel()
    return torch.cat([seeded, elements])


def quantize_delayed(
    x: torch.Tensor,
    ring: torch.Tensor,
    tally: torch.Tensor,
    fmt: Fp8Format,
    algo: Literal["max", "most_recent"],
    margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize_delayed(x, ring, tally, ..., may_seed=True)`` as torch ops.

    Seed when the tally says unseeded (history := amax(x), step from it; a non-finite amax
    leaves the ring alone), rotate the history one slot left, quantize with the ring's step,
    record the amax in the last slot, take the next step from the window, count non-finite
    amaxes and saturated elements, count ``x`` in the tally. Returns ``(data_fp8,
    step_used)``; ``ring`` and ``tally`` are updated in place (one ``copy_`` each).
    """
    history, step = ring_history(ring), ring_step(ring)
    nonfinite, saturated = ring_nonfinite(ring), ring_saturated(ring)
    a = reference.amax(x)
    finite = torch.isfinite(a)
    # Seeding (only on the operand's first call; a non-finite amax is counted once, below).
    unseeded = tally[library.TALLY_SEEDED : library.TALLY_SEEDED + 1] == 0
    seed = unseeded & finite
    history = torch.where(seed, a.expand_as(history), history)
    step_used = torch.where(seed, reference.step_from_amax(a, fmt, margin), step)
    if ring_history_len(ring) > 1:
        history = torch.roll(history, -1)
    # The quantize with the ring's step, and the ring's advance.
    q, _ = reference.quantize_with_step(x, fmt, step_used)
    sat = reference.saturated_count(x, step_used, fmt)
    history = torch.cat([history[:-1], torch.where(finite, a, history[-1:])])
    window = history.amax().reshape(1) if algo == "max" else a
    next_step = torch.where(finite, reference.step_from_amax(window, fmt, margin), step_used)
    nonfinite = nonfinite + (~finite).to(torch.float32)
    ring.copy_(ring_from_parts(history, next_step, nonfinite, saturated + sat))
    tally.copy_(_counted(tally, x))
    return q, step_used


def quantize_dynamic(
    x: torch.Tensor, ring: torch.Tensor, tally: torch.Tensor, fmt: Fp8Format, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize_dynamic(x, ring, tally, ...)`` as torch ops: ``(data_fp8, step)``.

    The step is ``x``'s own; the ring records the amax in its last slot (when finite; a
    non-finite one is counted) and the step; the tally counts ``x``. Updated in place.
    """
    q, step, a = reference.quantize_dynamic(x, fmt, margin)
    history = ring_history(ring)
    finite = torch.isfinite(a)
    newest = torch.where(finite, a, history[-1:])
    nonfinite = ring_nonfinite(ring) + (~finite).to(torch.float32)
    history = torch.cat([history[:-1], newest])
    ring.copy_(ring_from_parts(history, step, nonfinite, ring_saturated(ring)))
    tally.copy_(_counted(tally, x))
    return q, step
