"""Launch a framework's recipe under torchrun with a wall-clock limit (the frameworks are the
optional ``integrations`` extra: each test module skips, with its reason, when one is absent).

The worker sets its own collective timeout (30 s); ``torchrun`` runs here with a limit of
150 s (a launch takes about 50 s on a busy 2-core machine, most of it imports),
so a hang fails the test within minutes instead of stalling CI.

A launch costs more in imports (torchrun, then each rank importing torch and the framework)
than in training, so each framework's recipes run in one launch: ``torchrun_once`` launches
once per test session, even across xdist workers, and every test reads its part.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

HERE = Path(__file__).resolve().parent
LIMIT_S = 150.0


def skip_unless_installed(*modules: str, reason: str = "") -> None:
    """``pytest.importorskip``'s check without its import: skip the calling test module unless
    every module's top-level package is installed (``importlib.util.find_spec``, which imports
    nothing). For a framework the module's tests only use in a launched process or inside a test
    body (lightning is 4 CPU-s to import, compressed_tensors 3): every xdist worker collects
    every module, and an import at collection is paid by each of them."""
    missing = [m for m in modules if importlib.util.find_spec(m.partition(".")[0]) is None]
    if missing:
        why = reason or "in the optional extra: pip install -e '.[integrations]'"
        pytest.skip(f"{', '.join(missing)} not installed ({why})", allow_module_level=True)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def torchrun(worker: str, nproc: int, out: Path, *args: str) -> list[dict[str, Any]]:
    """Run ``worker`` (a file in this folder) on ``nproc`` ranks with ``torchrun``; each
    rank's ``out/rank{R}.pt``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(HERE / worker),
        str(out),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr if isinstance(e.stderr, str) else ""
        pytest.fail(f"{worker} on {nproc} rank(s) ran past {LIMIT_S} s:\n{err[-6000:]}")
    if done.returncode != 0:
        pytest.fail(f"{worker} on {nproc} rank(s) failed:\n{done.stderr[-6000:]}")
    return _ranks(out, nproc)


def _ranks(out: Path, nproc: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def torchrun_once(
    factory: pytest.TempPathFactory, name: str, worker: str, nproc: int, *args: str
) -> list[dict[str, Any]]:
    """``torchrun(worker, nproc, ..., *args)`` once per test session: under xdist the first
    worker to ask launches (in the folder the session's workers share) and the others, waiting
    on a lock meanwhile, read its ranks' files. A failed launch leaves nothing to read, so the
    next to ask launches again and fails on its own."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return torchrun(worker, nproc, factory.mktemp(name), *args)
    root = factory.getbasetemp().parent  # the session's; each worker's own is below it
    out, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            torchrun(worker, nproc, out, *args)
            done.touch()
    return _ranks(out, nproc)


# The tiny transformers models of the checkpoint tests (test_hf_checkpoint*.py): their config's
# common part, and each recipe those tests convert under.
HF_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 64,
}
HF_RECIPES = {
    "tensor": "e4m3/dynamic/0",
    "row": "e4m3/row/dynamic/0",
    "block": "e4m3/block/dynamic/0",
    "mx": "e4m3/mx/dynamic/0",
}
