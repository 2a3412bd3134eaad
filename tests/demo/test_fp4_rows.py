"""``computectx demo --dtype nvfp4``: the 4-bit rows train their dense linears as Fp4Linear."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from computectx.cli import main

from .test_run import TEXT, TINY


def test_a_4_bit_row_trains_its_linears_in_4_bits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    data = tmp_path / "code.txt"
    data.write_text(TEXT)
    argv = ["--dtype", "nvfp4", "--steps", "2", "--data", str(data), "--out", str(tmp_path)]
    assert main(["demo", *argv, *TINY, "--sample-tokens", "0", "--eval-batches", "1"]) == 0
    stdout = capsys.readouterr().out
    (r,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert r["flag"] == "nvfp4" and r["policy"].endswith(",recipe=nvfp4")
    assert r["fp8_converted_linears"] == 5  # qkv, out and the MLP's three; not the head
    assert r["fp8_backend"] == "emulated"  # the 4-bit twins: no FP4 tensor cores here
    assert r["fp8_nonfinite"] is None and r["fp8_granularity"] is None  # no fp8 statistics
    assert all(math.isfinite(v) for v in r["train_losses"])
    assert "│ nvfp4 " in stdout


def test_a_4_bit_moe_row_trains_its_experts_in_4_bits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --moe took no 4-bit flag before the 4-bit grouped GEMM (Fp4Experts).
    monkeypatch.setenv("COLUMNS", "200")
    data = tmp_path / "code.txt"
    data.write_text(TEXT)
    argv = ["--dtype", "mxfp4", "--moe", "--experts", "4", "--steps", "2", "--data", str(data)]
    argv += ["--out", str(tmp_path), *TINY, "--sample-tokens", "0", "--eval-batches", "1"]
    assert main(["demo", *argv]) == 0
    (r,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert r["flag"] == "mxfp4" and all(math.isfinite(v) for v in r["train_losses"])
    assert "│ mxfp4 " in capsys.readouterr().out
