"""``broadcast_frozen``: one rank's weights frozen for serving, copied to every rank.

``DistributedDataParallel`` broadcasts rank 0's parameters and buffers when it wraps, so
ranks that built their model from their own seed, or loaded the checkpoint on rank 0 only,
start alike. The weights frozen for serving (float8 and float4 codes, their scales and
amaxes: ``formats.linear.frozen_ddp``) are left out of that broadcast, because gloo sends no
float8 and neither backend sends float4: without this, each rank would keep its own codes
beside rank 0's trainable rest, and the ranks would serve (and train) different models
without an error. This sends each frozen buffer as bytes (its ``uint8`` view, which every
backend sends), in place: DDP's meaning, "rank 0's state wins", holds for them too.
``parallelize(strategy="ddp")`` calls it when it wraps; after a ``DistributedDataParallel``
of your own, call it once on every rank.
"""

from __future__ import annotations

import operator
from typing import SupportsIndex

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from computectx.distributed.collectives import comm_device
from computectx.distributed.expert_parallel import AllToAllDispatch
from computectx.distributed.group import GroupArg, agree, data_parallel_group, first_difference
from computectx.formats import QuantizedLinear
from computectx.formats.seam import frozen_buffer_names
from computectx.nn import MoE

__all__ = ["broadcast_frozen", "share_frozen"]


def broadcast_frozen(
    model: nn.Module, src: SupportsIndex = 0, group: GroupArg = None
) -> tuple[str, ...]:
    """Copy the weights frozen for serving inside ``model`` (``frozen_buffer_names``) and the
    frozen fp8 linears' scaling state (ledgers, tallies, ``fp8_meta``: under delayed scaling
    a frozen layer's input step comes from its input ledger) from the group's rank ``src``
    (its group rank, not the global rank) to every rank, in place, and return their names;
    call it on every rank of ``group`` right after ``DistributedDataParallel(model)`` (which
    broadcast the rest of rank 0's state) or before serving without DDP.

    ``model`` is a ``DistributedDataParallel`` (its ``module`` is copied over its process
    group unless ``group`` is given; ``src`` must then be the rank its wrap broadcast from,
    group rank 0 of its group: another rank's codes beside rank 0's weights would be a model
    no rank held), a ``torch.compile`` wrapper of one (unwrapped), or the model itself. A
    collective: the ranks first join and exchange each buffer's name, shape, dtype and the
    first name holding the same tensor (one ``all_gather_object``), then send each distinct
    buffer once (one broadcast each, the same count on every rank). Every rank raises the
    same error, nothing changed, when a rank's check fails: ``TypeError`` for a ``model``
    that is no ``nn.Module`` or a ``src`` that is no integer (``operator.index``);
    ``ValueError`` for a ``src`` outside the group, for ranks that pass different ``src``,
    for ranks whose frozen buffers differ (names, shapes, dtypes or which names share a
    tensor: the first rank and buffer named), for a ``DistributedDataParallel`` that would
    broadcast a frozen buffer before each forward (a layer frozen after the wrap, or frozen
    buffers not listed by ``exclude_frozen_from_ddp`` on the model it wraps), and for a
    ``src`` over a DDP other than the rank its wrap sent from. A rank outside ``group`` gets
    ``ValueError`` saying so (alone: call it on the group's ranks). Frozen experts of an
    expert-parallel ``MoE`` are each rank's own: left as they are.
    """
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"broadcast_frozen: this rank (global rank {dist.get_rank()}) is not a member of "
            f"group: call it on the group's ranks only"
        )
    inner = _unwrapped(model)
    if isinstance(inner, DistributedDataParallel) and group is None:
        group = inner.process_group
    return share_frozen(model, data_parallel_group(group), src, None)


def share_frozen(
    given: nn.Module, pg: dist.ProcessGroup, src: SupportsIndex, join_timeout: float | None
) -> tuple[str, ...]:
    """``broadcast_frozen`` over ``pg``, the ranks joining within ``join_timeout`` seconds
    (``None``: the group's timeout)."""
    model = _unwrapped(given)
    world = dist.get_world_size(pg)
    plan = agree(
        lambda: _layout(model, src, world, pg),
        pg,
        what="broadcast_frozen",
        join_timeout=join_timeout,
    )
    if len({s for s, _ in plan}) > 1:
        raise ValueError(
            f"broadcast_frozen: the ranks passed different src ({[s for s, _ in plan]}, in "
            f"rank order); pass the same rank on every rank. Nothing was changed"
        )
    found = first_difference([entries for _, entries in plan], "no such buffer")
    if found is not None:
        differ, name, zero, other = found
        raise ValueError(
            f"broadcast_frozen: the ranks hold different frozen buffers: rank(s) "
            f"{', '.join(map(str, differ))} differ from rank 0; the first is {name!r}: rank 0 "
            f"holds {zero}, rank {differ[0]} holds {other}. Freeze the same layers the same "
            f"way on every rank (tied or shared alike). Nothing was changed"
        )
    assert isinstance(model, nn.Module)  # _layout refused anything else, on every rank
    module = model.module if isinstance(model, DistributedDataParallel) else model
    held = dict(module.named_buffers(remove_duplicate=False))
    names = [name for name, _ in plan[0][1]]
    rank = plan[0][0]
    sent: set[int] = set()
    for name in names:
        if id(held[name]) not in sent:
            sent.add(id(held[name]))
            _send(held[name], pg, rank)
    # The scaling state was written in place: each layer reads it anew (seeded flags, world).
    for _, layer in _frozen_fp8(module):
        layer.scaling.adopt_written()
    return tuple(names)


def _unwrapped(model: object) -> object:
    """``model`` itself, or the module a ``torch.compile`` wrapper compiles."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(model, nn.Module) and isinstance(inner, nn.Module) else model


def _frozen_fp8(module: nn.Module) -> list[tuple[str, QuantizedLinear]]:
    """The frozen fp8 linears in ``module`` (each name of one held under several)."""
    return [
        (fqn, m)
        for fqn, m in module.named_modules(remove_duplicate=False)
        if isinstance(m, QuantizedLinear) and m.frozen
    ]


def _layout(
    model: object, src: object, world: int, pg: dist.ProcessGroup
) -> tuple[int, list[tuple[str, str]]]:
    """This rank's ``src`` and buffers to send, ``(name, "shape dtype")`` in model order
    (with the first name of a tensor held under several); ``TypeError``/``ValueError`` for
    what ``broadcast_frozen`` refuses here."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"broadcast_frozen takes an nn.Module, got {type(model).__name__}")
    if isinstance(src, bool) or not hasattr(type(src), "__index__"):
        raise TypeError(
            f"broadcast_frozen: src must be an int (the group's rank; any integer "
            f"operator.index takes), got {type(src).__name__}"
        )
    rank = operator.index(src)  # type: ignore[arg-type]
    if not 0 <= rank < world:
        raise ValueError(
            f"broadcast_frozen: src must be a rank of the group (its group rank, not the "
            f"global rank) in [0, {world}), got {rank}"
        )
    module = model.module if isinstance(model, DistributedDataParallel) else model
    names = frozen_buffer_names(module)
    if isinstance(model, DistributedDataParallel):
        _check_ddp(model, names, rank, pg)
    local = tuple(
        f"{fqn}.experts." if fqn else "experts."
        for fqn, m in module.named_modules()
        if isinstance(m, MoE) and isinstance(m.dispatch, AllToAllDispatch)
    )
    # A frozen fp8 linear's forward reads its scaling state too (under delayed scaling the
    # input's step comes from its ledger): DDP's wrap under parallelize leaves it out, and a
    # frozen layer records nothing, so no amax sync ever merges it.
    scaling = [
        f"{fqn}.{b}" if fqn else b
        for fqn, m in _frozen_fp8(module)
        for b in m.scaling.tensor_names()
    ]
    held = dict(module.named_buffers(remove_duplicate=False))
    first: dict[int, str] = {}
    out = []
    for n in dict.fromkeys([*names, *scaling]):
        if n.startswith(local):
            continue
        t = held[n]
        desc = f"{tuple(t.shape)} {t.dtype}"
        if id(t) in first:
            desc += f", the same tensor as {first[id(t)]!r}"
        first.setdefault(id(t), n)
        out.append((n, desc))
    return rank, out


def _check_ddp(
    ddp: DistributedDataParallel, names: list[str], src: int, pg: dist.ProcessGroup
) -> None:
    """``ValueError`` for a DDP that would broadcast a frozen buffer before each forward, or
    a ``src`` other than the rank its wrap broadcast the rest from."""
    if getattr(ddp, "broadcast_buffers", True):
        missed = [n for n in names if n not in ddp.parameters_to_ignore]
        if missed:
            raise ValueError(
                f"broadcast_frozen: the DistributedDataParallel broadcasts {missed[0]!r} (and "
                f"{len(missed) - 1} more frozen buffers) before each forward (gloo sends no "
                f"float8, no backend float4): a layer frozen after the wrap, or frozen "
                f"buffers not listed on the model it wraps. Freeze, call "
                f"exclude_frozen_from_ddp(model) on the model you wrap, then wrap it (to "
                f"train on, wrap or parallelize the frozen model anew)"
            )
    wrapped = dist.get_global_rank(ddp.process_group, 0)
    if dist.get_global_rank(pg, src) != wrapped:
        raise ValueError(
            f"broadcast_frozen: src {src} is global rank {dist.get_global_rank(pg, src)}, but "
            f"the DistributedDataParallel's wrap sent global rank {wrapped}'s parameters and "
            f"buffers: its frozen codes beside them would make a model no rank held. Pass "
            f"the src that is global rank {wrapped} (load the model to serve there before "
            f"wrapping)"
        )


@torch.no_grad()
def _send(buffer: torch.Tensor, pg: dist.ProcessGroup, src: int) -> None:
    """Broadcast ``buffer``'s bytes from ``pg``'s rank ``src``, in place: its ``uint8`` view
    where it is contiguous on the group's device, else through a copy written back."""
    device = comm_device(pg)
    if buffer.is_contiguous() and buffer.device == device:
        dist.broadcast(buffer.reshape(-1).view(torch.uint8), group=pg, group_src=src)
        return
    wire = buffer.contiguous().reshape(-1).view(torch.uint8).to(device)
    dist.broadcast(wire, group=pg, group_src=src)
    back = wire.to(buffer.device).view(buffer.dtype).view(buffer.shape)
    if buffer.dtype.itemsize == 1:  # float4 codes have no copy_ of their own: as bytes
        buffer.view(torch.uint8).copy_(back.view(torch.uint8))
    else:
        buffer.copy_(back)
