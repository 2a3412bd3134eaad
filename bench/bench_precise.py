"""Eager overhead of ``ctx.precise`` / ``ctx.to_compute`` against the hand-written cast dance.

Run: ``.venv/bin/python bench/bench_precise.py``. Both variants run the same op in the same
process, interleaved, so the ratio is measured side by side. Target: at most 5% overhead at
(64, 4096); at (4, 64) the absolute extra microseconds are what matter (the op itself is tiny).
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch
from torch.utils.benchmark import Timer

from computectx import ComputeCtx, DType


def rms_norm(t: torch.Tensor) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)


def hand_precise(x: torch.Tensor) -> torch.Tensor:
    # The dance precise replaces: upcast, run, downcast to the input's dtype.
    return rms_norm(x.to(torch.float32)).to(x.dtype)


def hand_to_compute(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)


def measure(stmt: str, env: dict[str, object], rounds: int, min_time: float) -> float:
    """Median over rounds of blocked_autorange medians, in microseconds."""
    runs = []
    for _ in range(rounds):
        m = Timer(stmt=stmt, globals=env).blocked_autorange(min_run_time=min_time)
        runs.append(m.median * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-time", type=float, default=0.2)
    args = parser.parse_args()
    ctx = ComputeCtx.new(DType.BF16, "cpu")
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'case':<28}{'shape':<12}{'hand µs':>10}{'ctx µs':>10}{'extra µs':>10}{'ratio':>8}")
    for shape in [(4, 64), (64, 4096)]:
        x = torch.randn(*shape).to(torch.bfloat16)
        xf = torch.randn(*shape)
        env: dict[str, object] = {
            "ctx": ctx, "x": x, "xf": xf, "rms_norm": rms_norm,
            "hand_precise": hand_precise, "hand_to_compute": hand_to_compute,
        }  # fmt: skip
        cases = [
            ("precise(rms_norm)", "hand_precise(x)", "ctx.precise(x, rms_norm)"),
            ("to_compute (no-op)", "hand_to_compute(x)", "ctx.to_compute(x)"),
            ("to_compute (f32->bf16)", "hand_to_compute(xf)", "ctx.to_compute(xf)"),
        ]
        for name, hand, mine in cases:
            # Interleave the two statements round by round so drift hits both alike.
            h_runs, c_runs = [], []
            for _ in range(args.rounds):
                h_runs.append(measure(hand, env, 1, args.min_time))
                c_runs.append(measure(mine, env, 1, args.min_time))
            h, c = statistics.median(h_runs), statistics.median(c_runs)
            print(f"{name:<28}{shape!s:<12}{h:>10.2f}{c:>10.2f}{c - h:>10.2f}{c / h:>8.3f}")


if __name__ == "__main__":
    main()
