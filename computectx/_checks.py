"""Input checks shared by the policy's values and the modules that read them: what counts as an
integer (one rule everywhere), and pydantic's errors in the library's own words."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from pydantic import ValidationError

__all__ = ["as_int", "validation_message"]


def as_int(value: object) -> int | None:
    """``value`` as an ``int`` when it is a Python or numpy integer, else ``None``: a ``bool``
    (numpy's too: ``True`` is 1 to pydantic's lax mode), a float (even ``2.0``), a string
    (``"2"``, a JSON number written as text) or ``None`` is not an integer. A text form
    converts its own digits before it asks."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def validation_message(e: ValidationError, model: str, fields: Iterable[str]) -> str:
    """pydantic's errors of a ``model`` as ``bad MODEL: field=value: message`` clauses, one per
    bad field, with no documentation URL; an unknown field names the accepted ``fields``."""
    out = []
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ").removeprefix(f"bad {model}: ")
        if err["type"] == "extra_forbidden":
            msg = f"no such field; accepted: {', '.join(fields)}"
        named = not field or msg.startswith(f"{field}=")
        out.append(msg if named else f"{field}={err['input']!r}: {msg}")
    return f"bad {model}: " + "; ".join(out)
