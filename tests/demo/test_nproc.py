"""``computectx demo --nproc N``: data-parallel ranks against one process, and the bounds.

The training runs call the CLI's ``main`` in the test's process (as tests/demo/test_run.py
does), so the launcher is not a third interpreter (each ``python -m computectx`` imports torch,
seconds). In the ``plain`` case ``--nproc 2`` spawns its two ranks as fresh interpreters, as
for a user; in the ``memory`` case the demo's ``spawn`` processes are started as forks of this
process's forkserver, which imported torch and computectx once and never ran an op (as
tests/test_docs.py does for the docs' spawned ranks): each rank then prepares itself as a
spawned interpreter does (the parent's ``sys.path`` and folder, the main module, the process
object unpickled) and skips only the seconds of imports; its stdout is the server's. The bad
values go through ``python -m computectx`` itself, which refuses them before importing torch.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from multiprocessing import context, popen_forkserver
from pathlib import Path
from typing import Any

import pytest
import torch

from computectx.cli import main

TEXT = "".join(f"def f{i % 7}(x):\n    return x + {i % 7}\n\n" for i in range(300))
SMALL = [
    "--batch-size", "4", "--seq-len", "32", "--d-model", "32", "--layers", "1",
    "--sample-tokens", "0", "--device", "cpu", "--steps", "8", "--lr", "1e-2",
    "--eval-batches", "1",
]  # fmt: skip
"""--eval-batches 1: rank 0's validation and serving passes see 4 windows, not 16; the
training batches, and so the losses compared (docs/demo.md's figures), are the same."""


def _demo(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "computectx", "demo", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def _results(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    return data


PRELOAD = [
    "torch",
    "torch.distributed",
    "computectx.distributed",
    "computectx.formats",
    "torch.distributed.fsdp",
    "computectx.nn",
    "computectx.memory",
    "computectx.demo.run",
]
"""What the forkserver imports if this test starts it: tests/test_docs.py's list (a server
started here serves those tests too) and the demo."""


def _spawn_as_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the test ends, ``spawn`` processes start as forks of this process's forkserver
    (started now with ``PRELOAD`` unless tests/distributed or tests/test_docs started it)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    monkeypatch.setattr(context.SpawnProcess, "_Popen", staticmethod(popen_forkserver.Popen))


@pytest.mark.parametrize(
    "extra",
    [
        ["--dtype", "fp32,fp8_hybrid,nvfp4", "--skip-serving"],
        ["--dtype", "fp32,fp8_hybrid", "--grad-accum", "2", "--offload"],
    ],
    ids=["plain", "memory"],
)
def test_two_processes_train_like_one(
    tmp_path: Path,
    extra: list[str],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    wall_limit: Callable[[float, str], AbstractContextManager[None]],
) -> None:
    # "memory": micro-batches summed in the data-parallel accumulator (one reduction per
    # step) and stepped by the offloaded optimizer, its ranks forked (the module docstring).
    # "plain" leaves out the serving section (not what is compared; its nvfp4 decode passes
    # cost most, and tests/demo/test_fp4_rows.py serves an nvfp4 row); "memory" keeps it:
    # rank 0 alone serves, the other rank waits.
    forked = "--offload" in extra
    if forked:
        _spawn_as_forks(monkeypatch)
    data = tmp_path / "code.txt"
    data.write_text(TEXT)
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"out{n}"
        threads = torch.get_num_threads()
        with wall_limit(300, f"demo --nproc {n}"):  # as the subprocess's timeout was
            code = main(["demo", *SMALL, *extra, "--data", str(data), "--out", str(out),
                         "--nproc", str(n)])  # fmt: skip
        captured = capfd.readouterr()  # the file descriptors: the spawned ranks' output too
        assert code == 0, captured.out + captured.err
        if not (forked and n == 2):  # a forked rank 0 prints to the server's stdout
            assert captured.out.count("wrote ") == 1  # one table and one report, from rank 0
        assert torch.get_num_threads() == threads  # the demo leaves this process as it was
        runs[n] = _results(out)
    assert [runs[n]["world_size"] for n in (1, 2)] == [1, 2]
    served = "--skip-serving" not in extra
    assert all(bool(r["serving"]) is served for n in (1, 2) for r in runs[n]["results"])
    one, two = ({r["flag"]: r["train_losses"] for r in runs[n]["results"]} for n in (1, 2))
    bounds = [("fp32", 1e-5), ("fp8_hybrid", 5e-4)] + [("nvfp4", 1e-2)] * ("nvfp4" in one)
    for flag, bound in bounds:  # docs/demo.md
        rel = max(abs(a - b) / abs(a) for a, b in zip(one[flag], two[flag], strict=True))
        assert rel <= bound, (flag, rel, one[flag], two[flag])


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--nproc", "0"], "--nproc '0': Input should be greater than or equal to 1"),
        (["--nproc", "-2"], "--nproc '-2': Input should be greater than or equal to 1"),
        (["--nproc", str(_cpus() + 1), "--batch-size", str(8 * (_cpus() + 1))], "CPU(s)"),
        (["--nproc", "2", "--batch-size", "3"], "does not divide batch_size=3"),
    ],
)
def test_bad_nproc_exits_2_before_launching(argv: list[str], expected: str) -> None:
    res = _demo("--device", "cpu", *argv)
    assert res.returncode == 2, res.stdout + res.stderr
    assert expected in res.stderr, res.stderr
