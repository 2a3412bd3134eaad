"""``Fp4Experts``: what grouped experts run their GEMMs with under a 4-bit recipe (NVFP4,
MXFP4; ``ctx.recipe`` an ``Fp4Recipe``), the twin of the fp8 ``QuantizedExperts``: the same
``mm(x, w, offs, save)``, so an experts module calls it as it calls fp8's (``ExpertsGemm``).

Group ``g`` (rows ``offs[g-1]:offs[g]``, ``offs[-1]`` read as 0) is ``Fp4Linear`` with weight
``w[g]`` on those rows alone, GEMM for GEMM (``linear.fp4``: TransformerEngine's operands)::

    GEMM  a                                        b
    Y     X_g, 1x16 along K, nearest               W[g] at the weight tile, nearest
    dX    dY_g, 1x16 along N, stochastic           W[g]ᵀ at the weight tile
    dW    dY_gᵀ col, Hadamard along M_g, stoch.    X_gᵀ col, Hadamard along M_g, nearest

through ``computectx::fp4_grouped_mm`` and ``fp4_grouped_wgrad``: each group's operands take
their own amax, the wgrad's are zero-padded and Hadamard-transformed per group, an empty group
reads nothing of its expert (no rows, a zero ``dW[g]``), rows past ``offs[-1]`` come out zero.
A weight FSDP2 gathered in 4 bits (``linear.fp4_gathered.Fp4GatheredExperts``: every expert's
operands, as the grouped GEMM makes them) is multiplied with as it came, forward and dgrad,
through ``computectx::fp4_grouped_mm_gathered``: the same bits, nothing of it quantized again.

**What is bit-equal** (``tests/formats/linear/test_fp4_experts.py``): with stochastic
rounding off, ``Y``'s rows, ``dX``'s rows and ``dW[g]`` of group ``g`` are ``Fp4Linear``'s
on those rows, bit for bit. With it on, the same given the same bits: a call keyed ``[word,
C]`` (the stream's word: ``Fp4Linear``'s on the same stream) (for ``x [M, K]``, ``w [E, N,
K]``) draws group ``g``'s ``dY_g`` at counter ``C + start_g·N`` (the bits one quantize of
the whole ``dY`` draws) and its ``dY_gᵀ`` at ``C + M·N + N·Σ_{h<g} pad(m_h)``, ``pad``
rounding up to 16 rows (NVFP4; 32 for MXFP4): an ``Fp4Linear`` whose counter puts its own
draw there gives the same ``dX`` and ``dW[g]``. With one group of all the rows that is
``Fp4Linear`` at counter ``C`` exactly. Nothing here is by bound; against the bf16 GEMM each
group is within the dense twin's bound (``numerics.fp4_gemm.fp4_mm_error_bound``), and
against one 4-bit GEMM of the whole batch (one amax for all rows) it differs by the 4-bit
noise, by design.

**The counter** (``sr_key``, int64 ``[seed, counter]``) is plain CPU state, never a buffer
(``Fp4Linear``'s rule: DDP would broadcast a buffer). It advances at every call that can run a
backward (grad enabled, ``recipe.stochastic``) by ``N·(M + Σ_g pad(m_g))``, computed from
``offs`` by tensor ops (no ``.tolist()``: a compiled caller recompiles neither as group sizes
nor as the counter change), by a new tensor, never in place; a replayed call (a non-reentrant
checkpoint's recomputation) advances nothing, its backward reading the original call's key.
It is this module's ``_extra_state`` (``[version, recipe code, seed, counter, stream]``,
``Fp4Linear``'s layout), so a converted experts module's state dict holds it
(``experts.fp8._extra_state`` for ``computectx.nn.GroupedExperts``) and a resumed run draws
the same bits; one saved under another 4-bit recipe or seed, or a counter outside ``[0,
FP4_COUNTER_LIMIT)``, raises ``ValueError`` before anything loads.

**What the backward keeps**: ``x`` as it is (for the wgrad's per-group ``Xᵀ`` operands),
under ``linear: keep`` and ``fp8`` alike (E4M3 rows would change the 4-bit operands: ``dW``
would no longer be ``Fp4Linear``'s); under ``offload`` in host memory; nothing of ``x`` when
``w`` needs no gradient. A double backward raises (the 4-bit operands carry no graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from computectx._checks import as_int
from computectx.activations import SaveMode
from computectx.formats.linear.fp4 import fp4_quant
from computectx.formats.linear.fp4_counter import (
    FP4_COUNTER_LIMIT,
    CounterLoads,
    check_stream,
    fp4_key,
    replays_a_call,
    saved_counter,
)
from computectx.formats.linear.fp4_gathered import Fp4ExpertsGather, Fp4GatheredExperts
from computectx.formats.numerics.fp4_gemm import Fp4Quant, wgrad_row_multiple
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.ops.fp4_grouped_gathered import grouped_mm_gathered
from computectx.formats.ops.grouped import check_grouped, outside_autocast
from computectx.formats.policy import describe
from computectx.formats.scaling.load import guard_whole_loads
from computectx.fp4_recipe import Fp4Recipe
from computectx.saved import kept_back, offload_kept, refuse_double_backward

__all__ = ["FRAME_READ_EAGERLY", "ExpertsGemm", "Fp4Experts", "experts_draw_frame"]

_FRAME: ContextVar[tuple[torch.Tensor, int] | None] = ContextVar("fp4_experts_frame", default=None)
_OPEN_FRAMES = 0
"""How many draw frames are open (any thread): a module global, so compiled code guards on it
(``_framed_keys``) and is recompiled, with the frame read eagerly, while one is open."""

FRAME_READ_EAGERLY = (
    "a 4-bit experts call inside experts_draw_frame (expert parallelism's dispatch) reads "
    "the frame's whole-batch counts on the host: compile with fullgraph=False (the frame is "
    "read eagerly there) or compile the blocks around the MoE rather than the experts"
)
"""Why ``torch.compile(..., fullgraph=True)`` of an experts module refuses a call in a frame."""


def _check_frame(counts: object, first: object) -> tuple[torch.Tensor, int]:
    if (
        not isinstance(counts, torch.Tensor)
        or counts.dtype != torch.int64
        or counts.dim() != 1
        or counts.device.type != "cpu"
    ):
        got = (
            f"a {counts.dtype} tensor of shape {tuple(counts.shape)} on {counts.device}"
            if isinstance(counts, torch.Tensor)
            else type(counts).__name__
        )
        raise ValueError(f"experts_draw_frame takes int64 CPU counts of shape (E,), got {got}")
    at = as_int(first)  # a Python or numpy integer; not a bool, a float or a tensor
    if at is None:
        raise TypeError(
            f"experts_draw_frame: first (the index of the call's first expert) must be an "
            f"int, got {type(first).__name__}"
            + ("" if isinstance(first, torch.Tensor) else f" {first!r}")
        )
    if not 0 <= at < counts.numel():
        raise ValueError(f"experts_draw_frame: first {at} outside [0, {counts.numel()})")
    rows = counts.tolist()
    low = min(rows, default=0)
    if low < 0 or sum(rows) >= FP4_COUNTER_LIMIT:
        raise ValueError(
            "experts_draw_frame: counts hold rows per expert, each >= 0 and in all below "
            "2**61 (FP4_COUNTER_LIMIT), got "
            + (f"{low} rows for expert {rows.index(low)}" if low < 0 else f"{sum(rows)} in all")
        )
    return counts.clone(), at


@contextlib.contextmanager
def experts_draw_frame(counts: torch.Tensor, first: int) -> Iterator[None]:
    """While active, every ``Fp4Experts.mm`` call draws as a slice of a larger experts
    module: ``counts`` (int64 CPU ``(E,)``) the rows of each of the whole module's ``E``
    experts over the whole batch, ``first`` the index of the call's first expert (its ``w
    [E_local, N, K]`` are experts ``first .. first + E_local - 1``, its ``offs`` their rows,
    in the whole batch's order). Group ``g`` then draws the bits one call on the whole batch
    draws for those rows (``dY`` at ``C + N·Σ_{h<first+g} m_h``, ``dYᵀ`` at ``C + M·N + N·Σ
    pad(m_h)``, ``M`` the whole batch's rows), and the counter advances by the whole call's
    ``N·(M + Σ pad(m_h))``, the same on every rank that holds a slice: expert parallelism's
    ``AllToAllDispatch`` sets it, so 4-bit experts spread over ranks draw one process's bits.
    A compiled call honours it too (the frame is read eagerly: a graph break there;
    ``fullgraph=True`` refuses, naming ``FRAME_READ_EAGERLY``).

    Refused at entry (nothing changed): counts not an int64 CPU ``(E,)`` tensor, a negative
    count or counts summing to ``FP4_COUNTER_LIMIT`` or more (``ValueError``), ``first`` not
    an int (``TypeError``; numpy ints are ints, ``bool`` is not) or outside ``[0, E)``. A
    call whose group sizes are not ``counts[first:first + E_local]``, or whose advance would
    take the counter to ``FP4_COUNTER_LIMIT`` or past, raises ``ValueError`` (nothing drawn,
    the counter unmoved)."""
    global _OPEN_FRAMES
    frame = _check_frame(counts, first)
    token = _FRAME.set(frame)
    _OPEN_FRAMES += 1
    _read_eagerly()
    try:
        yield
    finally:
        _OPEN_FRAMES -= 1
        _FRAME.reset(token)


def _padded(counts: torch.Tensor, multiple: int) -> torch.Tensor:
    return (counts + (multiple - 1)).div(multiple, rounding_mode="floor") * multiple


def _framed_keys(
    key: torch.Tensor, offs: torch.Tensor, m: int, n: int, multiple: int, replaying: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The dX key, the wgrad key (``None``: the backward's ``C + M·N``) and the counter's
    advance of one call: its own (no frame) or the frame's whole call's; no advance
    (``None``) for a ``replaying`` call outside a frame, which advances nothing."""
    # A global, so a compiled caller guards on it: traced with no frame open, it recompiles
    # when one opens, and the frame is then read eagerly (_frame_keys: a graph break).
    if _OPEN_FRAMES:
        framed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
        framed = _FRAME_KEYS[0](key, offs, n, multiple)
        if framed is not None:
            return framed
    # Tensor ops, no .tolist(): a compiled caller recompiles neither as group sizes nor
    # as the counter change. The .cpu() reads the advance to the host (a device sync on
    # a GPU): the counter is CPU state and its advance depends on the group sizes, which
    # only offs holds, on its device. It is no new stall: the 4-bit grouped operators read
    # offs on the host anyway (ops.grouped.checked_bounds, each quantize launched per
    # group), and this read comes before the GEMMs are enqueued, so the operator's own
    # read then finds little left queued.
    if replaying:  # a replay advances nothing: no read of its advance (a device sync)
        return key, None, None
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).to(torch.int64)
    return key, None, (n * (m + _padded(counts, multiple).sum())).reshape(1).cpu()


def _read_eagerly() -> None:
    # torch.compiler.disable imports torch._dynamo (and with it triton): done when the first
    # frame opens (always eager: before any call that reads a frame), never at import.
    if _FRAME_KEYS[0] is _frame_keys:
        _FRAME_KEYS[0] = torch.compiler.disable(  # type: ignore[no-untyped-call]
            _frame_keys, reason=FRAME_READ_EAGERLY
        )


def _frame_keys(
    key: torch.Tensor, offs: torch.Tensor, n: int, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``_framed_keys`` in this thread's frame (``None``: no frame here), read eagerly."""
    frame = _FRAME.get()
    if frame is None:
        return None
    every, first = frame
    local = offs.numel()
    mine = torch.diff(offs.cpu(), prepend=offs.new_zeros(1, device="cpu")).to(torch.int64)
    if first + local > every.numel() or not torch.equal(mine, every[first : first + local]):
        raise ValueError(
            f"4-bit grouped experts in a draw frame (experts_draw_frame): experts "
            f"{first}..{first + local - 1} of {every.numel()} got groups that are not the "
            f"frame's counts for them; nothing was drawn"
        )
    # Python ints (no int64 wrap): the frame's rows are below 2**61, n is a GEMM width.
    rows = every.tolist()
    ahead = sum(rows[:first])
    pad_ahead = sum(-(-r // multiple) * multiple for r in rows[:first])
    total = sum(rows)
    advance = n * (total + sum(-(-r // multiple) * multiple for r in rows))
    counter = int(key[1])
    if counter + advance >= FP4_COUNTER_LIMIT:
        raise ValueError(
            f"4-bit grouped experts in a draw frame (experts_draw_frame): the counter "
            f"{counter} would advance by {advance} to 2**61 (FP4_COUNTER_LIMIT) or past; "
            f"nothing was drawn"
        )
    dx = key + key.new_tensor([0, n * ahead])
    col = key + key.new_tensor([0, n * (total + pad_ahead)])
    return dx, col, key.new_tensor([advance])


_FRAME_KEYS: list[Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] = [
    _frame_keys
]
"""``_frame_keys`` as the calls read it: wrapped by ``torch.compiler.disable`` once a frame
has opened (``_read_eagerly``), so a compiled caller reads the frame eagerly."""


class ExpertsGemm(Protocol):
    """What an experts module's grouped GEMMs run through: ``QuantizedExperts`` (fp8) and
    ``Fp4Experts`` (4 bits) both are one."""

    def mm(
        self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, save: SaveMode = "keep"
    ) -> torch.Tensor:
        """``[M, N]``: group ``g``'s rows of ``x [M, K]`` times ``w[g]ᵀ`` (``w [E, N, K]``,
        ``offs`` int32 end rows), differentiable in ``x`` and ``w``."""
        ...


class Fp4Experts(CounterLoads, nn.Module):
    """The 4-bit setting of one experts module: its recipe and stochastic-rounding counter
    (module docstring) and stream (``sr_stream``, 0 unless given; ``set_sr_stream``,
    ``assign_fp4_streams``: ``CounterLoads`` saves and loads both). ``convert_to_quantized``
    makes one per experts module it converts under a 4-bit ctx, on the weights' device, on
    the stream of its name; it moves with its module."""

    kind = "4-bit experts"

    sr_key: torch.Tensor
    """int64 ``(2,)`` on the CPU: the stochastic rounding's key word (the seed, two's
    complement, on stream 0: ``Fp4Linear``'s) and counter; plain state, not a buffer (module
    docstring)."""

    def __init__(self, recipe: Fp4Recipe, *, sr_stream: int = 0) -> None:
        super().__init__()
        if not isinstance(recipe, Fp4Recipe):
            raise TypeError(
                f"Fp4Experts takes an Fp4Recipe (ctx.recipe under nvfp4/mxfp4), got "
                f"{describe(recipe)}"
            )
        sr_stream = check_stream(sr_stream, "Fp4Experts")
        self.recipe = recipe
        self.how: Fp4Quant = fp4_quant(recipe)
        self.sr_stream = sr_stream
        self.sr_key = fp4_key(recipe, 0, sr_stream)
        # load_state_dict checks the counter before any module loads, from whatever root:
        # the guard climbs to each module this one is registered under.
        guard_whole_loads(self)

    @property
    def policy(self) -> Fp4Recipe:
        """The recipe (``QuantizedExperts.policy``'s place)."""
        return self.recipe

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}"

    @property
    def experts_gather(self) -> Fp4ExpertsGather:
        """How a shard of whole experts of a weight this module multiplies with is quantized
        for FSDP2's 4-bit all-gather, and rebuilt into every expert's operands
        (``Fp4GatheredExperts``, which ``mm`` multiplies with as they are:
        ``linear.fp4_gathered``)."""
        return Fp4ExpertsGather(self.how)

    def mm(
        self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, save: SaveMode = "keep"
    ) -> torch.Tensor:
        """``[M, N]`` at ``x``'s dtype (the autocast dtype inside ``torch.autocast``): group
        ``g``'s rows times ``w[g]ᵀ`` in 4 bits (module docstring); ``save``: how the backward
        keeps ``x`` (``ctx.activations.linear``). ``K`` and ``N`` must be multiples of the
        block (16, MXFP4 32); bad shapes, dtypes or ``offs`` raise as the fp8 GEMM's do."""
        m, k, _, n = check_grouped(x, w, offs, op="4-bit grouped experts")
        block = self.recipe.block
        if k % block or n % block:
            raise ValueError(
                f"4-bit grouped experts under {self.recipe} need K and N multiples of {block}, "
                f"got w [E, N, K] = {tuple(w.shape)}"
            )
        key = self.sr_key if self.recipe.stochastic and torch.is_grad_enabled() else None
        if key is None:
            y: torch.Tensor = outside_autocast(_Fp4GroupedFn, x, w, offs, self.how, None, save)
            return y
        multiple = wgrad_row_multiple(self.how)
        replaying = replays_a_call()  # the same before and after the call (its checkpoint's)
        dx_key, col, drawn = _framed_keys(key, offs, m, n, multiple, replaying)
        keys = (dx_key, col)
        y = outside_autocast(_Fp4GroupedFn, x, w, offs, self.how, keys, save)
        if not replaying and drawn is not None:
            # After the call (a bad offs has raised, the counter unmoved); a new tensor: the
            # key the backward holds is never written to.
            self.sr_key = key + torch.cat([drawn.new_zeros(1), drawn])
        return y

    # ----- state (get_extra_state, set_extra_state, plan_state_load: CounterLoads) -----------

    def check_load(self, entries: Mapping[str, object], prefix: str) -> None:
        """``ValueError`` when ``entries`` (local names) hold an ``_extra_state`` that is not a
        counter in ``Fp4Linear``'s layout (``None`` included: an entry present is checked,
        never read as absent), was saved under another 4-bit recipe or seed (naming both),
        lies outside ``[0, FP4_COUNTER_LIMIT)`` or holds a negative stream (the whole-load
        guard runs this before any module loads; ``linear.fp4_counter.saved_counter``)."""
        if "_extra_state" not in entries:
            return
        where = f"{prefix}_extra_state of {self.named(prefix[:-1])}"
        saved_counter(entries["_extra_state"], self.recipe, where, "these experts run")


class _Fp4GroupedFn(torch.autograd.Function):
    """``Y[rows of g] = X[rows of g] W[g]ᵀ`` in 4 bits; dX and dW by the operand table."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        offs: torch.Tensor,
        how: Fp4Quant,
        key: tuple[torch.Tensor, torch.Tensor | None] | None,
        save: SaveMode,
    ) -> torch.Tensor:
        if isinstance(w, Fp4GatheredExperts):  # gathered in 4 bits: its operands as they came
            y = grouped_mm_gathered(x, w.operand(), offs, how, check_amax_values=False)
        else:
            y = fp4_ops.grouped_mm(x, w, offs, how)
        c: Any = ctx
        kept: tuple[torch.Tensor, ...] = (x,) if c.needs_input_grad[1] else ()
        kept = offload_kept(ctx, kept) if save == "offload" else kept
        ctx.save_for_backward(w, offs, *kept)
        c.how, c.key, c.x_dtype, c.save = how, key, x.dtype, save
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refuse_double_backward("linear", ctx.save, fp8_gemm=True)
        w, offs, *rest = ctx.saved_tensors
        how = ctx.how
        key, col = (None, None) if ctx.key is None else ctx.key
        dy = dy.contiguous()
        m, n = dy.shape
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if isinstance(w, Fp4GatheredExperts):
                qwt = w.dgrad_operand()
                dx = grouped_mm_gathered(
                    dy, qwt, offs, how, out_dtype=ctx.x_dtype, stochastic=key,
                    check_amax_values=False,
                )  # fmt: skip
            else:
                wt = w.transpose(1, 2)  # W[g]ᵀ [K, N], contracted over N
                dx = fp4_ops.grouped_mm(dy, wt, offs, how, out_dtype=ctx.x_dtype, stochastic=key)
        if ctx.needs_input_grad[1]:
            (x,) = kept_back(ctx, tuple(rest))
            if key is not None and col is None:
                col = key + key.new_tensor([0, m * n])
            dw = fp4_ops.grouped_wgrad(dy, x, offs, how, stochastic=col).to(w.dtype)
        return dx, dw, None, None, None, None
