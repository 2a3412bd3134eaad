"""What an op keeps for its backward, as ``ComputeCtx.activations`` says: the one mechanism.

``saved_call(f, x, *operands, mode=..., group=...)`` is ``f(x, *operands)`` whose backward keeps
only ``x`` and the ``operands``, never ``f``'s internals (``inputs=2``: the first two tensors
are activations kept as ``mode`` says, as SwiGLU's gate and up):

- ``keep``: ``f`` runs as any code does; autograd keeps what its ops save (today's behaviour).
- ``recompute``: ``x`` is kept as it arrived; the backward runs ``f`` again on it.
- ``fp8``: ``x`` is kept as E4M3 codes with one float32 scale per ``group`` consecutive
  elements of a row (1x128 along its last dimension: COAT's per-group, arXiv 2410.19313; never
  across rows, so a token codes alike in any batch); the backward
  runs ``f`` again on the decoded ``x``, so the gradient is ``f``'s exact vjp at a point within
  half an E4M3 step (relative ``2**-4``) of ``x``, elementwise. Only float32, bfloat16 and
  float16 are coded (``CODED_DTYPES``): an ``x`` of any other dtype (float64, whose range a
  float32 scale does not cover; complex; integer ids) is kept as it is, as ``recompute``.

The backward is ``f``'s vjp at the kept point: ``torch.autograd.grad`` of ``f`` run again in
eager mode, ``torch.func.vjp`` when dynamo traces it, so the whole call, forward and backward,
compiles with ``torch.compile(fullgraph=True)`` (``torch.autograd.grad`` inside a backward, and
saved-tensor hooks entered inside a compiled region, do not; a compiled call under
saved-tensor hooks entered outside it is refused by ``torch.func``: a known limit). ``f``
runs twice: in eager mode the second run sees the CPU's and the inputs' device's random
states of the first (a dropout draws the same mask, as under ``torch.utils.checkpoint``);
under dynamo it does not, so a compiled ``f`` must be deterministic. ``f`` must receive
every tensor that needs a gradient as an operand: a tensor it reaches otherwise would get
none. In eager mode that is refused (``ValueError``) at the call for a tensor in ``f``'s
closure cells, defaults or a partial's arguments, and exactly by the backward, which walks
the graph of ``f`` run again for any other leaf needing a gradient; under dynamo neither
runs (docs/activations.md).
Inside an activation-checkpointed region what this call keeps is dropped and recomputed like
anything else: the codes are a function of ``x``, so the recomputation keeps the same bytes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Final, TypeGuard, TypeVar

import torch
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.utils.checkpoint import _infer_device_type, get_device_states, set_device_states

from computectx.activations import ACTIVATION_KINDS, GROUPS, SAVE_MODES, ActivationKind, SaveMode
from computectx.dtypes import FLOAT_DTYPES, Fp8Format
from computectx.offload import offload, offload_streams

__all__ = [
    "CODED_DTYPES",
    "E4M3_MAX",
    "SAVING",
    "decode_groups",
    "encode_groups",
    "kept_back",
    "offload_kept",
    "refuse_double_backward",
    "saved_call",
    "tagged",
]

_T = TypeVar("_T")

SAVING: Final[ContextVar[ActivationKind | None]] = ContextVar("computectx_saving", default=None)
"""The kind of activation whose tensors autograd is saving now (``None``: no op said), set by
``saved_call(kind=...)`` and ``ctx.precise`` around their forward, so that a saved-tensor
hook counting bytes (``computectx.memory.SavedActivations``) can attribute each to its kind.
Not set while dynamo traces (a compiled graph's saves have no kind)."""

E4M3_MAX: Final = Fp8Format.E4M3.max
"""The largest finite E4M3 magnitude: each group's scale is ``absmax / 448``."""
CODED_DTYPES: Final = FLOAT_DTYPES
"""The dtypes ``fp8`` codes (float32 scales cover their range); an input of any other (float64,
complex, integer, bool) is kept as it is under ``fp8``, as under ``recompute``."""
_TINY: Final = torch.finfo(torch.float32).tiny
_POS_NAN, _NEG_NAN = 0x7F, 0xFF  # E4M3's two NaN codes: an infinity of each sign


def _row_group(shape: torch.Size, group: int) -> int:
    """The elements one scale covers for a tensor of ``shape``: ``group`` along the last
    dimension, or the whole row where the rows are shorter (RoPE's heads of 32, a router's
    few experts). A group never spans two rows, so what a row decodes to depends on that row
    alone: a batch split across ranks (DDP, FSDP2, expert parallelism), into micro-batches or
    through an MoE's token permutation codes every token as the whole batch does."""
    width = shape[-1] if len(shape) else 1
    return max(1, min(group, width))


def encode_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as E4M3 codes ``(groups, g)`` and float32 scales ``(groups,)``, one per ``g``
    consecutive elements of a row (``g = _row_group(x.shape, group)``): 1x``group`` along the
    last dimension, as COAT's 1x128, each row's last group zero-padded where ``group`` does
    not divide the row; one group per row where the rows are shorter than ``group``.

    A group's scale is ``absmax / 448`` over its finite elements (the ``fp8`` optimizer
    state's rule), rounded to float32, so its largest finite element codes to ±448 and none
    saturates; a group with no finite non-zero element gets the scale 1. That element decodes
    as ``448 * scale``: itself for bfloat16 and float16 inputs, within one float32 ulp of
    itself (relative ``2**-23``) for float32 inputs, where the scale's rounding shows. A scale
    under float32's smallest normal is raised to it (a group whose absmax is under ``448 *
    2**-126``, about 5.3e-36): no division by zero or by a subnormal, and that group's largest
    element rounds as any other (within half an E4M3 step). Infinities (an attention mask's
    -inf) keep their sign: they are stored as E4M3's NaN codes with that sign bit (0x7F, 0xFF)
    and decode as ±inf; a NaN element decodes as an infinity too (non-finite either way)."""
    g = _row_group(x.shape, group)
    width = x.shape[-1] if x.dim() else 1
    rows = x.reshape(x.numel() // max(width, 1), width).to(torch.float32)
    per_row = -(-width // g)
    grouped = torch.nn.functional.pad(rows, (0, per_row * g - width)).reshape(-1, g)
    finite = torch.isfinite(grouped)
    values = torch.where(finite, grouped, torch.zeros_like(grouped))
    amax = values.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, (amax / E4M3_MAX).clamp_min(_TINY), torch.ones_like(amax))
    # The clamp only takes rounding's last ulp off the largest element of a group.
    bits = (values / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    infinite = torch.where(torch.signbit(grouped), _NEG_NAN, _POS_NAN).to(torch.uint8)
    codes = torch.where(finite, bits, infinite).view(torch.float8_e4m3fn)
    return codes, scale.squeeze(-1)


def decode_groups(
    codes: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor ``encode_groups`` coded, as ``shape`` and ``dtype``: ``code * scale`` in
    float32 (rounded: an E4M3 value times a float32 scale may need 4 + 24 bits), then to
    ``dtype``; a NaN code as the infinity of its sign."""
    if shape.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=codes.device)
    values = codes.to(torch.float32) * scale.unsqueeze(-1)
    inf = torch.full_like(values, math.inf)
    signed = torch.where(codes.view(torch.uint8) > 127, -inf, inf)
    values = torch.where(values.isnan(), signed, values)
    width = shape[-1] if len(shape) else 1
    rows = values.reshape(shape.numel() // width, -1)
    return rows[:, :width].to(dtype).reshape(shape)


def saved_call(
    f: Callable[..., torch.Tensor],
    *tensors: torch.Tensor,
    mode: SaveMode,
    group: int = 128,
    inputs: int = 1,
    kind: ActivationKind | None = None,
) -> torch.Tensor:
    """``f(*tensors)``, its backward keeping the first ``inputs`` tensors (the activations) as
    ``mode`` says and the rest (the operands: weights, tables) as they are (module docstring).

    ``kind`` tags what the call saves (``SAVING``), whatever the mode. Without a graph to
    build (grad disabled, or nothing needing a gradient) ``f`` just runs. The arguments are
    checked first, on every path, whatever the mode: a ``mode`` not in ``SAVE_MODES`` (spelled
    as they are, as the ``SaveMode`` type and ``ctx.activations``' fields hold them: the
    policy's text form reads any case, this does not), a ``group`` not in ``GROUPS`` (16,
    32, 64, 128), ``inputs`` not between 1 and the number of tensors, or a ``kind`` neither
    ``None`` nor in ``ACTIVATION_KINDS`` is a ``ValueError``, before ``f`` runs. A double
    backward (``create_graph=True``) through a mode other than ``keep`` is a
    ``RuntimeError`` naming ``'KIND:keep'`` (``refuse_double_backward``)."""
    _check_arguments(len(tensors), mode, group, inputs, kind)
    if kind is None:
        return _saved_call(f, tensors, mode, group, inputs)
    return tagged(kind, _saved_call, f, tensors, mode, group, inputs)


def tagged(kind: ActivationKind, f: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``f(*args, **kwargs)``, what autograd saves meanwhile attributed to ``kind`` (``SAVING``; not
    under dynamo: a compiled graph's saves carry no kind). For paths that may enter this
    module; a hot path with a module budget (the MoE forward) sets ``SAVING`` itself."""
    if torch.compiler.is_compiling():
        return f(*args, **kwargs)
    token = SAVING.set(kind)
    try:
        return f(*args, **kwargs)
    finally:
        SAVING.reset(token)


def _check_arguments(
    tensors: int, mode: object, group: object, inputs: object, kind: object
) -> None:
    if mode not in SAVE_MODES:
        raise ValueError(
            f"saved_call: unknown save mode {mode!r}; accepted: {', '.join(SAVE_MODES)} "
            "(as spelled: the SaveMode values)"
        )
    if not _is_int(group) or group not in GROUPS:
        accepted = ", ".join(map(str, GROUPS))
        raise ValueError(
            f"saved_call: group={group!r} is not one of {accepted} (elements per fp8 group)"
        )
    if not _is_int(inputs) or not 1 <= inputs <= tensors:
        raise ValueError(f"saved_call: inputs={inputs!r} of {tensors} tensors (1 to {tensors})")
    if kind is not None and kind not in ACTIVATION_KINDS:
        accepted = ", ".join(ACTIVATION_KINDS)
        raise ValueError(f"saved_call: unknown activation kind {kind!r}; accepted: {accepted}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _saved_call(
    f: Callable[..., torch.Tensor],
    tensors: tuple[torch.Tensor, ...],
    mode: SaveMode,
    group: int,
    inputs: int,
) -> torch.Tensor:
    if mode == "keep" or not torch.is_grad_enabled():
        return f(*tensors)
    if not any(t.requires_grad for t in tensors):
        return f(*tensors)
    if not torch.compiler.is_compiling():
        _check_closure(f)
    y: torch.Tensor = _SavedCall.apply(f, mode, group, inputs, *tensors)  # type: ignore[no-untyped-call]
    return y


class _SavedCall(torch.autograd.Function):
    """``f(*tensors)`` keeping the inputs (as they are or as fp8 groups) and the operands."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        f: Callable[..., torch.Tensor],
        mode: SaveMode,
        group: int,
        inputs: int,
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        c: Any = ctx
        c.rng = None if torch.compiler.is_compiling() else _rng_state(tensors)
        y = f(*tensors)
        c.f, c.mode, c.kind = f, mode, None if torch.compiler.is_compiling() else SAVING.get()
        # Under fp8 each coded input is kept as its codes and scales, in turn; under offload
        # each moved one as a handle on its host copy (outside save_for_backward); any other
        # (recompute, a dtype fp8 does not code, a CPU tensor) as it is.
        c.coded = [mode == "fp8" and x.dtype in CODED_DTYPES for x in tensors[:inputs]]
        c.like = [(x.shape, x.dtype) for x in tensors[:inputs]]
        streams = _offload_streams(tensors[0]) if mode == "offload" else None
        c.moved = [None if streams is None else offload(x, streams, ctx) for x in tensors[:inputs]]
        kept = [
            part
            for x, coded, moved in zip(tensors[:inputs], c.coded, c.moved, strict=True)
            for part in (encode_groups(x, group) if coded else () if moved else (x,))
        ]
        ctx.save_for_backward(*kept, *tensors[inputs:])
        c.autocast = _autocast_state(tensors[0].device.type)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refuse_double_backward(ctx.kind, ctx.mode)
        return _SavedCall.first_order(ctx, dy)

    @staticmethod
    @once_differentiable
    def first_order(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        xs = [
            moved.fetch()
            if moved is not None
            else decode_groups(next(saved), next(saved), *like)
            if coded
            else next(saved)
            for coded, like, moved in zip(ctx.coded, ctx.like, ctx.moved, strict=True)
        ]
        operands = list(saved)
        needs = ctx.needs_input_grad[4:]
        with _autocast(ctx.autocast):
            if torch.compiler.is_compiling():  # what dynamo traces in a backward
                grads = tuple(_vjp(ctx.f, [*xs, *operands], dy))
            else:
                with _rng_restored(ctx.rng):
                    grads = _recomputed_grads(ctx.f, [*xs, *operands], needs, dy)
        return (None,) * 4 + tuple(g if n else None for g, n in zip(grads, needs, strict=True))


def refuse_double_backward(kind: str | None, mode: str, *, fp8_gemm: bool = False) -> None:
    """For the backward of an ``autograd.Function`` that keeps its input as ``mode`` says: a
    ``RuntimeError`` naming ``'KIND:keep'`` when it runs with grad enabled (a double backward,
    ``create_graph=True``: a gradient penalty) and ``mode`` is not ``keep``. Under ``fp8``,
    ``recompute`` and ``offload`` the backward works from what it kept outside the graph
    (E4M3 codes, a host copy, ``f`` run again, a softmax's output), so the second-order term
    through it would be lost; on a CPU, where offload keeps the input as it is, it is refused
    all the same (one behaviour on every device). Nothing in a first-order backward, under
    ``keep`` or while compiling (dynamo traces the backward: ``saved_call``'s compiles).
    ``fp8_gemm``: an fp8 GEMM's backward (``QuantizedLinear``, the fp8 experts), first-order
    under ``keep`` too (its fp8 operands carry no graph: the second-order term was lost
    silently before), refused under every mode."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    if mode == "keep" and not fp8_gemm:
        return
    if mode == "keep":
        raise RuntimeError(_FP8_GEMM_KEEP)
    message = _DOUBLE_BACKWARD.format(kind=kind or "KIND")
    raise RuntimeError(message + (_FP8_GEMM if fp8_gemm else ""))


def offload_kept(ctx: Any, kept: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """For a custom ``autograd.Function``'s forward under ``offload`` (``linear: offload``):
    ``kept`` moved to host memory when its device has streams (``computectx.offload``:
    ``ctx.moved`` holds the handles, in the current block), and nothing left for
    ``save_for_backward``; else (a CPU tensor, compiled) ``kept`` itself, to save. The
    backward reads it back through ``kept_back``."""
    streams = _offload_streams(kept[0]) if kept else None
    ctx.moved = None if streams is None else [offload(t, streams, ctx) for t in kept]
    return kept if streams is None else ()


def kept_back(ctx: Any, saved: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """In the backward: what ``offload_kept`` kept, ``saved`` (its part of ``saved_tensors``)
    or its tensors brought back to the device."""
    moved = getattr(ctx, "moved", None)
    return saved if moved is None else tuple(m.fetch() for m in moved)


def _offload_streams(x: torch.Tensor) -> Any:
    # Compiled, offload keeps its inputs on the device, as recompute (module docstring).
    return None if torch.compiler.is_compiling() else offload_streams(x.device)


def _vjp(
    f: Callable[..., torch.Tensor], tensors: list[torch.Tensor], dy: torch.Tensor
) -> list[torch.Tensor | None]:
    # torch.func.vjp over the floating (and complex) tensors only: an integer one (ids)
    # cannot require a gradient; it gets none, as in eager mode.
    wrt = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]

    def at(*differentiated: torch.Tensor) -> torch.Tensor:
        args = list(tensors)
        for i, t in zip(wrt, differentiated, strict=True):
            # A view, not the primal itself: dynamo (torch 2.13) records a primal's
            # requires_grad as it was before torch.func made it differentiable, so a custom
            # autograd.Function in f handed the primal read needs_input_grad False and gave
            # no gradient (silently: Gemm's upcast matmul lost dq and dv). A view is recorded
            # after, as anything f computes from it (tests/test_saved.py).
            args[i] = view = t.view_as(t)
            if not view.requires_grad:  # read when traced: never a silent wrong gradient
                raise RuntimeError(_UNTRACKED)
        return f(*args)

    found = iter(torch.func.vjp(at, *(tensors[i] for i in wrt))[1](dy))
    return [next(found) if i in wrt else None for i in range(len(tensors))]


def _recomputed_grads(
    f: Callable[..., torch.Tensor], tensors: list[torch.Tensor], needs: tuple[bool, ...], dy: Any
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``f`` at ``tensors`` (those ``needs`` asks for) by running it again.

    ``torch.autograd.grad`` rather than ``torch.func.vjp``, which refuses to run under
    saved-tensor hooks (``save_on_cpu`` or a counter around the forward and backward). Identity
    hooks on top hide this transient graph from such outer hooks: it lives for this call only
    and is no activation the forward kept."""
    leaves = [t.detach().requires_grad_(n) for t, n in zip(tensors, needs, strict=True)]
    wanted = [t for t in leaves if t.requires_grad]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
        y = f(*leaves)
        _check_reached(y, wanted)
        found = iter(torch.autograd.grad(y, wanted, dy, allow_unused=True))
    return tuple(next(found) if t.requires_grad else None for t in leaves)


def _check_reached(y: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    """Refuse an ``f`` whose output, run again on detached ``leaves``, depends on any other
    tensor needing a gradient (however ``f`` reached it: a closure, a default argument, a
    partial's keyword, a container, an object's attribute, a global): that tensor's
    gradient would be lost. Exact: it walks the graph ``f`` just built."""
    mine = {id(t) for t in leaves}
    seen: set[int] = set()
    todo = [y.grad_fn] if y.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf
        if isinstance(variable, torch.Tensor) and id(variable) not in mine:
            where = f"a tensor of shape {tuple(variable.shape)}"
            raise ValueError(_CLOSURE_ERROR.format(where=where))
        todo += [next_node for next_node, _ in node.next_functions if next_node is not None]


_RngState = tuple[torch.Tensor, str, list[int], list[torch.Tensor]]


def _rng_state(tensors: tuple[torch.Tensor, ...]) -> _RngState:
    # The CPU's and the tensors' device's random states at the forward, so that f run again
    # draws the same numbers (a dropout's mask), as torch.utils.checkpoint does.
    device_type: str = _infer_device_type(*tensors)  # type: ignore[no-untyped-call]
    devices, states = get_device_states(*tensors)
    return torch.get_rng_state(), device_type, devices, states


@contextlib.contextmanager
def _rng_restored(state: _RngState | None) -> Iterator[None]:
    if state is None:
        yield
        return
    cpu, device_type, devices, states = state
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.set_rng_state(cpu)
        if devices:
            set_device_states(devices, states, device_type=device_type)
        yield


def _same(t: Any) -> Any:
    return t


def _autocast_state(device: str) -> tuple[str, torch.dtype] | None:
    # The forward's autocast, for the backward's run of f (the engine does not carry it).
    return (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None


def _autocast(state: tuple[str, torch.dtype] | None) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if state is None else torch.autocast(state[0], dtype=state[1])


_DOUBLE_BACKWARD: Final = (
    "a double backward (create_graph=True) through an activation kept as fp8, recompute or "
    "offload is not supported: its backward works from what it kept outside the graph (E4M3 "
    "codes, a host copy, the op run again from its input, a softmax's output), so the "
    "second-order term through it would be lost; where gradients of gradients are taken, keep "
    "that kind: ctx.activations '{kind}:keep'"
)

_FP8_GEMM_KEEP: Final = (
    "a double backward (create_graph=True) through a quantized GEMM (QuantizedLinear, fp8 "
    "experts, Fp4Linear, 4-bit experts) is not supported: its backward works from fp8 or "
    "4-bit operands outside the graph, so the "
    "second-order term would be lost; take such gradients through high-precision linears "
    "(leave these layers out of convert_to_quantized with module_filter)"
)

_FP8_GEMM: Final = (
    "; a quantized GEMM's backward (QuantizedLinear, fp8 experts, Fp4Linear, 4-bit experts) is "
    "first-order under keep too: "
    "take such gradients through high-precision linears"
)

_UNTRACKED: Final = (
    "saved_call under torch.compile: dynamo traced an argument of f as needing no gradient "
    "inside torch.func.vjp, so a custom autograd.Function in f would give it none (this torch "
    "records requires_grad differently from 2.13); run this kind eager or keep it "
    "(ctx.activations 'KIND:keep')"
)

_CLOSURE_ERROR: Final = (
    "the function kept by saved_call or ctx.precise closes over {where}, which needs a "
    "gradient and is not one of its arguments; the backward, which runs it again, would give "
    "that tensor none. Pass it as an operand: ctx.precise(x, f, w) with f(x, w), or "
    "saved_call(f, x, w, ...)"
)


def _check_closure(f: Callable[..., torch.Tensor]) -> None:
    """Refuse early an ``f`` that visibly closes over a tensor needing a gradient (a closure
    cell, a partial's argument or keyword, a default argument). Modules are not looked into:
    ``f`` may read ``self.eps`` and take ``self.weight`` as an operand; the backward's graph
    walk (``_check_reached``) is the exact check, whatever the route."""
    for where, value in _captured(f, depth=3):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise ValueError(_CLOSURE_ERROR.format(where=where))


def _captured(f: object, depth: int) -> Iterator[tuple[str, object]]:
    # What f can reach without being given it: its bound self, its closure cells and a
    # functools.partial's bound arguments, and so on for the functions among them (a few
    # levels: ctx.precise wraps the caller's f in one of its own).
    found: list[tuple[str, object]] = []
    bound = getattr(f, "__self__", None)
    if bound is not None:
        found.append(("its bound self", bound))
    inner = getattr(f, "func", None)
    if inner is not None:
        found += [("a partial's function", inner)]
        found += [(f"partial argument {i}", a) for i, a in enumerate(getattr(f, "args", ()))]
        keywords = getattr(f, "keywords", None) or {}
        found += [(f"partial keyword {k!r}", a) for k, a in keywords.items()]
    defaults = [*(getattr(f, "__defaults__", None) or ())]
    defaults += (getattr(f, "__kwdefaults__", None) or {}).values()
    found += [("a default argument", a) for a in defaults]
    names = getattr(getattr(f, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, getattr(f, "__closure__", None) or (), strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            found.append((f"the variable {name!r}", cell.cell_contents))
    for where, value in found:
        yield where, value
        if depth > 1 and callable(value) and not isinstance(value, torch.nn.Module):
            yield from _captured(value, depth - 1)
