"""The demo's outputs: the results table and its notes, ``results.json`` and ``loss.png``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from computectx._files import atomic_path, write_file
from computectx.ctx import ComputeCtx
from computectx.demo.corpus import Corpus
from computectx.demo.footprint import OptimStateRow, optim_state_rows
from computectx.demo.settings import DemoSettings
from computectx.demo.train import PolicyResult, model_config, tail_steps
from computectx.nn import ByteLM

__all__ = [
    "RESULTS_VERSION",
    "DemoReport",
    "memory_notes",
    "optim_state_notes",
    "optim_state_of",
    "optim_state_table",
    "plot_losses",
    "printable",
    "results_json",
    "results_table",
    "serving_notes",
    "serving_table",
    "table_notes",
    "write_results",
]

RESULTS_VERSION = 8
"""``results.json``'s ``computectx_demo`` field. 2: per-role ``memory`` replaced
``memory_bytes``; ``gemm``, ``half_gemm`` and ``train_loss_steps`` were added. 3: each
result's ``fp8_granularity`` (``null`` without fp8) was added. 4: each result's ``kv`` and
``serving`` (the serving section's rows) were added. 5: the ``--moe`` settings, each result's
``expert_load`` (tokens per step, layer and expert; ``null`` for the dense model) and
``fp8_converted_experts`` were added. 6: ``optim_state`` (AdamW's weights and moments per
optimizer-state setting, computed) was added. 7: each result's ``memory.saved_kinds``
(``saved`` by kind of activation) was added; a ``flag`` may carry ``@ACTIVATIONS``. 8: the
setting ``skip_serving`` was added (each result's ``serving`` then empty)."""

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class DemoReport:
    """The whole run: settings, where it ran, the corpus, the fp8 and GEMM choices, results.

    ``device`` is the device trained on (``settings.device``, or the one chosen for it);
    ``half_gemm`` is the ``computectx.capability.native_half_gemm`` answer behind the bf16/f16
    GEMM path on a CPU (``None`` when no policy computes in half precision there).
    """

    settings: DemoSettings
    device: torch.device
    corpus: Corpus
    fp8_backend: str | None
    fp8_reason: str | None
    half_gemm: str | None
    results: list[PolicyResult]
    json_path: Path
    plot_path: Path
    world_size: int = 1
    """Data-parallel processes that trained (``--nproc``); figures are the group's."""
    load_plot_path: Path | None = None
    """Under ``--moe``: where the expert load picture goes (``expert-load.png``)."""


def results_table(report: DemoReport) -> Table:
    """One row per policy; ``table_notes`` says what each column measures."""
    cuda = report.device.type == "cuda"
    n = tail_steps(report.settings.steps)
    procs = "" if report.world_size == 1 else f", {report.world_size} data-parallel processes"
    table = Table(title=f"computectx demo: one model, one batch order, one policy per row{procs}")
    # Names are never cut (an 80-column terminal squeezes the figures' columns instead).
    table.add_column("policy", no_wrap=True, min_width=_widest(r.flag for r in report.results))
    table.add_column("fp8\ngranularity")
    table.add_column(f"train loss\n(last {n} mean)", justify="right")
    table.add_column("val loss", justify="right")
    table.add_column("tokens/s", justify="right")
    compiled = report.settings.compile
    if compiled:
        table.add_column("compile\ns", justify="right")
    table.add_column("state\nMiB", justify="right")
    table.add_column("saved\nMiB", justify="right")
    if cuda:
        table.add_column("peak\nMiB", justify="right")
    table.add_column("fp8\nnon-finite", justify="right")
    table.add_column("fp8\nsaturated", justify="right")
    for r in report.results:
        fp8 = r.fp8_nonfinite is not None and r.fp8_saturated is not None
        saved = "-" if r.memory.saved is None else f"{r.memory.saved / _MIB:.2f}"
        memory = [f"{r.memory.state / _MIB:.2f}", saved]
        if cuda:
            memory.append(f"{(r.memory.peak or 0) / _MIB:.2f}")
        table.add_row(
            r.flag,
            r.fp8_granularity or "-",
            f"{r.train_loss:.4f}",
            f"{r.val_loss:.4f}",
            f"{r.tokens_per_s:,.0f}",
            *([f"{r.compile_seconds:.1f}" if r.compile_seconds is not None else "-"] * compiled),
            *memory,
            f"{r.fp8_nonfinite}" if fp8 else "-",
            f"{100 * (r.fp8_saturated or 0.0):.4f}%" if fp8 else "-",
        )
    return table


def table_notes(report: DemoReport) -> list[str]:
    """What the table's loss, memory, granularity and compile columns measure, one line each."""
    s = report.settings
    n = tail_steps(s.steps)
    lines = [
        f"train loss: mean step loss over the last {n} of {s.steps} steps (the progress bar "
        f"shows each step's own loss, which moves by a few hundredths from batch to batch); "
        f"val loss: {s.eval_batches} held-out batches after the last step.",
        *memory_notes(report),
    ]
    by_kind = [
        f"{r.flag}: "
        + ", ".join(f"{k} {n / _MIB:.2f}" for k, n in r.memory.saved_kinds.items() if n)
        for r in report.results
        if r.memory.saved_kinds is not None
    ]
    if by_kind:
        lines.append(
            "saved MiB by kind (computectx.memory.SavedActivations; other: what no op tags, "
            "the loss's logits among it): " + "; ".join(by_kind) + "."
        )
    if any(r.fp8_granularity is not None for r in report.results):
        lines.append(
            "fp8 granularity: which elements share one fp8 step: tensor (one per tensor), row "
            "(one per row along the contraction), block (1x128 activations and gradients, "
            "128x128 weights), mx (1x32 blocks, E8M0 steps); docs/fp8.md has each GEMM's axes."
        )
    if any("@" in r.flag for r in report.results):
        lines.append(
            "FLAG@ACTIVATIONS: FLAG's policy keeping the activations for the backward as "
            "ComputeCtx.activations says (docs/activations.md: the kinds and the layers that "
            "follow each). fp8: E4M3 codes with a float32 scale per group of a row's elements "
            "(1x128 unless group= says otherwise; a linear's input a scale per row); recompute: "
            "the op's input kept, the op run again in the backward; offload: the input in host "
            "memory until its backward (a no-op on a CPU); checkpoint=RULE: whole blocks run "
            "again; saved MiB by kind shows what each kind kept."
        )
    if s.compile:
        lines.append(
            "compile s: the first step, which compiles the graphs; tokens/s counts the later "
            "(steady-state) steps only."
        )
    return lines


def optim_state_of(report: DemoReport) -> list[OptimStateRow]:
    """AdamW's weights and moments for the demo's model under each optimizer-state setting,
    computed from the codecs' accounting (the model is built on the CPU, not trained)."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # draws nothing for the run
        model = ByteLM(ComputeCtx.from_flag("fp32", "cpu"), model_config(report.settings))
    return optim_state_rows(model.parameters())


def _table(title: str, keys: list[tuple[str, int | None]], numbers: list[str]) -> Table:
    """A table titled ``title``: its key columns (name, minimum width or ``None``), never
    wrapped, then right-justified number columns."""
    table = Table(title=title)
    for name, width in keys:
        table.add_column(name, no_wrap=True, min_width=width)
    for name in numbers:
        table.add_column(name, justify="right")
    return table


def optim_state_table(rows: list[OptimStateRow]) -> Table:
    """One row per optimizer-state setting: weights, moments, their total and per parameter."""
    table = _table(
        "optimizer state: AdamW's weights and moments per setting (computed)",
        [("optim_state", None), ("master", None)],
        ["weights\nMiB", "moments\nMiB", "total\nMiB", "bytes\n/ param"],
    )
    for r in rows:
        table.add_row(
            r.optim_state,
            r.master,
            f"{r.weights / _MIB:.2f}",
            f"{r.moments / _MIB:.2f}",
            f"{r.total / _MIB:.2f}",
            f"{r.per_param:.2f}",
        )
    return table


def optim_state_notes(rows: list[OptimStateRow]) -> list[str]:
    """What the optimizer-state table counts, one line."""
    n = rows[0].parameters if rows else 0
    return [
        f"optimizer state: the {n:,} parameters' weights as the optimizer steps them (f32, or "
        f"a bf16 master with stochastic rounding) and AdamW's two moments stored per "
        f"ctx.optim_state (CompactOptimizer / OffloadedOptimizer), computed by "
        f"computectx.memory.optim.state.packed_nbytes, not trained: tensors under 4096 "
        f"elements keep f32 moments; the f32/f32 row is what the fp32 policy's run holds "
        f"(docs/memory.md: Optimizer state formats)."
    ]


def serving_table(report: DemoReport) -> Table | None:
    """The serving section: one row per trained policy and KV setting (``None`` when no
    result has one); ``serving_notes`` says what each column measures."""
    results = [r for r in report.results if r.serving]
    if not results:
        return None
    table = _table(
        "serving: each trained model's validation loss through the KV cache",
        [("policy", _widest(r.flag for r in results)), ("KV cache", None)],
        ["val loss\n(cached)", "vs f32\nKV", "KV bytes\n/ token", "decode\ntokens/s"],
    )
    for r in results:
        ref = next((row.val_loss for row in r.serving if row.kv == "f32"), None)
        for i, row in enumerate(r.serving):
            gap = "-" if ref is None or row.kv == "f32" else f"{(row.val_loss - ref) / ref:+.3%}"
            table.add_row(
                r.flag if i == 0 else "",
                row.kv + (" *" if row.kv == r.kv else ""),
                f"{row.val_loss:.4f}",
                gap,
                f"{row.kv_bytes_per_token:,}",
                f"{row.decode_tokens_per_s:,.0f}",
                end_section=i == len(r.serving) - 1,
            )
    return table


def serving_notes(report: DemoReport) -> list[str]:
    """What the serving table measures, one line each."""
    s = report.settings
    n = s.eval_batches * s.batch_size
    return [
        f"serving: the trained weights, with the KV cache stored at each setting (the rest of "
        f"the policy unchanged), decode the {n} validation windows of {s.seq_len} bytes one "
        f"byte per step, every earlier key and value read back from the cache, as generation "
        f"reads them (computectx.nn.decode_logits); * marks the policy's own kv, the one its "
        f"sample is generated with. KV bytes / token: every layer's keys and values (and "
        f"fp8 steps) for one more position; decode tokens/s: eager, on {report.device}.",
    ]


def memory_notes(report: DemoReport) -> list[str]:
    """What the memory columns measure, one line each (also ``memory_measure`` in JSON)."""
    saved = (
        "saved MiB: not measured under --compile (the hooks that count what autograd keeps "
        "would be traced into the graph)."
        if report.settings.compile
        else "saved MiB: the most autograd held for backward at once during the first step "
        "(one micro-batch's forward): activations and low-precision weight copies "
        "(computectx.memory.SavedActivations.peak)."
    )
    lines = [
        f"state MiB: weights, gradients, optimizer state, accumulator buffers and master "
        f"weights on {report.device} after the last step (computectx.memory.memory_report); "
        f"{saved}"
    ]
    if report.device.type == "cuda":
        lines.append("peak MiB: torch.cuda.max_memory_allocated during the policy's run.")
    return lines


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def write_results(report: DemoReport) -> None:
    """Write ``report.json_path``: ``results_json`` as strict JSON, durably."""
    text = json.dumps(results_json(report), indent=1, allow_nan=False)
    write_file(report.json_path, text.encode(), what="results.json")


def results_json(report: DemoReport) -> dict[str, Any]:
    """The content of ``results.json`` (strict JSON: non-finite numbers become ``None``)."""
    s = report.settings
    return {
        "computectx_demo": RESULTS_VERSION,
        "settings": json.loads(s.model_dump_json()),
        "model": json.loads(model_config(s).model_dump_json()),
        "corpus": {
            "name": report.corpus.name,
            "source": report.corpus.source,
            "files": report.corpus.files,
            "truncated": report.corpus.truncated,
            "train_bytes": report.corpus.train.numel(),
            "val_bytes": report.corpus.val.numel(),
        },
        "device": str(report.device),
        "world_size": report.world_size,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "fp8_backend": report.fp8_backend,
        "fp8_backend_reason": report.fp8_reason,
        "half_gemm": report.half_gemm,
        "train_loss_steps": tail_steps(s.steps),
        "memory_measure": " ".join(memory_notes(report)),
        "optim_state": [
            {**dataclasses.asdict(r), "bytes_per_param": r.per_param}
            for r in optim_state_of(report)
        ],
        "results": [
            {
                "flag": r.flag,
                "policy": r.policy,
                "gemm": r.gemm,
                "train_loss": _finite_or_none(r.train_loss),
                "val_loss": _finite_or_none(r.val_loss),
                "tokens_per_s": _finite_or_none(r.tokens_per_s),
                "train_seconds": r.seconds,
                "compile_seconds": r.compile_seconds,
                "memory": r.memory.as_dict(),
                "skipped_steps": r.skipped_steps,
                "fp8_converted_linears": r.fp8_converted,
                "fp8_converted_experts": r.fp8_experts,
                "fp8_backend": r.fp8_backend,
                "fp8_granularity": r.fp8_granularity,
                "fp8_nonfinite": r.fp8_nonfinite,
                "fp8_saturated_fraction_max": r.fp8_saturated,
                "fp8_layers": r.fp8_layers,
                "train_losses": [_finite_or_none(v) for v in r.train_losses],
                "val_curve": [[step, _finite_or_none(v)] for step, v in r.val_curve],
                "sample": r.sample,
                "kv": r.kv,
                "expert_load": None if r.expert_load is None else r.expert_load.tolist(),
                "serving": [
                    {
                        "kv": row.kv,
                        "val_loss": _finite_or_none(row.val_loss),
                        "kv_bytes_per_token": row.kv_bytes_per_token,
                        "decode_tokens_per_s": _finite_or_none(row.decode_tokens_per_s),
                    }
                    for row in r.serving
                ],
            }
            for r in report.results
        ],
    }


def _smooth(values: list[float], width: int) -> list[float]:
    """Centered moving average over the finite values (NaN where a window has none)."""
    half = width // 2
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - half) : i + half + 1] if math.isfinite(v)]
        out.append(sum(window) / len(window) if window else float("nan"))
    return out


_STYLES = ("-", "--", ":", "-.")


def plot_losses(report: DemoReport) -> None:
    """Write ``report.plot_path``: loss curves on top, each policy minus the first below.

    Policies often overlap to the pixel, so each gets its own line style, and lines get
    thinner and drawn later down the list: the first policy is the widest line at the
    bottom and stays visible around the others.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (or wanted) on servers and CI
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    results = report.results
    compare = len(results) > 1
    fig, axes = plt.subplots(
        2 if compare else 1,
        1,
        figsize=(8, 6.5 if compare else 4.5),
        dpi=110,
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [2.2, 1]} if compare else None,
    )
    ax = axes[0][0]
    width = max(1, len(results[0].train_losses) // 12)
    base = _smooth(results[0].train_losses, width)
    for i, r in enumerate(results):
        color, style = f"C{i}", _STYLES[i % len(_STYLES)]
        lw = max(1.2, 3.2 - 0.8 * i)
        steps = list(range(1, len(r.train_losses) + 1))
        smooth = _smooth(r.train_losses, width)
        ax.plot(steps, r.train_losses, color=color, alpha=0.18, linewidth=0.7, zorder=1)
        ax.plot(
            steps, smooth, color=color, linestyle=style, linewidth=lw, zorder=2 + i,
            label=f"{r.flag} train ({width}-step mean)",
        )  # fmt: skip
        vs = [step for step, _ in r.val_curve]
        vl = [v for _, v in r.val_curve]
        ax.plot(
            vs, vl, marker="os^D"[i % 4], linestyle="none", color=color, markersize=5,
            markerfacecolor="none" if i else color, zorder=10 + i, label=f"{r.flag} val",
        )  # fmt: skip
        if compare and i:
            diff = [a - b for a, b in zip(smooth, base, strict=False)]
            axes[1][0].plot(
                steps[: len(diff)], diff, color=color, linestyle=style, linewidth=1.4,
                label=f"{r.flag} - {results[0].flag}",
            )  # fmt: skip
    handles, labels = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="0.4", alpha=0.35, linewidth=0.7))
    labels.append("each step's loss (faint, one per policy)")
    s = report.settings
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(
        f"ByteLM on {report.corpus.name} ({report.device}, {s.layers}x{s.d_model}, "
        f"{s.batch_size * s.grad_accum}x{s.seq_len} bytes/step)"
    )
    ax.grid(alpha=0.3)
    ax.legend(handles, labels, ncol=2, fontsize=8)
    if compare:
        low = axes[1][0]
        low.axhline(0.0, color="C0", linewidth=1)
        low.set_ylabel(f"Δ train loss\n(vs {results[0].flag})")
        low.grid(alpha=0.3)
        low.legend(fontsize=8)
    axes[-1][0].set_xlabel(f"optimizer step (train lines: {width}-step moving average)")
    fig.tight_layout()
    try:
        with atomic_path(report.plot_path, what="the loss plot") as tmp:
            fig.savefig(tmp, format=report.plot_path.suffix.removeprefix(".") or "png")
    finally:
        plt.close(fig)


def printable(text: str) -> str:
    """``text`` with control characters (other than newline and tab) shown as U+FFFD."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


def _widest(names: Iterable[str]) -> int:
    return max((len(n) for n in names), default=0)
