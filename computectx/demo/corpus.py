"""The demo's bytes: the standard library's sources (or ``--data``), split and batched."""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from computectx.demo.settings import DemoError

__all__ = [
    "MAX_DATA_BYTES",
    "STDLIB_CORPUS_BYTES",
    "VAL_FRACTION",
    "Corpus",
    "load_corpus",
    "train_batches",
    "val_batches",
]

STDLIB_CORPUS_BYTES = 2 * 1024 * 1024
"""Bytes of standard-library source the default corpus reads (whole files, sorted by name)."""

MAX_DATA_BYTES = 64 * 1024 * 1024
"""Most bytes read from ``--data``; a larger file or folder is cut here (the corpus line
says so)."""

VAL_FRACTION = 0.1
"""Share of the corpus held out for validation: its last bytes (whole trailing files of the
default corpus)."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Training and validation bytes (uint8 tensors) and where they came from."""

    name: str
    source: str
    files: int
    train: torch.Tensor
    val: torch.Tensor
    truncated: bool = False
    """Whether reading stopped at the byte cap before the last file."""


def _stdlib_files() -> list[Path]:
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(os.__file__).parent]
    for root in roots:
        found = sorted(p for p in root.glob("*.py") if p.is_file())
        if found:
            return found
    return []


def _is_text(head: bytes) -> bool:
    return b"\x00" not in head


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = []
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        files.append(p)
    return files


def load_corpus(data: Path | None, min_bytes: int = 0) -> Corpus:
    """The demo's bytes: the standard library's ``*.py`` files, or ``data`` (file or folder).

    Files are read whole in name order until the cap (``STDLIB_CORPUS_BYTES`` for the
    default corpus, ``MAX_DATA_BYTES`` for ``data``); files with NUL bytes in their first
    4 KiB are taken for binary and skipped. The last ``VAL_FRACTION`` of the bytes is the
    validation split. Raises ``DemoError`` when the path is missing or unreadable or when
    either split would hold fewer than ``min_bytes`` bytes.
    """
    if data is None:
        files = _stdlib_files()
        if not files:
            raise DemoError(
                "found no Python standard-library sources to train on (this interpreter "
                "ships them compiled or zipped); pass --data PATH with a text file or folder"
            )
        cap, name, source = STDLIB_CORPUS_BYTES, "python stdlib", str(files[0].parent)
    else:
        path = Path(data).expanduser()
        if not path.exists():
            raise DemoError(f"--data {str(data)!r} does not exist; give a text file or a folder")
        if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
            raise DemoError(f"--data {str(data)!r} is not readable (permission denied)")
        files = _data_files(path)
        cap, name, source = MAX_DATA_BYTES, path.name or str(path), str(path)
    chunks: list[bytes] = []
    truncated = False
    used = 0
    total = 0
    for f in files:
        room = cap - total
        try:
            with f.open("rb") as fh:
                # Never more than the cap (plus one byte to tell whether the file goes on),
                # but always the 4 KiB the binary check looks at.
                blob = fh.read(max(room + 1, 4096))
        except OSError as e:
            if data is None:
                continue  # an odd stdlib file is no reason to stop; the user's data is
            raise DemoError(f"cannot read {str(f)!r} under --data: {e.strerror}") from None
        if not blob or not _is_text(blob[:4096]):
            continue
        chunks.append(blob[:room])
        total += len(chunks[-1])
        used += 1
        if total >= cap:
            truncated = len(blob) > room or f is not files[-1]
            break
    joined = b"\n".join(chunks)
    n_val = int(len(joined) * VAL_FRACTION)
    train, val = joined[: len(joined) - n_val], joined[len(joined) - n_val :]
    if min(len(train), len(val)) < max(min_bytes, 1):
        raise DemoError(
            f"{source!r} holds {len(joined)} bytes of text in {used} file(s); the demo needs "
            f"at least {max(min_bytes, 1)} bytes in each of the train and validation splits "
            f"(validation is the last {VAL_FRACTION:.0%}); use more text or a smaller --seq-len"
        )
    return Corpus(
        name=name,
        source=source,
        files=used,
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        truncated=truncated,
    )


def _windows(data: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(length + 1)[None, :]
    return data[idx].long()


def train_batches(
    corpus: Corpus, batch: int, seq_len: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(inputs, targets)`` int64 batches ``(batch, seq_len)`` of random training
    windows, the same sequence for the same ``seed`` (targets are inputs shifted by one)."""
    # A private generator: every policy sees the same batches whatever else draws numbers.
    g = torch.Generator().manual_seed(seed)
    hi = corpus.train.numel() - seq_len - 1
    while True:
        w = _windows(corpus.train, torch.randint(0, hi + 1, (batch,), generator=g), seq_len)
        yield w[:, :-1], w[:, 1:]


def val_batches(
    corpus: Corpus, batch: int, seq_len: int, count: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed ``(inputs, targets)`` batches of windows spread evenly over the
    validation bytes."""
    hi = corpus.val.numel() - seq_len - 1
    starts = torch.linspace(0, hi, batch * count).long()
    w = _windows(corpus.val, starts, seq_len)
    return [(b[:, :-1], b[:, 1:]) for b in (w[i : i + batch] for i in range(0, w.shape[0], batch))]
