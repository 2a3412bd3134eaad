"""FSDP2 on fp8 layers: bytes each rank all-gathers and step time, float32 gather against the
fp8 all-gather (``enable_quantized_all_gather``), and dynamic scaling's whole-batch amax against
rank-local, side by side from one run; then ``bf16`` and each fp8 recipe (``fp8_hybrid``,
``fp8_rowwise``, ``fp8_block``, ``fp8_mx``) set up through ``parallelize(strategy="fsdp")``,
with the ctx's mixed precision (gather at ``ctx.compute``, reduce-scatter at ``ctx.grad``)
and with ``mp_policy=MixedPrecisionPolicy()`` (every parameter gathered at its own dtype,
float32).

    python bench/bench_fsdp_gather.py                    # 2 gloo ranks on the CPU
    python bench/bench_fsdp_gather.py --dim 2048 --steps 10

Each configuration trains the same fp8 MLP (``--layers`` square ``--dim`` layers, each its
own ``fully_shard`` unit, no bias) on 2 spawned ranks; every rank counts the bytes it hands
to the all-gathers (forward and backward gathers) and times its steps. Targets: the per-
tensor fp8 all-gather sends at most 1.1 bytes per weight element, the 128x128-block one at
most 1.05 (1 byte of code and one float32 scale per 16384 elements), and what is not
gathered as fp8 goes at ``ctx.compute`` (2 bytes for bf16). Row and mx weights gather high
precision (docs/distributed.md); for them the table adds, as "fp8 (not
built)", what an fp8 gather would send, from the sizes of the quantized shards: the
forward gather's codes and scales along K, and the backward re-gather's along N (a row-wise
dgrad also needs a MAX all-reduce of K column amaxes, counted here). On the CPU with gloo
the step time is mostly the reference fp8 GEMMs; it is printed for the ratio, not as a GPU
figure. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import start_processes

from computectx import ComputeCtx
from computectx.distributed import enable_quantized_all_gather, sync_scaling
from computectx.formats import DynamicScaling, QuantizedLinear, Recipe

CONFIGS: list[tuple[str, str, str]] = [
    # (scaling, gather, current_amax)
    ("delayed", "hp", "group"),
    ("delayed", "fp8", "group"),
    ("dynamic", "fp8", "group"),
    ("dynamic", "fp8", "local"),
]


class _Sent:
    """Wraps ``dist.all_gather_single``, adding up the bytes this rank hands it (and the
    dtypes they travel in)."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.bytes = 0
        self.dtypes: set[str] = set()

    def __call__(self, out: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
        self.bytes += inp.numel() * inp.element_size()
        self.dtypes.add(str(inp.dtype).removeprefix("torch."))
        return self.original(out, inp, *args, **kwargs)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    results = []
    for scaling, gather, current in CONFIGS:
        ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
        if scaling == "dynamic":
            ctx = ctx.replace(recipe=Recipe(scaling=DynamicScaling()))
        torch.manual_seed(0)
        model = nn.Sequential(
            *(QuantizedLinear(args.dim, args.dim, bias=False, ctx=ctx) for _ in range(args.layers))
        )
        if gather == "fp8":
            enable_quantized_all_gather(model)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sync = sync_scaling(model, current_amax=current)  # type: ignore[arg-type]
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
        sent, step_s, _ = _steps(model, opt, x, args)
        sync.remove()
        elements = sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight"))
        elements //= world
        results.append(
            {
                "config": f"{scaling}, {gather} gather, {current} amax",
                "bytes_per_element": sent / (2 * args.steps * elements),
                "step_s": step_s,
            }
        )
    for flag in PARALLELIZE_FLAGS:
        for plain in (False, True):
            results.append(_through_parallelize(flag, plain, rank, world, args))
        if flag in ("fp8_rowwise", "fp8_mx"):
            results.append(_fp8_alternative(flag, world, args))
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


PARALLELIZE_FLAGS = ("bf16", "fp8_hybrid", "fp8_rowwise", "fp8_block", "fp8_mx")


def _steps(run: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, args: Any) -> Any:
    """Train ``warmup + steps`` steps; the bytes handed to the all-gathers in the last
    ``steps``, the median step time and the dtypes the gathers sent."""
    counter = _Sent(dist.all_gather_single)
    times = []
    dist.all_gather_single = counter  # type: ignore[assignment]
    try:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                counter.bytes = 0
            t0 = time.perf_counter()
            run(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
    finally:
        dist.all_gather_single = counter.original
    return counter.bytes, statistics.median(times[args.warmup :]), counter.dtypes


def _through_parallelize(
    flag: str, plain: bool, rank: int, world: int, args: argparse.Namespace
) -> dict[str, Any]:
    """``flag`` through ``parallelize(strategy="fsdp")``, with the ctx's mixed precision or
    (``plain``) ``mp_policy=MixedPrecisionPolicy()``: measured."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from computectx.distributed import parallelize

    ctx = ComputeCtx.from_flag(flag, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)))
    par = parallelize(
        model, ctx, strategy="fsdp", optimizer_class=torch.optim.SGD, lr=1e-3,
        fp8_filter=lambda m, fqn: True, offload=False,
        mp_policy=MixedPrecisionPolicy() if plain else None,
    )  # fmt: skip
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    sent, step_s, dtypes = _steps(par.model, par.optimizer, x, args)
    elements = args.layers * args.dim * args.dim // world
    if flag == "fp8_block" and not _gathers_blocks(model):
        dtypes = {"float32 (blocks cut)"}
    wire = "fp8" if dtypes == {"uint8"} else "/".join(sorted(dtypes))
    mp = "fp32 mp" if plain else "ctx mp"
    return {
        "config": f"{flag}, {wire} gather ({mp})",
        "bytes_per_element": sent / (2 * args.steps * elements),
        "step_s": step_s,
    }


def _gathers_blocks(model: nn.Module) -> bool:
    from computectx.distributed.fp8_all_gather import WeightGatheredQuantized, sharded_weight_of

    return all(
        isinstance(sharded_weight_of(m.weight), WeightGatheredQuantized)
        for m in model.modules()
        if isinstance(m, QuantizedLinear)
    )


def _fp8_alternative(flag: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """What one weight's fp8 gather would send under ``flag`` (row or mx), per element of
    a shard, averaged over a step's forward gather and backward re-gather."""
    from computectx.formats import quantize_tensor

    rows, k = args.dim // world, args.dim
    shard = torch.randn(rows, k)
    if flag == "fp8_mx":
        fwd = quantize_tensor(shard, "e4m3", granularity="mx")
        bwd = quantize_tensor(shard.t(), "e4m3", granularity="mx")  # 32-row blocks: shard-local
        extra = 0
    else:
        fwd = quantize_tensor(shard, "e4m3", granularity="row")
        # Wᵀ's rows are W's columns, which span every shard: the codes with the column
        # scales of the whole weight, after a MAX all-reduce of K float32 amaxes.
        bwd = (fwd[0], torch.empty(0))
        extra = 4 * k
    sent = sum(t.numel() * t.element_size() for t in (*fwd, *bwd)) + extra
    return {
        "config": f"{flag}, fp8 gather (not built)",
        "bytes_per_element": sent / (2 * rows * k),
        "step_s": float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    start_processes(  # type: ignore[no-untyped-call]  # torch leaves it untyped
        _rank, args=(2, port, args, queue), nprocs=2, start_method="spawn"
    )
    results = queue.get()
    base = results[0]
    print(
        f"2 gloo ranks, {args.layers} x QuantizedLinear({args.dim}, {args.dim}), "
        f"batch {args.batch} per rank, median of {args.steps} steps (torch {torch.__version__})"
    )
    print(f"{'configuration':40s} {'bytes/elem':>10s} {'vs fp32':>8s} {'step s':>8s} {'ratio':>6s}")
    for r in results:
        print(
            f"{r['config']:40s} {r['bytes_per_element']:10.4f} "
            f"{base['bytes_per_element'] / r['bytes_per_element']:7.2f}x "
            f"{r['step_s']:8.3f} {r['step_s'] / base['step_s']:6.2f}"
        )


if __name__ == "__main__":
    main()
