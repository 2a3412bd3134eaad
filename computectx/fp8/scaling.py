"""Per-weight scaling state: one ledger per operand role, quantizing through it, checkpoints.

A weight that runs in fp8 quantizes three operands — its ``input`` activation, the
``weight`` itself and the output ``grad`` — and each keeps one ledger (``computectx.fp8.ledger``
owns its layout: ``history_len`` amaxes, then the current step, the non-finite count and
the saturated count). Delayed scaling reads the step from the ledger and writes the
new amax into it; dynamic scaling keeps a ledger of length 1 only to record the last amax and
step, so both recipes report the same statistics.

Beside each ledger lives an int64 *tally* on the same device, ``[seeded, elements]``
(``computectx.fp8.custom_ops``): whether the first call has seeded the ledger and how many
elements went through it. Both are device tensors that the quantize operators update in
place, so no call reads a device value and a ``torch.compile``d step advances exactly what
an eager one does. Delayed histories are kept oldest to newest (the newest amax in the last
slot), so there is no host-side write index either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, Protocol

import torch

from computectx.dtypes import Fp8Format
from computectx.fp8 import custom_ops, ops, reference
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.inline import QuantizeImpl
from computectx.fp8.ledger import (
    LEDGER_SHAPE,
    is_ledger,
    ledger_history,
    ledger_history_len,
    ledger_new,
    ledger_step,
    ledger_with_history,
    read_ledger,
)
from computectx.recipes import DelayedScaling, DynamicScaling, Fp8Policy

__all__ = [
    "ROLES",
    "STATE_VERSION",
    "AmaxReduce",
    "Fp8ScalingState",
    "OperandScaling",
    "Role",
    "history_len_of",
]


class AmaxReduce(Protocol):
    """The seam a data-parallel layer plugs into ``Fp8Linear.amax_reduce``.

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

    def __call__(self, amax: torch.Tensor, /) -> torch.Tensor: ...


Role = Literal["input", "weight", "grad"]
ROLES: tuple[Role, ...] = ("input", "weight", "grad")
"""The operand roles of an fp8 linear, in checkpoint order."""

STATE_VERSION = 2
"""Version written into saved scaling state; loading accepts the versions in
``_READABLE_VERSIONS``. Version 2 keeps each operand's ledger under ``"ledger"``; version 1
kept the same tensor under the key ``_LEDGER_KEY_V1``."""
_READABLE_VERSIONS = (1, 2)
_LEDGER_KEY_V1 = "ring"  # rename.py: keep (the key version-1 checkpoints use)


def history_len_of(policy: Fp8Policy) -> int:
    """Ledger history length a policy needs: ``history_len`` for delayed scaling, 1 for
    dynamic (which keeps only the last amax, for statistics)."""
    s = policy.scaling
    return s.history_len if isinstance(s, DelayedScaling) else 1


class OperandScaling:
    """One operand's ledger plus its tally (both device tensors).

    ``ledger`` is laid out by ``computectx.fp8.ledger``, its history oldest to newest: the
    newest amax sits in the last slot (``newest_amax_index``). ``tally`` is int64
    ``[seeded, elements]``. ``seeded`` (whether the first call has filled the history) and
    ``elements`` (quantized elements, for saturated fractions) read it on the host, one
    device sync each, so read them between steps; assigning them writes the device tensor.
    ``idx`` is the history slot the next write replaces, always 0 (the oldest) in this
    layout; it stays for checkpoints and callers of the circular ring of version 1.
    """

    __slots__ = ("_seeded_hint", "ledger", "tally")

    def __init__(self, history_len: int, device: torch.device | str) -> None:
        self.ledger: torch.Tensor = ledger_new(history_len, device)
        self.tally: torch.Tensor = custom_ops.tally_new(self.ledger.device)
        # Eager calls only: once this process has seen the ledger seeded, the delayed quantize
        # can skip the seeding check (a pass over x on the kernels). Never read under compile.
        self._seeded_hint = False

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
        return bool(self.tally[custom_ops.TALLY_SEEDED].item())

    @seeded.setter
    def seeded(self, value: bool) -> None:
        self.tally[custom_ops.TALLY_SEEDED].fill_(int(bool(value)))
        self._seeded_hint = bool(value)

    @property
    def elements(self) -> int:
        """Elements quantized through this operand (one device read)."""
        return int(self.tally[custom_ops.TALLY_ELEMENTS].item())

    @elements.setter
    def elements(self, value: int) -> None:
        self.tally[custom_ops.TALLY_ELEMENTS].fill_(int(value))

    @property
    def elements_tensor(self) -> torch.Tensor:
        """The element count as an int64 device view of shape ``(1,)`` (no host read)."""
        return self.tally[custom_ops.TALLY_ELEMENTS : custom_ops.TALLY_ELEMENTS + 1]

    def quantize(
        self,
        x: torch.Tensor,
        fmt: Fp8Format,
        scaling: DelayedScaling | DynamicScaling,
        backend: Fp8Backend,
        quantize: QuantizeImpl = "op",
        reduce: AmaxReduce | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x`` under ``scaling`` through this ledger: ``(data_fp8, step_used)``.

        Delayed: the first call seeds the history with ``amax(x)`` (so step 1 is not blind),
        then every call quantizes with the ledger's step and records its amax. Dynamic: the
        step comes from ``amax(x)``; the ledger records that amax (when finite), the step, and
        counts a non-finite amax. One ``computectx::fp8_quantize_*`` operator either way,
        except while ``torch.compile`` traces with ``quantize="inline"``: then the same
        computation as plain torch ops (``computectx.fp8.inline``), for Inductor to fuse.
        Eager calls run the operator whatever ``quantize`` says (same bytes).

        ``reduce`` turns an amax into its data-parallel group's
        (``computectx.distributed.sync_fp8_scaling`` sets it). Dynamic scaling reduces
        every call's amax before taking the step, so ranks quantize with the whole batch's
        step. Delayed scaling reduces only the seed of an eager first call (its ledgers are
        merged between steps), so step 1 is the whole batch's too.
        """
        compiling = torch.compiler.is_compiling()
        if reduce is not None:
            if isinstance(scaling, DynamicScaling):
                return self._quantize_reduced(x, fmt, scaling, backend, reduce)
            if not compiling and not self._seeded_hint:
                # One host read, once per operand: a compiled run may have seeded the ledger
                # already (its flag lives on the device), and re-seeding would both
                # overwrite the history and issue a collective no other rank issues.
                if not self.seeded:
                    ops.seed_ledger(self.ledger, reduce(reference.amax(x)), fmt, scaling.margin)
                self.seeded = True
        may_seed = compiling or not self._seeded_hint
        data, step = ops.quantize_operand(
            x,
            fmt,
            self.ledger,
            self.tally,
            scaling,
            backend=backend,
            may_seed=may_seed,
            impl="inline" if compiling and quantize == "inline" else "op",
        )
        if not compiling:
            self._seeded_hint = True
        return data, step

    def _quantize_reduced(
        self,
        x: torch.Tensor,
        fmt: Fp8Format,
        scaling: DynamicScaling,
        backend: Fp8Backend,
        reduce: AmaxReduce,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Dynamic scaling with the group's amax: amax pass, reduction, cast with that step.
        # What the dynamic operator records (amax, step, a non-finite count, the elements)
        # is recorded here from the group's amax, so every rank's ledger is the same.
        whole = reduce(reference.amax(x))
        step = reference.step_from_amax(whole, fmt, scaling.margin)
        data, _ = ops.quantize_with_step(x, fmt, step, backend=backend)
        custom_ops.record(self.ledger, whole, step)
        custom_ops.count(self.tally, x)
        if not torch.compiler.is_compiling():  # a host flag: never written in a trace
            self._seeded_hint = True
        return data, step

    def quantize_unrecorded(
        self,
        x: torch.Tensor,
        fmt: Fp8Format,
        scaling: DelayedScaling | DynamicScaling,
        backend: Fp8Backend,
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
        if isinstance(scaling, DynamicScaling) and reduce is None:
            data, step, _ = ops.quantize_dynamic(x, fmt, scaling.margin, backend=backend)
            return data, step
        if isinstance(scaling, DynamicScaling):
            whole = reduce(reference.amax(x)) if reduce is not None else reference.amax(x)
            step = reference.step_from_amax(whole, fmt, scaling.margin)
        elif not torch.compiler.is_compiling() and self._seeded_hint:
            step = ledger_step(self.ledger).clone()
        else:
            own = reference.amax(x) if reduce is None else reduce(reference.amax(x))
            seeded = self.tally[custom_ops.TALLY_SEEDED : custom_ops.TALLY_SEEDED + 1] != 0
            step = torch.where(
                seeded, ledger_step(self.ledger), reference.step_from_amax(own, fmt, scaling.margin)
            )
        data, _ = ops.quantize_with_step(x, fmt, step, backend=backend)
        return data, step

    def record(self, amax: torch.Tensor, step: torch.Tensor) -> None:
        """Write an amax measured elsewhere and the step used with it (device ops only).

        A non-finite amax is counted and leaves the recorded amax as it was.
        """
        custom_ops.record(self.ledger, amax, step)
        self.tally[custom_ops.TALLY_SEEDED].fill_(1)
        self._seeded_hint = True

    def newest_amax_index(self) -> int:
        """Index of the newest history entry: the last slot."""
        return self.history_len - 1

    def resized(self, history_len: int) -> OperandScaling:
        """A copy with another history length, keeping the newest entries.

        The history is laid out oldest to newest; a shorter history keeps its newest
        ``history_len`` entries, a longer one repeats the oldest entry in front (so the
        window max and the newest entry are unchanged). Step and counts are kept.
        """
        n = self.history_len
        out = OperandScaling.__new__(OperandScaling)
        chron = ledger_history(self.ledger)
        if history_len <= n:
            chron = chron[n - history_len :]
        else:
            chron = torch.cat([chron[:1].expand(history_len - n), chron])
        out.ledger = ledger_with_history(self.ledger, chron)
        with torch.inference_mode(False):
            out.tally = self.tally.clone()
        out._seeded_hint = self._seeded_hint
        return out

    def to(self, device: torch.device) -> None:
        """Move the ledger to ``device`` (in place on this object)."""
        if self.ledger.device != device:
            # Not an inference tensor, even when moved inside inference_mode (ledger_new).
            with torch.inference_mode(False):
                self.ledger = self.ledger.to(device)
                self.tally = self.tally.to(device)


class Fp8ScalingState:
    """The scaling state of one fp8 weight: an ``OperandScaling`` per role.

    ``policy`` is the policy the ledgers are shaped for; ``conform`` reshapes them when a
    different policy (another history length, another recipe) starts using the weight.
    """

    __slots__ = ("operands", "policy", "world_size")

    def __init__(self, policy: Fp8Policy, device: torch.device | str) -> None:
        n = history_len_of(policy)
        self.policy = policy
        # The data-parallel world size the output-gradient ledger was recorded at: under a
        # loss each rank normalizes by its own batch, a rank's gradient is world_size times
        # the whole batch's. Saved with the state; computectx.distributed rescales the ledger
        # when a checkpoint meets another world size.
        self.world_size = 1
        self.operands: dict[Role, OperandScaling] = {r: OperandScaling(n, device) for r in ROLES}

    @property
    def input(self) -> OperandScaling:
        """The input activation's ledger."""
        return self.operands["input"]

    @property
    def weight(self) -> OperandScaling:
        """The weight's ledger."""
        return self.operands["weight"]

    @property
    def grad(self) -> OperandScaling:
        """The output gradient's ledger."""
        return self.operands["grad"]

    @property
    def device(self) -> torch.device:
        """Device the ledgers live on."""
        return self.operands["input"].ledger.device

    def conform(self, policy: Fp8Policy, device: torch.device) -> None:
        """Make the ledgers fit ``policy`` and live on ``device`` (no-op when they do)."""
        if policy is not self.policy and policy != self.policy:
            n = history_len_of(policy)
            for role, op in self.operands.items():
                if op.history_len != n:
                    self.operands[role] = op.resized(n)
            self.policy = policy
        for op in self.operands.values():
            op.to(device)

    def to(self, device: torch.device) -> None:
        """Move every ledger to ``device``."""
        for op in self.operands.values():
            op.to(device)

    # ----- checkpoints --------------------------------------------------------------------

    def to_dict(self) -> dict[str, object]:
        """The state as plain data for a checkpoint (ledgers copied to the CPU)."""
        return {
            "version": STATE_VERSION,
            "policy": str(self.policy),
            "world_size": self.world_size,
            "operands": {
                role: {
                    "ledger": op.ledger.detach().to("cpu", copy=True),
                    "idx": op.idx,
                    "seeded": op.seeded,
                    "elements": op.elements,
                }
                for role, op in self.operands.items()
            },
        }

    def load_dict(self, saved: object, device: torch.device | None = None) -> None:
        """Replace the state with a saved one (``to_dict``'s form), fitted to this policy,
        on ``device`` (default: where the ledgers are now).

        A history of another length is resized as ``OperandScaling.resized`` documents.
        Everything is checked before anything changes: a bad checkpoint raises
        ``ValueError`` and leaves the state as it was.
        """
        loaded = _parse_saved(saved, self.device if device is None else device)
        world = saved.get("world_size", 1) if isinstance(saved, Mapping) else 1
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(
                f"saved fp8 scaling state: world_size must be an int >= 1, got {world!r}"
            )
        self.world_size = world
        n = history_len_of(self.policy)
        self.operands = {
            role: op if op.history_len == n else op.resized(n) for role, op in loaded.items()
        }


def _parse_saved(saved: object, device: torch.device) -> dict[Role, OperandScaling]:
    what = "saved fp8 scaling state"
    if not isinstance(saved, Mapping):
        raise ValueError(f"{what} must be a dict (Fp8ScalingState.to_dict), got {saved!r}")
    version = saved.get("version")
    if version not in _READABLE_VERSIONS:
        raise ValueError(
            f"{what} has version {version!r}; this computectx reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))}"
        )
    operands = saved.get("operands")
    if not isinstance(operands, Mapping) or set(operands) != set(ROLES):
        got = sorted(operands) if isinstance(operands, Mapping) else operands
        raise ValueError(f"{what} must have operands {list(ROLES)}, got {got!r}")
    out: dict[Role, OperandScaling] = {}
    for role in ROLES:
        entry = operands[role]
        if not isinstance(entry, Mapping):
            raise ValueError(f"{what}: operand {role!r} must be a dict, got {entry!r}")
        key = _LEDGER_KEY_V1 if version == 1 else "ledger"
        ledger, idx = entry.get(key), entry.get("idx")
        seeded, elements = entry.get("seeded"), entry.get("elements")
        if not is_ledger(ledger):
            desc = (
                f"{ledger.dtype} {tuple(ledger.shape)}"
                if isinstance(ledger, torch.Tensor)
                else ledger
            )
            raise ValueError(
                f"{what}: operand {role!r} ledger ({key!r}) must be {LEDGER_SHAPE}, got {desc!r}"
            )
        n = ledger_history_len(ledger)
        _check_ledger_values(what, role, ledger)
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
            raise ValueError(
                f"{what}: operand {role!r} idx must be an int in [0, {n}), got {idx!r}"
            )
        if not isinstance(seeded, bool):
            raise ValueError(f"{what}: operand {role!r} seeded must be a bool, got {seeded!r}")
        if isinstance(elements, bool) or not isinstance(elements, int) or elements < 0:
            raise ValueError(
                f"{what}: operand {role!r} elements must be an int >= 0, got {elements!r}"
            )
        op = OperandScaling.__new__(OperandScaling)
        with torch.inference_mode(False):
            # A version-1 ledger written at slot idx (circular) is stored oldest to newest:
            # its oldest entry is the one at idx.
            saved = ledger.detach().to(device=device, copy=True).contiguous()
            hist = ledger_history(saved)
            op.ledger = ledger_with_history(saved, torch.cat([hist[idx:], hist[:idx]]))
            op.tally = custom_ops.tally_new(device)
            op.tally.copy_(torch.tensor([int(seeded), elements], dtype=torch.int64))
        op._seeded_hint = seeded
        out[role] = op
    return out


def _check_ledger_values(what: str, role: str, ledger: torch.Tensor) -> None:
    # Loading reads the values once (a checkpoint is not on the training path): a NaN or
    # non-positive step would quietly turn every later output into NaN or garbage, and a
    # NaN amax in the history would poison every window max that includes it.
    values = read_ledger(ledger)
    for i, a in enumerate(values.history):
        if not (math.isfinite(a) and a >= 0):
            raise ValueError(
                f"{what}: operand {role!r} amax history must be finite and >= 0, "
                f"got {a!r} at slot {i}"
            )
    step = values.step
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"{what}: operand {role!r} step must be finite and > 0, got {step!r}")
    counts = [values.nonfinite, values.saturated]
    if not all(math.isfinite(c) and c >= 0 for c in counts):
        raise ValueError(
            f"{what}: operand {role!r} non-finite and saturated counts must be finite and "
            f">= 0, got {counts!r}"
        )
