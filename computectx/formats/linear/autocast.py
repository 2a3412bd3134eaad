"""``autocast``: a region in which plain ``F.linear`` / ``nn.Linear`` calls run in fp8.

The open region lives in a ``ContextVar`` (so each thread and each asyncio task sees its
own), as a chain of frames: entering pushes a frame, leaving restores its parent. A frame
with ``enabled=False`` switches fp8 off inside it, for plain linears and ``QuantizedLinear``
modules alike.

Dispatch: while at least one enabled region is open on a thread, that thread's torch
function mode stack holds one ``_Fp8DispatchMode``. It intercepts ``F.linear`` and, when the
*current context's* region is enabled and the operands suit fp8, runs the fp8 autograd
function; every other call passes straight through. The mode is pushed when the first
enabled region on a thread opens and popped when the last one closes, so outside every
region nothing is intercepted and no torch op pays anything for computectx being imported.
Tasks interleaved on one event loop share the thread's mode while any of them is in a
region; the ``ContextVar`` check keeps the others on the ordinary path (at the cost of one
Python call per torch function while the mode is installed).

Limitation: the mode is per thread, the ``ContextVar`` per context. Code that runs a copied
context on another thread (``asyncio.to_thread``, ``contextvars.copy_context().run`` in a
worker) sees the region's frame but has no mode there, so its linears run unchanged. Open a
region inside the worker function instead.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar, cast

import torch
from torch.nn import functional
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from computectx.ctx import ComputeCtx
from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.backend import Backend, default_backend, select_backend
from computectx.formats.linear.function import fp8_linear
from computectx.formats.linear.plan import Fp8LinearPlan, gemm_dtype_for
from computectx.formats.numerics.layouts import check_granularity_widths
from computectx.formats.policy import describe, policy_of
from computectx.formats.scaling.layer import ScalingState
from computectx.recipes import Recipe

__all__ = ["REGION", "autocast", "region_fp8_enabled", "region_scaling_state"]

_F = TypeVar("_F", bound=Callable[..., Any])


# ----- the open region -------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Frame:
    """One open ``autocast``: what it says, who opened it, what it encloses."""

    enabled: bool
    ctx: ComputeCtx | None
    backend: Backend | None
    parent: _Frame | None
    owner: autocast
    dispatch: _ThreadDispatch | None  # the thread whose mode this frame holds, if enabled


REGION: ContextVar[_Frame | None] = ContextVar("computectx_fp8_region", default=None)
"""The innermost open region of this context (``None`` outside every region): what
``region_fp8_enabled`` reads, and ``QuantizedLinear.forward`` reads directly."""

# How many enabled=False regions are open in the process (all threads). Compiled code cannot
# read the ContextVar above; it reads this plain global instead, which dynamo guards on, so a
# graph traced while it was 0 is re-traced (and refused) once a disabled region opens.
_OPEN_DISABLED = 0
_OPEN_LOCK = threading.Lock()

COMPILED_REGION_ERROR = (
    "autocast regions are not visible inside torch.compile: {what}. Convert the model "
    "instead (computectx.formats.convert_to_quantized or QuantizedLinear.from_linear): a "
    "QuantizedLinear compiles whole and runs fp8 under its own ctx. To keep a module in high "
    "precision, leave it unconverted (convert_to_quantized's module_filter) rather than opening "
    "autocast(enabled=False) around compiled code"
)


def region_fp8_enabled() -> bool | None:
    """Whether the innermost open region enables fp8 (``None`` outside every region).

    Under ``torch.compile`` the region cannot be read: this returns ``None`` while no
    ``autocast(enabled=False)`` is open anywhere in the process and raises
    ``RuntimeError`` (saying what to do instead) while one is, so compiled code never runs
    a ``QuantizedLinear`` in a precision other than the one eager code would use.
    """
    if torch.compiler.is_compiling():
        if _OPEN_DISABLED:
            raise RuntimeError(
                COMPILED_REGION_ERROR.format(
                    what="a QuantizedLinear ran under torch.compile while an "
                    "autocast(enabled=False) region was open"
                )
            )
        return None
    frame = REGION.get()
    return None if frame is None else frame.enabled


def _count_disabled(delta: int) -> None:
    global _OPEN_DISABLED
    with _OPEN_LOCK:
        _OPEN_DISABLED += delta


class autocast:  # noqa: N801  # named like torch.autocast, which it mirrors
    """A region where ``nn.Linear`` / ``F.linear`` calls run in fp8 under ``ctx.recipe``.

    ``with autocast(ctx): loss = model(x)`` routes the linears of an unmodified model
    through the fp8 autograd function, each weight keeping its own scaling state;
    ``loss.backward()`` may run after the region closes. Regions nest and re-enter (the
    innermost wins; ``autocast(enabled=False)``, which needs no ctx, turns fp8 off
    inside it, also for ``QuantizedLinear`` modules), work as decorators (of plain and ``async``
    functions), and are private to the thread and asyncio task that opened them.

    ``backend`` forces a ``Backend`` for the region's linears (default:
    ``select_backend`` for each weight's device).
    """

    def __init__(
        self,
        ctx: ComputeCtx | None = None,
        enabled: bool = True,
        *,
        backend: Backend | str | None = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast: enabled must be a bool, got {enabled!r}")
        if enabled:
            if ctx is None:
                raise ValueError(
                    "autocast(enabled=True) needs a ComputeCtx whose fp8 policy it "
                    "applies, e.g. autocast(ComputeCtx.from_flag('fp8_hybrid', 'cpu')); "
                    "only autocast(enabled=False) works without one"
                )
            policy_of(ctx, "autocast")
        elif ctx is not None and not isinstance(ctx, ComputeCtx):
            raise TypeError(
                f"autocast: ctx must be a computectx.ComputeCtx or None, got {describe(ctx)}"
            )
        self._ctx = ctx
        self._enabled = enabled
        self._backend: Backend | None = None
        if backend is not None:
            device = ctx.device if ctx is not None else torch.device("cpu")
            self._backend = select_backend(device, force=backend)[0]

    @property
    def enabled(self) -> bool:
        """Whether this region turns fp8 on (``True``) or off (``False``)."""
        return self._enabled

    @property
    def ctx(self) -> ComputeCtx | None:
        """The context whose recipe (``ctx.recipe``) the region applies."""
        return self._ctx

    def __enter__(self) -> autocast:
        dispatch = _acquire_mode() if self._enabled else None
        frame = _Frame(self._enabled, self._ctx, self._backend, REGION.get(), self, dispatch)
        REGION.set(frame)
        if not self._enabled:
            _count_disabled(1)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        frame = REGION.get()
        if frame is None or frame.owner is not self:
            raise RuntimeError(
                "autocast exited out of order: the innermost open region in this "
                "context is not this one (regions must close in the reverse order they open)"
            )
        REGION.set(frame.parent)
        if not frame.enabled:
            _count_disabled(-1)
        if frame.dispatch is not None:
            _release_mode(frame.dispatch)

    def __call__(self, func: _F) -> _F:
        """Decorate ``func`` so each call runs inside a fresh region with these settings.

        A fresh region per call (rather than this instance) lets the decorated function
        run concurrently on several threads or tasks.
        """
        ctx, enabled, backend = self._ctx, self._enabled, self._backend
        if inspect.iscoroutinefunction(func):
            coro = cast(Callable[..., Awaitable[Any]], func)

            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with autocast(ctx, enabled, backend=backend):
                    return await coro(*args, **kwargs)

            return cast(_F, run_async)

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            with autocast(ctx, enabled, backend=backend):
                return func(*args, **kwargs)

        return cast(_F, run)

    def __repr__(self) -> str:
        where = "" if self._ctx is None else f"ctx={str(self._ctx)!r}, "
        return f"autocast({where}enabled={self._enabled})"


# ----- per-thread dispatch mode ------------------------------------------------------------


class _ThreadDispatch:
    """One thread's dispatch mode and how many enabled regions hold it."""

    __slots__ = ("count", "ident", "mode")

    def __init__(self) -> None:
        self.mode = _Fp8DispatchMode()
        self.count = 0
        self.ident = threading.get_ident()


_THREAD = threading.local()


def _thread_dispatch() -> _ThreadDispatch:
    d: _ThreadDispatch | None = getattr(_THREAD, "dispatch", None)
    if d is None:
        d = _ThreadDispatch()
        _THREAD.dispatch = d
    return d


def _mode_stack() -> list[object]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _acquire_mode() -> _ThreadDispatch:
    d = _thread_dispatch()
    # Checked on every entry, not only the first: torch pops whatever mode is on top, so a
    # foreign mode exiting out of order (interleaved tasks) can have removed ours.
    if not any(m is d.mode for m in _mode_stack()):
        d.mode.__enter__()  # type: ignore[no-untyped-call]
    d.count += 1
    return d


def _release_mode(d: _ThreadDispatch) -> None:
    d.count -= 1
    if d.count > 0 or d.ident != threading.get_ident():
        return
    stack = _mode_stack()
    # Only pop when the mode is on top. If another mode was pushed above it and is still
    # open (possible when asyncio tasks interleave their own modes with our regions), the
    # mode stays in the stack, inert (it finds no enabled region), and the next region on
    # this thread reuses it instead of pushing a second one.
    if stack and stack[-1] is d.mode:
        d.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]


class _Fp8DispatchMode(TorchFunctionMode):
    """Routes ``F.linear`` to fp8 when the current context's region is enabled."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is functional.linear:
            if torch.compiler.is_compiling():
                # The region (a ContextVar) cannot be read while tracing, and running the
                # linear unrouted would be silently high precision: refuse instead.
                raise RuntimeError(
                    COMPILED_REGION_ERROR.format(
                        what="F.linear (an nn.Linear) was traced by torch.compile while an "
                        "enabled autocast region was open on this thread"
                    )
                )
            frame = REGION.get()
            if frame is not None and frame.enabled and frame.ctx is not None:
                routed = _route_linear(frame, args, kwargs)
                if routed is not None:
                    return routed
        return func(*args, **kwargs)


# ----- the routed linear --------------------------------------------------------------------


class _WeightStates:
    """Scaling state of weights met inside regions, keyed by the weight tensor object.

    Keyed by identity, held weakly: the state lives exactly as long as the ``Parameter``
    does. (Keying by ``data_ptr`` would hand a freed weight's history to whatever tensor is
    allocated at the same address next, and would split one weight's history when
    ``.to()`` moves its storage.) A weight recomputed on every call (a parametrization)
    is a new tensor each time and so gets fresh, seeded state: dynamic scaling in effect.
    """

    def __init__(self) -> None:
        self._states: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor, policy: Recipe) -> ScalingState:
        state: ScalingState | None = self._states.get(weight)  # type: ignore[no-untyped-call]
        if state is None:
            with self._lock:
                state = self._states.get(weight)  # type: ignore[no-untyped-call]
                if state is None:
                    state = ScalingState(policy, weight.device)
                    self._states[weight] = state
        state.conform(policy, weight.device)
        return state

    def peek(self, weight: torch.Tensor) -> ScalingState | None:
        found: ScalingState | None = self._states.get(weight)  # type: ignore[no-untyped-call]
        return found


_WEIGHT_STATES = _WeightStates()


def region_scaling_state(weight: torch.Tensor) -> ScalingState | None:
    """The scaling state regions keep for a plain ``nn.Linear`` weight, if it ran in one."""
    return _WEIGHT_STATES.peek(weight)


def _route_linear(
    frame: _Frame, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """The fp8 result of ``functional.linear(*args, **kwargs)``, or ``None`` to run it unchanged."""
    names = ("input", "weight", "bias")
    if len(args) > 3 or any(k not in names for k in kwargs):
        return None
    bound = dict(zip(names, args, strict=False))
    if any(k in bound for k in kwargs):
        return None
    bound.update(kwargs)
    x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
    if not (_suits(x) and _suits(w)):
        return None
    x, w = cast(torch.Tensor, x), cast(torch.Tensor, w)
    if w.dim() != 2 or x.dim() < 1 or x.shape[-1] != w.shape[1] or x.device != w.device:
        return None
    if b is not None and not (_suits(b) and b.dim() == 1 and b.shape[0] == w.shape[0]):
        return None
    if b is not None and b.device != w.device:
        return None
    ctx = frame.ctx
    if ctx is None or not isinstance(ctx.recipe, Recipe):  # pragma: no cover - policy_of'd
        return None
    try:  # the width rule convert_to_quantized skips by: such a linear runs in high precision
        check_granularity_widths(ctx.recipe.granularity, w.shape[1], w.shape[0])
    except ValueError:
        return None
    plan = Fp8LinearPlan(
        policy=ctx.recipe,
        state=_WEIGHT_STATES.get(w, ctx.recipe),
        backend=default_backend(w.device) if frame.backend is None else frame.backend,
        gemm_dtype=gemm_dtype_for(ctx.compute),
        save=ctx.activations.linear,
    )
    return fp8_linear(x, w, b, plan)


def _suits(t: object) -> bool:
    # Plain dense tensors in a quantizable dtype only: subclasses (DTensor, fakes) and
    # meta/sparse tensors keep their own linear.
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and cast(torch.Tensor, t).dtype in FLOAT_DTYPES
        and cast(torch.Tensor, t).layout == torch.strided
        and cast(torch.Tensor, t).device.type != "meta"
    )
