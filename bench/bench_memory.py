"""Bytes per parameter on the compute device, and step time, for the offloaded memory policy
against plain mixed-precision AdamW, from one run.

    python bench/bench_memory.py                 # CUDA when available, else CPU
    python bench/bench_memory.py --device cpu    # CPU-only: same figures, see the note printed
    python bench/bench_memory.py --dp-reduce     # the DP accumulator's reduction, 2 gloo ranks
    python bench/bench_memory.py --optim-state   # master + AdamW state bytes per optim_state

Plain: f32 weights on the compute device, bf16 autocast, f32 gradients, AdamW state on the
compute device (the 16 bytes/param baseline). Offloaded: bf16 weights on the compute device,
``LowPrecGradAccumulator`` (bf16 buffers) and ``OffloadedOptimizer`` (f32 masters + AdamW
state) on the host. Both sides use fused AdamW; neither clips, so the offloaded step
includes its own non-finite-gradient check (one summing pass over the master gradients,
which a ``clip_grad_norm`` call would make free). Targets (GPU): at most 4 bytes/param on
the compute device, at most 20% slower per step. Nothing is asserted; the script prints the
figures side by side.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from computectx import ComputeCtx, DType
from computectx.demo.footprint import adamw_moment_bytes
from computectx.distributed import DataParallelGradAccumulator
from computectx.distributed.grad_accumulator import DEFAULT_BUCKET_MIB
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer, memory_report
from computectx.memory.accounting import Role
from computectx.optim_state import OptimState

COMPUTE_ROLES: tuple[Role, ...] = ("params", "grads")


def build(dim: int, layers: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(dim, dim), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).to(device=device, dtype=dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    backwards: Callable[[], None],
    update: Callable[[], None],
    device: torch.device,
    warmup: int,
    steps: int,
) -> tuple[float, float]:
    """Median seconds of the backward phase and of the optimizer phase of a step."""
    for _ in range(warmup):
        backwards()
        update()
    fb, opt = [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        backwards()
        sync(device)
        t1 = time.perf_counter()
        update()
        sync(device)
        fb.append(t1 - t0)
        opt.append(time.perf_counter() - t1)
    return statistics.median(fb), statistics.median(opt)


# ----- --dp-reduce: DataParallelGradAccumulator's reduction on 2 gloo ranks -----------------

# Eight 2048x2048 layers and a 32000x1024 embedding: 66.3M parameters, 253 MiB of f32 sums.
DP_SHAPES = [(2048, 2048)] * 8 + [(32000, 1024)]


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    return kib / 1024


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets VmHWM to the current RSS
        f.write("5")


Reduce = Callable[[LowPrecGradAccumulator], None]


def _one_vector(acc: LowPrecGradAccumulator) -> None:
    """The reduction before buckets: one f32 vector of every sum and a flag per parameter."""
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


def _dp_rank(rank: int, world: int, port: int, grad: str, steps: int, variant: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = ComputeCtx.parity("cpu").replace(grad=DType.parse(grad), offload=torch.device("cpu"))
    params = [torch.nn.Parameter(torch.zeros(s)) for s in DP_SHAPES]
    variants: list[tuple[str, Callable[[], LowPrecGradAccumulator], Reduce]] = [
        ("one f32 vector (before)", lambda: LowPrecGradAccumulator(params, ctx), _one_vector),
        (
            f"{DEFAULT_BUCKET_MIB:g} MiB buckets",
            lambda: DataParallelGradAccumulator(params, ctx),
            lambda acc: acc.sync(),  # DataParallelGradAccumulator.sync reduces
        ),
    ]
    # One variant per pair of processes: memory freed by another would be reused unseen.
    name, make, reduce = variants[variant]
    acc = make()
    seconds, growth = [], []
    for _ in range(steps):
        torch.stack([p.sum() for p in params]).sum().backward()  # type: ignore[no-untyped-call]
        dist.barrier()
        _reset_peak_rss()
        base = _peak_rss_mib()
        t0 = time.perf_counter()
        reduce(acc)
        seconds.append(time.perf_counter() - t0)
        growth.append(_peak_rss_mib() - base)
        for p in params:
            acc.pop(p)
    # With the sums handed over, what the accumulator still holds.
    kept = memory_report(accumulator=acc).bytes(role="accumulator")
    if rank == 0:
        print(
            f"grad={grad:<4} {name:<24} reduce {statistics.median(seconds) * 1e3:6.0f} ms "
            f"(median of {steps}), peak RSS growth {max(growth):6.1f} MiB, kept "
            f"{kept / 2**20:5.1f} MiB",
            flush=True,
        )
    acc.close()
    dist.destroy_process_group()


def dp_reduce(grad: str, steps: int) -> None:
    """Time one reduction each way on 2 gloo ranks (a fresh pair of processes for each)."""
    n = sum(a * b for a, b in DP_SHAPES)
    print(f"{len(DP_SHAPES)} parameters, {n:,} elements; sums in {grad}; 2 gloo ranks, 1 thread")
    spawn = multiprocessing.get_context("spawn")
    for variant in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = (2, port, grad, steps, variant)
        ranks = [spawn.Process(target=_dp_rank, args=(r, *args)) for r in range(2)]
        for proc in ranks:
            proc.start()
        for proc in ranks:
            proc.join()
        if any(proc.exitcode != 0 for proc in ranks):
            raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in ranks]}")


# ----- --optim-state: master + AdamW moments per optim_state, measured and computed ---------

STATE_FORMATS = ("f32", "bf16", "int8", "fp8", "int4")
# Llama 3 8B: vocabulary 128256, width 4096, 32 blocks (GQA: 8 KV heads of 128), MLP 14336,
# untied head; 8,030,261,248 parameters.
LLAMA3_8B: list[tuple[int, ...]] = [(128256, 4096), (128256, 4096), (4096,)] + 32 * [
    (4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
    (14336, 4096), (14336, 4096), (4096, 14336), (4096,), (4096,),
]  # fmt: skip


def adamw_bytes(shapes: list[tuple[int, ...]], state: str, master: DType) -> tuple[int, int]:
    """``(master, AdamW state)`` bytes for parameters of ``shapes``, from the codecs'
    accounting (``packed_nbytes``): both moments in ``state`` (float32 below ``min_size``
    elements) and one float32 ``step`` per parameter."""
    st = OptimState.parse(state)
    held = sum(adamw_moment_bytes(shape, st) + 4 for shape in shapes)  # and step
    return sum(math.prod(s) for s in shapes) * master.bits // 8, held


def optim_state_table(dim: int, layers: int) -> None:
    """Master + AdamW state per parameter for each ``optim_state`` x master: measured by
    ``memory_report`` after one ``OffloadedOptimizer`` step of a ``layers x Linear(dim)``
    model (bf16 weights), and computed for it and for Llama 3 8B."""
    build_shapes = [(dim, dim), (dim,)] * layers
    n8 = sum(math.prod(s) for s in LLAMA3_8B)
    print(f"measured: {layers} x Linear({dim}, {dim}), bf16 weights, OffloadedOptimizer(AdamW)")
    print(f"computed: the same, and Llama 3 8B ({n8:,} parameters), by packed_nbytes\n")
    print(f"{'':13}{'------- measured, bytes/param -------':>37}{'computed':>10}{'8B':>16}")
    head = f"{'master':7}{'state':6}{'master':>9}{'moments':>9}{'scratch':>9}{'total':>10}"
    print(f"{head}{'total':>10}{'bytes/param':>12}{'GB':>8}{'exact':>7}")
    lo, hi = 12 * n8 / 1e9, 16 * n8 / 1e9
    seeds = "seeds: master fp32 4P + states 8-12P"
    print(f"{seeds:<60}{'12-16':>12}{f'{lo:.0f}-{hi:.0f}':>8}")
    for master in (DType.F32, DType.BF16):
        for fmt in STATE_FORMATS:
            ctx = ComputeCtx.new(DType.BF16, "cpu").replace(
                master=master,
                offload=torch.device("cpu"),
                optim_state=OptimState.parse(fmt),
            )
            model = build(dim, layers, torch.bfloat16, torch.device("cpu"))
            opt = OffloadedOptimizer(model.parameters(), ctx, lr=1e-4)
            model(torch.randn(8, dim, dtype=torch.bfloat16)).float().square().mean().backward()
            opt.step()
            rep = memory_report(model, optimizer=opt)
            p = rep.parameters
            got = [rep.bytes(role=r) / p for r in ("master", "optimizer_state", "scratch")]
            computed = adamw_bytes(build_shapes, fmt, master)
            want = sum(computed) / p
            exact = computed == (rep.bytes(role="master"), rep.bytes(role="optimizer_state"))
            big = sum(adamw_bytes(LLAMA3_8B, fmt, master))
            print(
                f"{master!s:7}{fmt:6}{got[0]:>9.3f}{got[1]:>9.3f}{got[2]:>9.3f}"
                f"{got[0] + got[1]:>10.3f}{want:>10.3f}{big / n8:>12.3f}{big / 1e9:>8.1f}"
                f"{'yes' if exact else 'NO':>7}"
            )
            del model, opt
    print(
        "\ntotal = master + moments (measured); exact: measured and computed bytes equal; "
        "scratch: the reused float32 buffer of the compact step, not part of the total"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument(
        "--dim", type=int, default=None, help="hidden size (default: 2048 GPU, 512 CPU)"
    )
    ap.add_argument("--layers", type=int, default=None, help="default: 8 GPU, 4 CPU")
    ap.add_argument("--batch", type=int, default=None, help="rows per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--dp-reduce",
        choices=["bf16", "f32"],
        default=None,
        help="instead: time DataParallelGradAccumulator's reduction (sums in this dtype) on\n"
        "2 gloo ranks against the one-vector reduction it replaced, with peak RSS growth",
    )
    ap.add_argument(
        "--optim-state",
        action="store_true",
        help="instead: master + AdamW state bytes per parameter for each optim_state and\n"
        "master dtype, measured (--dim, --layers; default 24 x 2048: 100.7M parameters)\n"
        "and computed, with Llama 3 8B computed from the same accounting",
    )
    args = ap.parse_args(argv)
    if args.optim_state:
        optim_state_table(args.dim or 2048, args.layers or 24)
        return
    if args.dp_reduce is not None:
        dp_reduce(args.dp_reduce, args.steps)
        return

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    device = torch.device("cuda" if use_cuda else "cpu")
    dim = args.dim or (2048 if use_cuda else 512)
    batch = args.batch or (1024 if use_cuda else 64)
    args.layers = args.layers or (8 if use_cuda else 4)
    xs = [torch.randn(batch, dim, device=device) for _ in range(args.micro_batches)]

    # ----- plain mixed-precision AdamW --------------------------------------------------
    plain = build(dim, args.layers, torch.float32, device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    autocast_dtype = torch.bfloat16

    def plain_backwards() -> None:
        for x in xs:
            with torch.autocast(device.type, dtype=autocast_dtype):
                loss = plain(x).float().square().mean()
            loss.backward()

    def plain_update() -> None:
        plain_opt.step()
        plain_opt.zero_grad()

    plain_fb, plain_up = timed(plain_backwards, plain_update, device, 1, args.steps)
    # Gradients as they stand after the backwards of a step, before the optimizer runs.
    plain_backwards()
    plain_report = memory_report(plain, optimizer=plain_opt)
    plain_opt.zero_grad()

    # ----- offloaded: bf16 weights, bf16 accumulator + f32 masters on the host ----------
    ctx = ComputeCtx.new(DType.BF16, device).replace(
        grad=DType.BF16, master=DType.F32, offload=torch.device("cpu")
    )
    ours = build(dim, args.layers, torch.bfloat16, device)
    acc = LowPrecGradAccumulator(ours.parameters(), ctx)
    # fused AdamW runs ~8x faster than the per-tensor loop on CPU masters.
    opt = OffloadedOptimizer(ours.parameters(), ctx, lr=1e-4, fused=True)

    def our_backwards() -> None:
        for x in xs:
            loss = ours(x.to(torch.bfloat16)).float().square().mean()
            loss.backward()

    def our_update() -> None:
        opt.ingest_grads(acc)
        opt.step()
        opt.zero_grad()

    our_fb, our_up = timed(our_backwards, our_update, device, 1, args.steps)
    peak_note = ""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        our_backwards()
        our_update()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        peak_note = f"(step peak above resident, activations included: {peak:,} bytes)"
    our_backwards()
    our_report = memory_report(ours, optimizer=opt, accumulator=acc)

    n = plain_report.parameters
    dev = str(device if device.type == "cpu" else next(iter(ours.parameters())).device)
    if device.type == "cuda":
        plain_bpp = plain_report.bytes_per_param(dev)
        our_bpp = our_report.bytes_per_param(dev)
        how = f"all bytes resident on {dev}"
    else:
        # Compute and offload are the same host here: count the roles a GPU run keeps on
        # the GPU (weights, gradients). For plain AdamW the optimizer state and nothing
        # else also stays on the compute device, so it counts too.
        plain_bpp = plain_report.bytes_per_param(dev)
        our_bpp = our_report.bytes_per_param(dev, roles=COMPUTE_ROLES)
        how = (
            "CPU run: offload device = compute device, so 'offloaded' counts the roles "
            "(params, grads) a GPU run keeps on the GPU; plain counts everything"
        )
    print(f"model: {args.layers} x Linear({dim}, {dim}) = {n:,} parameters on {device}")
    print(f"{args.micro_batches} micro-batches of {batch} rows per step, median of {args.steps}")
    print(f"accounting: {how}")
    print()
    print(f"{'':28}{'plain AdamW':>14}{'offloaded':>14}{'ratio':>9}")
    print(
        f"{'bytes/param, compute device':28}{plain_bpp:>14.2f}{our_bpp:>14.2f}"
        f"{our_bpp / plain_bpp:>9.3f}"
    )
    rows = [
        ("forward+backward [ms]", plain_fb, our_fb),
        ("optimizer phase [ms]", plain_up, our_up),
        ("step time [ms]", plain_fb + plain_up, our_fb + our_up),
    ]
    for label, a, b in rows:
        print(f"{label:28}{a * 1e3:>14.1f}{b * 1e3:>14.1f}{b / a:>9.3f}")
    if peak_note:
        print(peak_note)
    print()
    print("targets: offloaded <= 4 bytes/param on the compute device; step time ratio <= 1.20")
    print()
    print("plain AdamW, after the backwards of one step:")
    print(plain_report)
    print()
    print("offloaded, after the backwards of one step:")
    print(our_report)
    acc.close()


if __name__ == "__main__":
    main()
