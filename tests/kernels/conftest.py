"""Kernel tests run on an fp8 GPU when there is one, else in Triton's CPU interpreter.

Triton decides at decoration time (when a kernel module is imported) whether a kernel is
compiled or interpreted, from ``TRITON_INTERPRET``. Without a CUDA device this conftest
imports the kernel modules with ``TRITON_INTERPRET=1`` set and then restores the
environment, so other test directories in the same (xdist worker) process see the
environment they started with; an autouse fixture sets the variable again, for the
duration of each test here only, because ``select_backend`` and the backend checks
read it when a test forces the Triton backend onto CPU tensors.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import torch
from filelock import FileLock

from computectx import capability

ON_GPU = bool(capability.fp8_tensor_cores())
"""True when the kernels compile for a CUDA GPU with fp8 tensor cores."""
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
"""Where kernel tests put their tensors."""

_KERNEL_MODULES = (
    "computectx.kernels.fp8_codes",  # first: the others import its function
    "computectx.kernels.quantize_cast",  # then the quantize kernels' shared functions
    "computectx.kernels.quantize",
    "computectx.kernels.quantize_blocks",
    "computectx.kernels.scaled_mm",
    "computectx.kernels.scaled_mm_blocks",
    "computectx.kernels.grouped_mm",
    "computectx.kernels.grouped_wgrad",
    "computectx.kernels.decode_attention",
)


def _import_kernels_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in _KERNEL_MODULES:
            module = sys.modules.get(name)
            if module is None:
                importlib.import_module(name)
            elif not getattr(module, "INTERPRETED", False):
                # Imported earlier (by another directory's tests) as compiled kernels:
                # decorate them again, now interpreted.
                importlib.reload(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not ON_GPU:
    _import_kernels_interpreted()


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device kernel tests run on: an fp8 GPU, else the CPU under the interpreter.

    Session-scoped (it never changes), so hypothesis tests can take it too.
    """
    return DEVICE


_GPU_COMPILES: dict[str, str] = {}
"""The script each GPU-compile test checks the report of, by the test's qualified name."""

_COMPILE_ALL = r"""
import contextlib, io, json, os, pathlib, sys, traceback
folder = pathlib.Path(sys.argv[1])
reports = {}
for name, script in json.loads((folder / "gpu-compile-scripts.json").read_text()).items():
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, name, "exec"), {"__name__": "__main__"})
        reports[name] = {"report": json.loads(printed.getvalue())}
    except Exception:
        reports[name] = {"error": traceback.format_exc()}
(folder / "gpu-compile.part").write_text(json.dumps(reports))
os.replace(folder / "gpu-compile.part", folder / "gpu-compile.json")
"""

_RUN_AND_RECORD = (
    'f="$2/gpu-compile.status"; timeout -k 5 "$3" "$0" -c "$1" "$2"; '
    'printf %s $? > "$f.part"; mv "$f.part" "$f"'
)
"""Runs the child (``$0 -c $1 $2``) under its own time limit (``$3`` seconds: it ends even
where the process that started it died without waiting) and then records its exit status,
whatever ended it (124 or 137 for the limit)."""

_Test = TypeVar("_Test", bound=Callable[..., None])


def _name(test: Callable[..., None]) -> str:
    return f"{test.__module__}.{test.__qualname__}"


def compiles_for_gpu(script: str) -> Callable[[_Test], _Test]:
    """Mark a test as checking the JSON report that ``script`` prints (it compiles kernels ahead
    of time for GPU targets); the test takes that report as its ``compile_report`` argument."""

    def register(test: _Test) -> _Test:
        _GPU_COMPILES[_name(test)] = script
        return test

    return register


def _session_scripts(session: pytest.Session) -> dict[str, str]:
    """The GPU-compile scripts of the tests this session runs (after selection)."""
    names = {_name(item.function) for item in session.items if hasattr(item, "function")}
    return {name: s for name, s in _GPU_COMPILES.items() if name in names}


def _compile_folder(session: pytest.Session) -> Path:
    """The folder the session's xdist workers share (each worker's own temporary folder is
    below it); without xdist, this process's own."""
    factory: pytest.TempPathFactory = session.config._tmp_path_factory  # type: ignore[attr-defined]
    base = factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


_CHILD: list[subprocess.Popen[bytes]] = []
"""The compile child this process started, if it did (waited for at the session's end)."""


def _start_compile_all(scripts: dict[str, str], folder: Path) -> None:
    """Start one fresh interpreter without ``TRITON_INTERPRET`` (one import of torch, Triton
    and the kernels for all) that runs every script and writes each one's report, or its
    traceback, to ``gpu-compile.json`` in ``folder`` (its stderr and exit status beside it).
    It runs in the background, alongside the session's other tests."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(folder / "gpu-compile-triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default, stated to silence a warning
    (folder / "gpu-compile-scripts.json").write_text(json.dumps(scripts))
    with (folder / "gpu-compile.stderr").open("wb") as stderr:
        _CHILD.append(
            subprocess.Popen(
                [
                    *("/bin/sh", "-c", _RUN_AND_RECORD, sys.executable, _COMPILE_ALL),
                    *(str(folder), str(int(_WALL_LIMIT))),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
                start_new_session=True,  # its own process group: ended with its sh wrapper
            )
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the GPU-compile child as soon as the session knows its tests: the first process
    of the session (under xdist, the first worker to get the lock) starts it, and the tests
    read its reports (``_gpu_compile_reports``) when they run, most often long after it is
    done, so no worker waits on it and its compiles overlap the other tests."""
    scripts = _session_scripts(session)
    if not scripts or session.config.option.collectonly:
        return
    folder = _compile_folder(session)
    with FileLock(folder / "gpu-compile.lock"):
        if not (folder / "gpu-compile-scripts.json").exists():
            _start_compile_all(scripts, folder)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Wait for the child this process started (another worker may still read its reports),
    or end it when the session was interrupted or stopped at a failure (``-x``)."""
    stopped = exitstatus == pytest.ExitCode.INTERRUPTED or bool(session.shouldstop)
    for child in _CHILD:
        try:
            child.wait(timeout=0 if stopped else _WALL_LIMIT)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            # Its wrapper went with it: a worker still waiting on the reports fails at once.
            status = Path(cast(list[str], child.args)[5]) / "gpu-compile.status"
            if not status.exists():
                status.write_text("killed: the session stopped first")


_WALL_LIMIT = 600.0
"""Seconds the compile child may take from its start."""


@pytest.fixture(scope="session")
def _gpu_compile_reports(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The reports of the session's GPU-compile tests, from the one child process for them all
    (started at the end of collection, ``pytest_collection_finish``), waited for here."""
    folder = _compile_folder(request.session)
    done, status = folder / "gpu-compile.json", folder / "gpu-compile.status"
    started = (folder / "gpu-compile-scripts.json").stat().st_mtime
    while not status.exists():
        assert time.time() - started < _WALL_LIMIT, "the GPU-compile child ran past its limit"
        time.sleep(0.2)
    stderr = (folder / "gpu-compile.stderr").read_text()[-4000:]
    assert status.read_text() == "0", stderr
    loaded: dict[str, Any] = json.loads(done.read_text())
    return loaded


@pytest.fixture
def compile_report(
    request: pytest.FixtureRequest, _gpu_compile_reports: dict[str, Any]
) -> dict[str, Any]:
    """The report of the script this test is marked with (``compiles_for_gpu``)."""
    entry = _gpu_compile_reports[_name(request.function)]
    assert "error" not in entry, entry.get("error", "")[-4000:]
    report: dict[str, Any] = entry["report"]
    return report
