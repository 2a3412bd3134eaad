"""Per-GEMM SQNR of the 4-bit grouped experts (``Fp4Experts``) against the bf16 GEMM.

One random case, one seed: 8 experts, N = 256, K = 512, groups of 300, 0, 17, 128, 64, 511, 9
and 3 rows. The reference is each group's rows in float32 from the bf16 operands (``Y``,
``dX``, ``dW``); each 4-bit recipe runs one forward and backward through ``Fp4Experts.mm``.

    .venv/bin/python bench/bench_fp4_experts.py
"""

from __future__ import annotations

import torch

from computectx.formats import Fp4Experts, Fp4Recipe

RECIPES = ("nvfp4", "nvfp4+no_sr+no_rht", "mxfp4", "mxfp4+sr+rht")
SIZES = (300, 0, 17, 128, 64, 511, 9, 3)
N, K = 256, 512


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    """``10 log10(|ref|² / |got - ref|²)`` in dB, in float64."""
    ref, got = ref.detach().double(), got.detach().double()
    return float(10 * torch.log10(ref.square().sum() / (got - ref).square().sum()))


def references(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Y, dX, dW)`` of each group in float32 from the bf16 operands."""
    m, e = x.shape[0], w.shape[0]
    y, dx, dw = torch.zeros(m, N), torch.zeros(m, K), torch.zeros(e, N, K)
    wf, start = w.float(), 0
    for g, rows in enumerate(SIZES):
        sl = slice(start, start + rows)
        y[sl], dx[sl] = x[sl].float() @ wf[g].t(), dy[sl].float() @ wf[g]
        dw[g] = dy[sl].float().t() @ x[sl].float()
        start += rows
    return y, dx, dw


def main() -> None:
    torch.manual_seed(0)
    m = sum(SIZES)
    offs = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    x = torch.randn(m, K).bfloat16()
    w = (torch.randn(len(SIZES), N, K) / K**0.5).bfloat16()
    dy = torch.randn(m, N).bfloat16()
    y_ref, dx_ref, dw_ref = references(x, w, dy)
    print("| recipe | Y | dX | dW |\n| --- | ---: | ---: | ---: |")
    for text in RECIPES:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = Fp4Experts(Fp4Recipe.parse(text)).mm(xs, ws, offs)
        torch.autograd.backward(y, dy)
        assert xs.grad is not None and ws.grad is not None
        cells = [sqnr(y_ref, y), sqnr(dx_ref, xs.grad), sqnr(dw_ref, ws.grad)]
        print(f"| {text} | " + " | ".join(f"{c:.2f} dB" for c in cells) + " |")


if __name__ == "__main__":
    main()
