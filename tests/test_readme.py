"""Every Python sample in the README runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_samples() -> None:
    assert len(SAMPLES) >= 2


@pytest.mark.parametrize("code", SAMPLES, ids=[f"sample{i}" for i in range(len(SAMPLES))])
def test_readme_sample_runs(code: str) -> None:
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
