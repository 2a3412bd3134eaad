"""The quantization maps of the block-wise optimizer-state formats, and the nearest entry.

A map is a sorted f32 tensor of the values a code can stand for, relative to its block's
scale (so every entry lies in [-1, 1]); code ``i`` means ``map[i] * scale``. Built here from
the papers' definitions:

- **Dynamic tree quantization** (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
  Quantization", after Dettmers 2016). After the sign bit (signed maps only), the number of
  leading zero bits is the decimal exponent ``E``, the first one bit is an indicator, and the
  ``f`` bits after it are a linear fraction in ``(0.1, 1]``: the value is
  ``sign * 10**-E * (0.1 + 0.9 * (k + 1) / 2**f)``, ``k = 0 .. 2**f - 1``. Each exponent's
  group covers ``(10**-(E+1), 10**-E]`` and ends on ``10**-E``, so the groups tile
  ``(10**-(E_max+1), 1]`` without overlap and ``1.0`` (and, signed, ``-1.0``) is a map entry:
  a block's largest element decodes exactly. The code of all zero bits is ``0``.
  Signed 8-bit: exponents 0..6, 127 magnitudes per sign, plus 0: 255 entries (the code of
  "-0" is unused). Unsigned 8-bit: exponents 0..7, 255 magnitudes plus 0: 256 entries.
- **Dynamic exponent, 4-bit signed** (Li et al. 2023, "Memory Efficient Optimizers with 4-bit
  States", first moment): the same tree on 1 sign + 3 bits: exponents 0..2 give
  ``{0.325, 0.55, 0.775, 1}``, ``{0.055, 0.1}``, ``{0.01}`` per sign, plus 0: 15 entries.
- **Linear without zero, 4-bit unsigned** (Li et al. 2023, second moment): ``(i + 1) / 16``,
  ``i = 0..15``. Zero is left out on purpose (a second moment quantized to zero would blow up
  ``m / sqrt(v)``), so an element below ``scale / 32`` decodes to ``scale / 16``.

Maps and their midpoints (the decision boundaries of nearest rounding) are cached per device.

**The nearest entry** of each element (``packed.nearest_codes``), by a table on the top 16 bits
of its f32 pattern (``nearest_table``, built here).

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
from typing import Literal, NamedTuple

import torch

__all__ = [
    "TABLE_MASK",
    "TABLE_SHIFT",
    "MapName",
    "NearestTable",
    "build_table",
    "dynamic_tree_values",
    "linear_without_zero_values",
    "map_for",
    "midpoints_for",
    "nearest_table",
    "qmap",
    "qmap_midpoints",
]

MapName = Literal["dynamic8_signed", "dynamic8_unsigned", "dynamic4_signed", "linear4_unsigned"]


def dynamic_tree_values(bits: int, signed: bool) -> list[float]:
    """The sorted values of the dynamic tree map on ``bits`` bits (sign bit included if signed)."""
    if bits < 2 or (signed and bits < 3):
        raise ValueError(f"a dynamic tree map needs at least {3 if signed else 2} bits, got {bits}")
    payload = bits - 1 if signed else bits  # bits after the sign
    magnitudes: list[float] = []
    # E leading zeros, one indicator bit, then f = payload - 1 - E fraction bits.
    for exponent in range(payload):
        frac_bits = payload - 1 - exponent
        count = 2**frac_bits
        scale = 10.0**-exponent
        magnitudes += [scale * (0.1 + 0.9 * (k + 1) / count) for k in range(count)]
    values = [0.0, *magnitudes]
    if signed:
        values += [-m for m in magnitudes]
    return sorted(values)


def linear_without_zero_values(bits: int) -> list[float]:
    """``(i + 1) / 2**bits`` for ``i = 0 .. 2**bits - 1``: linear on ``(0, 1]``, zero left out."""
    n = 2**bits
    return [(i + 1) / n for i in range(n)]


def _values(name: MapName) -> list[float]:
    if name == "dynamic8_signed":
        return dynamic_tree_values(8, signed=True)
    if name == "dynamic8_unsigned":
        return dynamic_tree_values(8, signed=False)
    if name == "dynamic4_signed":
        return dynamic_tree_values(4, signed=True)
    if name == "linear4_unsigned":
        return linear_without_zero_values(4)
    raise ValueError(
        f"unknown quantization map {name!r}; accepted: dynamic8_signed, dynamic8_unsigned, "
        f"dynamic4_signed, linear4_unsigned"
    )


@functools.lru_cache(maxsize=64)
def _cached(name: MapName, device: torch.device, mids: bool) -> torch.Tensor:
    vals = torch.tensor(_values(name), dtype=torch.float64)
    if mids:
        vals = (vals[1:] + vals[:-1]) / 2
    return vals.to(dtype=torch.float32, device=device)


def qmap(name: MapName, device: torch.device | str = "cpu") -> torch.Tensor:
    """The map ``name`` as a sorted f32 tensor on ``device`` (cached; do not modify it)."""
    return _cached(name, torch.device(device), False)


def qmap_midpoints(name: MapName, device: torch.device | str = "cpu") -> torch.Tensor:
    """The midpoints between neighbouring entries of ``qmap(name)`` (f32, cached).

    ``torch.bucketize(x, qmap_midpoints(name))`` is the index of the nearest entry to ``x``
    (a tie goes to the lower entry).
    """
    return _cached(name, torch.device(device), True)


def map_for(fmt: str, signed: bool) -> MapName:
    """The map a block-wise format uses for signed or non-negative state."""
    if fmt == "int8":
        return "dynamic8_signed" if signed else "dynamic8_unsigned"
    if fmt == "int4":
        return "dynamic4_signed" if signed else "linear4_unsigned"
    raise ValueError(f"format {fmt!r} has no quantization map; accepted: int8, int4")


def midpoints_for(fmt: str, signed: bool, device: torch.device | str) -> torch.Tensor:
    """``qmap_midpoints(map_for(fmt, signed), device)``."""
    return qmap_midpoints(map_for(fmt, signed), device)


# ----- the nearest entry, by a table on the float32 bit pattern -----------------------------

TABLE_SHIFT = 16
"""A bucket is the top ``32 - TABLE_SHIFT`` bits of a float32 pattern."""
TABLE_MASK = (1 << TABLE_SHIFT) - 1
_BUCKETS = 1 << (32 - TABLE_SHIFT)


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
    first, last = _as_f32(key << TABLE_SHIFT), _as_f32((key << TABLE_SHIFT) | TABLE_MASK)
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
def _cached_table(name: MapName, device: torch.device) -> NearestTable | None:
    built = build_table(qmap_midpoints(name, "cpu"))
    if built is None:
        return None
    return NearestTable(built.table.to(device), built.bounds.to(device))


def nearest_table(name: MapName, device: torch.device | str = "cpu") -> NearestTable | None:
    """The checked table of map ``name`` on ``device`` (cached; do not modify it), or ``None``
    where the map's midpoints are too close for it (use ``torch.bucketize`` there)."""
    return _cached_table(name, torch.device(device))
