"""What autograd keeps for the backward on the demo model, per ``--dtype`` flag and
``ctx.activations`` setting, side by side from one run, with each setting's gradient SQNR
against ``keep`` under the same flag.

    python bench/bench_activations.py                # the demo's default shape, on the CPU
    python bench/bench_activations.py --layers 4 --d-model 256
    python bench/bench_activations.py --loss --steps 800 --seeds 0,1,2

Saved bytes are counted as the demo's ``saved MiB`` counts them (every storage autograd keeps
during one micro-batch's forward and backward, each once, parameters excluded), split by kind
with ``computectx.memory.SavedActivations``. Nothing is timed and nothing asserted;
docs/activations.md shows a run.

``--loss`` trains the demo instead (its default settings, ``--steps`` steps, each seed of
``--seeds``) under ``--flag`` with each ``--setting`` (``computectx demo --dtype FLAG@SETTING``
trains the same; ``keep+lr`` is ``keep`` with the peak learning rate 1e-6 higher, the noise
floor) and prints each run's validation loss, then per setting the mean and the spread of its
difference from ``keep`` on the same seed, in percent: the loss bound of docs/memory.md.
Slow: one demo training per seed and setting (docs/benchmarks.md has figures).
"""

from __future__ import annotations

import argparse
import math

import torch

from computectx import ComputeCtx
from computectx.demo.settings import DemoSettings
from computectx.demo.train import model_config
from computectx.memory import SavedActivations
from computectx.memory.activation_bytes import SavedKind
from computectx.nn.lm import ByteLM

FLAGS = ("fp32", "bf16", "fp8_hybrid", "fp8_block")
SETTINGS = (
    "keep",
    "precise:recompute/act_fn:recompute/attention:recompute",
    "precise:recompute/act_fn:fp8/attention:recompute",
    "precise:fp8/act_fn:fp8/attention:fp8",
    "fp8",
)


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


def kept(ctx: ComputeCtx, settings: DemoSettings) -> tuple[SavedActivations, torch.Tensor]:
    """What one micro-batch's backward kept, and the flattened parameter gradients."""
    torch.manual_seed(0)
    model = ByteLM(ctx, model_config(settings))
    shape = (settings.batch_size, settings.seq_len)
    g = torch.Generator().manual_seed(settings.seed)
    x, y = (torch.randint(0, 256, shape, generator=g) for _ in range(2))
    params = list(model.parameters())
    with SavedActivations(exclude=params) as saved:
        torch.autograd.backward(model.loss_of(model(x), y))
    grads = torch.cat([p.grad.float().flatten() for p in params if p.grad is not None])
    return saved, grads


def sqnr(approx: torch.Tensor, exact: torch.Tensor) -> float:
    err = float((approx - exact).pow(2).sum())
    return math.inf if err == 0 else 10 * math.log10(float(exact.pow(2).sum()) / err)


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
    settings = DemoSettings(layers=args.layers, d_model=args.d_model)
    kinds = " ".join(f"{k:>9s}" for k in KINDS)
    print(
        f"{'--dtype':11s} {'activations':55s} {'saved MiB':>9s} {'x bf16':>7s} {'SQNR dB':>8s}",
        kinds,
    )
    bf16 = kept(ComputeCtx.from_flag("bf16", "cpu"), settings)[0].bytes()
    for flag in FLAGS:
        ref: torch.Tensor | None = None
        for setting in SETTINGS:
            ctx = ComputeCtx.from_flag(flag, "cpu").with_activations(setting)
            saved, grads = kept(ctx, settings)
            ref = grads if ref is None else ref
            total = saved.bytes()
            row = f"{flag:11s} {setting:55s} {total / 2**20:9.2f} {total / bf16:7.3f}"
            per_kind = " ".join(f"{saved.bytes(k) / 2**20:9.2f}" for k in KINDS)
            print(row, f"{sqnr(grads, ref):8.1f}", per_kind)


if __name__ == "__main__":
    main()
