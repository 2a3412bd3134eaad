"""``DataParallelGradAccumulator``: low-precision gradient sums reduced across ranks once per step.

Why the sums are reduced by the accumulator, not by DDP: the accumulator's post-accumulate-grad
hook runs before DDP's reducer looks at a gradient (tensor hooks run inside autograd's
AccumulateGrad node; DDP's hook is a post hook of that node), so it always takes the *local*
gradient, and DDP then all-reduces nothing (it writes zeros into ``param.grad``). Reducing
after DDP would need every micro-batch to synchronise (K collectives a step) or the sums to
travel back to the compute device. Instead each rank sums its micro-batches locally on the
offload device, and the sums are all-reduced once, in one coalesced f32 collective, when they
are handed over (``OffloadedOptimizer.ingest_grads``, ``pop``, ``peek``, ``flush``): averaged
over the ranks as DDP averages, then rounded once into ``ctx.grad``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
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

__all__ = ["DataParallelGradAccumulator"]


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
    ``flush_to_param_grads``, or ``sync()`` itself) all-reduces every sum in one coalesced
    collective in f32 (f64 for an f64 ``ctx.grad``), divides by the world size and rounds
    once into ``ctx.grad``. Every rank must hand over at the same points.

    Given a DDP module, it registers a DDP comm hook that does no communication while the
    accumulator is open (DDP's own reduction is thus off, with or without ``no_sync()``)
    and DDP's plain average-all-reduce once it is closed; the zeros DDP writes into
    ``param.grad`` after a backward outside ``no_sync()`` are dropped at the hand-over.
    A DDP module takes one comm hook in its life: build a new DDP for another accumulator.
    Any other gradient found in ``param.grad`` at the hand-over (one written after the
    accumulator drained it) is an error that says what to do. FSDP2 (DTensor) parameters
    are refused: FSDP2 reduce-scatters the gradients itself.
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
    ) -> None:
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

    def _reduce(self) -> None:
        params = self.params
        work = torch.float64 if self.grad_dtype == DType.F64 else torch.float32
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        flat = torch.zeros(total + len(params), dtype=work, device=self.device)
        offset = 0
        for i, (p, n) in enumerate(zip(params, sizes, strict=True)):
            buf = super().peek(p)
            if buf is not None:
                flat[offset : offset + n].copy_(buf.reshape(-1))
                flat[total + i] = 1.0
            offset += n
        all_reduce_on(flat, self.group, dist.ReduceOp.SUM)
        flat[:total].div_(self.world_size)
        has = flat[total:].tolist()
        offset = 0
        for p, n, h in zip(params, sizes, has, strict=True):
            if h > 0:
                self.set_sum(p, flat[offset : offset + n].view(p.shape))
            offset += n

    def close(self) -> None:
        """Remove the hooks; DDP's comm hook goes back to plain averaging all-reduce."""
        for handle in self._marks:
            handle.remove()
        self._marks = []
        super().close()
