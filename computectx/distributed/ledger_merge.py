"""The merge of the ranks' fp8 ledgers: what every rank holds after ``AmaxSync`` merges.

``merge_operands`` takes the ledgers and element counts of every rank (one all-gather, done
by the caller) and writes into each operand what one process quantizing the whole batch
would hold. Device ops only, the same ops on every rank over the same gathered values, so
the result is bit-identical on every rank. ``before`` is the operand as the last merge left
it (the same on every rank), or the rank's own ledger when it was replaced since (a loaded
checkpoint).

Per-tensor (``granularity == "tensor"``) operands:

- history: the element-wise max over ranks (every rank recorded the same calls since the
  last merge, so slot ``i`` is the same call everywhere, and a batch's amax is the max of
  its shards');
- step: recomputed from the merged history by the recipe's formula (the quantize kernel's
  float32 division), so it is bit-identical to a one-process step; kept as it was when no
  rank's ledger changed since the last merge, so a second merge changes nothing;
- non-finite count: when a rank counted a NaN/inf amax since the last merge, the whole batch
  had one, and every rank takes that rank's ledger (history moved on without recording,
  step kept, counted once: what one process holds after such a call);
- saturated count: the last merge's plus the sum of every rank's new saturations.

Fine-grained operands (``row``, ``block``, ``mx``: statistics only, each scale is the current
block's): the newest amax and the largest step are the max over ranks; the non-finite count
grows by the largest rank's growth (one call of one process counts once); the saturated
count by the sum of the ranks'.

Element counts: operands whose tensor is split over ranks (inputs, output gradients, weight
shards that FSDP2's fp8 all-gather quantizes) grow by the sum of every rank's growth, exact
for uneven shards; a weight every rank quantizes whole is one tensor counted once (the max
over ranks, which are equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from computectx.dtypes import Fp8Format
from computectx.formats import QuantizedLinear
from computectx.formats.seam import (
    OperandScaling,
    Role,
    ledger_history,
    ledger_nonfinite,
    ledger_saturated,
    ledger_step,
    step_from_amax,
)
from computectx.recipes import DelayedScaling

__all__ = ["LossNormalization", "MergeEntry", "merge_operands", "payload", "rescale_grad_ledger"]

LossNormalization = Literal["per_rank", "global"]
"""What each rank's loss is divided by: its own batch, or the global batch."""


@dataclass
class MergeEntry:
    """One operand to merge, with what the last merge left in it."""

    layer: QuantizedLinear
    role: Role
    op: OperandScaling
    before: torch.Tensor
    """The ledger as the last merge left it (or the rank's own, when replaced since)."""
    before_elements: torch.Tensor | None
    """The element count then, an int64 ``(1,)`` device tensor (``None``: replaced since)."""
    split: bool
    """The operand is split over ranks (inputs, gradients, weight shards): counts add up."""


def payload(entries: list[MergeEntry]) -> torch.Tensor:
    """This rank's ledgers, then its element counts, as one float64 vector (exact: float32
    values, and counts below 2**53), for one all-gather."""
    parts = [e.op.ledger.detach().to(torch.float64) for e in entries]
    parts += [e.op.elements_tensor.to(torch.float64) for e in entries]
    return torch.cat(parts)


def _format_of(layer: QuantizedLinear, role: Role) -> Fp8Format:
    scheme = layer.policy.format
    return scheme.backward if role == "grad" else scheme.forward


def merge_operands(entries: list[MergeEntry], gathered: torch.Tensor) -> None:
    """Write the merge of ``gathered`` (``(world, len(payload))``, every rank's ``payload``)
    into every operand of ``entries``, in place, on the device."""
    sizes = [e.op.ledger.numel() for e in entries]
    total = sum(sizes)
    ledgers = gathered[:, :total].to(torch.float32)
    elements = gathered[:, total:].to(torch.int64)
    offset = 0
    with torch.no_grad():
        for i, (entry, size) in enumerate(zip(entries, sizes, strict=True)):
            each = ledgers[:, offset : offset + size]
            offset += size
            if entry.layer.policy.granularity == "tensor":
                _merge_tensor(entry, each)
            else:
                _merge_fine(entry, each)
            _merge_elements(entry, elements[:, i])


def _merge_tensor(entry: MergeEntry, ledgers: torch.Tensor) -> None:
    op, before, layer = entry.op, entry.before, entry.layer
    each = ledgers.unbind(0)  # one ledger per rank
    nonfinite_all = torch.cat([ledger_nonfinite(r) for r in each])
    saturated_all = torch.cat([ledger_saturated(r) for r in each])
    prev_saturated = ledger_saturated(before)
    # index_select with a device index (not t[i]): no data-dependent indexing on the host.
    poisoned_rank = nonfinite_all.argmax().reshape(1)
    taken = ledgers.index_select(0, poisoned_rank)[0]
    poisoned = ledger_nonfinite(taken) > ledger_nonfinite(before)
    merged_hist = torch.stack([ledger_history(r) for r in each]).amax(dim=0)
    scaling = layer.policy.scaling
    if isinstance(scaling, DelayedScaling) and scaling.algo == "max":
        window = merged_hist.amax().reshape(1)
    else:
        window = merged_hist[op.newest_amax_index()].reshape(1)
    fresh_step = step_from_amax(window, _format_of(layer, entry.role), scaling.margin)
    # Nothing recorded anywhere since the last merge: the step stays (a merge after a merge,
    # or after a NaN kept the step, changes nothing).
    unchanged = (ledgers == before.unsqueeze(0)).all().reshape(1)
    step = torch.where(unchanged, ledger_step(before), fresh_step)
    ledger_history(op.ledger).copy_(torch.where(poisoned, ledger_history(taken), merged_hist))
    ledger_step(op.ledger).copy_(torch.where(poisoned, ledger_step(taken), step))
    ledger_nonfinite(op.ledger).copy_(ledger_nonfinite(taken))
    if entry.split:
        ledger_saturated(op.ledger).copy_(prev_saturated + (saturated_all - prev_saturated).sum())
    else:
        ledger_saturated(op.ledger).copy_(ledger_saturated(taken))


def _merge_fine(entry: MergeEntry, ledgers: torch.Tensor) -> None:
    op, before = entry.op, entry.before
    each = ledgers.unbind(0)
    ledger_history(op.ledger).copy_(torch.stack([ledger_history(r) for r in each]).amax(dim=0))
    ledger_step(op.ledger).copy_(torch.cat([ledger_step(r) for r in each]).amax().reshape(1))
    nonfinite_all = torch.cat([ledger_nonfinite(r) for r in each])
    prev_nonfinite = ledger_nonfinite(before)
    ledger_nonfinite(op.ledger).copy_(prev_nonfinite + (nonfinite_all - prev_nonfinite).amax())
    saturated_all = torch.cat([ledger_saturated(r) for r in each])
    prev_saturated = ledger_saturated(before)
    if entry.split:
        ledger_saturated(op.ledger).copy_(prev_saturated + (saturated_all - prev_saturated).sum())
    else:
        ledger_saturated(op.ledger).copy_(saturated_all.amax().reshape(1))


def _merge_elements(entry: MergeEntry, counts: torch.Tensor) -> None:
    # counts: (world,) int64, every rank's element count now.
    mine = entry.op.elements_tensor
    if entry.split and entry.before_elements is not None:
        prev = entry.before_elements
        mine.copy_(prev + (counts - prev).sum())
    else:
        mine.copy_(counts.amax().reshape(1))


def rescale_grad_ledger(
    layer: QuantizedLinear, world_size: int, loss_normalization: LossNormalization = "per_rank"
) -> None:
    """Bring ``layer``'s scaling state to ``world_size`` ranks (device ops, in place).

    Under a loss each rank normalizes by its own batch (``"per_rank"``), a rank's output
    gradient is ``world_size`` times the whole batch's, and so is what its gradient ledger
    holds: a state recorded at ``layer.scaling.world_size`` ranks has its gradient history
    and step multiplied by the ratio of the world sizes (exact for powers of two), so the
    first backward after loading a checkpoint saved at another world size neither saturates
    nor wastes range. Under a ``"global"`` normalization nothing depends on the world size.
    Either way the state is then marked as recorded at ``world_size``.
    """
    state = layer.scaling
    if loss_normalization == "per_rank" and state.world_size != world_size:
        ledger = state.grad.ledger
        ratio = world_size / state.world_size
        with torch.no_grad():
            ledger_history(ledger).mul_(ratio)
            ledger_step(ledger).mul_(ratio)
    state.world_size = world_size
