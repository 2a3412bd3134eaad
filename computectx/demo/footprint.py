"""Memory of one policy's training, by role: state from ``memory_report``, plus what autograd
keeps for backward (measured with ``torch.autograd.graph.saved_tensors_hooks``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from types import TracebackType

import torch

from computectx.memory import LowPrecGradAccumulator, memory_report

__all__ = ["Footprint", "SavedForBackward", "state_footprint"]


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes one policy's training holds on the training device, by role.

    ``params`` .. ``optimizer`` come from ``computectx.memory.memory_report`` after the last
    optimizer step (gradients still present). ``saved`` is what autograd kept for backward
    during one micro-batch: activations, plus any low-precision copies of the weights that
    the GEMMs saved (parameters themselves are counted under ``params``, not again here);
    ``None`` when it was not measured (a compiled run: the hooks would be traced).
    ``peak`` is ``torch.cuda.max_memory_allocated`` over the run on CUDA, else ``None``.
    """

    params: int
    grads: int
    accumulator: int
    master: int
    optimizer: int
    saved: int | None
    peak: int | None = None

    @property
    def state(self) -> int:
        """Weights, gradients, accumulator buffers, master weights and optimizer state."""
        return self.params + self.grads + self.accumulator + self.master + self.optimizer

    def as_dict(self) -> dict[str, int | None]:
        """The roles and the ``state`` total, in bytes (for ``results.json``)."""
        return {**dataclasses.asdict(self), "state": self.state}


def state_footprint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    accumulator: LowPrecGradAccumulator | None,
    device: torch.device,
    saved: int | None,
) -> Footprint:
    """A ``Footprint`` of the state on ``device`` now (after a step, before ``zero_grad``)."""
    rep = memory_report(model, optimizer=optimizer, accumulator=accumulator)
    return Footprint(
        params=rep.bytes(device=device, role="params"),
        grads=rep.bytes(device=device, role="grads"),
        accumulator=rep.bytes(device=device, role="accumulator"),
        master=rep.bytes(device=device, role="master"),
        optimizer=rep.bytes(device=device, role="optimizer_state")
        + rep.bytes(device=device, role="staging"),
        saved=saved,
    )


class SavedForBackward:
    """Counts the bytes of the tensors autograd saves for backward while the block runs.

    Each storage counts once, whole (as ``memory_report`` counts), and storages of
    ``exclude`` (the parameters) not at all. Use it around one forward and backward: every
    tensor saved in a forward stays alive until its backward, so no two counted storages can
    share an address. The tensors pass through unchanged, so training is unaffected.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {_address(t) for t in exclude}
        self._seen: set[tuple[str, int]] = set()
        self.bytes = 0
        """Bytes counted so far."""
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _address(t)
        if key not in self._skip and key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> SavedForBackward:
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
