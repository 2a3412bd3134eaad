"""Typing tests in the numpy style: pass/ must type-check and run, fail/ must be rejected on
exactly the marked lines, reveal/ must infer the marked types — with and without pydantic's
mypy plugin, since users check their code either way. The project itself must check cleanly
under ``mypy --strict`` (pyproject.toml's configuration), and so must a user's file outside the
repository against the installed package.

mypy spends nearly all its time on torch's own modules. One cold run builds the project's
cache; the plain typing cases and the user's file then reuse it (about 2 s and 20 s instead of
a cold run each), while the pydantic-plugin run, whose plugin invalidates any other cache, runs
cold beside the project's. All of it is one test so that xdist cannot split the runs across
workers (each would then redo the cold runs); its failures are listed together.
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
CONFIGS = {
    "plain": "",
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


def _mypy(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mypy", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out = proc.communicate()[0]
    return proc.returncode, out


def _typing_args(tmp: Path, name: str, cache: Path) -> list[str]:
    cfg = tmp / f"{name}.ini"
    cfg.write_text(
        "[mypy]\nstrict = True\nwarn_unused_ignores = True\n"
        f"mypy_path = {ROOT / 'typings'}\n{CONFIGS[name]}"
    )
    return ["--config-file", str(cfg), "--cache-dir", str(cache), *_FLAGS, str(DATA)]


def run_all(tmp: Path) -> dict[str, tuple[int, str]]:
    """Every mypy run of the suite, as ``name -> (exit code, output)``: ``project``,
    ``plain`` and ``pydantic-plugin`` (tests/typing), ``user`` (a file outside the repo)."""
    project_cache = ROOT / ".mypy_cache" / "project"
    # Cold, side by side: the project (pyproject.toml's configuration) and the plugin run.
    first = {
        "project": _mypy(["--cache-dir", str(project_cache)], ROOT),
        "pydantic-plugin": _mypy(
            _typing_args(tmp, "pydantic-plugin", ROOT / ".mypy_cache" / "typing-pydantic-plugin"),
            ROOT,
        ),
    }
    outs = {name: _finish(p) for name, p in first.items()}
    # Warm, from the project's cache (the same per-module options for everything they share).
    user = tmp / "user"
    user.mkdir()
    (user / "user.py").write_text(USER_FILE)
    second = {
        "plain": _mypy(_typing_args(tmp, "plain", project_cache), ROOT),
        "user": _mypy(["--strict", "--cache-dir", str(project_cache), "user.py"], user),
    }
    outs.update({name: _finish(p) for name, p in second.items()})
    return outs


def _parse(output: str) -> tuple[dict[tuple[str, int], set[str]], dict[tuple[str, int], str]]:
    errors: dict[tuple[str, int], set[str]] = defaultdict(set)
    reveals: dict[tuple[str, int], str] = {}
    for raw in output.splitlines():
        m = _LINE.match(raw)
        if m is None:
            continue
        key = (str(Path(m["file"]).resolve()), int(m["line"]))
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


def test_mypy_strict_project_typing_cases_and_a_users_file(tmp_path: Path) -> None:
    outs = run_all(tmp_path)
    failures: list[str] = []
    code, out = outs["project"]
    if code != 0:
        failures.append(f"mypy --strict on the project (pyproject.toml) exited {code}:\n{out}")
    for config in sorted(CONFIGS):
        for check in CASE_CHECKS:
            try:
                check(outs[config][1])
            except AssertionError as e:
                failures.append(f"{check.__name__} [{config}]: {e}\n{outs[config][1]}")
    # A user's own file, outside the repo, checked with the venv the README creates. With
    # setuptools' import-hook editable finder mypy reported "Cannot find implementation or
    # library stub for module named computectx"; a wrong dtype must still be an error.
    if outs["user"][1].splitlines() != USER_EXPECTED:
        failures.append(f"a user's file outside the repo:\n{outs['user'][1]}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("path", sorted((DATA / "pass").glob("*.py")), ids=lambda p: p.name)
def test_pass_cases_run(path: Path) -> None:
    runpy.run_path(str(path), run_name="__main__")
