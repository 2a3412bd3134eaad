"""The tensor-wise quantizes that read and advance a ledger, on the kernels or the twins.

What the ``fp8_quantize_delayed`` and ``fp8_quantize_dynamic`` operators
(``computectx.fp8.ops.registry``) run: seeding an unseeded ledger, rotating its history,
quantizing with its step on the Triton kernel (``computectx.fp8.ops.triton``) or the pure-torch
twin (``computectx.fp8.numerics.tensorwise``), and counting into the tally. Delayed ledgers are
kept oldest to newest: each call rotates the history one slot to the left and the quantize
writes its amax into the last slot, so no host-side index changes between calls.
"""

from __future__ import annotations

from typing import Literal

import torch

from computectx.dtypes import Fp8Format
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.numerics import tensorwise
from computectx.fp8.numerics.ledger import (
    LEDGER_NONFINITE,
    LEDGER_SATURATED,
    LEDGER_STEP,
    TALLY_SEEDED,
    count,
    ledger_history,
    ledger_history_len,
)
from computectx.fp8.ops import triton

__all__ = ["delayed_call", "quantize_delayed_at", "quantize_dynamic_with"]


def quantize_delayed_at(
    x: torch.Tensor,
    fmt: Fp8Format,
    ledger: torch.Tensor,
    slot: int,
    algo: Literal["max", "most_recent"],
    margin: int,
    backend: Fp8Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed quantize writing history ``slot``, on the kernels or the pure-torch twin
    (``uses_kernels``); arguments already checked. The kernel knows no ledger layout of its
    own: it gets this one's offsets."""
    if not triton.uses_kernels(backend, x):
        return tensorwise.quantize_delayed(x, fmt, ledger, slot, algo, margin)
    return triton.quantize_delayed(
        x=x,
        fp8=fmt.torch,
        ledger=ledger,
        history_len=ledger_history_len(ledger),
        slot=slot,
        step_offset=LEDGER_STEP,
        nonfinite_offset=LEDGER_NONFINITE,
        saturated_offset=LEDGER_SATURATED,
        algo=algo,
        margin=margin,
    )


def quantize_dynamic_with(
    x: torch.Tensor, fmt: Fp8Format, margin: int, backend: Fp8Backend
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data_fp8, step, amax)`` from ``x``'s own amax, on the kernels or the twin."""
    if not triton.uses_kernels(backend, x):
        return tensorwise.quantize_dynamic(x, fmt, margin)
    return triton.quantize_dynamic(x=x, fp8=fmt.torch, margin=margin)


def delayed_call(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fmt: Fp8Format,
    algo: Literal["max", "most_recent"],
    margin: int,
    backend: Fp8Backend,
    may_seed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``fp8_quantize_delayed`` runs, as a plain function: ``(data_fp8, step_used)``.

    When the tally says the ledger is not seeded yet, the history is first filled with
    ``amax(x)`` and the step set from it, so the first call quantizes with its own step (a
    non-finite amax leaves the ledger alone: the quantize counts it, once). ``may_seed=False``
    promises the ledger is seeded and skips that check. Then the history rotates one slot
    left, ``x`` is quantized with the ledger's step, its amax lands in the last slot and the
    step becomes the next one from the window (``algo``); the tally counts ``x``.

    Launches on a GPU with the kernels (docs/fp8.md, "Delayed scaling"): the quantize
    kernel, the rotation (roll, copy; none for a history of 1) and the tally (fill, add),
    plus the seeding check's small ops when ``may_seed``.
    """
    if may_seed:
        unseeded = tally[TALLY_SEEDED : TALLY_SEEDED + 1] == 0
        tensorwise.seed_ledger(ledger, x, fmt, margin, when=unseeded)
    history = ledger_history(ledger)
    if history.numel() > 1:
        history.copy_(torch.roll(history, -1))
    q, step_used = quantize_delayed_at(x, fmt, ledger, history.numel() - 1, algo, margin, backend)
    count(tally, x)
    return q, step_used
