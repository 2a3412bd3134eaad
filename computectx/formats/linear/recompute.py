"""Activation checkpointing of fp8 layers: a recomputed forward replays the original's steps.

Activation checkpointing drops a region's saved tensors after the forward and runs the
region's forward again during the backward to rebuild them. An fp8 call that quantized
through its ledgers would, run again, quantize with a step that has moved on since (so the
rebuilt fp8 codes, and every activation after them, differ from the forward's) and record
its amaxes a second time. Instead, each fp8 call of an original forward inside a checkpointed
region remembers the steps it used (``StepsUsed``: the input's, the weight's), and the
recomputed call quantizes with exactly those steps, recording nothing and issuing no
collective. The fp8 codes are recomputed from the same inputs, so they are the same bytes.

Matching is by region and by order, as checkpointing itself matches saved tensors: the
n-th call of a scaling state in a region's recompute takes the steps of that state's n-th
call in the region's original forward. Regions are keyed by checkpoint's own objects,
found as ``checkpoint_site`` describes, and held weakly: what a region remembers lives as
long as the autograd graph that can still recompute it, so a forward whose backward never
runs leaves nothing behind once its graph is gone.

``checkpoint_policy`` and ``checkpoint_context_fn`` are for checkpointing under
``torch.compile``, where AOTAutograd recomputes the region itself (see the function);
``delayed_quantize_in_compiled_checkpoint`` is how a traced fp8 call applies it unasked.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils import _python_dispatch

from computectx.formats.scaling.layer import ScalingState
from computectx.formats.scaling.operand import AmaxReduce

__all__ = [
    "CheckpointSite",
    "StepsUsed",
    "checkpoint_context_fn",
    "checkpoint_policy",
    "checkpoint_site",
    "delayed_quantize_in_compiled_checkpoint",
    "in_reentrant_checkpoint_forward",
    "live_regions",
    "selective_modes_set_aside",
    "warn_nothing_to_replay",
]


@dataclass(frozen=True, eq=False, slots=True)
class StepsUsed:
    """What one fp8 call of an original forward quantized with, for its recomputation.

    ``input_step`` and ``weight_step`` are the float32 steps its input and weight codes were
    made with (``weight_step`` is ``None`` for a weight that arrived quantized: frozen, or an
    ``QuantizedWeight``, whose codes and step come with it again). ``record`` and ``amax_reduce``
    are the plan's, so the backward of a recomputed call (reentrant checkpointing runs that
    one, not the original's) records the output gradient as the original call would have.
    """

    state: ScalingState
    input_step: torch.Tensor
    weight_step: torch.Tensor | None
    record: bool
    amax_reduce: AmaxReduce | None


@dataclass(eq=False, slots=True)
class _Region:
    # id(state) -> that state's calls in forward order; the StepsUsed hold the state, so
    # the id stays that state's while the region lives.
    calls: dict[int, list[StepsUsed]] = field(default_factory=dict)
    # one cursor per recomputation (per backward: the graph task, or checkpoint's group),
    # so a graph kept with retain_graph=True replays from the start each time.
    cursors: dict[object, dict[int, int]] = field(default_factory=dict)


_REGIONS: weakref.WeakKeyDictionary[object, _Region] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


@dataclass(frozen=True, eq=False, slots=True)
class CheckpointSite:
    """Where an fp8 call runs with respect to activation checkpointing.

    ``kind`` is ``"forward"`` (the original forward of a checkpointed region: ``remember``
    what it used), ``"recompute"`` (its recomputation during the backward: ``recall``) or
    ``"backward"`` (any other forward that runs while a backward is running, such as a
    nested checkpoint's or one checkpointing machinery this module does not know: it records
    nothing, and has nothing to replay).
    """

    kind: Literal["forward", "recompute", "backward"]
    key: object = None
    task: object = None

    @property
    def recomputing(self) -> bool:
        """Whether this call runs during a backward (and so must record nothing)."""
        return self.kind != "forward"

    def remember(self, steps: StepsUsed) -> None:
        """Keep ``steps`` for this region's recomputation (original forward only)."""
        if self.kind != "forward" or self.key is None:
            return
        with _LOCK:
            region = _REGIONS.get(self.key)
            if region is None:
                region = _Region()
                _REGIONS[self.key] = region
            region.calls.setdefault(id(steps.state), []).append(steps)

    def recall(self, state: ScalingState) -> StepsUsed | None:
        """The steps ``state``'s matching original call used, or ``None`` if none was kept."""
        if self.kind != "recompute" or self.key is None:
            return None
        with _LOCK:
            region = _REGIONS.get(self.key)
            if region is None:
                return None
            calls = region.calls.get(id(state))
            cursor = region.cursors.setdefault(self.task, {})
            n = cursor.get(id(state), 0)
            if calls is None or n >= len(calls):
                return None
            cursor[id(state)] = n + 1
            return calls[n]


def live_regions() -> int:
    """How many checkpointed regions hold remembered steps now (for tests and leak checks)."""
    with _LOCK:
        return len(_REGIONS)


# ---------------------------------------------------------------------------------------
# Finding the region. torch.utils.checkpoint has no public "which region am I in" query, so
# this reads the state its two implementations already keep:
#
# - non-reentrant (checkpoint(use_reentrant=False), checkpoint_wrapper, FSDP2's composable
#   checkpoint, selective checkpointing): the original forward runs under saved-tensor hooks
#   built around the region's _CheckpointFrame (closure variable "frame"); the
#   recomputation runs under hooks built around a weak reference to that frame
#   ("target_frame_ref") and the backward's id ("gid").
# - reentrant (use_reentrant=True): CheckpointFunction.forward runs the region under
#   no_grad, CheckpointFunction.backward runs it again; both frames hold the same "ctx".
#
# tests/formats/linear/test_recompute.py checks every one of these paths, so a torch release
# that changes them fails there rather than silently recording twice.


def _closure_value(fn: Any, name: str) -> object:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None)
    if code is None or cells is None or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


_FRAME_TYPE: type | None = getattr(torch_checkpoint, "_CheckpointFrame", None)
_REENTRANT = getattr(torch_checkpoint, "CheckpointFunction", None)
_REENTRANT_FORWARD = getattr(getattr(_REENTRANT, "forward", None), "__code__", None)
_REENTRANT_BACKWARD = getattr(getattr(_REENTRANT, "backward", None), "__code__", None)


def _is_frame(obj: object) -> bool:
    return _FRAME_TYPE is not None and isinstance(obj, _FRAME_TYPE)


def _non_reentrant_site() -> CheckpointSite | None:
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return None
    pack = inspect.unwrap(hooks[0])  # the recomputation's pack hook is dynamo-disabled
    frame = _closure_value(pack, "frame")
    if _is_frame(frame):
        if torch._C._current_graph_task_id() != -1:
            # A checkpointed region entered during a backward: a nested checkpoint inside
            # an outer region's recomputation.
            return CheckpointSite("backward")
        return CheckpointSite("forward", frame)
    ref = _closure_value(pack, "target_frame_ref")
    if isinstance(ref, weakref.ReferenceType):
        target = ref()
        if _is_frame(target):
            return CheckpointSite("recompute", target, _closure_value(pack, "gid"))
    return None


def _reentrant_ctx(code: object) -> object:
    if code is None:
        return None
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return f.f_locals.get("ctx")
        f = f.f_back  # type: ignore[assignment]
    return None


def in_reentrant_checkpoint_forward() -> bool:
    """Whether this call runs in the original forward of a reentrant checkpoint.

    ``checkpoint(use_reentrant=True)`` runs that forward under ``torch.no_grad``; it is a
    training forward all the same (the recomputation builds its graph), so a layer records
    in it as it would without checkpointing. False while compiling (nothing to look up).
    """
    if torch.compiler.is_compiling():
        return False
    return _will_recompute(_reentrant_ctx(_REENTRANT_FORWARD))


def _will_recompute(ctx: Any) -> bool:
    # A reentrant checkpoint called under the user's own no_grad (a validation pass in
    # training mode) builds no graph, so its forward is never recomputed and is no training
    # forward: autograd then gave its ctx no edges to the inputs (needs_input_grad would
    # not tell: it follows requires_grad, not the grad mode).
    return ctx is not None and bool(getattr(ctx, "next_functions", ()))


def checkpoint_site(record: bool) -> CheckpointSite | None:
    """Where the fp8 call about to run sits with respect to activation checkpointing.

    ``None`` outside every checkpointed region (and while compiling: a compiled region's
    recomputation is AOTAutograd's, see ``checkpoint_policy``). ``record`` is whether
    the call records; a reentrant region's original forward is looked up only then (it
    runs under no_grad, like an eval call that must not pay for the look-up).
    """
    if torch.compiler.is_compiling():
        return None
    site = _non_reentrant_site()
    if site is not None:
        return site
    task = torch._C._current_graph_task_id()
    if task != -1:
        ctx = _reentrant_ctx(_REENTRANT_BACKWARD)
        if ctx is not None:
            return CheckpointSite("recompute", ctx, task)
        return CheckpointSite("backward")
    if record and not torch.is_grad_enabled():
        ctx = _reentrant_ctx(_REENTRANT_FORWARD)
        if _will_recompute(ctx):
            return CheckpointSite("forward", ctx)
    return None


def warn_nothing_to_replay() -> None:
    """A recording fp8 call ran during a backward with no remembered steps to replay."""
    warnings.warn(
        "an fp8 layer ran a training forward during a backward with no steps remembered "
        "for it (a nested checkpoint, or checkpointing this version of computectx does not "
        "recognise): it quantized with the scaling state as it is now and recorded nothing, "
        "so its gradients may differ from a run without checkpointing",
        UserWarning,
        stacklevel=4,
    )


# ---------------------------------------------------------------------------------------
# Selective checkpointing. Its dispatch modes cache or replay ops by (op, call index), and
# expect the recomputation to dispatch exactly the ops the forward did. A quantize that
# records (forward) and one that replays a step (recomputation) dispatch different ops, so
# both run with those modes set aside: the policy never sees them, and the layer's GEMM,
# which both dispatch alike, stays the policy's to save or recompute.

_SELECTIVE_MODES: tuple[type, ...] = tuple(
    t
    for t in (
        getattr(torch_checkpoint, "_CachingTorchDispatchMode", None),
        getattr(torch_checkpoint, "_CachedTorchDispatchMode", None),
    )
    if isinstance(t, type)
)


@contextlib.contextmanager
def selective_modes_set_aside() -> Iterator[None]:
    """Run the block with selective checkpointing's dispatch modes off the mode stack.

    Other dispatch modes stay where they were; a stack without selective modes is left
    untouched (one length query).
    """
    stack = _python_dispatch._get_current_dispatch_mode_stack()
    if not any(isinstance(m, _SELECTIVE_MODES) for m in stack):
        yield
        return
    deepest = min(i for i, m in enumerate(stack) if isinstance(m, _SELECTIVE_MODES))
    popped = [_python_dispatch._pop_mode() for _ in range(len(stack) - deepest)]
    kept = [m for m in reversed(popped) if not isinstance(m, _SELECTIVE_MODES)]
    for m in kept:
        _python_dispatch._push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _python_dispatch._pop_mode()
        for m in reversed(popped):
            _python_dispatch._push_mode(m)


# ---------------------------------------------------------------------------------------
# Under torch.compile. Dynamo turns a checkpointed region into a higher-order op and
# AOTAutograd recomputes the region's nodes in the backward graph from the graph's inputs.
# The ledgers are such inputs, updated in place by the forward; AOTAutograd reads them in
# the backward after that update (pytorch/pytorch#197039), so a delayed quantize recomputed
# there uses the next step, not the one the forward used. A selective policy that saves the
# delayed quantize's outputs (the fp8 codes and the step) instead of recomputing them makes
# the backward use the forward's bytes. A recording delayed call that dynamo traces inside a
# region without a context_fn wraps itself in a region under that policy
# (delayed_quantize_in_compiled_checkpoint tells the regions apart at trace time); inside a
# region with another context_fn it refuses to trace.

_LEDGER_READERS = ("fp8_quantize_delayed",)
"""computectx operators whose result depends on a ledger's step (a compiled recomputation
would read the ledger after the forward advanced it)."""

SelectivePolicy = Callable[..., Any]


def _reads_a_ledger(op: object) -> bool:
    name = getattr(op, "__name__", "")  # "fp8_quantize_delayed.default"
    namespace = getattr(op, "namespace", None)
    return namespace == "computectx" and name.split(".")[0] in _LEDGER_READERS


def checkpoint_policy(
    base: SelectivePolicy | Sequence[object] | None = None,
) -> SelectivePolicy:
    """A selective-checkpointing policy that saves what a delayed fp8 quantize produced.

    For ``torch.utils.checkpoint.create_selective_checkpoint_contexts``. The result is
    ``MUST_SAVE`` for ``computectx::fp8_quantize_delayed`` (its fp8 codes, one byte per
    element, and its step) and otherwise what ``base`` says: a policy function, a list of
    ops to save (as ``create_selective_checkpoint_contexts`` takes), or ``None`` to
    recompute everything else. Needed only under ``torch.compile`` with delayed scaling; in
    eager the recomputed forward replays the steps itself and the policy never sees the
    quantize (``selective_modes_set_aside``).
    """
    if base is None or callable(base):
        inner = base
        saved: frozenset[object] = frozenset()
    else:
        inner = None
        saved = frozenset(base)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if _reads_a_ledger(op):
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        if inner is not None:
            return inner(ctx, op, *args, **kwargs)
        if op in saved:
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    policy._computectx_fp8 = True  # type: ignore[attr-defined]  # tells our context_fn apart
    return policy


def checkpoint_context_fn(
    base: SelectivePolicy | Sequence[object] | None = None,
) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that checkpoints selectively under ``checkpoint_policy(base)``."""
    return functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, checkpoint_policy(base)
    )


SAVE_FP8: Callable[[], tuple[Any, Any]] = checkpoint_context_fn()
"""``checkpoint_context_fn()``, made once: what an fp8 call inside a compiled checkpointed
region without it wraps itself in (``delayed_quantize_in_compiled_checkpoint`` tells it so,
``computectx.formats.linear.function`` does it)."""

CompiledRegion = Literal["none", "saved", "unsaved"]


def _checkpoint_hop_code() -> object:
    try:
        from torch._dynamo.variables.higher_order_ops import CheckpointHigherOrderVariable
    except ImportError:  # pragma: no cover - a torch without dynamo's checkpoint support
        return None
    return getattr(getattr(CheckpointHigherOrderVariable, "_call_function", None), "__code__", None)


def _is_fp8_context_fn(context_fn: object) -> bool:
    return (
        isinstance(context_fn, functools.partial)
        and context_fn.func is torch_checkpoint.create_selective_checkpoint_contexts
        and bool(context_fn.args)
        and bool(getattr(context_fn.args[0], "_computectx_fp8", False))
    )


def delayed_quantize_in_compiled_checkpoint(
    unsaveable: Literal["", "inline", "sharded"],
) -> CompiledRegion:
    """Where dynamo is tracing a recording delayed fp8 call, as a trace-time constant.

    ``"none"`` outside every checkpointed region; ``"saved"`` inside one whose
    ``context_fn`` is ``checkpoint_context_fn``'s (its quantize will be saved);
    ``"unsaved"`` inside one without a ``context_fn`` (the call must see to it). Raises,
    while tracing, inside one with another ``context_fn`` (whose policy this cannot extend)
    and, in any, for a quantize no policy can single out (``unsaveable``: ``"inline"``, plain
    torch ops; ``"sharded"``, a tensor-parallel operand's whole-tensor quantize): AOTAutograd
    would recompute those quantizes from the ledger the forward advanced
    (pytorch/pytorch#197039).

    Dynamo runs this at trace time (``assume_constant_result``: no graph break, nothing in
    the graph). It finds the innermost checkpoint dynamo is turning into a higher-order op
    by that frame of dynamo's, whose ``context_fn`` local is the one the user passed (torch
    has no public query; the tests of the three cases fail if a release changes this).
    Meaningful only while compiling.
    """
    code = _checkpoint_hop_code()
    f = sys._getframe(1)
    while code is not None and f is not None:
        if f.f_code is code:
            context_fn = f.f_locals.get("context_fn")
            if unsaveable == "inline":
                raise RuntimeError(_INLINE_ERROR)
            if unsaveable == "sharded":
                raise RuntimeError(_SHARDED_ERROR)
            if context_fn is None:
                return "unsaved"
            if _is_fp8_context_fn(context_fn):
                return "saved"
            raise RuntimeError(_FOREIGN_ERROR)
        f = f.f_back  # type: ignore[assignment]
    return "none"


_FOREIGN_ERROR = (
    "an fp8 layer with delayed scaling runs inside a torch.compile'd activation checkpoint "
    "whose context_fn is not computectx's: AOTAutograd would recompute its quantize from the "
    "amax history the forward already advanced (pytorch/pytorch#197039), silently giving "
    "other gradients. Pass context_fn=checkpoint_context_fn(your_policy) "
    "(computectx.formats.linear.recompute), which saves the delayed quantize and leaves every "
    "other op to your policy"
)
_INLINE_ERROR = (
    "an fp8 layer with delayed scaling and quantize='inline' runs inside a torch.compile'd "
    "activation checkpoint: AOTAutograd would recompute its quantize from the amax history "
    "the forward already advanced (pytorch/pytorch#197039), and no checkpointing policy can "
    "single out an inline quantize's plain torch ops, so its gradients would silently "
    "differ. Use quantize='op' there (with context_fn=checkpoint_context_fn() or none)"
)


_SHARDED_ERROR = (
    "an fp8 layer with delayed scaling and tensor-parallel (DTensor) operands runs inside a "
    "torch.compile'd activation checkpoint: AOTAutograd would recompute its whole-tensor "
    "quantize from the amax history the forward already advanced (pytorch/pytorch#197039), "
    "and no checkpointing policy singles that quantize out yet, so its gradients would "
    "silently differ. Use dynamic scaling for tensor-parallel layers under a compiled "
    "checkpoint, or checkpoint them eagerly"
)


# What torch.compiler.assume_constant_result does (torch/_dynamo/decorators.py), written out:
# that function imports torch._dynamo, and with it triton, which `import computectx` must not
# (tests/test_imports.py). Dynamo then runs the function at trace time and puts its result
# in the graph as a constant: no graph break, no guard, nothing run at execution.
delayed_quantize_in_compiled_checkpoint._dynamo_marked_constant = True  # type: ignore[attr-defined]
