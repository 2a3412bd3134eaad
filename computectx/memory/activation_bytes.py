"""The bytes autograd keeps for the backward, by kind of activation: ``SavedActivations``."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Final, Literal

import torch
from typing_extensions import Self

from computectx.activations import ACTIVATION_KINDS, ActivationKind
from computectx.saved import SAVING

__all__ = ["SAVED_KINDS", "SavedActivations", "SavedKind"]

SavedKind = ActivationKind | Literal["other"]
"""A kind of ``ctx.activations``, or ``"other"`` for what no op tagged (the GEMMs' inputs of
a linear that does not tag yet, a loss's logits, your own ops)."""
SAVED_KINDS: Final[tuple[SavedKind, ...]] = (*ACTIVATION_KINDS, "other")
"""The kinds, in the order reports list them."""


@dataclasses.dataclass
class SavedActivations:
    """Counts the bytes of the tensors autograd saves while the block runs, by device and kind,
    and the most of them held at once (saved-tensor hooks: a ``with`` block).

    Each storage counts once, whole (as ``memory_report`` counts), under the kind that saved it
    first (``computectx.saved.SAVING``: ``ctx.precise``'s ops under their kind, SwiGLU under
    ``act_fn``, ``saved_call(kind=...)``; the rest ``"other"``); storages of ``exclude`` (the
    parameters) not at all. A storage is held from its first save until the backward (or the
    graph's release) drops the last tensor saved from it; saved again after that, it counts
    again. So around a whole training step (every micro-batch's forward and backward),
    ``counts`` is everything the step saved and ``peak`` the most it held at once: one
    micro-batch's worth under gradient accumulation, all of it with one micro-batch. What the
    backward computes again is hidden from it where it runs under its own hooks
    (``saved_call``'s run of its op, ``torch.utils.checkpoint``'s non-reentrant regions, whose
    inputs count as saved); a reentrant checkpoint's forward, run again in the backward, saves
    under these hooks: it counts, and ``peak`` is then the figure to read. Eager only: a
    compiled graph's saves carry no kind. Tensors pass through unchanged."""

    exclude: dataclasses.InitVar[Iterable[torch.Tensor]] = ()
    counts: Counter[tuple[str, SavedKind]] = dataclasses.field(default_factory=Counter)
    """Bytes saved per ``(device, kind)`` (every storage the block saved, once while held)."""
    by_dtype: Counter[tuple[str, SavedKind, str]] = dataclasses.field(
        default_factory=Counter, init=False
    )
    """Bytes per ``(device, kind, dtype)``, the dtype named as ``memory_report`` names it
    (``"bfloat16"``, ``"float8_e4m3fn"``): the dtype the storage was first saved as."""
    storages: Counter[tuple[str, SavedKind, str]] = dataclasses.field(
        default_factory=Counter, init=False
    )
    """Storages counted per ``(device, kind, dtype)``."""
    held: Counter[tuple[str, SavedKind]] = dataclasses.field(default_factory=Counter, init=False)
    """Bytes held now per ``(device, kind)``: saved and not yet released by the backward."""
    peak: dict[str, int] = dataclasses.field(default_factory=dict, init=False)
    """The most bytes held at once per device (``held`` summed over the kinds): the step's
    peak of saved activations when the block is a step."""
    at_peak: Counter[tuple[str, SavedKind]] = dataclasses.field(default_factory=Counter, init=False)
    """``held`` per ``(device, kind)`` when that device reached its ``peak``."""

    def __post_init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self._skip = {_address(t) for t in exclude}
        # Per held storage: how many saved tensors still refer to it, its kind and bytes.
        self._refs: dict[tuple[str, int], list[Any]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)

    def bytes(self, kind: SavedKind | None = None, device: str | None = None) -> int:
        """Bytes counted for ``kind`` on ``device`` (``None`` matches every kind or device)."""
        return sum(
            n
            for (dev, k), n in self.counts.items()
            if (kind is None or k == kind) and (device is None or dev == device)
        )

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Held:
        address = _address(t)
        if address in self._skip:
            return t
        ref = self._refs.get(address)
        if ref is not None:
            ref[0] += 1
            return _Held(t.detach(), self, address)
        device = address[0]
        nbytes = t.untyped_storage().nbytes()
        kind: SavedKind = SAVING.get() or "other"
        self._refs[address] = [1, kind, nbytes]
        self.counts[(device, kind)] += nbytes
        key = (device, kind, str(t.dtype).removeprefix("torch."))
        self.by_dtype[key] += nbytes
        self.storages[key] += 1
        self.held[(device, kind)] += nbytes
        total = sum(n for (d, _), n in self.held.items() if d == device)
        if total > self.peak.get(device, 0):
            self.peak[device] = total
            for k in SAVED_KINDS:
                self.at_peak[(device, k)] = self.held[(device, k)]
        return _Held(t.detach(), self, address)

    def _release(self, address: tuple[str, int]) -> None:
        ref = self._refs[address]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[address]
            self.held[(address[0], ref[1])] -= ref[2]


class _Held:
    """One saved tensor as the hooks keep it; dropping it (the backward did, or the graph went
    away) releases its storage's share of ``SavedActivations.held``. Detached: an op's saved
    output would otherwise refer to its own node, a cycle only the garbage collector frees
    (autograd gives the unpacked tensor its history back)."""

    __slots__ = ("address", "owner", "tensor")

    def __init__(
        self, tensor: torch.Tensor, owner: SavedActivations, address: tuple[str, int]
    ) -> None:
        self.tensor, self.owner, self.address = tensor, owner, address

    def __del__(self) -> None:
        self.owner._release(self.address)


def _unpack(t: torch.Tensor | _Held) -> torch.Tensor:
    return t.tensor if isinstance(t, _Held) else t


def _address(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()
