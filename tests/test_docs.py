"""Every Python block in the README and in docs/*.md runs as written.

A block runs on its own, in a fresh process, unless the line right above its fence is
``<!-- continue -->``: then it continues the block before it on the same page, and the
chain runs as one script (the prose says so too, for readers of the rendered page).
``<!-- requires: accelerate -->`` right above a block's fence names the optional packages it
imports (comma-separated import names): without one of them the block is skipped, with the
reason, instead of failing (the frameworks of docs/integrations.md are an optional extra).

Each script runs in a fork of a forkserver that imported torch and computectx once (as the
distributed tests' ranks do: milliseconds instead of an interpreter importing torch, seconds,
for each of the ~40 scripts); the server never ran an op, and the script runs as ``__main__``
in its own temporary folder (``tests/docs_sample_worker.py``).
"""

from __future__ import annotations

import multiprocessing
import re
import runpy
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONTINUE = "<!-- continue -->"
REQUIRES = re.compile(r"^<!-- requires: ([\w., ]+) -->$")
WORKER = Path(__file__).resolve().parent / "docs_sample_worker.py"
LIMIT_S = 300.0
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
            chains.append(Chain(page, last.first_line, last.code + "\n" + match.group(1)))
        else:
            needs = REQUIRES.match(before)
            mods = tuple(m.strip() for m in needs.group(1).split(",")) if needs else ()
            chains.append(Chain(page, line, match.group(1), mods))
    return chains


CHAINS = [c for p in PAGES for c in chains_of(p.read_text(), p.relative_to(ROOT).as_posix())]


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


def test_the_docs_have_samples() -> None:
    pages = {c.page for c in CHAINS}
    assert {"README.md", "docs/guide.md", "docs/fp8.md", "docs/memory.md"} <= pages


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
                "computectx.fp8",
                "torch.distributed.fsdp",
                "computectx.nn",
                "computectx.memory",
            ]
        )
        _FORKSERVER.append(ctx)
    return _FORKSERVER[0]


@pytest.mark.parametrize("chain", CHAINS, ids=[f"{c.page}:{c.first_line}" for c in CHAINS])
def test_sample_runs(chain: Chain, tmp_path: Path) -> None:
    for module in chain.requires:
        pytest.importorskip(module, reason=f"{chain.page} needs {module} (an optional extra)")
    # In a temporary folder, so a sample that writes files leaves nothing in the checkout.
    log = tmp_path / "sample.log"
    proc = _context().Process(
        target=runpy.run_path,
        args=(str(WORKER),),
        kwargs={
            "init_globals": {"SAMPLE_ARGS": (chain.code, str(tmp_path), str(log))},
            "run_name": "__forked__",
        },
    )
    proc.start()
    proc.join(LIMIT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
    out = log.read_text() if log.exists() else "(no output)"
    assert proc.exitcode == 0, f"{chain.page}:{chain.first_line} (exit {proc.exitcode})\n{out}"
