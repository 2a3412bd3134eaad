"""The host step of the offloaded and compact optimizers against the CPU's best AdamW
implementations (issue 35): the table of docs/benchmarks.md.

    python bench/bench_host_step.py                     # 4 x 2048 x 2048 (16.8M parameters)
    python bench/bench_host_step.py --shape 4 4096 4096 --reps 15
    python bench/bench_host_step.py --parts f32 clip    # some of the parts only
    python bench/bench_host_step.py --no-twins --no-peers  # ours native rows and torch's only

One AdamW step over the parameters with gradients present, every contender built on its own
copy of the same weights and stepped in turn, round after round, in a new order each round
(interleaved, so a change in the machine's load falls on every row alike, and no row always
follows the same one), with Python's garbage collected between rounds and never within one.
Each round gives every parameter a fresh copy of the same gradients (in the parameter's
dtype), times ``step()`` alone, then ``zero_grad()`` (untimed, as a training loop frees its
gradients). The first ``--warmup`` rounds are not
counted (they build the native kernel, and torchao's compiled steps). The parts:

- ``f32``: torch ``AdamW`` ``fused=True`` (every ratio's base), the same behind torch's own
  non-finite check (``torch.amp.GradScaler`` at scale 1: ``unscale_`` reads and writes every
  gradient and finds inf/NaN, ``step`` skips on them: the like-for-like of ours' check, in the
  ``÷ checked`` lines under the table), ``foreach=True``, single-tensor (``foreach=False``,
  torch's default on the CPU); ours ``OffloadedOptimizer``
  and ``CompactOptimizer`` with float32 state (masters and state on the CPU, the model there
  too, so the masters are the model's own storage: torch's fused kernel and the non-finite
  check); DeepSpeed's ``DeepSpeedCPUAdam`` where ``deepspeed`` imports;
- ``clip``: torch fused, ours offloaded and compact (f32 state, then bf16, int8, fp8 and int4
  moments) with a clip to total norm 1.0 before the step, timed together as a fine-tuning
  loop runs them (torch's ``clip_grad_norm_``, ours ``clip_grad_norm``, whose norm the step
  reuses as its non-finite check); their ``ratio`` column is to torch fused with the clip;
- ``compact``: ours ``CompactOptimizer`` with bf16, int8, fp8 and int4 moments (the default
  path, and ``compile=False``: the torch-ops twin), torchao's ``AdamWFp8``, ``AdamW8bit``,
  ``AdamW4bit`` and bitsandbytes' ``AdamW8bit`` where they import;
- ``bf16``: bfloat16 weights and gradients: torch fused AdamW on them (round to nearest:
  updates below half an ulp are lost), ours ``CompactOptimizer`` with float32 moments and
  stochastic rounding (``ctx.master=bf16``), torchao's ``_AdamW(bf16_stochastic_round=True)``.

Peers are optional extras of the bench, never of the library: ``pip install deepspeed
bitsandbytes`` (deepspeed also wants ``hjson ninja msgpack py-cpuinfo psutil einops`` and builds
its CPU Adam with the system compiler the first time); a row whose package does not import is
left out with a note.

Columns: ``ratio`` is the median over torch fused's median (with the clip for ``clip`` rows),
``÷ ours f32`` over ``ours CompactOptimizer f32``'s (item 3's bf16-master target is read
there), ``GB/s`` the bytes the row must move per parameter (``B/param``: read weight,
gradient and both moments, write weight and moments, in the row's formats; ours adds one read
of the gradient for the non-finite check, a clip 12 more) over the median, ``state B/param``
the optimizer state held per parameter after the steps (scales and maps included).
Medians; nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from computectx import ComputeCtx, DType
from computectx.memory import CompactOptimizer, OffloadedOptimizer

MOMENT_BYTES = {"f32": 4.0, "bf16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5}
"""Bytes of one moment element per state format (block scales left out: 4 per block)."""

CLIP_BYTES = 12
"""Bytes a clip moves per float32 parameter: read g for the norm, then read and write g to
scale it (torch scales by the clamped coefficient even when it is 1)."""

MAX_NORM = 1.0

PARTS = ("f32", "clip", "compact", "bf16")
FORMATS = ("bf16", "int8", "fp8", "int4")
BASE = "torch AdamW fused=True"
OURS_F32 = "ours CompactOptimizer f32"
CHECKED = f"{BASE}, GradScaler's check"
UNSCALE_BYTES = 8
"""Bytes ``GradScaler.unscale_`` moves per float32 parameter: read and write the gradient."""
TWIN = "compile=False (twin)"

Make = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def moved(weight: int, state: str, check: bool) -> float:
    """Bytes an AdamW step moves per parameter: read and write the weight (``weight`` bytes)
    and both moments, read the gradient (the weight's dtype); ``check``: one more read of
    the gradient (ours' non-finite check)."""
    return 2 * weight + weight + 4 * MOMENT_BYTES[state] + (weight if check else 0)


@dataclass
class Row:
    """One contender: its label, part, the bytes it moves per parameter, its parameters and
    optimizer, and its step times."""

    label: str
    part: str
    bytes_per_param: float
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)
    clip: bool = False
    scaler: torch.amp.GradScaler | None = None


def _params(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape[1:], generator=gen).to(dtype)) for _ in range(shape[0])
    ]


@dataclass(frozen=True)
class Peer:
    """A peer's optimizer class, imported when its row is made (an ``ImportError`` or any
    other failure leaves the row out with a note)."""

    module: str
    name: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def maker(self) -> Make:
        cls = getattr(importlib.import_module(self.module), self.name)
        kwargs = dict(self.kwargs)
        return lambda p: cls(p, **kwargs)


def _compact(ctx: ComputeCtx, compile: bool | None = None) -> Make:
    """Ours ``CompactOptimizer`` under ``ctx``."""
    return lambda p: CompactOptimizer(p, ctx, compile=compile)


def _specs(parts: tuple[str, ...]) -> list[tuple[str, str, float, torch.dtype, Make | Peer]]:
    """``(label, part, bytes, weight dtype, maker or the peer it imports)`` of every row."""
    ctx = ComputeCtx.parity("cpu")
    f32, check = moved(4, "f32", False), moved(4, "f32", True)
    specs: list[tuple[str, str, float, torch.dtype, Make | Peer]] = []
    if "f32" in parts:
        specs += [
            (BASE, "f32", f32, torch.float32, lambda p: torch.optim.AdamW(p, fused=True)),
            (
                CHECKED,
                "f32",
                f32 + UNSCALE_BYTES,
                torch.float32,
                lambda p: torch.optim.AdamW(p, fused=True),
            ),
            (
                "torch AdamW foreach=True",
                "f32",
                f32,
                torch.float32,
                lambda p: torch.optim.AdamW(p, foreach=True),
            ),
            (
                "torch AdamW single-tensor",
                "f32",
                f32,
                torch.float32,
                lambda p: torch.optim.AdamW(p, foreach=False),
            ),
            (
                "ours OffloadedOptimizer f32",
                "f32",
                check,
                torch.float32,
                lambda p: OffloadedOptimizer(p, ctx),
            ),
            (OURS_F32, "f32", check, torch.float32, lambda p: CompactOptimizer(p, ctx)),
            (
                "DeepSpeed CPUAdam",
                "f32",
                f32,
                torch.float32,
                Peer("deepspeed.ops.adam", "DeepSpeedCPUAdam"),
            ),
        ]
    if "clip" in parts:
        specs += [
            (
                f"{BASE}, clip + step",
                "clip",
                f32 + CLIP_BYTES,
                torch.float32,
                lambda p: torch.optim.AdamW(p, fused=True),
            ),
            (
                "ours OffloadedOptimizer f32, clip + step",
                "clip",
                f32 + CLIP_BYTES,
                torch.float32,
                lambda p: OffloadedOptimizer(p, ctx),
            ),
            (
                "ours CompactOptimizer f32, clip + step",
                "clip",
                f32 + CLIP_BYTES,
                torch.float32,
                lambda p: CompactOptimizer(p, ctx),
            ),
        ]
        # The compact formats behind the same clip: the step reuses its norm as the check.
        specs += [
            (
                f"ours {fmt} moments, clip + step",
                "clip",
                moved(4, fmt, False) + CLIP_BYTES,
                torch.float32,
                _compact(ctx.with_optim_state(fmt)),
            )
            for fmt in FORMATS
        ]
    if "compact" in parts:
        for fmt in FORMATS:
            c = ctx.with_optim_state(fmt)
            nbytes = moved(4, fmt, True)
            specs.append(
                (
                    f"ours {fmt} moments",
                    "compact",
                    nbytes,
                    torch.float32,
                    _compact(c),
                )
            )
            specs.append(
                (
                    f"ours {fmt} moments, {TWIN}",
                    "compact",
                    nbytes,
                    torch.float32,
                    _compact(c, compile=False),
                )
            )
        for name, fmt in (("AdamWFp8", "fp8"), ("AdamW8bit", "int8"), ("AdamW4bit", "int4")):
            specs.append(
                (
                    f"torchao {name}",
                    "compact",
                    moved(4, fmt, False),
                    torch.float32,
                    Peer("torchao.optim", name),
                )
            )
        specs.append(
            (
                "bitsandbytes AdamW8bit",
                "compact",
                moved(4, "int8", False),
                torch.float32,
                Peer("bitsandbytes.optim", "AdamW8bit"),
            )
        )
    if "bf16" in parts:
        bf16 = ctx.replace(master=DType.BF16)
        specs += [
            (
                "torch AdamW fused=True, bf16 weights and moments (nearest)",
                "bf16",
                moved(2, "bf16", False),
                torch.bfloat16,
                lambda p: torch.optim.AdamW(p, fused=True),
            ),
            (
                "ours bf16 master + SR, f32 moments",
                "bf16",
                moved(2, "f32", True),
                torch.bfloat16,
                lambda p: CompactOptimizer(p, bf16),
            ),
            (
                f"ours bf16 master + SR, f32 moments, {TWIN}",
                "bf16",
                moved(2, "f32", True),
                torch.bfloat16,
                lambda p: CompactOptimizer(p, bf16, compile=False),
            ),
            (
                "torchao _AdamW bf16 SR (bf16 moments)",
                "bf16",
                moved(2, "bf16", False),
                torch.bfloat16,
                Peer("torchao.optim", "_AdamW", (("bf16_stochastic_round", True),)),
            ),
        ]
    return specs


def contenders(
    shape: tuple[int, ...],
    parts: tuple[str, ...] = PARTS,
    peers: bool = True,
    twins: bool = True,
) -> tuple[list[Row], list[str]]:
    """The rows to time (each on its own parameters) and notes on rows left out
    (``peers=False``: every peer's row; ``twins=False``: ours ``compile=False`` rows)."""
    notes: list[str] = []
    rows = []
    for label, part, nbytes, dtype, make in _specs(parts):
        if not twins and label.endswith(TWIN):
            continue
        if isinstance(make, Peer):
            if not peers:
                continue
            try:
                make = make.maker()
            except Exception as e:  # an optional extra of the bench, not of the library
                notes.append(f"{label}: left out ({type(e).__name__}: {e})")
                continue
        params = _params(shape, dtype)
        row = Row(label, part, nbytes, params, make(params), clip=part == "clip")
        if label == CHECKED:
            row.scaler = _unit_scaler()
        rows.append(row)
    return rows, notes


def _unit_scaler() -> torch.amp.GradScaler:
    """torch's AMP gradient scaler at scale 1 that never grows: only its non-finite check
    and skip remain (``scale`` once, as a loop's first ``scaler.scale(loss)`` does, makes
    its scale tensor)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=2**30)
    scaler.scale(torch.ones(()))
    return scaler


def _clip(row: Row) -> None:
    """Clip the row's gradients to ``MAX_NORM`` as its loop would: ours through the optimizer
    (whose step then reuses the norm), torch's with ``clip_grad_norm_``."""
    if isinstance(row.opt, (OffloadedOptimizer, CompactOptimizer)):
        row.opt.clip_grad_norm(MAX_NORM)
    else:
        torch.nn.utils.clip_grad_norm_(row.params, MAX_NORM)


def measure(rows: list[Row], shape: tuple[int, ...], reps: int, warmup: int) -> None:
    """Step every row once per round, ``warmup + reps`` rounds; keep the last ``reps``.

    Each round takes the rows in a new order (seeded): in one fixed order a row would always
    follow the same other row, and pay for what that one leaves in the caches (the row after
    torch's single-tensor step, whose temporaries flush them, measured 10-20% slower there
    than in any other place)."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape[1:], generator=gen) for _ in range(shape[0])]
    order = random.Random(0)
    for r in range(warmup + reps):
        # The garbage of the rounds before (torchao's state subclasses, the twins'
        # temporaries) collected now, untimed, and none during the round (as timeit): one
        # collection a round, not a row (a collection walks every object of the process).
        gc.collect()
        gc.disable()
        try:
            _round(order.sample(rows, len(rows)), grads, r >= warmup)
        finally:
            gc.enable()


def _round(order: list[Row], grads: list[torch.Tensor], keep: bool) -> None:
    """Step every row of ``order`` once, its time appended where ``keep``."""
    for row in order:
        for p, g in zip(row.params, grads, strict=True):
            p.grad = g.to(p.dtype, copy=True)
        start = time.perf_counter()
        if row.clip:
            _clip(row)
        if row.scaler is not None:
            row.scaler.unscale_(row.opt)
            row.scaler.step(row.opt)
            row.scaler.update()
        else:
            row.opt.step()
        elapsed = time.perf_counter() - start
        row.opt.zero_grad()
        if keep:
            row.times.append(elapsed)


def _tensor_bytes(t: torch.Tensor) -> int:
    """A state tensor's bytes: a tensor subclass's inner tensors (torchao's states)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return int(t.numel() * t.element_size())


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The optimizer state's bytes (every tensor in ``opt.state``, scalars included)."""
    held = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(_tensor_bytes(v) for v in held)


def table(rows: list[Row], numel: int) -> list[str]:
    """The markdown table: median, min, ratio of medians to torch fused (with or without the
    clip) and to ours compact f32, GB/s, bytes moved and held per parameter."""
    medians = {row.label: statistics.median(row.times) for row in rows}
    base = {False: medians.get(BASE), True: medians.get(f"{BASE}, clip + step")}
    ours = medians.get(OURS_F32)
    out = [
        "| contender | median ms | min ms | ratio | ÷ ours f32 | GB/s | B/param | state B/param |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        med = medians[row.label]
        b = base[row.clip]
        ratio = f"{med / b:.2f}" if b else "-"
        to_ours = f"{med / ours:.2f}" if ours and not row.clip else "-"
        gbs = row.bytes_per_param * numel / med / 1e9
        out.append(
            f"| {row.label} | {med * 1e3:.1f} | {min(row.times) * 1e3:.1f} | {ratio} | "
            f"{to_ours} | {gbs:.1f} | {row.bytes_per_param:g} | "
            f"{state_bytes(row.opt) / numel:.2f} |"
        )
    checked = medians.get(CHECKED)
    if checked:
        out += [
            f"{row.label} ÷ checked: {medians[row.label] / checked:.2f}"
            for row in rows
            if row.label.startswith("ours") and not row.clip
        ]
    return out


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[4, 2048, 2048])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--no-peers", action="store_true", help="leave the peers' rows out")
    parser.add_argument(
        "--no-twins", action="store_true", help="leave ours compile=False (twin) rows out"
    )
    args = parser.parse_args(argv)
    shape = tuple(args.shape)
    numel = math.prod(shape)
    rows, notes = contenders(
        shape, tuple(args.parts), peers=not args.no_peers, twins=not args.no_twins
    )
    measure(rows, shape, args.reps, args.warmup)
    lines = [
        f"{numel / 1e6:.1f}M parameters as {shape[0]} x {list(shape[1:])}, "
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
