"""The fp8 recipe: which formats, which granularity, which scaling recipe. Pure data in the
core layer.

``ComputeCtx.recipe`` holds a ``Recipe``; everything in ``computectx.formats`` reads it. The
recipe lives here, beside ``dtypes``, and not in ``computectx.formats``, so that the core never
imports the layer that consumes it (``computectx.formats.policy`` re-exports these names).

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
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from typing_extensions import Self

from computectx.dtypes import Fp8Format

__all__ = [
    "POLICY_GRANULARITIES",
    "DelayedScaling",
    "DynamicScaling",
    "Fp8Scheme",
    "PolicyGranularity",
    "Recipe",
    "Scaling",
    "parse_scaling",
]

_SCALING_FORM = "'delayed[/HISTORY[/MARGIN[/ALGO]]]' or 'dynamic[/MARGIN]'"
_POLICY_FORM = (
    "'SCHEME[/delayed[/HISTORY[/MARGIN[/ALGO]]]]', 'SCHEME/dynamic[/MARGIN]' or "
    "'[SCHEME/]GRANULARITY[+OPTION...][/dynamic[/MARGIN]]'"
)

PolicyGranularity = Literal["tensor", "row", "block", "mx"]
"""Which elements of an fp8 linear's operands share one step: ``tensor`` (one per tensor),
``row`` (one per row along the contraction dimension), ``block`` (1x128 activations and
gradients, 128x128 weights) or ``mx`` (1x32 blocks with E8M0 scales)."""
POLICY_GRANULARITIES: Final[tuple[PolicyGranularity, ...]] = get_args(PolicyGranularity)
# The options of the text form's granularity part (`row+gw_hp`), each a field and a value.
_OPTIONS: dict[str, tuple[str, object]] = {
    "gw_hp": ("gw_hp", True),
    "pow2": ("power_of_two", True),
    "no_pow2": ("power_of_two", False),
    "rceil": ("mx_rounding", "rceil"),
    "floor": ("mx_rounding", "floor"),
}


def folded(value: object) -> object:
    """A text value stripped and lowercased (anything else as it is): every name of the policy,
    fp8 or 4-bit, is case-insensitive through this."""
    return value.strip().lower() if isinstance(value, str) else value


def _flag(value: object) -> object:
    # Strict booleans: pydantic's lax mode would read "yes", "off", 1 or 0.0 as a bool, so a
    # typo in a JSON file would switch an option silently. None (JSON null) never reaches
    # here: the policy's before-validator turns it into the granularity's default.
    if not isinstance(value, bool):
        raise ValueError(
            f"must be a boolean, true or false (JSON) / True or False (Python), or null for "
            f"the default (the granularity's or format's); got {type(value).__name__} {value!r}"
        )
    return value


def _integer(value: object) -> object:
    # Strict integers: a bool (True is 1 to pydantic's lax mode), a string or a float is
    # refused, so JSON `"margin": true` or `"history_len": "16"` never reads as a number. The
    # text forms convert their digits to int before they get here.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer, got {type(value).__name__} {value!r}")
    return value


StrictBool = Annotated[bool, BeforeValidator(_flag)]
"""A strictly boolean policy field (``True``/``False``, JSON ``true``/``false``)."""
StrictInt = Annotated[int, BeforeValidator(_integer)]
"""A strictly integral policy field (no bool, string or float)."""


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
        key = folded(value)
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

    kind: Annotated[Literal["delayed"], BeforeValidator(folded)] = "delayed"
    """Discriminator for serialization; always ``"delayed"`` (optional on input: a recipe
    without ``kind`` is delayed)."""
    history_len: StrictInt = Field(default=16, ge=1, le=1024)
    """Number of past amaxes kept per operand (the window of the ``max`` reduction)."""
    margin: StrictInt = Field(default=0, ge=0, le=16)
    """Headroom exponent: the scale leaves ``2**margin`` above the observed amax."""
    algo: Annotated[Literal["max", "most_recent"], BeforeValidator(folded)] = "max"
    """Window reduction: ``"max"`` (stable) or ``"most_recent"`` (responsive)."""

    def __str__(self) -> str:
        """The text form ``delayed/HISTORY/MARGIN/ALGO``, which ``parse_scaling`` reads."""
        return f"delayed/{self.history_len}/{self.margin}/{self.algo}"


class DynamicScaling(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """Scale from the *current* amax: measure, then quantize (an extra pass over the data,
    no state). ``step = amax(x) / (fmt.max / 2**margin)``."""

    kind: Annotated[Literal["dynamic"], BeforeValidator(folded)] = "dynamic"
    """Discriminator for serialization; always ``"dynamic"``."""
    margin: StrictInt = Field(default=0, ge=0, le=16)
    """Headroom exponent: the scale leaves ``2**margin`` above the observed amax (per tensor:
    a ``Recipe`` of granularity ``row``, ``block`` or ``mx`` refuses a nonzero one)."""

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
    # A dict without `kind` is the default recipe, delayed (as for Recipe() and the
    # text form "hybrid"); the tag is case-insensitive like every name.
    if isinstance(value, dict):
        tag = folded(value.get("kind", "delayed"))
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


def _granularity_name(part: str) -> str:
    """The granularity a text-form part names (``"row+gw_hp"`` -> ``"row"``), lowercased."""
    return part.split("+")[0].strip().lower()


def _granularity_fields(part: str, text: str) -> dict[str, object]:
    """The fields of the text form's granularity part ``GRANULARITY[+OPTION...]``."""
    name, *options = [o.strip().lower() for o in part.split("+")]
    fields: dict[str, object] = {"granularity": name}
    for option in options:
        if option not in _OPTIONS:
            accepted = ", ".join(repr(o) for o in _OPTIONS)
            raise ValueError(
                f"unknown fp8 granularity option {option!r} in {text!r}; accepted: {accepted} "
                f"(form {_POLICY_FORM})"
            )
        field, value = _OPTIONS[option]
        if field in fields:
            raise ValueError(f"{field} given twice in {part.strip()!r} of {text!r}")
        fields[field] = value
    return fields


class Recipe(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """How fp8 linears quantize: the format scheme, the granularity and the scaling recipe.

    Text form (used inside a ``ComputeCtx`` policy string): ``hybrid/delayed/16/0/max``
    (scheme/recipe/history_len/margin/algo) or ``e4m3/dynamic/0`` (scheme/recipe/margin)
    for per-tensor scaling; a finer granularity follows the scheme, with its options after
    ``+``: ``e4m3/row/dynamic/0``, ``e4m3/row+gw_hp/dynamic/0``, ``e4m3/block+pow2/dynamic/0``,
    ``e4m3/mx+floor/dynamic/0`` (options: ``gw_hp``, ``pow2``, ``no_pow2``, ``rceil``,
    ``floor``; ``str`` writes those that differ from the granularity's defaults). Every name
    is case-insensitive; ``scaling`` also reads its own text form
    (``Recipe(scaling="dynamic")``) and a dict without ``kind`` (the granularity's recipe).
    Booleans and integers are strict (no ``"yes"``, ``1`` or ``"16"``); a ``None`` option is
    the granularity's default.

    Defaults follow the granularity: per tensor, ``hybrid`` and delayed scaling; ``row``,
    ``block`` and ``mx`` (the anchors' recipes) ``e4m3`` and dynamic scaling (delayed
    scaling and a nonzero margin are per-tensor only, and refused for the others: their
    steps come from each block's current amax). Power-of-two steps are on for
    ``row`` and ``mx`` (always), off for ``block`` (optional) and ``tensor``; ``mx`` rounds
    its exponents ``rceil`` unless told ``floor``.
    """

    format: Annotated[Fp8Scheme, BeforeValidator(folded)] = Fp8Scheme.HYBRID
    """Format scheme: ``hybrid`` (E4M3 forward, E5M2 gradients), ``e4m3`` or ``e5m2``
    (default ``hybrid`` per tensor, ``e4m3`` for the finer granularities)."""
    scaling: Scaling = Field(default_factory=DelayedScaling)
    """Scaling recipe: ``DelayedScaling`` (the per-tensor default) or ``DynamicScaling`` (the
    default and the only recipe of the finer granularities), or its text form
    (``"delayed/16/0/max"``, ``"dynamic/0"``)."""
    granularity: Annotated[PolicyGranularity, BeforeValidator(folded)] = "tensor"
    """Which elements share one step: ``tensor`` (default), ``row`` (one step per row along
    the contraction dimension), ``block`` (1x128 activations and gradients, 128x128
    weights) or ``mx`` (1x32 blocks, E8M0 scales)."""
    power_of_two: StrictBool = False
    """Round every measured step up to a power of two: on by default for ``row``, always on
    for ``mx``, optional for ``block``, off (and refused) per tensor."""
    mx_rounding: Annotated[Literal["floor", "rceil"] | None, BeforeValidator(folded)] = None
    """How an ``mx`` block's exponent is chosen: ``"rceil"`` (default for ``mx``) or
    ``"floor"`` (OCP); ``None`` (and only ``None``) for the other granularities."""
    gw_hp: StrictBool = False
    """``row`` only: the weight-gradient GEMM runs in high precision (torchao's
    ``ROWWISE_WITH_GW_HP``)."""

    @model_validator(mode="before")
    @classmethod
    def _granularity_defaults(cls, data: Any) -> Any:
        # The defaults that depend on the granularity: the format, the recipe (also the
        # recipe of a scaling dict without `kind`: delayed per tensor, dynamic for the finer
        # granularities, whose only recipe it is, unless the dict holds delayed's own fields,
        # `history_len` or `algo`: then it is delayed, and refused with the rule), powers of
        # two, the mx rounding and gw_hp. A None option (JSON null) reads as "the
        # granularity's default".
        if not isinstance(data, dict):
            return data
        g = folded(data.get("granularity", "tensor"))
        if g not in POLICY_GRANULARITIES:
            return data  # the field's own validation names the accepted values
        out = dict(data)
        if g != "tensor":
            out.setdefault("format", Fp8Scheme.E4M3)
            out.setdefault("scaling", DynamicScaling())
            scaling = out["scaling"]
            delayed_only = set(_TEXT_FIELDS["delayed"]) - set(_TEXT_FIELDS["dynamic"])
            if isinstance(scaling, dict) and not {"kind", *delayed_only} & set(scaling):
                out["scaling"] = {"kind": "dynamic", **scaling}
        if out.get("power_of_two") is None:
            out["power_of_two"] = g in ("row", "mx")
        if out.get("mx_rounding") is None and g == "mx":
            out["mx_rounding"] = "rceil"
        if out.get("gw_hp") is None:
            out["gw_hp"] = False
        return out

    @model_validator(mode="after")
    def _check_granularity(self) -> Self:
        g = self.granularity
        if g != "tensor" and isinstance(self.scaling, DelayedScaling):
            raise ValueError(
                f"delayed scaling is per-tensor only: granularity {g!r} takes every step from "
                f"the current amax of its block, so it needs dynamic scaling, e.g. "
                f"{f'{self.format}/{g}/dynamic'!r}"
            )
        if g != "tensor" and self.scaling.margin:
            raise ValueError(
                f"margin={self.scaling.margin} applies to per-tensor scaling only: granularity "
                f"{g!r} takes each step from the current amax of the very block it quantizes, "
                f"so no value outgrows its step and a margin would only leave 2**margin of the "
                f"format's range unused (TransformerEngine's block recipes and torchao's "
                f"row-wise one have none); write margin 0, e.g. "
                f"{f'{self.format}/{self._granularity_text()}/dynamic/0'!r}"
            )
        if g == "tensor" and self.power_of_two:
            raise ValueError(
                "power_of_two applies to granularities 'row' and 'block' ('mx' steps are always "
                "powers of two), not 'tensor', whose step is amax / fmt.max"
            )
        if g == "mx" and not self.power_of_two:
            raise ValueError(
                "granularity 'mx' has E8M0 scales, always powers of two; power_of_two=False "
                "cannot apply (choose the exponent's rounding with mx_rounding)"
            )
        if g != "mx" and self.mx_rounding is not None:
            raise ValueError(
                f"mx_rounding applies to granularity 'mx' only, not {g!r}; for power-of-two "
                f"steps set power_of_two=True"
            )
        if g != "row" and self.gw_hp:
            raise ValueError(
                f"gw_hp (a high-precision weight-gradient GEMM, torchao's "
                f"ROWWISE_WITH_GW_HP) applies to granularity 'row' only, not {g!r}"
            )
        return self

    def _granularity_text(self) -> str:
        """The text form's granularity part, ``GRANULARITY[+OPTION...]``."""
        return "+".join([self.granularity, *self._options()])

    def _options(self) -> list[str]:
        """The text form's options: those that differ from the granularity's defaults."""
        g, options = self.granularity, []
        if self.gw_hp:
            options.append("gw_hp")
        if g == "row" and not self.power_of_two:
            options.append("no_pow2")
        if g == "block" and self.power_of_two:
            options.append("pow2")
        if g == "mx" and self.mx_rounding == "floor":
            options.append("floor")
        return options

    def __str__(self) -> str:
        """``SCHEME/``, then ``GRANULARITY[+OPTION...]/`` unless per tensor, then the scaling
        recipe's text form."""
        if self.granularity == "tensor":
            return f"{self.format}/{self.scaling}"
        return f"{self.format}/{self._granularity_text()}/{self.scaling}"

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """Read the text form ``str(policy)`` writes; trailing fields may be omitted and
        take their defaults (``"hybrid"``, ``"e4m3/dynamic"``, ``"e4m3/row"``), and so may the
        scheme before a granularity (``"row+gw_hp"``); names are case-insensitive."""
        if not isinstance(text, str):
            raise TypeError(f"Recipe.parse takes a str, got {type(text).__name__}")
        parts = [p.strip() for p in text.strip().split("/")]
        fields: dict[str, object] = {}
        if _granularity_name(parts[0]) in POLICY_GRANULARITIES:
            fields.update(_granularity_fields(parts[0], text))
            rest = parts[1:]
        else:
            try:
                fields["format"] = Fp8Scheme.parse(parts[0])
            except ValueError:
                schemes = ", ".join(repr(s.value) for s in Fp8Scheme)
                hint = ""
                if parts[0].lower() in _RECIPES:
                    hint = f"; the scheme comes first, e.g. {'hybrid/' + text.strip().lower()!r}"
                raise ValueError(
                    f"unknown fp8 scheme in {text!r}; accepted: {schemes} (form "
                    f"{_POLICY_FORM}){hint}"
                ) from None
            rest = parts[1:]
            if rest and _granularity_name(rest[0]) in POLICY_GRANULARITIES:
                fields.update(_granularity_fields(rest[0], text))
                rest = rest[1:]
        if rest:
            prefix = "/".join(p.lower() for p in parts[: len(parts) - len(rest)]) + "/"
            fields["scaling"] = _scaling_from_parts(rest, text, _POLICY_FORM, prefix=prefix)
        try:
            return cls.model_validate(fields)
        except ValidationError as e:
            msgs = "; ".join(str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
            raise ValueError(f"bad fp8 policy {text!r}: {msgs}") from None


# The 0.1.0 name of ``Recipe``, a plain alias until 0.3.0 (CHANGELOG.md): a ctx pickled by
# 0.1.0 names its recipe's class by this path.
Fp8Policy = Recipe
