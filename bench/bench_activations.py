"""What autograd keeps for the backward on the demo model, per ``--dtype`` flag and
``ctx.activations`` setting, side by side from one run, with each setting's gradient SQNR
against ``keep`` under the same flag.

    python bench/bench_activations.py                # the demo's default shape, on the CPU
    python bench/bench_activations.py --layers 4 --d-model 256

Saved bytes are counted as the demo's ``saved MiB`` counts them (every storage autograd keeps
during one micro-batch's forward and backward, each once, parameters excluded), split by kind
with ``computectx.memory.SavedActivations``. Nothing is timed and nothing asserted;
docs/activations.md shows a run.
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
    "precise:fp8/act_fn:fp8",
    "precise:fp8/act_fn:fp8/attention:fp8",
)


KINDS: tuple[SavedKind, ...] = ("precise", "act_fn", "attention", "other")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=DemoSettings().layers)
    parser.add_argument("--d-model", type=int, default=DemoSettings().d_model)
    args = parser.parse_args()
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
