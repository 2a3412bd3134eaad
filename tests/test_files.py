"""Durable writes (``computectx._files``): ``save_weights`` and the demo's files.

Modes under the umask and on overwrite, symlinks written through, fsync of the file before
the rename and of the folder after it, a writer killed mid-save, stale temporaries, and bad
paths refused before anything is written.
"""

from __future__ import annotations

import ast
import fcntl
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import computectx._files as files_module
from computectx._files import TEMP_SUFFIX, stale_temporaries
from computectx.memory import save_weights
from computectx.memory import weights as weights_module

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes, flock and fsync")


def net(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def saved_weight(path: Path) -> torch.Tensor:
    return load_file(str(path))["weight"]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(TEMP_SUFFIX))


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("umask")
@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_the_mode_the_umask_gives(tmp_path: Path, mask: int, expected: int) -> None:
    os.umask(mask)
    path = save_weights(net(0), tmp_path / "w.safetensors")
    assert mode_of(path) == expected
    assert temporaries(tmp_path) == []


@pytest.mark.usefixtures("umask")
@pytest.mark.parametrize("mode", [0o640, 0o444])
def test_overwriting_keeps_the_files_mode(tmp_path: Path, mode: int) -> None:
    path = save_weights(net(0), tmp_path / "w.safetensors")
    path.chmod(mode)
    save_weights(net(1), path)
    assert mode_of(path) == mode
    assert torch.equal(saved_weight(path), net(1).weight.detach())


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may give a file to another user")
def test_overwriting_as_root_keeps_the_files_owner_and_group(tmp_path: Path) -> None:
    path = save_weights(net(0), tmp_path / "w.safetensors")
    os.chown(path, 4321, 4322)
    path.chmod(0o4750)  # a mode chown would clear (set-user-ID) is kept too
    save_weights(net(1), path)
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4321, 4322, 0o4750)


def test_saving_through_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "w.safetensors"
    save_weights(net(0), target)
    link = tmp_path / "latest.safetensors"
    link.symlink_to(target)
    chain = tmp_path / "chain.safetensors"  # a link to a link
    chain.symlink_to(link)
    assert save_weights(net(1), link) == link
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert torch.equal(saved_weight(target), net(1).weight.detach())
    save_weights(net(2), chain)
    assert chain.is_symlink() and link.is_symlink()
    assert torch.equal(saved_weight(target), net(2).weight.detach())
    # A dangling link gets its target created.
    dangling = tmp_path / "next.safetensors"
    dangling.symlink_to(tmp_path / "store" / "next.safetensors")
    save_weights(net(3), dangling)
    assert dangling.is_symlink()
    assert torch.equal(saved_weight(tmp_path / "store" / "next.safetensors"), net(3).weight)
    assert temporaries(tmp_path) == temporaries(tmp_path / "store") == []


def _record_commit(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record os.fsync (as the file or folder synced) and os.replace calls, in order."""
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        st = os.fstat(fd)
        kind = "folder" if stat.S_ISDIR(st.st_mode) else "file"
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else "?"
        events.append((f"fsync {kind}", name))
        fsync(fd)

    def recording_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", f"{os.fspath(src)} -> {os.fspath(dst)}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    return events


def _check_commit(events: list[tuple[str, str]], target: Path) -> None:
    """Exactly: fsync of the temporary, its rename over ``target``, fsync of the folder."""
    real = target.resolve()
    assert [e[0] for e in events] == ["fsync file", "replace", "fsync folder"], events
    tmp = events[0][1]
    if tmp != "?":
        assert Path(tmp).parent == real.parent and Path(tmp).name.endswith(TEMP_SUFFIX)
        assert events[1][1] == f"{tmp} -> {real}"
        assert events[2][1] == str(real.parent)


def test_the_file_is_fsynced_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _record_commit(monkeypatch)
    path = save_weights(net(0), tmp_path / "w.safetensors")
    _check_commit(events, path)
    events.clear()
    save_weights(net(1), path)  # an overwrite commits the same way
    _check_commit(events, path)


# A writer that starts a save through the helper, writes part of the file and is killed.
_KILLED_WRITER = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("files", sys.argv[1])
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
with files.atomic_path(sys.argv[2], what="weights") as tmp:
    with open(tmp, "wb") as f:
        f.write(b"half a checkpoint")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _kill_a_writer_of(path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, files_module.__file__, str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == -signal.SIGKILL, res.stderr


def test_a_writer_that_fails_or_is_killed_mid_save_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_weights(net(0), tmp_path / "w.safetensors")
    # Failing mid-write: nothing is committed and the temporary goes.
    with monkeypatch.context() as patch:
        events = _record_commit(patch)

        def half_then_fail(tensors: object, filename: str, metadata: object = None) -> None:
            Path(filename).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
            raise KeyboardInterrupt

        patch.setattr(weights_module, "save_file", half_then_fail)
        with pytest.raises(KeyboardInterrupt):
            save_weights(net(1), path)
        assert events == []  # nothing fsynced, nothing renamed
        assert torch.equal(saved_weight(path), net(0).weight.detach())
        assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]

    # Killed mid-write: the temporary stays, and the next save to the path removes it.
    # Files the cleanup must leave: other paths' temporaries, look-alikes, other files.
    others = [
        f".other.safetensors.{'0' * 16}{TEMP_SUFFIX}",  # another path's temporary
        f".w.safetensors.{'0' * 15}{TEMP_SUFFIX}",  # not the pattern (15 digits)
        f".w.safetensors.{'0' * 16}{TEMP_SUFFIX}.keep",
        f".w.safetensors.x.{'0' * 16}{TEMP_SUFFIX}",  # the temporary of w.safetensors.x
        "w.safetensors.abcd1234.tmp",
        "notes.txt",
    ]
    for name in others:
        (tmp_path / name).write_text("keep me")
    _kill_a_writer_of(path)
    left = stale_temporaries(path)
    assert len(left) == 1 and left[0].read_bytes() == b"half a checkpoint"
    assert torch.equal(saved_weight(path), net(0).weight.detach())  # the old file, whole

    save_weights(net(1), path)
    assert not left[0].exists()
    assert torch.equal(saved_weight(path), net(1).weight.detach())
    assert all((tmp_path / name).read_text() == "keep me" for name in others)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "w.safetensors"])


def test_a_live_writers_temporary_is_kept(tmp_path: Path) -> None:
    path = save_weights(net(0), tmp_path / "w.safetensors")
    live = tmp_path / f".w.safetensors.{'ab' * 8}{TEMP_SUFFIX}"
    live.write_bytes(b"being written")
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # as the writer holds it
        save_weights(net(1), path)
        assert live.exists()
    save_weights(net(2), path)  # the writer is gone: its temporary is stale now
    assert not live.exists()
    assert torch.equal(saved_weight(path), net(2).weight.detach())


def test_names_at_the_filesystems_limit_save_and_keep_their_temporaries_apart(
    tmp_path: Path,
) -> None:
    # Two names of the longest length the folder takes, alike for their first 240 bytes.
    stem = "w" * (os.pathconf(tmp_path, "PC_NAME_MAX") - len("ab.safetensors"))
    path, sibling = tmp_path / f"{stem}ab.safetensors", tmp_path / f"{stem}ac.safetensors"
    for p in (path, sibling):
        save_weights(net(0), p)
        _kill_a_writer_of(p)
    [stale], [sibling_stale] = stale_temporaries(path), stale_temporaries(sibling)
    assert stale != sibling_stale
    save_weights(net(1), path)
    assert torch.equal(saved_weight(path), net(1).weight.detach())
    assert not stale.exists() and sibling_stale.exists()
    assert temporaries(tmp_path) == [sibling_stale.name]


def test_bad_paths_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    a_file = tmp_path / "taken.txt"
    a_file.write_text("x")
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    cases: list[tuple[str | Path, type[Exception], str]] = [
        ("", ValueError, "the path is empty"),
        (tmp_path, IsADirectoryError, "the path is a folder"),
        (f"{tmp_path / 'new'}{os.sep}", IsADirectoryError, "the path names a folder"),
        (tmp_path / "missing" / "w.safetensors", FileNotFoundError, "no such directory"),
        (a_file / "w.safetensors", NotADirectoryError, "is not a folder"),
        (loop, ValueError, "symlink loop"),
        ("/dev/null", ValueError, "not a regular file"),
        ("w\0.safetensors", ValueError, "NUL"),
    ]
    before = sorted(tmp_path.iterdir())
    for path, error, why in cases:
        with pytest.raises(error) as info:
            save_weights(net(0), path)
        message = str(info.value)
        assert why in message and repr(os.fspath(path)) in message, message
        assert "accepted: a new or existing regular file" in message, message
        assert sorted(tmp_path.iterdir()) == before, path
    assert a_file.read_text() == "x"
    with pytest.raises(TypeError, match=r"str or os\.PathLike, got int"):
        save_weights(net(0), 3)  # type: ignore[arg-type]


def test_the_demos_files_are_durable_and_a_failed_plot_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from computectx.demo import Corpus, DemoReport, DemoSettings, Footprint, PolicyResult
    from computectx.demo.report import plot_losses, write_results

    result = PolicyResult(
        flag="fp32", policy="fp32", gemm="native", train_losses=[3.0, 2.5, 2.0],
        val_curve=[(3, 2.1)], train_loss=2.0, val_loss=2.1, tokens_per_s=1000.0, seconds=1.0,
        memory=Footprint(params=1, grads=1, accumulator=0, master=0, optimizer=2, saved=None),
        skipped_steps=0, fp8_converted=0, fp8_backend=None, fp8_nonfinite=None,
        fp8_saturated=None, fp8_layers={}, sample="",
    )  # fmt: skip
    corpus = Corpus(name="t", source="t", files=1, train=torch.zeros(8), val=torch.zeros(8))
    kept = tmp_path / "kept"
    kept.mkdir()
    report = DemoReport(
        settings=DemoSettings(steps=3), device=torch.device("cpu"), corpus=corpus,
        fp8_backend=None, fp8_reason=None, half_gemm=None, results=[result],
        json_path=tmp_path / "results.json", plot_path=tmp_path / "loss.png",
    )  # fmt: skip
    # results.json is a symlink into another folder, loss.png a group-readable file.
    (kept / "results.json").write_text("{}")
    report.json_path.symlink_to(kept / "results.json")
    report.plot_path.write_bytes(b"old plot")
    report.plot_path.chmod(0o640)

    events = _record_commit(monkeypatch)
    write_results(report)
    _check_commit(events, report.json_path)
    assert report.json_path.is_symlink()
    assert '"computectx_demo"' in (kept / "results.json").read_text()
    events.clear()
    plot_losses(report)
    _check_commit(events, report.plot_path)
    assert report.plot_path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert mode_of(report.plot_path) == 0o640
    png = report.plot_path.read_bytes()

    print_png: Callable[[FigureCanvasAgg, object], None] = FigureCanvasAgg.print_png

    def half_then_fail(self: FigureCanvasAgg, filename: object, **kwargs: object) -> None:
        if not isinstance(filename, (str, os.PathLike)):  # matplotlib's dry run to a buffer
            print_png(self, filename)
            return
        with open(filename, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(FigureCanvasAgg, "print_png", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        plot_losses(report)
    assert report.plot_path.read_bytes() == png
    assert temporaries(tmp_path) == temporaries(kept) == []


# Calls that write a file, by the called name; each must write into a temporary that
# ``atomic_path`` gave (one of its arguments is the name `with atomic_path(...) as name` bound).
_WRITERS = {"write_text", "write_bytes", "savefig", "save_file", "mkstemp", "NamedTemporaryFile"}
_MODULE_WRITERS = {("torch", "save"), ("os", "replace"), ("os", "rename"), ("shutil", "copy")}
_PROBES = {
    ("demo/run.py", "NamedTemporaryFile"),  # the --out folder's writability probe
    # The native kernel's build cache. ``computectx.kernels`` may not import computectx._files
    # (tests/test_layering.py), so host_adam.py writes on its own, the same way: the library
    # and its sha256 sidecar each into a ``mkstemp`` temporary in the cache folder, fsynced,
    # ``os.replace``d into place, the folder fsynced; the sidecar written after the library,
    # and a library loaded only when its sidecar matches (tests/memory/optim/test_native.py).
    # ``open``: the build's lock file, which holds no data.
    ("kernels/host_adam.py", "mkstemp"),
    ("kernels/host_adam.py", "write_text"),
    ("kernels/host_adam.py", "replace"),
    ("kernels/host_adam.py", "open"),
}


def _raw_writes(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    temporaries = {
        item.optional_vars.id
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        for item in node.items
        if isinstance(item.context_expr, ast.Call)
        and isinstance(item.context_expr.func, ast.Name)
        and item.context_expr.func.id in ("atomic_path", "atomic_directory")
        and isinstance(item.optional_vars, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        given = node.args[1:2] if isinstance(f, ast.Name) else node.args[:1]  # open / Path.open
        mode = [*given, *(k.value for k in node.keywords if k.arg == "mode")]
        writes = (
            name in _WRITERS
            or (owner, name) in _MODULE_WRITERS
            or (
                name == "open"
                and any(
                    isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in mode
                )
            )
        )
        args = [*node.args, *(k.value for k in node.keywords)]
        if isinstance(
            f, ast.Attribute
        ):  # (folder / name).write_text(...): the path it is called on
            args.append(f.value)
        # A path in an atomic_directory's folder: ``folder / name``.
        args += [a.left for a in list(args) if isinstance(a, ast.BinOp)]
        if writes and not any(isinstance(a, ast.Name) and a.id in temporaries for a in args):
            found.append((node.lineno, name))
    return found


def test_every_file_the_package_writes_goes_through_atomic_path() -> None:
    package = Path(files_module.__file__).parent
    raw = [
        f"{rel}:{line} {name}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "_files.py"
        for rel in [path.relative_to(package).as_posix()]
        for line, name in _raw_writes(path.read_text())
        if (rel, name) not in _PROBES
    ]
    assert raw == []
    # The check itself finds each kind of raw write.
    writes = "p.write_text('x')\nopen(p, 'wb')\np.open(mode='a')\ntorch.save(x, p)"
    assert [n for _, n in _raw_writes(writes)] == ["write_text", "open", "open", "save"]
    assert _raw_writes("with atomic_path(p, what='x') as tmp:\n    torch.save(x, tmp)") == []
    inside = (
        "with atomic_directory(p) as d:\n    save_file(x, d / 'a')\n    (d / 'b').write_text('x')"
    )
    assert _raw_writes(inside) == []
    assert [n for _, n in _raw_writes("save_file(x, p / 'a')\n(p / 'b').write_text('x')")] == [
        "save_file",
        "write_text",
    ]
    reads = "open('/proc/meminfo')\nopen(p, 'rb')\np.open('rb')\n'a'.replace('a', 'b')"
    assert _raw_writes(reads) == []


def test_a_folder_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.txt").write_text("old")

    def half_written() -> None:
        with files_module.atomic_directory(target) as d:
            (d / "a.txt").write_text("new")
            raise RuntimeError("midway")

    with pytest.raises(RuntimeError, match="midway"):
        half_written()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"]
    with files_module.atomic_directory(target) as d:
        (d / "a.txt").write_text("new")
        assert not (target / "a.txt").exists()  # nothing shows before the commit
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in target.iterdir()) == ["a.txt"]


def test_a_folder_is_written_through_a_symlink_and_the_link_stays(tmp_path: Path) -> None:
    # As atomic_path writes a file: the folder the link resolves to is replaced, the link
    # stays a link, and no temporary is left beside either, on success or on failure.
    real, links = tmp_path / "real", tmp_path / "links"
    real.mkdir()
    links.mkdir()
    (real / "old.txt").write_text("old")
    link = links / "ckpt"
    link.symlink_to(real)

    def half_written() -> None:
        with files_module.atomic_directory(link) as d:
            (d / "a.txt").write_text("new")
            raise RuntimeError("midway")

    with pytest.raises(RuntimeError, match="midway"):
        half_written()
    assert link.is_symlink() and sorted(p.name for p in real.iterdir()) == ["old.txt"]
    with files_module.atomic_directory(link) as d:
        (d / "a.txt").write_text("new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in real.iterdir()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["links", "real"]
    assert [p.name for p in links.iterdir()] == ["ckpt"]
