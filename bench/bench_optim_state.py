"""Optimizer state formats on the demo model: validation loss against float32 state, state
bytes per parameter, and the CPU optimizer step time (issue 24).

    python bench/bench_optim_state.py                  # both parts (15-30 min on 2 cores)
    python bench/bench_optim_state.py --part loss --lr 1e-3   # the runs docs/benchmarks.md reads
    python bench/bench_optim_state.py --part speed     # the step times only

**Loss.** Each row trains the demo's model (``ByteLM`` at ``DemoSettings()``' defaults:
2 blocks of 128, byte windows of 128, batches of 8, 120 steps, AdamW at lr 3e-3 with the
demo's warm-up and cosine schedule, gradient norm clipped at 1) from the same seed on the
same batches of the demo's corpus (the standard library's sources), as ``computectx demo``
trains one policy. Only the optimizer differs. The validation loss is the demo's: its
``--eval-batches`` held-out batches, six times during the run and after the last step.
Each row is compared with its reference: float32 state under the same compute policy
(``fp32``: f32 weights and compute; ``bf16``: bf16 autocast over f32 weights). ``Δ val``
is the final validation loss over the reference's, ``curve |Δ|`` the mean relative
distance of the six validation points from the reference's. At the demo's lr 3e-3 this
model's trajectories part early whatever perturbs them (a bf16 master rounded to nearest
ends 1.3% *below* float32): read the bounds at ``--lr 1e-3``. Rows:

- ``torch AdamW``: ``torch.optim.AdamW`` (f32 state; the reference);
- ``ours STATE``: ``CompactOptimizer`` over ``torch.optim.AdamW`` with ``optim_state=STATE``;
- ``offloaded STATE``: ``OffloadedOptimizer`` (masters and state on the offload device, the
  CPU here) with ``ctx.optim_state=STATE``;
- ``torchao AdamW8bit / AdamW4bit / AdamWFp8``: torchao 0.18's optimizers (block 256 / 128 /
  256, float32 below 4096 elements, as ours);
- under ``bf16``: ``bf16 master, nearest``: the weights stored bf16 (``ctx.master=bf16``),
  stepped by ``torch.optim.AdamW`` (every update rounded to nearest, so updates below half
  an ulp are lost); ``bf16 master + SR``: the same weights stepped by ``CompactOptimizer``
  (stochastic rounding) with float32, 8-bit and 4-bit moments, and by ``OffloadedOptimizer``
  with 8-bit moments; torchao's ``_AdamW``, ``AdamW8bit`` and ``AdamW4bit`` with
  ``bf16_stochastic_round=True`` beside them.

``state B/param`` is the optimizer state per model parameter: ``memory_report``'s
``optimizer_state`` role for torch's and our optimizers; for torchao's, the bytes of every
tensor inside its state subclasses (codes, scales and the per-tensor copy of the
quantization map), which ``memory_report`` cannot read. ``master+state`` adds the weights
the optimizer steps (the f32 or bf16 masters, or the parameters themselves when there are
none).

**Speed.** One optimizer step over ``--numel`` million float32 parameters in 2048x2048
tensors, random gradients, median of ``--reps`` steps after two warm-up steps (which
compile), at ``torch.get_num_threads()`` threads: ``torch.optim.AdamW`` ``foreach`` (the
ratios' base), single-tensor and ``fused``; ours per state format, eager and compiled
(``compile=True``: inductor, tens of seconds the first time); torchao's (compiled by
torchao, per shape).
The figures are indicative: a CPU, another machine's memory bandwidth and thread count move
them. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from computectx import ComputeCtx, DType
from computectx.demo.corpus import load_corpus, train_batches, val_batches
from computectx.demo.settings import DemoSettings
from computectx.demo.train import evaluate, lr_at, model_config, tail_steps
from computectx.memory import CompactOptimizer, OffloadedOptimizer, memory_report
from computectx.nn import ByteLM

MakeOpt = Callable[[ByteLM, float], torch.optim.Optimizer]
TORCHAO = ("AdamW8bit", "AdamWFp8", "AdamW4bit")
"""torchao 0.18's quantized AdamW classes, side by side with ours."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: its label, the compute policy, and how its optimizer is built."""

    label: str
    flag: str
    make: MakeOpt
    master: DType = DType.F32
    reference: bool = False


@dataclasses.dataclass(frozen=True)
class Result:
    run: Run
    val_curve: list[tuple[int, float]]
    train_loss: float
    state_bytes: int
    stepped_bytes: int
    parameters: int
    seconds: float

    @property
    def val_loss(self) -> float:
        return self.val_curve[-1][1]


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of every group (torchao keeps it as a tensor, set in place)."""
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _subclass_bytes(t: torch.Tensor) -> int | None:
    """The bytes of a tensor subclass's inner tensors (torchao's states), ``None`` for a
    plain tensor."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return None
    names, _ = t.__tensor_flatten__()
    return sum(int(getattr(t, n).nbytes) for n in names)


def state_bytes(model: ByteLM, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """``(optimizer state, master weights)`` bytes: ``memory_report`` for plain tensors; the
    inner tensors of torchao's state subclasses, which it cannot read."""
    held = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    sub = [_subclass_bytes(v) for v in held]
    if any(b is not None for b in sub):
        plain = sum(int(v.nbytes) for v, b in zip(held, sub, strict=True) if b is None)
        return plain + sum(b for b in sub if b is not None), 0
    rep = memory_report(model, optimizer=opt)
    return rep.bytes(role="optimizer_state"), rep.bytes(role="master")


def train(run: Run, s: DemoSettings, batches_of: Callable[[], Any], val: Any) -> Result:
    """Train the demo model under ``run`` as ``computectx demo`` trains one policy."""
    ctx = ComputeCtx.from_flag(run.flag, "cpu")
    if run.master != ctx.master:
        ctx = ctx.replace(master=run.master)
    torch.manual_seed(s.seed)
    model = ByteLM(ctx, model_config(s))
    params = list(model.parameters())
    opt = run.make(model, s.lr)
    offloaded = opt if isinstance(opt, OffloadedOptimizer) else None
    batches = batches_of()
    eval_at = {round(s.steps * k / 6) for k in range(1, 7)} - {0}
    curve = [(0, evaluate(model, val))]
    losses: list[float] = []
    state = master = 0
    t0 = time.perf_counter()
    for step in range(s.steps):
        set_lr(opt, lr_at(step, s.steps, s.lr))
        x, y = next(batches)
        loss = model.loss(x, y)
        torch.autograd.backward(loss)
        if offloaded is not None:
            offloaded.ingest_grads()
            norm = offloaded.clip_grad_norm(1.0)
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        if not math.isfinite(norm):
            raise SystemExit(f"{run.label}: non-finite gradient norm at step {step}")
        opt.step()
        losses.append(float(loss.detach()))
        if step == s.steps - 1:
            state, master = state_bytes(model, opt)
        opt.zero_grad(set_to_none=True)
        if step + 1 in eval_at:
            curve.append((step + 1, evaluate(model, val)))
    seconds = time.perf_counter() - t0
    n = sum(p.numel() for p in params)
    weights = master if master else sum(p.numel() * p.element_size() for p in params)
    tail = losses[-tail_steps(s.steps) :]
    return Result(run, curve, sum(tail) / len(tail), state, state + weights, n, seconds)


def _torch_adamw(model: ByteLM, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr)


def _torchao(name: str, **kwargs: Any) -> MakeOpt:
    def make(model: ByteLM, lr: float) -> torch.optim.Optimizer:
        cls = getattr(importlib.import_module("torchao.optim"), name)
        opt: torch.optim.Optimizer = cls(model.parameters(), lr=lr, **kwargs)
        return opt

    return make


def _ours(fmt: str, offloaded: bool = False, compile: bool | None = None) -> MakeOpt:
    def make(model: ByteLM, lr: float) -> torch.optim.Optimizer:
        ctx = model.ctx.with_optim_state(fmt)
        if offloaded:
            return OffloadedOptimizer(
                model.parameters(), ctx.replace(offload=torch.device("cpu")), lr=lr
            )
        return CompactOptimizer(model.parameters(), ctx, lr=lr, compile=compile)

    return make


def runs(with_torchao: bool) -> list[Run]:
    """Every loss row, references first (each compute policy's rows follow its reference)."""
    out = [Run("torch AdamW (f32 state)", "fp32", _torch_adamw, reference=True)]
    out += [Run(f"ours {f}", "fp32", _ours(f)) for f in ("bf16", "int8", "fp8", "int4")]
    out.append(Run("offloaded int8", "fp32", _ours("int8", offloaded=True)))
    if with_torchao:
        out += [Run(f"torchao {n}", "fp32", _torchao(n)) for n in TORCHAO]
    bf16 = DType.BF16
    out += [
        Run("torch AdamW (f32 state)", "bf16", _torch_adamw, reference=True),
        Run("bf16 master, nearest (torch AdamW)", "bf16", _torch_adamw, bf16),
        Run("ours bf16 master + SR (f32 state)", "bf16", _ours("f32"), bf16),
        Run("ours bf16 master + SR, int8", "bf16", _ours("int8"), bf16),
        Run("ours bf16 master + SR, int4", "bf16", _ours("int4"), bf16),
        Run("offloaded bf16 master + SR, int8", "bf16", _ours("int8", offloaded=True), bf16),
    ]
    if with_torchao:
        sr = {"bf16_stochastic_round": True}
        out += [
            Run("torchao _AdamW bf16 SR", "bf16", _torchao("_AdamW", **sr), bf16),
            Run("torchao AdamW8bit bf16 SR", "bf16", _torchao("AdamW8bit", **sr), bf16),
            Run("torchao AdamW4bit bf16 SR", "bf16", _torchao("AdamW4bit", **sr), bf16),
        ]
    return out


def _fmt_bytes(r: Result) -> tuple[str, str]:
    return f"{r.state_bytes / r.parameters:.3f}", f"{r.stepped_bytes / r.parameters:.3f}"


def loss_table(results: Iterable[Result]) -> list[str]:
    """The loss rows as a markdown table, each against its policy's reference."""
    lines = [
        "| policy | optimizer | val loss | Δ val | curve \\|Δ\\| | train loss | state B/param "
        "| master+state B/param | s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ref: Result | None = None
    for r in results:
        if r.run.reference:
            ref = r
        assert ref is not None and ref.run.flag == r.run.flag
        if r is ref:
            gap = curve = "-"
        else:
            gap = f"{(r.val_loss - ref.val_loss) / ref.val_loss:+.3%}"
            dist = [
                abs(a - b) / b for (_, a), (_, b) in zip(r.val_curve, ref.val_curve, strict=True)
            ]
            curve = f"{statistics.mean(dist[1:]):.3%}"
        sb, mb = _fmt_bytes(r)
        lines.append(
            f"| {r.run.flag} | {r.run.label} | {r.val_loss:.4f} | {gap} | {curve} | "
            f"{r.train_loss:.4f} | {sb} | {mb} | {r.seconds:.0f} |"
        )
    return lines


# ----- speed --------------------------------------------------------------------------------


def speed_params(numel_m: float) -> list[torch.nn.Parameter]:
    """``numel_m`` million float32 parameters in 2048x2048 tensors, with gradients."""
    count = max(1, round(numel_m * 1e6 / 2048**2))
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(2048, 2048, generator=g) * 0.02)
        p.grad = torch.randn(2048, 2048, generator=g) * 1e-3
        params.append(p)
    return params


def time_steps(opt: torch.optim.Optimizer, reps: int) -> tuple[float, float]:
    """``(first step s, median later step s)``: two warm-up steps (the first compiles)."""
    t0 = time.perf_counter()
    opt.step()
    first = time.perf_counter() - t0
    opt.step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


SpeedRow = tuple[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer | None]]


def speed_rows(with_torchao: bool, compiled: bool) -> list[SpeedRow]:
    """Each step-time row: torch's AdamW three ways, ours per format (eager, and compiled
    with ``compiled``), torchao's."""
    rows: list[SpeedRow] = [
        ("torch AdamW foreach", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True)),
        ("torch AdamW single-tensor", lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False)),
        ("torch AdamW fused", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
    ]
    cpu = ComputeCtx.from_flag("fp32", "cpu")
    for how in (False, True) if compiled else (False,):
        for fmt in ("f32", "bf16", "int8", "fp8", "int4"):
            ctx = cpu.with_optim_state(fmt)

            def ours(p: list[torch.nn.Parameter], ctx: ComputeCtx = ctx, how: bool = how) -> Any:
                opt = CompactOptimizer(p, ctx, lr=1e-3, compile=how)
                if opt.stepper is None:  # f32 state on f32 weights: torch's own step
                    return None
                return opt

            rows.append((f"ours {fmt} {'compiled' if how else 'eager'}", ours))
    if with_torchao:
        tao = importlib.import_module("torchao.optim")
        for name in TORCHAO:

            def theirs(p: list[torch.nn.Parameter], name: str = name) -> Any:
                return getattr(tao, name)(p, lr=1e-3)

            rows.append((f"torchao {name}", theirs))
    return rows


def speed_table(numel_m: float, reps: int, with_torchao: bool, compiled: bool) -> list[str]:
    lines = [
        "| optimizer | first step s | step ms | ns/param | vs foreach |",
        "|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    base: float | None = None
    for label, make in speed_rows(with_torchao, compiled):
        params = speed_params(numel_m)
        n = sum(p.numel() for p in params)
        opt = make(params)
        if opt is None:
            continue
        first, t = time_steps(opt, reps)
        if label == "torch AdamW foreach":
            base = t
        ratio = "-" if base is None else f"{t / base:.2f}"
        lines.append(f"| {label} | {first:.2f} | {t * 1e3:.1f} | {t / n * 1e9:.2f} | {ratio} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--part", choices=["loss", "speed", "all"], default="all")
    ap.add_argument("--steps", type=int, default=DemoSettings().steps)
    ap.add_argument("--lr", type=float, default=DemoSettings().lr, help="peak learning rate")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the loss part")
    ap.add_argument("--numel", type=float, default=16.8, help="million parameters (speed)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torchao", action="store_true", help="leave torchao's rows out")
    ap.add_argument("--no-compile", action="store_true", help="leave our compiled rows out")
    args = ap.parse_args(argv)
    with_torchao = not args.no_torchao
    print(
        f"torch {torch.__version__}, python {platform.python_version()}, "
        f"{platform.processor() or platform.machine()}"
    )
    if with_torchao:
        print(f"torchao {importlib.import_module('torchao').__version__}")
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
    if args.part in ("loss", "all"):
        s = DemoSettings(steps=args.steps, lr=args.lr, device="cpu")
        corpus = load_corpus(None, min_bytes=s.seq_len + 1)
        val = val_batches(corpus, s.batch_size, s.seq_len, s.eval_batches)
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        results = []
        for run in runs(with_torchao):
            r = train(run, s, lambda: train_batches(corpus, s.batch_size, s.seq_len, s.seed), val)
            print(f"{run.flag:5} {run.label:40} val {r.val_loss:.4f} ({r.seconds:.0f} s)")
            results.append(r)
        torch.set_num_threads(threads)
        c = model_config(s)
        shape = f"ByteLM {c.n_layers}x{c.d_model} (d_ff {c.d_ff})"
        print(f"\n{shape}: {results[0].parameters:,} parameters, lr {s.lr:g}, {s.steps} steps\n")
        print("\n".join(loss_table(results)))
    if args.part in ("speed", "all"):
        print(f"\nstep time, {torch.get_num_threads()} threads, median of {args.reps}\n")
        speed_table(args.numel, args.reps, with_torchao, not args.no_compile)


if __name__ == "__main__":
    main()
