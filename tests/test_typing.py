"""Typing tests in the numpy style: pass/ must type-check and run, fail/ must be rejected on
exactly the marked lines, reveal/ must infer the marked types — with and without pydantic's
mypy plugin, since users check their code either way. The project itself must check cleanly
under ``mypy --strict`` (pyproject.toml's configuration), and so must a user's file outside the
repository against the installed package.

mypy spends nearly all its time on torch's own modules, and a module's cache entry holds only
for the same options, plugins and imports. Two chains, one test each, so that xdist's two
workers can run them side by side, each from one cold run:

- the project (cold, pyproject.toml), then the typing cases without the plugin from its cache
  (the same options, and ``typings/`` on the path as pyproject.toml puts it);
- the typing cases with the plugin (cold), then a user's file with that same configuration
  from its cache. Neither puts ``typings/`` on the path: a user has no such folder, and torch
  checked against the typings' triton is not the torch checked against the untyped installed
  one (the user's file re-checked torch for that, 19 CPU-s).
"""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "typing"
CACHE = ROOT / ".mypy_cache"
CONFIGS = {
    "plain": f"mypy_path = {ROOT / 'typings'}\n",
    "pydantic-plugin": "plugins = pydantic.mypy\n",
}
_LINE = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): (?P<kind>error|note): (?P<msg>.*)$")
_CODE = re.compile(r"\[(?P<code>[a-z-]+)\]$")
_FLAGS = [
    "--no-error-summary",
    "--hide-error-context",
    "--show-error-codes",
    "--show-absolute-path",
]
USER_FILE = (
    "from computectx import ComputeCtx, DType\n"
    "ctx = ComputeCtx.new(DType.BF16, 'cpu')\n"
    "compute: DType = ctx.compute\n"
    "bad: str = ctx.compute\n"
)
USER_EXPECTED = [
    'user.py:4: error: Incompatible types in assignment (expression has type "DType", '
    'variable has type "str")  [assignment]',
    "Found 1 error in 1 file (checked 1 source file)",
]


def _mypy(args: list[str], cwd: Path) -> tuple[int, str]:
    res = subprocess.run(
        [sys.executable, "-m", "mypy", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    return res.returncode, res.stdout


def _config(tmp: Path, name: str) -> Path:
    cfg = tmp / f"{name}.ini"
    cfg.write_text(f"[mypy]\nstrict = True\nwarn_unused_ignores = True\n{CONFIGS[name]}")
    return cfg


def _cases(cfg: Path, cache: Path) -> tuple[int, str]:
    return _mypy(["--config-file", str(cfg), "--cache-dir", str(cache), *_FLAGS, str(DATA)], ROOT)


def _parse(output: str) -> tuple[dict[tuple[str, int], set[str]], dict[tuple[str, int], str]]:
    errors: dict[tuple[str, int], set[str]] = defaultdict(set)
    reveals: dict[tuple[str, int], str] = {}
    for raw in output.splitlines():
        m = _LINE.match(raw)
        if m is None:
            continue
        # Relative to mypy's working directory (mypy may print a path relative to it).
        key = (str((ROOT / m["file"]).resolve()), int(m["line"]))
        if m["kind"] == "error":
            code = _CODE.search(m["msg"])
            errors[key].add(code["code"] if code else "?")
        elif m["msg"].startswith("Revealed type is "):
            reveals[key] = m["msg"].removeprefix("Revealed type is ").strip('"')
    return errors, reveals


def _expected(kind: str, marker: str) -> dict[tuple[str, int], str]:
    out = {}
    for path in sorted((DATA / kind).glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if f"# {marker}: " in line:
                out[(str(path.resolve()), n)] = line.split(f"# {marker}: ", 1)[1].strip()
    return out


def fail_cases_are_rejected_on_exactly_the_marked_lines(output: str) -> None:
    errors, _ = _parse(output)
    expected = {k: set(v.split()) for k, v in _expected("fail", "E").items()}
    assert expected, "no fail cases found"
    got = {k: v for k, v in errors.items() if "/fail/" in k[0]}
    assert got == expected


def reveal_cases_infer_the_marked_types(output: str) -> None:
    errors, reveals = _parse(output)
    expected = _expected("reveal", "R")
    assert expected, "no reveal cases found"
    got = {k: v for k, v in reveals.items() if "/reveal/" in k[0]}
    assert got == expected
    assert not [k for k in errors if "/reveal/" in k[0]]


def pass_cases_type_check_cleanly(output: str) -> None:
    errors, _ = _parse(output)
    assert not [k for k in errors if "/pass/" in k[0]]
    # The library itself checks cleanly under both configurations too.
    assert not [k for k in errors if "/computectx/" in k[0]]


CASE_CHECKS: list[Callable[[str], None]] = [
    fail_cases_are_rejected_on_exactly_the_marked_lines,
    reveal_cases_infer_the_marked_types,
    pass_cases_type_check_cleanly,
]


def _case_failures(config: str, output: str) -> list[str]:
    failures = []
    for check in CASE_CHECKS:
        try:
            check(output)
        except AssertionError as e:
            failures.append(f"{check.__name__} [{config}]: {e}\n{output}")
    return failures


@pytest.mark.slow
def test_mypy_strict_project_and_the_typing_cases_without_the_plugin(tmp_path: Path) -> None:
    cache = CACHE / "project"
    code, out = _mypy(["--cache-dir", str(cache)], ROOT)
    failures = []
    if code != 0:
        failures.append(f"mypy --strict on the project (pyproject.toml) exited {code}:\n{out}")
    # Warm, from the project's cache (the same per-module options for everything they share).
    failures += _case_failures("plain", _cases(_config(tmp_path, "plain"), cache)[1])
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_typing_cases_with_the_pydantic_plugin_and_a_users_file(tmp_path: Path) -> None:
    cache = CACHE / "typing-pydantic-plugin"
    cfg = _config(tmp_path, "pydantic-plugin")
    failures = _case_failures("pydantic-plugin", _cases(cfg, cache)[1])
    # A user's own file, outside the repo, checked with the venv the README creates (and the
    # plugin's configuration, warm from the cases' cache). With setuptools' import-hook editable
    # finder mypy reported "Cannot find implementation or library stub for module named
    # computectx"; a wrong dtype must still be an error.
    user = tmp_path / "user"
    user.mkdir()
    (user / "user.py").write_text(USER_FILE)
    out = _mypy(["--config-file", str(cfg), "--cache-dir", str(cache), "user.py"], user)[1]
    if out.splitlines() != USER_EXPECTED:
        failures.append(f"a user's file outside the repo:\n{out}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("path", sorted((DATA / "pass").glob("*.py")), ids=lambda p: p.name)
def test_pass_cases_run(path: Path) -> None:
    runpy.run_path(str(path), run_name="__main__")
