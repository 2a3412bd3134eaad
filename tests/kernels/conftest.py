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
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

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
import contextlib, io, json, sys, traceback
reports = {}
for name, script in json.loads(sys.stdin.read()).items():
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(script, name, "exec"), {"__name__": "__main__"})
        reports[name] = {"report": json.loads(printed.getvalue())}
    except Exception:
        reports[name] = {"error": traceback.format_exc()}
json.dump(reports, sys.stdout)
"""

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


def _compile_all(scripts: dict[str, str], cache: Path) -> dict[str, Any]:
    """Run every script in one fresh interpreter without ``TRITON_INTERPRET`` (one import of
    torch, Triton and the kernels for all); each script's report, or its traceback."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default, stated to silence a warning
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE_ALL],
        input=json.dumps(scripts),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    reports: dict[str, Any] = json.loads(res.stdout)
    return reports


@pytest.fixture(scope="session")
def _gpu_compile_reports(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The reports of the session's GPU-compile tests, from one child process for them all;
    under xdist the first worker to ask runs it (in the folder the session's workers share) and
    the others, waiting on a lock meanwhile, read its reports."""
    names = {_name(item.function) for item in request.session.items if hasattr(item, "function")}
    scripts = {name: s for name, s in _GPU_COMPILES.items() if name in names}
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _compile_all(scripts, tmp_path_factory.mktemp("triton-cache"))
    root = tmp_path_factory.getbasetemp().parent  # the session's; each worker's own is below
    done = root / "gpu-compile.json"
    with FileLock(root / "gpu-compile.lock"):
        if not done.exists():
            reports = _compile_all(scripts, root / "gpu-compile-triton-cache")
            done.write_text(json.dumps(reports))
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
