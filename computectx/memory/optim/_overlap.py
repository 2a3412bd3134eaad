"""The offloaded step overlapped with the backward (``OffloadedOptimizer(..., overlap=True)``).

With the model on a GPU and the masters on the host, the serial step waits for the whole
backward, then moves every gradient down, steps every master, and moves every weight up. The
overlapped step moves each gradient down while the backward goes on, and steps each master
as soon as its gradient has landed, its weight's upload queued at once:

1. *In the backward*, a post-accumulate-grad hook per parameter (``Overlap.hooked``) takes
   its gradient the moment autograd has written it: its 2-norm (float32) is taken on the
   compute device's current stream (ordered after the gradient, nothing waits), the gradient
   is copied into the parameter's own pinned host buffer on a side stream (``Lanes``) that
   first waits for the current stream, and ``param.grad`` is set to ``None`` (the allocator
   keeps its memory until the copy has read it: ``record_stream``).
2. *At the clip* (``clip``), the global 2-norm is the 2-norm of the per-gradient norms,
   stacked in parameter order, read with one device sync; nothing is scaled yet: the scale
   (``min(max_norm / (norm + 1e-6), 1)``, torch's ``clip_grad_norm_``) is applied to each
   gradient as it lands.
3. *At the step*, the verdict (may these gradients be applied?) comes from the same norms
   (one sync; or the clip's), before any master changes; then, in the order the hooks fired,
   each download is waited on (``Landing.wait``), added to its master's gradient, scaled,
   the master stepped alone (``step_one``) and its weight's upload queued.

Where the fast path does not apply, everything lands first and the serial step runs
(``land_all``): a gradient left in ``param.grad`` (assigned, or a step before the hooks
expected it), an accumulator's sums, a master gradient ingested by hand, a clip of another
norm than 2, a norm that does not clear the gradients by itself (inf, NaN or ``>= 2**64``:
the host then tells them apart exactly), or compact state / masters below float32 (the
stepper steps all masters at once).

Gradient accumulation: each parameter's gradient stays on the device (summed there by
autograd, as without offload) until the firing its hook expects to be the step's last (the
count the step before saw; 1 at first); that firing moves it down. A firing beyond it waits
for that copy, adds it back into the new gradient on the device (one upload, where autograd
would have added it) and moves the sum down again. A step that comes before the expected
last firing finds the gradients in ``param.grad`` and takes the serial path. So the sums are
autograd's own, bit for bit what the serial step applies, and in a steady loop only the
first step pays for the surplus firings.

Parameters under ``NEAR_BELOW`` (4096) elements keep their masters, and so their optimizer
state, on their CUDA device (``MasterWeights.near``): their gradients are not copied, and
their masters are stepped there, in the same order, without a round trip through the host.

``HostLanes`` stands in for the side stream on the CPU: a copy lands only when its landing is
waited on, and until then the buffer holds NaN, so a read before the wait is a wrong step.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle

from computectx.memory.accumulator import LowPrecGradAccumulator
from computectx.memory.optim._grad_health import SQUARE_OVERFLOW
from computectx.memory.optim._grad_ingest import GradIngest
from computectx.memory.optim._masters import MasterWeights

__all__ = [
    "NEAR_BELOW",
    "CudaLanes",
    "HostLanes",
    "Landing",
    "Lanes",
    "Overlap",
]


class Landing(Protocol):
    """A copy in flight; ``wait`` blocks until its destination holds the copied values."""

    def wait(self) -> None: ...


class Lanes(Protocol):
    """Copies from the compute device into host buffers, off the backward's stream."""

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> Landing: ...


class _CudaLanding:
    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class CudaLanes:
    """Downloads on one side stream of ``device``, each after the work queued so far on the
    current stream (which wrote the gradient), into pinned buffers."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> Landing:
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        # The source was allocated on the current stream: without this the allocator could
        # hand its memory out again (``param.grad = None``) before the side stream read it.
        src.record_stream(self.stream)
        return _CudaLanding(event)


class _DeferredLanding:
    __slots__ = ("dst", "log", "values")

    def __init__(self, dst: torch.Tensor, values: torch.Tensor, log: list[tuple[str, int]]) -> None:
        self.dst = dst
        self.values: torch.Tensor | None = values
        self.log = log

    def wait(self) -> None:
        if self.values is not None:
            self.log.append(("landed", self.dst.data_ptr()))
            self.dst.copy_(self.values)
            self.values = None


class HostLanes:
    """The CPU's stand-in for ``CudaLanes``: the copy lands only when waited on; until then the
    buffer reads NaN. ``log`` records ``("download", ptr)`` and ``("landed", ptr)`` in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> Landing:
        values = src.detach().clone()  # what the device copy will read: the value now
        dst.fill_(math.nan)
        self.log.append(("download", dst.data_ptr()))
        return _DeferredLanding(dst, values, self.log)


NEAR_BELOW = 4096
"""Parameters with fewer elements than this keep their masters on their CUDA device under the
overlapped step (``MasterWeights.near_below``): a copy down and up costs more than their
step there."""


@dataclasses.dataclass
class _Pending:
    """A gradient on its way to its master: its landing, where it lands (``source``: the host
    buffer, or the gradient itself for a master on its device) and its norm (on the compute
    device)."""

    landing: Landing
    source: torch.Tensor
    norm: torch.Tensor


class _Landed:
    """The landing of a gradient that stays where it is (its master is on its device)."""

    def wait(self) -> None:
        return None


class Overlap:
    """The hooks, host buffers and downloads of an overlapped ``OffloadedOptimizer``."""

    def __init__(
        self,
        weights: MasterWeights,
        ingest: GradIngest,
        lanes: Callable[[torch.device], Lanes],
    ) -> None:
        self.weights = weights
        self.ingest = ingest
        self._lanes_for = lanes
        self._lanes: dict[torch.device, Lanes] = {}
        self._buffers: dict[int, torch.Tensor] = {}  # download buffers, by position
        self._in_flight: dict[int, Landing] = {}  # the last download into each buffer
        self._pending: dict[int, _Pending] = {}  # in the order the hooks fired
        self._fired: list[int] = []
        self._expect: list[int] = []
        self._scale: torch.Tensor | None = None  # the clip's, applied at landing
        self._verdict: bool | None = None  # the clip's
        self._handles: list[RemovableHandle] = []
        weakref.finalize(self, _remove_all, self._handles)

    # ----- the backward ---------------------------------------------------------------

    def watch(self, compute: Iterable[torch.Tensor]) -> None:
        """Hook each of ``compute`` (the positions after those watched so far)."""
        for p in compute:
            i = len(self._fired)
            self._fired.append(0)
            self._expect.append(1)
            if p.requires_grad:
                hook = _Hook(weakref.ref(self), i)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]

    def hooked(self, i: int, param: torch.Tensor) -> None:
        """Position ``i``'s hook: move its gradient down when this firing is the one the step
        before saw last (or later); leave it on the device before that."""
        g = param.grad
        if g is None or g.layout != torch.strided or _accumulated_elsewhere(param):
            return
        self._fired[i] += 1
        if self._fired[i] < self._expect[i]:
            return
        if self._scale is not None:
            # A backward after a clip: the clipped gradients land scaled first (the new one
            # adds to them unscaled, as it would to the serial step's clipped masters).
            self.land_all()
        self._verdict = None
        with torch.no_grad():
            g = g.detach()
            pending = self._pending.pop(i, None)
            if pending is not None:
                # A firing beyond the expected last: the sum already down goes back into
                # the new gradient (as autograd would have added it: IEEE addition is
                # commutative, so the sum is the serial one bit for bit) and goes down again.
                pending.landing.wait()
                g.add_(pending.source.to(g.device))
            norm = torch.linalg.vector_norm(g, 2.0, dtype=_norm_dtype(g.dtype))
            if self.weights.near(param):
                # A master on the gradient's device (a small tensor): nothing to copy.
                self._pending[i] = _Pending(_Landed(), g, norm)
            else:
                buffer = self._buffer(i, g)
                landing = self._lanes_of(g.device).download(buffer, g)
                self._in_flight[i] = landing
                self._pending[i] = _Pending(landing, buffer, norm)
        param.grad = None

    def _lanes_of(self, device: torch.device) -> Lanes:
        lanes = self._lanes.get(device)
        if lanes is None:
            lanes = self._lanes[device] = self._lanes_for(device)
        return lanes

    def _buffer(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """Position ``i``'s download buffer, free to be written (its last copy landed)."""
        buffer = self._buffers.get(i)
        if buffer is None or buffer.dtype != g.dtype or buffer.shape != g.shape:
            pin = g.device.type == "cuda"
            buffer = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=pin)
            self._buffers[i] = buffer
        landing = self._in_flight.pop(i, None)
        if landing is not None:
            landing.wait()
        return buffer

    # ----- landing --------------------------------------------------------------------

    def _land(self, i: int, pending: _Pending) -> None:
        """Add position ``i``'s landed gradient to its master's (scaled by the clip's)."""
        pending.landing.wait()
        master = self.weights.master[i]
        with torch.no_grad():
            # The buffer is reused (and a gradient kept on its device is the compute
            # parameter's), so the master gradient is a copy of it.
            self.ingest.add(i, master, pending.source.to(master.dtype, copy=True))
            if self._scale is not None and master.grad is not None:
                master.grad.mul_(self._scale)

    def land_all(self) -> None:
        """Land every download (the serial path's start): the masters hold the gradients
        (scaled by a clip taken on them)."""
        while self._pending:
            i = next(iter(self._pending))
            self._land(i, self._pending.pop(i))
        self._scale = None

    @property
    def scaled(self) -> bool:
        """Whether a clip's scale waits for the downloads (a second clip measures the scaled
        gradients: it lands them first)."""
        return self._scale is not None

    def has_pending(self) -> bool:
        """Whether a gradient is on its way down."""
        return bool(self._pending)

    def fast(self) -> bool:
        """Whether the step can land and step one master at a time: every gradient to apply
        is one download, none is elsewhere (``param.grad``, ingested)."""
        if not self._pending:
            return False
        weights, ingest = self.weights, self.ingest
        return all(cp.grad is None for cp in weights.compute) and all(
            ingest.holds_nothing(i) for i in range(len(weights.master))
        )

    # ----- clip and verdict -----------------------------------------------------------

    def _norms(self) -> torch.Tensor:
        """The downloads' norms in parameter order, stacked on the first one's device."""
        norms = [self._pending[i].norm for i in sorted(self._pending)]
        first = norms[0].device
        return torch.stack([n.to(first) for n in norms])

    def clip(self, max_norm: float) -> float:
        """The global 2-norm of the downloads (one sync), as ``clip_grad_norm_`` measures it;
        each gradient is scaled as it lands. Call only when ``fast()``."""
        total = torch.linalg.vector_norm(self._norms(), 2.0)
        norm = float(total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._scale = coef.to(device=self.weights.ctx.offload_device)
        # As GradHealth.clip: an element is at most the norm, and once clipped at most
        # max_norm; a finite but huge norm leaves it to verdict().
        if not math.isfinite(norm):
            self._verdict = False
        elif min(norm, max_norm) < SQUARE_OVERFLOW:
            self._verdict = True
        return norm

    def verdict(self) -> bool | None:
        """``True``/``False``: whether the downloads may be applied, known from their norms
        (or the clip's) with one sync; ``None``: the host must tell them apart (land all)."""
        if self._verdict is not None:
            return self._verdict
        norms = self._norms()
        if bool((norms < SQUARE_OVERFLOW).all()):
            return True
        return None

    # ----- the step -------------------------------------------------------------------

    def step_each(self, step_one: Callable[[int], None]) -> None:
        """Land each download in the order the hooks fired and ``step_one`` its position."""
        while self._pending:
            i = next(iter(self._pending))
            self._land(i, self._pending.pop(i))
            step_one(i)
        self._scale = self._verdict = None

    def stepped(self) -> None:
        """A step ended (applied or skipped): each position now expects the firings it saw."""
        self._expect = [f or e for f, e in zip(self._fired, self._expect, strict=True)]
        self.forget()

    def forget(self) -> None:
        """Drop the downloads in flight and the counts (``zero_grad``; the buffers wait for
        their copies before they are written again)."""
        self._pending.clear()
        self._fired = [0] * len(self._fired)
        self._scale = self._verdict = None

    def buffers(self) -> list[torch.Tensor]:
        """The download buffers (for ``memory_report``)."""
        return list(self._buffers.values())


def _norm_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a gradient's norm is taken in: float32 for 16-bit gradients (their own
    dtype would round the norm), the gradient's otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else None


def _accumulated_elsewhere(param: torch.Tensor) -> bool:
    """Whether a ``LowPrecGradAccumulator`` drains ``param``'s gradient (its hook takes it,
    whichever hook runs first)."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    return any(isinstance(getattr(h, "acc", None), LowPrecGradAccumulator) for h in hooks.values())


class _Hook:
    """Position ``i``'s hook, holding its ``Overlap`` weakly."""

    __slots__ = ("i", "overlap")

    def __init__(self, overlap: weakref.ref[Overlap], i: int) -> None:
        self.overlap = overlap
        self.i = i

    def __call__(self, param: torch.Tensor) -> None:
        overlap = self.overlap()
        if overlap is not None:
            overlap.hooked(self.i, param)


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
