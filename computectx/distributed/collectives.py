"""Small collectives the package shares: an all-reduce that reaches a pure nccl group from
the CPU, and the group's amax of one tensor (a plain tensor, or a DTensor of any
placements: the whole tensor's)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from computectx.formats.seam import AmaxReduce

__all__ = ["GroupAmax", "RankLocal", "ShardAmax", "all_reduce_on", "comm_device", "whole_amax"]


def comm_device(group: dist.ProcessGroup) -> torch.device:
    """Where ``group``'s collectives take their tensors: gloo exchanges CPU tensors; a pure
    nccl group needs them on this rank's GPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_on(t: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType) -> None:
    """All-reduce ``t`` in place over ``group``, crossing to the GPU when only nccl is there.

    gloo (and a ``cpu:gloo,cuda:nccl`` group) reduce CPU tensors directly; a pure nccl group
    gets a copy on the current CUDA device and the result is copied back.
    """
    if isinstance(t, DTensor):
        # c10d's in-place all_reduce has no DTensor sharding strategy; what a DTensor amax
        # means is its whole value (whole_amax), so callers reduce that.
        raise TypeError("all_reduce_on takes a plain tensor; reduce whole_amax(t) instead")
    if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu, op=op, group=group)
        t.copy_(on_gpu)
    else:
        dist.all_reduce(t, op=op, group=group)


def _nan_as_inf(a: torch.Tensor) -> torch.Tensor:
    # A reduction may drop a NaN (MAX over gloo and nccl does); +inf is as non-finite and
    # survives it. A new tensor: the argument is left alone.
    return torch.where(torch.isnan(a), torch.full_like(a, math.inf), a)


def whole_amax(amax: torch.Tensor) -> torch.Tensor:
    """An amax as a plain tensor holding the whole tensor's value, NaN as +inf.

    A plain tensor is taken as it is (a copy). A DTensor's local tensor is only this rank's
    part of the value: under ``Partial("max")`` (what ``x.abs().amax()`` of a sharded ``x``
    gives) it is the max over this rank's shard, and under ``Shard`` a piece of the tensor;
    under ``Replicate`` it is the whole value. So every mesh dimension that is not
    replicated is reduced (a MAX all-reduce for ``Partial("max")``, DTensor's own
    redistribution otherwise), after NaN became +inf on each rank, and the result is the
    local tensor of the replicated DTensor: the max over the whole tensor, the same on
    every rank of the mesh.
    """
    if not isinstance(amax, DTensor):
        return _nan_as_inf(amax.detach())
    mesh = amax.device_mesh
    local = _nan_as_inf(amax.to_local().detach())
    placements = list(amax.placements)
    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial) and placement.reduce_op == "max":
            all_reduce_on(local, mesh.get_group(dim), dist.ReduceOp.MAX)
            placements[dim] = Replicate()
    if all(isinstance(p, Replicate) for p in placements):
        return local
    rebuilt = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=amax.shape, stride=amax.stride()
    )
    whole: torch.Tensor = rebuilt.full_tensor()
    return _nan_as_inf(whole)


class GroupAmax:
    """An amax (float32, shape ``(1,)``) to its group's: a MAX all-reduce of one float.

    A NaN travels as +inf (a reduction may drop a NaN), so a non-finite amax on any rank is
    non-finite on all, as it is in one process quantizing the whole batch. The result is a
    new plain tensor; the argument is left alone. A DTensor amax (the amax of a DTensor
    activation: tensor parallelism, torchtitan's full_dtensor mode) is first made the whole
    tensor's (``whole_amax``: its mesh's non-replicated dimensions reduced), then reduced
    over the group.

    Also ``computectx.formats``'s ``AmaxReduce`` seam: ``armed`` is set by ``AmaxSync``
    while a training forward of its model runs (``True`` from the start when
    ``always_armed``: the FSDP2 all-gather, which every rank of the shard group runs
    together by construction, and a sync built without hooks). ``reduces=False``
    (``current_amax="local"``, and the row, block and mx layers' seam) hands the amax back
    unchanged: no collective.
    """

    def __init__(
        self, group: dist.ProcessGroup, *, reduces: bool = True, always_armed: bool = False
    ) -> None:
        self.group = group
        self.reduces = reduces
        self.armed = always_armed
        self.lockstep = True

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        if not self.reduces:
            return amax
        a = whole_amax(amax)
        all_reduce_on(a, self.group, dist.ReduceOp.MAX)
        return a

    def __deepcopy__(self, memo: dict[int, object]) -> GroupAmax:
        # A process group is runtime, not state: a copy of a model (an EMA copy) shares it.
        # The copy's arming is its own, and starts off.
        return GroupAmax(self.group, reduces=self.reduces)


class ShardAmax:
    """The amax of one rank's shard to the whole tensor's: a MAX all-reduce over each of
    ``groups`` (the mesh dimensions the tensor is sharded over), then ``then`` (the
    data-parallel seam, when one is armed for this call). Always armed: every rank of a
    tensor-parallel group runs every call of the layer together.
    """

    armed = True
    reduces = True
    lockstep = True

    def __init__(self, groups: list[dist.ProcessGroup], then: AmaxReduce | None = None) -> None:
        self.groups = groups
        self.then = then

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        a = whole_amax(amax)
        for group in self.groups:
            all_reduce_on(a, group, dist.ReduceOp.MAX)
        return a if self.then is None else self.then(a)


class RankLocal:
    """The ``AmaxReduce`` of layers whose ranks scale on their own by choice
    (``AmaxSync.remove()``). Always armed, reduces nothing, so every training call
    records its rank's own amaxes, issues no collective, and nothing warns that no sync is
    attached."""

    armed = True
    reduces = False
    lockstep = False

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        return amax
