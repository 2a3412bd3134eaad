"""The nearest map entry of each element, by a table on the top 16 bits of its f32 pattern.

``torch.bucketize(n, mids)`` (``right=False``) gives the number of midpoints strictly below
``n``: the nearest entry, a tie to the lower one. A binary search per element is slow on the
CPU (about 25 ns per element), so instead:

- the top 16 bits of ``n``'s float32 bit pattern (sign, exponent, 7 mantissa bits) pick one
  of 65536 buckets; each bucket is a contiguous interval ``[lo, hi]`` of float32 values;
- ``table[bucket]`` is ``bucketize(lo, mids)``, the code of the bucket's smallest value;
- the code of ``n`` is ``table[bucket] + (n > bounds[table[bucket]])``, ``bounds`` being the
  midpoints followed by ``+inf``.

This is exactly ``bucketize`` when at most one midpoint lies in ``[lo, hi)`` of every bucket,
i.e. ``bucketize(hi) - bucketize(lo) <= 1``: then the midpoints below ``n`` are those below
``lo`` plus the next one if ``n`` is above it. The table is built once per map and device
(cached) and checked for this; a map where it fails gets no table (``nearest_table`` returns
``None``) and the caller keeps ``bucketize``.

Non-finite values: ``inf`` and NaN give ``len(mids)`` and ``-inf`` gives 0, as ``bucketize``
does, except a NaN whose pattern shares ``-inf``'s top 16 bits (``0xFF800001..0xFF80FFFF``,
never produced by arithmetic), which gets 0. The codecs never encode non-finite values.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from computectx.memory.optim.state.maps import MapName, qmap_midpoints

__all__ = ["NearestTable", "nearest_codes", "nearest_table"]

_SHIFT = 16
_BUCKETS = 1 << (32 - _SHIFT)
_LOW = (1 << _SHIFT) - 1


class NearestTable(NamedTuple):
    """``table`` (int32, 65536): the code of each bucket's smallest value; ``bounds`` (f32):
    the midpoints followed by ``+inf``."""

    table: torch.Tensor
    bounds: torch.Tensor


def _as_f32(patterns: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in ``[0, 2**32)`` as float32 values."""
    signed = torch.where(patterns >= 2**31, patterns - 2**32, patterns)
    return signed.to(torch.int32).view(torch.float32)


def build_table(mids: torch.Tensor) -> NearestTable | None:
    """The table for the sorted float32 midpoints ``mids`` (on the CPU), or ``None`` if some
    bucket holds two midpoints or more (then the table search is not exact)."""
    key = torch.arange(_BUCKETS, dtype=torch.int64)
    first, last = _as_f32(key << _SHIFT), _as_f32((key << _SHIFT) | _LOW)
    negative = key >= _BUCKETS // 2  # sign bit set: values fall as the pattern rises
    lo = torch.where(negative, last, first)
    hi = torch.where(negative, first, last)
    # Buckets with NaN patterns: only the +-inf buckets also hold an ordered value, at their
    # first pattern; the others are all NaN. Take the first pattern's value for both ends.
    lo = torch.where(lo.isnan(), first, lo)
    hi = torch.where(hi.isnan(), first, hi)
    c_lo, c_hi = torch.bucketize(lo, mids), torch.bucketize(hi, mids)
    if not bool(((c_hi - c_lo) <= 1).all()):
        return None
    bounds = torch.cat((mids, torch.tensor([float("inf")], dtype=mids.dtype)))
    return NearestTable(c_lo.to(torch.int32), bounds)


@functools.lru_cache(maxsize=64)
def _cached(name: MapName, device: torch.device) -> NearestTable | None:
    built = build_table(qmap_midpoints(name, "cpu"))
    if built is None:
        return None
    return NearestTable(built.table.to(device), built.bounds.to(device))


def nearest_table(name: MapName, device: torch.device | str = "cpu") -> NearestTable | None:
    """The checked table of map ``name`` on ``device`` (cached; do not modify it), or ``None``
    where the map's midpoints are too close for it (use ``torch.bucketize`` there)."""
    return _cached(name, torch.device(device))


def nearest_codes(n: torch.Tensor, table: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``torch.bucketize(n, mids)`` for float32 ``n``, as int32, by ``nearest_table``'s parts."""
    flat = n.reshape(-1)
    key = (flat.view(torch.int32) >> _SHIFT) & _LOW
    code = table.index_select(0, key)  # index_select: several times faster than table[key]
    return (code + (flat > bounds.index_select(0, code))).view(n.shape)
