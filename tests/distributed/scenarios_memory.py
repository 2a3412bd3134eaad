"""Scenarios for the memory policy on many ranks (``test_parallel_memory.py``).

Every scenario runs on 2 ranks and, as the reference, in one process (world_size=1) on the whole
batch: the same global micro-batches, split evenly over the ranks, with mean losses, so the
ranks' averaged gradient is the one process's gradient up to float summation order. The
reference uses the plain single-process classes (no DDP, no FSDP2, no computectx.distributed).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx, DType
from computectx.distributed import DataParallelGradAccumulator, ShardedParams
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer, memory_report
from computectx.memory.accumulator import AccumMode

STEPS, MICRO, ROWS = 4, 3, 4  # global micro-batches of ROWS rows, MICRO per step


def _ctx(grad: DType) -> ComputeCtx:
    return ComputeCtx.parity("cpu").replace(
        grad=grad, master=DType.F32, offload=torch.device("cpu")
    )


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, MICRO, ROWS, 8, generator=g) * 3
    y = torch.randn(STEPS, MICRO, ROWS, 2, generator=g)
    return x, y


def _shard(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def _full(model: torch.nn.Module) -> torch.Tensor:
    """Every weight of the model, whole (FSDP2 shards gathered), as one f32 vector."""
    parts = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1).float() for p in parts])


def _grad(t: torch.Tensor) -> torch.Tensor:
    if t.grad is None:
        raise AssertionError("a parameter has no gradient")
    return t.grad


def _mean_over_ranks(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _roundtrip(sd: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded: dict[str, Any] = torch.load(buf, weights_only=True)
    return loaded


class _CountAllReduce:
    """Counts torch.distributed.all_reduce calls made while it is active."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = dist.all_reduce

    def __enter__(self) -> _CountAllReduce:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._orig


def ddp_accumulator(params: dict[str, Any]) -> dict[str, Any]:
    """DDP + DataParallelGradAccumulator + OffloadedOptimizer against one process.

    Reports, per rank: the f32-sum training run (global loss, clip norm, final weights), a
    bitwise resume from a mid-run checkpoint, the all-reduce count per step, the first step's
    bf16 summed gradients, and the errors of the two misuse patterns.
    """
    world = dist.get_world_size()
    x, y = _data()
    out: dict[str, Any] = {}

    def run(
        model: torch.nn.Module, acc: LowPrecGradAccumulator, opt: OffloadedOptimizer, steps: range
    ) -> tuple[list[float], list[float], int]:
        losses, norms = [], []
        with _CountAllReduce() as counter:
            for s in steps:
                total = 0.0
                for k in range(MICRO):
                    # the natural DDP pattern: no_sync on all but the last micro-batch
                    last = k == MICRO - 1
                    sync = contextlib.nullcontext() if world == 1 or last else model.no_sync()  # type: ignore[operator]
                    with sync:
                        loss = torch.nn.functional.mse_loss(model(_shard(x[s, k])), _shard(y[s, k]))
                        (loss / MICRO).backward()  # type: ignore[no-untyped-call]
                    total += float(loss) / MICRO
                opt.ingest_grads(acc)
                assert all(p.grad is None for p in model.parameters())
                norms.append(opt.clip_grad_norm(0.5))
                opt.step()
                opt.zero_grad()
                losses.append(total)
        return losses, norms, counter.calls

    def build(grad: DType, seed: int = 0) -> tuple[Any, Any, OffloadedOptimizer]:
        ctx = _ctx(grad)
        net = _model(seed)
        model: torch.nn.Module
        acc: LowPrecGradAccumulator
        if world == 1:  # the reference: one process, single-process classes only
            model, acc = net, LowPrecGradAccumulator(net.parameters(), ctx)
        else:
            model = DistributedDataParallel(net)
            acc = DataParallelGradAccumulator(model, ctx)
        opt = OffloadedOptimizer(model.parameters(), ctx, torch.optim.AdamW, lr=1e-2)
        return model, acc, opt

    # f32 sums: training against one process, then a bitwise resume.
    model, acc, opt = build(DType.F32)
    losses, norms, calls = run(model, acc, opt, range(2))
    state = _roundtrip(opt.state_dict())
    more_losses, more_norms, _ = run(model, acc, opt, range(2, STEPS))
    out["loss"] = _mean_over_ranks(losses + more_losses)
    out["norm"] = torch.tensor(norms + more_norms, dtype=torch.float64)
    out["weights"] = _full(model)
    out["all_reduce_per_step"] = calls / 2
    out["masters_on"] = str(opt.master_params[0].device)

    model2, acc2, opt2 = build(DType.F32, seed=5)  # other initial weights: the load restores
    opt2.load_state_dict(state)
    run(model2, acc2, opt2, range(2, STEPS))
    out["resumed_weights"] = _full(model2)

    # bf16 sums: the first step's summed gradients as the optimizer receives them.
    model3, acc3, opt3 = build(DType.BF16)
    for k in range(MICRO):
        sync = contextlib.nullcontext() if world == 1 or k == MICRO - 1 else model3.no_sync()
        with sync:
            out_k = model3(_shard(x[0, k]))
            loss = torch.nn.functional.mse_loss(out_k, _shard(y[0, k])) / MICRO
            loss.backward()  # type: ignore[no-untyped-call]
    opt3.ingest_grads(acc3)
    out["bf16_grads"] = torch.cat([_grad(m).reshape(-1) for m in opt3.master_params])

    if world > 1:
        # Misuse 1: the plain accumulator under DDP (the bug of issue 10) is a clear error.
        net = DistributedDataParallel(_model())
        plain = LowPrecGradAccumulator(net.parameters(), _ctx(DType.F32))
        opt4 = OffloadedOptimizer(net.parameters(), _ctx(DType.F32), torch.optim.AdamW)
        for k in range(MICRO):
            sync = contextlib.nullcontext() if k == MICRO - 1 else net.no_sync()
            with sync:
                net(_shard(x[0, k])).pow(2).mean().backward()
        before = [m.clone() for m in opt4.master_params]
        try:
            opt4.ingest_grads(plain)
            out["plain_error"] = ""
        except RuntimeError as e:
            out["plain_error"] = str(e)
        out["plain_untouched"] = (
            all(
                m.grad is None and torch.equal(m, b)
                for m, b in zip(opt4.master_params, before, strict=True)
            )
            and plain.micro_batches == MICRO
        )
        # Misuse 2: built from the DDP module's parameters, not the module: DDP still reduces.
        net = DistributedDataParallel(_model())
        from_params = DataParallelGradAccumulator(net.parameters(), _ctx(DType.F32))
        net(_shard(x[0, 0])).pow(2).mean().backward()
        try:
            from_params.sync()
            out["params_error"] = ""
        except RuntimeError as e:
            out["params_error"] = str(e)
        # A second accumulator on the same DDP module: DDP takes one comm hook.
        try:
            DataParallelGradAccumulator(model, _ctx(DType.F32))
            out["second_error"] = ""
        except RuntimeError as e:
            out["second_error"] = str(e)
    return out


def fsdp2_optimizer(params: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 + OffloadedOptimizer(sharding=ShardedParams(mesh)) against one process.

    Four steps with the global norm clipped, one of them (step 1) carrying an inf in a
    gradient row that only the last rank holds and no clip call, so step() itself must skip
    on every rank; another (step 2) gets its inf on the last rank after the clip (that rank's
    kept verdict is stale, the others' is not: all must still skip, with the same collectives);
    then a bitwise resume from the checkpoint after step 1.
    """
    world = dist.get_world_size()
    x, y = _data()
    x, y = x.reshape(STEPS, MICRO * ROWS, 8), y.reshape(STEPS, MICRO * ROWS, 2)
    ctx = _ctx(DType.F32)
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    out: dict[str, Any] = {}

    def build(seed: int) -> tuple[torch.nn.Module, OffloadedOptimizer]:
        model = _model(seed)
        if mesh is None:  # the reference: one plain process
            return model, OffloadedOptimizer(model.parameters(), ctx, torch.optim.AdamW, lr=1e-2)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = OffloadedOptimizer(
            model.parameters(), ctx, torch.optim.AdamW, sharding=ShardedParams(mesh), lr=1e-2
        )
        return model, opt

    def run(
        model: torch.nn.Module, opt: OffloadedOptimizer, steps: range
    ) -> tuple[list[float], list[float]]:
        losses, norms = [], []
        for s in steps:
            loss = torch.nn.functional.mse_loss(model(_shard(x[s])), _shard(y[s]))
            loss.backward()  # type: ignore[no-untyped-call]
            losses.append(float(loss))
            if s == 1:
                w = _grad(next(model.parameters()))  # the first Linear's weight
                g = w.to_local() if isinstance(w, DTensor) else w
                if dist.get_rank() == world - 1:
                    g[-1, 0] = float("inf")  # the last row lives on the last rank only
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    opt.step()
                norms.append(float("nan"))
            else:
                norms.append(opt.clip_grad_norm(0.5))
                if s == 2 and dist.get_rank() == world - 1:
                    # After the clip, on the last rank only: its kept verdict no longer
                    # holds, so it looks again; every rank must still agree (and run the
                    # same collectives): all of them skip step 2.
                    master_grad = _grad(opt.master_params[0])
                    with torch.no_grad():
                        master_grad[-1, 0] = float("inf")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    opt.step()
            opt.zero_grad()
        return losses, norms

    model, opt = build(0)
    if mesh is not None:  # FSDP2 reduce-scatters itself: the DDP accumulator refuses it
        try:
            DataParallelGradAccumulator(model, ctx)
            out["accumulator_error"] = ""
        except TypeError as e:
            out["accumulator_error"] = str(e)
        try:  # DTensor parameters without sharding= are refused, naming what to pass
            OffloadedOptimizer(model.parameters(), ctx)
            out["unsharded_error"] = ""
        except TypeError as e:
            out["unsharded_error"] = str(e)
    masters = opt.master_params
    out["master_types"] = sorted({type(m).__name__ for m in masters})
    out["master_devices"] = sorted({str(m.device) for m in masters})
    out["master_numel"] = sum(m.numel() for m in masters)
    losses, norms = run(model, opt, range(2))
    state = _roundtrip(opt.state_dict())
    l2, n2 = run(model, opt, range(2, STEPS))
    out["loss"] = _mean_over_ranks(losses + l2)
    out["norm"] = torch.tensor(norms + n2, dtype=torch.float64)
    out["skipped"] = opt.skipped_steps
    out["weights"] = _full(model)
    out["state_numel"] = sum(
        t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0
    )

    model2, opt2 = build(5)
    opt2.load_state_dict(state)
    run(model2, opt2, range(2, STEPS))
    out["resumed_weights"] = _full(model2)
    return out


def memory_policy(params: dict[str, Any]) -> dict[str, Any]:
    """Both scenarios in one process per rank (each rank process costs seconds to start)."""
    out = {f"ddp/{k}": v for k, v in ddp_accumulator(params).items()}
    out.update({f"fsdp2/{k}": v for k, v in fsdp2_optimizer(params).items()})
    return out


# ----- the DP accumulator's buckets (test_memory_units.py) --------------------------------

TINY_MIB = 40 / 2**20  # 10 f32 elements: many buckets, most parameters split across several
BUCKET_CASES: dict[str, tuple[DType, AccumMode]] = {
    "f32": (DType.F32, "nearest"),
    "bf16": (DType.BF16, "nearest"),
    "bf16_sr": (DType.BF16, "stochastic"),
}


class _Branches(torch.nn.Module):
    """A trunk and two heads: rank 0 trains ``head_a``, every other rank ``head_b``, and no
    rank ``unused``, so which sums a rank holds depends on its data. ``skew`` is stored
    transposed (a non-contiguous parameter and gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = torch.nn.Linear(8, 16)
        self.head_a = torch.nn.Linear(16, 3)
        self.head_b = torch.nn.Linear(16, 2)
        self.unused = torch.nn.Linear(2, 2)
        self.skew = torch.nn.Parameter(torch.randn(6, 5).t())

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        head = self.head_a if rank == 0 else self.head_b
        loss: torch.Tensor = head(h).pow(2).mean() + (h[:, :5] @ self.skew).sin().mean()
        return loss


def _unbucketed_reduce(acc: LowPrecGradAccumulator) -> None:
    """The DP reduction as it was before buckets, written out: one f32 vector of every sum
    with a presence flag per parameter, one all-reduce, then ``set_sum`` per parameter."""
    params = acc.params
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    flat = torch.zeros(total + len(params))
    offset = 0
    for i, (p, n) in enumerate(zip(params, sizes, strict=True)):
        buf = acc.peek(p)
        if buf is not None:
            flat[offset : offset + n].copy_(buf.reshape(-1))
            flat[total + i] = 1.0
        offset += n
    dist.all_reduce(flat)
    flat[:total].div_(dist.get_world_size())
    offset = 0
    for p, n, h in zip(params, sizes, flat[total:].tolist(), strict=True):
        if h > 0:
            acc.set_sum(p, flat[offset : offset + n].view(p.shape))
        offset += n


def dp_buckets(params: dict[str, Any]) -> dict[str, Any]:
    """For each grad dtype and rounding mode, the same micro-batches into three accumulators:
    the unbucketed reduction above, a DataParallelGradAccumulator with tiny buckets and one
    with the default 25 MiB; their reduced sums, collectives per reduction, bucket sizes and
    what memory_report counts."""
    rank = dist.get_rank()
    x, _ = _data()
    out: dict[str, Any] = {}
    for case, (grad, mode) in BUCKET_CASES.items():
        ctx = _ctx(grad)
        ref_model, tiny_model, default_model = _Branches(), _Branches(), _Branches()
        ref = LowPrecGradAccumulator(ref_model.parameters(), ctx, mode=mode)
        tiny = DataParallelGradAccumulator(tiny_model, ctx, mode=mode, bucket_mib=TINY_MIB)
        default = DataParallelGradAccumulator(default_model, ctx, mode=mode)
        for model in (ref_model, tiny_model, default_model):
            for k in range(MICRO):
                model(_shard(x[0, k]), rank).backward()
        # The plain accumulator's peek does not reduce: these are the rank's own sums.
        local = [ref.peek(p) for p in ref.params]
        local_bytes = sum(s.untyped_storage().nbytes() for s in local if s is not None)
        _unbucketed_reduce(ref)
        out[f"{case}/ref"] = [ref.peek(p) for p in ref.params]
        for name, acc in (("tiny", tiny), ("default", default)):
            before = memory_report(accumulator=acc).bytes(role="accumulator")
            with _CountAllReduce() as counter:
                acc.sync()
            sums = [acc.peek(p) for p in acc.params]
            out[f"{case}/{name}"] = sums
            out[f"{case}/{name}_calls"] = counter.calls
            out[f"{case}/{name}_buckets"] = list(acc.buckets)
            out[f"{case}/{name}_bucket_bytes"] = acc.bucket_bytes
            held = sum(s.untyped_storage().nbytes() for s in sums if s is not None)
            after = memory_report(accumulator=acc).bytes(role="accumulator")
            out[f"{case}/{name}_counted_before"] = before - local_bytes
            out[f"{case}/{name}_counted_extra"] = after - held
            acc.close()
            out[f"{case}/{name}_counted_closed"] = (
                memory_report(accumulator=acc).bytes(role="accumulator") - held
            )
        out[f"{case}/contiguous"] = all(
            s.is_contiguous() for s in out[f"{case}/tiny"] if s is not None
        )
    # FSDP2 sums gradients itself: a LowPrecGradAccumulator's (DTensor) sums are refused at
    # the hand-over, before anything moves.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = _model()
    fully_shard(sharded, mesh=mesh)
    ctx = _ctx(DType.BF16)
    plain = LowPrecGradAccumulator(sharded.parameters(), ctx)
    opt = OffloadedOptimizer(sharded.parameters(), ctx, sharding=ShardedParams(mesh))
    sharded(_shard(x[0, 0])).pow(2).mean().backward()
    try:
        opt.ingest_grads(plain)
        out["fsdp2_error"] = ""
    except TypeError as e:
        out["fsdp2_error"] = str(e)
    out["fsdp2_untouched"] = plain.micro_batches == 1 and all(
        m.grad is None for m in opt.master_params
    )
    named = list(_Branches().named_parameters())
    out["names"] = [n for n, _ in named]
    out["numels"] = [p.numel() for _, p in named]
    return out
