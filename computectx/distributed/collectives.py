"""Small collectives the package shares: an all-reduce that reaches a pure nccl group from
the CPU, and the group's amax of one tensor."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["GroupAmax", "RankLocal", "all_reduce_on"]


def all_reduce_on(t: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType) -> None:
    """All-reduce ``t`` in place over ``group``, crossing to the GPU when only nccl is there.

    gloo (and a ``cpu:gloo,cuda:nccl`` group) reduce CPU tensors directly; a pure nccl group
    gets a copy on the current CUDA device and the result is copied back.
    """
    if t.device.type == "cpu" and dist.get_backend(group) == "nccl":
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu, op=op, group=group)
        t.copy_(on_gpu)
    else:
        dist.all_reduce(t, op=op, group=group)


class GroupAmax:
    """An amax (float32, shape ``(1,)``) to its group's: a MAX all-reduce of one float.

    A NaN travels as +inf (a reduction may drop a NaN), so a non-finite amax on any rank is
    non-finite on all, as it is in one process quantizing the whole batch. The result is a
    new tensor; the argument is left alone.

    Also ``computectx.fp8``'s ``AmaxReduce`` seam: ``armed`` is set by ``Fp8AmaxSync``
    while a synchronized forward runs (``True`` from the start when ``always_armed``: the
    FSDP2 all-gather, which every rank of the shard group runs together by construction).
    ``reduces=False`` (``current_amax="local"``) hands the amax back unchanged.
    """

    def __init__(
        self, group: dist.ProcessGroup, *, reduces: bool = True, always_armed: bool = False
    ) -> None:
        self.group = group
        self.reduces = reduces
        self.armed = always_armed

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        if not self.reduces:
            return amax
        a = torch.where(torch.isnan(amax), torch.full_like(amax, math.inf), amax)
        all_reduce_on(a, self.group, dist.ReduceOp.MAX)
        return a

    def __deepcopy__(self, memo: dict[int, object]) -> GroupAmax:
        # A process group is runtime, not state: a copy of a model (an EMA copy) shares it.
        # The copy's arming is its own, and starts off.
        return GroupAmax(self.group, reduces=self.reduces)


class RankLocal:
    """The ``AmaxReduce`` of layers whose ranks scale on their own by choice
    (``Fp8AmaxSync.remove()``): always armed, reduces nothing, so every training call
    records its rank's own amaxes and nothing warns that no sync is attached."""

    armed = True
    reduces = False

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        return amax
