"""Activations kept in host memory until their backward: ``ctx.activations``' ``offload``.

``saved_call`` under ``offload`` keeps each input of its op as an ``Offloaded``: a copy in
pinned host memory started on a side stream as the forward passes (the device memory goes
back to the allocator once the copy is done), brought back on that stream before the
backward needs it, the compute stream waiting for the copy only there. The device movement
goes through one small seam, ``Streams`` (CUDA's streams and events: ``CudaStreams``), so the
order of the copies and waits is tested on a CPU with a stand-in (``STREAMS``).

On a CPU device offload does nothing (the tensor already lives in host memory: a copy would
only double it while both exist): the op keeps its input as it is, as under ``recompute``.
Under ``torch.compile`` neither is traced: a compiled op keeps its input on the device.

When is a tensor brought back? An ``OffloadBlocks`` (``ByteLM`` makes one per forward when
a kind is offloaded) groups what each block offloads. At the boundary after block ``i``
the compute stream waits for block ``i - 1``'s copies to the host (so the forward never
holds more than two blocks' offloaded tensors on the device: the one computing and the one
in flight), and the backward, reaching that boundary (block ``i``'s backward is next),
starts bringing back block ``i``'s tensors and block ``i - 1``'s, so these arrive while block
``i`` computes its gradients. The last block (and what follows it: the final norm) is not
offloaded: its backward comes first. A tensor offloaded outside any block is brought back
when its backward asks for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Final, Protocol

import torch
from torch.autograd.function import FunctionCtx

__all__ = [
    "STREAMS",
    "CudaStreams",
    "OffloadBlocks",
    "Offloaded",
    "Streams",
    "offload",
    "offload_streams",
    "on_device",
]


class Streams(Protocol):
    """The device movement offload needs: copies on a side stream, ordered by events."""

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``t`` to (pinned) host memory after the work queued on the compute
        stream so far; its device memory must stay untouched until the copy is done. Returns
        the host tensor and an event marking the end of the copy."""
        ...

    def to_device(
        self, host: torch.Tensor, device: torch.device, after: Any
    ) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` to ``device`` once event ``after`` (its copy to the host) is
        done. Returns the device tensor, not to be read before ``wait`` on the returned event."""
        ...

    def wait(self, event: Any, t: torch.Tensor | None = None) -> None:
        """Make the compute stream wait for ``event``; ``t`` (made by ``to_device``) is then
        used on the compute stream."""
        ...


STREAMS: Final[ContextVar[Streams | None]] = ContextVar("computectx_streams", default=None)
"""The streams offload uses when set (a stand-in in tests); ``None``: ``CudaStreams`` for a
CUDA tensor, nothing (offload keeps the tensor as it is) for any other."""


class CudaStreams:
    """``Streams`` on CUDA: one side stream per device, events, pinned host buffers."""

    def __init__(self) -> None:
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self._side[device]

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        side = self._stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # t is written by then
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        t.record_stream(side)  # the allocator reuses t's memory only after the copy
        return host, done

    def to_device(
        self, host: torch.Tensor, device: torch.device, after: Any
    ) -> tuple[torch.Tensor, Any]:
        side = self._stream(device)
        with torch.cuda.stream(side):
            side.wait_event(after)
            t = torch.empty(host.shape, dtype=host.dtype, device=device)
            t.copy_(host, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        return t, done

    def wait(self, event: Any, t: torch.Tensor | None = None) -> None:
        device = None if t is None else t.device
        current = torch.cuda.current_stream(device)
        current.wait_event(event)
        if t is not None:
            t.record_stream(current)  # made on the side stream, read on this one


_CUDA: list[CudaStreams] = []


def offload_streams(device: torch.device) -> Streams | None:
    """The streams offloading a tensor on ``device`` goes through (``STREAMS``), or ``None``:
    keep it as it is."""
    blocks = _BLOCKS.get()
    if blocks is not None and blocks.on_device:
        return None
    given = STREAMS.get()
    if given is not None or device.type != "cuda":
        return given
    if not _CUDA:
        _CUDA.append(CudaStreams())
    return _CUDA[0]


class Offloaded:
    """One tensor kept in host memory: ``fetch`` brings it back (``prefetch`` starts early)."""

    __slots__ = ("arrived", "back", "copied", "device", "host", "streams")

    def __init__(self, t: torch.Tensor, streams: Streams) -> None:
        self.streams, self.device = streams, t.device
        self.host, self.copied = streams.to_host(t)
        self.back: torch.Tensor | None = None
        self.arrived: Any = None

    def prefetch(self) -> None:
        """Start the copy back to the device (once until the next ``fetch``)."""
        if self.back is None:
            self.back, self.arrived = self.streams.to_device(self.host, self.device, self.copied)

    def fetch(self) -> torch.Tensor:
        """The tensor on its device, the compute stream waiting for its copy. The handle lets
        go of it: the device copy lives as long as the backward uses it; the host copy stays
        (a second backward, ``retain_graph=True``, fetches it again)."""
        self.prefetch()
        t, self.back = self.back, None
        assert t is not None
        self.streams.wait(self.arrived, t)
        return t


_BLOCKS: Final[ContextVar[OffloadBlocks | None]] = ContextVar("computectx_blocks", default=None)


def offload(t: torch.Tensor, streams: Streams) -> Offloaded:
    """``t`` copied to host memory through ``streams``, in the current ``OffloadBlocks``'s
    block when one is active."""
    moved = Offloaded(t, streams)
    blocks = _BLOCKS.get()
    if blocks is not None:
        blocks.groups[-1].append(moved)
    return moved


class OffloadBlocks:
    """What a forward offloads, by block (module docstring): ``with blocks.active():`` around
    the forward, ``x = blocks.boundary(x)`` after each block."""

    def __init__(self) -> None:
        self.groups: list[list[Offloaded]] = [[]]
        """The tensors each block offloaded, in forward order (the last: after the last
        boundary)."""
        self.on_device = False
        """Set for the last block (``last_block``): nothing is offloaded from then on."""

    def last_block(self) -> None:
        """What runs from now on stays on the device: its backward comes first, so a copy
        out would only come straight back (and hold the device meanwhile)."""
        self.on_device = True

    @contextlib.contextmanager
    def active(self) -> Iterator[OffloadBlocks]:
        """Offloads made inside join the current block."""
        token = _BLOCKS.set(self)
        try:
            yield self
        finally:
            _BLOCKS.reset(token)

    def boundary(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a block's output) as it is, ending that block: the compute stream waits for
        the previous block's copies to the host, and the backward, reaching ``x``, starts
        bringing back this block's tensors and the previous block's."""
        index = len(self.groups) - 1
        for moved in self.groups[index - 1] if index else []:
            moved.streams.wait(moved.copied)
        self.groups.append([])
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        out: torch.Tensor = _Boundary.apply(x, self, index)  # type: ignore[no-untyped-call]
        return out

    def prefetch(self, index: int) -> None:
        """Start bringing back block ``index``'s tensors and block ``index - 1``'s."""
        for group in self.groups[max(index - 1, 0) : index + 1][::-1]:
            for moved in group:
                moved.prefetch()


@contextlib.contextmanager
def on_device() -> Iterator[None]:
    """Nothing offloaded inside (a checkpointed block: what it keeps lives only until its
    recomputation's backward, in forward and in the backward's run again alike)."""
    held = OffloadBlocks()
    held.on_device = True
    with held.active():
        yield


class _Boundary(torch.autograd.Function):
    """The identity, whose backward prefetches (``OffloadBlocks.prefetch``)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, blocks: OffloadBlocks, index: int) -> Any:
        c: Any = ctx
        c.blocks, c.index = blocks, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.blocks.prefetch(ctx.index)
        return dy, None, None
