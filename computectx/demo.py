"""``computectx demo``: train one small LM under each precision policy and compare them.

The model is ``computectx.nn.ByteLM``; the default corpus is the Python standard library's
own source files, read byte by byte from the running interpreter, so the demo needs no
download. Every policy starts from the same weights and sees the same batches in the same
order, so the differences in the results table are the policy's doing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field, ValidationError, field_validator
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from computectx import capability
from computectx.ctx import DTYPE_FLAGS, ComputeCtx, TorchDevice, parse_device
from computectx.dtypes import DType
from computectx.fp8 import Fp8Linear, fp8_stats, select_backend
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer, memory_report
from computectx.nn import ByteLM, LMConfig, decode_bytes, encode_bytes, generate

__all__ = [
    "DEFAULT_DTYPES",
    "Corpus",
    "DemoError",
    "DemoReport",
    "DemoSettings",
    "PolicyResult",
    "add_arguments",
    "load_corpus",
    "run_command",
    "run_demo",
]

DEFAULT_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp8_hybrid")
"""The policies compared when ``--dtype`` is not given."""

STDLIB_CORPUS_BYTES = 2 * 1024 * 1024
"""Bytes of standard-library source the default corpus reads (whole files, sorted by name)."""

MAX_DATA_BYTES = 64 * 1024 * 1024
"""Most bytes read from ``--data``; a larger file or folder is cut here (the corpus line
says so)."""

VAL_FRACTION = 0.1
"""Share of the corpus held out for validation: its last bytes (whole trailing files of the
default corpus)."""

SAMPLE_PROMPT = "def "
"""The prompt each trained model continues for the printed sample."""


class DemoError(ValueError):
    """A demo setting that cannot work here (found before any training starts)."""


class DemoSettings(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """Everything one demo run depends on; the CLI flags map onto these fields."""

    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    """``--dtype`` flags to compare, in order (``ComputeCtx.from_flag`` names)."""
    steps: int = Field(default=120, ge=1, le=1_000_000)
    """Optimizer steps per policy."""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    """Seeds the initial weights, the batch order and the sample."""
    grad_accum: int = Field(default=1, ge=1, le=4096)
    """Micro-batches per step; above 1 their gradients sum in a ``LowPrecGradAccumulator``."""
    offload: bool = False
    """Step master weights and optimizer state with an ``OffloadedOptimizer`` on the CPU."""
    out: Path = Path("computectx-demo")
    """Folder for ``results.json`` and ``loss.png``."""
    device: TorchDevice = Field(default_factory=capability.default_device)
    """Device to train on."""
    data: Path | None = None
    """A text file or folder to train on instead of the standard library's sources."""
    batch_size: int = Field(default=8, ge=1, le=65536)
    """Sequences per micro-batch."""
    seq_len: int = Field(default=128, ge=8, le=65536)
    """Bytes per training sequence."""
    d_model: int = Field(default=128, ge=16, le=65536, multiple_of=16)
    """Width of the model (heads are 32 wide)."""
    layers: int = Field(default=2, ge=1, le=256)
    """Decoder blocks."""
    lr: float = Field(default=3e-3, gt=0.0, le=1.0)
    """Peak AdamW learning rate (linear warm-up over the first tenth, then cosine to 10%)."""
    sample_tokens: int = Field(default=160, ge=0, le=4096)
    """Bytes generated for each policy's sample (0: no sample)."""
    eval_batches: int = Field(default=4, ge=1, le=4096)
    """Validation batches per evaluation."""
    threads: int = Field(default=1, ge=1, le=4096)
    """Intra-op CPU threads torch uses during the run (restored afterwards). One by default:
    the demo model's matrices are ~128 wide, so a second thread gains little overall (fp32
    speeds up, bf16 and the fp8 reference slow down), and on a busy machine waiting threads
    slow the run several-fold."""

    @field_validator("dtypes", mode="before")
    @classmethod
    def _known_flags(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"dtypes must be flag names (strings), got {value!r}")
        flags = tuple(v.strip().lower() for v in value)
        if not flags:
            raise ValueError("give at least one --dtype")
        for f in flags:
            if f not in DTYPE_FLAGS:
                raise ValueError(
                    f"unknown --dtype {f!r}; accepted: {', '.join(DTYPE_FLAGS)} (repeat the "
                    f"flag or separate with commas)"
                )
        dups = sorted({f for f in flags if flags.count(f) > 1})
        if dups:
            raise ValueError(f"--dtype {', '.join(dups)} given more than once")
        return flags

    @field_validator("d_model")
    @classmethod
    def _whole_heads(cls, value: int) -> int:
        if value % 32:
            raise ValueError(f"d_model={value} must be a multiple of 32 (32-wide heads)")
        return value

    def lm_config(self) -> LMConfig:
        """The ``LMConfig`` of the demo model (long enough for training and the sample)."""
        longest = max(self.seq_len, len(SAMPLE_PROMPT) + self.sample_tokens)
        return LMConfig(
            d_model=self.d_model,
            n_layers=self.layers,
            n_heads=self.d_model // 32,
            d_ff=_round_up(self.d_model * 3, 16),
            max_len=longest,
        )


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# ----- the corpus ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Training and validation bytes (uint8 tensors) and where they came from."""

    name: str
    source: str
    files: int
    train: torch.Tensor
    val: torch.Tensor
    truncated: bool = False
    """Whether reading stopped at the byte cap before the last file."""


def _stdlib_files() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(os.__file__).parent]
    for root in roots:
        found = sorted(p for p in root.glob("*.py") if p.is_file())
        if found:
            return found
    return []


def _is_text(head: bytes) -> bool:
    return b"\x00" not in head


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = []
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        files.append(p)
    return files


def load_corpus(data: Path | None, min_bytes: int = 0) -> Corpus:
    """The demo's bytes: the standard library's ``*.py`` files, or ``data`` (file or folder).

    Files are read whole in name order until the cap (``STDLIB_CORPUS_BYTES`` for the
    default corpus, ``MAX_DATA_BYTES`` for ``data``); files with NUL bytes in their first
    4 KiB are taken for binary and skipped. The last ``VAL_FRACTION`` of the bytes is the
    validation split. Raises ``DemoError`` when the path is missing or unreadable or when
    either split would hold fewer than ``min_bytes`` bytes.
    """
    if data is None:
        files = _stdlib_files()
        if not files:
            raise DemoError(
                "found no Python standard-library sources to train on (this interpreter "
                "ships them compiled or zipped); pass --data PATH with a text file or folder"
            )
        cap, name, source = STDLIB_CORPUS_BYTES, "python stdlib", str(files[0].parent)
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise DemoError(f"--data {str(data)!r} does not exist; give a text file or a folder")
        if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
            raise DemoError(f"--data {str(data)!r} is not readable (permission denied)")
        files = _data_files(path)
        cap, name, source = MAX_DATA_BYTES, path.name or str(path), str(path)
    chunks: list[bytes] = []
    truncated = False
    used = 0
    total = 0
    for f in files:
        room = cap - total
        try:
            with f.open("rb") as fh:
                # Never more than the cap (plus one byte to tell whether the file goes on),
                # but always the 4 KiB the binary check looks at.
                blob = fh.read(max(room + 1, 4096))
        except OSError as e:
            if data is None:
                continue  # an odd stdlib file is no reason to stop; the user's data is
            raise DemoError(f"cannot read {str(f)!r} under --data: {e.strerror}") from None
        if not blob or not _is_text(blob[:4096]):
            continue
        chunks.append(blob[:room])
        total += len(chunks[-1])
        used += 1
        if total >= cap:
            truncated = len(blob) > room or f is not files[-1]
            break
    joined = b"\n".join(chunks)
    n_val = int(len(joined) * VAL_FRACTION)
    train, val = joined[: len(joined) - n_val], joined[len(joined) - n_val :]
    if min(len(train), len(val)) < max(min_bytes, 1):
        raise DemoError(
            f"{source!r} holds {len(joined)} bytes of text in {used} file(s); the demo needs "
            f"at least {max(min_bytes, 1)} bytes in each of the train and validation splits "
            f"(validation is the last {VAL_FRACTION:.0%}); use more text or a smaller --seq-len"
        )
    return Corpus(
        name=name,
        source=source,
        files=used,
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        truncated=truncated,
    )


def _windows(data: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(length + 1)[None, :]
    return data[idx].long()


def _train_batches(
    corpus: Corpus, batch: int, seq_len: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    # A private generator: every policy sees the same batches whatever else draws numbers.
    g = torch.Generator().manual_seed(seed)
    hi = corpus.train.numel() - seq_len - 1
    while True:
        w = _windows(corpus.train, torch.randint(0, hi + 1, (batch,), generator=g), seq_len)
        yield w[:, :-1], w[:, 1:]


def _val_batches(
    corpus: Corpus, batch: int, seq_len: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    hi = corpus.val.numel() - seq_len - 1
    starts = torch.linspace(0, hi, batch * count).long()
    w = _windows(corpus.val, starts, seq_len)
    return [(b[:, :-1], b[:, 1:]) for b in (w[i : i + batch] for i in range(0, w.shape[0], batch))]


# ----- training -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyResult:
    """One policy's run: its curves, final losses, speed, memory and fp8 statistics."""

    flag: str
    policy: str
    train_losses: list[float]
    val_curve: list[tuple[int, float]]
    train_loss: float
    val_loss: float
    tokens_per_s: float
    seconds: float
    memory_bytes: int
    skipped_steps: int
    fp8_converted: int
    fp8_backend: str | None
    fp8_nonfinite: int | None
    fp8_saturated: float | None
    fp8_layers: dict[str, Any]
    sample: str


@dataclasses.dataclass(frozen=True)
class DemoReport:
    """The whole run: settings, corpus, fp8 backend, how memory was measured, the results."""

    settings: DemoSettings
    corpus: Corpus
    fp8_backend: str | None
    fp8_reason: str | None
    memory_measure: str
    results: list[PolicyResult]
    json_path: Path
    plot_path: Path


def _lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _policy_ctx(flag: str, settings: DemoSettings) -> ComputeCtx:
    ctx = ComputeCtx.from_flag(flag, settings.device)
    if settings.grad_accum > 1 and ctx.compute < DType.F32:
        # Low-precision policies keep their summed gradients low-precision too: the
        # accumulator's buffers are at the compute dtype (the fp32 policy stays at f32).
        ctx = ctx.replace(grad=ctx.compute)
    if settings.offload:
        ctx = ctx.replace(offload=torch.device("cpu"))
    return ctx


@torch.no_grad()
def _evaluate(model: ByteLM, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was = model.training
    model.eval()
    dev = model.ctx.device
    losses = [float(model.loss(x.to(dev), y.to(dev))) for x, y in batches]
    model.train(was)
    return sum(losses) / len(losses)


def _memory_measure(device: torch.device) -> str:
    if device.type == "cuda":
        return "peak MiB: torch.cuda.max_memory_allocated during the policy's run"
    return (
        "state MiB: bytes of parameters, gradients, accumulator buffers, master weights and "
        "optimizer state on the device after the last step (computectx.memory.memory_report); "
        "activations are not counted"
    )


def _fp8_summary(model: ByteLM) -> tuple[int, float, dict[str, Any]]:
    stats = fp8_stats(model)
    nonfinite = 0
    saturated = 0.0
    layers: dict[str, Any] = {}
    for name, layer in stats.items():
        roles = {r: dataclasses.asdict(layer[r]) for r in ("input", "weight", "grad")}
        layers[name] = {"policy": layer.policy, **roles}
        for r in roles.values():
            nonfinite += int(r["nonfinite_count"])
            saturated = max(saturated, float(r["saturated_fraction"]))
    return nonfinite, saturated, layers


def _train_policy(
    flag: str,
    settings: DemoSettings,
    corpus: Corpus,
    val: list[tuple[torch.Tensor, torch.Tensor]],
    progress: Progress,
) -> PolicyResult:
    ctx = _policy_ctx(flag, settings)
    dev = ctx.device
    torch.manual_seed(settings.seed)
    model = ByteLM(ctx, settings.lm_config())
    # Under an fp8 policy the blocks build their linears as Fp8Linear (the head stays).
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    backend = ",".join(sorted({m.backend.value for m in fp8_layers})) or None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    params = list(model.parameters())
    offloaded: OffloadedOptimizer | None = None
    opt: torch.optim.Optimizer
    if settings.offload:
        opt = offloaded = OffloadedOptimizer(params, ctx, lr=settings.lr)
    else:
        opt = torch.optim.AdamW(params, lr=settings.lr)
    acc = LowPrecGradAccumulator(params, ctx) if settings.grad_accum > 1 else None
    batches = _train_batches(corpus, settings.batch_size, settings.seq_len, settings.seed)
    eval_at = {round(settings.steps * k / 6) for k in range(1, 7)} - {0}
    losses: list[float] = []
    val_curve: list[tuple[int, float]] = [(0, _evaluate(model, val))]
    skipped = 0
    train_seconds = 0.0
    memory = 0
    task = progress.add_task(flag, total=settings.steps, loss=float("nan"))
    try:
        for step in range(settings.steps):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, settings.steps, settings.lr)
            summed = torch.zeros((), device=dev)
            for _ in range(settings.grad_accum):
                x, y = next(batches)
                loss = model.loss(x.to(dev), y.to(dev)) / settings.grad_accum
                torch.autograd.backward(loss)
                summed += loss.detach()
            step_loss = float(summed)  # one device-to-host read per step, not per micro-batch
            if offloaded is not None:
                offloaded.ingest_grads(acc)
                norm = offloaded.clip_grad_norm(1.0)
            else:
                if acc is not None:
                    acc.flush_to_param_grads()
                norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
            if math.isfinite(norm):
                opt.step()
            else:
                # Non-finite gradients (an fp16 overflow, say) are dropped, not applied;
                # the count goes into the results.
                skipped += 1
                if offloaded is not None:
                    opt.step()  # consumes the skip that clip_grad_norm scheduled
            if step == settings.steps - 1:
                memory = memory_report(model, optimizer=opt, accumulator=acc).bytes(device=dev)
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            train_seconds += time.perf_counter() - t0
            losses.append(step_loss)
            if step + 1 in eval_at:
                val_curve.append((step + 1, _evaluate(model, val)))
            progress.update(task, advance=1, loss=step_loss)
    finally:
        if acc is not None:
            acc.close()
    if dev.type == "cuda":
        memory = int(torch.cuda.max_memory_allocated(dev))
    tail = losses[-max(1, len(losses) // 10) :]
    nonfinite = saturated = None
    layers: dict[str, Any] = {}
    if ctx.fp8 is not None:
        nonfinite, saturated, layers = _fp8_summary(model)
    sample = ""
    if settings.sample_tokens:
        g = torch.Generator().manual_seed(settings.seed)
        out = generate(
            model,
            encode_bytes(SAMPLE_PROMPT, dev),
            settings.sample_tokens,
            temperature=0.8,
            top_k=40,
            generator=g,
        )
        sample = decode_bytes(out)
    tokens = settings.steps * settings.grad_accum * settings.batch_size * settings.seq_len
    return PolicyResult(
        flag=flag,
        policy=str(ctx),
        train_losses=losses,
        val_curve=val_curve,
        train_loss=sum(tail) / len(tail),
        val_loss=val_curve[-1][1],
        tokens_per_s=tokens / train_seconds if train_seconds > 0 else float("inf"),
        seconds=train_seconds,
        memory_bytes=memory,
        skipped_steps=skipped,
        fp8_converted=len(fp8_layers),
        fp8_backend=backend,
        fp8_nonfinite=nonfinite,
        fp8_saturated=saturated,
        fp8_layers=layers,
        sample=sample,
    )


# ----- outputs ------------------------------------------------------------------------------


def check_output_dir(out: Path) -> Path:
    """Create ``out`` if needed and prove a file can be written there; ``DemoError`` if not."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise DemoError(f"--out {str(out)!r} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".computectx-write-check-"):
            pass
    except OSError as e:
        raise DemoError(f"--out {str(out)!r} is not a writable folder: {e.strerror}") from None
    return path


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _results_json(report: DemoReport) -> dict[str, Any]:
    s = report.settings
    return {
        "computectx_demo": 1,
        "settings": json.loads(s.model_dump_json()),
        "model": json.loads(s.lm_config().model_dump_json()),
        "corpus": {
            "name": report.corpus.name,
            "source": report.corpus.source,
            "files": report.corpus.files,
            "truncated": report.corpus.truncated,
            "train_bytes": report.corpus.train.numel(),
            "val_bytes": report.corpus.val.numel(),
        },
        "device": str(s.device),
        "torch": torch.__version__,
        "fp8_backend": report.fp8_backend,
        "fp8_backend_reason": report.fp8_reason,
        "memory_measure": report.memory_measure,
        "results": [
            {
                "flag": r.flag,
                "policy": r.policy,
                "train_loss": _finite_or_none(r.train_loss),
                "val_loss": _finite_or_none(r.val_loss),
                "tokens_per_s": _finite_or_none(r.tokens_per_s),
                "train_seconds": r.seconds,
                "memory_bytes": r.memory_bytes,
                "skipped_steps": r.skipped_steps,
                "fp8_converted_linears": r.fp8_converted,
                "fp8_backend": r.fp8_backend,
                "fp8_nonfinite": r.fp8_nonfinite,
                "fp8_saturated_fraction_max": r.fp8_saturated,
                "fp8_layers": r.fp8_layers,
                "train_losses": [_finite_or_none(v) for v in r.train_losses],
                "val_curve": [[step, _finite_or_none(v)] for step, v in r.val_curve],
                "sample": r.sample,
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


def _plot(report: DemoReport) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (or wanted) on servers and CI
    import matplotlib.pyplot as plt

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
        color = f"C{i}"
        steps = list(range(1, len(r.train_losses) + 1))
        smooth = _smooth(r.train_losses, width)
        ax.plot(steps, r.train_losses, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, smooth, color=color, linewidth=1.6, label=f"{r.flag} train")
        vs = [step for step, _ in r.val_curve]
        vl = [v for _, v in r.val_curve]
        ax.plot(vs, vl, "o--", color=color, markersize=4, linewidth=1, label=f"{r.flag} val")
        if compare and i:
            diff = [a - b for a, b in zip(smooth, base, strict=False)]
            axes[1][0].plot(steps[: len(diff)], diff, color=color, label=f"{r.flag}")
    s = report.settings
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(
        f"ByteLM on {report.corpus.name} ({s.device}, {s.layers}x{s.d_model}, "
        f"{s.batch_size * s.grad_accum}x{s.seq_len} bytes/step)"
    )
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    if compare:
        low = axes[1][0]
        low.axhline(0.0, color="C0", linewidth=1)
        low.set_ylabel(f"Δ train loss\n(vs {results[0].flag})")
        low.grid(alpha=0.3)
        low.legend(fontsize=8)
    axes[-1][0].set_xlabel(f"optimizer step (train loss: {width}-step moving average)")
    fig.tight_layout()
    fig.savefig(report.plot_path)
    plt.close(fig)


def _table(report: DemoReport) -> Table:
    cuda = report.settings.device.type == "cuda"
    table = Table(title="computectx demo: one model, one batch order, one policy per row")
    table.add_column("policy")
    table.add_column("train loss", justify="right")
    table.add_column("val loss", justify="right")
    table.add_column("tokens/s", justify="right")
    table.add_column("peak MiB" if cuda else "state MiB", justify="right")
    table.add_column("fp8 non-finite", justify="right")
    table.add_column("fp8 saturated", justify="right")
    for r in report.results:
        fp8 = r.fp8_nonfinite is not None and r.fp8_saturated is not None
        table.add_row(
            r.flag,
            f"{r.train_loss:.4f}",
            f"{r.val_loss:.4f}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.memory_bytes / 2**20:.2f}",
            f"{r.fp8_nonfinite}" if fp8 else "-",
            f"{100 * (r.fp8_saturated or 0.0):.4f}%" if fp8 else "-",
        )
    return table


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


# ----- the run ------------------------------------------------------------------------------


def run_demo(settings: DemoSettings, console: Console | None = None) -> DemoReport:
    """Train every policy in ``settings.dtypes``, print the table and write the outputs.

    Checks the output folder, the data and the device before training (``DemoError``).
    Writes ``results.json`` and ``loss.png`` into ``settings.out``.
    """
    out = console or Console()
    if console is None and not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=120)  # rich assumes 80 columns off a terminal: too narrow
    dev = settings.device
    if dev.type == "cuda":
        probe = capability.cuda(dev)
        if not probe.ok:
            raise DemoError(f"--device {dev} cannot run here: {probe.reason}")
    elif dev.type != "cpu":
        raise DemoError(f"--device {dev} is not supported by the demo; accepted: cpu, cuda[:N]")
    corpus = load_corpus(settings.data, min_bytes=settings.seq_len + 1)
    folder = check_output_dir(settings.out)
    backend = reason = None
    if any(f.startswith("fp8_") for f in settings.dtypes):
        chosen, reason = select_backend(dev)
        backend = chosen.value
    out.print(
        f"corpus: {corpus.name} ({corpus.source}): {corpus.files} files, "
        f"{corpus.train.numel():,} train + {corpus.val.numel():,} validation bytes"
        + (" (cut at the byte cap)" if corpus.truncated else ""),
        markup=False,
        highlight=False,
    )
    if backend is not None:
        # select_backend's reason starts with the backend's name ("reference: no CUDA ...").
        out.print(f"fp8 backend: {reason}", markup=False, highlight=False)
    val = _val_batches(corpus, settings.batch_size, settings.seq_len, settings.eval_batches)
    results = []
    columns = (
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with Progress(*columns, console=Console(stderr=True)) as progress:
            for flag in settings.dtypes:
                results.append(_train_policy(flag, settings, corpus, val, progress))
    finally:
        torch.set_num_threads(threads)
    report = DemoReport(
        settings=settings,
        corpus=corpus,
        fp8_backend=backend,
        fp8_reason=reason,
        memory_measure=_memory_measure(dev),
        results=results,
        json_path=folder / "results.json",
        plot_path=folder / "loss.png",
    )
    out.print(_table(report))
    out.print(report.memory_measure, markup=False, highlight=False)
    for r in results:
        out.print(f"{r.flag:<10} {r.policy}", markup=False, highlight=False)
        if r.skipped_steps:
            out.print(
                f"{r.flag}: {r.skipped_steps} step(s) skipped for non-finite gradients",
                markup=False,
            )
    for r in results:
        if r.sample:
            out.print(f"\nsample ({r.flag}, temperature 0.8, top-k 40):", markup=False)
            out.print(Text(_printable(r.sample)))
    report.json_path.write_text(json.dumps(_results_json(report), indent=1, allow_nan=False))
    _plot(report)
    out.print(f"\nwrote {report.json_path} and {report.plot_path}", markup=False)
    return report


# ----- the command line --------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..2**63-1, got {text!r}")
    return value


def _dtype_list(text: str) -> list[str]:
    flags = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [f for f in flags if f not in DTYPE_FLAGS]
    if not flags or bad:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {', '.join(map(repr, bad)) or repr(text)}; accepted: "
            f"{', '.join(DTYPE_FLAGS)} (repeat --dtype or separate with commas)"
        )
    return flags


def _device(text: str) -> torch.device:
    try:
        return parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's flags to ``parser`` (the ``demo`` subcommand's parser)."""
    d = DemoSettings.model_fields
    parser.add_argument(
        "--dtype",
        dest="dtypes",
        action="extend",
        type=_dtype_list,
        metavar="FLAG[,FLAG]",
        help=f"policy to train, repeatable: {', '.join(DTYPE_FLAGS)} "
        f"(default: {','.join(DEFAULT_DTYPES)})",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=d["steps"].default, help="optimizer steps"
    )
    parser.add_argument("--seed", type=_seed, default=d["seed"].default, help="random seed")
    parser.add_argument(
        "--grad-accum",
        type=_positive_int,
        default=1,
        metavar="N",
        help="micro-batches per step, summed in a LowPrecGradAccumulator when N > 1",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="step master weights and AdamW state with an OffloadedOptimizer on the CPU",
    )
    parser.add_argument(
        "--out", type=Path, default=d["out"].default, help="output folder (default: %(default)s)"
    )
    parser.add_argument(
        "--device", type=_device, default=None, help="cpu or cuda[:N] (default: cuda if usable)"
    )
    parser.add_argument(
        "--data", type=Path, default=None, help="text file or folder (default: Python's stdlib)"
    )
    for name, meta, what in (
        ("batch-size", "B", "sequences per micro-batch"),
        ("seq-len", "T", "bytes per sequence"),
        ("d-model", "D", "model width, a multiple of 32"),
        ("layers", "L", "decoder blocks"),
        ("sample-tokens", "N", "bytes generated per sample, 0 for none"),
        ("threads", "N", "CPU threads for torch during the run"),
    ):
        field = name.replace("-", "_")
        parser.add_argument(
            f"--{name}",
            dest=field,
            type=int,
            default=d[field].default,
            metavar=meta,
            help=f"{what} (default: %(default)s)",
        )
    parser.add_argument("--lr", type=float, default=d["lr"].default, help="peak learning rate")


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    """``DemoSettings`` from parsed flags; ``DemoError`` naming the flag when one is invalid."""
    fields: dict[str, Any] = {
        k: getattr(args, k)
        for k in (
            "steps",
            "seed",
            "grad_accum",
            "offload",
            "out",
            "data",
            "batch_size",
            "seq_len",
            "d_model",
            "layers",
            "sample_tokens",
            "threads",
            "lr",
        )
    }
    if args.dtypes:
        fields["dtypes"] = tuple(args.dtypes)
    if args.device is not None:
        fields["device"] = args.device
    try:
        return DemoSettings(**fields)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
            loc = "--dtype" if loc == "--dtypes" else loc
            msg = str(err["msg"]).removeprefix("Value error, ")
            msgs.append(f"{loc}: {msg}" if err["loc"] else msg)
        raise DemoError("; ".join(msgs)) from None


def run_command(args: argparse.Namespace) -> int:
    """The ``computectx demo`` subcommand: 0 on success, 2 on a bad setting."""
    try:
        run_demo(settings_from_args(args))
    except DemoError as e:
        print(f"computectx demo: error: {e}", file=sys.stderr)
        return 2
    return 0
