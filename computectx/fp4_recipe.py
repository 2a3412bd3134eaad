"""The 4-bit recipes, NVFP4 and MXFP4: which blocks, which rounding, which transform, which layers
stay in high precision. Pure data in the core layer, beside the fp8 ``Recipe``.

``ComputeCtx.recipe`` holds an fp8 ``Recipe``, an ``Fp4Recipe`` or ``None``; the first word
tells them apart, in the text form and in JSON's ``format`` (``hybrid``, ``e4m3``, ``e5m2`` are
fp8; ``nvfp4``, ``mxfp4`` are 4-bit): ``AnyRecipe`` is that union and ``parse_recipe`` reads
either text form.

NVFP4 (TransformerEngine's ``NVFP4BlockScaling``): E2M1 values, one E4M3 scale per 16
consecutive elements and one float32 scale per tensor from the tensor's amax. What each GEMM
operand gets ("col": quantized along the tokens M, the weight-gradient GEMM's contraction):

    GEMM  A operand                           B operand
    Y     X, 1x16 along K, nearest            W, 16x16 tiles (1x16 with w1x16), nearest
    dX    dY, 1x16 along N, stochastic        W^T, the same tiles
    dW    dY^T col, Hadamard along M, stoch.  X^T col, Hadamard along M, nearest

MXFP4 (OCP): E2M1 values, one E8M0 scale (a power of two) per 32 elements along K for every
operand, its exponent rounded ``rceil`` (default) or ``floor``; no per-tensor scale; no
stochastic rounding or Hadamard transform unless asked (``sr``, ``rht``: Tseng et al.'s MXFP4
training recipe). Stochastic rounding applies to the gradients only (``dY``, both uses), drawn
from ``seed`` and a counter the layer keeps; the Hadamard transform (16x16, the fixed
``WGRAD_SIGNS``) to the two operands of the weight-gradient GEMM only, whose product it leaves
unchanged since ``(a T)(b T)^T = a b^T``.

Text form: ``FORMAT[+OPTION...]``, the options that differ from the format's defaults in a fixed
order (``str`` writes them so; any order reads): ``w1x16``/``w16x16``, ``sr``/``no_sr``,
``rht``/``no_rht``, ``rceil``/``floor``, ``seed=N``, ``hp_last=N`` and ``hp=PATTERN`` (repeated),
e.g. ``nvfp4``, ``nvfp4+w1x16+no_sr``, ``mxfp4+floor``, ``nvfp4+hp_last=2+hp=*.attn.*``. A 4-bit
recipe has no scaling part: every scale comes from the current amax of its block.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from typing_extensions import Self

from computectx._checks import as_int, text_int, validation_message
from computectx.recipes import Recipe, StrictBool, StrictInt, folded

__all__ = [
    "FP4_FORMATS",
    "WGRAD_SIGNS",
    "AnyRecipe",
    "Fp4Format",
    "Fp4Recipe",
    "parse_recipe",
]

Fp4Format = Literal["nvfp4", "mxfp4"]
"""The 4-bit formats: ``nvfp4`` (E4M3 scales per 16 elements and a float32 scale per tensor)
and ``mxfp4`` (E8M0 scales per 32 elements)."""
FP4_FORMATS: Final[tuple[Fp4Format, ...]] = get_args(Fp4Format)

WGRAD_SIGNS: Final[tuple[int, ...]] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""TransformerEngine's fixed sign vector of the wgrad operands' Hadamard transform
(``diag(signs) @ H16 / 4``): every ``Fp4Recipe`` records it, and refuses any other."""

_FORM = (
    "'nvfp4[+OPTION...]' or 'mxfp4[+OPTION...]' with options w1x16, w16x16, sr, no_sr, rht, "
    "no_rht, rceil, floor, seed=N, hp_last=N, hp=PATTERN"
)
# The text form's switches, each a field and a value.
_SWITCHES: dict[str, tuple[str, object]] = {
    "w1x16": ("weight_tile", "1x16"),
    "w16x16": ("weight_tile", "16x16"),
    "sr": ("stochastic", True),
    "no_sr": ("stochastic", False),
    "rht": ("hadamard", True),
    "no_rht": ("hadamard", False),
    "rceil": ("mx_rounding", "rceil"),
    "floor": ("mx_rounding", "floor"),
}
_NUMBERS = ("seed", "hp_last")  # the text form's NAME=N options
# A pattern of module names: what a dotted name holds, and fnmatch's * ? [seq] [!seq].
_PATTERN = re.compile(r"[a-z0-9_.*?\[\]!-]+")
# Each format's default for an option left out or null: nvfp4 is TransformerEngine's recipe.
_DEFAULTS: dict[str, dict[str, object]] = {
    "nvfp4": {"weight_tile": "16x16", "stochastic": True, "hadamard": True},
    "mxfp4": {"mx_rounding": "rceil", "stochastic": False, "hadamard": False},
}


class Fp4Recipe(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """How 4-bit linears quantize: NVFP4 or MXFP4, the weight tiles, stochastic rounding, the
    Hadamard transform and the layers kept in high precision (module docstring: what each GEMM
    operand gets, the text form).

    Defaults follow the format: ``nvfp4`` is TransformerEngine's recipe (16x16 weight tiles,
    stochastic rounding of gradients, the Hadamard transform on the wgrad operands), ``mxfp4``
    the OCP format (rceil exponents, neither). An option given as ``None`` (JSON null) is the
    format's default; booleans and integers are strict; names are case-insensitive. The
    output head, the embeddings and the routers stay in high precision as for fp8
    (``convert_to_quantized``); ``hp_last`` and ``hp`` name more.
    """

    format: Annotated[Fp4Format, BeforeValidator(folded)] = "nvfp4"
    """``nvfp4`` (default) or ``mxfp4``."""
    weight_tile: Annotated[Literal["16x16", "1x16"] | None, BeforeValidator(folded)] = None
    """``nvfp4`` only: the weight's scale blocks, ``16x16`` tiles (default: one scale serves
    W and W^T) or ``1x16`` rows; ``None`` for ``mxfp4``, whose weights are 1x32 blocks."""
    mx_rounding: Annotated[Literal["rceil", "floor"] | None, BeforeValidator(folded)] = None
    """``mxfp4`` only: how a block's E8M0 exponent is chosen, ``rceil`` (default) or
    ``floor`` (OCP); ``None`` for ``nvfp4``."""
    stochastic: StrictBool = True
    """Round the gradients' codes stochastically (on by default for ``nvfp4``, off for
    ``mxfp4``); forward operands always round to nearest."""
    hadamard: StrictBool = True
    """Apply the 16x16 random Hadamard transform to both wgrad operands along the tokens (on
    by default for ``nvfp4``, off for ``mxfp4``)."""
    hadamard_signs: tuple[int, ...] = WGRAD_SIGNS
    """The transform's sign vector: TransformerEngine's fixed ``WGRAD_SIGNS``, written in
    JSON so that a checkpoint records it; any other vector is refused."""
    seed: StrictInt = Field(default=0, ge=0, lt=2**64)
    """The key of stochastic rounding's random bits (Philox), in ``[0, 2**64)``; each layer
    advances its own counter, saved with its state. Nonzero only with ``stochastic``."""
    hp_last: StrictInt = Field(default=0, ge=0, le=4096)
    """How many final blocks (the model's last entries of its block list) keep every linear
    in high precision: the NVFP4 paper keeps the last ones."""
    hp: tuple[str, ...] = ()
    """``fnmatch`` patterns of module names kept in high precision (``*.attn.*``), matched
    case-insensitively; stored lowercased, sorted, once each."""

    @model_validator(mode="before")
    @classmethod
    def _format_defaults(cls, data: Any) -> Any:
        # The defaults that depend on the format, for an option left out or null; anything
        # but a dict of a known format is left to the fields' own validation.
        fmt = folded(data.get("format", "nvfp4")) if isinstance(data, dict) else None
        defaults = _DEFAULTS.get(fmt) if isinstance(fmt, str) else None
        if defaults is None:
            return data
        return data | {k: v for k, v in defaults.items() if data.get(k) is None}

    @field_validator("hadamard_signs", mode="before")
    @classmethod
    def _fixed_signs(cls, value: Any) -> Any:
        if not isinstance(value, (list, tuple)) or [as_int(v) for v in value] != list(WGRAD_SIGNS):
            raise ValueError(
                f"the Hadamard sign vector is fixed to TransformerEngine's WGRAD_SIGNS "
                f"{list(WGRAD_SIGNS)} (16 integers, each 1 or -1); got {value!r}"
            )
        return WGRAD_SIGNS

    @field_validator("hp", mode="before")
    @classmethod
    def _patterns(cls, value: Any) -> Any:
        if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
            raise ValueError(f"must be a list of module-name patterns (strings), got {value!r}")
        patterns = sorted({p.strip().lower() for p in value})
        for p in patterns:
            if not _PATTERN.fullmatch(p):
                raise ValueError(
                    f"bad module-name pattern {p!r}: a pattern holds letters, digits, '_', '.', "
                    f"'-' and fnmatch's '*', '?', '[seq]', '[!seq]' (no ',', '+', '/' or '=')"
                )
        return tuple(patterns)

    @model_validator(mode="after")
    def _check_format(self) -> Self:
        f = self.format
        if f == "mxfp4" and self.weight_tile is not None:
            raise ValueError(
                f"weight_tile={self.weight_tile!r} applies to format 'nvfp4' only: 'mxfp4' "
                f"scales every operand, weights included, in 1x32 blocks along K"
            )
        if f == "nvfp4" and self.mx_rounding is not None:
            raise ValueError(
                f"mx_rounding={self.mx_rounding!r} applies to format 'mxfp4' only: 'nvfp4' "
                f"block scales are E4M3, rounded to nearest"
            )
        if self.seed and not self.stochastic:
            raise ValueError(
                f"seed={self.seed} keys stochastic rounding, which is off in this recipe; "
                f"turn it on (stochastic=True, '+sr') or leave the seed at 0"
            )
        return self

    @property
    def block(self) -> int:
        """Elements per scale along K: 16 (``nvfp4``) or 32 (``mxfp4``)."""
        return 16 if self.format == "nvfp4" else 32

    def keeps_high(self, name: str, block: int | None = None, blocks: int = 0) -> bool:
        """Whether the module ``name`` stays in high precision by this recipe's own rule: it
        matches an ``hp`` pattern, or it sits in block ``block`` of ``blocks`` and that block is
        one of the last ``hp_last``."""
        if any(fnmatch.fnmatchcase(name.lower(), p) for p in self.hp):
            return True
        return block is not None and block >= blocks - self.hp_last

    def _options(self) -> list[str]:
        """The text form's options: those that differ from the format's defaults."""
        defaults, options = _DEFAULTS[self.format], []
        for word, (field, value) in _SWITCHES.items():
            if getattr(self, field) == value and defaults.get(field) != value:
                options.append(word)
        options += [f"{n}={getattr(self, n)}" for n in _NUMBERS if getattr(self, n)]
        return options + [f"hp={p}" for p in self.hp]

    def __str__(self) -> str:
        """``FORMAT[+OPTION...]``, the options that differ from the format's defaults."""
        return "+".join([self.format, *self._options()])

    @classmethod
    def parse(cls, text: str) -> Fp4Recipe:
        """Read the text form ``str(recipe)`` writes (module docstring), in any case and any
        order of options; ``ValueError`` naming the bad part and the accepted form."""
        if not isinstance(text, str):
            raise TypeError(f"Fp4Recipe.parse takes a str, got {type(text).__name__}")
        if "/" in text:
            raise ValueError(
                f"a 4-bit recipe has no scaling part, got {text!r}: NVFP4 and MXFP4 take every "
                f"scale from the current amax of its block; accepted form {_FORM}"
            )
        name, *options = [o.strip().lower() for o in text.split("+")]
        if name not in FP4_FORMATS:
            raise ValueError(f"unknown 4-bit format {name!r} in {text!r}; accepted form {_FORM}")
        fields: dict[str, Any] = {"format": name}
        for option in options:
            key, eq, value = (part.strip() for part in option.partition("="))
            if option in _SWITCHES:
                field, read = _SWITCHES[option]
            elif eq and key in _NUMBERS:
                field, read = key, text_int(key, value, repr(text), f"; form {_FORM}")
            elif eq and key == "hp":
                fields["hp"] = [*fields.get("hp", []), value]
                continue
            else:
                raise ValueError(f"unknown 4-bit option {option!r} in {text!r}; form {_FORM}")
            if field in fields:
                raise ValueError(f"{field} given twice in {text!r}")
            fields[field] = read
        try:
            return cls.model_validate(fields)
        except ValidationError as e:
            what = f"4-bit recipe {text!r}"
            raise ValueError(validation_message(e, what, cls.model_fields)) from None


def parse_recipe(text: str) -> Recipe | Fp4Recipe:
    """Read either recipe's text form: ``nvfp4[+...]`` and ``mxfp4[+...]`` are ``Fp4Recipe``s,
    anything else an fp8 ``Recipe`` (``Recipe.parse``); ``ValueError`` naming both forms."""
    if not isinstance(text, str):
        raise TypeError(f"parse_recipe takes a str, got {type(text).__name__}")
    if re.split(r"[+/]", text.strip(), maxsplit=1)[0].strip().lower() in FP4_FORMATS:
        return Fp4Recipe.parse(text)
    try:
        return Recipe.parse(text)
    except ValueError as e:
        raise ValueError(f"{e}; or a 4-bit recipe, {_FORM}") from None


def _recipe_tag(value: Any) -> str | None:
    # The first word: a dict's format (fp8's default, hybrid, when absent) or the instance.
    if isinstance(value, dict):
        return "fp4" if folded(value.get("format")) in FP4_FORMATS else "fp8"
    if isinstance(value, Fp4Recipe):
        return "fp4"
    return "fp8" if isinstance(value, Recipe) else None


def _recipe_text(value: object) -> object:
    return parse_recipe(value) if isinstance(value, str) else value


AnyRecipe = Annotated[
    Annotated[Recipe, Tag("fp8")] | Annotated[Fp4Recipe, Tag("fp4")],
    Discriminator(
        _recipe_tag,
        custom_error_type="recipe_type",
        custom_error_message=(
            "recipe must be a Recipe (fp8), an Fp4Recipe, a dict of either's fields or text "
            "('hybrid/delayed', 'e4m3/row', 'nvfp4', 'mxfp4+floor')"
        ),
    ),
    BeforeValidator(_recipe_text),
]
"""A recipe of either width: an fp8 ``Recipe`` or an ``Fp4Recipe``, told apart by the format
word. Read from an instance, a dict (``format`` picks: ``nvfp4``/``mxfp4`` are 4-bit, anything
else or none fp8) or either text form (``parse_recipe``)."""
