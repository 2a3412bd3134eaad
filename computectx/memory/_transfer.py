"""Reusable staging buffers for asynchronous copies between a compute device and the host.

Why this module exists: a ``non_blocking=True`` copy between a CUDA device and host memory
is only correct when three lifetimes are respected, and the obvious one-liner
(``g.to("cpu", non_blocking=True)`` inside a gradient hook) respects none of them:

1. *The host side must not be read before the copy lands.* A non-blocking device-to-host
   copy returns immediately; reading (or casting) the destination on the CPU before the
   copy's CUDA event has completed reads stale bytes. Every buffer here carries the event
   of the last copy that touched it, and the host waits on that event before reading the
   buffer or writing it again.
2. *The device-side source must not be reused before the copy reads it.* The caching
   allocator hands a freed block to the next allocation *on the stream it was allocated
   on*, ordered by that stream alone. A copy issued on that same stream is therefore safe
   even if Python drops the source right after enqueueing it; a copy issued on another
   stream is not, unless the source is marked with ``record_stream`` for the copy's
   stream. ``record_stream`` is also what makes memory look "leaked": the block is not
   returned to the pool (and still counts in ``memory_allocated``) until the allocator
   next polls the recorded event, which happens only at a later allocation. We issue every
   copy on the *current* stream of the device, where ``record_stream`` is a no-op, and
   still call it so that a caller running backward on a side stream stays correct.
3. *Pinned host memory must be allocated once, not per copy.* ``.to("cpu",
   non_blocking=True)`` allocates its destination from the pinned host caching allocator,
   which keeps freed pinned blocks cached for reuse rather than returning them to the OS,
   and cannot reuse a block until the event of the copy that used it has completed. One
   fresh pinned tensor per gradient per micro-batch makes that cache grow with the number
   of distinct sizes and copies in flight. Each tensor here owns one pinned staging buffer
   for its whole life instead.

On a CPU-only path (both ends on the host) the event is a completed no-op, the buffer is
not pinned and the copies are ordinary blocking copies; the ordering logic is the same,
which is what the CPU tests exercise.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

import torch

__all__ = ["TRANSFERS", "Staging", "Transfer", "check_transfer", "needs_staging", "uses_staging"]

Transfer = Literal["auto", "staged", "blocking"]
"""How tensors cross between a compute device and the offload device: ``auto`` stages
through a reusable (pinned) host buffer exactly for CUDA <-> CPU and copies directly
otherwise; ``staged`` always stages, even between tensors on one device (which is how the
CPU tests run the CUDA code path); ``blocking`` always copies directly and synchronously."""

TRANSFERS: tuple[Transfer, ...] = get_args(Transfer)


class _Event(Protocol):
    def record(self, stream: torch.cuda.Stream | None = None) -> None: ...

    def synchronize(self) -> None: ...


class _HostEvent:
    """The event of a copy that completed when it was issued (host-to-host copies)."""

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _make_event(peer: torch.device) -> _Event:
    if peer.type == "cuda":
        return torch.cuda.Event()  # type: ignore[no-untyped-call]
    return _HostEvent()


def needs_staging(compute: torch.device, host: torch.device) -> bool:
    """Whether copies between ``compute`` and ``host`` go through a pinned staging buffer.

    True exactly for CUDA <-> CPU, the pair where pinned memory makes the copy
    asynchronous; every other pair copies directly (same device: no transfer at all).
    """
    return compute.type == "cuda" and host.type == "cpu"


def check_transfer(transfer: object) -> Transfer:
    """``transfer`` as a ``Transfer``, or a ``ValueError`` naming it and the accepted values."""
    for accepted in TRANSFERS:
        if isinstance(transfer, str) and transfer == accepted:
            return accepted
    raise ValueError(f"unknown transfer {transfer!r}; accepted: {', '.join(map(repr, TRANSFERS))}")


def uses_staging(transfer: Transfer, compute: torch.device, host: torch.device) -> bool:
    """Whether a copy between ``compute`` and ``host`` goes through a ``Staging`` buffer."""
    if transfer == "auto":
        return needs_staging(compute, host)
    return transfer == "staged"


class Staging:
    """One tensor's reusable host-side buffer for copies to and from ``peer``.

    The buffer is pinned when ``peer`` is a CUDA device (so copies can overlap compute)
    and lives as long as this object. ``wait()`` blocks until the last copy through the
    buffer has completed; the copy methods call it before overwriting the buffer, and
    the owner must call it before reading the buffer after ``fill_from``.
    """

    def __init__(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        *,
        host: torch.device,
        peer: torch.device,
    ) -> None:
        self.peer = peer
        pin = host.type == "cpu" and peer.type == "cuda"
        self.buffer = torch.empty(shape, dtype=dtype, device=host, pin_memory=pin)
        self._event = _make_event(peer)
        self._in_flight = False

    @property
    def in_flight(self) -> bool:
        """True between issuing a copy and the ``wait()`` that observes its completion."""
        return self._in_flight

    def wait(self) -> None:
        """Block until the last copy that read or wrote the buffer has completed."""
        if self._in_flight:
            self._event.synchronize()
            self._in_flight = False

    def fill_from(self, src: torch.Tensor) -> None:
        """Copy ``src`` (on ``peer``) into the buffer, asynchronously where possible.

        The copy is issued on ``src``'s device's current stream. Call ``wait()`` before
        reading ``buffer``.
        """
        self.wait()
        self.buffer.copy_(src, non_blocking=self.buffer.is_pinned())
        self._issued(src)

    def drain_to(self, dst: torch.Tensor) -> None:
        """Copy the buffer into ``dst`` (on ``peer``), asynchronously where possible.

        The caller fills ``buffer`` first (after ``wait()``); the buffer must then stay
        untouched until the next ``wait()``, which the copy methods do themselves.
        """
        dst.copy_(self.buffer, non_blocking=self.buffer.is_pinned())
        self._issued(dst)

    def _issued(self, device_tensor: torch.Tensor) -> None:
        if self.peer.type == "cuda" and device_tensor.device.type == "cuda":
            stream = torch.cuda.current_stream(device_tensor.device)
            # A no-op when the tensor was allocated on this stream (the common case);
            # otherwise it keeps the allocator from reusing the block before the copy.
            device_tensor.record_stream(stream)
            self._event.record(stream)
        else:
            self._event.record()
        self._in_flight = True
