"""``ShardedParams``: the ``Sharding`` an ``OffloadedOptimizer`` needs for FSDP2 parameters."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from computectx.distributed._fp8_gather import GatheredAsFp8
from computectx.distributed.collectives import all_reduce_on
from computectx.distributed.fp8_all_gather import sharded_weight_of
from computectx.distributed.group import (
    GroupArg,
    check_join_timeout,
    data_parallel_group,
    joining,
)

__all__ = ["ShardedParams"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class ShardedParams:
    """Parameters split across the ranks of ``group`` (FSDP2 ``fully_shard``'s DTensors).

    Pass it as ``OffloadedOptimizer(..., sharding=ShardedParams(mesh))``. ``local`` gives
    the rank's shard of a DTensor (plain tensors pass through), so masters and optimizer
    state are plain local shards on the offload device; ``all_reduce`` combines the
    optimizer's few per-rank numbers (the squared norm for ``clip_grad_norm``, the
    non-finite verdict of ``step``) over ``group``. Those numbers travel as a CPU tensor:
    gloo and ``cpu:gloo,cuda:nccl`` groups reduce it in place, a pure nccl group through
    the current CUDA device. ``group`` is the mesh (one-dimensional: for HSDP pass the
    shard dimension, ``mesh["shard"]``), a process group, or ``None`` for the default
    group. Each reduction joins the group first (``join``; ``join_timeout`` as
    ``parallelize``'s): a rank that clips or steps alone gets a clear error, not a hang.
    """

    def __init__(self, group: GroupArg = None, *, join_timeout: float | None = None) -> None:
        check_join_timeout(join_timeout)
        self.group = data_parallel_group(group)
        self.join_timeout = join_timeout

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's shard of ``tensor`` when it is a DTensor, else ``tensor`` itself; a
        weight that FSDP2 gathers quantized (``WeightGatheredQuantized``, the fp8 experts',
        ``WeightGatheredFp4``: a ``GatheredAsFp8``) gives the plain tensor it wraps, so
        masters and optimizer state are plain tensors."""
        with torch.no_grad():  # the shard itself (a view), not an autograd copy
            local = sharded_weight_of(tensor)
        return local.hp if isinstance(local, GatheredAsFp8) else local

    def all_reduce(self, values: torch.Tensor, op: Literal["sum", "max"]) -> torch.Tensor:
        """``values`` summed (or maxed) over the group; a new CPU tensor.

        A collective: it first joins the group (``join``), unless a call that joined it is
        underway on this rank (``Parallel.step``), so the optimizer's ``clip_grad_norm`` or
        ``step`` called on one rank alone raises a ``RuntimeError`` naming the ranks that
        did not join after ``join_timeout`` (``None``: the group's timeout), nothing
        exchanged, instead of pairing with their next collective."""
        if op not in _OPS:
            raise ValueError(f"unknown op {op!r}; accepted: 'sum', 'max'")
        out = values.detach().to("cpu", copy=True)
        call = f"the sharded optimizer's all-reduce ({op}: clip_grad_norm's norm or step's verdict)"
        with joining(self.group, call, self.join_timeout):
            all_reduce_on(out, self.group, _OPS[op])
        return out

    def __repr__(self) -> str:
        return f"ShardedParams(world_size={dist.get_world_size(self.group)})"
