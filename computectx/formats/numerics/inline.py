"""The quantize of one operand as plain torch ops, for Inductor to fuse (``quantize="inline"``).

``computectx::fp8_quantize_delayed`` / ``fp8_quantize_dynamic`` are opaque to a compiled
graph: Inductor cannot fold their amax, step and cast into the norm or activation that
produces ``x``. The functions here compute the same thing from the pure-torch twins'
building blocks (``computectx.formats.numerics.tensorwise``), so a compiled graph sees every op, and
write the ledger and the tally back with one ``copy_`` each, which functionalization turns into the
same input mutation the operators declare.

Same bytes as the operators: the quantized data, the step used, the ledger and the tally agree
bit for bit with ``fp8_quantize_delayed(..., may_seed=True)`` and ``fp8_quantize_dynamic``
on every backend (the kernels are bit-identical to the twins). Eager callers normally keep
the operators (the Triton kernel is one launch); ``OperandScaling.quantize`` routes to these
only while ``torch.compile`` traces a layer built with ``quantize="inline"``.

*Inline* because the quantize is traced into the compiled graph as ordinary ops instead of
being called as one opaque operator; whether Inductor then fuses them with their neighbours
is its choice. The option's spelling before issue 14 (``OLD_SPELLING``) now raises a
``ValueError`` naming this one.
"""

from __future__ import annotations

from typing import Literal

import torch

from computectx.dtypes import Fp8Format
from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.ledger import (
    TALLY_ELEMENTS,
    TALLY_SEEDED,
    ledger_from_parts,
    ledger_history,
    ledger_history_len,
    ledger_nonfinite,
    ledger_saturated,
    ledger_step,
)

__all__ = [
    "OLD_SPELLING",
    "QUANTIZE_IMPLS",
    "QuantizeImpl",
    "parse_quantize",
    "quantize_delayed",
    "quantize_dynamic",
]

QuantizeImpl = Literal["op", "inline"]
"""How a compiled fp8 linear quantizes: ``"op"``, the opaque ``computectx::fp8_quantize_*``
operators (the Triton kernel on a GPU); ``"inline"``, plain torch ops Inductor can fuse."""
QUANTIZE_IMPLS: tuple[QuantizeImpl, ...] = ("op", "inline")
OLD_SPELLING = "fused"  # rename.py: keep
"""What ``"inline"`` was called before; ``parse_quantize`` refuses it, naming the new one."""


def parse_quantize(value: object) -> QuantizeImpl:
    """``value`` if it is ``"op"`` or ``"inline"``; ``ValueError`` naming both otherwise
    (naming ``"inline"`` for ``OLD_SPELLING``, its name before)."""
    if value == "op":
        return "op"
    if value == "inline":
        return "inline"
    if value == OLD_SPELLING:
        raise ValueError(f"{OLD_SPELLING!r} was renamed 'inline': pass quantize='inline'")
    raise ValueError(f"quantize must be 'op' or 'inline', got {value!r}")


def _counted(tally: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # [seeded, elements] after counting x: seeded becomes 1, elements grows by numel.
    seeded = torch.ones_like(tally[TALLY_SEEDED : TALLY_SEEDED + 1])
    elements = tally[TALLY_ELEMENTS : TALLY_ELEMENTS + 1] + x.numel()
    return torch.cat([seeded, elements])


def quantize_delayed(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fmt: Fp8Format,
    algo: Literal["max", "most_recent"],
    margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize_delayed(x, ledger, tally, ..., may_seed=True)`` as torch ops.

    Seed when the tally says unseeded (history := amax(x), step from it; a non-finite amax
    leaves the ledger alone), rotate the history one slot left, quantize with the ledger's step,
    record the amax in the last slot, take the next step from the window, count non-finite
    amaxes and saturated elements, count ``x`` in the tally. Returns ``(data_fp8,
    step_used)``; ``ledger`` and ``tally`` are updated in place (one ``copy_`` each).
    """
    history, step = ledger_history(ledger), ledger_step(ledger)
    nonfinite, saturated = ledger_nonfinite(ledger), ledger_saturated(ledger)
    a = tensorwise.amax(x)
    finite = torch.isfinite(a)
    # Seeding (only on the operand's first call; a non-finite amax is counted once, below).
    unseeded = tally[TALLY_SEEDED : TALLY_SEEDED + 1] == 0
    seed = unseeded & finite
    history = torch.where(seed, a.expand_as(history), history)
    step_used = torch.where(seed, tensorwise.step_from_amax(a, fmt, margin), step)
    if ledger_history_len(ledger) > 1:
        history = torch.roll(history, -1)
    # The quantize with the ledger's step, and the ledger's advance.
    q, _ = tensorwise.quantize_with_step(x, fmt, step_used)
    sat = tensorwise.saturated_count(x, step_used, fmt)
    history = torch.cat([history[:-1], torch.where(finite, a, history[-1:])])
    window = history.amax().reshape(1) if algo == "max" else a
    next_step = torch.where(finite, tensorwise.step_from_amax(window, fmt, margin), step_used)
    nonfinite = nonfinite + (~finite).to(torch.float32)
    ledger.copy_(ledger_from_parts(history, next_step, nonfinite, saturated + sat))
    tally.copy_(_counted(tally, x))
    return q, step_used


def quantize_dynamic(
    x: torch.Tensor, ledger: torch.Tensor, tally: torch.Tensor, fmt: Fp8Format, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize_dynamic(x, ledger, tally, ...)`` as torch ops: ``(data_fp8, step)``.

    The step is ``x``'s own; the ledger records the amax in its last slot (when finite; a
    non-finite one is counted) and the step; the tally counts ``x``. Updated in place.
    """
    q, step, a = tensorwise.quantize_dynamic(x, fmt, margin)
    history = ledger_history(ledger)
    finite = torch.isfinite(a)
    newest = torch.where(finite, a, history[-1:])
    nonfinite = ledger_nonfinite(ledger) + (~finite).to(torch.float32)
    history = torch.cat([history[:-1], newest])
    ledger.copy_(ledger_from_parts(history, step, nonfinite, ledger_saturated(ledger)))
    tally.copy_(_counted(tally, x))
    return q, step
