"""Checkpoints of an expert-parallel model (``expert_parallel``): each rank holds its own
experts, so its state dict holds them as DTensors of its slice, marked with the rank that saved
them; a slice another rank saved is refused on load (a one-rank ``torch.save`` loaded on every
rank would otherwise give every rank rank 0's experts), and ``full_state_dict`` gathers whole
experts for one rank to save."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from computectx.distributed.collectives import comm_device
from computectx.nn.experts import GroupedExperts
from computectx.nn.moe import MoE

__all__ = [
    "EXPERT_WEIGHTS",
    "SHARDS",
    "ExpertShards",
    "full_state_dict",
    "shard_expert_optimizer_state",
    "unshard_expert_optimizer_state",
]

EXPERT_WEIGHTS = ("gate_up", "down")
"""The 3-D parameters of a ``GroupedExperts`` that expert parallelism slices."""

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

    def __init__(self, group: dist.ProcessGroup, local: int) -> None:
        self.mesh = DeviceMesh.from_group(group, comm_device(group).type)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.local = local

    def attach(self, experts: GroupedExperts) -> None:
        # Functions, not bound methods: torch marks the hooks it is given with attributes.
        def save(module: nn.Module, state: dict[str, Any], prefix: str, meta: Any) -> None:
            self.save(module, state, prefix, meta)

        def load(module: nn.Module, state: dict[str, Any], prefix: str, *rest: Any) -> None:
            self.load(module, state, prefix, *rest)

        experts.register_state_dict_post_hook(save)  # type: ignore[no-untyped-call]
        experts.register_load_state_dict_pre_hook(load)  # type: ignore[no-untyped-call]

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
                value = value.redistribute(self.mesh, [Shard(0)])
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
        for attr in EXPERT_WEIGHTS:
            if prefix + attr in state:
                state[prefix + attr] = self.as_shard(state[prefix + attr])

    def check(
        self,
        state: dict[str, Any],
        prefix: str,
        keys: tuple[str, ...] = EXPERT_WEIGHTS,
        what: str = "",
    ) -> None:
        """Refuse a slice that another rank (or another world) saved (``ValueError``)."""
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

    def load(self, module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        self.check(state, prefix)
        for attr in EXPERT_WEIGHTS:
            if prefix + attr in state:
                state[prefix + attr] = self.local_of(state[prefix + attr])


SHARDS: weakref.WeakKeyDictionary[nn.Module, ExpertShards] = weakref.WeakKeyDictionary()


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


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with every DTensor gathered whole (``full_tensor``): the
    experts of an expert-parallel model as whole ``(E, ...)`` tensors, FSDP2's shards as whole
    parameters. A collective: every rank of the groups calls it, in the same order (the
    DTensors are gathered in the state dict's order). What it returns is the same on every
    rank, so one rank may ``torch.save`` it; it loads into one process, or into an
    expert-parallel model of any world (each rank takes its experts)."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        out[key] = value.full_tensor() if isinstance(value, DTensor) else value
    return out
