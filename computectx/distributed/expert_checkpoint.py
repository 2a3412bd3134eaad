"""Checkpoints of an expert-parallel model (``expert_parallel``): each rank holds its own
experts, so its state dict holds them as DTensors of its slice, marked with the rank that saved
them; a slice another rank saved is refused on load (a one-rank ``torch.save`` loaded on every
rank would otherwise give every rank rank 0's experts), and ``full_state_dict`` gathers whole
experts for one rank to save. And the state every rank moves alike after a step: the routers'
biases (``update_expert_bias``)."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from computectx.distributed.collectives import comm_device
from computectx.distributed.group import GroupArg, data_parallel_group, join, joining
from computectx.nn.experts import GroupedExperts
from computectx.nn.moe import MoE, planned_biases, update_biases

__all__ = [
    "EXPERT_STATE",
    "EXPERT_WEIGHTS",
    "JOIN_TIMEOUTS",
    "SHARDS",
    "ExpertShards",
    "full_state_dict",
    "shard_expert_optimizer_state",
    "unshard_expert_optimizer_state",
    "update_expert_bias",
]

EXPERT_WEIGHTS = ("gate_up", "down")
"""The 3-D parameters of a ``GroupedExperts`` that expert parallelism slices."""

EXPERT_STATE = (
    *EXPERT_WEIGHTS,
    *(f"{n}{s}" for n in EXPERT_WEIGHTS for s in ("_fp8", "_step")),
    *(f"fp8.{n}{s}" for n in EXPERT_WEIGHTS for s in ("_fp4", "_scale", "_amax")),
)
"""The state-dict keys (under the ``GroupedExperts``) of every per-expert tensor, whose first
dimension is the expert: the weights, frozen fp8 experts' codes and steps
(``freeze_for_serving``), frozen 4-bit experts' codes, scales and amaxes
(``FrozenFp4Experts``, the ``fp8`` child). Each rank holds its own experts' of each."""

_SLICE = "_computectx_expert_slice"
"""The attribute that marks a saved expert DTensor with ``(rank, world)`` of the rank that
saved it (it survives ``torch.save`` / ``torch.load(weights_only=True)``)."""


class ExpertShards:
    """State-dict hooks of an expert-parallel ``GroupedExperts``: its weights are saved as
    DTensors sharded along the expert dimension over the group (the whole ``(E, ...)`` shape:
    ``torch.distributed.checkpoint`` saves every rank's experts and reshards them on load,
    into one process too), each marked with the rank that saved it; they load from such a
    DTensor of this rank, from a DTensor that DCP filled, or from a whole ``(E, ...)`` tensor
    (a one-process checkpoint, ``full_state_dict``) by taking this rank's experts. Another
    rank's slice is refused (``check``)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        local: int,
        whole: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.group = group
        self.mesh = DeviceMesh.from_group(group, comm_device(group).type)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.local = local
        self.whole = dict(whole or {})
        """Each expert weight's whole ``(E, ...)`` shape (``check_shapes``)."""
        self.module: weakref.ref[GroupedExperts] | None = None

    def held(self) -> dict[str, torch.Tensor]:
        """The per-expert tensors (``EXPERT_STATE``) the attached experts hold now (their
        weights, or once frozen their codes), by state-dict key under the module."""
        experts = self.module() if self.module is not None else None
        if experts is None:
            return {}
        out: dict[str, torch.Tensor] = {}
        for key in EXPERT_STATE:
            owner, _, name = key.rpartition(".")
            module = getattr(experts, owner, None) if owner else experts
            t = getattr(module, name, None) if isinstance(module, nn.Module) else None
            if isinstance(t, torch.Tensor):
                out[key] = t
        return out

    def wholes(self) -> dict[str, tuple[int, ...]]:
        """Each held per-expert tensor's whole ``(E, ...)`` shape (every rank's experts)."""
        held = {k: (self.local * self.world, *t.shape[1:]) for k, t in self.held().items()}
        return {**self.whole, **held}

    def load_view(self, state: dict[str, Any], prefix: str) -> dict[str, Any]:
        """``state`` as the experts under ``prefix`` load it (a new dict): another rank's
        slice refused (``check``), then this rank's experts of each per-expert entry. The
        whole-load guard runs the layers' own checks on this view (``check_layer_entries``),
        so frozen experts check their own codes, not the whole or marked ones."""
        self.check(state, prefix)
        view = dict(state)
        for key in (prefix + k for k in EXPERT_STATE):
            if key in view:
                view[key] = self.local_of(view[key])
        return view

    def attach(self, experts: GroupedExperts) -> None:
        # Functions, not bound methods: torch marks the hooks it is given with attributes.
        def save(module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
            self.save(module, state, prefix, meta)

        def load(module: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
            self.load(module, state, prefix, *rest)

        def view(state: dict[str, Any], prefix: str) -> dict[str, Any]:
            return self.load_view(state, prefix)

        self.module = weakref.ref(experts)
        experts.register_state_dict_post_hook(save)  # type: ignore[no-untyped-call]
        handle = experts.register_load_state_dict_pre_hook(load)  # type: ignore[no-untyped-call]
        # First of the module's pre-hooks: its whole-load guard (if any) checks the slices.
        hooks = experts._load_state_dict_pre_hooks
        assert isinstance(hooks, OrderedDict)
        hooks.move_to_end(handle.id, last=False)
        vars(experts)["load_view"] = view  # what the whole-load guard's checks see

    def _experts_of(self, rank: int, world: int) -> str:
        local = self.local * self.world // world
        return f"experts {rank * local}..{(rank + 1) * local - 1}"

    def as_shard(self, value: Any) -> Any:
        """A plain tensor over this rank's experts as a marked DTensor; anything else as it
        is."""
        if (
            not isinstance(value, torch.Tensor)
            or isinstance(value, DTensor)
            or value.dim() == 0
            or value.shape[0] != self.local
        ):
            return value
        shard = DTensor.from_local(value, self.mesh, [Shard(0)], run_check=False)
        setattr(shard, _SLICE, (self.rank, self.world))
        return shard

    def local_of(self, value: Any) -> Any:
        """This rank's experts of a DTensor (resharded if need be) or of a whole ``(E, ...)``
        tensor; anything else as it is."""
        if isinstance(value, DTensor):
            if value.device_mesh != self.mesh or value.placements != (Shard(0),):
                value = _as_bytes(value, lambda v: v.redistribute(self.mesh, [Shard(0)]))
            return value.to_local()
        if (
            isinstance(value, torch.Tensor)
            and value.dim()
            and value.shape[0] == (self.local * self.world)
        ):
            first = self.rank * self.local
            return value[first : first + self.local]
        return value

    def save(
        self, module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        for attr in EXPERT_STATE:
            if prefix + attr in state:
                state[prefix + attr] = self.as_shard(state[prefix + attr])

    def check(
        self,
        state: dict[str, Any],
        prefix: str,
        keys: tuple[str, ...] = EXPERT_STATE,
        what: str = "",
    ) -> None:
        """Refuse a slice that another rank (or another world) saved, and (for the weights
        and frozen codes) a tensor of another shape (``ValueError``)."""
        if keys == EXPERT_STATE and not what:
            self.check_shapes(state, prefix)
        for key in (prefix + k for k in keys):
            value = state.get(key)
            saved = getattr(value, _SLICE, None) if isinstance(value, DTensor) else None
            if saved is None or tuple(saved) == (self.rank, self.world):
                continue
            rank, world = saved
            raise ValueError(
                f"{what}{key} holds the {self._experts_of(rank, world)} that rank {rank} "
                f"of {world} saved, and this is rank {self.rank} of {self.world} "
                f"({self._experts_of(self.rank, self.world)}): a state_dict of an "
                f"expert-parallel model holds only its own rank's experts, so one rank's "
                f"checkpoint (torch.save(model.state_dict()) on rank {rank}) cannot load on "
                f"another. Save with torch.distributed.checkpoint on every rank, or gather the "
                f"whole experts with computectx.distributed.full_state_dict(model) on every "
                f"rank and save that on one; nothing was loaded"
            )

    def check_shapes(self, state: dict[str, Any], prefix: str) -> None:
        """Refuse (``ValueError``) an expert weight whose whole shape is not the model's: a
        DTensor of another global shape, or a plain tensor that is neither the whole
        ``(E, ...)`` weight nor, in a group of one, this rank's. Checked before anything
        loads, so a tensor of the same size and another shape is never sliced into a shape
        that is nowhere in the checkpoint. A plain tensor over ``E / world`` experts says
        nothing of whose experts they are: refused too."""
        for attr, want in self.wholes().items():
            key = prefix + attr
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue  # not a tensor: torch's own load says so
            got = tuple(value.shape)
            if got == want:
                continue
            mine = (self.local, *want[1:])
            if isinstance(value, DTensor):
                held = f"a DTensor of whole shape {got}"
            elif got == mine:
                held = (
                    f"a plain tensor of shape {got}: {self.local} experts, with nothing to say "
                    f"whose (a rank's share of this model's is a DTensor: state_dict())"
                )
            else:
                held = f"a tensor of shape {got}"
            raise ValueError(
                f"{key} holds {held}, and this expert-parallel model's {attr} is {want} (all "
                f"{want[0]} experts; each of the {self.world} ranks holds {mine}): load the "
                f"whole (E, ...) weights (full_state_dict) or this model's own state_dict "
                f"(torch.distributed.checkpoint); nothing was loaded"
            )

    def load(self, module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        self.check(state, prefix)
        for attr in EXPERT_STATE:
            if prefix + attr in state:
                state[prefix + attr] = self.local_of(state[prefix + attr])


SHARDS: weakref.WeakKeyDictionary[nn.Module, ExpertShards] = weakref.WeakKeyDictionary()

JOIN_TIMEOUTS: dict[dist.ProcessGroup, float | None] = {}
"""The ``join_timeout`` that ``expert_parallel`` was given for each group: the expert
helpers that are collectives (``full_state_dict``, ``update_expert_bias``,
``clip_grad_norm_with_experts``) join with it."""


def _expert_weights(model: nn.Module) -> dict[str, ExpertShards]:
    return {
        f"{fqn}.experts.{attr}" if fqn else f"experts.{attr}": SHARDS[moe.experts]
        for fqn, moe in model.named_modules()
        if isinstance(moe, MoE) and moe.experts in SHARDS
        for attr in EXPERT_WEIGHTS
    }


def shard_expert_optimizer_state(model: nn.Module, optim: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by FQN (``get_optimizer_state_dict``) with the state
    of every expert weight (its tensors over this rank's experts: AdamW's moments) as
    DTensors sharded like the weight and marked with this rank, so that DCP saves every
    rank's moments (plain tensors of one FQN would be taken as replicated: one rank's copy
    for all) and a one-rank copy is refused on another rank. A new dict; no collective."""
    weights = _expert_weights(model)
    state = dict(optim.get("state", {}))
    for fqn, shards in weights.items():
        entry = state.get(fqn)
        if isinstance(entry, dict):
            state[fqn] = {k: shards.as_shard(v) for k, v in entry.items()}
    return {**optim, "state": state}


def unshard_expert_optimizer_state(model: nn.Module, optim: Any) -> Any:
    """The inverse of ``shard_expert_optimizer_state``: this rank's part of each expert
    weight's state, after refusing (``ValueError``) one that another rank saved."""
    weights = _expert_weights(model)
    if not weights or not isinstance(optim, dict) or not isinstance(optim.get("state"), dict):
        return optim
    state = dict(optim["state"])
    for fqn, shards in weights.items():
        entry = state.get(fqn)
        if isinstance(entry, dict):
            shards.check(entry, "", tuple(entry), what=f"the optimizer state of {fqn}: ")
            state[fqn] = {k: shards.local_of(v) for k, v in entry.items()}
    return {**optim, "state": state}


def _groups_of(model: nn.Module, state: dict[str, Any]) -> list[dist.ProcessGroup]:
    # The groups that gathering ``state``'s DTensors reduces over, in a fixed order: an
    # expert shard's own group, else each dimension's group of the DTensor's mesh.
    by_mesh = {id(s.mesh): s.group for m in model.modules() if (s := SHARDS.get(m)) is not None}
    out: list[dist.ProcessGroup] = []
    for value in state.values():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            known = by_mesh.get(id(mesh))
            for g in [known] if known is not None else mesh.get_all_groups():
                if all(g is not h for h in out):
                    out.append(g)
    return out


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """A snapshot of ``model.state_dict()`` with every DTensor gathered whole
    (``full_tensor``): the experts of an expert-parallel model as whole ``(E, ...)`` tensors,
    FSDP2's shards as whole parameters. Every tensor in it is a detached copy (the others
    too, not references to the live weights and buffers), so it stays what the model held
    at the call: a rollback (``load_state_dict``) restores every weight of that moment.

    A collective: every rank of the groups calls it, in the same order (the DTensors are
    gathered in the state dict's order). It first joins each group (``join``, with
    ``expert_parallel``'s ``join_timeout``), so a rank that calls it alone gets a
    ``RuntimeError`` naming the ranks that did not join, and the group stays usable. What
    it returns is the same on every rank, so one rank may ``torch.save`` it; it loads into
    one process, or into an expert-parallel model of any world (each rank takes its
    experts), plain or under DDP. Not into an FSDP2-sharded model: torch's
    ``load_state_dict`` refuses whole tensors for its DTensor parameters there (roll an
    FSDP2 model back through ``torch.distributed.checkpoint``). Without a DTensor it issues
    nothing."""
    state = model.state_dict()
    for group in _groups_of(model, state):
        join(group, "full_state_dict", JOIN_TIMEOUTS.get(group))
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            out[key] = _as_bytes(value, DTensor.full_tensor)
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


def _as_bytes(value: DTensor, move: Callable[[DTensor], torch.Tensor]) -> Any:
    """``move(value)`` (a gather or a reshard); a DTensor of one-byte codes (fp8, 4-bit
    pairs, e8m0 scales: frozen experts) moves as ``uint8`` bytes, which every backend
    sends (gloo sends no fp8), and comes back in its own dtype, bit for bit."""
    dtype = value.dtype
    if dtype.itemsize != 1 or dtype in (torch.uint8, torch.int8, torch.bool):
        return move(value)
    local = value.to_local().view(torch.uint8)
    raw = DTensor.from_local(
        local,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )
    return move(raw).view(dtype)


def update_expert_bias(model: nn.Module, group: GroupArg | None = None) -> None:
    """``MoE.update_bias`` for every MoE of ``model`` with the load of the whole group: every
    layer's ``tokens_per_expert`` summed over the ranks of ``group`` in one all-reduce, so
    every rank moves its router biases alike (``balance="aux_free"``; other layers only
    reset their counts). Call it after each optimizer step on every rank (``Parallel.step``
    does); ``group=None`` outside torch.distributed (or a world of one) reduces nothing.
    With no MoE layer it issues nothing. Each rank's counts are its own tokens for every
    expert (the global ones under ``expert_parallel`` too), so the sum is the batch's.

    Every layer is checked before any moves (a non-finite router bias, one that a step
    would overflow, a non-finite or negative count): one ``ValueError`` and nothing changed
    (no bias, no count). On many ranks each rank's verdict travels in the same all-reduce
    as the counts (no extra collective), so every rank refuses alike, naming the ranks; and
    it joins the group first (``join``, with ``expert_parallel``'s ``join_timeout``), so a
    rank that calls it alone gets a ``RuntimeError`` naming the ranks that did not join,
    and the group stays usable."""
    named = [(f, m) for f, m in model.named_modules() if isinstance(m, MoE)]
    if not named:
        return
    pg: dist.ProcessGroup | None = None
    if dist.is_available() and dist.is_initialized():
        pg = data_parallel_group(group)
        if dist.get_world_size(pg) == 1:
            pg = None
    if pg is None:
        _update_biases(named, None)
        return
    with joining(pg, "update_expert_bias", JOIN_TIMEOUTS.get(pg)):
        _update_biases(named, pg)


def _update_biases(named: list[tuple[str, MoE]], pg: dist.ProcessGroup | None) -> None:
    layers = [m for _, m in named]
    why: str | None = None
    try:  # this rank's own counts: every check update_biases makes, nothing written
        planned_biases(layers, names=[fqn or "the model" for fqn, _ in named])
    except (TypeError, ValueError) as e:
        why = str(e)
    counts = torch.cat([m.tokens_per_expert.detach().reshape(-1) for m in layers])
    failed: list[int] = [0] if why is not None else []
    if pg is not None:
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        # Each rank's verdict rides with the counts: one all-reduce, every rank decides alike.
        flags = torch.zeros(world, dtype=counts.dtype, device=counts.device)
        flags[rank] = int(why is not None)
        wire = torch.cat([counts, flags]).to(comm_device(pg))
        dist.all_reduce(wire, group=pg)
        wire = wire.to(counts.device)
        counts, flags = wire[: counts.numel()], wire[counts.numel() :]
        failed = flags.nonzero().flatten().tolist()
    if failed:
        ranks = ", ".join(map(str, failed))
        where = "" if pg is None else f" on rank(s) {ranks} of the group (every rank raises this)"
        detail = (
            why
            if why is not None
            else "see the error on those ranks; no router bias moved and no count was reset"
        )
        raise ValueError(f"update_expert_bias refused{where}: {detail}")
    # The group's counts, checked again as a whole (the same on every rank, so every rank
    # refuses alike) before any layer moves.
    update_biases(layers, list(torch.split(counts, [m.n_experts for m in layers])))
