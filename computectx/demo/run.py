"""``run_demo``: check everything, train each policy, print the table, write the files."""

from __future__ import annotations

import datetime
import io
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text
from torch.multiprocessing.spawn import start_processes

from computectx import capability
from computectx._files import atomic_path
from computectx.demo.corpus import Corpus, load_corpus, val_batches
from computectx.demo.moe import load_notes, load_table, plot_expert_load
from computectx.demo.report import (
    DemoReport,
    optim_state_notes,
    optim_state_of,
    optim_state_table,
    plot_losses,
    printable,
    results_table,
    serving_notes,
    serving_table,
    table_notes,
    write_results,
)
from computectx.demo.settings import DemoError, DemoSettings
from computectx.demo.train import (
    PolicyResult,
    data_parallel_rank,
    policy_ctx,
    tail_steps,
    train_policy,
)
from computectx.formats import select_backend

__all__ = ["check_output_dir", "resolve_device", "run_demo"]

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a rank waits in a collective before failing (a dead peer ends the run)."""


def resolve_device(settings: DemoSettings) -> torch.device:
    """The device to train on: ``settings.device``, or CUDA when usable else the CPU.

    ``DemoError`` when the named CUDA device cannot run here.
    """
    if settings.device is None:
        return capability.default_device()
    dev = torch.device(settings.device)
    if dev.type == "cuda":
        probe = capability.cuda(dev)
        if not probe.ok:
            raise DemoError(f"--device {settings.device} cannot run here: {probe.reason}")
    return dev


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


def _half_gemm_line(settings: DemoSettings, dev: torch.device) -> str | None:
    if dev.type != "cpu":
        return None
    halves = sorted(
        {
            c.compute.torch
            for c in (policy_ctx(f, settings, dev) for f in settings.dtypes)
            if c.compute.torch in (torch.bfloat16, torch.float16)
        },
        key=str,
    )
    parts = []
    for dtype in halves:
        probe = capability.native_half_gemm(dtype)
        how = (
            "torch's kernel"
            if probe.ok
            else "float32 GEMMs of the exactly widened operands, rounded once (GemmPath.UPCAST)"
        )
        parts.append(f"{str(dtype).removeprefix('torch.')} GEMMs: {how}; {probe.reason}")
    return "; ".join(parts) or None


def _load_title(report: DemoReport) -> str:
    s = report.settings
    return (
        f"expert load per step: ByteLM {s.layers}x{s.d_model}, {s.experts} experts, "
        f"top-{s.top_k}, {s.shared_experts} shared, balance {s.balance} ({report.device})\n"
        f"each expert's tokens over the balanced share (1 = balanced)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank_main(rank: int, settings: DemoSettings, port: int, report_path: str) -> None:
    """One process of ``--nproc``: join the group, run the demo, rank 0 reports."""
    dev = resolve_device(settings)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        settings = settings.model_copy(update={"device": str(dev)})
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        backend, rank=rank, world_size=settings.nproc, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        quiet = None if rank == 0 else Console(file=io.StringIO())
        report = run_demo(settings, quiet)
        if rank == 0:
            with atomic_path(report_path, what="the rank-0 report") as tmp:
                torch.save(report, tmp)
    finally:
        dist.destroy_process_group()


def _launch(settings: DemoSettings) -> DemoReport:
    # torch's own launcher machinery: spawned processes, a failure in any rank raised here.
    dev = resolve_device(settings)
    if dev.type == "cuda" and settings.nproc > torch.cuda.device_count():
        raise DemoError(
            f"--nproc {settings.nproc} exceeds the {torch.cuda.device_count()} CUDA device(s) "
            f"here; accepted: 1 to {torch.cuda.device_count()}"
        )
    load_corpus(settings.data, min_bytes=settings.seq_len + 1)  # refuse bad data up front
    folder = check_output_dir(settings.out)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".computectx-ranks-") as tmp:
        report_path = os.path.join(tmp, "report.pt")
        start_processes(  # type: ignore[no-untyped-call]  # torch leaves it untyped
            _rank_main,
            args=(settings, _free_port(), report_path),
            nprocs=settings.nproc,
            start_method="spawn",
        )
        report: DemoReport = torch.load(report_path, weights_only=False)  # our own file
    return report


def run_demo(settings: DemoSettings, console: Console | None = None) -> DemoReport:
    """Train every policy in ``settings.dtypes``, print the table and write the outputs.

    Checks the device, the data and the output folder before training (``DemoError``).
    Writes ``results.json`` and ``loss.png`` (and under ``--moe`` ``expert-load.png``) into
    ``settings.out``. Sets torch's intra-op thread count to ``settings.threads`` for the
    training and restores it. With ``settings.nproc`` above 1 it spawns that many processes
    (gloo on the CPU, one GPU each with nccl) that train data-parallel; rank 0 prints and
    writes, and its report is returned.
    """
    rank, world = data_parallel_rank()
    if settings.nproc > 1 and world == 1:
        return _launch(settings)
    if world != settings.nproc:
        raise DemoError(
            f"run_demo with nproc={settings.nproc} inside a process group of {world} "
            f"process(es); give nproc={world}, or call it outside torch.distributed"
        )
    out = _console(console)
    dev = resolve_device(settings)
    for flag in settings.dtypes:
        policy_ctx(flag, settings, dev)  # a bad FLAG@ACTIVATIONS text: DemoError, up front
    corpus = load_corpus(settings.data, min_bytes=settings.seq_len + 1)
    folder = check_output_dir(settings.out)
    backend, reason = _fp8_backend(settings, dev)
    half_gemm = _print_setup(out, settings, dev, corpus, reason)
    val = val_batches(corpus, settings.batch_size, settings.seq_len, settings.eval_batches)
    results = _train_all(settings, dev, corpus, val, rank)
    report = DemoReport(
        settings=settings,
        device=dev,
        corpus=corpus,
        fp8_backend=backend,
        fp8_reason=reason,
        half_gemm=half_gemm,
        results=results,
        json_path=folder / "results.json",
        plot_path=folder / "loss.png",
        world_size=world,
        load_plot_path=folder / "expert-load.png" if settings.moe else None,
    )
    _print_report(out, report)
    if rank == 0:
        _write_outputs(out, report)
    return report


def _console(console: Console | None) -> Console:
    out = console or Console()
    if console is None and not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=120)  # rich assumes 80 columns off a terminal: too narrow
    return out


def _fp8_backend(settings: DemoSettings, dev: torch.device) -> tuple[str | None, str | None]:
    """The fp8 backend the fp8 policies run on and why (``None`` without an fp8 policy)."""
    if not any(f.startswith("fp8_") for f in settings.dtypes):
        return None, None
    chosen, reason = select_backend(dev)
    return chosen.value, reason


def _print_setup(
    out: Console, settings: DemoSettings, dev: torch.device, corpus: Corpus, reason: str | None
) -> str | None:
    """Print the corpus, the fp8 backend's reason and how half-precision GEMMs run on the
    CPU; returns that last line (``None`` off the CPU or without half policies)."""
    out.print(
        f"corpus: {corpus.name} ({corpus.source}): {corpus.files} files, "
        f"{corpus.train.numel():,} train + {corpus.val.numel():,} validation bytes"
        + (" (cut at the byte cap)" if corpus.truncated else ""),
        markup=False,
        highlight=False,
    )
    if reason is not None:
        # select_backend's reason starts with the backend's name ("reference: no CUDA ...").
        out.print(f"fp8 backend: {reason}", markup=False, highlight=False)
    half_gemm = _half_gemm_line(settings, dev)
    if half_gemm is not None:
        out.print(half_gemm, markup=False, highlight=False)
    return half_gemm


def _train_all(
    settings: DemoSettings,
    dev: torch.device,
    corpus: Corpus,
    val: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
) -> list[PolicyResult]:
    """Train every policy in turn at ``settings.threads`` intra-op threads (restored after),
    rank 0 showing the progress bars."""
    results = []
    columns = (
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("step loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with Progress(*columns, console=Console(stderr=True), disable=rank != 0) as progress:
            for flag in settings.dtypes:
                results.append(train_policy(flag, settings, dev, corpus, val, progress))
    finally:
        torch.set_num_threads(threads)
    return results


def _expert_loads(report: DemoReport) -> list[tuple[str, torch.Tensor]]:
    return [(r.flag, r.expert_load) for r in report.results if r.expert_load is not None]


def _print_report(out: Console, report: DemoReport) -> None:
    """The results table and its notes, the optimizer-state, expert-load and serving
    sections, then the samples."""
    out.print(results_table(report))
    for line in table_notes(report):
        out.print(line, markup=False, highlight=False)
    for r in report.results:
        out.print(f"{r.flag:<10} {r.policy}", markup=False, highlight=False)
        if r.skipped_steps:
            out.print(
                f"{r.flag}: {r.skipped_steps} step(s) skipped for non-finite gradients",
                markup=False,
            )
    rows = optim_state_of(report)
    out.print(optim_state_table(rows))
    for line in optim_state_notes(rows):
        out.print(line, markup=False, highlight=False)
    _print_expert_load(out, report)
    serving = serving_table(report)
    if serving is not None:
        out.print(serving)
        for line in serving_notes(report):
            out.print(line, markup=False, highlight=False)
    for r in report.results:
        if r.sample:
            out.print(f"\nsample ({r.flag}, kv={r.kv}, temperature 0.8, top-k 40):", markup=False)
            out.print(Text(printable(r.sample)))


def _print_expert_load(out: Console, report: DemoReport) -> None:
    """Under ``--moe``: each policy's expert load over the last steps, with its notes."""
    loads = _expert_loads(report)
    if not loads:
        return
    settings = report.settings
    tail = tail_steps(settings.steps)
    out.print(load_table(loads, tail))
    tokens = settings.batch_size * settings.grad_accum * settings.seq_len
    for line in load_notes(settings, tail, tokens):
        out.print(line, markup=False, highlight=False)


def _write_outputs(out: Console, report: DemoReport) -> None:
    """Rank 0: ``results.json``, ``loss.png`` and (under ``--moe``) ``expert-load.png``."""
    write_results(report)
    plot_losses(report)
    wrote = [report.json_path, report.plot_path]
    loads = _expert_loads(report)
    if loads and report.load_plot_path is not None:
        plot_expert_load(loads, report.load_plot_path, _load_title(report))
        wrote.append(report.load_plot_path)
    out.print(f"\nwrote {', '.join(map(str, wrote[:-1]))} and {wrote[-1]}", markup=False)
