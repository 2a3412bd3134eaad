"""``bench/gpu_check.py --cpu-smoke`` runs every section at tiny sizes and writes its files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_cpu_smoke_writes_json_and_markdown(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--cpu-smoke",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["smoke"] is True
    sections = result["sections"]
    assert set(sections) == {"cuda_tests", "gemm", "quantize", "linear", "bytelm"}
    for name in ("gemm", "quantize", "linear", "bytelm"):
        assert isinstance(sections[name], list) and sections[name], (name, sections[name])
    assert {row["op"] for row in sections["gemm"]} >= {"fp8 cublas", "bf16 mm"}
    assert {row["flag"] for row in sections["bytelm"]} == {"bf16", "fp8_hybrid"}
    assert any(row["compiled"] for row in sections["linear"])
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "## gemm" in markdown and "| op |" in markdown
