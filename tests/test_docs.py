"""Every Python block in the README and in docs/*.md runs as written, one by one and in order.

A block runs on its own, in a fresh process, unless the line right above its fence is
``<!-- continue -->``: then it continues the block before it on the same page, and the
chain runs as one script (the prose says so too, for readers of the rendered page).
``<!-- requires: accelerate -->`` right above a block's fence names the optional packages it
imports (comma-separated import names): without one of them the block is skipped, with the
reason, instead of failing (the frameworks of docs/integrations.md are an optional extra).

Each page's blocks also run *in order in one script*, in one namespace, as a user pastes a
page's recipes into one file or a notebook: a sample that works alone but not after the page's
others (a name it assumes unbound, a fork after torch started its thread pools) fails there.
That run needs every optional package any of the page's blocks names.

Each script is a file in its own temporary folder, run as ``python script.py`` would run it
(``tests/docs_sample_worker.py``), in a fork of a forkserver that imported torch and computectx
once (as the distributed tests' ranks do: milliseconds instead of an interpreter importing
torch, seconds, for each of the ~50 scripts); the server never ran an op. Samples that start
ranks use ``spawn``: each rank imports the script again as ``__mp_main__``, as it does for a user,
but is a fork of the same server rather than a fresh interpreter (the worker says what that
keeps and what it saves), except in ``test_spawned_ranks_run_as_for_a_user``. A script that has
not finished in ``LIMIT_S`` fails, and it and its ranks are killed.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import runpy
import signal
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONTINUE = "<!-- continue -->"
REQUIRES = re.compile(r"^<!-- requires: ([\w., ]+) -->$")
WORKER = Path(__file__).resolve().parent / "docs_sample_worker.py"
LIMIT_S = 240.0
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)


@dataclass(frozen=True)
class Chain:
    """One runnable script: a block and every block that continues it."""

    page: str
    first_line: int
    code: str
    requires: tuple[str, ...] = ()


def chains_of(text: str, page: str) -> list[Chain]:
    """The runnable scripts of one markdown page, in page order."""
    chains: list[Chain] = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start()) + 1
        if before == CONTINUE:
            if not chains or chains[-1].page != page:
                raise ValueError(f"{page}:{line}: {CONTINUE} above the page's first block")
            last = chains.pop()
            code = last.code + "\n" + match.group(1)
            chains.append(Chain(page, last.first_line, code, last.requires))
        else:
            needs = REQUIRES.match(before)
            mods = tuple(m.strip() for m in needs.group(1).split(",")) if needs else ()
            chains.append(Chain(page, line, match.group(1), mods))
    return chains


def in_order(chains: list[Chain]) -> Chain:
    """One page's chains as one script, in page order, as a user pastes them into one file."""
    requires = tuple(dict.fromkeys(m for c in chains for m in c.requires))
    return Chain(chains[0].page, chains[0].first_line, "\n".join(c.code for c in chains), requires)


BY_PAGE = [chains_of(p.read_text(), p.relative_to(ROOT).as_posix()) for p in PAGES]
CHAINS = [c for chains in BY_PAGE for c in chains]
# A page of one script runs in order already.
PAGE_SCRIPTS = [in_order(chains) for chains in BY_PAGE if len(chains) > 1]


def test_chains_split_and_continue() -> None:
    text = (
        "intro\n```python\na = 1\n```\nprose\n<!-- continue -->\n```python\nb = a\n```\n"
        "```bash\nnot python\n```\n```python\nc = 3\n```\n"
    )
    assert chains_of(text, "p.md") == [
        Chain("p.md", 2, "a = 1\n\nb = a\n"),
        Chain("p.md", 13, "c = 3\n"),
    ]
    with pytest.raises(ValueError, match="first block"):
        chains_of("<!-- continue -->\n```python\nx = 1\n```\n", "p.md")
    needing = "<!-- requires: accelerate, lightning.fabric -->\n```python\nimport accelerate\n```\n"
    assert chains_of(needing, "p.md") == [
        Chain("p.md", 2, "import accelerate\n", ("accelerate", "lightning.fabric"))
    ]
    # A continued block keeps what its chain requires; the page's script needs every chain's.
    page = (
        needing
        + "<!-- continue -->\n```python\nb = 2\n```\n<!-- requires: x -->\n```python\nc = 3\n```\n"
    )
    chains = chains_of(page, "p.md")
    assert [c.requires for c in chains] == [("accelerate", "lightning.fabric"), ("x",)]
    assert in_order(chains) == Chain(
        "p.md", 2, "import accelerate\n\nb = 2\n\nc = 3\n", ("accelerate", "lightning.fabric", "x")
    )


def test_the_docs_have_samples() -> None:
    pages = {c.page for c in CHAINS}
    assert {"README.md", "docs/guide.md", "docs/fp8.md", "docs/memory.md"} <= pages
    assert {s.page for s in PAGE_SCRIPTS} >= {"README.md", "docs/moe.md", "docs/distributed.md"}


_FORKSERVER: list[ForkServerContext] = []


def _context() -> ForkServerContext:
    # The process's one forkserver (tests/distributed/conftest.py may have started it with
    # its own preload list, which these modules then extend as each script imports them).
    if not _FORKSERVER:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "computectx.distributed",
                "computectx.formats",
                "torch.distributed.fsdp",
                "computectx.nn",
                "computectx.memory",
            ]
        )
        _FORKSERVER.append(ctx)
    return _FORKSERVER[0]


def _server() -> str:
    """The address of the forkserver (started now if it is not yet running)."""
    _context()
    forkserver.ensure_running()
    address: str = forkserver._forkserver._forkserver_address  # type: ignore[attr-defined]
    return address


def _kill_in(folder: Path) -> None:
    """Kill the processes working in ``folder``: a hung script and the ranks it started."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and Path(os.readlink(entry / "cwd")) == folder.resolve():
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # gone already
            pass


def _run(script: Chain, name: str, tmp_path: Path, *, real_spawn: bool = False) -> None:
    for module in script.requires:
        pytest.importorskip(module, reason=f"{script.page} needs {module} (an optional extra)")
    # A file in a temporary folder: spawned ranks import it again, and a sample that writes
    # files leaves nothing in the checkout.
    path = tmp_path / f"{name}.py"
    path.write_text(script.code)
    log = tmp_path / f"{name}.log"
    server = None if real_spawn else _server()
    proc = _context().Process(
        target=runpy.run_path,
        args=(str(WORKER),),
        kwargs={
            "init_globals": {"SAMPLE_ARGS": (str(path), str(log), server)},
            "run_name": "__forked__",
        },
    )
    proc.start()
    proc.join(LIMIT_S)
    hung = proc.is_alive()
    if hung:
        _kill_in(tmp_path)
        proc.join()
    out = log.read_text() if log.exists() else "(no output)"
    where = f"{script.page}:{script.first_line}"
    assert not hung, f"{where} ({name}) did not finish in {LIMIT_S:.0f} s: a hang?\n{out}"
    assert proc.exitcode == 0, f"{where} ({name}, exit {proc.exitcode})\n{out}"


@pytest.mark.parametrize("chain", CHAINS, ids=[f"{c.page}:{c.first_line}" for c in CHAINS])
def test_sample_runs(chain: Chain, tmp_path: Path) -> None:
    _run(chain, "sample", tmp_path)


@pytest.mark.parametrize("script", PAGE_SCRIPTS, ids=[s.page for s in PAGE_SCRIPTS])
def test_page_runs_in_order(script: Chain, tmp_path: Path) -> None:
    """The page's samples pasted into one script, in page order, one namespace."""
    _run(script, "page", tmp_path)


def test_spawned_ranks_run_as_for_a_user(tmp_path: Path) -> None:
    """Once with ranks that are fresh interpreters, as ``spawn`` starts them for a user (the
    other runs fork them from the test's forkserver, which has torch imported already)."""
    launch = next(
        c for c in CHAINS if c.page == "docs/distributed.md" and "scaling_stats" in c.code
    )
    assert "mp.spawn(" in launch.code
    _run(launch, "spawned", tmp_path, real_spawn=True)
