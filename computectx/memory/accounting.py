"""Memory accounting: the bytes each device holds, by role, counting each storage once."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Literal, get_args

import torch

from computectx.dtypes import DType
from computectx.memory.accumulator import LowPrecGradAccumulator
from computectx.memory.activation_bytes import SAVED_KINDS, SavedActivations, SavedKind
from computectx.memory.optim.checkpoint import state_tensors
from computectx.memory.optim.compact import CompactOptimizer
from computectx.memory.optim.offloaded import OffloadedOptimizer

__all__ = ["MemoryReport", "MemoryRow", "Role", "StateRole", "memory_report"]

StateRole = Literal[
    "params", "grads", "accumulator", "master", "optimizer_state", "staging", "scratch"
]
"""What a tensor held now is for. ``grads`` covers ``param.grad`` and the masters' ``.grad``;
``optimizer_state`` is the state as stored (packed parts under a compact ``optim_state``);
``staging`` is the reusable (pinned) host buffers of asynchronous copies; ``scratch`` is the
reused float32 buffer a compact-state step decodes one parameter's state into (the peak
extra memory of a step)."""
Role = StateRole | Literal["activations"]
"""A ``StateRole``, or ``activations``: what autograd kept for the backward during a forward
that a ``SavedActivations`` measured (rows by kind: ``MemoryRow.kind``)."""

STATE_ROLES: tuple[StateRole, ...] = get_args(StateRole)
ROLES: tuple[Role, ...] = (*STATE_ROLES, "activations")
_ROLE_OF: dict[str, StateRole] = {r: r for r in STATE_ROLES}


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """Bytes held on one device, for one role, at one dtype (and one kind of activation)."""

    device: str
    role: Role
    dtype: str
    bytes: int
    storages: int
    kind: SavedKind | None = None
    """For role ``activations``: the kind of activation (``SavedActivations``); else ``None``."""


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device, per-role, per-dtype byte counts from ``memory_report``.

    Each storage is counted once, under the first role that claims it in the order of
    ``ROLES`` (a tied weight is one parameter; a master that aliased a parameter would be a
    parameter). A storage is counted whole, even when a tensor views only part of it.
    ``parameters`` is the element count of the model's parameters (for bytes per parameter).

    Rows of role ``activations`` (only when ``memory_report`` was given a ``SavedActivations``)
    are what autograd kept during the measured forward, by kind, device and dtype: they are
    not held now, so no storage is shared with the other roles; ``saved_peak`` is the most
    of them held at once per device (``SavedActivations.peak``). ``peak`` is
    ``torch.cuda.max_memory_allocated`` of each CUDA device the report counts, since the last
    ``torch.cuda.reset_peak_memory_stats`` (reset it before the step to get the step's peak);
    a CPU has no such counter, so it never appears there.
    """

    rows: tuple[MemoryRow, ...]
    parameters: int
    peak: dict[str, int] = dataclasses.field(default_factory=dict)
    """Peak bytes allocated per CUDA device (``torch.cuda.max_memory_allocated``)."""
    saved_peak: dict[str, int] = dataclasses.field(default_factory=dict)
    """The most bytes of saved activations held at once per device, from the
    ``SavedActivations`` given (``SavedActivations.peak``; around a training step: the step's
    peak); empty without one."""

    def bytes(
        self,
        device: str | torch.device | None = None,
        role: Role | None = None,
        dtype: torch.dtype | DType | str | None = None,
        kind: SavedKind | None = None,
    ) -> int:
        """Total bytes matching every filter given (``None`` matches everything).

        ``device`` names one device the way tensors report theirs: ``"cuda"`` without an
        index means the current CUDA device (as ``torch.device("cuda")`` does when a tensor
        is made there), and ``"cpu:0"`` is the CPU. ``dtype`` may be a ``torch.dtype``, a
        ``DType``, or a name (``"bfloat16"``, ``"bf16"``). ``kind`` matches only rows of
        role ``activations`` of that kind.
        """
        if role is not None and role not in ROLES:
            raise ValueError(f"unknown role {role!r}; accepted: {', '.join(map(repr, ROLES))}")
        if kind is not None and kind not in SAVED_KINDS:
            raise ValueError(
                f"unknown kind {kind!r}; accepted: {', '.join(map(repr, SAVED_KINDS))}"
            )
        dev = None if device is None else _device_key(device)
        dt = None if dtype is None else _dtype_name(dtype)
        return sum(
            r.bytes
            for r in self.rows
            if (dev is None or r.device == dev)
            and (role is None or r.role == role)
            and (dt is None or r.dtype == dt)
            and (kind is None or r.kind == kind)
        )

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices holding any counted storage."""
        return tuple(sorted({r.device for r in self.rows}))

    def bytes_per_param(
        self, device: str | torch.device | None = None, roles: Iterable[Role] | None = None
    ) -> float:
        """Bytes per model parameter on ``device`` in ``roles``.

        ``None`` means all devices, or every role of the state held now (``STATE_ROLES``: not
        ``activations``).
        """
        chosen = STATE_ROLES if roles is None else tuple(roles)
        total = sum(self.bytes(device=device, role=r) for r in chosen)
        return total / self.parameters if self.parameters else 0.0

    def by_device(self) -> dict[str, dict[Role, int]]:
        """``{device: {role: bytes}}`` with every state role present (zeros included), and
        ``activations`` when the report measured them."""
        measured = any(r.role == "activations" for r in self.rows)
        roles = ROLES if measured else STATE_ROLES
        return {d: {r: self.bytes(device=d, role=r) for r in roles} for d in self.devices}

    def __str__(self) -> str:
        roles = [r.role if r.kind is None else f"{r.role}:{r.kind}" for r in self.rows]
        w = max([16, *map(len, roles)])
        dw = max([10, *(len(r.dtype) for r in self.rows)])
        lines = [f"{'device':<10} {'role':<{w}} {'dtype':<{dw}} {'bytes':>14} {'storages':>9}"]
        for r, role in zip(self.rows, roles, strict=True):
            lines.append(
                f"{r.device:<10} {role:<{w}} {r.dtype:<{dw}} {r.bytes:>14,} {r.storages:>9}"
            )
        lines.append(f"parameters: {self.parameters:,}")
        lines.extend(f"peak on {d}: {n:,}" for d, n in sorted(self.peak.items()))
        lines.extend(f"saved peak on {d}: {n:,}" for d, n in sorted(self.saved_peak.items()))
        return "\n".join(lines)


def _device_key(device: str | torch.device) -> str:
    """The device as a tensor on it reports it (``str(t.device)``), for matching rows."""
    dev = torch.device(device)
    if dev.type in ("cpu", "meta"):
        return dev.type  # tensors there never carry an index
    if dev.index is None and dev.type == "cuda":
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return f"cuda:{index}"
    return str(dev)


def _dtype_name(dtype: torch.dtype | DType | str) -> str:
    if isinstance(dtype, str):
        found = getattr(torch, dtype.strip(), None)
        dtype = found if isinstance(found, torch.dtype) else DType.parse(dtype)
    if isinstance(dtype, DType):
        dtype = dtype.torch
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, a DType or a name, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    # Meta (and empty) storages all report address 0; tell them apart by the storage
    # object's identity instead.
    return str(t.device), ptr if ptr != 0 else -int(storage._cdata)


def memory_report(
    model: torch.nn.Module | Iterable[torch.Tensor] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    accumulator: LowPrecGradAccumulator | None = None,
    activations: SavedActivations | None = None,
) -> MemoryReport:
    """Count the bytes held by a training setup, per device and role.

    ``model`` gives the parameters (``params``) and their ``.grad`` (``grads``); when it is
    omitted, an ``OffloadedOptimizer``'s compute parameters (or a plain optimizer's
    parameters) stand in. ``accumulator`` adds its buffers; ``optimizer`` adds master
    weights, their gradients, optimizer state (as stored: packed parts for a compact
    ``optim_state``), staging buffers and the step's scratch buffer. Only real tensors are
    counted (module buffers are not parameters and are left out); a storage shared by
    several tensors counts once. ``activations`` (a ``SavedActivations`` that measured a
    forward or step) adds rows of role ``activations``, one per device, kind and dtype, after
    the state's, and ``saved_peak``. ``peak`` holds each counted CUDA device's
    ``torch.cuda.max_memory_allocated``.
    """
    params = _model_params(model, optimizer)
    tagged: list[tuple[Role, torch.Tensor]] = []
    for p in params:
        tagged.append(("params", p))
        if p.grad is not None:
            tagged.append(("grads", p.grad))
    if accumulator is not None:
        if not isinstance(accumulator, LowPrecGradAccumulator):
            raise TypeError(
                f"accumulator must be a LowPrecGradAccumulator, got {type(accumulator).__name__}"
            )
        tagged.extend((_ROLE_OF[r], t) for r, t in accumulator.memory_tensors())
    if optimizer is not None:
        tagged.extend((_ROLE_OF[r], t) for r, t in _optimizer_tensors(optimizer))
    order = {r: i for i, r in enumerate(ROLES)}
    tagged.sort(key=lambda rt: order[rt[0]])
    seen: set[tuple[str, int]] = set()
    totals: dict[tuple[str, Role, str], list[int]] = {}
    for role, t in tagged:
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        row = totals.setdefault((key[0], role, str(t.dtype).removeprefix("torch.")), [0, 0])
        row[0] += t.untyped_storage().nbytes()
        row[1] += 1
    rows = tuple(
        MemoryRow(device=d, role=r, dtype=dt, bytes=b, storages=n)
        for (d, r, dt), (b, n) in sorted(
            totals.items(), key=lambda kv: (kv[0][0], order[kv[0][1]], kv[0][2])
        )
    )
    saved_peak: dict[str, int] = {}
    if activations is not None:
        rows += _activation_rows(activations)
        saved_peak = dict(sorted(activations.peak.items()))
    unique = {id(p): p for p in params}
    return MemoryReport(
        rows=rows,
        parameters=sum(p.numel() for p in unique.values()),
        peak=_cuda_peaks(rows),
        saved_peak=saved_peak,
    )


def _activation_rows(saved: SavedActivations) -> tuple[MemoryRow, ...]:
    if not isinstance(saved, SavedActivations):
        raise TypeError(f"activations must be a SavedActivations, got {type(saved).__name__}")
    order = {k: i for i, k in enumerate(SAVED_KINDS)}
    keys = sorted(saved.by_dtype, key=lambda key: (key[0], order[key[1]], key[2]))
    return tuple(
        MemoryRow(d, "activations", dt, saved.by_dtype[(d, k, dt)], saved.storages[(d, k, dt)], k)
        for d, k, dt in keys
    )


def _cuda_peaks(rows: Iterable[MemoryRow]) -> dict[str, int]:
    """``torch.cuda.max_memory_allocated`` of each CUDA device among ``rows``' devices."""
    cuda = sorted({r.device for r in rows if r.device.startswith("cuda")})
    if not cuda:  # tensors there: CUDA is initialized
        return {}
    return {d: int(torch.cuda.max_memory_allocated(torch.device(d))) for d in cuda}


def _model_params(
    model: torch.nn.Module | Iterable[torch.Tensor] | None,
    optimizer: torch.optim.Optimizer | None,
) -> list[torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return list(model.parameters())
    if isinstance(model, torch.Tensor):
        raise TypeError("model must be an nn.Module or an iterable of tensors, not one tensor")
    if model is not None:
        params = list(model)
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"model[{i}] is a {type(p).__name__}, not a tensor")
        return params
    if isinstance(optimizer, OffloadedOptimizer):
        return list(optimizer.compute_params)
    if isinstance(optimizer, torch.optim.Optimizer):
        return [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer is None:
        return []
    raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(optimizer, (OffloadedOptimizer, CompactOptimizer)):
        yield from optimizer.memory_tensors()
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.grad is not None:
                yield "grads", p.grad
    for per_param in optimizer.state.values():
        yield from (("optimizer_state", t) for t in state_tensors(per_param))
