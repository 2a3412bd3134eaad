"""The 4-bit twin's CPU speed: one ``Fp4Linear`` forward + backward at the demo's shapes.

The demo model (``computectx demo``'s defaults: batch 8 x seq 128 = 1024 tokens, d_model
128, MLP 4x) runs its 4-bit linears on the pure-torch twin on a CPU; this times one
linear's forward and backward (Y, dX, dW: five quantizes, the Hadamard transform and
stochastic rounding under NVFP4's default recipe, three twin GEMMs) per recipe, beside a
bf16 ``nn.Linear``. Best of ``--reps``; the machine's load changes the figures.

Run: ``python bench/bench_fp4_speed.py [--tokens 1024] [--reps 5]``
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats.linear.fp4 import Fp4Linear


def _time(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, reps: int) -> float:
    best = float("inf")
    for _ in range(reps + 1):  # the first is a warm-up
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        layer(xi).backward(dy)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    d, m = args.d_model, args.tokens
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(f"{'recipe':>8}  {'shape (in -> out)':>18}  {'fwd+bwd ms':>10}")
    gen = torch.Generator().manual_seed(0)
    for k, n in ((d, 4 * d), (4 * d, d)):
        x = torch.randn(m, k, generator=gen).bfloat16()
        dy = torch.randn(m, n, generator=gen).bfloat16()
        torch.manual_seed(0)
        layers: dict[str, nn.Module] = {"bf16": nn.Linear(k, n).bfloat16()}
        for flag in ("nvfp4", "mxfp4"):
            layers[flag] = Fp4Linear(k, n, ctx=ComputeCtx.from_flag(flag, "cpu")).bfloat16()
        for name, layer in layers.items():
            ms = 1e3 * _time(layer, x, dy, args.reps)
            print(f"{name:>8}  {f'{m}x{k} -> {n}':>18}  {ms:10.1f}")


if __name__ == "__main__":
    main()
