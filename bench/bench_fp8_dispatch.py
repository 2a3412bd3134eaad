"""Cost of ``autocast``'s dispatch outside regions: ``F.linear`` and ``torch.add`` timed
in a process that never imports computectx against one that imported ``computectx.formats`` and
opened and closed a region, side by side; plus the cost inside regions, for reference.

    .venv/bin/python bench/bench_fp8_dispatch.py            # CPU (or --device cuda)

Each configuration runs in its own fresh interpreter (a child of this script), and the
children alternate for ``--rounds`` rounds; each figure is the best per-call time over
all rounds (the least disturbed by other work on the machine). Target: outside every region
the ratio is 1.00 (no op slower for computectx being imported). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import torch

SHAPES = ((8, 64, 64), (256, 1024, 1024))
"""(M, K, N): a tiny linear where dispatch overhead shows, and a medium one."""

MODES = ("baseline", "imported", "disabled_region", "fp8_region")
LABELS = {
    "baseline": "computectx not imported",
    "imported": "computectx.formats imported + a region used, now outside",
    "disabled_region": "inside autocast(enabled=False)",
    "fp8_region": "inside autocast(ctx) (fp8, reference backend)",
}


def best_per_call(fn: Callable[[], object], device: torch.device, budget_s: float) -> float:
    """Best per-call seconds over repeated timed batches filling ``budget_s``."""
    for _ in range(3):
        fn()
    calls = 1
    while True:  # size a batch to ~1 ms
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if time.perf_counter() - t0 > 1e-3:
            break
        calls *= 2
    best = float("inf")
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def child(mode: str, device: torch.device, budget_s: float) -> dict[str, float]:
    """Timings of one configuration, run in a fresh interpreter."""
    from torch.nn import functional

    region = None
    if mode != "baseline":
        from computectx import ComputeCtx
        from computectx.formats import autocast

        ctx = ComputeCtx.from_flag("fp8_hybrid", device)
        w0 = torch.randn(16, 16, device=device)
        with autocast(ctx):  # "used": the dispatch mode was pushed and popped
            functional.linear(torch.randn(4, 16, device=device), w0)
        if mode == "disabled_region":
            region = autocast(enabled=False)
        elif mode == "fp8_region":
            region = autocast(ctx)
    if region is not None:
        region.__enter__()
    out: dict[str, float] = {}
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, device=device, dtype=torch.bfloat16)

        def run(x: torch.Tensor = x, w: torch.Tensor = w, b: torch.Tensor = b) -> object:
            return functional.linear(x, w, b)

        out[f"linear {m}x{k}x{n}"] = best_per_call(run, device, budget_s)
    y = torch.randn(8, 64, device=device)
    out["add 8x64"] = best_per_call(lambda: torch.add(y, y), device, budget_s)
    if region is not None:
        region.__exit__(None, None, None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.5, help="seconds per op per child")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1 keeps shared CPUs from turning spin-waits into noise)",
    )
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child, device, args.budget)))
        return

    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--device", args.device]
            cmd += ["--budget", str(args.budget), "--threads", str(args.threads)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            slot = best.setdefault(mode, {})
            for op, t in res.items():
                slot[op] = min(slot.get(op, float("inf")), t)

    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {device}")
    print(
        f"best of {args.rounds} rounds x {args.budget}s per op, {args.threads} thread(s); "
        f"microseconds per call (ratio to the first row)"
    )
    ops = list(best["baseline"])
    header = f"{'configuration':<52}" + "".join(f"{op:>24}" for op in ops)
    print(header)
    for mode in MODES:
        cells = []
        for op in ops:
            t, ref = best[mode][op], best["baseline"][op]
            cells.append(f"{t * 1e6:>12.2f} ({t / ref:>5.2f}x)")
        print(f"{LABELS[mode]:<52}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
