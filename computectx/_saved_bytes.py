"""Counting the storages autograd saves for the backward: ``SavedStorages``, the one rule
that ``computectx.memory.SavedActivations`` (by device and kind) and the demo's
``SavedForBackward`` (the total) count by."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch
from typing_extensions import Self

__all__ = ["SavedStorages"]


class SavedStorages:
    """Saved-tensor hooks (a ``with`` block) that count each storage autograd saves in the
    block: once, whole (as ``memory_report`` counts), the storages of ``exclude`` (the
    parameters) not at all. A subclass says where the bytes go (``_count``).

    Every tensor saved in a forward stays alive until its backward, so around one forward
    (and its backward) no two counted storages share an address. Tensors pass through
    unchanged, so training is unaffected."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {_address(t) for t in exclude}
        self._seen: set[tuple[str, int]] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _count(self, device: str, nbytes: int, dtype: torch.dtype) -> None:
        """Take the ``nbytes`` of one storage seen for the first time, on ``device``, saved
        first as a tensor of ``dtype``."""
        raise NotImplementedError

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _address(t)
        if key not in self._skip and key not in self._seen:
            self._seen.add(key)
            self._count(key[0], t.untyped_storage().nbytes(), t.dtype)
        return t

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


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _address(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()
