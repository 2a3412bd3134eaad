"""What autograd keeps for the backward on the demo model, and one training step's time, per
``--dtype`` flag and ``ctx.activations`` setting, side by side from one run, with each
setting's gradient SQNR against ``keep`` under the same flag; next to them, under bf16, plain
activation checkpointing as a user wraps it and torchao's float8 training.

    python bench/bench_activations.py                # the demo's default shape, on the CPU
    python bench/bench_activations.py --flags bf16 --rounds 15 --gemm-path native
    python bench/bench_activations.py --layers 4 --d-model 256
    python bench/bench_activations.py --loss --steps 800 --seeds 0,1,2

Saved bytes are counted as the demo's ``saved MiB`` counts them (every storage autograd keeps
during one micro-batch's forward and backward, each once, parameters excluded), split by kind
with ``computectx.memory.SavedActivations``. The step time is one micro-batch's forward,
backward and an SGD step (eager, no counting hooks, ``--threads`` torch threads, one as the
demo trains), the median of ``--rounds`` rounds in which every row takes one step in turn (so
a load that comes and goes on a shared machine touches every row alike), after the counted
step as a warm-up. The header says which GEMMs bf16 runs (``computectx.nn.GemmPath``: the
CPU probe picks ``native`` on a CPU with a fast bf16 kernel, but a busy machine can mislead
it into ``upcast``, whose attention keeps one more T x T tensor; ``--gemm-path native`` fixes
it). The settings: the ``ctx.activations`` text forms of ``SETTINGS`` (the
whole blocks checkpointed by rule among them: ``checkpoint=every:2``, ``checkpoint=all``)
under each flag, and under bf16 two rows that are not settings:

- ``torch checkpoint, each block``: ``keep``, each decoder block's forward wrapped in
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` by the user;
- ``torchao float8``: the same bf16 ``ByteLM`` converted by torchao's
  ``convert_to_float8_training`` (its default tensorwise dynamic recipe; every block linear,
  the head left out as ``fp8_hybrid`` leaves it), eager; a line says why when torchao is
  absent or the conversion or a step fails.

Nothing is asserted; docs/benchmarks.md shows a run. On a CPU the fp8 codec and the reruns
are pure torch: the times say what a setting costs there, not on a GPU (``gpu_check``'s
activations section measures that).

``--loss`` trains the demo instead (its default settings, ``--steps`` steps, each seed of
``--seeds``) under ``--flag`` with each ``--setting`` (``computectx demo --dtype FLAG@SETTING``
trains the same; ``keep+lr`` is ``keep`` with the peak learning rate 1e-6 higher, the noise
floor) and prints each run's validation loss, then per setting the mean and the spread of its
difference from ``keep`` on the same seed, in percent: the loss bound of docs/memory.md.
Slow: one demo training per seed and setting (docs/benchmarks.md has figures).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from computectx import ComputeCtx
from computectx.demo.settings import DemoSettings
from computectx.demo.train import model_config
from computectx.memory import SavedActivations
from computectx.memory.activation_bytes import SavedKind
from computectx.nn.gemm import Gemm, GemmPath, forced_gemm_path
from computectx.nn.lm import ByteLM

FLAGS = ("fp32", "bf16", "fp8_hybrid", "fp8_block")
SETTINGS = (
    "keep",
    "precise:recompute/act_fn:recompute/attention:recompute",
    "precise:recompute/act_fn:fp8/attention:recompute",
    "precise:recompute/act_fn:fp8/attention:fp8",
    "precise:fp8/act_fn:fp8/attention:fp8",
    "fp8",
    "checkpoint=every:2",
    "checkpoint=all",
)
USER_CHECKPOINT = "torch checkpoint, each block"
TORCHAO = "torchao float8"


KINDS: tuple[SavedKind, ...] = ("linear", "precise", "act_fn", "attention", "residual", "other")
LOSS_SETTINGS = (
    "keep",
    "keep+lr",
    "precise:recompute/act_fn:fp8/attention:recompute",
    "precise:recompute/act_fn:fp8/attention:fp8",
    "precise:fp8/act_fn:fp8/attention:fp8/group=32",
    "precise:fp8/act_fn:fp8/attention:fp8",
)
"""``--loss``'s settings by default: ``keep`` (the reference) first, then ``keep+lr``, the
noise floor: ``keep`` with the peak learning rate 1e-6 higher, a perturbation far below any
rounding, which shows how far a run's loss moves for reasons that are not the activations."""


@dataclass
class Row:
    """One setting's model and what was measured of it."""

    flag: str
    label: str
    model: ByteLM
    saved: SavedActivations | None = None
    grads: torch.Tensor | None = None
    times: list[float] = field(default_factory=list)
    step: Callable[[], None] | None = None


def demo_model(ctx: ComputeCtx, settings: DemoSettings) -> ByteLM:
    """The demo's ``ByteLM`` under ``ctx``, the same initial weights for every ctx."""
    torch.manual_seed(0)
    return ByteLM(ctx, model_config(settings))


def batch(settings: DemoSettings) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (settings.batch_size, settings.seq_len)
    g = torch.Generator().manual_seed(settings.seed)
    x, y = (torch.randint(0, 256, shape, generator=g) for _ in range(2))
    return x, y


def kept(ctx: ComputeCtx, settings: DemoSettings) -> tuple[SavedActivations, torch.Tensor]:
    """What one micro-batch's backward kept, and the flattened parameter gradients."""
    return count(demo_model(ctx, settings), *batch(settings))


def count(model: ByteLM, x: torch.Tensor, y: torch.Tensor) -> tuple[SavedActivations, torch.Tensor]:
    """One forward and backward of ``model`` under the counter: what it kept, and the
    flattened parameter gradients (then cleared)."""
    params = list(model.parameters())
    with SavedActivations(exclude=params) as saved:
        torch.autograd.backward(model.loss_of(model(x), y))
    grads = torch.cat([p.grad.float().flatten() for p in params if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return saved, grads


def user_checkpointed(model: ByteLM) -> ByteLM:
    """``model`` with each decoder block's forward under torch's non-reentrant activation
    checkpointing, as a user wraps it (``ctx.activations`` untouched)."""
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def torchao_float8(model: ByteLM) -> ByteLM:
    """``model`` converted by torchao's float8 training (every block linear; the head, a
    plain linear under the fp8 recipes here, left out)."""
    float8 = importlib.import_module("torchao.float8")
    float8.convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn != "head")
    return model


def sqnr(approx: torch.Tensor, exact: torch.Tensor) -> float:
    err = float((approx - exact).pow(2).sum())
    return math.inf if err == 0 else 10 * math.log10(float(exact.pow(2).sum()) / err)


def timed_step(model: ByteLM, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One training step of ``model``: forward, backward and an SGD step (lr 0: every round
    runs the same step)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step() -> None:
        torch.autograd.backward(model.loss_of(model(x), y))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_rows(flags: list[str], settings: DemoSettings) -> tuple[list[Row], list[str]]:
    """One row per flag and setting (and bf16's two rows that are not settings), and a line
    for each row that could not be built or run."""
    rows: list[Row] = []
    failed: list[str] = []
    for flag in flags:
        for setting in SETTINGS:
            ctx = ComputeCtx.from_flag(flag, "cpu").with_activations(setting)
            rows.append(Row(flag, setting, demo_model(ctx, settings)))
        if flag == "bf16":
            bf16 = ComputeCtx.from_flag("bf16", "cpu")
            rows.append(Row(flag, USER_CHECKPOINT, user_checkpointed(demo_model(bf16, settings))))
            try:
                rows.append(Row(flag, TORCHAO, torchao_float8(demo_model(bf16, settings))))
            except Exception as e:  # the reason is the row
                failed.append(f"{TORCHAO}: not run: {type(e).__name__}: {e}")
    x, y = batch(settings)
    for row in list(rows):
        try:  # the counted step is the timing's warm-up too
            row.saved, row.grads = count(row.model, x, y)
        except Exception as e:  # the reason is the row
            failed.append(f"{row.flag} {row.label}: failed on the CPU: {type(e).__name__}: {e}")
            rows.remove(row)
            continue
        row.step = timed_step(row.model, x, y)
    return rows, failed


def time_rows(rows: list[Row], rounds: int) -> None:
    """``rounds`` rounds, every row one step in turn each round."""
    for _ in range(rounds):
        for row in rows:
            assert row.step is not None
            start = time.perf_counter()
            row.step()
            row.times.append(time.perf_counter() - start)


def loss_table(flag: str, steps: int, seeds: list[int], settings: list[str]) -> None:
    """Train the demo under ``flag@setting`` for each seed and setting; print the validation
    losses and, per setting, its difference from ``keep``'s on the same seed (percent)."""
    from rich.progress import Progress

    from computectx.demo.corpus import load_corpus, val_batches
    from computectx.demo.train import train_policy

    if settings[0] != "keep":
        settings = ["keep", *settings]
    losses: dict[str, list[float]] = {s: [] for s in settings}
    torch.set_num_threads(DemoSettings().threads)  # as computectx demo trains
    for seed in seeds:
        demo = DemoSettings(steps=steps, seed=seed, sample_tokens=0)
        corpus = load_corpus(demo.data, min_bytes=demo.seq_len + 1)
        val = val_batches(corpus, demo.batch_size, demo.seq_len, demo.eval_batches)
        for setting in settings:
            run, acts = demo, setting
            if setting == "keep+lr":
                run, acts = demo.model_copy(update={"lr": demo.lr * (1 + 1e-6)}), "keep"
            with Progress(disable=True) as progress:
                r = train_policy(f"{flag}@{acts}", run, torch.device("cpu"), corpus, val, progress)
            losses[setting].append(r.val_loss)
            print(f"seed {seed} {flag}@{setting}: val loss {r.val_loss:.4f}", flush=True)
    print(f"\n{flag}, {steps} steps, seeds {seeds}: val loss, and against keep on the same seed")
    head = " ".join(f"{h:>7s}" for h in ("mean", "min", "max"))
    print(f"{'activations':48s} {head} {'vs keep: mean':>14s} {'min':>7s} {'max':>7s}")
    for setting, vals in losses.items():
        rel = [100 * (v / k - 1) for v, k in zip(vals, losses["keep"], strict=True)]
        mean, rmean = sum(vals) / len(vals), sum(rel) / len(rel)
        print(
            f"{setting:48s} {mean:7.4f} {min(vals):7.4f} {max(vals):7.4f} "
            f"{rmean:+13.2f}% {min(rel):+6.2f}% {max(rel):+6.2f}%"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=DemoSettings().layers)
    parser.add_argument("--d-model", type=int, default=DemoSettings().d_model)
    parser.add_argument("--flags", default=",".join(FLAGS), help="--dtype flags, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per row (median)")
    parser.add_argument("--threads", type=int, default=DemoSettings().threads)
    parser.add_argument(
        "--gemm-path",
        choices=("probe", "native", "upcast"),
        default="probe",
        help="bf16/f16 GEMMs: as the CPU probe finds (a load can mislead it), or forced",
    )
    parser.add_argument("--loss", action="store_true", help="train the demo: loss per setting")
    parser.add_argument("--flag", default="bf16", help="--loss: the demo's --dtype flag")
    parser.add_argument("--steps", type=int, default=DemoSettings().steps, help="--loss: steps")
    parser.add_argument("--seeds", default="0,1,2", help="--loss: seeds, comma-separated")
    parser.add_argument(
        "--setting", action="append", help="--loss: an activations setting (repeat the flag)"
    )
    args = parser.parse_args()
    if args.loss:
        seeds = [int(s) for s in args.seeds.split(",")]
        loss_table(args.flag, args.steps, seeds, args.setting or list(LOSS_SETTINGS))
        return
    torch.set_num_threads(args.threads)
    settings = DemoSettings(layers=args.layers, d_model=args.d_model)
    flags = args.flags.split(",")
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.gemm_path != "probe":
            stack.enter_context(forced_gemm_path(GemmPath(args.gemm_path)))
        rows, failed = build_rows(flags, settings)
        bf16_ctx = ComputeCtx.from_flag("bf16", "cpu")
        bf16, path = kept(bf16_ctx, settings)[0].bytes(), Gemm.for_ctx(bf16_ctx).path.value
    time_rows(rows, args.rounds)
    base = {r.flag: r for r in rows if r.label == "keep"}
    bf16_ms = 1e3 * statistics.median(base["bf16"].times) if "bf16" in base else math.nan
    print(
        f"{settings.layers} blocks, d_model {settings.d_model}, {settings.batch_size} x "
        f"{settings.seq_len} tokens; step: forward, backward, SGD; median of {args.rounds} "
        f"interleaved rounds, {torch.get_num_threads()} thread(s), torch {torch.__version__}; "
        f"bf16 GEMMs: {path} ({'forced' if args.gemm_path != 'probe' else 'the CPU probe'})"
    )
    kinds = " ".join(f"{k:>9s}" for k in KINDS)
    print(
        f"{'--dtype':11s} {'activations':55s} {'saved MiB':>9s} {'x bf16':>7s} {'SQNR dB':>8s} "
        f"{'step ms':>8s} {'x bf16':>7s}",
        kinds,
    )
    for row in rows:
        assert row.saved is not None and row.grads is not None
        ref = base[row.flag].grads if row.flag in base else None
        db = sqnr(row.grads, ref) if ref is not None else math.nan
        total, ms = row.saved.bytes(), 1e3 * statistics.median(row.times)
        per_kind = " ".join(f"{row.saved.bytes(k) / 2**20:9.2f}" for k in KINDS)
        print(
            f"{row.flag:11s} {row.label:55s} {total / 2**20:9.2f} {total / bf16:7.3f} "
            f"{db:8.1f} {ms:8.1f} {ms / bf16_ms:7.2f}",
            per_kind,
        )
    for line in failed:
        print(line)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
