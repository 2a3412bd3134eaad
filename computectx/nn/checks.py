"""The checks of ``computectx.nn``'s constructor arguments: counts, reals and flags, each
refused with a ``TypeError``/``ValueError`` naming the value and what is accepted."""

from __future__ import annotations

import math
import numbers

from computectx._checks import as_int

__all__ = ["checked_count", "checked_flag", "checked_real"]

_MAX_COUNT = 2**31 - 1  # offs are int32: no count, size or row index beyond it


def checked_count(owner: str, name: str, value: object, minimum: int) -> int:
    """``value`` as an ``int`` in ``[minimum, 2**31 - 1]``, else ``TypeError``/``ValueError``
    naming it. Python and numpy integers are accepted; ``bool``, floats (``2.0``) and
    strings (``"2"``) are not."""
    count = as_int(value)
    if count is None:
        raise TypeError(
            f"{owner} {name} must be an int (a Python or numpy integer), got "
            f"{type(value).__name__} {value!r}"
        )
    if not minimum <= count <= _MAX_COUNT:
        raise ValueError(
            f"{owner} {name} must be an int in [{minimum}, {_MAX_COUNT}], got {count!r}"
        )
    return count


def checked_real(owner: str, name: str, value: object, *, non_negative: bool) -> float:
    """``value`` as a finite ``float`` (``>= 0`` when ``non_negative``), else
    ``TypeError``/``ValueError`` naming it; ints and numpy reals are accepted, ``bool`` and
    strings are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner} {name} must be a real number (int or float), got "
            f"{type(value).__name__} {value!r}"
        )
    real = float(value)
    if not math.isfinite(real) or (non_negative and real < 0):
        accepted = "a finite number >= 0" if non_negative else "a finite number"
        raise ValueError(f"{owner} {name} must be {accepted}, got {value!r}")
    return real


def checked_flag(owner: str, name: str, value: object) -> bool:
    """``value`` when it is a ``bool`` (numpy's too), else ``TypeError`` naming it."""
    if type(value).__name__ not in ("bool", "bool_"):
        got = f"{type(value).__name__} {value!r}"
        raise TypeError(f"{owner} {name} must be True or False, got {got}")
    return bool(value)
