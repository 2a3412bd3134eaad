"""fp8 grouped GEMMs against bf16 ``F.grouped_mm`` on the CPU, and expert weight bytes.

Run: ``.venv/bin/python bench/bench_moe.py`` (``--help`` for the shape). Prints markdown
tables (docs/benchmarks.md has a run).

**The GEMM.** One expert projection of a mixture-of-experts layer: ``--tokens`` tokens
routed top-``k`` to ``--experts`` experts give ``M = tokens * k`` rows sorted by expert,
``x [M, K]`` against the experts' weights ``w [E, N, K]`` (``K = --dim``, ``N = --hidden``).
The group sizes come from a skewed router (seeded softmax preferences, a multinomial draw
per token), the last expert gets no token, and no size is a multiple of 16 (printed).
``x``, ``w`` and ``dY`` are Gaussian (``w`` over ``sqrt(K)``), rounded to bf16 so every
row below sees the same values.

Rows, timed side by side (each round runs every row once, in order; the figure is the
median round), with ``torch`` at ``--threads`` intra-op threads:

- ``bf16 F.grouped_mm``: torch's grouped GEMM in bf16, the baseline every ratio is over;
- ``f32 F.grouped_mm``: the same in float32, the reference of the SQNR columns;
- ``fp8 <granularity>``: ``computectx.formats.quantized_grouped_mm`` under the ``--dtype`` flag's
policy
  (``fp8_hybrid_dynamic``: tensor; ``fp8_rowwise``; ``fp8_rowwise_gw_hp``; ``fp8_block``;
  ``fp8_mx``) on ``--backend`` (``reference``, the float32 twin, by default: a loop over the
  groups in pure torch, so its times say what the twin costs, nothing about a GPU).

``fwd`` is ``Y = grouped(x, w)``; ``fwd+bwd`` adds ``Y.backward(dY)`` (dX and dW). The
SQNR of Y, dX and dW is ``10 log10(sum ref^2 / sum (got - ref)^2)`` in dB against the f32 row.
The bench stops unless every row's dW of the empty expert is exactly zero.

**Expert weight bytes** per MoE layer (the up/gate projection ``[E, 2H, D]`` and the down
projection ``[E, D, H]``) for the demo's MoE model, Llama 4 17B-16E and DeepSeek-V3: bf16
weights against fp8 codes plus the steps of each granularity's weight operand
(``expert_weight_bytes``): ``tensor`` one float32 step per expert and matrix, ``row`` one
per output row, ``block`` one per 128x128 block, ``mx`` one E8M0 byte per 1x32 block.
"Training" adds what the input gradient's ``Wᵀ`` operand holds besides: ``row`` and ``mx``
quantize ``Wᵀ`` again along the other axis (codes and steps); ``tensor`` and ``block`` reuse
the forward's codes. The step formula is checked against the bytes ``quantize_tensor`` returns
for the bench's own ``w``.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from computectx import ComputeCtx
from computectx.formats import Backend, quantize_tensor, quantized_grouped_mm

RECIPES: tuple[tuple[str, str], ...] = (
    ("tensor", "fp8_hybrid_dynamic"),
    ("row", "fp8_rowwise"),
    ("row+gw_hp", "fp8_rowwise_gw_hp"),
    ("block", "fp8_block"),
    ("mx", "fp8_mx"),
)
"""Each granularity's row and the ``--dtype`` flag whose policy it runs."""

MODELS: dict[str, tuple[int, int, int]] = {
    "demo --moe": (8, 128, 128),
    "Llama 4 17B-16E": (16, 5120, 8192),
    "DeepSeek-V3": (256, 7168, 2048),
}
"""``(experts, dim, expert hidden)`` per MoE layer: the demo's default ``--moe`` model,
Llama 4 Scout (16 routed experts of 8192) and DeepSeek-V3 (256 routed experts of 2048)."""

_QUANT_GRANULARITY = {"tensor": "tensor", "row": "row", "block": "128x128", "mx": "mx"}


def sqnr(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (got - ref)^2)`` in dB, in float64 (``inf``: exact)."""
    r = ref.detach().double()
    noise = float((got.detach().double() - r).square().sum())
    return math.inf if noise == 0 else 10 * math.log10(float(r.square().sum()) / noise)


def group_sizes(tokens: int, experts: int, top_k: int, seed: int) -> list[int]:
    """Rows per expert of a skewed top-``k`` router: each token draws ``top_k`` distinct
    experts from seeded softmax preferences; the last expert's tokens go to the first, so
    one group is empty."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=gen), 0).expand(tokens, experts)
    picks = torch.multinomial(probs, top_k, replacement=False, generator=gen)
    sizes = torch.bincount(picks.flatten(), minlength=experts).tolist()
    sizes[0] += sizes[-1]
    sizes[-1] = 0
    return [int(s) for s in sizes]


def offs_of(sizes: list[int]) -> torch.Tensor:
    """int32 cumulative end rows (``F.grouped_mm``'s ``offs``)."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


@dataclass(frozen=True)
class Operands:
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    offs: torch.Tensor


def operands(m: int, k: int, n: int, sizes: list[int], seed: int) -> Operands:
    """bf16 ``x [M, K]``, ``w [E, N, K]`` and ``dY [M, N]`` (Gaussian, seeded)."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(len(sizes), n, k, generator=gen) / math.sqrt(k)).bfloat16()
    dy = torch.randn(m, n, generator=gen).bfloat16()
    return Operands(x, w, dy, offs_of(sizes))


Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def runners(backend: Backend) -> dict[str, Runner]:
    """Each row's grouped GEMM ``(x, w, offs) -> Y``, by label."""

    def torch_grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)

    out: dict[str, Runner] = {"bf16 F.grouped_mm": torch_grouped, "f32 F.grouped_mm": torch_grouped}
    for label, flag in RECIPES:
        policy = ComputeCtx.from_flag(flag, "cpu").fp8
        assert policy is not None

        def fp8(
            x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, policy: object = policy
        ) -> torch.Tensor:
            return quantized_grouped_mm(x, w, offs, policy, backend=backend)  # type: ignore[arg-type]

        out[f"fp8 {label}"] = fp8
    return out


def _leaves(ops: Operands, label: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = torch.float32 if label.startswith("f32") else torch.bfloat16
    x = ops.x.to(dtype, copy=True).requires_grad_(True)
    w = ops.w.to(dtype, copy=True).requires_grad_(True)
    return x, w, ops.dy.to(dtype)


def run_once(
    fn: Runner, ops: Operands, label: str, backward: bool
) -> tuple[float, tuple[torch.Tensor, ...]]:
    """One timed call: seconds and ``(Y, dX, dW)`` (``(Y,)`` without ``backward``)."""
    x, w, dy = _leaves(ops, label)
    t0 = time.perf_counter()
    if backward:
        y = fn(x, w, ops.offs)
        torch.autograd.backward(y, dy)
        seconds = time.perf_counter() - t0
        assert x.grad is not None and w.grad is not None
        return seconds, (y.detach(), x.grad, w.grad)
    with torch.no_grad():
        y = fn(x, w, ops.offs)
    return time.perf_counter() - t0, (y,)


def bench(
    ops: Operands, backend: Backend, reps: int
) -> tuple[dict[str, dict[str, float]], dict[str, tuple[torch.Tensor, ...]]]:
    """Median seconds of every row (``fwd``, ``fwd+bwd``), measured in interleaved rounds
    after one warm-up round, and each row's ``(Y, dX, dW)``."""
    fns = runners(backend)
    times: dict[str, dict[str, list[float]]] = {k: {"fwd": [], "fwd+bwd": []} for k in fns}
    results: dict[str, tuple[torch.Tensor, ...]] = {}
    for round_ in range(reps + 1):
        for label, fn in fns.items():
            for kind in ("fwd", "fwd+bwd"):
                seconds, out = run_once(fn, ops, label, kind == "fwd+bwd")
                if round_:  # round 0 warms up
                    times[label][kind].append(seconds)
                if kind == "fwd+bwd":
                    results[label] = out
    medians = {k: {kind: statistics.median(v) for kind, v in d.items()} for k, d in times.items()}
    return medians, results


def scale_bytes(granularity: str, n: int, k: int) -> int:
    """Bytes of the steps of one ``[N, K]`` weight quantized along K at ``granularity``
    (``row+gw_hp`` as ``row``)."""
    g = granularity.split("+")[0]
    if g == "tensor":
        return 4
    if g == "row":
        return 4 * n
    if g == "block":
        return 4 * math.ceil(n / 128) * math.ceil(k / 128)
    if g == "mx":
        return n * math.ceil(k / 32)
    raise ValueError(f"unknown granularity {granularity!r}")


def expert_weight_bytes(
    granularity: str, experts: int, dim: int, hidden: int, training: bool = False
) -> int:
    """fp8 bytes of one MoE layer's expert weights (``[E, 2H, D]`` and ``[E, D, H]``) at
    ``granularity``: codes and the forward operand's steps; with ``training`` also the
    input gradient's ``Wᵀ`` (quantized again, along N, for ``row`` and ``mx``)."""
    total = 0
    for n, k in ((2 * hidden, dim), (dim, hidden)):
        total += experts * (n * k + scale_bytes(granularity, n, k))
        again = granularity.split("+")[0] in ("row", "mx")
        if training and again:
            total += experts * (n * k + scale_bytes(granularity, k, n))
    return total


def check_bytes(w: torch.Tensor) -> None:
    """Stop unless ``scale_bytes`` is what ``quantize_tensor`` returns for each expert of ``w``."""
    _, n, k = w.shape
    for label, g in _QUANT_GRANULARITY.items():
        measured = 0
        for expert in w:
            codes, steps = quantize_tensor(expert.float(), "e4m3", granularity=g)  # type: ignore[arg-type]
            measured += codes.nbytes + steps.nbytes
        if measured != w.shape[0] * (n * k + scale_bytes(label, n, k)):
            raise SystemExit(f"{label}: quantize_tensor holds {measured} bytes, the formula not")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _db(x: float) -> str:
    return "exact" if math.isinf(x) else f"{x:.1f}"


def _mib(b: int) -> str:
    return f"{b / 2**20:,.2f}" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens routed")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512, help="K: the model width")
    parser.add_argument("--hidden", type=int, default=512, help="N: the experts' output width")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--backend", default="reference", help="fp8 backend of the fp8 rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    backend = Backend(args.backend)
    sizes = group_sizes(args.tokens, args.experts, args.top_k, args.seed)
    m, k, n = sum(sizes), args.dim, args.hidden
    print(
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s); "
        f"fp8 backend {backend}"
    )
    print(
        f"M = {args.tokens} tokens x top-{args.top_k} = {m} rows, K = {k}, N = {n}, "
        f"E = {args.experts}; rows per expert: {sizes}\n"
    )
    ops = operands(m, k, n, sizes, args.seed)
    times, results = bench(ops, backend, args.reps)
    base = times["bf16 F.grouped_mm"]
    ref = results["f32 F.grouped_mm"]
    empty = [g for g, size in enumerate(sizes) if size == 0]
    for label, (_, _, dw) in results.items():  # no token, no gradient: exactly zero
        if bool(dw[empty].ne(0).any()):
            raise SystemExit(f"{label}: an expert without tokens got a nonzero dW")
    print(f"### Grouped GEMM, {args.reps} rounds (median ms), SQNR against f32 (dB)\n")
    print("| row | fwd ms | fwd+bwd ms | fwd / bf16 | fwd+bwd / bf16 | Y | dX | dW |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, t in times.items():
        y, dx, dw = results[label]
        print(
            f"| {label} | {_ms(t['fwd'])} | {_ms(t['fwd+bwd'])} | "
            f"{t['fwd'] / base['fwd']:.2f}x | {t['fwd+bwd'] / base['fwd+bwd']:.2f}x | "
            f"{_db(sqnr(y, ref[0]))} | {_db(sqnr(dx, ref[1]))} | {_db(sqnr(dw, ref[2]))} |"
        )
    check_bytes(ops.w)
    shapes = MODELS
    heads = [f"{name} ({e} x {d} x {h})" for name, (e, d, h) in shapes.items()]
    print("\n### Expert weight bytes per MoE layer (MiB; x bf16), E x dim x hidden\n")
    print("| weights | " + " | ".join(heads) + " |")
    print("| --- |" + " ---: |" * len(heads))
    bf16 = {name: 2 * 3 * e * d * h for name, (e, d, h) in shapes.items()}
    print("| bf16 | " + " | ".join(_mib(b) for b in bf16.values()) + " |")
    for training in (False, True):
        for label, _ in RECIPES:
            if label == "row+gw_hp":
                continue  # its weights are row's
            cells = []
            for name, (e, d, h) in shapes.items():
                b = expert_weight_bytes(label, e, d, h, training)
                cells.append(f"{_mib(b)} ({b / bf16[name]:.3f}x)")
            what = "fp8 " + label + (", training (+ Wᵀ)" if training else "")
            print(f"| {what} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
