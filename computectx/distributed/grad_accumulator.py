"""``DataParallelGradAccumulator``: low-precision gradient sums reduced across ranks once per step.

Why the sums are reduced by the accumulator, not by DDP: the accumulator's post-accumulate-grad
hook runs before DDP's reducer looks at a gradient (tensor hooks run inside autograd's
AccumulateGrad node; DDP's hook is a post hook of that node), so it always takes the *local*
gradient, and DDP then all-reduces nothing (it writes zeros into ``param.grad``). Reducing
after DDP would need every micro-batch to synchronise (K collectives a step) or the sums to
travel back to the compute device. Instead each rank sums its micro-batches locally on the
offload device, and the sums are all-reduced once when they are handed over
(``OffloadedOptimizer.ingest_grads``, ``pop``, ``peek``, ``flush``): averaged over the ranks as
DDP averages, then rounded once into ``ctx.grad``.

The reduction runs in f32 through one reused bucket of at most ``bucket_mib`` (25 MiB by
default, as DDP's ``bucket_cap_mb``): the sums are copied into it in parameter order, a
parameter larger than the room left is split across buckets, and each bucket is all-reduced,
averaged and written back before the next is filled. The layout follows from the parameters'
sizes alone, so every rank runs the same collectives whatever its gradients. Each element is
summed over the ranks as in one vector of every parameter: on two ranks (a + b is b + a) the
sums are bitwise those of the one-vector reduction this replaced; on more, the backend's
order of summation may follow the message layout, as it does for DDP's buckets.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from computectx.ctx import ComputeCtx
from computectx.distributed.collectives import all_reduce_on
from computectx.distributed.group import GroupArg, data_parallel_group
from computectx.dtypes import DType
from computectx.memory import LowPrecGradAccumulator
from computectx.memory.accumulator import AccumMode, Transfer

__all__ = ["DEFAULT_BUCKET_MIB", "DataParallelGradAccumulator"]

DEFAULT_BUCKET_MIB = 25.0
"""The default bucket of ``DataParallelGradAccumulator`` (DDP's default ``bucket_cap_mb``)."""


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Elements ``start .. start + length`` of parameter ``param``'s sum, at ``offset``."""

    param: int
    start: int
    length: int
    offset: int


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """One collective: the pieces' values, then one presence flag per parameter in
    ``flags`` (those whose first piece is here): 1 where the rank holds a sum."""

    pieces: tuple[_Piece, ...]
    flags: tuple[int, ...]
    values: int

    @property
    def size(self) -> int:
        return self.values + len(self.flags)


def _layout(numels: Sequence[int], capacity: int) -> tuple[_Bucket, ...]:
    """Buckets of at most ``capacity`` (>= 2) elements holding every parameter in order."""
    buckets: list[_Bucket] = []
    pieces: list[_Piece] = []
    flags: list[int] = []
    used = 0
    for i, n in enumerate(numels):
        start = 0
        while True:
            flag = 1 if start == 0 else 0
            need = flag + (1 if start < n else 0)  # a first piece brings its flag
            if capacity - used - len(flags) < need:
                buckets.append(_Bucket(tuple(pieces), tuple(flags), used))
                pieces, flags, used = [], [], 0
            take = min(n - start, capacity - used - len(flags) - flag)
            pieces.append(_Piece(i, start, take, used))
            flags.extend([i] * flag)
            used += take
            start += take
            if start >= n:
                break
    if pieces:
        buckets.append(_Bucket(tuple(pieces), tuple(flags), used))
    return tuple(buckets)


def _check_bucket_mib(bucket_mib: object, itemsize: int) -> int:
    """``bucket_mib`` in bytes, after checking it."""
    if isinstance(bucket_mib, bool) or not isinstance(bucket_mib, (int, float)):
        raise TypeError(f"bucket_mib must be a number of MiB (e.g. 25), got {bucket_mib!r}")
    if not (math.isfinite(bucket_mib) and bucket_mib > 0):
        raise ValueError(
            f"bucket_mib must be a positive, finite number of MiB (the most memory the "
            f"reduction's bucket takes; default {DEFAULT_BUCKET_MIB:g}), got {bucket_mib!r}"
        )
    nbytes = int(bucket_mib * 2**20)
    if nbytes < 2 * itemsize:
        raise ValueError(
            f"bucket_mib={bucket_mib!r} is {nbytes} byte(s); a bucket needs at least "
            f"{2 * itemsize} (one value and one presence flag of {itemsize} bytes each)"
        )
    return nbytes


class _CommState:
    """What DDP's comm hook needs: the accumulator (weakly) and DDP's own group."""

    def __init__(self, acc: DataParallelGradAccumulator, group: dist.ProcessGroup) -> None:
        self.acc = weakref.ref(acc)
        self.group = group


def _comm_hook(state: _CommState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    acc = state.acc()
    if acc is None or acc.closed:
        # Without a live accumulator DDP reduces as it always does (average over the group).
        return allreduce_hook(state.group, bucket)
    # The accumulator drained these gradients and reduces its sums itself: no communication.
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks the hook's annotations as objects; ``from __future__ import annotations`` made
# them strings.
_comm_hook.__annotations__ = {
    "state": _CommState,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}


class DataParallelGradAccumulator(LowPrecGradAccumulator):
    """A ``LowPrecGradAccumulator`` whose sums are averaged over a data-parallel group.

    ``model`` is a ``DistributedDataParallel`` module, a plain module replicated by hand, or
    an iterable of its parameters. Each rank sums its own micro-batch gradients (as the
    base class does, in ``ctx.grad`` on ``ctx.offload_device``); the first hand-over after
    new gradients (``OffloadedOptimizer.ingest_grads``, ``pop``, ``peek``,
    ``flush_to_param_grads``, or ``sync()`` itself) all-reduces every sum in f32 (f64 for an
    f64 ``ctx.grad``), divides by the world size and rounds once into ``ctx.grad``. Every
    rank must hand over at the same points.

    Given a DDP module, it registers a DDP comm hook that does no communication while the
    accumulator is open (DDP's own reduction is thus off, with or without ``no_sync()``)
    and DDP's plain average-all-reduce once it is closed; the zeros DDP writes into
    ``param.grad`` after a backward outside ``no_sync()`` are dropped at the hand-over.
    A DDP module takes one comm hook in its life: build a new DDP for another accumulator.
    Any other gradient found in ``param.grad`` at the hand-over (one written after the
    accumulator drained it) is an error that says what to do. FSDP2 (DTensor) parameters
    are refused: FSDP2 reduce-scatters the gradients itself.

    The reduction goes through one bucket of at most ``bucket_mib`` MiB (keyword; 25 by
    default, as DDP's ``bucket_cap_mb``), kept for the next hand-over and counted by
    ``memory_report`` under ``accumulator``; a smaller model gets a bucket of its own size.
    A parameter larger than the room left is reduced in pieces. One collective per bucket
    (``buckets``), the same on every rank: the layout follows from the parameters' sizes
    only. Each element is summed as in one all-reduce of every sum, so on two ranks the
    result is bitwise the one-vector result; more ranks may sum in another order, as DDP's
    buckets do.
    """

    def __init__(
        self,
        model: torch.nn.Module | Iterable[torch.Tensor],
        ctx: ComputeCtx,
        *,
        group: GroupArg = None,
        mode: AccumMode = "nearest",
        transfer: Transfer = "auto",
        seed: int = 0,
        bucket_mib: float = DEFAULT_BUCKET_MIB,
    ) -> None:
        if not isinstance(ctx, ComputeCtx):
            raise TypeError(f"ctx must be a ComputeCtx, got {type(ctx).__name__}")
        # Checked before any hook is registered (the base class registers them).
        work = torch.float64 if ctx.grad == DType.F64 else torch.float32
        self._bucket_bytes = _check_bucket_mib(bucket_mib, work.itemsize)
        self._work = work
        self._layout: tuple[tuple[int, ...], tuple[_Bucket, ...]] | None = None
        self._bucket: torch.Tensor | None = None
        ddp = model if isinstance(model, DistributedDataParallel) else None
        # DDP's own group by default: the sums are reduced over the ranks DDP replicates on.
        pg = ddp.process_group if group is None and ddp is not None else data_parallel_group(group)
        if isinstance(model, torch.nn.Module):
            params: list[Any] = list(model.parameters())
        elif isinstance(model, torch.Tensor):
            raise TypeError(
                "model must be a DistributedDataParallel module, a module or an iterable of "
                "its parameters, got a single Tensor"
            )
        else:
            params = list(model)
        sharded = [i for i, p in enumerate(params) if isinstance(p, DTensor)]
        if sharded:
            raise TypeError(
                f"parameters {sharded[:8]} are DTensors (FSDP2 fully_shard): FSDP2 "
                f"reduce-scatters gradients itself and a DataParallelGradAccumulator would "
                f"reduce them twice; accumulate with FSDP2's set_requires_gradient_sync "
                f"instead (see docs/distributed.md)"
            )
        super().__init__(params, ctx, mode=mode, transfer=transfer, seed=seed)
        self.group = pg
        self.ddp = ddp
        self._dirty = False
        self._reducing = False
        self._marks: list[RemovableHandle] = []
        for p in self.params:
            # Registered after the base class's hook, so it runs after the drain.
            handle = p.register_post_accumulate_grad_hook(self._mark)  # type: ignore[no-untyped-call]
            self._marks.append(handle)
        if ddp is not None:
            try:
                ddp.register_comm_hook(_CommState(self, ddp.process_group), _comm_hook)
            except RuntimeError as e:
                self.close()
                raise RuntimeError(
                    f"could not turn DDP's own gradient reduction off ({e}); a DDP module "
                    f"takes one comm hook in its life: wrap the model in a new "
                    f"DistributedDataParallel for this accumulator"
                ) from e

    def _mark(self, param: torch.Tensor) -> None:
        self._dirty = True

    @property
    def bucket_bytes(self) -> int:
        """The most bytes the reduction's bucket holds (``bucket_mib`` in bytes)."""
        return self._bucket_bytes

    @property
    def buckets(self) -> tuple[int, ...]:
        """The size in elements of each bucket, in order: one collective each per reduction.

        Each holds its pieces of the sums and one presence flag per parameter starting in
        it, so the sizes add up to the parameters' elements plus their number.
        """
        return tuple(b.size for b in self._buckets())

    @property
    def world_size(self) -> int:
        """How many ranks the sums are averaged over."""
        return dist.get_world_size(self.group)

    def sync(self) -> None:
        """All-reduce (average) the local sums over the group, once per batch of new gradients."""
        if self._reducing or not self._dirty:
            return
        self._reducing = True
        try:
            self._drop_ddp_writes()
            self._reduce()
            self._dirty = False
        finally:
            self._reducing = False

    def _drop_ddp_writes(self) -> None:
        late = [p for p in self.params if p.grad is not None]
        if not late:
            return
        if self.ddp is not None:
            with torch.no_grad():
                # One host read for all of them, not one per parameter.
                nonzero = bool(
                    torch.stack([p.grad.any() for p in late if p.grad is not None]).any()
                )
            if not nonzero:
                for p in late:
                    p.grad = None  # what DDP wrote under the no-communication hook: zeros
                return
        raise RuntimeError(
            f"{len(late)} parameter(s) drained by the DataParallelGradAccumulator have a "
            f"param.grad written after the accumulator took their gradient, so it cannot tell "
            f"what was reduced. If the model is wrapped in DistributedDataParallel, build the "
            f"accumulator from the DDP module itself (DataParallelGradAccumulator(ddp_model, "
            f"ctx)) so that DDP's reduction is turned off; otherwise do not set param.grad "
            f"on tracked parameters"
        )

    def _buckets(self) -> tuple[_Bucket, ...]:
        numels = tuple(p.numel() for p in self.params)
        if self._layout is None or self._layout[0] != numels:
            capacity = self._bucket_bytes // self._work.itemsize
            self._layout = numels, _layout(numels, capacity)
        return self._layout[1]

    def _reduce(self) -> None:
        params = self.params
        buckets = self._buckets()
        size = max((b.size for b in buckets), default=0)
        if self._bucket is None or self._bucket.numel() < size:
            self._bucket = None  # the old one goes before the new one comes
            self._bucket = torch.empty(size, dtype=self._work, device=self.device)
        sums = [super(DataParallelGradAccumulator, self).peek(p) for p in params]
        world = self.world_size
        present: dict[int, bool] = {}
        for b in buckets:
            bucket = self._bucket[: b.size]
            for piece in b.pieces:
                part = bucket[piece.offset : piece.offset + piece.length]
                local = sums[piece.param]
                if local is None:
                    part.zero_()
                else:
                    # Pieces of one sum never overlap, so the ones written back already
                    # (the earlier elements) are never read again.
                    part.copy_(local.view(-1)[piece.start : piece.start + piece.length])
            flags = [0.0 if sums[i] is None else 1.0 for i in b.flags]
            bucket[b.values :].copy_(torch.tensor(flags, dtype=self._work))
            all_reduce_on(bucket, self.group, dist.ReduceOp.SUM)
            bucket[: b.values].div_(world)
            present.update(zip(b.flags, (h > 0 for h in bucket[b.values :].tolist()), strict=True))
            for piece in b.pieces:
                if present[piece.param]:
                    part = bucket[piece.offset : piece.offset + piece.length]
                    self.set_sum_part(params[piece.param], piece.start, part)

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The base class's tensors, and the reduction's bucket as ``("accumulator", b)``."""
        yield from super().memory_tensors()
        if self._bucket is not None:
            yield "accumulator", self._bucket

    def close(self) -> None:
        """Remove the hooks and release the bucket; DDP's comm hook goes back to plain
        averaging all-reduce."""
        for handle in self._marks:
            handle.remove()
        self._marks = []
        self._bucket = None
        super().close()
