"""Bytes per parameter on the compute device, and step time, for the offloaded memory policy
against plain mixed-precision AdamW, from one run.

    python bench/bench_memory.py                 # CUDA when available, else CPU
    python bench/bench_memory.py --device cpu    # CPU-only: same figures, see the note printed

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
import statistics
import time
from collections.abc import Callable

import torch

from computectx import ComputeCtx, DType
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer, memory_report
from computectx.memory.accounting import Role

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
    args = ap.parse_args(argv)

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
