"""Which ranks take part, and checks that they all run the same policy and the same model."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from computectx.ctx import ComputeCtx
from computectx.fp8 import Fp8Linear

__all__ = ["GroupArg", "check_same_model", "check_same_policy", "data_parallel_group"]

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


_Entry = tuple[str, str]  # (FQN, what is there)


def _fp8_layers_of(model: nn.Module) -> list[_Entry]:
    return [
        (
            fqn,
            f"Fp8Linear({m.in_features}->{m.out_features}, granularity "
            f"{m.policy.granularity!r}, {m.policy})",
        )
        for fqn, m in model.named_modules()
        if isinstance(m, Fp8Linear)
    ]


def _parameters_of(model: nn.Module) -> list[_Entry]:
    # A DTensor's shape is the whole parameter's, the same on every rank of its mesh.
    return [(fqn, f"{tuple(p.shape)} {p.dtype}") for fqn, p in model.named_parameters()]


def _first_difference(mine: list[_Entry], theirs: list[_Entry]) -> tuple[str, str, str]:
    # The first FQN, in the order either rank lists them, whose description differs or that
    # one rank lacks: (fqn, rank 0's, the other rank's).
    a, b = dict(mine), dict(theirs)
    order = [f for f, _ in mine] + [f for f, _ in theirs if f not in a]
    for fqn in order:
        if a.get(fqn) != b.get(fqn):
            return fqn, a.get(fqn, "nothing"), b.get(fqn, "nothing")
    # The same entries in another order: the first position that differs.
    at = next(i for i, (x, y) in enumerate(zip(mine, theirs, strict=True)) if x != y)
    return mine[at][0], f"{mine[at][1]} at position {at}", f"{theirs[at][0]!r} there"


def check_same_model(model: nn.Module, group: GroupArg = None, *, parameters: bool) -> None:
    """Stop with a clear error, on every rank, when the ranks of ``group`` converted different
    layers to fp8 (FQN, widths, granularity and policy of every ``Fp8Linear``), or, with
    ``parameters``, hold different parameters (FQN, shape, dtype: FSDP2 shards each one
    over the ranks).

    One ``all_gather_object`` at setup, before any collective that the model shapes: a
    different ``fp8_filter`` on one rank would otherwise abort in gloo ("Received data size
    doesn't match expected size") or hang at the first merge. The ``ValueError`` names the
    ranks that differ from rank 0 and the first layer (or parameter) that differs.
    """
    pg = data_parallel_group(group)
    # Parameters first: they shape every collective of FSDP2, fp8 or not.
    mine: dict[str, Any] = {"parameter": _parameters_of(model)} if parameters else {}
    mine["fp8 layer"] = _fp8_layers_of(model)
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, mine, group=pg)
    first: dict[str, Any] = everyone[0]
    for kind in mine:
        differ = [r for r, theirs in enumerate(everyone) if theirs[kind] != first[kind]]
        if not differ:
            continue
        fqn, zero, other = _first_difference(first[kind], everyone[differ[0]][kind])
        raise ValueError(
            f"the ranks of the data-parallel group set up different models: rank(s) "
            f"{', '.join(map(str, differ))} differ from rank 0 in their {kind}s; the first "
            f"that differs is {fqn!r}: rank 0 holds {zero}, rank {differ[0]} holds {other}. "
            f"Build the same model and convert it with the same fp8_filter on every rank"
        )
