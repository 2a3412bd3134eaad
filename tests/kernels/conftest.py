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
from pathlib import Path
from typing import Any

import pytest
import torch

from computectx import capability

ON_GPU = bool(capability.fp8_tensor_cores())
"""True when the kernels compile for a CUDA GPU with fp8 tensor cores."""
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
"""Where kernel tests put their tensors."""

_KERNEL_MODULES = (
    "computectx.kernels.fp8_codes",  # first: the others import its function
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


def compile_report(script: str, tmp_path: Path) -> dict[str, Any]:
    """Run ``script`` (which compiles kernels ahead of time for GPU targets and prints a JSON
    report) in a fresh interpreter without ``TRITON_INTERPRET``; its report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the current default, stated to silence a warning
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    report: dict[str, Any] = json.loads(res.stdout)
    return report
