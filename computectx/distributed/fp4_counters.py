"""The 4-bit layers' stochastic-rounding counters made one over the ranks: ``sync_fp4_counters``.

Each rank's ``Fp4Linear`` (and ``Fp4Experts``) advances its counter by the elements its own
backward rounds, so ranks holding different numbers of rows part ways. A checkpoint keeps one
counter per layer (``_extra_state``, a plain tensor: DCP writes one rank's copy of a
replicated entry, whichever its planner picks), so it would resume every rank at one rank's
counter, or at a counter that depends on DCP's plan. ``Parallel.step`` therefore sets every
rank's counter to the largest over the ranks after each step (one MAX all-reduce of the
counters stacked, one int64 per 4-bit layer that rounds stochastically; none without such
layers): after every
step every rank holds the same counters, a checkpoint saved then is every rank's, and it
loads on any number of ranks to those counters (2 -> 1 and 1 -> 2 alike). No counter
moves backwards, so no rank draws again bits it drew before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from computectx.distributed.collectives import all_reduce_on
from computectx.distributed.group import check_join_timeout, joining
from computectx.formats import Fp4Experts, Fp4Linear

__all__ = ["fp4_counter_layers", "sync_fp4_counters"]


def fp4_counter_layers(model: nn.Module) -> list[Fp4Linear | Fp4Experts]:
    """The 4-bit modules of ``model`` whose counter advances (stochastic rounding on), in
    ``model.modules()`` order (a shared module once)."""
    return [
        m for m in model.modules() if isinstance(m, (Fp4Linear, Fp4Experts)) and m.recipe.stochastic
    ]


def sync_fp4_counters(
    model: nn.Module, group: dist.ProcessGroup, *, join_timeout: float | None = None
) -> int:
    """Set every 4-bit layer's counter (``fp4_counter_layers``) to the largest over the
    ranks of ``group``: one MAX all-reduce of the stacked counters (one int64 a layer), none
    when there is no such layer. A collective: every rank calls it together
    (``Parallel.step`` does, after its join and agreed checks). It first joins ``group``
    (``join``; none inside a call that joined it already, as ``Parallel.step``), so a rank
    that calls it alone gets a ``RuntimeError`` naming the ranks that did not join after
    ``join_timeout`` seconds (``None``: the group's timeout), no counter changed and the
    group usable. Each counter is replaced by a new tensor, never written in place (a
    backward may hold the old key). Returns how many counters it reduced."""
    check_join_timeout(join_timeout)
    layers = fp4_counter_layers(model)
    if not layers:
        return 0
    with joining(group, "sync_fp4_counters", join_timeout):
        counters = torch.stack([m.sr_key[1] for m in layers])  # CPU state: no device copy
        all_reduce_on(counters, group, dist.ReduceOp.MAX)
    for m, value in zip(layers, counters.tolist(), strict=True):
        key = m.sr_key.clone()
        key[1] = value
        m.sr_key = key
    return len(layers)
