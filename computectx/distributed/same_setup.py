"""Checks that the ranks of a group run the same policy and set up the same model (fp8 and
4-bit layers, parameters), each one collective that every rank raises alike."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from computectx.ctx import ComputeCtx
from computectx.distributed.group import GroupArg, data_parallel_group
from computectx.formats import Fp4Experts, Fp4Linear, FrozenFp4Experts, QuantizedLinear

__all__ = ["check_same_model", "check_same_policy", "first_difference"]


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
            f"QuantizedLinear({m.in_features}->{m.out_features}, granularity "
            f"{m.policy.granularity!r}, {m.policy})",
        )
        for fqn, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
    ]


def _parameters_of(model: nn.Module) -> list[_Entry]:
    # A DTensor's shape is the whole one, alike on every rank; strides and requires_grad: what
    # DDP refuses on one rank after the wrap sent rank 0's buffers; meta: nothing to send.
    return [
        (f, f"{tuple(p.shape)} {p.dtype}"
         f"{'' if isinstance(p, DTensor) else f', strides {p.stride()}'}{', meta' * p.is_meta}"
         f", {'trains' if p.requires_grad else 'requires_grad=False'}")
        for f, p in model.named_parameters()
    ]  # fmt: skip


def _buffers_of(model: nn.Module) -> list[_Entry]:
    # What DDP's wrap broadcasts from rank 0 into every rank's buffer, bytes into whatever is
    # there (another shape or size reads rank 0's bytes, another dtype aborts in gloo) and what
    # the wrap's scaling share copies (meta: nothing to copy); the names left to each rank not.
    own = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    return [
        (f, f"{tuple(b.shape)} {b.dtype}{' meta' * b.is_meta}")
        for f, b in model.named_buffers()
        if f not in own
    ]


def _fp4_layers_of(model: nn.Module) -> list[_Entry]:
    # Frozen 4-bit experts too: expert-parallel ones are each rank's own, which no broadcast
    # compares (share_frozen leaves them out), so their format and serving rule are compared here.
    return [
        (fqn, f"{type(m).__name__} under {m.recipe} on stream {m.sr_stream}")
        if isinstance(m, Fp4Linear | Fp4Experts)
        else (
            fqn,
            f"FrozenFp4Experts({m.format}, activation_amax={m.activation_amax}, {m.extra_repr()})",
        )
        for fqn, m in model.named_modules()
        if isinstance(m, Fp4Linear | Fp4Experts | FrozenFp4Experts)
    ]


def first_difference(
    everyone: Sequence[Sequence[tuple[str, object]]], absent: str
) -> tuple[list[int], str, str, str] | None:
    """For the ranks' ``(name, value)`` lists in rank order: ``None`` when every rank's equals
    rank 0's, else the ranks that differ, the first name (in the order either rank lists
    them) whose value differs between rank 0 and the first rank that differs, or that one
    of them lacks, and rank 0's and that rank's value of it (``absent`` for none)."""
    differ = [r for r, theirs in enumerate(everyone) if list(theirs) != list(everyone[0])]
    if not differ:
        return None
    mine, theirs = everyone[0], everyone[differ[0]]
    a, b = dict(mine), dict(theirs)
    for name in [n for n, _ in mine] + [n for n, _ in theirs if n not in a]:
        if (name in a, a.get(name)) != (name in b, b.get(name)):
            return differ, name, str(a.get(name, absent)), str(b.get(name, absent))
    # The same entries in another order: the first position that differs.
    at = next(i for i, (x, y) in enumerate(zip(mine, theirs, strict=True)) if x != y)
    return differ, mine[at][0], f"{mine[at][1]} at position {at}", f"{theirs[at][0]!r} there"


# Each kind check_same_model compares: what a rank lacking an entry holds, and the fix's tail.
_KINDS: dict[str, tuple[str, str]] = {
    "parameter": ("nothing", ""),
    "buffer": ("nothing", ""),
    "fp8 layer": ("nothing", ""),
    "4-bit layer": ("no 4-bit layer", " (and the same streams: assign_fp4_streams)"),
}


def check_same_model(model: nn.Module, group: GroupArg = None, *, parameters: bool) -> None:
    """Stop with a clear error, on every rank, when the ranks of ``group`` converted different
    layers to fp8 (FQN, widths, granularity and policy of every ``QuantizedLinear``) or to 4
    bits (FQN, class, recipe and stochastic-rounding stream of every ``Fp4Linear`` and
    ``Fp4Experts``), or, with ``parameters``, hold different parameters (FQN, shape, dtype,
    strides, meta, requires_grad) or buffers (FQN, shape, dtype, meta; but the names the model
    lists for DDP to leave out). One ``all_gather_object`` at setup, before any collective
    the model shapes (another ``fp8_filter`` on one rank would abort in gloo or hang at the
    first merge; FSDP2 would gather one rank's weight as 4-bit codes and another's in high
    precision). The ``ValueError`` names the ranks that differ from rank 0 and the first
    parameter or layer that differs."""
    pg = data_parallel_group(group)
    # Parameters first: they shape every collective of FSDP2, fp8 or not.
    mine: dict[str, Any] = {"parameter": _parameters_of(model)} if parameters else {}
    mine["fp8 layer"] = _fp8_layers_of(model)
    mine["4-bit layer"] = _fp4_layers_of(model)
    if parameters:  # last: a layer's buffers differ where the layers do, named above
        mine["buffer"] = _buffers_of(model)
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, mine, group=pg)
    for kind in mine:
        absent, hint = _KINDS[kind]
        found = first_difference([theirs[kind] for theirs in everyone], absent)
        if found is None:
            continue
        differ, fqn, zero, other = found
        raise ValueError(
            f"the ranks of the data-parallel group set up different models: rank(s) "
            f"{', '.join(map(str, differ))} differ from rank 0 in their {kind}s; the first "
            f"that differs is {fqn!r}: rank 0 holds {zero}, rank {differ[0]} holds {other}. "
            f"Build the same model and convert it with the same fp8_filter on every rank{hint}"
        )
