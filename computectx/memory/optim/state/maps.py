"""The quantization maps of the block-wise optimizer-state formats.

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
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

__all__ = [
    "MapName",
    "dynamic_tree_values",
    "linear_without_zero_values",
    "map_for",
    "midpoints_for",
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
