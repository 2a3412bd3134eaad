"""Small collectives the fp8 scaling shares: the group's amax of one tensor."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from computectx.distributed.accumulate import all_reduce_on

__all__ = ["GroupAmax"]


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
