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

When does a copy go out, when does one come back? An ``OffloadBlocks`` (``ByteLM`` makes
one per forward when a kind is offloaded) keeps the device bytes offload holds within a
window: ``largest``, the most bytes one block offloads (its blocks' offloaded tensors
counted by their storages). In the forward, before a copy out starts, the compute stream
waits for the oldest copies still in flight until they and the new one fit the window (so a
copy overlaps about a block of compute: it is waited for when the tensor of the same place
in the next block goes out); the last block (and what follows it: the final norm) is not
offloaded, its backward comes first, and before it runs the compute stream waits for every
copy out. In the backward, once the last block's gradients are done (the boundary after
the block before it), tensors come back in the reverse of the order they went out, as many
as fit the window beside those brought back and still in use (each one's device copy counts
until the backward lets it go); each use brings back more. So the device never holds more
than one block's offloaded bytes, and none while the last block runs forward or backward
(it keeps its own inputs, as ``recompute`` does): offload leaves one block's inputs on the
device. A tensor offloaded outside any block is brought back when its backward asks for it.

Each backward (a graph task: ``retain_graph``'s second, one entering at a middle block, an
``autograd.grad`` stopping at one) brings back only the tensors whose op it runs, from the
last of them down, and lets go of any it brought back unused when it ends. Nothing is
offloaded inside torch's checkpoint nor by a forward that a backward runs (a checkpoint's
recomputation): such a region keeps its inputs until its own backward, as a block
checkpointed by rule does. An input changed in place after it went out is refused at its
fetch as autograd refuses a saved tensor changed in place (its copy out may have read the new
values): it is watched while alive, and held until the window waits for its copy out.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Final, Protocol

import torch
import torch.utils.checkpoint
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
    if given is None and device.type != "cuda":
        return None  # host memory already: kept as it is (no hook walk on the CPU)
    if torch._C._current_graph_task_id() != -1 or _in_checkpoint():
        return None  # a checkpointed region, or a forward run again by a backward: kept
    if given is not None:
        return given
    if not _CUDA:
        _CUDA.append(CudaStreams())
    return _CUDA[0]


def _in_checkpoint() -> bool:
    # Inside torch's non-reentrant checkpoint (its forward's or its recomputation's saved-tensor
    # hooks on top, as torch.utils.checkpoint makes them: a closure over its frame): nothing
    # is offloaded there, as in a block ByteLM checkpoints by rule (the forward and the run
    # again must save alike, and what the region keeps lives only until its backward).
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return False
    pack = inspect.unwrap(hooks[0])
    cells = getattr(pack, "__closure__", None) or ()
    names = getattr(getattr(pack, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, cells, strict=False):
        if name in _FRAME_CELLS:
            with contextlib.suppress(ValueError):  # an empty cell
                value = cell.cell_contents
                found = value() if isinstance(value, weakref.ReferenceType) else value
                if isinstance(found, _FRAME):
                    return True
    if getattr(pack, "__module__", None) == torch.utils.checkpoint.__name__ and not _WARNED:
        # torch's own checkpoint hook, its frame not found: torch renamed what this reads.
        _WARNED.append(True)
        warnings.warn(_UNSEEN.format(version=torch.__version__), RuntimeWarning, stacklevel=2)
    return False


_FRAME: Final = getattr(torch.utils.checkpoint, "_CheckpointFrame", ())
_FRAME_CELLS: Final = ("frame", "target_frame_ref")  # its pack hooks' closures' names for it
_WARNED: list[bool] = []  # the warning below was given (once a process)
_UNSEEN: Final = (
    "computectx.offload cannot tell torch's checkpoint regions in this torch ({version}): its "
    "saved-tensor pack hook holds no torch.utils.checkpoint._CheckpointFrame in a closure cell "
    "named 'frame' or 'target_frame_ref' (torch renamed them), so a checkpointed region's "
    "forward offloads its inputs: the gradients are right (its recomputation keeps its own), "
    "but those copies are never used and count against the window. Keep the kinds of "
    "checkpointed blocks ('KIND:keep'), or let ByteLM checkpoint blocks by rule"
)


class Offloaded:
    """One tensor kept in host memory: ``fetch`` brings it back (``prefetch`` starts early)."""

    __slots__ = (
        "__weakref__",
        "arrived",
        "back",
        "copied",
        "device",
        "host",
        "modified",
        "nbytes",
        "node",
        "pending",
        "source",
        "streams",
        "used",
        "version",
        "window",
    )

    def __init__(
        self, t: torch.Tensor, streams: Streams, window: OffloadBlocks | None, node: object
    ) -> None:
        self.streams, self.device, self.window = streams, t.device, window
        self.nbytes = t.numel() * t.element_size()  # what comes back
        self.node = None if node is None else weakref.ref(node)
        """The backward node that fetches it (held weakly): brought back only in a backward
        that runs it."""
        self.host, self.copied = streams.to_host(t)
        # In-place changes after this point are refused as autograd refuses them for a saved
        # tensor: ``t`` is watched while alive, and held until the window waits for its copy.
        self.version = None if t.is_inference() else t._version
        self.source = weakref.ref(t)
        self.pending: torch.Tensor | None = None if window is None else t
        self.modified: int | None = None
        self.back: torch.Tensor | None = None
        self.arrived: Any = None
        self.used = False
        """Fetched in this backward (``window``: not to be brought back again)."""

    def copied_out(self) -> None:
        """The compute stream waited for the copy out: what it read is now fixed."""
        self._note_version()
        self.pending = None

    def _note_version(self) -> None:
        t = self.source()
        unseen = self.modified is None and self.version is not None
        if t is not None and unseen and t._version != self.version:
            self.modified = t._version

    def executes(self) -> bool:
        """Whether the running backward runs the node that fetches it (``True`` with none)."""
        node = None if self.node is None else self.node()
        return node is None or bool(torch._C._will_engine_execute_node(node))  # type: ignore[arg-type]

    def prefetch(self) -> None:
        """Start the copy back to the device (once until the next ``fetch``)."""
        if self.back is None:
            self.back, self.arrived = self.streams.to_device(self.host, self.device, self.copied)
            if self.window is not None:
                self.window.live += self.nbytes

    def drop(self) -> None:
        """Let go of a copy back not fetched (the backward ended without using it)."""
        if self.back is not None:
            self.back, self.arrived = None, None
            if self.window is not None:
                self.window.live -= self.nbytes

    def fetch(self) -> torch.Tensor:
        """The tensor on its device, the compute stream waiting for its copy. The handle lets
        go of it: the device copy lives as long as the backward uses it; the host copy stays
        (a second backward, ``retain_graph=True``, fetches it again). A ``RuntimeError`` as
        autograd's for a saved tensor if the input was changed in place after it was offloaded
        (seen while it is alive or held: its host copy may have read the new values)."""
        self._note_version()
        if self.modified is not None:
            shape, dtype = tuple(self.host.shape), self.host.dtype
            message = _MODIFIED.format(shape=shape, dtype=dtype, now=self.modified)
            raise RuntimeError(message.format(then=self.version))
        if self.window is not None:
            self.window.begin()
        self.used = True
        self.prefetch()
        t, arrived, self.back, self.arrived = self.back, self.arrived, None, None
        assert t is not None
        if self.window is not None:
            self.window.fetched(t, self.nbytes)  # more copies back queue behind this one
        self.streams.wait(arrived, t)
        return t


_MODIFIED: Final = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: an input of shape {shape} ({dtype}) kept in host memory (offload) is at version "
    "{now}; expected version {{then}} instead: it was changed after its op offloaded it, so its "
    "host copy may hold the new values. Change a clone of it instead, or keep that kind "
    "(ctx.activations 'KIND:keep')"
)


_BLOCKS: Final[ContextVar[OffloadBlocks | None]] = ContextVar("computectx_blocks", default=None)


def offload(t: torch.Tensor, streams: Streams, node: object = None) -> Offloaded:
    """``t`` copied to host memory through ``streams``, in the current ``OffloadBlocks``'s
    window when one is active; ``node``: the backward node that will fetch it (an
    ``autograd.Function``'s ctx), so that a backward not running it leaves it in host memory."""
    blocks = _BLOCKS.get()
    return Offloaded(t, streams, None, node) if blocks is None else blocks.add(t, streams, node)


class OffloadBlocks:
    """What a forward offloads, by block, held on the device within one block's bytes (module
    docstring): ``with blocks.active():`` around the forward, ``blocks.last_block()`` before
    the last block, ``x = blocks.boundary(x)`` after each block. It holds its tensors' handles
    weakly: they live as long as the graph that fetches them (each ``Offloaded`` holds it)."""

    def __init__(self) -> None:
        self.order: list[weakref.ref[Offloaded]] = []
        """What the forward offloaded, in order."""
        self.largest = 0
        """The window: the most bytes a block has offloaded (so far, in the forward)."""
        self.on_device = False
        """Set for the last block (``last_block``): nothing is offloaded from then on."""
        self.live = 0
        """Device bytes brought back: coming, or fetched and still in use."""
        self._block = 0  # bytes the current block offloaded
        self._out: deque[_InFlight] = deque()  # copies out not waited for yet
        self._out_bytes = 0  # their storages' bytes, those whose graph is gone left out
        self._me = weakref.ref(self)  # for the handles' callbacks (no cycle through self)
        self._next = 0  # the backward brings back order[:_next] next, the last first
        self._task = -1  # the backward (graph task) running now, -1: none yet

    def add(self, t: torch.Tensor, streams: Streams, node: object = None) -> Offloaded:
        """``t`` offloaded, the compute stream first waiting for the oldest copies out until
        those in flight and ``t`` fit the window (this block so far counts as a block)."""
        # A view holds its whole storage until its copy is done: counted as such (an upper
        # bound where views of one storage, a block's q, k and v, go out together).
        nbytes = t.untyped_storage().nbytes()
        self._block += nbytes
        self.largest = max(self.largest, self._block)
        while self._out and self._out_bytes + nbytes > self.largest:
            self._wait_oldest()
        moved = Offloaded(t, streams, self, node)
        self._out.append(_InFlight(moved, self._me, nbytes))
        self._out_bytes += nbytes
        self.order.append(weakref.ref(moved))
        return moved

    def _wait_oldest(self) -> None:
        flying = self._out.popleft()
        self._out_bytes -= flying.storage_bytes
        flying.storage_bytes = 0  # counted out: its callback, should it still run, adds none
        oldest = flying()
        if oldest is not None:  # else its graph is gone: nothing will read it
            oldest.streams.wait(oldest.copied)
            oldest.copied_out()

    def _gone(self, flying: _InFlight) -> None:
        # A handle's graph went before its copy out was waited for: no longer counted.
        self._out_bytes -= flying.storage_bytes
        flying.storage_bytes = 0

    def last_block(self) -> None:
        """What runs from now on stays on the device: its backward comes first, so a copy
        out would only come straight back. The compute stream waits for every copy out: the
        last block runs with no offloaded tensor on the device."""
        self.on_device = True
        while self._out:
            self._wait_oldest()

    @contextlib.contextmanager
    def active(self) -> Iterator[OffloadBlocks]:
        """Offloads made inside join the window."""
        token = _BLOCKS.set(self)
        try:
            yield self
        finally:
            _BLOCKS.reset(token)

    def boundary(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a block's output) as it is, ending that block; the backward, reaching ``x``
        (the block's gradients are next), starts bringing back what fits the window. The
        boundary after the last block brings back nothing: the last block's backward runs
        first, with its own inputs on the device."""
        self._block = 0
        if self.on_device or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        out: torch.Tensor = _Boundary.apply(x, self)  # type: ignore[no-untyped-call]
        return out

    def reached(self) -> None:
        """The backward reached the boundary after a block: bring back what fits."""
        self.begin()
        self.top_up()

    def fetched(self, t: torch.Tensor, nbytes: int) -> None:
        """``t`` (``nbytes`` of the window) is in use until the backward lets it go; start
        bringing back what fits."""
        weakref.finalize(t, self._release, nbytes)
        self.top_up()

    def begin(self) -> None:
        """A backward asks (a boundary reached, a fetch): at its first ask (each backward is a
        graph task: retain_graph's second, one entering at a middle block) bring back from the
        end of the order again, and once it ends let go of what it brought back unused."""
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return
        self._task, self._next = task, len(self.order)
        for ref in self.order:
            if (moved := ref()) is not None:
                moved.used = False
        if task != -1:
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._task = -1
        for ref in self.order:
            if (moved := ref()) is not None:
                moved.drop()

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def top_up(self) -> None:
        """Start bringing back, the last offloaded first, what fits the window beside the
        device copies ``live``: only what the running backward uses (its node runs)."""
        while self._next > 0:
            moved = self.order[self._next - 1]()
            if moved is not None and not moved.used and moved.back is None and moved.executes():
                if self.live + moved.nbytes > self.largest:
                    return
                moved.prefetch()
            self._next -= 1


class _InFlight(weakref.ref[Offloaded]):
    """A copy out not waited for yet: its handle (weakly) and its storage's bytes, which leave
    the window's count when it is waited for or its handle goes with its graph."""

    __slots__ = ("storage_bytes",)

    def __new__(
        cls, moved: Offloaded, blocks: weakref.ref[OffloadBlocks], storage_bytes: int
    ) -> _InFlight:
        return super().__new__(cls, moved, _forget(blocks))

    def __init__(
        self, moved: Offloaded, blocks: weakref.ref[OffloadBlocks], storage_bytes: int
    ) -> None:
        # weakref.ref.__init__ only checks its arguments; __new__ set the referent and callback
        self.storage_bytes = storage_bytes


def _forget(blocks: weakref.ref[OffloadBlocks]) -> Callable[[_InFlight], None]:
    # The callback of a handle in flight: its window stops counting it (if still alive).
    def gone(flying: _InFlight) -> None:
        window = blocks()
        if window is not None:
            window._gone(flying)

    return gone


@contextlib.contextmanager
def on_device() -> Iterator[None]:
    """Nothing offloaded inside (a checkpointed block: what it keeps lives only until its
    recomputation's backward, in forward and in the backward's run again alike)."""
    held = OffloadBlocks()
    held.on_device = True
    with held.active():
        yield


class _Boundary(torch.autograd.Function):
    """The identity, whose backward brings back what fits (``OffloadBlocks.reached``)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, blocks: OffloadBlocks) -> Any:
        c: Any = ctx
        c.blocks = blocks
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.blocks.reached()
        return dy, None
