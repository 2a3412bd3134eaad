"""The bytes autograd keeps for the backward, by kind of activation: ``SavedActivations``."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import Final, Literal

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
    """Counts the bytes of the tensors autograd saves while the block runs, by device and kind
    (saved-tensor hooks: a ``with`` block).

    Each storage counts once, whole (as ``memory_report`` counts), under the kind that saved it
    first (``computectx.saved.SAVING``: ``ctx.precise``'s ops under their kind, SwiGLU under
    ``act_fn``, ``saved_call(kind=...)``; the rest ``"other"``); storages of ``exclude`` (the
    parameters) not at all. Use it around one forward (and its backward, if you like: the
    backward's recomputations are hidden from it): every saved tensor stays alive until its
    backward, so no two counted storages share an address. Eager only: a compiled graph's
    saves carry no kind. Tensors pass through unchanged."""

    exclude: dataclasses.InitVar[Iterable[torch.Tensor]] = ()
    counts: Counter[tuple[str, SavedKind]] = dataclasses.field(default_factory=Counter)
    """Bytes per ``(device, kind)``."""
    by_dtype: Counter[tuple[str, SavedKind, str]] = dataclasses.field(
        default_factory=Counter, init=False
    )
    """Bytes per ``(device, kind, dtype)``, the dtype named as ``memory_report`` names it
    (``"bfloat16"``, ``"float8_e4m3fn"``): the dtype the storage was first saved as."""
    storages: Counter[tuple[str, SavedKind, str]] = dataclasses.field(
        default_factory=Counter, init=False
    )
    """Storages counted per ``(device, kind, dtype)``."""

    def __post_init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self._skip = {_address(t) for t in exclude}
        self._seen: set[tuple[str, int]] = set()
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

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        device, ptr = _address(t)
        if (device, ptr) in self._skip or (device, ptr) in self._seen:
            return t
        self._seen.add((device, ptr))
        nbytes = t.untyped_storage().nbytes()
        kind: SavedKind = SAVING.get() or "other"
        self.counts[(device, kind)] += nbytes
        key = (device, kind, str(t.dtype).removeprefix("torch."))
        self.by_dtype[key] += nbytes
        self.storages[key] += 1
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _address(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()
