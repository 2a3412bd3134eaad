"""Small collectives the package shares: an all-reduce that reaches a pure nccl group from
the CPU, and the group's amax of one tensor."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["GroupAmax", "all_reduce_on"]


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
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        a = torch.where(torch.isnan(amax), torch.full_like(amax, math.inf), amax)
        all_reduce_on(a, self.group, dist.ReduceOp.MAX)
        return a
