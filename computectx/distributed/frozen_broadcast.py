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

import hashlib
import operator
from typing import SupportsIndex

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from computectx.distributed.collectives import comm_device
from computectx.distributed.expert_parallel import AllToAllDispatch, moe_local_buffers
from computectx.distributed.group import GroupArg, agree, data_parallel_group
from computectx.distributed.same_setup import first_difference
from computectx.formats.seam import adopt_frozen_written, frozen_buffer_names, frozen_recipes
from computectx.nn import MoE

__all__ = ["broadcast_frozen", "share_frozen"]


def broadcast_frozen(
    model: nn.Module, src: SupportsIndex = 0, group: GroupArg = None
) -> tuple[str, ...]:
    """Copy the weights frozen for serving inside ``model`` (``frozen_buffer_names``: their
    codes and scales, and the frozen fp8 linears' scaling state, ledgers, tallies and
    ``fp8_meta``: under delayed scaling a frozen layer's input step comes from its input
    ledger) from the group's rank ``src`` (its group rank, not the global rank) to every
    rank, in place, and return their names; each frozen layer then reads its host state from
    the bytes it holds (fp8's seeded flags and world size; a static 4-bit layer is calibrated
    when its ``input_amax`` is finite). Call it on every rank of ``group`` right after
    ``DistributedDataParallel(model)`` (which broadcast the rest of rank 0's state) or before
    serving without DDP.

    ``model`` is a ``DistributedDataParallel`` (its ``module`` is copied over its process group
    unless ``group`` is given; ``src`` must then be the rank its wrap broadcast from, group rank
    0 of its group: another rank's codes beside rank 0's weights would be a model no rank held),
    a ``torch.compile`` wrapper of one (unwrapped), or the model itself. On the model itself (no
    DDP) only the frozen buffers are sent: every other parameter and buffer (the frozen layers'
    biases, the trainable layers; not each rank's own: an expert-parallel ``MoE``'s experts, a
    ``MoE``'s rank-local buffers, sharded ``DTensor`` tensors, the names the model lists for DDP
    to leave out in ``_ddp_params_and_buffers_to_ignore``: list a rank's own counter there) must
    already agree, and the ranks compare a checksum of each (-0.0 and 0.0 alike; nothing is
    compared when no rank holds a frozen layer: nothing is sent); ranks that hold another are
    refused, as the frozen codes alone would make a model no rank held (load the same checkpoint
    on every rank, or wrap first). A collective: the ranks first join and exchange each buffer's
    name, shape, dtype, the first name holding the same tensor and the recipe each frozen layer
    serves with (one ``all_gather_object``), then send each distinct buffer once (one broadcast
    each, the same count on every rank). Every rank raises the same error, nothing changed, when
    a rank's check fails: ``TypeError`` for a ``model`` that is no ``nn.Module`` or a ``src``
    that is no integer (``operator.index``: an integer tensor of one element passes);
    ``ValueError`` for a ``src`` outside the group, for ranks that pass different ``src``, for
    ranks whose frozen buffers differ (names, shapes, dtypes, which names share a tensor, or a
    layer's recipe: fp8 scheme, scaling, margin, algo...; 4-bit format, mode,
    ``activation_amax``: the first rank and buffer named, both sides quoted), for a frozen
    buffer this rank could not send (on the meta device, not dense, an inference tensor outside
    ``inference_mode``), for a bare model whose rest differs (above), for a
    ``DistributedDataParallel`` that would broadcast a frozen buffer before a forward (a layer
    frozen after the wrap, or frozen buffers not listed by ``exclude_frozen_from_ddp`` on the
    model it wraps), and for a ``src`` over a DDP other than the rank its wrap sent from. A rank
    outside ``group`` gets ``ValueError`` saying so (alone: call it on the group's ranks).
    Frozen experts of an expert-parallel ``MoE`` are each rank's own: left as they are.
    """
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"broadcast_frozen: this rank (global rank {dist.get_rank()}) is not a member of "
            f"group: call it on the group's ranks only"
        )
    inner = _unwrapped(model)
    if isinstance(inner, DistributedDataParallel) and group is None:
        group = inner.process_group
    bare = not isinstance(inner, DistributedDataParallel)
    return share_frozen(model, data_parallel_group(group), src, None, rest_must_agree=bare)


def share_frozen(
    given: nn.Module,
    pg: dist.ProcessGroup,
    src: SupportsIndex,
    join_timeout: float | None,
    *,
    rest_must_agree: bool = False,
) -> tuple[str, ...]:
    """``broadcast_frozen`` over ``pg``, the ranks joining within ``join_timeout`` seconds
    (``None``: the group's timeout); ``rest_must_agree``: also compare a checksum of every
    parameter and buffer not sent (but each rank's own: ``_rest``) and refuse when a rank's
    differs (a bare model, whose rest no wrap sends)."""
    model = _unwrapped(given)
    world = dist.get_world_size(pg)
    plan = agree(
        lambda: _layout(model, src, world, pg, rest_must_agree),
        pg,
        what="broadcast_frozen",
        join_timeout=join_timeout,
    )
    _check_plan(plan)
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
    # Written in place: each layer reads its host state anew (fp8's seeded flags and world
    # size, a static 4-bit layer's input_calibrated), as the bytes now say.
    adopt_frozen_written(module)
    return tuple(names)


_Plan = list[tuple[int, list[tuple[str, str]], list[tuple[str, str]]]]


def _check_plan(plan: _Plan) -> None:
    """``ValueError`` (every rank holds the same ``plan``: every rank raises it) for ranks
    that passed different ``src``, hold different frozen buffers or recipes, or (a bare
    model) a different rest."""
    if len({s for s, _, _ in plan}) > 1:
        raise ValueError(
            f"broadcast_frozen: the ranks passed different src ({[s for s, _, _ in plan]}, in "
            f"rank order); pass the same rank on every rank. Nothing was changed"
        )
    found = first_difference([entries for _, entries, _ in plan], "no such buffer")
    if found is not None:
        differ, name, zero, other = found
        raise ValueError(
            f"broadcast_frozen: the ranks hold different frozen buffers: rank(s) "
            f"{', '.join(map(str, differ))} differ from rank 0; the first is {name!r}: rank 0 "
            f"holds {zero}, rank {differ[0]} holds {other}. Freeze the same layers the same "
            f"way (the same recipe, tied or shared alike) on every rank. Nothing was changed"
        )
    found = first_difference([rest for _, _, rest in plan], "no such tensor")
    if found is not None:
        differ, name, zero, other = found
        raise ValueError(
            f"broadcast_frozen: on a model without DistributedDataParallel only the frozen "
            f"layers' buffers are sent, and the rest must already agree, but rank(s) "
            f"{', '.join(map(str, differ))} hold another {name!r} than rank 0 (rank 0: "
            f"{zero}; rank {differ[0]}: {other}): sending the frozen codes alone would make a "
            f"model no rank held. Load the same checkpoint on every rank, or wrap the model "
            f"first (DistributedDataParallel after exclude_frozen_from_ddp, or parallelize), "
            f"whose wrap sends rank 0's rest; a tensor each rank keeps its own (a counter, "
            f"rank-local statistics) is left out when the model lists its name in "
            f"_ddp_params_and_buffers_to_ignore, as DDP does. Nothing was changed"
        )


def _unwrapped(model: object) -> object:
    """``model`` itself, or the module a ``torch.compile`` wrapper compiles."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(model, nn.Module) and isinstance(inner, nn.Module) else model


def _layout(
    model: object, src: object, world: int, pg: dist.ProcessGroup, rest_must_agree: bool
) -> tuple[int, list[tuple[str, str]], list[tuple[str, str]]]:
    """This rank's ``src``, its buffers to send, ``(name, "shape dtype")`` in model order
    (with the first name of a tensor held under several, and on each frozen layer's first
    buffer the recipe it serves with), and when ``rest_must_agree`` a checksum of the rest
    (``share_frozen``); ``TypeError``/``ValueError`` for what ``broadcast_frozen`` refuses
    here: everything that could fail later on one rank alone is checked now."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"broadcast_frozen takes an nn.Module, got {type(model).__name__}")
    rank = _src_rank(src, world)
    module = model.module if isinstance(model, DistributedDataParallel) else model
    names = frozen_buffer_names(module)
    if isinstance(model, DistributedDataParallel):
        _check_ddp(model, names, rank, pg)
    local = tuple(
        f"{fqn}.experts." if fqn else "experts."
        for fqn, m in module.named_modules()
        if isinstance(m, MoE) and isinstance(m.dispatch, AllToAllDispatch)
    )
    recipes = frozen_recipes(module)
    held = dict(module.named_buffers(remove_duplicate=False))
    first: dict[int, str] = {}
    out = []
    for n in dict.fromkeys(names):
        if n.startswith(local):
            continue
        t = held[n]
        _check_sendable(n, t)
        desc = f"{tuple(t.shape)} {t.dtype}"
        if id(t) in first:
            desc += f", the same tensor as {first[id(t)]!r}"
        if n in recipes:
            desc += f", serving with {recipes[n]}"
        first.setdefault(id(t), n)
        out.append((n, desc))
    # Nothing frozen to send (on this rank: the ranks compare that first): no rest to check.
    rest = _rest(module, first, local) if rest_must_agree and out else []
    return rank, out, rest


def _src_rank(src: object, world: int) -> int:
    """``src`` as the group rank it names; ``TypeError``/``ValueError`` naming it."""
    accepted = "an int (the group's rank; any integer operator.index takes"
    if isinstance(src, bool) or not hasattr(type(src), "__index__"):
        raise TypeError(f"broadcast_frozen: src must be {accepted}), got {type(src).__name__}")
    try:
        rank = operator.index(src)  # type: ignore[arg-type]
    except TypeError:  # a float or many-element tensor: its __index__ refuses it
        what = type(src).__name__
        if isinstance(src, torch.Tensor):
            what = f"a {str(src.dtype).removeprefix('torch.')} tensor of shape {tuple(src.shape)}"
        raise TypeError(
            f"broadcast_frozen: src must be {accepted}: an integer tensor of one element "
            f"too), got {what}"
        ) from None
    if not 0 <= rank < world:
        raise ValueError(
            f"broadcast_frozen: src must be a rank of the group (its group rank, not the "
            f"global rank) in [0, {world}), got {rank}"
        )
    return rank


def _check_sendable(name: str, t: torch.Tensor) -> None:
    """``ValueError`` for a buffer that this rank could not send or write in place."""
    why = None
    if t.is_meta:
        why = "is on the meta device (no values to send or receive: load the model first)"
    elif t.layout != torch.strided:
        why = f"has layout {t.layout} (a dense tensor is sent as bytes)"
    elif t.is_inference() and not torch.is_inference_mode_enabled():
        why = "is an inference tensor (made under inference_mode), written in place only there"
    if why is not None:
        raise ValueError(f"broadcast_frozen: the frozen buffer {name!r} {why}. Nothing was changed")


def _rest(module: nn.Module, sent: dict[int, str], local: tuple[str, ...]) -> list[tuple[str, str]]:
    """A checksum of each parameter and buffer of ``module`` not sent (``sent``: by id), but
    each rank's own: a spread MoE's experts (``local``), every MoE's rank-local buffers,
    sharded ``DTensor`` tensors, and what the model lists for DDP to leave out."""
    out = []
    seen = set(sent)
    own = {*moe_local_buffers(module), *getattr(module, "_ddp_params_and_buffers_to_ignore", ())}
    for n, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) in seen or n in own or n.startswith(local) or isinstance(t, DTensor):
            continue
        seen.add(id(t))
        out.append((n, _checksum(t)))
    return out


_SAME_WIDTH_INT = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def _checksum(t: torch.Tensor) -> str:
    """``t``'s shape, dtype and a digest of its bytes (never its values), -0.0 read as 0.0
    (the same model: a checkpoint and its reload may differ in the sign of a zero)."""
    desc = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    if t.is_meta or t.layout != torch.strided:
        return f"{desc} on {t.device.type} (layout {t.layout})"
    t = t.detach().contiguous().reshape(-1)
    bits = _SAME_WIDTH_INT.get(t.dtype)
    if bits is not None:  # -0.0 (the sign bit alone) read as 0.0, on the bits: no float op,
        u = t.view(bits)  # whose result would follow the thread's flush-to-zero mode
        t = torch.where(u == torch.iinfo(bits).min, torch.zeros_like(u), u)
    data = t.view(torch.uint8).cpu().numpy().tobytes()
    return f"{desc}, checksum {hashlib.blake2b(data, digest_size=8).hexdigest()}"


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
                f"{len(missed) - 1} more frozen buffers) before a forward (gloo sends no "
                f"float8, no backend float4, and one rank's lone forward would wait for the "
                f"others): a layer frozen after the wrap, or frozen "
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
