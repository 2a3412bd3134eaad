"""The fused Adam/AdamW update on compact state: decode, torch's math in float32, encode.

``adam_update`` reads the parameter (float32, or a bf16/f16 master) and its gradient, decodes
the moments ``m`` and ``v`` (``Packed`` or plain float32 tensors), does exactly the
operations of ``torch.optim.Adam``/``AdamW``'s single-tensor path (``foreach=False``) in
float32, writes the parameter in place and returns the moments re-encoded (a plain tensor is
updated in place and returned). The same function ``_update`` runs eagerly or, with
``compiled=True``, through one ``torch.compile(fullgraph=True, dynamic=True)`` graph per
configuration (formats, kinds, flags), shared by every size: no Python loop over blocks.

The hyper-parameters enter as one float32 tensor (not Python floats, which the compiler
would specialize on: a recompile per learning rate or step). Each operation matches the
rounding of torch's own (``lerp_``, ``mul_``/``addcmul_``, ``sqrt``/``div``/``add_``,
``addcdiv_``), so the eager update equals torch's bit for bit on float32 state on the CPU
(tested), and its codes equal those of "decode, ``torch.optim`` step, encode". The ``aot_eager``
backend runs the same kernels (bit for bit, tested); inductor fuses and may contract into
FMAs, so it agrees to float32 ulps (measured with inductor on the CPU: parameter within
2.4e-7, the same codes, some block scales one ulp apart).

Tensors are plain local tensors (an FSDP2 caller passes each DTensor's local shard).

A bf16/f16 parameter with a ``generator`` is written with stochastic rounding
(``computectx.memory._rounding.stochastic_round_keyed``, from one key drawn from the
generator per parameter per step), applied eagerly to the float32 result after the compiled
region; without a generator it is rounded to nearest.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from computectx.memory._rounding import draw_key, stochastic_round_keyed
from computectx.memory.optim.state.maps import map_for, nearest_table
from computectx.memory.optim.state.packed import (
    Maps,
    Packed,
    Spec,
    decode_tensors,
    encode_tensors,
    maps_for,
    part_layout,
)
from computectx.optim_state import OptimState

__all__ = [
    "COMPILE_BACKEND",
    "NATIVE_MIN_PER_THREAD",
    "adam_update",
    "compiled_update",
    "native_cleared",
    "native_ready",
]

COMPILE_BACKEND = "inductor"
"""The ``torch.compile`` backend of ``compiled=True`` (tests set ``"aot_eager"``)."""

RECOMPILE_LIMIT = 64
"""Graphs kept per process for ``_update`` (one per configuration met)."""

NATIVE_MIN_PER_THREAD = 1 << 15
"""Elements per thread below which the native kernel uses fewer threads (one under 64K)."""


class _Config(NamedTuple):
    """The static facts of one update (one compiled graph per distinct value)."""

    m: Spec | None  # None: m is a plain float32 tensor, updated in place
    v: Spec | None
    weight_decay: bool
    decoupled: bool
    maximize: bool
    write_param: bool  # False: the float32 result is returned for stochastic rounding


# The hyper-parameters, in the order of the float32 tensor ``_update`` reads.
_DECAY, _WD, _ONE_MINUS_B1, _B2, _ONE_MINUS_B2, _BC2_SQRT, _EPS, _NEG_STEP = range(8)


def _update(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_in: tuple[torch.Tensor, ...],
    v_in: tuple[torch.Tensor, ...],
    m_maps: Maps,
    v_maps: Maps,
    hp: torch.Tensor,
    cfg: _Config,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """One Adam(W) step on one flat parameter; returns (f32 result or None, m parts, v parts).

    Every tensor is 1-D (one graph for every rank); a rank-1 moment's 2-D view is taken from
    its ``rows`` part.
    """
    numel = param.numel()
    p = param.float()
    g = grad.float()
    if cfg.maximize:
        g = -g
    m = m_in[0] if cfg.m is None else decode_tensors(m_in, cfg.m, m_maps, numel)
    v = v_in[0] if cfg.v is None else decode_tensors(v_in, cfg.v, v_maps, numel)
    if cfg.weight_decay:
        if cfg.decoupled:
            p = p * hp[_DECAY]  # param.mul_(1 - lr * weight_decay)
        else:
            g = torch.addcmul(g, p, hp[_WD])  # grad.add(param, alpha=weight_decay)
    m_new = torch.lerp(m, g, hp[_ONE_MINUS_B1])  # exp_avg.lerp_(grad, 1 - beta1)
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    v_new = torch.addcmul(v * hp[_B2], hp[_ONE_MINUS_B2] * g, g)
    denom = v_new.sqrt() / hp[_BC2_SQRT] + hp[_EPS]  # (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    p_new = p + hp[_NEG_STEP] * m_new / denom  # param.addcdiv_(exp_avg, denom, -step_size)
    stored: list[tuple[torch.Tensor, ...]] = []
    for new, old, spec, maps in ((m_new, m_in, cfg.m, m_maps), (v_new, v_in, cfg.v, v_maps)):
        if spec is None:  # a plain float32 moment, updated in place
            old[0].copy_(new)
            stored.append(old)
        else:  # a rank-1 moment is encoded from its 2-D view (rows from its ``rows`` part)
            stored.append(
                encode_tensors(new.view(old[1].numel(), -1) if spec.rank1 else new, spec, maps)
            )
    if cfg.write_param:
        param.copy_(p_new)
        return None, stored[0], stored[1]
    return p_new, stored[0], stored[1]


_COMPILED: dict[str, Callable[..., Any]] = {}


def compiled_update(backend: str | None = None) -> Callable[..., Any]:
    """``torch.compile(_update, fullgraph=True, dynamic=True)`` on ``backend`` (made once)."""
    key = backend or COMPILE_BACKEND
    fn = _COMPILED.get(key)
    if fn is None:
        fn = torch.compile(_update, fullgraph=True, dynamic=True, backend=key)
        _COMPILED[key] = fn
    return fn


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Contiguous ``t`` as a plain 1-D tensor on the same memory that is not a view of ``t``.

    A view would make the compiler guard on (and recompile for) its base's rank, and a
    ``Parameter`` on its type (another graph for a 1-D parameter than for the flattened
    view of a 2-D one).
    """
    if t.dim() == 1 and type(t) is torch.Tensor and not t._is_view():
        return t
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    return flat.set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))


class _Laid(NamedTuple):
    """A moment as the update reads it: its spec (``None``: plain float32), its parts in
    ``part_layout`` order (flat), their names, and its map."""

    spec: Spec | None
    parts: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    maps: Maps


@functools.lru_cache(maxsize=1024)
def _layout(
    fmt: str, kind: str, shape: torch.Size, block: int, rows: bool
) -> tuple[Spec, tuple[str, ...]]:
    """``spec_of`` and the part names of a ``Packed`` of these facts (cached: a step reads
    them without calling into the codec's modules)."""
    spec = Spec(fmt, kind == "signed", block, fmt == "int4" and rows)
    return spec, tuple(part_layout(spec, shape))


class _Kept(NamedTuple):
    """A ``Packed``'s lay-out by the last step, kept while its stamp is the same: a native
    step returns the ``Packed`` it was given (``_written_in_place``), so the next one lays out
    nothing."""

    stamp: tuple[Any, ...]
    parts: tuple[torch.Tensor, ...]  # held, so that the stamp's ids stay theirs
    laid: _Laid
    in_place: bool  # every part contiguous: the laid parts are its own memory


_KEPT: weakref.WeakKeyDictionary[Packed, _Kept] = weakref.WeakKeyDictionary()


def _stamp(x: Packed) -> tuple[Any, ...]:
    """``x``'s facts and its parts by identity and memory (which ``.data =`` or ``set_``
    change under the same tensor)."""
    parts = ((id(t), t.data_ptr(), t.dtype, t.shape, t.stride()) for t in x.parts.values())
    return (x.format, x.kind, x.shape, x.block, *parts)


def _lay_out(
    m: Packed | torch.Tensor, v: Packed | torch.Tensor, state: OptimState, param: torch.Tensor
) -> tuple[_Laid, _Laid]:
    """``m`` and ``v`` checked against ``param`` and ``state`` and laid out for ``_update``."""
    laid: list[_Laid] = []
    for name, x in (("m", m), ("v", v)):
        if isinstance(x, Packed):
            device = next(iter(x.parts.values())).device  # Packed.device, inline
            if x.shape != param.shape or device != param.device:
                raise ValueError(
                    f"adam_update: {name} is packed for shape {list(x.shape)} on {device}, "
                    f"but the parameter is {list(param.shape)} on {param.device}"
                )
            if x.format != state.format:
                raise ValueError(
                    f"adam_update: {name} is packed as {x.format}, but state says {state.format}"
                )
            kept = _KEPT.get(x)
            if kept is not None and kept.stamp == _stamp(x):
                laid.append(kept.laid)
                continue
            spec, names = _layout(x.format, x.kind, x.shape, x.block, "rows" in x.parts)
            parts = []
            for k in names:  # a loop, not a comprehension: the step reads ``packed`` once
                parts.append(x.parts[k])
            flat = tuple(_flat(t.contiguous()) for t in parts)
            laid.append(_Laid(spec, flat, names, maps_for(spec, device)))
            in_place = all(t.is_contiguous() for t in parts)
            _KEPT[x] = _Kept(_stamp(x), tuple(x.parts.values()), laid[-1], in_place)
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"adam_update: {name} must be a Packed or a tensor, got {type(x).__name__}"
            )
        if (
            x.dtype != torch.float32
            or x.shape != param.shape
            or x.device != param.device
            or not x.is_contiguous()
        ):
            raise ValueError(
                f"adam_update: plain {name} must be contiguous float32 of the parameter's "
                f"shape {list(param.shape)} on {param.device}, got {x.dtype}{list(x.shape)} "
                f"on {x.device}"
            )
        empty = torch.empty(0, device=x.device)
        laid.append(_Laid(None, (_flat(x.contiguous()),), (), Maps(empty, empty)))
    return laid[0], laid[1]


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: Packed | torch.Tensor,
    v: Packed | torch.Tensor,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    state: OptimState,
    generator: torch.Generator | None,
    compiled: bool,
    native: bool = False,
) -> tuple[Packed | torch.Tensor, Packed | torch.Tensor]:
    """One ``torch.optim.Adam`` (``decoupled=False``) / ``AdamW`` (``decoupled=True``) step.

    ``step`` is the step number after incrementing (1 on the first step), as torch's
    ``state["step"]``. ``param`` is updated in place; the new ``m`` and ``v`` are returned
    (packed as they came, in ``state``'s format; plain tensors, and a ``Packed`` of contiguous
    parts that the native kernel wrote, updated in place and returned themselves).

    ``native``: on the CPU, run the native kernel (``computectx.kernels.host_adam``) where it
    takes the configuration and builds, else the twin (``compiled`` as given).
    """
    if not param.is_floating_point() or param.dtype == torch.float64:
        raise ValueError(
            f"adam_update takes a float32, bfloat16 or float16 parameter, got {param.dtype}"
        )
    if grad.shape != param.shape or grad.device != param.device or not grad.is_floating_point():
        raise ValueError(
            f"adam_update: grad {grad.dtype}{list(grad.shape)} on {grad.device} does not "
            f"match the parameter {param.dtype}{list(param.shape)} on {param.device}"
        )
    if step < 1:
        raise ValueError(f"adam_update: step={step}; accepted: the step number, >= 1")
    m_laid, v_laid = _lay_out(m, v, state, param)
    rounds = param.dtype != torch.float32 and generator is not None
    cfg = _Config(m_laid.spec, v_laid.spec, weight_decay != 0, decoupled, maximize, not rounds)
    # Python floats as torch computes them (double), then float32 as its kernels read them.
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    values = [1 - lr * weight_decay, weight_decay, 1 - beta1, beta2, 1 - beta2, bc2**0.5, eps]
    # Made on the host and copied without blocking: ``torch.tensor(..., device=cuda)`` would
    # wait for the stream once per parameter per step.
    values.append(-(lr / bc1))
    key = None if generator is None or not rounds else draw_key(generator)
    if native and param.device.type == "cpu":
        stored = _native_update(param, grad, m_laid, v_laid, values, cfg, key)
        if stored is not None:
            if _written_in_place(m, m_laid, stored[0]) and _written_in_place(v, v_laid, stored[1]):
                return m, v  # the kernel wrote their own parts
            return _repacked(m, v, m_laid, v_laid, *stored)
    hp = torch.tensor(values, dtype=torch.float32).to(param.device, non_blocking=True)
    with torch.no_grad():
        work = param if param.is_contiguous() else param.contiguous()
        args = (
            _flat(work),
            _flat(grad.contiguous()),
            m_laid.parts,
            v_laid.parts,
            m_laid.maps,
            v_laid.maps,
            hp,
            cfg,
        )
        if compiled:
            # One graph per configuration (formats, kinds, flags, dtypes): more than dynamo's
            # default limit of 8 per function when many are in use in one process.
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                p_new, m_out, v_out = compiled_update()(*args)
        else:
            p_new, m_out, v_out = _update(*args)
        if p_new is not None:
            assert key is not None
            work.copy_(stochastic_round_keyed(p_new, param.dtype, key).view(param.shape))
        if work is not param:
            param.copy_(work)
    return _repacked(m, v, m_laid, v_laid, m_out, v_out)


def _written_in_place(x: Packed | torch.Tensor, laid: _Laid, out: tuple[torch.Tensor, ...]) -> bool:
    """Whether the kernel wrote ``x``'s own memory: its new parts are the laid ones (not a
    rank-1 moment's new rows and cols), and those are ``x``'s parts (all contiguous)."""
    if out is not laid.parts:
        return False
    if not isinstance(x, Packed):
        return True
    kept = _KEPT.get(x)
    return kept is not None and kept.in_place and kept.laid is laid


def _repacked(
    m: Packed | torch.Tensor,
    v: Packed | torch.Tensor,
    m_laid: _Laid,
    v_laid: _Laid,
    m_out: tuple[torch.Tensor, ...],
    v_out: tuple[torch.Tensor, ...],
) -> tuple[Packed | torch.Tensor, Packed | torch.Tensor]:
    """``m`` and ``v`` with their new parts (packed as they came; plain ones as they are)."""
    out: list[Packed | torch.Tensor] = []
    for x, lay, parts in ((m, m_laid, m_out), (v, v_laid, v_out)):
        if isinstance(x, Packed):  # the same layout, new parts
            if x.format == "bf16":
                parts = (parts[0].view(x.shape),)
            named = dict(zip(lay.names, parts, strict=True))
            out.append(Packed(x.format, x.kind, x.shape, x.block, named))
        else:
            out.append(x)
    return out[0], out[1]


# ----- the native CPU kernel -----------------------------------------------------------------


def native_ready() -> bool:
    """Whether the native CPU kernel runs here: built (or loaded) now, as the first native
    step would build it; ``False`` after ``host_adam``'s one ``RuntimeWarning`` (the twin
    runs), in a single process.

    Under ``torch.distributed`` with several ranks a failed build raises ``host_adam``'s
    ``RuntimeError`` instead (naming this rank and the compiler's error): the twin differs from
    the kernel in the last bits. A build can fail on one node only (no compiler there), so a
    multi-rank caller runs this where the ranks agree on every rank's checks before any of
    them steps (``Parallel.step`` agrees on the optimizer's ``check_step``): then every rank
    raises the same error, naming the rank, and none steps. Nothing here is a collective."""
    from computectx.kernels import host_adam

    return host_adam.library() is not None


def native_cleared(v: torch.Tensor) -> bool | None:
    """Whether every element of ``v`` is finite with a finite float32 square (``|v| <
    2**64``), by the native kernel's check (``host_adam.cleared``, on torch's threads); ``None``
    where it does not read ``v`` (not a plain contiguous CPU tensor of the kernel's dtypes: a
    tensor subclass, whose ``data_ptr`` need not be its elements', takes the torch ops) or
    could not be built: silently, as the caller has the exact torch condition."""
    from computectx.kernels import host_adam

    if (
        type(v) not in (torch.Tensor, torch.nn.Parameter)
        or v.device.type != "cpu"
        or v.dtype not in host_adam.PARAM_DTYPES
        or not v.is_contiguous()
    ):
        return None
    lib = host_adam.quiet_library()
    return None if lib is None else host_adam.cleared(lib, v, torch.get_num_threads())


@functools.cache
def _byte_table(fmt: str, signed: bool) -> torch.Tensor:
    """The nearest-entry table of the map of ``fmt`` (codes below 256) as uint8, on the CPU: a
    quarter of the int32 table's cache lines."""
    table = nearest_table(map_for(fmt, signed))
    assert table is not None
    return table.table.to(torch.uint8)


@functools.cache
def _fp8_values() -> torch.Tensor:
    """The float32 value of each of the 256 e4m3fn codes (the native kernel's fp8 map)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _native_moment(laid: _Laid, host: Any) -> tuple[Any, tuple[torch.Tensor, ...]] | None:
    """``laid`` as the kernel's ``Moment`` and the parts the kernel leaves (rank-1: its new
    rows and cols), or ``None`` where the kernel does not take it."""
    spec, parts, maps = laid.spec, laid.parts, laid.maps
    if spec is None:
        return host.Moment(host.PLAIN, True, 0, 0, parts[0]), parts
    if spec.format == "bf16":
        return host.Moment(host.BF16, spec.signed, 0, 0, parts[0]), parts
    if spec.format == "fp8":
        values, table = _fp8_values(), None
    elif maps.table is None or maps.bounds is None:
        return None  # no exact table: bucketize (the twin)
    else:
        values, table = maps.values, _byte_table(spec.format, spec.signed)
    lookup = {"map": values, "table": table, "bounds": maps.bounds}
    if spec.rank1:
        codes, rows, cols = parts
        new = (torch.empty_like(rows), torch.empty_like(cols))
        moment = host.Moment(
            host.RANK1, spec.signed, 0, rows.numel(), codes, rows, cols, *new, **lookup
        )
        return moment, (codes, *new)
    if spec.block % 2:
        return None  # an int4 byte would straddle two blocks (two threads)
    fmt = {"int8": host.INT8, "fp8": host.FP8, "int4": host.INT4}[spec.format]
    return host.Moment(fmt, spec.signed, spec.block, 0, parts[0], parts[1], **lookup), parts


def _native_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_laid: _Laid,
    v_laid: _Laid,
    values: list[float],
    cfg: _Config,
    key: torch.Tensor | None,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None:
    """The step by the native kernel on the hyper-parameters ``values`` (``_update``'s order):
    the moments' new parts, or ``None`` (nothing written) where it does not take
    this configuration or could not be built: the caller runs the twin (``host_adam.library``
    raises instead under ``torch.distributed`` with several ranks; ``native_ready``)."""
    from computectx.kernels import host_adam

    dtypes = host_adam.PARAM_DTYPES
    if param.dtype not in dtypes or grad.dtype not in dtypes:
        return None
    m_spec, v_spec = m_laid.spec, v_laid.spec
    blocks = {s.block for s in (m_spec, v_spec) if s is not None and s.block}
    if len(blocks) > 1:
        return None
    lib = host_adam.library()
    if lib is None:
        return None
    laid = [_native_moment(x, host_adam) for x in (m_laid, v_laid)]
    if laid[0] is None or laid[1] is None:
        return None
    hp = list(values)
    if not (cfg.weight_decay and cfg.decoupled):
        hp[_DECAY] = 1.0  # the kernel multiplies by it unless the decay is L2 (exact: p * 1)
    numel = param.numel()
    threads = max(1, min(torch.get_num_threads(), numel // NATIVE_MIN_PER_THREAD))
    with torch.no_grad():
        work = param if param.is_contiguous() else param.contiguous()
        host_adam.step(
            lib,
            work,
            grad.contiguous(),
            laid[0][0],
            laid[1][0],
            hp,
            l2=cfg.weight_decay and not cfg.decoupled,
            maximize=cfg.maximize,
            key=None if key is None else int(key),
            threads=threads,
        )
        if work is not param:
            param.copy_(work)
    return laid[0][1], laid[1][1]
