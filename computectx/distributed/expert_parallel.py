"""Expert parallelism: each rank of a group holds ``E / world`` experts of every MoE, and the
tokens travel to the experts they chose and back with ``all_to_all_single``.

``expert_parallel(model, group)`` keeps, on rank ``r``, experts ``r * E/world .. (r+1) * E/world
- 1`` of each ``computectx.nn.MoE`` (the 3-D ``gate_up`` and ``down`` parameters sliced along
their expert dimension) and sets ``MoE.dispatch`` to an ``AllToAllDispatch``. The router, the
shared experts and everything else stay whole on every rank. A forward of an MoE then runs, on
every rank of the group and whatever the routing:

1. one ``all_gather_single`` of every rank's per-expert token counts (``E`` int64 each), then
   one host read of them (the split sizes of the next two exchanges, and the whole batch's
   rows per expert: 4-bit experts draw their stochastic rounding in that frame,
   ``formats.experts_draw_frame``, so their bits and counters are one process's);
2. one ``all_to_all_single`` of the token rows (variable split sizes; a rank may send or
   receive none), regrouped by local expert: expert ``e``'s rows from rank 0, then rank 1...,
   which is the order one process sorting the whole batch (rank 0's rows first) gives them;
3. the local experts' grouped GEMMs (``experts(x, offs)``, fp8 where the experts are);
4. one ``all_to_all_single`` of the outputs back to the ranks the tokens came from.

The exchanges are differentiable (``AllToAll``): the backward sends the output gradients to the
experts' ranks and the input gradients back, one ``all_to_all_single`` each, in the reverse
order on every rank. Every rank runs the same three collectives per forward and two per
backward, so routing skew (every token to one rank's experts, a rank with no tokens at all)
neither hangs nor drops a token. Since an expert's rows reach it in one process's order, the
forward and the gradients equal one process on the whole batch: bit for bit for float32 and
for the fp8 grouped GEMM's reference backend (each group's amax and blocks are one process's),
and for 4-bit experts (NVFP4 with stochastic rounding, MXFP4), with a loss normalized by the
whole batch (``tests/distributed/test_expert_parallel.py``).

A forward of an expert-parallel MoE is a collective: every rank of the group runs every forward
together (evaluation included), as under FSDP2. It first joins the group (``group.join``: a
few store round trips, once per forward of the model given to ``expert_parallel``), so a rank
that runs one alone gets a ``RuntimeError`` naming the ranks that did not join after
``join_timeout`` instead of waiting in ``all_to_all`` until the group's timeout, and the group
stays usable. ``state_dict`` holds the expert weights as DTensors sharded along the expert
dimension over the group (whole shapes, every rank's experts: ``torch.distributed.checkpoint``
saves them all and reshards them on load, into one process too; no collective), each marked
with the rank that saved it; ``load_state_dict`` takes such DTensors of this rank (or filled by
DCP) or whole ``(E, ...)`` tensors (a one-process checkpoint, ``full_state_dict``), keeping
this rank's experts, and refuses another rank's slice (a one-rank ``torch.save``) before
anything loads. ``parallelize`` takes an expert-parallel model (the group must be its
data-parallel group): the expert parameters stay out of DDP's all-reduce and of FSDP2's
sharding, since each rank's are its own (``expert_parameters``), and their optimizer state
travels in ``Parallel.state_dict`` as DTensors too (``shard_expert_optimizer_state``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from computectx._checks import check_max_norm
from computectx.distributed.collectives import comm_device
from computectx.distributed.expert_checkpoint import (
    EXPERT_WEIGHTS,
    JOIN_TIMEOUTS,
    SHARDS,
    ExpertShards,
    full_state_dict,
    shard_expert_optimizer_state,
    unshard_expert_optimizer_state,
    update_expert_bias,
)
from computectx.distributed.group import (
    COMPILE_REFUSED,
    GroupArg,
    agree,
    check_join_timeout,
    data_parallel_group,
    describe_forward,
    join,
    join_forwards,
    joined,
    joining,
)
from computectx.dtypes import FP8_DTYPES
from computectx.formats import experts_draw_frame
from computectx.nn.experts import GroupedExperts
from computectx.nn.moe import MoE

__all__ = [
    "AllToAll",
    "AllToAllDispatch",
    "clip_grad_norm_with_experts",
    "expert_parallel",
    "expert_parallel_group",
    "expert_parameters",
    "full_state_dict",
    "moe_local_buffers",
    "same_ranks",
    "shard_expert_optimizer_state",
    "unshard_expert_optimizer_state",
    "update_expert_bias",
]


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    # float8 rows travel as their bytes: gloo refuses float8 dtypes.
    wire = x.contiguous()
    fp8 = wire.dtype in FP8_DTYPES
    if fp8:
        wire = wire.view(torch.uint8)
    out = wire.new_empty((sum(out_splits), *wire.shape[1:]))
    dist.all_to_all_single(out, wire, out_splits, in_splits, group=group)
    return out.view(x.dtype) if fp8 else out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with split sizes, differentiable: the backward sends
    the output's gradient back along the same routes (the splits swapped)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.routes = (in_splits, out_splits, group)
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back_out, back_in, group = ctx.routes
        return _exchange(grad, back_out, back_in, group), None, None, None


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out: torch.Tensor = AllToAll.apply(x, out_splits, in_splits, group)  # type: ignore[no-untyped-call]
    return out


class AllToAllDispatch:
    """``MoE.dispatch`` of an expert-parallel MoE: ``(x_sorted, counts, experts) -> y_sorted``
    with this rank's ``local`` experts (module docstring). Built by ``expert_parallel``.

    ``x_sorted`` are this rank's token rows sorted by global expert, ``counts`` (``E``,
    int64) the rows of each global expert, ``experts`` this rank's ``GroupedExperts`` (its
    ``E / world`` experts). A copy (``copy.deepcopy`` of the model) shares the group.
    """

    def __init__(
        self, group: dist.ProcessGroup, local: int, join_timeout: float | None = None
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local = local
        self.join_timeout = join_timeout

    @property
    def first_expert(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.local

    def __deepcopy__(self, memo: dict[int, object]) -> AllToAllDispatch:
        return AllToAllDispatch(self.group, self.local, self.join_timeout)

    def __repr__(self) -> str:
        last = self.first_expert + self.local - 1
        return (
            f"AllToAllDispatch(rank {self.rank} of {self.world}: experts "
            f"{self.first_expert}..{last})"
        )

    # Eager: it joins, then routes with split sizes read on the host (a compiled forward
    # breaks its graph here; fullgraph=True refuses, naming COMPILE_REFUSED).
    @torch.compiler.disable(reason=COMPILE_REFUSED)  # type: ignore[untyped-decorator, no-untyped-call]
    def __call__(
        self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        world, local, group = self.world, self.local, self.group
        if counts.shape != (world * local,):
            raise ValueError(
                f"{self!r} takes counts for {world * local} experts, got shape "
                f"{tuple(counts.shape)}"
            )
        if not joined(group):  # an MoE called outside a joined forward of its model
            join(group, describe_forward(experts), self.join_timeout)
        # 1. Counts: every rank's, every[s, e] = rank s's rows for expert e (one host read:
        # the splits of the two exchanges, and the whole batch's counts, by which 4-bit
        # experts draw their stochastic rounding as one process: experts_draw_frame).
        device = comm_device(group)
        send = counts.detach().to(device=device, dtype=torch.int64)
        flat = send.new_empty(world * send.numel())
        dist.all_gather_single(flat, send, group=group)
        every = flat.view(world, world * local).cpu()
        first = self.first_expert
        sent_rows = every[self.rank].view(world, local).sum(1).tolist()
        got_rows = every[:, first : first + local]  # got_rows[s, e]: rank s's for my e
        recv_rows = got_rows.sum(1).tolist()
        # 2. Rows out, ordered (source rank, my expert); regrouped (my expert, source rank).
        mine = _all_to_all(x, recv_rows, sent_rows, group)
        ids = torch.arange(local).repeat(world)
        expert_of_row = torch.repeat_interleave(ids, got_rows.flatten())
        order = torch.argsort(expert_of_row, stable=True).to(x.device)
        per_expert = got_rows.sum(0)
        offs = torch.cumsum(per_expert, 0).to(device=x.device, dtype=torch.int32)
        # 3. My experts. No row at all: one zero row past offs[-1] (its output and every
        # weight gradient are zero), so the experts' backward runs, as on the other ranks.
        rows = mine.index_select(0, order)
        with experts_draw_frame(every.sum(0), first):
            if rows.shape[0] == 0:
                pad = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
                y: torch.Tensor = experts(pad, offs)[:0]
            else:
                y = experts(rows, offs)
        # 4. Rows back, in the (source rank, my expert) order they came in.
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _all_to_all(y.index_select(0, back), sent_rows, recv_rows, group)


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights of every expert-parallel MoE in ``model``: each rank holds its own
    experts, so data parallelism must neither average nor shard them. Experts frozen for
    serving hold no weight (their codes are buffers, each rank's own): none of theirs."""
    out: list[nn.Parameter] = []
    for _, moe in _moe_layers(model):
        if isinstance(moe.dispatch, AllToAllDispatch):
            held = (getattr(moe.experts, n, None) for n in EXPERT_WEIGHTS)
            out.extend(w for w in held if isinstance(w, nn.Parameter))
    return out


def expert_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group ``model``'s experts are spread over (``expert_parallel``), or ``None``."""
    for _, moe in _moe_layers(model):
        if isinstance(moe.dispatch, AllToAllDispatch):
            return moe.dispatch.group
    return None


def expert_parallel(
    model: nn.Module, group: GroupArg = None, *, join_timeout: float | None = None
) -> list[str]:
    """Spread the experts of every ``computectx.nn.MoE`` in ``model`` over the ranks of
    ``group`` (a process group, a one-dimensional ``DeviceMesh`` (``mesh["ep"]``) or the
    default group), and route tokens to them with ``all_to_all_single``; returns the FQNs of
    the MoE layers (module docstring).

    Each MoE's expert count must be a multiple of the group's size (``ValueError`` naming the
    layer otherwise). Call it on the whole model on every rank, after building (and loading)
    it and before ``parallelize``, ``fully_shard`` or DDP and before building an optimizer
    (the expert weights become new ``Parameter`` objects). In a group of one it changes
    nothing. Every check runs on every rank and the verdicts are exchanged in one
    ``all_gather_object`` (``agree``), together with each rank's MoE layers and expert
    counts: a check that fails on one rank (a model not ``GroupedExperts`` there, already set
    up, already sharded, an expert count the group cannot divide), or layers that differ,
    raise the same error on every rank, naming the ranks, before any layer changes.

    Every forward of ``model`` (and of any of its MoE layers called alone) is then a
    collective: it first joins the group (``join``: a few store round trips), so a rank that
    runs a forward alone, an evaluation included, gets a ``RuntimeError`` naming the ranks
    that did not join after ``join_timeout`` seconds (``None``: the group's timeout) instead
    of waiting in ``all_to_all`` until the group's timeout; nothing was exchanged and the
    group stays usable. Ranks that enter different forwards together (one in eval mode, one
    training) get a ``RuntimeError`` on every rank.

    Checkpoints: ``state_dict()`` issues no collective (one rank may call it) and holds each
    expert weight as a DTensor of this rank's slice, marked with the rank and world that
    saved it. ``load_state_dict`` refuses (``ValueError``, before anything loads) such a
    slice saved by another rank, as ``if rank == 0: torch.save(model.state_dict())`` then a
    load on every rank would give every rank rank 0's experts. Save with
    ``torch.distributed.checkpoint`` on every rank (every rank's experts; it reshards to any
    world, one process included), or gather the whole experts with ``full_state_dict(model)``
    on every rank and save that on one rank: whole ``(E, ...)`` tensors load into one process
    or into any expert-parallel world (each rank takes its experts).
    """
    pg = data_parallel_group(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    layers = _moe_layers(model)

    def check() -> list[tuple[str, int, str]]:
        check_join_timeout(join_timeout)
        return [(fqn, _check_layer(fqn, moe, world), _describe(moe)) for fqn, moe in layers]

    everyone = agree(check, pg, what="expert_parallel", join_timeout=join_timeout)
    _check_same_layers(everyone)
    plan = [(fqn, moe, n) for (fqn, moe), (_, n, _) in zip(layers, everyone[rank], strict=True)]
    if world == 1:
        return [f for f, _, _ in plan]
    shards = [_spread_layer(fqn, moe, n, pg, join_timeout) for fqn, moe, n in plan]
    if plan:
        join_forwards(model, pg, join_timeout)
        JOIN_TIMEOUTS[pg] = join_timeout

        def refuse(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
            # Every expert slice is checked before any module of the model loads.
            for where, shard in shards:
                shard.check(state, prefix + where)

        model.register_load_state_dict_pre_hook(refuse)  # type: ignore[no-untyped-call]
    return [f for f, _, _ in plan]


def _check_same_layers(everyone: list[list[tuple[str, int, str]]]) -> None:
    """The same ``ValueError`` on every rank when the ranks' MoE layers (every rank's
    ``(fqn, experts, description)``, in rank order) differ from rank 0's, naming the first."""
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if not differ:
        return
    other = everyone[differ[0]]
    ours = {fqn: text for fqn, _, text in everyone[0]}
    theirs = {fqn: text for fqn, _, text in other}
    names = [f for f, _, _ in everyone[0]] + [f for f, _, _ in other if f not in ours]
    first = next((f for f in names if ours.get(f) != theirs.get(f)), names[0])
    raise ValueError(
        f"the ranks set up different MoE layers for expert parallelism: rank(s) "
        f"{', '.join(map(str, differ))} differ from rank 0; the first that differs is "
        f"{first or 'the model'!r}: rank 0 holds {ours.get(first, 'no such MoE')}, rank "
        f"{differ[0]} holds {theirs.get(first, 'no such MoE')}. Build the same model on "
        f"every rank; nothing changed"
    )


def _spread_layer(
    fqn: str, moe: MoE, n: int, pg: dist.ProcessGroup, join_timeout: float | None
) -> tuple[str, ExpertShards]:
    """Keep this rank's ``n // world`` of ``moe``'s ``n`` experts and route its tokens over
    ``pg``; returns the experts' key prefix and their ``ExpertShards``."""
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    local = n // world
    experts = moe.experts
    for attr in EXPERT_WEIGHTS:
        w = getattr(experts, attr)
        piece = w.detach()[rank * local : (rank + 1) * local].clone()
        setattr(experts, attr, nn.Parameter(piece, requires_grad=w.requires_grad))
    experts.n_experts = local
    moe.dispatch = AllToAllDispatch(pg, local, join_timeout)
    # An MoE called alone joins as itself ("forward of MoE ..."); inside a forward of
    # the model it is already joined.
    join_forwards(moe, pg, join_timeout)
    whole = {a: (n, *getattr(experts, a).shape[1:]) for a in EXPERT_WEIGHTS}
    shard = ExpertShards(pg, local, whole)
    shard.attach(experts)
    SHARDS[experts] = shard
    return (f"{fqn}.experts." if fqn else "experts.", shard)


def _describe(moe: MoE) -> str:
    """What the ranks compare of one MoE layer: every expert weight's whole shape and dtype
    (they size the exchanges and the experts' GEMMs) and the layer's configuration."""
    weights = ", ".join(
        f"{a} {tuple(getattr(moe.experts, a).shape)} {getattr(moe.experts, a).dtype}"
        for a in EXPERT_WEIGHTS
        if isinstance(getattr(moe.experts, a, None), torch.Tensor)
    )
    return (
        f"MoE(dim {moe.dim}, hidden {moe.hidden}, {moe.n_experts} experts, top_k "
        f"{moe.top_k}, balance {moe.balance!r}; {weights}; router {moe.router.extra_repr()})"
    )


def _check_layer(fqn: str, moe: MoE, world: int) -> int:
    """This rank's checks of one MoE layer (raises before anything changes); its expert
    count."""
    name = fqn or "the model"
    experts = moe.experts
    if not isinstance(experts, GroupedExperts):
        raise TypeError(f"{name}.experts is a {type(experts).__name__}, not GroupedExperts")
    if moe.dispatch is not None:
        raise ValueError(
            f"{name} already has a dispatch ({moe.dispatch!r}): expert_parallel runs once"
        )
    weights = [getattr(experts, n, None) for n in EXPERT_WEIGHTS]
    if any(w is None for w in weights):
        raise ValueError(
            f"{name}.experts are frozen for serving (their weights are codes): "
            f"expert_parallel spreads trainable experts. Call expert_parallel first, then "
            f"freeze the experts (each rank its own); nothing changed"
        )
    if any(isinstance(w, DTensor) for w in weights):
        raise RuntimeError(
            f"{name}'s experts are already sharded (DTensor): call expert_parallel before "
            f"parallelize / fully_shard"
        )
    n = int(getattr(experts, EXPERT_WEIGHTS[0]).shape[0])
    if n % world:
        raise ValueError(
            f"{name} has {n} experts, which {world} ranks cannot share evenly: expert "
            f"parallelism needs the expert count to be a multiple of the group's size"
        )
    return n


def same_ranks(a: dist.ProcessGroup | None, b: GroupArg) -> bool:
    """Whether the groups ``a`` and ``b`` (``None``: the default group) hold the same ranks."""
    ranks = [dist.get_process_group_ranks(data_parallel_group(g)) for g in (a, b)]
    return sorted(ranks[0]) == sorted(ranks[1])


def _full_norm(norm: torch.Tensor) -> torch.Tensor:
    full = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return full.detach().float()


def clip_grad_norm_with_experts(
    params: list[nn.Parameter],
    experts: tuple[nn.Parameter, ...],
    group: dist.ProcessGroup,
    max_norm: float,
    *,
    join_timeout: float | None = None,
) -> float:
    """Clip the gradients of ``params`` to the total norm ``max_norm`` and return the norm
    before, when the ``experts`` among them are each rank's own (``expert_parallel`` over
    ``group``): their squares are summed over the group (one all-reduce), the others' are
    the same on every rank (replicated, or DTensors whose norm is the whole one). Every rank
    gets the same norm, so every rank clips alike, and a non-finite norm (any rank's inf or
    NaN) is returned on all, nothing clipped.

    ``max_norm`` is checked first (``check_max_norm``: a real number > 0, ``math.inf`` to
    only measure). A collective: it joins ``group`` first (``join``; ``join_timeout`` or
    else ``expert_parallel``'s), so a rank that calls it alone gets a ``RuntimeError``
    naming the ranks that did not join, no gradient changed, and the group stays usable."""
    check_max_norm(max_norm)
    timeout = JOIN_TIMEOUTS.get(group) if join_timeout is None else join_timeout
    check_join_timeout(timeout)
    with joining(group, "clip_grad_norm_with_experts", timeout):
        return _clip_with_experts(params, experts, group, float(max_norm))


def _clip_with_experts(
    params: list[nn.Parameter],
    experts: tuple[nn.Parameter, ...],
    group: dist.ProcessGroup,
    max_norm: float,
) -> float:
    mine = {id(p) for p in experts}
    rest = [p for p in params if id(p) not in mine and p.grad is not None]
    own = [p for p in experts if p.grad is not None]
    zero = torch.zeros((), dtype=torch.float32)
    shared, local = (
        _full_norm(torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None]))
        if ps
        else zero
        for ps in (rest, own)
    )
    squares = (local.cpu() ** 2).reshape(1).to(comm_device(group))
    dist.all_reduce(squares, group=group)
    total = torch.sqrt(shared.cpu() ** 2 + squares.cpu().reshape(()))
    norm = float(total)
    if math.isfinite(norm):
        for ps in (rest, own):
            if ps:
                grad = ps[0].grad
                assert grad is not None
                torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total.to(grad.device))
    return norm


def moe_local_buffers(model: nn.Module) -> list[str]:
    """The names of every MoE's rank-local buffers (``MoE.local_buffer_names``): DDP must
    not broadcast rank 0's over the others'."""
    return [
        f"{fqn}.{b}" if fqn else b for fqn, m in _moe_layers(model) for b in m.local_buffer_names()
    ]
