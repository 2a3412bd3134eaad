"""One operand's scaling: its ledger and tally, and every way it quantizes through them.

``OperandScaling`` reads its two tensors from a *store* on every access (a ``QuantizedLinear``'s
buffers, or a standalone dict), so a tensor replaced from outside is what it uses next.
``ScalingState`` (``computectx.formats.scaling.layer``) holds one per operand role. ``AmaxReduce``
is the seam a data-parallel layer fills (``computectx.distributed``): it turns a call's own
amax into its group's.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Protocol

import torch

from computectx.dtypes import Fp8Format
from computectx.formats.backend import Backend
from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.inline import QuantizeImpl
from computectx.formats.numerics.ledger import (
    TALLY_ELEMENTS,
    TALLY_SEEDED,
    count,
    ledger_history,
    ledger_history_len,
    ledger_new,
    ledger_saturated,
    ledger_step,
    record,
    tally_new,
)
from computectx.formats.ops.tensorwise import (
    quantize_dynamic,
    quantize_operand,
    quantize_with_step,
    seed_ledger,
)
from computectx.formats.scaling.saved import resize_ledger
from computectx.recipes import DelayedScaling, DynamicScaling

__all__ = [
    "AmaxReduce",
    "OperandScaling",
    "StatisticsRecord",
    "Store",
    "held_tensor",
    "record_statistics",
    "replicated_value",
]


class AmaxReduce(Protocol):
    """The seam a data-parallel layer plugs into ``QuantizedLinear.amax_reduce``.

    Calling it maps a call's own amax (float32, shape ``(1,)``) to its group's (a MAX over
    ranks). ``armed`` says whether a synchronized forward is running now, one that every
    rank of the group runs together: only then does a layer advance its ledgers or reduce
    anything, so a rank-local call (a forward of the unwrapped module, say) can neither
    hang the group nor shift one rank's history out of step. ``reduces`` is ``False`` for
    a sync whose quantizes keep their own amax (``current_amax="local"``), and for layers
    whose ranks scale on their own by choice.
    """

    @property
    def armed(self) -> bool: ...

    @property
    def reduces(self) -> bool: ...

    @property
    def lockstep(self) -> bool:
        """Whether the ranks' ledgers are kept in step (merged slot by slot), so a call
        must record even with no rows (an amax of 0, the MAX's identity)."""
        ...

    def __call__(self, amax: torch.Tensor, /) -> torch.Tensor: ...


Store = MutableMapping[str, "torch.Tensor | None"]
"""Where a scaling state keeps its tensors, by name: a module's ``_buffers`` or a dict."""


def held_tensor(store: Store, key: str) -> torch.Tensor:
    t = store.get(key)
    if t is None:
        raise RuntimeError(f"the fp8 scaling tensor {key!r} is missing from its module")
    return t


def replicated_value(t: torch.Tensor | None, what: str) -> torch.Tensor | None:
    # torch's distribute_module (under parallelize_module: tensor parallelism) replaces a
    # module's plain buffers with replicated DTensors. The scaling state stays plain
    # tensors: a replicated DTensor's local tensor is its whole value.
    if t is None or type(t) is torch.Tensor or not torch.distributed.is_available():
        return t
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(
            f"{what}: the scaling tensors are DTensors placed {tuple(t.placements)}; they "
            f"hold one value for the whole layer, so only a replicated DTensor can stand "
            f"for them"
        )
    # A plain copy: the local tensor of a DTensor that distribute_tensor broadcast may be a
    # functional collective's wrapper.
    local = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        local.copy_(t.to_local())
    return local


class OperandScaling:
    """One operand's ledger plus its tally (both device tensors).

    ``ledger`` is laid out by ``computectx.formats.numerics.ledger``, its history oldest to newest:
    the
    newest amax sits in the last slot (``newest_amax_index``). ``tally`` is int64
    ``[seeded, elements]``. ``seeded`` (whether the first call has filled the history) and
    ``elements`` (quantized elements, for saturated fractions) read it on the host, one
    device sync each, so read them between steps; assigning them writes the device tensor.
    ``idx`` is the history slot the next write replaces, always 0 (the oldest) in this
    layout; it stays for checkpoints and callers of the circular ring of version 1.

    Both tensors live in ``store`` under ``prefix + "ledger"`` and ``prefix + "tally"``
    (a dict of its own by default; a ``QuantizedLinear``'s buffers), read on every access.
    """

    __slots__ = ("_ledger_key", "_seeded_for", "_store", "_tally_key")

    def __init__(
        self,
        history_len: int,
        device: torch.device | str,
        *,
        store: Store | None = None,
        prefix: str = "",
    ) -> None:
        self._store: Store = {} if store is None else store
        self._ledger_key = f"{prefix}ledger"
        self._tally_key = f"{prefix}tally"
        self._seeded_for: torch.Tensor | None = None
        self.ledger = ledger_new(history_len, device)
        self.tally = tally_new(self.ledger.device)

    @property
    def ledger(self) -> torch.Tensor:
        """The float32 ledger (``computectx.formats.numerics.ledger``'s layout)."""
        return held_tensor(self._store, self._ledger_key)

    @ledger.setter
    def ledger(self, value: torch.Tensor) -> None:
        self._store[self._ledger_key] = value

    @property
    def tally(self) -> torch.Tensor:
        """The int64 tally ``[seeded, elements]``."""
        return held_tensor(self._store, self._tally_key)

    @tally.setter
    def tally(self, value: torch.Tensor) -> None:
        self._store[self._tally_key] = value

    @property
    def _seeded_hint(self) -> bool:
        # Eager calls only: once this process has seen the ledger seeded, the delayed quantize
        # can skip the seeding check (a pass over x on the kernels). Never read under compile.
        # Bound to the tally object it was seen on: a tally replaced from outside (a loaded
        # checkpoint) may hold anything, so it starts unknown again.
        return self._seeded_for is not None and self._seeded_for is self.tally

    @_seeded_hint.setter
    def _seeded_hint(self, value: bool) -> None:
        self._seeded_for = self.tally if value else None

    @property
    def history_len(self) -> int:
        """Length of the amax history."""
        return ledger_history_len(self.ledger)

    @property
    def idx(self) -> int:
        """The history slot the next delayed quantize replaces: 0, the oldest."""
        return 0

    @property
    def seeded(self) -> bool:
        """Whether the first call has run (one device read)."""
        return bool(self.tally[TALLY_SEEDED].item())

    @seeded.setter
    def seeded(self, value: bool) -> None:
        self.tally[TALLY_SEEDED].fill_(int(bool(value)))
        self._seeded_hint = bool(value)

    @property
    def elements(self) -> int:
        """Elements quantized through this operand (one device read)."""
        return int(self.tally[TALLY_ELEMENTS].item())

    @elements.setter
    def elements(self, value: int) -> None:
        self.tally[TALLY_ELEMENTS].fill_(int(value))

    @property
    def elements_tensor(self) -> torch.Tensor:
        """The element count as an int64 device view of shape ``(1,)`` (no host read)."""
        return self.tally[TALLY_ELEMENTS : TALLY_ELEMENTS + 1]

    def quantize(
        self,
        x: torch.Tensor,
        fmt: Fp8Format,
        scaling: DelayedScaling | DynamicScaling,
        backend: Backend,
        quantize: QuantizeImpl = "op",
        reduce: AmaxReduce | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x`` under ``scaling`` through this ledger: ``(data_fp8, step_used)``.

        Delayed: the first call seeds the history with ``amax(x)`` (so step 1 is not blind),
        then every call quantizes with the ledger's step and records its amax. Dynamic: the
        step comes from ``amax(x)``; the ledger records that amax (when finite), the step, and
        counts a non-finite amax. One ``computectx::fp8_quantize_*`` operator either way,
        except while ``torch.compile`` traces with ``quantize="inline"``: then the same
        computation as plain torch ops (``computectx.formats.numerics.inline``), for Inductor to
        fuse.
        Eager calls run the operator whatever ``quantize`` says (same bytes).

        ``reduce`` turns an amax into its data-parallel group's
        (``computectx.distributed.sync_scaling`` sets it). Dynamic scaling reduces
        every call's amax before taking the step, so ranks quantize with the whole batch's
        step. Delayed scaling reduces only the seed of an eager first call (its ledgers are
        merged between steps), so step 1 is the whole batch's too.
        """
        compiling = torch.compiler.is_compiling()
        # The tensors and the host flag read once, before the operator, and the flag written
        # as a plain attribute after it: the call enters this module once.
        ledger, tally = self.ledger, self.tally
        if reduce is not None:
            if isinstance(scaling, DynamicScaling):
                return self._quantize_reduced(x, fmt, scaling, backend, reduce)
            if not compiling and not self._seeded_hint:
                # One host read, once per operand: a compiled run may have seeded the ledger
                # already (its flag lives on the device), and re-seeding would both
                # overwrite the history and issue a collective no other rank issues.
                if not self.seeded:
                    seed_ledger(self.ledger, reduce(tensorwise.amax(x)), fmt, scaling.margin)
                self.seeded = True
        may_seed = compiling or self._seeded_for is not tally
        data, step = quantize_operand(
            x,
            fmt,
            ledger,
            tally,
            scaling,
            backend=backend,
            may_seed=may_seed,
            impl="inline" if compiling and quantize == "inline" else "op",
        )
        if not compiling:
            self._seeded_for = tally  # seeded now (the _seeded_hint it stands for)
        return data, step

    def _quantize_reduced(
        self,
        x: torch.Tensor,
        fmt: Fp8Format,
        scaling: DynamicScaling,
        backend: Backend,
        reduce: AmaxReduce,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Dynamic scaling with the group's amax: amax pass, reduction, cast with that step.
        # What the dynamic operator records (amax, step, a non-finite count, the elements)
        # is recorded here from the group's amax, so every rank's ledger is the same.
        whole = reduce(tensorwise.amax(x))
        step = tensorwise.step_from_amax(whole, fmt, scaling.margin)
        data, _ = quantize_with_step(x, fmt, step, backend=backend)
        record(self.ledger, whole, step)
        count(self.tally, x)
        if not torch.compiler.is_compiling():  # a host flag: never written in a trace
            self._seeded_hint = True
        return data, step

    def quantize_sharded(
        self,
        x: torch.Tensor,
        fmt: Fp8Format,
        scaling: DelayedScaling | DynamicScaling,
        backend: Backend,
        reduce: AmaxReduce,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x``, one rank's shard of a larger tensor, and record what one process
        quantizing the whole tensor records: ``(data_fp8, step_used)``.

        ``reduce`` turns the shard's amax into the whole tensor's (tensor parallelism:
        ``computectx.distributed`` reduces it over the mesh dimensions the tensor is
        sharded over). Dynamic: the step of the whole amax. Delayed: the ledger's step;
        the first call seeds the history with the whole amax, and every call records the
        whole amax (one reduction per call, so the ledgers stay identical on every rank
        holding a shard without a merge). The saturated count is the shard's and the
        element count the shard's elements. Device ops only.
        """
        if isinstance(scaling, DynamicScaling):
            return self._quantize_reduced(x, fmt, scaling, backend, reduce)
        whole = reduce(tensorwise.amax(x)).to(torch.float32).reshape(1)
        ledger, tally = self.ledger, self.tally
        history = ledger_history(ledger)
        unseeded = tally[TALLY_SEEDED : TALLY_SEEDED + 1] == 0
        with torch.no_grad():
            tensorwise.seed_ledger(ledger, whole, fmt, scaling.margin, when=unseeded)
            if history.numel() > 1:
                history.copy_(torch.roll(history, -1))
            step_used = ledger_step(ledger).clone()
            data, _ = quantize_with_step(x, fmt, step_used, backend=backend)
            sat = tensorwise.saturated_count(x, step_used, fmt)
            last = history.numel() - 1
            tensorwise.advance_ledger(ledger, last, whole, sat, fmt, scaling.algo, scaling.margin)
            count(tally, x)
        if not torch.compiler.is_compiling():
            self._seeded_hint = True
        return data, step_used

    def quantize_unrecorded(
        self,
        x: torch.Tensor,
        fmt: Fp8Format,
        scaling: DelayedScaling | DynamicScaling,
        backend: Backend,
        reduce: AmaxReduce | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x`` as a call outside training does: ``(data_fp8, step_used)``, with
        nothing written (no history, no step, no counts).

        Dynamic: the step of ``x``'s own amax. Delayed: the ledger's step; an operand that
        has never been seeded takes the step of ``x``'s own amax instead (a device
        ``where``, no host read). The output therefore depends only on the state training
        left and on ``x`` itself, never on earlier calls of this kind. ``reduce`` (for
        callers whose ranks all run the call, as FSDP2's all-gather does) turns that amax
        into the group's.
        """
        if isinstance(scaling, DynamicScaling):
            if reduce is None:
                data, step, _ = quantize_dynamic(x, fmt, scaling.margin, backend=backend)
                return data, step
            step = tensorwise.step_from_amax(reduce(tensorwise.amax(x)), fmt, scaling.margin)
        elif not torch.compiler.is_compiling() and self._seeded_hint:
            step = ledger_step(self.ledger).clone()
        else:
            own = tensorwise.amax(x) if reduce is None else reduce(tensorwise.amax(x))
            seeded = self.tally[TALLY_SEEDED : TALLY_SEEDED + 1] != 0
            step = torch.where(
                seeded,
                ledger_step(self.ledger),
                tensorwise.step_from_amax(own, fmt, scaling.margin),
            )
        data, _ = quantize_with_step(x, fmt, step, backend=backend)
        return data, step

    def record(self, amax: torch.Tensor, step: torch.Tensor) -> None:
        """Write an amax measured elsewhere and the step used with it (device ops only).

        A non-finite amax is counted and leaves the recorded amax as it was.
        """
        record(self.ledger, amax, step)
        self.tally[TALLY_SEEDED].fill_(1)
        if not torch.compiler.is_compiling():  # a host flag: never written in a trace
            self._seeded_hint = True

    def newest_amax_index(self) -> int:
        """Index of the newest history entry: the last slot."""
        return self.history_len - 1

    def resized(self, history_len: int) -> OperandScaling:
        """A standalone copy with another history length (``resize_ledger``: the newest
        entries kept, a longer history padded with the oldest entry; step and counts kept)."""
        out = OperandScaling.__new__(OperandScaling)
        out._store, out._ledger_key, out._tally_key = {}, "ledger", "tally"
        out.ledger = resize_ledger(self.ledger, history_len)
        with torch.inference_mode(False):
            out.tally = self.tally.clone()
        out._seeded_for = out.tally if self._seeded_hint else None
        return out

    def resize(self, history_len: int) -> None:
        """Give the ledger another history length, in place on this object (a new ledger
        tensor, ``resize_ledger``'s rule); the tally is kept."""
        if self.history_len != history_len:
            hint = self._seeded_hint
            self.ledger = resize_ledger(self.ledger, history_len)
            self._seeded_hint = hint

    def to(self, device: torch.device) -> None:
        """Move the ledger and the tally to ``device`` (in place on this object)."""
        if self.ledger.device != device or self.tally.device != device:
            hint = self._seeded_hint
            # Not an inference tensor, even when moved inside inference_mode (ledger_new).
            with torch.inference_mode(False):
                self.ledger = self.ledger.to(device)
                self.tally = self.tally.to(device)
            self._seeded_hint = hint

    def restore(self, ledger: torch.Tensor, tally: torch.Tensor) -> None:
        """Copy ``ledger`` and ``tally`` (an earlier copy of this operand's) back into this
        operand's tensors, in place (device ops; the tensors stay the same objects, so a
        compiled graph that holds them reads the restored values). Whether the tally is
        seeded is not known on the host afterwards: the next delayed quantize checks it."""
        with torch.no_grad():
            self.ledger.copy_(ledger)
            self.tally.copy_(tally)
        self._seeded_hint = False

    def install(self, ledger: torch.Tensor, tally: torch.Tensor, seeded: bool) -> None:
        """Take ``ledger`` and ``tally`` (new tensors, already checked) as this operand's;
        ``seeded`` is what the tally says, known on the host."""
        self.ledger = ledger
        self.tally = tally
        self._seeded_hint = seeded


StatisticsRecord = tuple[OperandScaling, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(operand, x, largest_step, saturated)``: what one block-scaled quantize of ``x`` measured."""


def record_statistics(records: Sequence[StatisticsRecord]) -> None:
    """Record what block-scaled quantizes measured, each into its operand (device ops only).

    Per ``(operand, x, largest_step, saturated)``: ``x``'s amax (NaN propagates and is
    counted) and its largest block step into the ledger, the elements that quantize saturated
    (float32 ``(1,)``) into the ledger's count, ``x``'s elements into the tally. Statistics
    only: no block-scaled quantize reads them back. One call for a GEMM's operands, every
    amax measured before anything is written.
    """
    held = [(op, op.ledger, op.tally) for op, _, _, _ in records]
    amaxes = [tensorwise.amax(x) for _, x, _, _ in records]
    for (op, ledger, tally), (_, x, step, saturated), a in zip(held, records, amaxes, strict=True):
        record(ledger, a, step)
        tally[TALLY_SEEDED].fill_(1)
        ledger_saturated(ledger).add_(saturated)
        count(tally, x)
        if not torch.compiler.is_compiling():  # a host flag: never written in a trace
            op._seeded_for = tally
