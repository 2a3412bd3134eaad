"""The f32 host step of the offloaded and compact optimizers against torch's CPU AdamW
(issue 35, item 1).

    python bench/bench_host_step.py                     # 4 x 2048 x 2048 (16.8M parameters)
    python bench/bench_host_step.py --shape 4 4096 4096 --reps 15

One AdamW step over float32 parameters with gradients present, every contender built on its
own copy of the same weights and stepped in turn, round after round (interleaved, so a
change in the machine's load falls on every row alike). Each round gives every parameter a
fresh copy of the same gradients, times ``step()`` alone, then ``zero_grad()`` (untimed, as a
training loop frees its gradients). The first ``--warmup`` rounds are not counted. Rows:

- ``torch AdamW fused=True`` (the ratios' base), ``foreach=True``, single-tensor
  (``foreach=False``, torch's default on the CPU);
- ``ours OffloadedOptimizer f32``: masters (f32) and state on the CPU, the model's weights on
  the CPU too, so the masters are the model's own storage (nothing is copied back): the step
  is torch's fused kernel and the non-finite check (one read of the gradients);
- ``ours CompactOptimizer f32``: the fused kernel on the model's own parameters and the
  non-finite check;
- the same three (torch fused, ours offloaded, ours compact) with a clip to total norm 1.0
  before the step, timed together, as a fine-tuning loop runs them: torch's
  ``clip_grad_norm_``, ours ``clip_grad_norm``, whose norm the step reuses as its
  non-finite check. Their ratio is to torch's fused row with the clip;
- ``DeepSpeed CPUAdam``: only where ``deepspeed`` imports (not a dependency; skipped with a
  note otherwise).

``GB/s`` counts the 28 bytes per parameter an AdamW update must move (read weight, gradient
and both moments, write weight and moments); ``B/param`` is what the row moves (ours: 4 more
for the check; a clip: 12 more, a read for the norm and a read and write to scale).
Medians; nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from computectx import ComputeCtx
from computectx.memory import CompactOptimizer, OffloadedOptimizer

UPDATE_BYTES = 28
"""Bytes an AdamW update moves per float32 parameter: read w, g, m, v; write w, m, v."""

CLIP_BYTES = 12
"""Bytes a clip moves per float32 parameter: read g for the norm, then read and write g to
scale it (torch scales by the clamped coefficient even when it is 1)."""

MAX_NORM = 1.0


@dataclass
class Row:
    """One contender: its label, the bytes it moves per parameter, its parameters and
    optimizer, and its step times."""

    label: str
    bytes_per_param: int
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    times: list[float]
    clip: bool = False


def _params(shape: tuple[int, ...]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape[1:], generator=gen)) for _ in range(shape[0])]


def contenders(shape: tuple[int, ...]) -> tuple[list[Row], list[str]]:
    """The rows to time (each on its own parameters) and notes on rows left out."""
    ctx = ComputeCtx.parity("cpu")
    makers: list[tuple[str, int, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]] = [
        ("torch AdamW fused=True", UPDATE_BYTES, lambda p: torch.optim.AdamW(p, fused=True)),
        ("torch AdamW foreach=True", UPDATE_BYTES, lambda p: torch.optim.AdamW(p, foreach=True)),
        ("torch AdamW single-tensor", UPDATE_BYTES, lambda p: torch.optim.AdamW(p, foreach=False)),
        ("ours OffloadedOptimizer f32", UPDATE_BYTES + 4, lambda p: OffloadedOptimizer(p, ctx)),
        ("ours CompactOptimizer f32", UPDATE_BYTES + 4, lambda p: CompactOptimizer(p, ctx)),
    ]
    clipped: list[tuple[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]] = [
        ("torch AdamW fused=True", lambda p: torch.optim.AdamW(p, fused=True)),
        ("ours OffloadedOptimizer f32", lambda p: OffloadedOptimizer(p, ctx)),
        ("ours CompactOptimizer f32", lambda p: CompactOptimizer(p, ctx)),
    ]
    notes = []
    try:
        cpu_adam = importlib.import_module("deepspeed.ops.adam").DeepSpeedCPUAdam
        makers.append(("DeepSpeed CPUAdam", UPDATE_BYTES, lambda p: cpu_adam(p)))
    except Exception as e:  # an optional extra of the bench, not of the library
        notes.append(f"DeepSpeed CPUAdam: skipped ({type(e).__name__}: {e})")
    rows = []
    for label, nbytes, make in makers:
        params = _params(shape)
        rows.append(Row(label, nbytes, params, make(params), []))
    for label, make in clipped:
        params = _params(shape)
        nbytes = UPDATE_BYTES + CLIP_BYTES
        rows.append(Row(f"{label}, clip + step", nbytes, params, make(params), [], clip=True))
    return rows, notes


def _clip(row: Row) -> None:
    """Clip the row's gradients to ``MAX_NORM`` as its loop would: ours through the optimizer
    (whose step then reuses the norm), torch's with ``clip_grad_norm_``."""
    if isinstance(row.opt, (OffloadedOptimizer, CompactOptimizer)):
        row.opt.clip_grad_norm(MAX_NORM)
    else:
        torch.nn.utils.clip_grad_norm_(row.params, MAX_NORM)


def measure(rows: list[Row], shape: tuple[int, ...], reps: int, warmup: int) -> None:
    """Step every row once per round, ``warmup + reps`` rounds; keep the last ``reps``."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape[1:], generator=gen) for _ in range(shape[0])]
    for r in range(warmup + reps):
        for row in rows:
            for p, g in zip(row.params, grads, strict=True):
                p.grad = g.clone()
            start = time.perf_counter()
            if row.clip:
                _clip(row)
            row.opt.step()
            elapsed = time.perf_counter() - start
            row.opt.zero_grad()
            if r >= warmup:
                row.times.append(elapsed)


def table(rows: list[Row], numel: int) -> list[str]:
    """The markdown table: median, min, ratio of medians to the first row of the same kind
    (with or without the clip), GB/s."""
    bases: dict[bool, float] = {}
    for row in rows:
        bases.setdefault(row.clip, statistics.median(row.times))
    out = [
        "| contender | median ms | min ms | ratio | GB/s | B/param |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        med = statistics.median(row.times)
        gbs = UPDATE_BYTES * numel / med / 1e9
        out.append(
            f"| {row.label} | {med * 1e3:.1f} | {min(row.times) * 1e3:.1f} | "
            f"{med / bases[row.clip]:.2f} | {gbs:.1f} | {row.bytes_per_param} |"
        )
    return out


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[4, 2048, 2048])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    shape = tuple(args.shape)
    numel = math.prod(shape)
    rows, notes = contenders(shape)
    measure(rows, shape, args.reps, args.warmup)
    lines = [
        f"{numel / 1e6:.1f}M f32 parameters as {shape[0]} x {list(shape[1:])}, "
        f"{args.reps} interleaved rounds after {args.warmup}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}",
        *table(rows, numel),
        *notes,
    ]
    for line in lines:
        print(line)
    return lines


if __name__ == "__main__":
    main()
