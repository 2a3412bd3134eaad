"""The fp8 recipe: which formats, which scaling recipe. Pure data in the core layer.

``ComputeCtx.fp8`` holds an ``Fp8Policy``; everything in ``computectx.fp8`` reads it. The
recipe lives here, beside ``dtypes``, and not in the fp8 package, so that the core never
imports the layer that consumes it (``computectx.fp8.policy`` re-exports these names).

Scale convention (one formula for every recipe, every kernel and the reference twin):

    step  = amax / (fmt.max / 2**margin)      (the *quantization step*, a float32 scalar)
    q     = saturate(round_to_fp8(x / step))  (saturate clamps to ±fmt.max, never inf)
    x_hat = q * step                          (dequantization)

``step`` is what ``torch._scaled_mm`` calls ``scale_a`` / ``scale_b``: the factor that takes
fp8 codes back to real values. The largest magnitude ``amax`` maps to ``fmt.max / 2**margin``,
so ``margin`` leaves ``2**margin`` of headroom for values that grow between the step that
measured amax and the step that uses it (delayed scaling). A zero amax has no meaningful
step; it keeps ``step = 1`` (every value quantizes to 0 exactly) rather than dividing by 0.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Discriminator, Field, Tag, ValidationError

from computectx.dtypes import Fp8Format

__all__ = ["DelayedScaling", "DynamicScaling", "Fp8Policy", "Fp8Scheme", "Scaling", "parse_scaling"]

_SCALING_FORM = "'delayed[/HISTORY[/MARGIN[/ALGO]]]' or 'dynamic[/MARGIN]'"
_POLICY_FORM = "'SCHEME[/delayed[/HISTORY[/MARGIN[/ALGO]]]]' or 'SCHEME/dynamic[/MARGIN]'"


def _lower(value: object) -> object:
    # Names are case-insensitive everywhere: every text field of the policy folds case here.
    return value.strip().lower() if isinstance(value, str) else value


class Fp8Scheme(enum.Enum):
    """Which fp8 format each direction uses.

    ``HYBRID``: E4M3 for forward operands (activations, weights: precision matters), E5M2
    for gradients (range matters). ``E4M3`` / ``E5M2``: that format everywhere.
    """

    HYBRID = "hybrid"
    E4M3 = "e4m3"
    E5M2 = "e5m2"

    def __str__(self) -> str:
        return self.value

    @property
    def forward(self) -> Fp8Format:
        """Format of forward operands (inputs and weights)."""
        return Fp8Format.E5M2 if self is Fp8Scheme.E5M2 else Fp8Format.E4M3

    @property
    def backward(self) -> Fp8Format:
        """Format of output gradients in the backward GEMMs."""
        return Fp8Format.E4M3 if self is Fp8Scheme.E4M3 else Fp8Format.E5M2

    @classmethod
    def parse(cls, value: Fp8Scheme | str) -> Fp8Scheme:
        """Read ``"hybrid"``, ``"e4m3"`` or ``"e5m2"`` in any case; ``ValueError`` (naming
        the accepted names) otherwise."""
        if isinstance(value, Fp8Scheme):
            return value
        key = _lower(value)
        for member in Fp8Scheme:
            if member.value == key:
                return member
        accepted = ", ".join(repr(s.value) for s in Fp8Scheme)
        raise ValueError(f"unknown fp8 scheme {value!r}; accepted: {accepted}")


class DelayedScaling(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """Scale from the amax *history*: each step uses a scale derived from amaxes recorded
    on earlier steps, and records its own amax for later ones (one pass over the data).

    ``step = reduce(history) / (fmt.max / 2**margin)`` where ``reduce`` is the window max
    (``algo="max"``) or the newest entry (``algo="most_recent"``). The first call of an
    operand seeds the whole window with its current amax so step 1 is not blind.
    """

    kind: Annotated[Literal["delayed"], BeforeValidator(_lower)] = "delayed"
    """Discriminator for serialization; always ``"delayed"`` (optional on input: a recipe
    without ``kind`` is delayed)."""
    history_len: int = Field(default=16, ge=1, le=1024)
    """Number of past amaxes kept per operand (the window of the ``max`` reduction)."""
    margin: int = Field(default=0, ge=0, le=16)
    """Headroom exponent: the scale leaves ``2**margin`` above the observed amax."""
    algo: Annotated[Literal["max", "most_recent"], BeforeValidator(_lower)] = "max"
    """Window reduction: ``"max"`` (stable) or ``"most_recent"`` (responsive)."""

    def __str__(self) -> str:
        """The text form ``delayed/HISTORY/MARGIN/ALGO``, which ``parse_scaling`` reads."""
        return f"delayed/{self.history_len}/{self.margin}/{self.algo}"


class DynamicScaling(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """Scale from the *current* amax: measure, then quantize (an extra pass over the data,
    no state). ``step = amax(x) / (fmt.max / 2**margin)``."""

    kind: Annotated[Literal["dynamic"], BeforeValidator(_lower)] = "dynamic"
    """Discriminator for serialization; always ``"dynamic"``."""
    margin: int = Field(default=0, ge=0, le=16)
    """Headroom exponent: the scale leaves ``2**margin`` above the observed amax."""

    def __str__(self) -> str:
        """The text form ``dynamic/MARGIN``, which ``parse_scaling`` reads."""
        return f"dynamic/{self.margin}"


_RECIPES: dict[str, type[DelayedScaling] | type[DynamicScaling]] = {
    "delayed": DelayedScaling,
    "dynamic": DynamicScaling,
}
# The positional fields of each recipe's text form, in order.
_TEXT_FIELDS: dict[str, tuple[str, ...]] = {
    "delayed": ("history_len", "margin", "algo"),
    "dynamic": ("margin",),
}


def _bounds(model: type[BaseModel], name: str) -> str:
    """``"an integer from LO to HI"`` read from the field's own ``Field(ge=, le=)``."""
    lo = hi = None
    for m in model.model_fields[name].metadata:
        lo = getattr(m, "ge", lo)
        hi = getattr(m, "le", hi)
    return f"an integer from {lo} to {hi}"


def _errors(e: ValidationError) -> str:
    """pydantic's errors as ``field=value: message`` clauses, one per bad field."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc'])}={err['input']!r}: {err['msg']}"
        for err in e.errors()
    )


def _scaling_from_parts(
    parts: list[str], text: str, form: str, prefix: str = ""
) -> DelayedScaling | DynamicScaling:
    """The recipe named by ``parts[0]`` with the positional ``parts[1:]``; errors quote
    ``text`` (the whole string the user wrote, ``prefix`` + the scaling part) and the
    accepted ``form``."""
    recipe = parts[0].lower()
    if recipe not in _RECIPES:
        raise ValueError(
            f"unknown fp8 scaling recipe {parts[0]!r} in {text!r}; accepted recipes "
            f"'delayed', 'dynamic' in the form {form}"
        )
    cls, names, args = _RECIPES[recipe], _TEXT_FIELDS[recipe], parts[1:]
    if len(args) > len(names):
        raise ValueError(
            f"too many fields in {text!r}: {recipe} scaling takes at most {len(names)} "
            f"({'/'.join(n.upper() for n in names)}) after the recipe; accepted form {form}"
        )
    fields: dict[str, object] = {}
    for name, value in zip(names, args, strict=False):
        if name == "algo":
            fields[name] = value
            continue
        try:
            fields[name] = int(value)
        except ValueError:
            hint = ""
            if value.lower() in ("max", "most_recent") and recipe == "delayed":
                # An algo written where a number belongs: the numbers before it were cut.
                filled = [str(DelayedScaling().history_len), str(DelayedScaling().margin)]
                numbers = [a for a in args if a.lower() not in ("max", "most_recent")][:2]
                fixed = "/".join([recipe, *numbers, *filled[len(numbers) :], value.lower()])
                hint = f"; did you mean {prefix + fixed!r}?"
            raise ValueError(
                f"{name} must be {_bounds(cls, name)}, got {value!r} in {text!r}; accepted "
                f"form {form}{hint}"
            ) from None
    try:
        return cls.model_validate(fields)
    except ValidationError as e:
        raise ValueError(
            f"bad fp8 scaling in {text!r}: {_errors(e)}; accepted form {form}"
        ) from None


def parse_scaling(text: str) -> DelayedScaling | DynamicScaling:
    """Read a scaling recipe's text form: ``delayed/HISTORY/MARGIN/ALGO`` or
    ``dynamic/MARGIN`` (e.g. ``"delayed/16/0/max"``, ``"dynamic"``).

    Trailing fields may be omitted and take their defaults; names are case-insensitive.
    Raises ``ValueError`` naming the bad field, the accepted form and, for a value out of
    range, the bound.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_scaling takes a str, got {type(text).__name__}")
    return _scaling_from_parts([p.strip() for p in text.strip().split("/")], text, _SCALING_FORM)


def _scaling_tag(value: Any) -> str | None:
    # A dict without `kind` is the default recipe, delayed (as for Fp8Policy() and the
    # text form "hybrid"); the tag is case-insensitive like every name.
    if isinstance(value, dict):
        tag = _lower(value.get("kind", "delayed"))
        return tag if isinstance(tag, str) else repr(tag)
    kind = getattr(value, "kind", None)
    return kind if isinstance(kind, str) else None


def _scaling_input(value: object) -> object:
    if isinstance(value, str):
        return parse_scaling(value)
    if not isinstance(value, (dict, DelayedScaling, DynamicScaling)):
        raise ValueError(
            f"scaling must be a DelayedScaling, a DynamicScaling, a dict of their fields or "
            f"text in the form {_SCALING_FORM}; got {type(value).__name__} {value!r}"
        )
    return value


Scaling = Annotated[
    Annotated[DelayedScaling, Tag("delayed")] | Annotated[DynamicScaling, Tag("dynamic")],
    Discriminator(_scaling_tag),
    BeforeValidator(_scaling_input),
]
"""A scaling recipe: ``DelayedScaling`` or ``DynamicScaling``. Read from an instance, a dict
(``kind`` picks the recipe and defaults to ``"delayed"``) or the text form
(``parse_scaling``)."""


class Fp8Policy(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """How fp8 linears quantize: the format scheme and the scaling recipe.

    Text form (used inside a ``ComputeCtx`` policy string): ``hybrid/delayed/16/0/max``
    (scheme/recipe/history_len/margin/algo) or ``e4m3/dynamic/0`` (scheme/recipe/margin).
    Every name is case-insensitive; ``scaling`` also reads its own text form
    (``Fp8Policy(scaling="dynamic")``) and a dict without ``kind`` (delayed).
    """

    format: Annotated[Fp8Scheme, BeforeValidator(_lower)] = Fp8Scheme.HYBRID
    """Format scheme: ``hybrid`` (E4M3 forward, E5M2 gradients), ``e4m3`` or ``e5m2``."""
    scaling: Scaling = Field(default_factory=DelayedScaling)
    """Scaling recipe: ``DelayedScaling`` (default) or ``DynamicScaling``, or its text form
    (``"delayed/16/0/max"``, ``"dynamic/0"``)."""

    def __str__(self) -> str:
        """``SCHEME/`` followed by the scaling recipe's text form."""
        return f"{self.format}/{self.scaling}"

    @classmethod
    def parse(cls, text: str) -> Fp8Policy:
        """Read the text form ``str(policy)`` writes; trailing fields may be omitted and
        take their defaults (``"hybrid"``, ``"e4m3/dynamic"``); names are case-insensitive."""
        if not isinstance(text, str):
            raise TypeError(f"Fp8Policy.parse takes a str, got {type(text).__name__}")
        parts = [p.strip() for p in text.strip().split("/")]
        try:
            scheme = Fp8Scheme.parse(parts[0])
        except ValueError:
            schemes = ", ".join(repr(s.value) for s in Fp8Scheme)
            hint = ""
            if parts[0].lower() in _RECIPES:
                hint = f"; the scheme comes first, e.g. {'hybrid/' + text.strip().lower()!r}"
            raise ValueError(
                f"unknown fp8 scheme in {text!r}; accepted: {schemes} (form {_POLICY_FORM}){hint}"
            ) from None
        if len(parts) == 1:
            return cls(format=scheme)
        scaling = _scaling_from_parts(parts[1:], text, _POLICY_FORM, prefix=f"{scheme}/")
        return cls(format=scheme, scaling=scaling)
