"""Run a scenario on N gloo ranks, each a fresh process, and collect what each rank reports.

Every rank is a subprocess running ``worker.py`` with a free port, a collective timeout (set in
the worker) and a wall-clock limit here, so a bug fails the test in seconds instead of hanging
CI. Each rank writes its results with ``torch.save``; the test compares them with a
single-process run of the same scenario.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).resolve().parent / "worker.py"

RunRanks = Callable[..., list[dict[str, Any]]]


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run(
    tmp_path: Path, scenario: str, world_size: int, limit_s: float, params: dict[str, Any]
) -> list[dict[str, Any]]:
    # world_size=1 runs the same scenario in one process: the single-process reference.
    out = tmp_path / f"{scenario.replace(':', '-').replace('.py', '')}-{world_size}"
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    for rank in range(world_size):
        cmd = [sys.executable, str(WORKER), scenario, str(out), json.dumps(params)]
        log = (out / f"rank{rank}.log").open("w")
        procs.append(
            (
                subprocess.Popen(
                    cmd, env={**env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    failed = []
    try:
        for rank, (proc, _) in enumerate(procs):
            try:
                if proc.wait(timeout=limit_s) != 0:
                    failed.append(rank)
            except subprocess.TimeoutExpired:
                failed.append(rank)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        logs = "\n".join(
            f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text()[-4000:]}" for r in failed
        )
        pytest.fail(f"{scenario} on {world_size} rank(s): rank(s) {failed} failed\n{logs}")
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


@pytest.fixture
def run_ranks(tmp_path: Path) -> RunRanks:
    """``run_ranks(scenario, world_size=2, limit_s=120, **params)``: each rank's result dict."""

    def run(
        scenario: str, world_size: int = 2, limit_s: float = 120.0, **params: Any
    ) -> list[dict[str, Any]]:
        return _run(tmp_path, scenario, world_size, limit_s, params)

    return run
