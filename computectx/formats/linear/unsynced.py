"""Whether this process is one rank of many: the one question fp8 asks of ``torch.distributed``.

fp8 never reduces, gathers or otherwise talks to other ranks: ``computectx.distributed``
does, through the seams fp8 exposes (``QuantizedLinear.amax_reduce``, ``QuantizedWeight``). But a
user who wraps an fp8 model in ``DistributedDataParallel`` or ``fully_shard`` without that
package has nothing of it running, and each rank would scale by its own shard in silence.
So the first training call of a ``QuantizedLinear`` with no seam filled asks whether a process
group of more than one rank exists, and warns once per process, naming the fix.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["ScalingNotSyncedWarning", "warn_if_unsynced"]


class ScalingNotSyncedWarning(UserWarning):
    """An fp8 layer trains on one rank of many with nothing keeping its scales in step."""


_warned: list[bool] = [False]


def _world_size() -> int:
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size())


def _on_whole_world_mesh(layer: nn.Module, world: int) -> bool:
    # A weight that is a DTensor on a mesh of every rank (tensor parallelism over the whole
    # world, torchtitan's full_dtensor mode): each quantize of a sharded operand takes the
    # whole tensor's amax over the mesh, so every rank's scales are the same by construction.
    weight = getattr(layer, "weight", None)
    if weight is None or type(weight) in (torch.Tensor, nn.Parameter):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor) and weight.device_mesh.size() == world


def warn_if_unsynced(layer: nn.Module) -> None:
    """Warn once per process when ``layer`` trains on one of several ranks unsynced."""
    if _warned[0]:
        return
    world = _world_size()
    if world <= 1 or _on_whole_world_mesh(layer, world):
        return
    _warned[0] = True
    warnings.warn(
        ScalingNotSyncedWarning(
            f"an fp8 layer ({type(layer).__name__}) is training on one of {world} ranks with "
            f"nothing keeping its scales in step: each rank scales by its own shard, and "
            f"the ranks' scaling histories drift apart. Set up with "
            f"computectx.distributed.parallelize(model, ctx, ...) or call "
            f"computectx.distributed.sync_scaling(model) after wrapping it (after "
            f"fully_shard under FSDP2); to scale each rank on its own on purpose, call "
            f"sync_scaling(model).remove()"
        ),
        stacklevel=3,
    )
