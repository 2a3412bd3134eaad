"""Which ranks take part, and a check that they all run the same policy."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from computectx.ctx import ComputeCtx

__all__ = ["GroupArg", "check_same_policy", "data_parallel_group"]

GroupArg = dist.ProcessGroup | DeviceMesh | None
"""A process group, a one-dimensional ``DeviceMesh``, or ``None`` for the default group."""

_INIT_HINT = (
    "call torch.distributed.init_process_group(backend) first (or launch with torchrun / "
    "`computectx demo --nproc N`)"
)


def data_parallel_group(group: GroupArg = None) -> dist.ProcessGroup:
    """The process group to reduce over: ``group`` itself, a mesh's group, or the default one.

    Raises ``RuntimeError`` naming what to call when torch.distributed is not initialised,
    and ``TypeError``/``ValueError`` for anything but a group or a one-dimensional mesh.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"torch.distributed is not initialised: {_INIT_HINT}")
    if group is None:
        default = dist.group.WORLD
        if default is None:  # pragma: no cover - initialised implies a default group
            raise RuntimeError(f"torch.distributed has no default group: {_INIT_HINT}")
        return default
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a {group.ndim}-dimensional DeviceMesh {group.mesh_dim_names or ''} names no "
                f"single data-parallel group; pass mesh[dim_name] (one dimension) instead"
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(
        f"group must be a torch.distributed ProcessGroup, a one-dimensional DeviceMesh or "
        f"None (the default group), got {type(group).__name__}"
    )


def _digest(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8)


def check_same_policy(ctx: ComputeCtx, group: GroupArg = None) -> None:
    """Stop with a clear error, on every rank, when the ranks of ``group`` hold different policies.

    Compares a hash of ``str(ctx)`` in one all-gather at setup, so a rank that parsed another
    ``--dtype`` fails here, naming the ranks and this rank's policy, instead of hanging or
    silently diverging at the first collective that the policies shape differently. Device
    indices are left out (``cuda:0`` on rank 0 and ``cuda:1`` on rank 1 is the same policy);
    device types are compared.
    """
    if not isinstance(ctx, ComputeCtx):
        raise TypeError(f"ctx must be a computectx.ComputeCtx, got {type(ctx).__name__}")
    pg = data_parallel_group(group)
    # The hash travels on the CPU: gloo handles it everywhere, and for nccl it must be on the
    # rank's device. uint8 is a dtype every backend reduces.
    device = torch.device("cpu")
    if dist.get_backend(pg) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    offload = None if ctx.offload is None else torch.device(ctx.offload.type)
    policy = str(ctx.replace(device=torch.device(ctx.device.type), offload=offload))
    mine = _digest(policy).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(gathered, mine, group=pg)
    differ = [r for r, d in enumerate(gathered) if not torch.equal(d, gathered[0])]
    if differ:
        raise ValueError(
            f"the ranks of the data-parallel group hold different compute policies: rank(s) "
            f"{', '.join(map(str, differ))} differ from rank 0; this rank "
            f"({dist.get_rank(pg)}) holds {policy!r}. Build the same ComputeCtx on every rank"
        )
