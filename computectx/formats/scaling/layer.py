"""Per-weight scaling state: one ledger per operand role, quantizing through it, checkpoints.

A weight that runs in fp8 quantizes three operands — its ``input`` activation, the
``weight`` itself and the output ``grad`` — and each keeps one ledger
(``computectx.formats.numerics.ledger`` owns its layout: ``history_len`` amaxes, then the current
step,
the non-finite count and the saturated count). Delayed scaling reads the step from the ledger and
writes the new amax into it; dynamic scaling keeps a ledger of length 1 only to record the last amax
and step, so both recipes report the same statistics.

Beside each ledger lives an int64 *tally* on the same device, ``[seeded, elements]``
(``computectx.formats.ops.tensorwise``): whether the first call has seeded the ledger and how many
elements went through it. Both are device tensors that the quantize operators update in
place, so no call reads a device value and a ``torch.compile``d step advances exactly what
an eager one does. Delayed histories are kept oldest to newest (the newest amax in the last
slot), so there is no host-side write index either.

The tensors live in a *store*, a mapping from names to tensors: a ``QuantizedLinear`` passes its
own buffers (``Module._buffers``), so the state is persistent buffers that every state dict,
device move and checkpoint format handles as tensors (names and checks in
``computectx.formats.scaling.saved``); a standalone state (a region's) keeps its own dict. The
objects here read the store on every access, so a buffer replaced from outside (a
``load_state_dict(assign=True)``, ``computectx.memory.load_weights``) is what they use next.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from computectx.formats.scaling.operand import (
    OperandScaling,
    Store,
    held_tensor,
    replicated_value,
)
from computectx.formats.scaling.saved import (
    META_WORLD,
    ROLES,
    Role,
    SavedScaling,
    history_len_of,
    meta_new,
    read_saved_tensors,
    same_recipe,
    tensor_names,
)
from computectx.recipes import Recipe

__all__ = ["ScalingState", "held_out"]


class ScalingState:
    """The scaling state of one fp8 weight: an ``OperandScaling`` per role, and ``meta``.

    ``input``, ``weight`` and ``grad`` are the three operands' ``OperandScaling`` (plain
    attributes, also in ``operands`` by role): the input activation's, the weight's and the
    output gradient's ledger and tally.

    ``policy`` is the policy the ledgers are shaped for; ``conform`` reshapes them when a
    different policy (another history length, another recipe) starts using the weight.
    The tensors live in ``store`` under ``prefix`` + ``computectx.formats.scaling.saved``'s
    names: ``{role}_ledger``, ``{role}_tally`` and ``meta`` (int64: the state version, the
    world size and the policy, so that a checkpoint says what it was recorded under).
    """

    __slots__ = (
        "_meta_seen",
        "_names",
        "_prefix",
        "_store",
        "_world",
        "grad",
        "input",
        "operands",
        "policy",
        "weight",
    )

    def __init__(
        self,
        policy: Recipe,
        device: torch.device | str,
        *,
        store: Store | None = None,
        prefix: str = "",
    ) -> None:
        self._store: Store = {} if store is None else store
        self._prefix = prefix
        self.policy = policy
        n = history_len_of(policy)
        self._names = tensor_names(prefix)
        self.operands: dict[Role, OperandScaling] = {
            r: OperandScaling(n, device, store=self._store, prefix=f"{prefix}{r}_") for r in ROLES
        }
        # The three operands as plain attributes (the objects never change; what they hold
        # does): a call reads them without entering this module.
        self.input: OperandScaling = self.operands["input"]
        """The input activation's ledger."""
        self.weight: OperandScaling = self.operands["weight"]
        """The weight's ledger."""
        self.grad: OperandScaling = self.operands["grad"]
        """The output gradient's ledger."""
        self._meta_seen: torch.Tensor | None = None
        self._world = 1
        self._set_meta(meta_new(policy, 1, self.device), 1)

    def __setattr__(self, name: str, value: object) -> None:
        # input, weight and grad are read-only once set, as the operands of ``operands`` they
        # name: assigning one would leave the two views of the state disagreeing.
        if name in ROLES and hasattr(self, name):
            raise AttributeError(
                f"ScalingState.{name} cannot be assigned: it is the state's own {name} operand "
                f"(operands[{name!r}]); load a state dict or conform the state instead"
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in ROLES:
            raise AttributeError(f"ScalingState.{name} cannot be deleted")
        super().__delattr__(name)

    @property
    def device(self) -> torch.device:
        """Device the ledgers live on."""
        return self.operands["input"].ledger.device

    @property
    def meta(self) -> torch.Tensor:
        """The int64 record of the state version, world size and policy (``scaling.saved``)."""
        return held_tensor(self._store, f"{self._prefix}meta")

    def tensor_names(self) -> tuple[str, ...]:
        """The store keys of every tensor of this state, in saving order."""
        return self._names

    @property
    def world_size(self) -> int:
        """The data-parallel world size the output-gradient ledger was recorded at.

        Under a loss each rank normalizes by its own batch, a rank's gradient is
        ``world_size`` times the whole batch's. Saved in ``meta``;
        ``computectx.distributed`` rescales the ledger when a checkpoint meets another
        world size. Read from a host copy (no device sync).
        """
        self.check_loaded()
        return self._world

    @world_size.setter
    def world_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"world_size must be an int >= 1, got {value!r}")
        self.check_loaded()
        meta = self.meta
        with torch.no_grad():
            meta[META_WORLD : META_WORLD + 1].fill_(value)
        self._world = value

    def _set_meta(self, meta: torch.Tensor, world: int) -> None:
        self._store[f"{self._prefix}meta"] = meta
        self._meta_seen = meta
        self._world = world

    def check_loaded(self) -> None:
        """Adopt tensors that were replaced from outside since this state last wrote them.

        ``computectx.memory.load_weights`` (and anything else that sets the buffers
        directly) bypasses ``load_state_dict``: the first use afterwards reads the tensors
        as a saved state (``read_saved_tensors``: one host read, checked against the
        policy, ``ValueError`` naming both policies) and installs copies. A no-op (one
        identity check) while ``meta`` is the tensor this state wrote.
        """
        meta = self.meta
        if meta is self._meta_seen or meta.device.type == "meta":
            return
        names = tensor_names()
        what = "the fp8 scaling state set into this layer"
        found = {
            n: replicated_value(self._store.get(k), what)
            for n, k in zip(names, self.tensor_names(), strict=True)
        }
        self.install(read_saved_tensors(found, self.policy, self.device, what))

    def adopt_written(self) -> None:
        """Take the tensors as they are after a write in place from outside (another rank's
        bytes copied into them: ``computectx.distributed.broadcast_frozen``): the host's
        seeded flags are forgotten (the next quantize reads the tally) and the world size is
        read from ``meta`` (one host read). The tensors stay the same objects."""
        for op in self.operands.values():
            op._seeded_hint = False
        self._world = int(self.meta[META_WORLD].item())

    def install(self, saved: SavedScaling) -> None:
        """Take a saved state (already read and fitted to this policy: ``scaling.saved``)."""
        for role, op in self.operands.items():
            op.install(saved.ledgers[role], saved.tallies[role], saved.seeded[role])
        self._set_meta(meta_new(self.policy, saved.world_size, self.device), saved.world_size)

    def reset(self, device: torch.device) -> None:
        """Fresh state on ``device``: nothing seeded, no counts, world size 1."""
        fresh = ScalingState(self.policy, device)
        for role, op in self.operands.items():
            theirs = fresh.operands[role]
            op.install(theirs.ledger, theirs.tally, False)
        self._set_meta(fresh.meta, 1)

    def conform(self, policy: Recipe, device: torch.device) -> None:
        """Make the ledgers fit ``policy`` and live on ``device`` (no-op when they do)."""
        if not torch.compiler.is_compiling():
            self.check_loaded()
        if policy is not self.policy and policy != self.policy:
            if not same_recipe(self.policy, policy):
                # Another scheme, recipe, margin or algo (the ctx was swapped): the steps and
                # amaxes recorded so far mean nothing under it, as loading would refuse them.
                self.policy = policy
                self.reset(self.device)
            else:
                n = history_len_of(policy)
                for op in self.operands.values():
                    op.resize(n)
                self.policy = policy
                self._set_meta(meta_new(policy, self._world, self.device), self._world)
        self.to(device)

    def to(self, device: torch.device) -> None:
        """Move every tensor to ``device``. State on the ``meta`` device (a layer built
        under ``torch.device("meta")``) has no values to move: it starts fresh there."""
        tensors = [held_tensor(self._store, k) for k in self.tensor_names()]
        if all(t.device == device for t in tensors):
            return
        if device.type != "meta" and any(t.device.type == "meta" for t in tensors):
            self.reset(device)
            return
        for op in self.operands.values():
            op.to(device)
        meta, key = self.meta, f"{self._prefix}meta"
        if meta.device != device:
            with torch.inference_mode(False):
                self._store[key] = meta.to(device)
            if meta is self._meta_seen:  # else not adopted yet: check_loaded reads it there
                self._meta_seen = self._store[key]


@contextmanager
def held_out(
    buffers: dict[str, torch.Tensor | None], names: tuple[str, ...]
) -> Iterator[dict[str, torch.Tensor | None]]:
    """Take ``names`` out of ``buffers`` for the block (which may replace them in the dict it
    gets), then put them back in their places. The same dict object throughout: the
    scaling state reads its tensors from it."""
    order = list(buffers)
    held = {k: buffers.pop(k) for k in names if k in buffers}
    try:
        yield held
    finally:
        now = {**buffers, **held}
        buffers.clear()
        buffers.update({k: now.pop(k) for k in order if k in now})
        buffers.update(now)
