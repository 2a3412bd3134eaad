"""Typing tests in the numpy style: pass/ must type-check and run, fail/ must be rejected on
exactly the marked lines, reveal/ must infer the marked types — with and without pydantic's
mypy plugin, since users check their code either way."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from collections import defaultdict
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


def _run_mypy(tmp: Path) -> dict[str, str]:
    """Run mypy over tests/typing once per config, in parallel; return each one's output."""
    procs = {}
    for name, extra in CONFIGS.items():
        cfg = tmp / f"{name}.ini"
        cfg.write_text(
            "[mypy]\nstrict = True\nwarn_unused_ignores = True\n"
            f"mypy_path = {ROOT / 'typings'}\n{extra}"
        )
        cmd = [
            sys.executable, "-m", "mypy", "--config-file", str(cfg),
            "--cache-dir", str(ROOT / ".mypy_cache" / f"typing-{name}"),
            "--no-error-summary", "--hide-error-context", "--show-error-codes",
            "--show-absolute-path", str(DATA),
        ]  # fmt: skip
        procs[name] = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return {name: p.communicate()[0] for name, p in procs.items()}


@pytest.fixture(scope="module")
def mypy_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _run_mypy(tmp_path_factory.mktemp("mypy"))


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


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fail_cases_are_rejected_on_exactly_the_marked_lines(
    mypy_outputs: dict[str, str], config: str
) -> None:
    errors, _ = _parse(mypy_outputs[config])
    expected = {k: set(v.split()) for k, v in _expected("fail", "E").items()}
    assert expected, "no fail cases found"
    got = {k: v for k, v in errors.items() if "/fail/" in k[0]}
    assert got == expected, mypy_outputs[config]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_reveal_cases_infer_the_marked_types(mypy_outputs: dict[str, str], config: str) -> None:
    errors, reveals = _parse(mypy_outputs[config])
    expected = _expected("reveal", "R")
    assert expected, "no reveal cases found"
    got = {k: v for k, v in reveals.items() if "/reveal/" in k[0]}
    assert got == expected, mypy_outputs[config]
    assert not [k for k in errors if "/reveal/" in k[0]], mypy_outputs[config]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_pass_cases_type_check_cleanly(mypy_outputs: dict[str, str], config: str) -> None:
    errors, _ = _parse(mypy_outputs[config])
    assert not [k for k in errors if "/pass/" in k[0]], mypy_outputs[config]
    # The library itself checks cleanly under both configurations too.
    assert not [k for k in errors if "/computectx/" in k[0]], mypy_outputs[config]


@pytest.mark.parametrize("path", sorted((DATA / "pass").glob("*.py")), ids=lambda p: p.name)
def test_pass_cases_run(path: Path) -> None:
    runpy.run_path(str(path), run_name="__main__")
