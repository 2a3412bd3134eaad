"""Per-GEMM SQNR of the 4-bit recipes (NVFP4, MXFP4) against bf16: Y, dX and dW of one linear.

Run: ``.venv/bin/python bench/bench_fp4_gemm.py`` (``--help`` for the shape). Prints a markdown
table per input setting.

**The GEMMs.** One linear ``Y = X Wᵀ`` with ``X [M, K]`` (M tokens), ``W [N, K]`` and an output
gradient ``dY [M, N]``: the forward ``Y``, the input gradient ``dX = dY W`` and the weight
gradient ``dW = dYᵀ X``. Each 4-bit GEMM quantizes its operands as TransformerEngine's
``NVFP4BlockScaling`` does (``computectx.formats.numerics.fp4_gemm``'s table: X and dY 1x16 along
the contraction, W at its weight tile, the dW operands column-wise along M with the random
Hadamard transform; dY stochastically rounded) and runs through ``computectx.formats.ops.fp4``
(the emulated backend: the float32 twin, on the CPU). Y and dX are written in bf16, dW in
float32, as the 4-bit linear will.

**The reference** is bf16's: the product of the bf16 operands, formed exactly (float64) — what a
bf16 GEMM computes before it rounds its output. ``SQNR = 10 log10(sum ref^2 / sum (got -
ref)^2)`` in dB. The ``bf16`` row is the bf16 GEMM itself (its output rounded to bf16), the
ceiling a 16-bit output allows. ``dW rest`` is dW's SQNR over the entries no outlier reaches
(neither X's column k nor dY's column n holds one): there an outlier acts only through the
per-tensor amax, which pushes the other blocks' E4M3 scales down towards E4M3's subnormals
(NVFP4), the effect the transform reduces by spreading each outlier over 16 values.

**Settings**: ``gaussian`` (X, dY ~ N(0, 1), W ~ N(0, 1/K)), ``outliers in X`` (the same, then
``--outlier-frac`` of X's elements set to ``±1e5``: the case the Hadamard transform is for,
spreading an outlier over the 16 tokens of its run before dW's operands are quantized along the
tokens) and ``outliers in X and dY`` (dY's too: dW is then dominated by the products of two
outliers in one token, which every format codes nearly exactly, so its ``dW`` column is high),
and ``heavy tails`` (X and dY elements ``N(0, 1) exp(1.5 N(0, 1))``: log-normal magnitudes).

**Rows**: ``nvfp4`` (TE's defaults: 16x16 weight tiles, stochastic rounding of dY, the Hadamard
transform on dW's operands), then the same with one choice changed (``no_rht``, ``no_sr``,
``w1x16``), ``nvfp4 plain`` (1x16 weights, round to nearest, no transform: the recipe
torchao's ``NVFP4Tensor`` expresses), ``mxfp4`` (1x32 E8M0, ``rceil``), ``mxfp4 floor``
and ``mxfp4 +rht`` (the transform on dW's operands, as an option). **torchao** columns:
torchao 0.18's emulation of the same recipe on the CPU — its ``NVFP4Tensor.to_nvfp4`` (the
per-tensor scale from the amax) or ``MXTensor.to_mx`` (``float4_e2m1fn_x2``, 32, the rule)
quantizes each operand along the same axis, dequantizes it, and the product is taken in float64;
``-`` where torchao has no such recipe (16x16 tiles, stochastic rounding, the transform).
"""

from __future__ import annotations

import argparse
import importlib
import math
import platform
import time

import torch

from computectx.formats.numerics.e2m1 import Stochastic
from computectx.formats.numerics.fp4_gemm import Fp4Quant
from computectx.formats.ops import fp4 as fp4_ops

Gemms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # Y, dX, dW
OUTLIER = 1e5


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (got - ref)^2)`` in dB (inf for an exact result)."""
    ref, got = ref.double(), got.double()
    err = float((got - ref).pow(2).sum())
    return math.inf if err == 0 else 10 * math.log10(float(ref.pow(2).sum()) / err)


def reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> Gemms:
    """bf16's GEMMs before their output rounding: the exact products of the bf16 operands."""
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    return x64 @ w64.t(), dy64 @ w64, dy64.t() @ x64


def bf16_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> Gemms:
    """The bf16 GEMMs: the exact products rounded once to bf16."""
    return tuple(t.to(torch.bfloat16) for t in reference(x, w, dy))  # type: ignore[return-value]


def fp4_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, how: Fp4Quant, sr: bool) -> Gemms:
    """The three GEMMs of a 4-bit linear on the 4-bit operators (module docstring)."""
    m, n = dy.shape
    key_dx = Stochastic(seed=1234, offset=0) if sr else None
    key_dw = Stochastic(seed=1234, offset=m * n) if sr else None
    bf16, f32 = torch.bfloat16, torch.float32
    qw = fp4_ops.quantize(w, how, weight=True)
    y = fp4_ops.scaled_mm(fp4_ops.quantize(x, how), qw, bf16)
    # dX = dY W: W^T [K, N] at the weight tile (a 16x16 tile's codes are the forward's).
    qwt = fp4_ops.quantize(w.t(), how, weight=True)
    dx = fp4_ops.scaled_mm(fp4_ops.quantize(dy, how, stochastic=key_dx), qwt, bf16)
    qd = fp4_ops.quantize(dy, how, columnwise=True, stochastic=key_dw)
    dw = fp4_ops.scaled_mm(qd, fp4_ops.quantize(x, how, columnwise=True), f32)
    return y, dx, dw


def torchao_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, fmt: str) -> Gemms | None:
    """torchao's emulation: each operand quantized along its contraction, dequantized, the
    products in float64; None when torchao does not import."""
    try:
        config = importlib.import_module("torchao.prototype.mx_formats.config")
        mx = importlib.import_module("torchao.prototype.mx_formats.mx_tensor")
        nv = importlib.import_module("torchao.prototype.mx_formats.nvfp4_tensor")
    except ImportError:
        return None

    def deq(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if fmt == "nvfp4":
            scale = nv.per_tensor_amax_to_scale(t.float().abs().amax())
            q = nv.NVFP4Tensor.to_nvfp4(t, per_tensor_scale=scale)
        else:
            mode = (
                config.ScaleCalculationMode.RCEIL
                if fmt == "mxfp4"
                else config.ScaleCalculationMode.FLOOR
            )
            q = mx.MXTensor.to_mx(t, torch.float4_e2m1fn_x2, 32, mode)
        values: torch.Tensor = q.dequantize(torch.float32)
        return values.double()

    y = deq(x) @ deq(w).t()
    dx = deq(dy) @ deq(w.t()).t()
    dw = deq(dy.t()) @ deq(x.t()).t()
    return y, dx, dw


ROWS: list[tuple[str, Fp4Quant, bool, str | None]] = [
    # label, recipe values, stochastic rounding of dY, torchao's equivalent
    ("nvfp4", Fp4Quant(), True, None),
    ("nvfp4 no_rht", Fp4Quant(hadamard=False), True, None),
    ("nvfp4 no_sr", Fp4Quant(), False, None),
    ("nvfp4 w1x16", Fp4Quant(weight_tile="1x16"), True, None),
    ("nvfp4 plain", Fp4Quant(weight_tile="1x16", hadamard=False), False, "nvfp4"),
    ("mxfp4 (rceil)", Fp4Quant(format="mxfp4", hadamard=False), False, "mxfp4"),
    ("mxfp4 floor", Fp4Quant(format="mxfp4", mx_rounding="floor", hadamard=False), False, "floor"),
    ("mxfp4 +rht", Fp4Quant(format="mxfp4"), False, None),
]  # fmt: skip


def inputs(m: int, k: int, n: int, setting: str, frac: float, seed: int) -> Gemms:
    """``x [M, K]``, ``w [N, K]``, ``dy [M, N]`` in bf16 for one setting (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    dy = torch.randn(m, n, generator=gen)
    if setting == "heavy tails":
        x = x * torch.exp(1.5 * torch.randn(m, k, generator=gen))
        dy = dy * torch.exp(1.5 * torch.randn(m, n, generator=gen))
    outliers = {"outliers in X": (x,), "outliers in X and dY": (x, dy)}.get(setting, ())
    for t in outliers:
        mask = torch.rand(t.shape, generator=gen) < frac
        t[mask] = OUTLIER * torch.sign(t[mask])
    return x.bfloat16(), w.bfloat16(), dy.bfloat16()


SETTINGS = {
    "gaussian": "",
    "outliers in X": "{frac:g} of X's elements set to ±1e5",
    "outliers in X and dY": "{frac:g} of X's and of dY's elements set to ±1e5",
    "heavy tails": "X and dY elements N(0, 1) exp(1.5 N(0, 1))",
}


def table(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, with_torchao: bool) -> list[str]:
    ref = reference(x, w, dy)
    # dW's entries that no outlier reaches: neither X's column k nor dY's column n holds one.
    rest = ~(dy.abs() >= OUTLIER / 10).any(0)[:, None] & ~(x.abs() >= OUTLIER / 10).any(0)[None, :]

    def cells(got: Gemms | None) -> list[str]:
        if got is None:
            return ["-"] * 4
        scores = [sqnr(r, g) for r, g in zip(ref, got, strict=True)]
        scores.append(sqnr(ref[2][rest], got[2][rest]))
        return [f"{v:.1f}" for v in scores]

    lines = [
        "| recipe | Y | dX | dW | dW rest | torchao Y | dX | dW | dW rest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        "| bf16 | " + " | ".join(cells(bf16_gemms(x, w, dy))) + " | - | - | - | - |",
    ]
    runs: dict[str | None, Gemms | None] = {None: None}
    for label, how, sr, ao in ROWS:
        ours = cells(fp4_gemms(x, w, dy, how, sr))
        if ao is not None and with_torchao and ao not in runs:
            runs[ao] = torchao_gemms(x, w, dy, ao)
        theirs = cells(runs.get(ao))
        lines.append(f"| {label} | " + " | ".join(ours + theirs) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="M (a multiple of 16)")
    parser.add_argument("--dim", type=int, default=512, help="K, the input features")
    parser.add_argument("--hidden", type=int, default=512, help="N, the output features")
    parser.add_argument("--outlier-frac", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-torchao", action="store_true", help="skip torchao's columns")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, {platform.machine()} {platform.processor() or ''}".strip()
        + f"; M={args.tokens} K={args.dim} N={args.hidden}, seed {args.seed}; "
        + fp4_ops.select_fp4_backend("cpu")[1]
    )
    for name, text in SETTINGS.items():
        x, w, dy = inputs(args.tokens, args.dim, args.hidden, name, args.outlier_frac, args.seed)
        extra = f" ({text.format(frac=args.outlier_frac)})" if text else ""
        print(f"\n**{name}**{extra}: SQNR in dB against bf16's exact products\n")
        print("\n".join(table(x, w, dy, not args.no_torchao)))
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
