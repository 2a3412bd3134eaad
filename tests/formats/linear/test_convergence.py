"""Convergence: a small MLP trained 200 steps in fp8 (HYBRID, delayed and dynamic scaling,
reference backend) ends within 3% of the BF16 run's loss; SQNR of outputs and gradients
against BF16 is reported (run with ``-s`` to see it) and checked against a derived floor."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional

from computectx import ComputeCtx
from computectx.formats import (
    DelayedScaling,
    DynamicScaling,
    QuantizedLinear,
    convert_to_quantized,
    scaling_stats,
)

from ..conftest import CtxFor

STEPS = 200
BATCH = 128
IN, HIDDEN, OUT = 64, 128, 16

RECIPES: dict[str, DelayedScaling | DynamicScaling] = {
    "delayed": DelayedScaling(),
    "dynamic": DynamicScaling(),
}


def teacher() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(HIDDEN, IN, generator=g) / 8, torch.randn(OUT, HIDDEN, generator=g) / 11


def batches(seed: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Draws of a fixed nonlinear regression target; the same seed gives the same data."""
    t1, t2 = teacher()
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, IN, generator=g)
        return x, torch.tanh(x @ t1.t()) @ t2.t()

    return draw


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, OUT),
    )


def build(ctx: ComputeCtx | None) -> tuple[nn.Sequential, Callable[[torch.Tensor], torch.Tensor]]:
    """The model and its forward: BF16 autocast (``None``) or every linear in fp8 (``ctx``)."""
    model = mlp()
    if ctx is None:

        def bf16(x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y: torch.Tensor = model(x.bfloat16())
            return y.float()

        return model, bf16
    report = convert_to_quantized(model, ctx, min_features=16, include_head=True)
    assert len(report.converted) == 3

    def fp8(x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = model(x.bfloat16())
        return y.float()

    return model, fp8


def train(ctx: ComputeCtx | None) -> float:
    """Final loss on held-out data after ``STEPS`` AdamW steps (``None``: BF16)."""
    model, forward = build(ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    draw = batches(seed=7)
    for _ in range(STEPS):
        x, y = draw(BATCH)
        loss = functional.mse_loss(forward(x), y)
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
    if ctx is not None:
        for name, s in scaling_stats(model).items():
            assert s.input.nonfinite_count == 0 and s.grad.nonfinite_count == 0, name
    xe, ye = batches(seed=99)(2048)
    with torch.no_grad():
        return float(functional.mse_loss(forward(xe), ye))


@pytest.fixture(scope="module")
def bf16_loss() -> float:
    return train(None)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_training_ends_within_3_percent_of_bf16(
    recipe: str, bf16_loss: float, ctx_for: CtxFor
) -> None:
    xe, ye = batches(seed=99)(2048)
    with torch.no_grad():
        start = float(functional.mse_loss(build(None)[1](xe), ye))
    loss = train(ctx_for(RECIPES[recipe]))
    gap = (loss - bf16_loss) / bf16_loss
    print(f"\nfinal loss: bf16 {bf16_loss:.5f}, fp8 {recipe} {loss:.5f} ({gap:+.2%})")
    assert bf16_loss < start / 5  # the task was learned, so the comparison means something
    assert abs(gap) <= 0.03


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``test`` against ``ref``, in dB."""
    noise = (ref.double() - test.double()).square().sum()
    return 10 * math.log10(float(ref.double().square().sum() / noise))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_sqnr_of_outputs_and_gradients_against_bf16(recipe: str, ctx_for: CtxFor) -> None:
    """SQNR floor, derived: rounding to a format with relative error up to ``u`` (uniform
    in ``[-u, u]`` at worst) adds noise of variance ``u²/3`` relative to the signal; a
    product of two quantized operands adds both. Outputs (E4M3 x E4M3, ``u = 2**-4``):
    ``-10·log10(2·u²/3) = 25.8 dB``; gradients (E5M2 ``u = 2**-3`` with E4M3):
    ``-10·log10((2**-6 + 2**-8)/3) = 21.9 dB``. The floors leave 6 dB for layers
    compounding their errors."""
    x, y = batches(seed=5)(BATCH)
    results: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for name in ("bf16", recipe):
        model, forward = build(None if name == "bf16" else ctx_for(RECIPES[recipe]))
        out = forward(x)
        torch.autograd.backward(functional.mse_loss(out, y))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        results[name] = (out.detach(), [g.detach() for g in grads])
        if name != "bf16":
            assert all(isinstance(m, QuantizedLinear) for m in model if isinstance(m, nn.Linear))
    out_ref, g_ref = results["bf16"]
    out_fp8, g_fp8 = results[recipe]
    out_db = sqnr_db(out_ref, out_fp8)
    grad_db = [sqnr_db(a, b) for a, b in zip(g_ref, g_fp8, strict=True)]
    print(
        f"\nSQNR vs bf16 ({recipe}): output {out_db:.1f} dB, "
        f"gradients {', '.join(f'{d:.1f}' for d in grad_db)} dB (min {min(grad_db):.1f})"
    )
    assert out_db >= 19.8
    assert min(grad_db) >= 15.9
