"""The project's own contract: lint, strict typing, docs build, and README == CI command."""

from __future__ import annotations

import re
import subprocess
import sys
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


def test_mypy_strict_is_clean() -> None:
    # Configuration (strict, typings/ stubs, files = computectx + tests) is in pyproject.toml.
    res = _run(sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache" / "project"))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    res = _run(str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "design" / "index.html").exists()


def test_users_can_type_check_against_the_installed_package(tmp_path: Path) -> None:
    # A user's own file, outside the repo, checked with the venv the README creates. With
    # setuptools' import-hook editable finder mypy reported "Cannot find implementation or
    # library stub for module named computectx"; a wrong dtype must still be an error.
    (tmp_path / "user.py").write_text(
        "from computectx import ComputeCtx, DType\n"
        "ctx = ComputeCtx.new(DType.BF16, 'cpu')\n"
        "compute: DType = ctx.compute\n"
        "bad: str = ctx.compute\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.stdout.splitlines() == [
        'user.py:4: error: Incompatible types in assignment (expression has type "DType", '
        'variable has type "str")  [assignment]',
        "Found 1 error in 1 file (checked 1 source file)",
    ], res.stdout + res.stderr


def test_triton_is_an_extra_not_a_requirement() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["triton"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["dev"])
