"""The project's own contract: lint, docs build, and README == CI command (strict typing of
the project and of a user's file: tests/test_typing.py, which shares mypy's cache between them)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [ln for ln in ci_lines if ln and not ln.startswith(("#", "set ", "cd "))]
    assert len(commands) == 1, commands
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, flags=re.S)
    assert commands[0] in [b.strip() for b in blocks], commands[0]


def test_ruff_is_clean() -> None:
    lint = _run(str(BIN / "ruff"), "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    res = _run(str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "design" / "index.html").exists()


def test_triton_is_an_extra_not_a_requirement() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["triton"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["dev"])


def test_the_wall_limit_stops_a_block_that_runs_too_long(
    wall_limit: Callable[[float, str], AbstractContextManager[None]],
) -> None:
    expired = pytest.raises(TimeoutError, match=r"sleeper ran past its wall limit of 0\.05 s")
    with expired, wall_limit(0.05, "sleeper"):
        time.sleep(5)
    with wall_limit(5, "quick"):
        pass
    time.sleep(0.1)  # the alarm was cancelled: nothing fires after the block
