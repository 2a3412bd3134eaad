"""Every Python block in the README and in docs/*.md runs as written, one by one and in order.

A block runs on its own, in a fresh process, unless the line right above its fence is
``<!-- continue -->``: then it continues the block before it on the same page, and the
chain runs as one script (the prose says so too, for readers of the rendered page).
``<!-- requires: accelerate -->`` right above a block's fence names the optional packages it
imports (comma-separated import names): without one of them the block is skipped, with the
reason, instead of failing (the frameworks of docs/integrations.md are an optional extra).

What a reader relies on: each sample runs as pasted alone into a fresh interpreter, and a page's
samples pasted into one script (or a notebook), in page order, run too. Each sample runs once:

- A page of several samples runs *in order in one script*, in one namespace
  (``test_page_runs_in_order``): a sample that works alone but not after the page's others (a
  name it assumes unbound, a rank function a later sample redefines, a recompile after an
  earlier sample compiled the same method) fails there. That run needs every optional package
  any of the page's blocks names.
- The same run proves each of its samples runs alone, given that the sample binds every name
  it reads (``test_each_sample_binds_the_names_it_reads``: ruff's F821 on each sample as its own
  file, which also flags a module-level name read before the sample binds it). The first sample
  of a page runs in the fresh process exactly as it would alone. A later one also sees the
  process state the earlier ones left; none sets any outside its functions
  (``test_no_sample_sets_process_state_outside_its_functions``: environment, default dtype and
  device, process groups, warnings filters, dynamo and inductor config, ...). What it could
  still take from them unseen: the global RNG's position (a sample that draws without seeding
  draws other numbers alone; the samples' checks hold for any draw) and modules they imported
  (as the server's preloaded ones are, in every run).
- A sample no page run covers runs alone (``test_sample_runs``): the one sample of a page, and
  each sample of a page whose run is skipped for a missing optional package.

Until 7 Dec every sample also ran alone: each ran twice, and the page runs were half the cost.

Each script is a file in its own temporary folder, run as ``python script.py`` would run it
(``tests/docs_sample_worker.py``), in a fork of a forkserver that imported torch and computectx
once (as the distributed tests' ranks do: milliseconds instead of an interpreter importing
torch, seconds, for each script); the server never ran an op. Samples that start
ranks use ``spawn``: each rank imports the script again as ``__mp_main__``, as it does for a user,
but is a fork of the same server rather than a fresh interpreter (the worker says what that
keeps and what it saves), except in ``test_spawned_ranks_run_as_for_a_user``. A script that has
not finished in ``LIMIT_S`` fails, and it and its ranks are killed.
"""

from __future__ import annotations

import ast
import importlib.util
import multiprocessing
import os
import re
import runpy
import signal
import subprocess
import sys
from collections.abc import Callable
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
RUFF = Path(sys.executable).parent / "ruff"
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


def _installed(modules: tuple[str, ...]) -> bool:
    """Whether every module's top-level package is installed (without importing it)."""
    return all(importlib.util.find_spec(m.split(".")[0]) is not None for m in modules)


def alone(by_page: list[list[Chain]], installed: Callable[[tuple[str, ...]], bool]) -> list[Chain]:
    """The chains no page run covers: a page's only chain, and the chains of a page whose run
    is skipped for a missing optional package."""
    return [
        c
        for chains in by_page
        for c in chains
        if len(chains) == 1 or not installed(in_order(chains).requires)
    ]


# Process-wide state a sample could leave for the page's later samples (names aside): what
# these calls and assignments set outlives the sample (``config.patch(...)`` and
# ``warnings.catch_warnings`` restore what they change).
GLOBAL_SETTERS = re.compile(
    r"^(torch\.(set_default_\w+|set_num_threads|use_deterministic_algorithms|set_float32_\w+)"
    r"|(torch\.)?(dist|distributed)\.init_process_group|os\.(putenv|chdir)"
    r"|os\.environ(\.(update|setdefault|pop|clear))?|sys\.(path|modules)\.\w+"
    r"|warnings\.(simplefilter|filterwarnings)|torch\._(dynamo|inductor)\.config\.(?!patch$)\w+"
    r"|torch\.backends\.[\w.]+)$"
)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    return node.id if isinstance(node, ast.Name) else ""


def top_level_state(code: str) -> list[str]:
    """What ``code`` sets of the process's state outside its functions (calls and assignments
    matching ``GLOBAL_SETTERS``, except warnings filters inside ``warnings.catch_warnings``)."""
    found: list[str] = []
    pending: list[tuple[ast.AST, bool]] = [(node, False) for node in ast.parse(code).body]
    while pending:
        node, caught = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        caught = caught or (
            isinstance(node, ast.With)
            and any(
                isinstance(i.context_expr, ast.Call)
                and _dotted(i.context_expr.func) == "warnings.catch_warnings"
                for i in node.items
            )
        )
        names = [_dotted(t) for t in getattr(node, "targets", [getattr(node, "target", None)]) if t]
        if isinstance(node, ast.Call):
            names.append(_dotted(node.func))
        found += [
            n
            for n in names
            if isinstance(node, ast.Call | ast.Assign | ast.AugAssign | ast.AnnAssign)
            and GLOBAL_SETTERS.match(n)
            and not (caught and n.startswith("warnings."))
        ]
        pending.extend((child, caught) for child in ast.iter_child_nodes(node))
    return found


BY_PAGE = [chains_of(p.read_text(), p.relative_to(ROOT).as_posix()) for p in PAGES]
CHAINS = [c for chains in BY_PAGE for c in chains]
# A page of one script runs in order already.
PAGE_SCRIPTS = [in_order(chains) for chains in BY_PAGE if len(chains) > 1]
ALONE = alone(BY_PAGE, _installed)


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


def test_every_sample_runs_in_its_page_or_alone() -> None:
    a, b, c, d, e = (Chain("p.md", n, f"x{n} = {n}\n") for n in range(5))
    hf = Chain("q.md", 9, "import transformers\n", ("transformers",))
    # One chain: no page run. More: the page run covers them, unless it needs a missing package.
    assert alone([[a], [b, c], [d, hf]], lambda mods: True) == [a]
    assert alone([[a], [b, c], [d, hf], [e]], lambda mods: not mods) == [a, d, hf, e]
    paged = {s.page for s in PAGE_SCRIPTS if _installed(s.requires)}
    assert all(c.page in paged or c in ALONE for c in CHAINS)


def test_no_sample_sets_process_state_outside_its_functions() -> None:
    """A later sample of a page could take such state from an earlier one in the page run and
    fail alone; names are checked below, and this is the rest."""
    assert top_level_state(
        "import os, torch\nos.environ['A'] = '1'\ntorch.set_default_dtype(torch.half)\n"
        "torch._dynamo.config.cache_size_limit = 1\nos.environ.update(B='2')\n"
        "def f():\n    torch.set_num_threads(1)\nos.environ.get('C')\n"
        "with warnings.catch_warnings():\n    warnings.simplefilter('error')\n"
        "    torch.set_default_device('cpu')\n"
        "with torch._dynamo.config.patch(error_on_recompile=True):\n    pass\n"
    ) == [
        "torch.set_default_device",
        "os.environ.update",
        "torch._dynamo.config.cache_size_limit",
        "torch.set_default_dtype",
        "os.environ",
    ]
    setting = {f"{c.page}:{c.first_line}": top_level_state(c.code) for c in CHAINS}
    assert {where: names for where, names in setting.items() if names} == {}


def test_each_sample_binds_the_names_it_reads(tmp_path: Path) -> None:
    """Each chain alone, as its own file, reads no name it does not bind (before reading it, at
    module level): with the page runs, the proof that each runs as pasted alone."""
    for i, chain in enumerate(CHAINS):
        (tmp_path / f"chain_{i}.py").write_text(chain.code)
    lint = subprocess.run(
        [
            str(RUFF),
            "check",
            "--isolated",
            "--no-cache",
            "--select",
            "F821",
            "--output-format",
            "concise",
            ".",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.sub(
        r"^chain_(\d+)\.py:(\d+):\d+:",
        lambda m: f"{CHAINS[int(m[1])].page}:{CHAINS[int(m[1])].first_line}, its line {m[2]}:",
        lint.stdout,
        flags=re.M,
    )
    assert lint.returncode == 0, f"a sample reads a name it does not bind:\n{found}{lint.stderr}"


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


@pytest.mark.parametrize("chain", ALONE, ids=[f"{c.page}:{c.first_line}" for c in ALONE])
def test_sample_runs(chain: Chain, tmp_path: Path) -> None:
    """A chain no page run covers, alone, as a user pastes it."""
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
