"""Memory of one policy's training, by role: state from ``memory_report``, plus what autograd
keeps for backward, by kind (``computectx.memory.SavedActivations``); and what AdamW's weights
and moments would take under each optimizer-state setting (computed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from computectx.memory import LowPrecGradAccumulator, SavedActivations, memory_report
from computectx.memory.activation_bytes import SAVED_KINDS
from computectx.memory.optim.state.packed import packed_nbytes
from computectx.memory.optim.state.store import packs
from computectx.optim_state import OptimState

__all__ = [
    "OPTIM_STATE_ROWS",
    "Footprint",
    "OptimStateRow",
    "adamw_moment_bytes",
    "optim_state_rows",
    "state_footprint",
]

OPTIM_STATE_ROWS: tuple[tuple[str, str], ...] = (
    ("f32", "f32"),
    ("bf16", "f32"),
    ("int8", "f32"),
    ("fp8", "f32"),
    ("int4", "f32"),
    ("int8", "bf16"),
    ("int4", "bf16"),
)
"""The ``(optim_state, master)`` settings of the optimizer-state table, in order."""


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes one policy's training holds on the training device, by role.

    ``params`` .. ``optimizer`` come from ``computectx.memory.memory_report`` after the last
    optimizer step (gradients still present). ``saved`` is the most autograd held for
    backward at once during the first step (``SavedActivations.peak``: one micro-batch's
    forward, all of it): activations, plus any low-precision copies of the weights that the
    GEMMs saved (parameters themselves are counted under ``params``, not again here);
    ``None`` when it was not measured (a compiled run: the hooks would be traced).
    ``peak`` is ``torch.cuda.max_memory_allocated`` over the run on CUDA, else ``None``.
    ``saved_kinds`` splits ``saved`` by kind of activation (``SavedActivations.at_peak``:
    ``linear`` .. ``moe`` as the ops tag them, ``other`` for the rest), every kind present,
    ``None`` when not measured.
    """

    params: int
    grads: int
    accumulator: int
    master: int
    optimizer: int
    saved: int | None
    peak: int | None = None
    saved_kinds: dict[str, int] | None = None

    @property
    def state(self) -> int:
        """Weights, gradients, accumulator buffers, master weights and optimizer state."""
        return self.params + self.grads + self.accumulator + self.master + self.optimizer

    def as_dict(self) -> dict[str, Any]:
        """The roles and the ``state`` total, in bytes (for ``results.json``)."""
        return {**dataclasses.asdict(self), "state": self.state}


def state_footprint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulator: LowPrecGradAccumulator | None,
    device: torch.device,
    saved: SavedActivations | None,
) -> Footprint:
    """A ``Footprint`` of the state on ``device`` now (after a step, before ``zero_grad``),
    with the peak ``saved`` measured on ``device`` (``None``: not measured)."""
    rep = memory_report(model, optimizer=optimizer, accumulator=accumulator)
    kinds: dict[str, int] | None = None
    if saved is not None:
        where = str(torch.empty(0, device=device).device)  # as saved tensors name it
        kinds = {k: saved.at_peak[(where, k)] for k in SAVED_KINDS}
    return Footprint(
        params=rep.bytes(device=device, role="params"),
        grads=rep.bytes(device=device, role="grads"),
        accumulator=rep.bytes(device=device, role="accumulator"),
        master=rep.bytes(device=device, role="master"),
        optimizer=rep.bytes(device=device, role="optimizer_state")
        + rep.bytes(device=device, role="staging"),
        saved=None if kinds is None else sum(kinds.values()),
        saved_kinds=kinds,
    )


@dataclasses.dataclass(frozen=True)
class OptimStateRow:
    """AdamW's bytes for one model under one ``(optim_state, master)`` setting, computed.

    ``weights`` is the weights the optimizer steps (float32 or bf16), ``moments`` both
    moments (compact from ``min_size`` elements up, float32 below) and a float32 ``step``
    per parameter tensor, as ``CompactOptimizer`` holds them.
    """

    optim_state: str
    master: str
    parameters: int
    weights: int
    moments: int

    @property
    def total(self) -> int:
        return self.weights + self.moments

    @property
    def per_param(self) -> float:
        """Weights and moments per parameter, in bytes."""
        return self.total / self.parameters if self.parameters else 0.0


def adamw_moment_bytes(shape: Sequence[int], state: OptimState) -> int:
    """Bytes AdamW's two moments (``exp_avg``, ``exp_avg_sq``) of a parameter of ``shape``
    hold under ``state``, as the state store keeps them (``packs``: compact from ``min_size``
    elements up, float32 below and for a scalar), from the codecs' ``packed_nbytes``."""
    p = torch.empty(tuple(shape), device="meta")
    if packs(p, p.shape, state):
        return sum(packed_nbytes(p.shape, state, k) for k in ("signed", "unsigned"))
    return 2 * 4 * p.numel()


def optim_state_rows(params: Iterable[torch.Tensor]) -> list[OptimStateRow]:
    """One ``OptimStateRow`` per ``OPTIM_STATE_ROWS`` setting for these parameters, from the
    codecs' accounting (``packed_nbytes``), without training."""
    params = list(params)
    count = sum(p.numel() for p in params)
    rows = []
    for fmt, master in OPTIM_STATE_ROWS:
        state = OptimState.parse(fmt)
        moments = 0
        for p in params:
            moments += adamw_moment_bytes(p.shape, state) + 4  # and step, a float32 scalar
        width = 4 if master == "f32" else 2
        rows.append(OptimStateRow(fmt, master, count, count * width, moments))
    return rows
