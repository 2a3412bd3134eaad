"""Numerics of fine-grained fp8 scaling: quantize-dequantize, and the fp8 linear, per granularity.

Run: ``.venv/bin/python bench/bench_granularity.py`` (``--no-demo`` skips the demo model).
Numerics only, no timing: it runs wherever torch does (the pure-torch twins on a CPU, the
Triton kernels on an fp8 GPU, where the quantize bytes are also checked against the twins).

**Data** (seeded). ``X`` is a 256 x 1024 float32 Gaussian, as it is (``none``), with 4 random
rows (tokens) or 4 random columns (channels) multiplied by 1e2, 1e4 and 1e5. For the linear,
``W`` is a 512 x 1024 Gaussian over sqrt(1024) and ``dY`` a 256 x 512 Gaussian whose same 4
token rows (row case) or 4 random columns, output features (column case), are multiplied by
the same factor. And the demo model's own tensors: ``computectx demo``'s ByteLM, trained
under ``bf16`` with the demo's settings (120 steps of 8 x 128 bytes, the stdlib corpus, its
learning-rate schedule and gradient clipping), then one more training batch run forward and
backward with hooks on two linears, ``blocks.1.mlp.down`` (its input is the SwiGLU product)
and ``blocks.0.attn.qkv``: their input ``X``, output gradient ``dY`` and weight ``W``.

**SQNR** is ``10 log10(sum x^2 / sum (x_hat - x)^2)`` in dB over a set of elements
(``sqnr``), against float64. Outliers carry almost all of a tensor's energy, so the figure is
taken over the *body*: the elements outside the outlier rows or columns.

1. *Quantize-dequantize*: ``dequantize_tensor(*quantize_tensor(x, "e4m3", granularity=...))``
   against ``x``, over the body; the demo columns are ``X`` and ``dY``, whole.
2. *The linear*: ``QuantizedLinear`` (no bias) under each ``--dtype`` flag on bf16 ``X`` and ``dY``
   (the flags' activations) and a float32 ``W`` (their master weights), one forward and
   backward; its output ``Y = X Wᵀ``, ``dX = dY W`` and ``dW = dYᵀ X`` against float64 on the
   same values. The body of a result is what no outlier enters exactly: in the row case
   ``Y``'s and ``dX``'s other rows (``dW`` sums over every token: whole); in the column case
   ``dW`` outside the outlier rows (features) and columns (channels) (each element of ``Y``
   and ``dX`` mixes the outliers in: whole). The ``bf16`` row is the bf16 policy's GEMM with no
   fp8 (float32 accumulation, one rounding), the ceiling the fp8 rows can reach.

It prints markdown tables (docs/benchmarks.md) and the issue's targets, met or not:

- 1e5 row outliers: every fine granularity >= 25 dB, while per-tensor collapses (< 10 dB);
- 1e5 column outliers: 1x128 >= 20 dB, mx >= 23 dB.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from computectx import ComputeCtx
from computectx.dtypes import Fp8Format
from computectx.formats import Backend, QuantizedLinear, dequantize_tensor, select_backend
from computectx.formats.ops import blockwise as block_ops

FACTORS = (1e2, 1e4, 1e5)
CASES: tuple[tuple[str, float], ...] = (
    ("none", 1.0),
    *(("rows", f) for f in FACTORS),
    *(("cols", f) for f in FACTORS),
)
OUTLIERS = 4
"""Outlier rows or columns per case."""
DEMO_LAYERS = ("blocks.1.mlp.down", "blocks.0.attn.qkv")
"""The demo model's linears whose tensors are captured."""


def sqnr(approx: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """``10 log10(sum exact^2 / sum (approx - exact)^2)`` in dB over ``mask`` (default: every
    element), in float64; ``inf`` when ``approx`` is exact there."""
    e = exact.detach().double().cpu()
    d = approx.detach().double().cpu() - e
    if mask is not None:
        e, d = e[mask.cpu()], d[mask.cpu()]
    noise = float(d.square().sum())
    return math.inf if noise == 0 else 10 * math.log10(float(e.square().sum()) / noise)


def label(kind: str, factor: float) -> str:
    """A case's column head: ``none``, ``4 rows x1e4``, ..."""
    return "none" if kind == "none" else f"{OUTLIERS} {kind} x{factor:.0e}".replace("e+0", "e")


# ---------------------------------------------------------------------------------------
# Quantize-dequantize.


@dataclass(frozen=True)
class Variant:
    """One row of the quantize table: a granularity and its options."""

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
        idx = torch.randperm(rows, generator=gen)[:OUTLIERS]
        x[idx] *= factor
        body[idx] = False
    elif kind == "cols":
        idx = torch.randperm(cols, generator=gen)[:OUTLIERS]
        x[:, idx] *= factor
        body[:, idx] = False
    return x, body


def body_sqnr(
    x: torch.Tensor,
    body: torch.Tensor | None,
    fmt: Fp8Format,
    backend: Backend,
    opts: dict[str, Any],
) -> float:
    """SQNR of ``x`` quantized and dequantized with ``opts``, over ``body`` (None: whole)."""
    data, scale = block_ops.quantize_granular(x, fmt, backend=backend, **opts)
    if backend is not Backend.REFERENCE:  # the kernels' bytes are the twins', or stop
        ref = block_ops.quantize_granular(x.cpu(), fmt, backend=Backend.REFERENCE, **opts)
        for got, want in zip((data, scale), ref, strict=True):
            if not torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)):
                raise SystemExit(f"{opts}: {backend} differs from the reference twin")
    return sqnr(dequantize_tensor(data, scale, torch.float32), x.float(), body)


# ---------------------------------------------------------------------------------------
# The linear.


@dataclass(frozen=True)
class LinearData:
    """One linear's operands and the bodies of its three results (None: whole)."""

    x: torch.Tensor  # [M, K] bf16
    weight: torch.Tensor  # [N, K] float32
    dy: torch.Tensor  # [M, N] bf16
    body_y: torch.Tensor | None = None
    body_dx: torch.Tensor | None = None
    body_dw: torch.Tensor | None = None

    def exact(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Y``, ``dX`` and ``dW`` in float64 on the same values."""
        x, w, dy = self.x.double(), self.weight.double(), self.dy.double()
        return x @ w.t(), dy @ w, dy.t() @ x


def linear_data(
    kind: str, factor: float, m: int, k: int, n: int, seed: int, device: str
) -> LinearData:
    """``X`` from ``outlier_data``, Gaussian ``W`` and ``dY`` with the matching outliers."""
    x, x_body = outlier_data(kind, factor, m, k, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    dy = torch.randn(m, n, generator=gen)
    body_y = body_dx = body_dw = None
    if kind == "rows":
        tokens = x_body.all(dim=1)  # the rows outside the outlier tokens
        dy[~tokens] *= factor
        body_y = tokens.unsqueeze(1).expand(m, n)
        body_dx = tokens.unsqueeze(1).expand(m, k)
    elif kind == "cols":
        features = torch.ones(n, dtype=torch.bool)
        features[torch.randperm(n, generator=gen)[:OUTLIERS]] = False
        dy[:, ~features] *= factor
        body_dw = features.unsqueeze(1) & x_body.all(dim=0).unsqueeze(0)
    return LinearData(
        x.bfloat16().to(device), w.to(device), dy.bfloat16().to(device), body_y, body_dx, body_dw
    )


@dataclass(frozen=True)
class LinearVariant:
    """One row of the linear tables: a ``--dtype`` flag (and its granularity's name)."""

    label: str
    flag: str


LINEAR_VARIANTS = (
    LinearVariant("bf16 (no fp8)", "bf16"),
    LinearVariant("tensor (dynamic)", "fp8_e4m3_dynamic"),
    LinearVariant("row", "fp8_rowwise"),
    LinearVariant("row+gw_hp", "fp8_rowwise_gw_hp"),
    LinearVariant("block (1x128, 128x128 W)", "fp8_block"),
    LinearVariant("mx (rceil)", "fp8_mx"),
)
RESULTS = ("output Y", "dX", "dW")


def run_linear(
    flag: str, data: LinearData, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | str:
    """``(Y, dX, dW)`` of one forward and backward under ``flag``, or why it cannot run."""
    n, k = data.weight.shape
    ctx = ComputeCtx.from_flag(flag, device)
    x = data.x.clone().requires_grad_()
    if ctx.recipe is None:  # the policy's own GEMM: float32 accumulation, one rounding
        from computectx.nn import Gemm

        w = data.weight.clone().requires_grad_()
        y = Gemm.for_ctx(ctx).linear(x, w)
        torch.autograd.backward(y, data.dy)
        weight_grad = w.grad
    else:
        try:
            layer = QuantizedLinear(k, n, bias=False, ctx=ctx, device=device, dtype=torch.float32)
            with torch.no_grad():
                layer.weight.copy_(data.weight)
            y = layer(x)
        except ValueError as e:  # a granularity the fp8 linear does not run (yet)
            return str(e).split(";")[0]
        torch.autograd.backward(y, data.dy)
        weight_grad = layer.weight.grad
    assert x.grad is not None and weight_grad is not None
    return y.detach(), x.grad, weight_grad


def linear_sqnr(flag: str, data: LinearData, device: str) -> tuple[float, float, float] | str:
    """SQNR of ``Y``, ``dX`` and ``dW`` over their bodies, or why the flag cannot run."""
    got = run_linear(flag, data, device)
    if isinstance(got, str):
        return got
    bodies = (data.body_y, data.body_dx, data.body_dw)
    y, dx, dw = (sqnr(g, e, b) for g, e, b in zip(got, data.exact(), bodies, strict=True))
    return y, dx, dw


# ---------------------------------------------------------------------------------------
# The demo model's tensors.


@dataclass(frozen=True)
class Captured:
    """A linear's input, output gradient and weight, as the bf16 demo run saw them."""

    x: torch.Tensor
    dy: torch.Tensor
    weight: torch.Tensor


class _Probe(nn.Linear):
    """Stands in for a demo linear during the capture. The blocks run a plain ``nn.Linear``
    through ``Gemm.linear`` without calling it, so its hooks would never fire; a subclass is
    called as a module, and runs the same GEMM."""

    def __init__(self, layer: nn.Linear, ctx: ComputeCtx) -> None:
        super().__init__(layer.in_features, layer.out_features, bias=False, device="meta")
        self.weight = layer.weight
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from computectx.nn import Gemm

        out: torch.Tensor = Gemm.for_ctx(self.ctx).linear(x, self.weight)
        return out


def _keep_input(store: dict[str, torch.Tensor]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        store["x"] = args[0].detach()

    return hook


def _keep_grad_output(store: dict[str, torch.Tensor]) -> Callable[..., None]:
    def hook(module: nn.Module, grad_in: object, grad_out: tuple[torch.Tensor, ...]) -> None:
        store["dy"] = grad_out[0].detach()

    return hook


def demo_tensors(steps: int, device: str, log: Callable[[str], None]) -> dict[str, Captured]:
    """Train the demo's ByteLM under ``bf16`` as ``computectx demo`` does, for ``steps``
    steps; then run one more batch with hooks on ``DEMO_LAYERS`` and return what they saw."""
    from computectx.demo.corpus import load_corpus, train_batches
    from computectx.demo.settings import DemoSettings
    from computectx.demo.train import lr_at, model_config
    from computectx.nn import ByteLM

    settings = DemoSettings(steps=steps)
    dev = torch.device(device)
    ctx = ComputeCtx.from_flag("bf16", dev)
    corpus = load_corpus(settings.data, min_bytes=settings.seq_len + 1)
    torch.manual_seed(settings.seed)
    model = ByteLM(ctx, model_config(settings))
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = train_batches(
        corpus, settings.batch_size, settings.seq_len, settings.seed
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)  # as the demo runs (one thread by default)
    t0 = time.perf_counter()
    loss = torch.zeros(())
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, settings.steps, settings.lr)
        ids, targets = (t.to(dev) for t in next(batches))
        loss = model.loss(ids, targets)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.set_num_threads(threads)
    log(
        f"demo ByteLM ({settings.layers} blocks, d_model {settings.d_model}) trained under bf16 "
        f"for {settings.steps} steps in {time.perf_counter() - t0:.0f} s; last loss "
        f"{float(loss.detach()):.3f}"
    )
    seen: dict[str, dict[str, torch.Tensor]] = {name: {} for name in DEMO_LAYERS}
    modules = dict(model.named_modules())
    originals: dict[str, nn.Linear] = {}
    for name in DEMO_LAYERS:
        parent_name, _, attr = name.rpartition(".")
        layer = modules[name]
        assert isinstance(layer, nn.Linear)
        originals[name] = layer
        probe = _Probe(layer, ctx)
        probe.register_forward_hook(_keep_input(seen[name]))
        probe.register_full_backward_hook(_keep_grad_output(seen[name]))
        setattr(modules[parent_name], attr, probe)
    ids, targets = (t.to(dev) for t in next(batches))
    torch.autograd.backward(model.loss(ids, targets))
    for name, layer in originals.items():
        parent_name, _, attr = name.rpartition(".")
        setattr(modules[parent_name], attr, layer)
    out = {}
    for name, store in seen.items():
        x, dy = store["x"], store["dy"]
        out[name] = Captured(
            x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), originals[name].weight
        )
    return out


# ---------------------------------------------------------------------------------------
# Tables.


def table(title: str, heads: list[str], rows: list[tuple[str, list[str]]]) -> None:
    print(f"\n{title}\n")
    print("| granularity | " + " | ".join(heads) + " |")
    print("| --- |" + " ---: |" * len(heads))
    for name, cells in rows:
        print(f"| {name} | " + " | ".join(cells) + " |")


def cell(db: float) -> str:
    return "exact" if math.isinf(db) else f"{db:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="tokens M")
    parser.add_argument("--cols", type=int, default=1024, help="channels K")
    parser.add_argument("--out-features", type=int, default=512, help="the linear's N")
    parser.add_argument("--fmt", default="e4m3", help="e4m3 or e5m2 (the quantize table)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--demo-steps", type=int, default=120, help="the demo's default")
    parser.add_argument("--no-demo", action="store_true", help="skip the demo model")
    args = parser.parse_args()
    fmt = Fp8Format.parse(args.fmt)
    backend, why = select_backend(args.device)
    print(
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {args.device}; backend {why}"
    )
    m, k, n = args.rows, args.cols, args.out_features
    print(f"X {m} x {k}, W {n} x {k}, dY {m} x {n} (seed {args.seed}); SQNR in dB, over the body")
    demo = {} if args.no_demo else demo_tensors(args.demo_steps, args.device, print)
    cases = [(label(kind, f), kind, f) for kind, f in CASES]

    # 1. Quantize-dequantize.
    demo_heads = [f"demo {name} {t}" for name in demo for t in ("X", "dY")]
    qtable: dict[tuple[str, str, float], float] = {}
    rows = []
    for v in VARIANTS:
        cells = []
        for _, kind, factor in cases:
            x, body = outlier_data(kind, factor, m, k, args.seed)
            qtable[v.label, kind, factor] = db = body_sqnr(
                x.to(args.device), body, fmt, backend, v.options
            )
            cells.append(cell(db))
        for cap in demo.values():
            for t in (cap.x, cap.dy):
                cells.append(cell(body_sqnr(t, None, fmt, backend, v.options)))
        rows.append((v.label, cells))
    table(f"Quantize-dequantize, {fmt}: body SQNR", [c[0] for c in cases] + demo_heads, rows)

    # 2. The linear.
    data = [linear_data(kind, factor, m, k, n, args.seed, args.device) for _, kind, factor in cases]
    data += [LinearData(c.x, c.weight.detach().float(), c.dy) for c in demo.values()]
    heads = [c[0] for c in cases] + [f"demo {name}" for name in demo]
    figures = {
        lv.label: [linear_sqnr(lv.flag, d, args.device) for d in data] for lv in LINEAR_VARIANTS
    }
    refused = {}
    for i, result in enumerate(RESULTS):
        rows = []
        for lv in LINEAR_VARIANTS:
            cells = []
            for fig in figures[lv.label]:
                if isinstance(fig, str):
                    refused[lv.label] = fig
                    cells.append("—")
                else:
                    cells.append(cell(fig[i]))
            rows.append((f"{lv.label} (`{lv.flag}`)", cells))
        table(
            f"QuantizedLinear {result}: SQNR against float64 (body where outliers leave one)",
            heads,
            rows,
        )
    for name, why in refused.items():
        print(f"\n{name}: not run: {why}")

    def of(granularity: str) -> list[str]:
        return [v.label for v in VARIANTS if v.options["granularity"] == granularity]

    targets = [(f"{lb}, 4 rows x1e5 >= 25", qtable[lb, "rows", 1e5] >= 25.0) for lb in FINE]
    targets.append(("tensor, 4 rows x1e5 < 10 (collapses)", qtable["tensor", "rows", 1e5] < 10.0))
    for granularity, floor in (("1x128", 20.0), ("mx", 23.0)):
        for lb in of(granularity):
            targets.append((f"{lb}, 4 cols x1e5 >= {floor:.0f}", qtable[lb, "cols", 1e5] >= floor))
    print("\nquantize-dequantize targets (dB)")
    for name, met in targets:
        print(f"  {'met    ' if met else 'NOT MET'}  {name}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
