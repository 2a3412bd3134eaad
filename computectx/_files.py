"""Durable file writes: every file the package writes goes through ``atomic_path``.

A write goes to a temporary in the target's folder, named ``.<name>.<16 hex>.computectx-tmp``
(a name too long for that is cut and followed by a hash of it) and held under an exclusive
``flock`` while it is written. Then the temporary gets its final mode (a new file: what the
umask gives; an overwritten file: the mode, and where allowed the owner and group, it had), is
``fsync``-ed, renamed over the target with ``os.replace`` and the folder is ``fsync``-ed. A
crash leaves the old file or the new one, never part of one. A writer killed mid-save leaves
its temporary; the next write to the same path removes the temporaries of that path's pattern
whose lock no live writer holds, and nothing else. A symlink is written through: its target is
replaced, the link stays. (POSIX: ``flock`` and a folder's ``fsync``.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

if sys.platform != "win32":
    import fcntl

__all__ = [
    "TEMP_SUFFIX",
    "atomic_directory",
    "atomic_path",
    "stale_temporaries",
    "target_of",
    "write_file",
]

TEMP_SUFFIX = ".computectx-tmp"
"""The last part of every temporary's name: ``.<name>.<16 hex digits>.computectx-tmp``."""

_ACCEPTED = "accepted: a new or existing regular file, or a symlink to one, in an existing folder"


def _refuse(error: type[OSError] | type[ValueError], what: str, path: str, why: str) -> Exception:
    return error(f"cannot write {what} to {path!r}: {why}; {_ACCEPTED}")


def target_of(path: str | os.PathLike[str], *, what: str) -> Path:
    """The file a write to ``path`` replaces (symlinks resolved), checked before any write.

    ``what`` names the file in the errors ("weights", "results.json"). ``ValueError`` for an
    empty path, ``IsADirectoryError`` for a folder, ``FileNotFoundError`` /
    ``NotADirectoryError`` when the parent folder is missing or a file, ``ValueError`` for
    an existing file that is not a regular one (a device, a FIFO) or a symlink loop.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} path must be a str or os.PathLike, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{what} path must be a str path, got {type(text).__name__}")
    if text == "":
        raise _refuse(ValueError, what, text, "the path is empty")
    if "\0" in text:
        raise _refuse(ValueError, what, text, "the path contains a NUL character")
    if text.endswith(os.sep) or (os.altsep is not None and text.endswith(os.altsep)):
        raise _refuse(IsADirectoryError, what, text, "the path names a folder")
    real = Path(os.path.realpath(text))
    if real.is_symlink():  # realpath stops inside a loop
        raise _refuse(ValueError, what, text, "the path is a symlink loop")
    if real.is_dir():
        raise _refuse(IsADirectoryError, what, text, "the path is a folder")
    if real.exists() and not real.is_file():
        raise _refuse(ValueError, what, text, "the path exists and is not a regular file")
    if not real.parent.exists():
        raise _refuse(FileNotFoundError, what, text, f"no such directory {str(real.parent)!r}")
    if not real.parent.is_dir():
        raise _refuse(NotADirectoryError, what, text, f"{str(real.parent)!r} is not a folder")
    return real


def _stem(name: str) -> str:
    """``name`` in its temporaries' names; a name too long to take the 33 extra characters
    within 255 bytes is cut and followed by a hash of the whole name."""
    raw = name.encode()
    if len(raw) <= 255 - 33:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    return f"{raw[:200].decode(errors='ignore')}~{digest}"


def _pattern(real: Path) -> re.Pattern[str]:
    stem = re.escape(_stem(real.name))
    return re.compile(rf"\.{stem}\.[0-9a-f]{{16}}{re.escape(TEMP_SUFFIX)}")


def _try_lock(fd: int) -> bool:
    """An exclusive lock on ``fd`` without waiting; ``False`` when another holder has it."""
    if sys.platform == "win32":  # POSIX only; no lock taken elsewhere
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """The temporaries of writes to ``path`` (symlinks resolved) that no live writer holds."""
    real = Path(os.path.realpath(path))
    pattern = _pattern(real)
    found = []
    with os.scandir(real.parent) as entries:
        for entry in entries:
            if not (pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except FileNotFoundError:  # finished or removed meanwhile
                continue
            try:
                if _try_lock(fd):
                    found.append(Path(entry.path))
            finally:
                os.close(fd)
    return sorted(found)


def _remove_stale(real: Path) -> None:
    for tmp in stale_temporaries(real):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            tmp.unlink()


def _keep_owner(fd: int, old: os.stat_result) -> None:
    """Give the new file the old one's owner and group where this process may (root may
    both; the owner may set a group it belongs to); otherwise they stay the writer's."""
    now = os.fstat(fd)
    if (now.st_uid, now.st_gid) == (old.st_uid, old.st_gid) or not hasattr(os, "fchown"):
        return
    for uid in (old.st_uid, -1):
        try:
            os.fchown(fd, uid, old.st_gid)
            return
        except PermissionError:
            continue


def _fsync_folder(folder: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # Windows cannot open a folder to sync it
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, what: str) -> Iterator[Path]:
    """Yield a temporary path to write the whole file to; commit it to ``path`` on exit.

    ``path`` is checked first (``target_of``), then stale temporaries of it are removed.
    On a normal exit the temporary gets its mode, is fsynced, replaces the target and the
    folder is fsynced; if the body raises, the temporary is removed and the target is
    untouched. While the body runs the temporary is private (0600) to its owner.
    """
    real = target_of(path, what=what)
    old = real.stat() if real.exists() else None
    _remove_stale(real)
    tmp = real.parent / f".{_stem(real.name)}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
    try:
        # 0o666 and the umask (and a default ACL) give the mode an ordinary new file gets.
        lock = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise type(e)(
            e.errno, f"cannot write {what} to {os.fspath(path)!r}: {e.strerror}", str(tmp)
        ) from None
    try:
        _try_lock(lock)
        mode = stat.S_IMODE(old.st_mode if old is not None else os.fstat(lock).st_mode)
        os.chmod(tmp, 0o600)  # writable by its owner whatever the umask, hidden meanwhile
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)  # the writer may have replaced the file we created
        try:
            if old is not None:
                _keep_owner(fd, old)
            os.chmod(tmp, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, real)
        _fsync_folder(real.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.close(lock)


def write_file(path: str | os.PathLike[str], data: bytes, *, what: str) -> Path:
    """Write ``data`` to ``path`` through ``atomic_path``; return ``path`` as a ``Path``."""
    with atomic_path(path, what=what) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path: Path) -> None:
    """Remove ``path`` whatever it is (a folder, a file, a symlink: never followed)."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path)


@contextlib.contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield a new, empty folder beside ``target`` to write a whole folder into; on exit each
    file in it and the folder are fsynced and the folder is renamed to ``target`` (an existing
    ``target`` moved aside first and removed after), so a crash leaves the old folder or the
    new one. If the body or the commit raises, the new folder is removed and ``target`` is as
    it was. A symlink is written through, as ``atomic_path`` writes a file: the folder it
    resolves to is replaced (the new folder made beside that one), the link stays. The
    caller checked ``target`` (that it may be replaced, that it is no symlink loop)."""
    real = Path(os.path.realpath(target))
    parent = real.parent
    stem = _stem(real.name)
    tmp = parent / f".{stem}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
    tmp.mkdir()
    old: Path | None = None
    try:
        yield tmp
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                _fsync_file(path)
        _fsync_folder(tmp)
        if os.path.lexists(real):
            old = parent / f".{stem}.{secrets.token_hex(8)}.old{TEMP_SUFFIX}"
            os.rename(real, old)
        os.rename(tmp, real)
        _fsync_folder(parent)
    except BaseException:
        if old is not None and not os.path.lexists(real):
            os.rename(old, real)
            old = None
        with contextlib.suppress(OSError):
            _remove_tree(tmp)
        raise
    finally:
        if old is not None:
            with contextlib.suppress(OSError):
                _remove_tree(old)
