"""Expert residency: memory-mapped experts that page in only as tokens select them.

A mixture-of-experts layer stores each projection of its experts as one 3-D tensor
``[E, N, K]`` (``computectx.nn.MoE``'s ``gate_up``/``down``, transformers'
``gate_up_proj``/``down_proj``, torchtitan's ``w1``/``w2``/``w3``): expert ``e`` is the
contiguous slice ``w[e]``. ``load_weights`` under ``Residency.MMAP`` leaves those tensors as
views of a private memory map of the checkpoint, so a page of an expert is read from the file
only when something touches it, and a grouped GEMM touches only the experts that have rows
(``F.grouped_mm`` and every ``quantized_grouped_mm`` backend skip an empty group's weight). Decoding
with a few experts selected then keeps a few experts resident, not the set.

- ``experts_of(model)``: the experts modules of ``model`` and their 3-D weights, by fqn.
- ``resident_bytes(t)``: the bytes of ``t``'s memory mapped into this process's page tables
  now, what ``/proc/self/smaps`` counts as ``Rss``, read from ``/proc/self/pagemap``.
- ``cached_bytes(t)``: the bytes of ``t``'s memory in the page cache (``mincore``): what the
  kernel has read from the file, for any process, including its read-ahead.
- ``expert_residency(model)``: an ``ExpertResidency`` per experts module, with the resident
  bytes of each expert.
- ``prefetch_experts(weights, counts)``: ``madvise(MADV_WILLNEED)`` on the experts that
  ``counts`` selects, so their pages are read ahead in a few large reads instead of one fault
  at a time, and the neighbours that fault read-around would bring in are not read.

These read Linux interfaces (``/proc/self/pagemap``, ``mincore``, ``madvise``).
``resident_bytes``, ``cached_bytes`` and ``expert_residency`` raise ``OSError`` where they do
not exist; ``prefetch_experts`` is advice and does nothing there.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import struct
import sys
from collections.abc import Iterable

import torch

__all__ = [
    "ExpertResidency",
    "cached_bytes",
    "expert_residency",
    "experts_of",
    "prefetch_experts",
    "resident_bytes",
]

_PAGE = mmap.PAGESIZE
_PRESENT = 1 << 63  # /proc/self/pagemap: bit 63 of a page's entry, "page present"
_MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)


def experts_of(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The experts modules of ``model``: ``{fqn: {parameter name: [E, N, K] tensor}}``.

    A module that defines ``expert_weights()`` (returning ``{name: tensor}``) says which
    tensors are its experts. Any other module counts as an experts module when at least two
    of its own parameters are 3-D with the same leading dimension ``E`` (the experts): that
    is how ``computectx.nn.MoE``, transformers and torchtitan store grouped experts, and what
    a 1-D convolution (one 3-D weight) is not.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, module in model.named_modules():
        seam = getattr(module, "expert_weights", None)
        if callable(seam):
            weights = dict(seam())
        else:
            weights = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
            if len(weights) < 2 or len({w.shape[0] for w in weights.values()}) != 1:
                continue
        if weights:
            out[fqn] = weights
    return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``(first page address, page count)`` of the memory ``t``'s elements occupy."""
    if t.device.type != "cpu":
        raise ValueError(f"residency is measured on host memory, got a tensor on {t.device}")
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    lo = t.data_ptr() - t.data_ptr() % _PAGE
    hi = t.data_ptr() + extent * t.element_size()
    return lo, -(-(hi - lo) // _PAGE)


def resident_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s pages mapped in this process now (``Rss``, page by page).

    A page of a memory-mapped file counts once this process has touched it (or the kernel
    mapped it in around a touch: fault-around maps up to 64 KiB of neighbours already in the
    page cache). Whole pages are counted, so a tensor that shares its first or last page
    with another one counts that page too. ``OSError`` where ``/proc/self/pagemap`` does not
    exist (not Linux).
    """
    lo, pages = _span(t)
    if pages == 0:
        return 0
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo // _PAGE * 8)
        entries = struct.unpack(f"{pages}Q", f.read(pages * 8))
    return sum(1 for e in entries if e & _PRESENT) * _PAGE


def cached_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s pages in memory by ``mincore``: for a file mapping, the pages of
    the file in the page cache, whoever read them (this process, another, or the kernel's
    read-ahead); for anonymous memory, the pages that are not swapped out. ``OSError`` where
    ``mincore`` is not available."""
    lo, pages = _span(t)
    if pages == 0:
        return 0
    vec = (ctypes.c_ubyte * pages)()
    libc = _libc()
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(pages * _PAGE), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return sum(1 for v in vec if v & 1) * _PAGE


@dataclasses.dataclass(frozen=True)
class ExpertResidency:
    """One experts module's residency: ``resident[e]`` is the bytes of expert ``e``'s slices
    of every weight that are resident in this process (``resident_bytes``); ``expert_bytes``
    the bytes of one expert's slices; ``mapped`` names the weights that view a file mapping
    (``/proc/self/maps``), by parameter name, with the file."""

    fqn: str
    experts: int
    expert_bytes: int
    resident: tuple[int, ...]
    mapped: dict[str, str]

    @property
    def resident_total(self) -> int:
        """The resident bytes of all the module's experts together."""
        return sum(self.resident)

    def __str__(self) -> str:
        whole = self.experts * self.expert_bytes
        return (
            f"{self.fqn or '<model>'}: {self.resident_total:,} of {whole:,} expert bytes resident "
            f"({self.resident_total / max(self.expert_bytes, 1):.2f} of {self.experts} experts' "
            f"worth); {len(self.mapped)} weight(s) memory-mapped"
        )


def expert_residency(model: torch.nn.Module) -> tuple[ExpertResidency, ...]:
    """An ``ExpertResidency`` for each experts module of ``model`` (``experts_of``)."""
    out = []
    for fqn, weights in experts_of(model).items():
        n = min(w.shape[0] for w in weights.values())
        resident = tuple(
            sum(resident_bytes(w.detach()[e]) for w in weights.values()) for e in range(n)
        )
        per = sum(w[0].numel() * w.element_size() for w in weights.values())
        mapped = {name: path for name, w in weights.items() if (path := _file_of(w)) is not None}
        out.append(ExpertResidency(fqn, n, per, resident, mapped))
    return tuple(out)


def prefetch_experts(weights: Iterable[torch.Tensor], counts: torch.Tensor) -> int:
    """Ask the kernel to read ahead the experts that ``counts`` selects; return the bytes asked.

    ``weights`` are ``[E, ...]`` expert tensors and ``counts`` the tokens per expert (any
    integer dtype, ``E`` entries; read on the host). For each expert with tokens, each
    weight's slice gets ``madvise(MADV_WILLNEED)``: on a memory-mapped checkpoint its pages
    are read in a few large requests now, before the grouped GEMM touches them one page
    fault at a time, and nothing of the experts without tokens is read. On memory that is
    not a file mapping the advice changes nothing. Tensors not on the CPU, or a platform
    without ``madvise``, are skipped (0 bytes). Advice never fails a forward: an ``madvise``
    error skips that slice.
    """
    host = [w for w in weights if w.device.type == "cpu" and w.dim() > 0]
    libc = _libc_or_none()
    if libc is None or not host:
        return 0
    selected = [e for e, c in enumerate(counts.tolist()) if c > 0]
    advice = ctypes.c_int(_MADV_WILLNEED)
    asked = 0
    for w in host:
        for e in selected:
            if e >= w.shape[0]:
                continue
            lo, pages = _span(w.detach()[e])
            if (
                pages
                and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(pages * _PAGE), advice) == 0
            ):
                asked += pages * _PAGE
    return asked


def _file_of(t: torch.Tensor) -> str | None:
    """The file whose mapping holds ``t``'s data (``/proc/self/maps``), or None."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    ptr = t.data_ptr()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= ptr < hi:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return path if path.startswith("/") else None
    except OSError:
        return None
    return None


def _libc() -> ctypes.CDLL:
    libc = _libc_or_none()
    if libc is None:
        raise OSError(f"mincore/madvise are not available on {sys.platform}")
    return libc


_LIBC: list[ctypes.CDLL | None] = []


def _libc_or_none() -> ctypes.CDLL | None:
    if not _LIBC:
        libc: ctypes.CDLL | None = None
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            except (OSError, AttributeError):
                libc = None
        _LIBC.append(libc)
    return _LIBC[0]
