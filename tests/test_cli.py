"""``computectx info`` and the capability probes it reports."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from computectx import ComputeCtx, capability
from computectx.cli import info_lines, main


def test_info_reports_versions_probes_and_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch       {torch.__version__}" in out
    for probe in ("cuda", "fp8 tensor cores", "triton", "triton interpreter"):
        assert f"  {probe} " in out
    assert str(ComputeCtx.serving("cpu" if not torch.cuda.is_available() else "cuda")) in out
    assert "fp8=hybrid/delayed/16/0/max" in out
    if not torch.cuda.is_available():
        assert "fp8 backend: reference: no CUDA device" in out


def test_presets_in_info_parse_back() -> None:
    presets = [ln for ln in info_lines() if "compute=" in ln]
    assert len(presets) >= 9
    for line in presets:
        text = line.split()[-1]
        assert str(ComputeCtx.parse(text)) == text


def test_probes_give_reasons() -> None:
    for probe in (
        capability.cuda(),
        capability.fp8_tensor_cores(),
        capability.triton_available(),
        capability.triton_interpreter(),
    ):
        assert probe.reason
        assert bool(probe) is probe.ok
    expected = "cuda" if capability.cuda().ok else "cpu"
    assert capability.default_device() == torch.device(expected)
    if not torch.cuda.is_available():
        assert not capability.fp8_tensor_cores("cuda:0").ok
        assert "no fp8 tensor cores" in capability.fp8_tensor_cores().reason


def test_interpreter_probe_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert capability.triton_interpreter().ok
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not capability.triton_interpreter().ok


def test_module_entry_point_and_bad_command() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "computectx", "info"], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0 and "presets:" in res.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "computectx", "frobnicate"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "invalid choice: 'frobnicate'" in bad.stderr
