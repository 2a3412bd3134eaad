"""Input checks shared by the policy's values and the modules that read them: what counts as an
integer (one rule everywhere), and pydantic's errors in the library's own words
(``CheckedModel``)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Container, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from pydantic import BaseModel, ValidationError
from typing_extensions import Self

__all__ = [
    "CheckedModel",
    "as_int",
    "check_max_norm",
    "checked_int",
    "described",
    "fault",
    "read_value",
    "shown_ints",
    "text_int",
    "validation_message",
]


def as_int(value: object) -> int | None:
    """``value`` as an ``int`` when it is a Python or numpy integer, else ``None``: a ``bool``
    (numpy's too: ``True`` is 1 to pydantic's lax mode), a float (even ``2.0``), a string
    (``"2"``, a JSON number written as text) or ``None`` is not an integer. A text form
    converts its own digits before it asks."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def checked_int(
    value: object, not_int: str, accepted: Container[int] | None = None, refused: str = ""
) -> int:
    """``value`` as an ``int`` (``as_int``) that ``accepted`` holds (any, for ``None``), as
    every integer field of the policy reads its value: ``ValueError`` otherwise, with the
    message ``not_int`` (a ``str.format`` template of ``{value}``, the value, and ``{type}``,
    its type's name) or ``refused`` (of ``{n}``, the integer refused)."""
    n = as_int(value)
    if n is None:
        raise ValueError(not_int.format(value=value, type=type(value).__name__))
    if accepted is not None and n not in accepted:
        raise ValueError(refused.format(n=n))
    return n


def text_int(name: str, digits: str, where: str, tail: str = "") -> int:
    """The ``N`` of a text form's ``NAME=N`` part, as an ``int``: ASCII digits after an
    optional sign (a text form converts its own digits; ``as_int`` refuses text), else
    ``ValueError`` "``NAME='N' in WHERE is not an integer``" then ``tail``."""
    if not re.fullmatch(r"[+-]?[0-9]+", digits):
        raise ValueError(f"{name}={digits!r} in {where} is not an integer{tail}")
    return int(digits)


def described(value: object) -> str:
    """``value`` refused, for an error message: a tensor's dtype, shape and device
    (``torch.bfloat16 (4, 8) on cpu``), anything else's type name."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def fault(value: torch.Tensor) -> str:
    """What is wrong with one refused element (a tensor of one element) of values that must be
    finite and positive, for an error message that never prints the value: ``'NaN'``,
    ``'inf'``, ``'-inf'``, ``'0'`` or ``'negative'``. One host read of four flags: call it on
    the error path only."""
    one = value.detach().reshape(())
    flags = torch.stack([one.isnan(), one == math.inf, one == -math.inf, one == 0]).tolist()
    names = ("NaN", "inf", "-inf", "0")
    return next((n for n, hit in zip(names, flags, strict=True) if hit), "negative")


def shown_ints(values: torch.Tensor | list[int], limit: int = 8) -> str:
    """A metadata vector (offsets, lengths, row or expert indices) for an error message,
    capped: ``'[0, 4, 9]'``, or its first ``limit`` values and how many it holds
    (``'[0, 4, 9, ... (1000 values)]'``); a tensor reads only those ``limit`` to the host."""
    n = values.numel() if isinstance(values, torch.Tensor) else len(values)
    head = values.reshape(-1)[:limit].tolist() if isinstance(values, torch.Tensor) else values
    shown = ", ".join(str(v) for v in head[:limit])
    return f"[{shown}]" if n <= limit else f"[{shown}, ... ({n} values)]"


def check_max_norm(max_norm: object) -> None:
    """A ``max_norm``: a real number (not a bool or a string), ``> 0`` and not NaN;
    ``math.inf`` measures the norm without clipping, as in torch. ``TypeError`` /
    ``ValueError`` naming the value otherwise (NaN would make every weight NaN, a negative
    one flip every gradient's sign). Every clip of the package checks with it."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float):
        raise TypeError(
            f"max_norm must be a real number > 0 (math.inf to only measure), got {max_norm!r}"
        )
    if not max_norm > 0:  # NaN too
        raise ValueError(
            f"max_norm must be a real number > 0 (math.inf to only measure), got {max_norm!r}"
        )


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


class CheckedModel(BaseModel, frozen=True):
    """A pydantic model whose every way in (the constructor, ``model_validate``,
    ``model_validate_json``) refuses bad fields with the library's ``ValueError``
    (``validation_message``: each bad field, its value and what is accepted, no documentation
    URL) instead of pydantic's ``ValidationError``. Frozen, as every value of the policy; the
    policy's values and ``LMConfig`` derive from it."""

    if not TYPE_CHECKING:  # type checkers keep pydantic's typed signature of each model

        def __init__(self, /, **data: Any) -> None:
            try:
                super().__init__(**data)
            except ValidationError as e:
                raise ValueError(type(self)._message(e)) from None

    @classmethod
    def _message(cls, e: ValidationError) -> str:
        return validation_message(e, cls.__name__, cls.model_fields)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """``obj`` (a dict of the fields) as this model; ``ValueError`` as the constructor."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise ValueError(cls._message(e)) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        """The JSON form as this model; ``ValueError`` as the constructor."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as e:
            raise ValueError(cls._message(e)) from None

    @classmethod
    def _from_text(cls, data: dict[str, object], what: str, text: str) -> Self:
        """The fields a text form's parser read from ``text`` as the model: a bad one is a
        ``ValueError`` "``bad WHAT 'TEXT': ...``" with the constructor's reasons."""
        try:
            return cls(**data)
        except ValueError as e:
            reasons = str(e).removeprefix(f"bad {cls.__name__}: ")
            raise ValueError(f"bad {what} {text!r}: {reasons}") from None

    @classmethod
    def from_fields(cls, value: dict[Any, Any], what: str, takes: str) -> Self:
        """A dict of this model's fields as the model: ``ValueError`` naming the unknown
        keys, the ``value`` and what a dict of ``what`` ``takes``, before any field is read."""
        unknown = sorted(map(repr, set(value) - set(cls.model_fields)))
        if unknown:
            raise ValueError(f"unknown {what} field(s) {', '.join(unknown)} in {value!r}; {takes}")
        return cls(**{str(k): v for k, v in value.items()})


_M = TypeVar("_M", bound=CheckedModel)


def read_value(
    value: object, model: type[_M], parse: Callable[[str], _M], what: str, takes: str, accepted: str
) -> _M:
    """``value`` as a ``model`` of the policy: the model itself, its text form (``parse``) or
    its JSON form (a dict of its fields, ``from_fields``: a dict of ``what`` ``takes``).
    Anything else is a ``ValueError`` "``bad WHAT VALUE (TYPE); accepted: ACCEPTED``"."""
    if isinstance(value, model):
        return value
    if isinstance(value, str):
        return parse(value)
    if isinstance(value, dict):
        return model.from_fields(value, what, takes)
    raise ValueError(f"bad {what} {value!r} ({type(value).__name__}); accepted: {accepted}")
