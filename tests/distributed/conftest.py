"""Run a scenario on N gloo ranks, each a fresh process, and collect what each rank reports.

Every rank is a process forked from a server with torch imported (``worker.run_forked``), with
a free port, a collective timeout (set in the worker) and a wall-clock limit here, so a bug
fails the test in seconds instead of hanging CI. Each rank writes its results with
``torch.save``; the test compares them with a single-process run of the same scenario.
"""

from __future__ import annotations

import multiprocessing
import runpy
import socket
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

import pytest
import torch

from computectx.formats.numerics.ledger import ledger_history, ledger_step

WORKER = Path(__file__).resolve().parent / "worker.py"

RunRanks = Callable[..., list[dict[str, Any]]]


def in_world(ledger: torch.Tensor, key: str, ratio: float) -> torch.Tensor:
    """``ledger`` (of operand ``key``, e.g. ``"0.grad"``) as another world size holds it: under a
    per-rank mean loss a gradient ledger's history and step scale with the world size, times
    ``ratio``; other ledgers are the same. A copy."""
    out = ledger.clone()
    if key.endswith(".grad"):
        ledger_history(out).mul_(ratio)
        ledger_step(out).mul_(ratio)
    return out


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


_FORKSERVER: list[ForkServerContext] = []


def _context() -> ForkServerContext:
    # One forkserver per test process, started on first use with torch and computectx
    # imported: each rank is then a fork of it (milliseconds) instead of a fresh interpreter
    # importing torch (seconds), and the server itself never ran an op or a collective.
    if not _FORKSERVER:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "computectx.distributed",
                "computectx.formats",
                "torch.distributed.fsdp",
            ]
        )
        _FORKSERVER.append(ctx)
    return _FORKSERVER[0]


def _run(
    tmp_path: Path, scenario: str, world_size: int, limit_s: float, params: dict[str, Any]
) -> list[dict[str, Any]]:
    # world_size=1 runs the same scenario in one process: the single-process reference.
    out = tmp_path / f"{scenario.replace(':', '-').replace('.py', '')}-{world_size}"
    out.mkdir(parents=True, exist_ok=True)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }
    ctx = _context()
    procs = []
    for rank in range(world_size):
        # The worker runs as a file (pytest imports test modules under names a forked
        # interpreter cannot import again); it calls run_forked with FORK_ARGS.
        fork_args = (scenario, out, params, {**env, "RANK": str(rank)})
        proc = ctx.Process(
            target=runpy.run_path,
            args=(str(WORKER),),
            kwargs={"init_globals": {"FORK_ARGS": fork_args}, "run_name": "__forked__"},
        )
        proc.start()
        procs.append(proc)
    failed = []
    deadline = time.monotonic() + limit_s
    try:
        for rank, proc in enumerate(procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode != 0:
                failed.append(rank)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n{_log(out, r, procs[r].exitcode)}" for r in failed)
        pytest.fail(f"{scenario} on {world_size} rank(s): rank(s) {failed} failed\n{logs}")
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


def _log(out: Path, rank: int, exitcode: int | None) -> str:
    log = out / f"rank{rank}.log"
    if not log.exists():  # it failed before its output went to the log: see stderr
        return f"(no log: the process ended with exit code {exitcode} before writing one)"
    return log.read_text()[-4000:]


@pytest.fixture
def run_ranks(tmp_path: Path) -> RunRanks:
    """``run_ranks(scenario, world_size=2, limit_s=120, **params)``: each rank's result dict."""

    def run(
        scenario: str, world_size: int = 2, limit_s: float = 120.0, **params: Any
    ) -> list[dict[str, Any]]:
        return _run(tmp_path, scenario, world_size, limit_s, params)

    return run
