"""``bench/gpu_check.py --cpu-smoke`` runs every section at tiny sizes and writes its files.

Its ``main`` runs in the test's process (the bench scripts import as modules: pyproject's
``pythonpath``), not in a fresh interpreter that would import torch again; dynamo's caches are
cleared before and after, so its compiles neither meet nor leave another test's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import gpu_check
import pytest
import torch


def test_gpu_check_cpu_smoke_writes_json_and_markdown(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    wall_limit: Callable[[float, str], AbstractContextManager[None]],
) -> None:
    torch._dynamo.reset()
    try:
        # One timed call after each warm-up (--reps 1, not the smoke's 2): the rows and files
        # are the claim here, not the figures; every section and row still runs.
        with wall_limit(600, "gpu_check --cpu-smoke"):  # as the subprocess's timeout was
            code = gpu_check.main(["--cpu-smoke", "--reps", "1", "--out", str(tmp_path)])
    finally:
        torch._dynamo.reset()
    stdout = capsys.readouterr().out
    assert code == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["smoke"] is True
    sections = result["sections"]
    assert set(sections) == {
        "cuda_tests",
        "gemm",
        "quantize",
        "linear",
        "bytelm",
        "granularity_gemm",
        "kv_decode",
        "moe_gemm",
        "optim_state",
        "offload_overlap",
        "activations",
        "fp4_gemm",
    }
    # Activations (issue 36): the smoke settings each keep less than keep, checkpoint=all least.
    acts = {row["setting"]: row for row in sections["activations"]}
    assert list(acts) == [
        "keep",
        "precise:recompute/act_fn:fp8/attention:recompute",
        "checkpoint=all",
    ]
    assert (
        0
        < acts["checkpoint=all"]["saved_mib"]
        < min(row["saved_mib"] for s, row in acts.items() if s != "checkpoint=all")
    )
    assert (
        acts["keep"]["saved_mib"]
        > acts["precise:recompute/act_fn:fp8/attention:recompute"]["saved_mib"]
    )
    # 4 bits (issue 37): every op timed; the 4-bit rows say which backend ran and why.
    fp4 = {row["op"]: row for row in sections["fp4_gemm"]}
    grouped = {f"{f} fp4_grouped_mm (8 groups)" for f in ("nvfp4", "mxfp4")}
    assert set(fp4) == {"bf16 mm", "nvfp4 fp4_scaled_mm", "mxfp4 fp4_scaled_mm", *grouped}
    assert all(row["ms"] > 0 for row in fp4.values())
    assert fp4["nvfp4 fp4_scaled_mm"]["backend"] == "emulated"
    assert "never an 8-bit fallback" in fp4["mxfp4 fp4_scaled_mm"]["reason"]
    for name in ("gemm", "quantize", "linear", "bytelm", "granularity_gemm", "moe_gemm"):
        assert isinstance(sections[name], list) and sections[name], (name, sections[name])
    assert {row["op"] for row in sections["gemm"]} >= {"fp8 cublas", "bf16 mm"}
    assert {row["flag"] for row in sections["bytelm"]} == {"bf16", "fp8_hybrid"}
    assert any(row["compiled"] for row in sections["linear"])
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "## gemm" in markdown and "| op |" in markdown
    # The granularity GEMMs (issue 16): every op, its ratios, the anchors; printed too.
    gran = {row["op"]: row for row in sections["granularity_gemm"]}
    assert set(gran) == {
        "bf16 mm",
        "_scaled_mm per-tensor",
        "_scaled_mm rowwise",
        "block_scaled_mm reference 1x128 x 128x128",
        "block_scaled_mm reference mx x mx",
    }  # the CPU has no cuBLAS block or MX recipe, so no cublas rows
    assert gran["bf16 mm"]["vs_bf16"] == 1.0 and gran["_scaled_mm rowwise"]["vs_rowwise"] == 1.0
    for row in gran.values():
        assert row["tflops"] > 0
        assert row["vs_bf16"] * gran["bf16 mm"]["tflops"] == pytest.approx(row["tflops"])
    assert "block 1.41x" in gran["block_scaled_mm reference 1x128 x 128x128"]["anchor"]
    assert "delayed 1.69x, current 1.57x" in gran["_scaled_mm per-tensor"]["anchor"]
    assert gran["_scaled_mm rowwise"]["anchor"] == ""
    assert "## granularity_gemm" in stdout and "vs_bf16" in stdout
