"""Body SQNR of fp8 quantize-dequantize for every scaling granularity, with outliers.

Run: ``.venv/bin/python bench/bench_granularity.py``. A 256 x 1024 float32 Gaussian tensor
(seeded) is quantized to E4M3 and back with ``fp8_quantize(..., granularity=)`` and
``fp8_dequantize``, as it is, with 4 random rows, and with 4 random columns, multiplied by
1e2, 1e4 and 1e5. The SQNR is measured over the *body* only (the elements outside the
outlier rows or columns): ``10 log10(sum x^2 / sum (x_hat - x)^2)``. It prints a markdown
table (docs/benchmarks.md) and the issue's targets, met or not:

- 1e5 row outliers: every fine granularity >= 25 dB, while per-tensor collapses (< 10 dB);
- 1e5 column outliers: 1x128 >= 20 dB, mx >= 23 dB.

Numerics only, no timing: it runs wherever torch does (the pure-torch twins on a CPU, the
Triton kernels on an fp8 GPU, where the bytes are also checked against the twins).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from dataclasses import dataclass
from typing import Any

import torch

from computectx.dtypes import Fp8Format
from computectx.fp8 import Fp8Backend, fp8_dequantize, ops, select_backend

FACTORS = (1e2, 1e4, 1e5)
CASES: tuple[tuple[str, float], ...] = (
    ("none", 1.0),
    *(("rows", f) for f in FACTORS),
    *(("cols", f) for f in FACTORS),
)


@dataclass(frozen=True)
class Variant:
    """One row of the table: a granularity and its options."""

    label: str
    options: dict[str, Any]


VARIANTS = (
    Variant("tensor", {"granularity": "tensor"}),
    Variant("row (power of two, default)", {"granularity": "row"}),
    Variant("row, power_of_two=False", {"granularity": "row", "power_of_two": False}),
    Variant("1x128", {"granularity": "1x128"}),
    Variant("1x128, power_of_two=True", {"granularity": "1x128", "power_of_two": True}),
    Variant("128x128", {"granularity": "128x128"}),
    Variant("128x128, power_of_two=True", {"granularity": "128x128", "power_of_two": True}),
    Variant("mx (rceil, default)", {"granularity": "mx"}),
    Variant("mx, mx_rounding='floor'", {"granularity": "mx", "mx_rounding": "floor"}),
)
FINE = tuple(v.label for v in VARIANTS if v.options["granularity"] != "tensor")


def outlier_data(
    kind: str, factor: float, rows: int, cols: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussian tensor with 4 random rows or columns times ``factor``; the body mask."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    body = torch.ones_like(x, dtype=torch.bool)
    if kind == "rows":
        idx = torch.randperm(rows, generator=gen)[:4]
        x[idx] *= factor
        body[idx] = False
    elif kind == "cols":
        idx = torch.randperm(cols, generator=gen)[:4]
        x[:, idx] *= factor
        body[:, idx] = False
    return x, body


def body_sqnr(
    x: torch.Tensor, body: torch.Tensor, fmt: Fp8Format, backend: Fp8Backend, opts: dict[str, Any]
) -> float:
    data, scale = ops.quantize_granular(x, fmt, backend=backend, **opts)
    if backend is not Fp8Backend.REFERENCE:  # the kernels' bytes are the twins', or stop
        ref = ops.quantize_granular(x.cpu(), fmt, backend=Fp8Backend.REFERENCE, **opts)
        for got, want in zip((data, scale), ref, strict=True):
            if not torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)):
                raise SystemExit(f"{opts}: {backend} differs from the reference twin")
    err = fp8_dequantize(data, scale, torch.float32).double().cpu() - x.double().cpu()
    signal = x.double().cpu()[body].square().sum()
    return 10 * math.log10(float(signal / err[body].square().sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--fmt", default="e4m3", help="e4m3 or e5m2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    fmt = Fp8Format.parse(args.fmt)
    backend, why = select_backend(args.device)
    print(
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {args.device}; backend {why}"
    )
    print(f"{args.rows} x {args.cols} float32 Gaussian, {fmt}, seed {args.seed}; body SQNR dB\n")
    heads = ["none"] + [f"4 {k} x{f:.0e}".replace("e+0", "e") for k, f in CASES[1:]]
    print("| granularity | " + " | ".join(heads) + " |")
    print("| --- |" + " ---: |" * len(heads))
    table: dict[tuple[str, str, float], float] = {}
    for v in VARIANTS:
        cells = []
        for kind, factor in CASES:
            x, body = outlier_data(kind, factor, args.rows, args.cols, args.seed)
            table[v.label, kind, factor] = db = body_sqnr(
                x.to(args.device), body, fmt, backend, v.options
            )
            cells.append(f"{db:.1f}")
        print(f"| {v.label} | " + " | ".join(cells) + " |")

    def of(granularity: str) -> list[str]:
        return [v.label for v in VARIANTS if v.options["granularity"] == granularity]

    targets = [(f"{label}, 4 rows x1e5 >= 25", table[label, "rows", 1e5] >= 25.0) for label in FINE]
    targets.append(("tensor, 4 rows x1e5 < 10 (collapses)", table["tensor", "rows", 1e5] < 10.0))
    for granularity, floor in (("1x128", 20.0), ("mx", 23.0)):
        for label in of(granularity):
            targets.append(
                (f"{label}, 4 cols x1e5 >= {floor:.0f}", table[label, "cols", 1e5] >= floor)
            )
    print("\ntargets (dB)")
    for name, met in targets:
        print(f"  {'met    ' if met else 'NOT MET'}  {name}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
