"""How optimizer state is stored: the ``optim_state`` policy. Pure data in the core layer.

``ComputeCtx.optim_state`` holds an ``OptimState``; ``computectx.memory`` reads it (the codecs
own the bytes, the optimizers the stepping). The formats:

- ``f32``: torch's own state, untouched (the default: today's behaviour).
- ``bf16``: every parameter-shaped state tensor stored in bfloat16 (round to nearest).
- ``int8``: block-wise absmax with the dynamic (tree) map of Dettmers et al.: the signed map
  for signed state (first moments, momentum), the unsigned map for non-negative state (second
  moments, sums of squares).
- ``fp8``: block-wise e4m3 codes with one float32 scale per block (``absmax / 448``).
- ``int4``: signed state block-wise with a signed 4-bit dynamic-exponent map; non-negative
  state rank-1 normalized (per-row and per-column maxima of the tensor viewed 2-D as
  ``(shape[0], -1)``; a 1-D tensor uses blocks) with the 4-bit linear map that excludes zero
  (Li et al., lpmm). Two codes per byte.

Scalars (``step``) and tensors with fewer than ``min_size`` elements stay float32 in every
format (bitsandbytes' ``min_8bit_size``). Blocks never straddle parameters (nor shards).

Text form ``FORMAT[/block=N][/min=M]`` (``"int8"``, ``"int4/block=64/min=0"``), names in any
case; JSON form ``{"format": "int8", "block": 256, "min_size": 4096}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, get_args

from pydantic import BeforeValidator, model_validator
from typing_extensions import Self

from computectx._checks import CheckedModel, checked_int, read_value, text_int

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_MIN_SIZE",
    "OPTIM_STATE_FLAGS",
    "OptimState",
    "OptimStateField",
    "StateFormat",
    "parse_optim_state",
]

StateFormat = Literal["f32", "bf16", "int8", "fp8", "int4"]
"""How each parameter-shaped optimizer state tensor is stored (see the module docstring)."""
OPTIM_STATE_FLAGS: Final[tuple[str, ...]] = get_args(StateFormat)
"""The format names, as the text form and a ``--optim-state``-style flag spell them."""
DEFAULT_BLOCK: Final[dict[str, int]] = {"int8": 256, "fp8": 256, "int4": 128}
"""The block size of each block-wise format when none is given (bitsandbytes' and torchao's
256 for 8 bits, torchao's and lpmm's 128 for 4 bits)."""
DEFAULT_MIN_SIZE: Final = 4096
"""State tensors with fewer elements than this stay float32 (bitsandbytes' ``min_8bit_size``)."""
BLOCK_RANGE: Final = (32, 4096)
"""The smallest and largest block size accepted (powers of two between them)."""

_FORM = "'FORMAT[/block=N][/min=M]'"
_FORMATS = ", ".join(OPTIM_STATE_FLAGS)
_BLOCKS = f"a power of two from {BLOCK_RANGE[0]} to {BLOCK_RANGE[1]}"
_TAKES = f"an OptimState dict takes 'format' ({_FORMATS}), 'block' and 'min_size', each optional"
_ACCEPTED = (
    f"an OptimState, its text form {_FORM} with FORMAT one of {_FORMATS}, or its dict "
    f"{{'format': ..., 'block': ..., 'min_size': ...}}"
)
_TEXT_KEYS = {"block": "block", "min": "min_size", "min_size": "min_size"}
_ACCEPTS = {
    "block": f"{_BLOCKS} (an int; None for the format's default)",
    "min_size": "an int from 0 to 2**63 - 1",
}


def _format(value: object) -> object:
    # Names are case-insensitive everywhere in the policy.
    key = value.strip().lower() if isinstance(value, str) else value
    if key not in OPTIM_STATE_FLAGS:
        raise ValueError(f"unknown optimizer state format {value!r}; accepted: {_FORMATS}")
    return key


MIN_SIZE_MAX: Final = 2**63 - 1
"""The largest ``min_size`` accepted (the largest element count a torch tensor can have)."""


def _integer(value: object, what: str) -> int:
    return checked_int(
        value, what + " must be an integer, got {type} {value!r}; accepted: " + _ACCEPTS[what]
    )


def _block(value: object) -> object:
    if value is None:
        return None
    block = _integer(value, "block")
    lo, hi = BLOCK_RANGE
    if not (lo <= block <= hi and block & (block - 1) == 0):
        raise ValueError(f"block={block} is not {_BLOCKS}")
    return block


def _min_size(value: object) -> object:
    size = _integer(value, "min_size")
    if size < 0:
        raise ValueError(f"min_size={size} is negative; accepted: an integer >= 0")
    if size > MIN_SIZE_MAX:
        raise ValueError(f"min_size={size} is too large; accepted: {_ACCEPTS['min_size']}")
    return size


class OptimState(CheckedModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """How an optimizer's parameter-shaped state tensors are stored (``ComputeCtx.optim_state``).

    ``OptimState()`` is float32 state (torch's own, untouched); ``OptimState(format="int8")``
    block-wise 8-bit moments (blocks of 256), ``OptimState(format="int4", block=64)`` 4-bit
    moments in blocks of 64. Scalars and tensors with fewer than ``min_size`` elements stay
    float32 in every format.

    Text form ``FORMAT[/block=N][/min=M]`` (``"int8"``, ``"int4/block=64/min=0"``: the block
    and min only when not the default), which ``parse`` reads back in any case with the parts
    after ``FORMAT`` in any order; JSON form ``{"format": "int8", "block": 256,
    "min_size": 4096}``.
    """

    format: Annotated[StateFormat, BeforeValidator(_format)] = "f32"
    """Storage format of each state tensor: ``f32`` (default), ``bf16``, ``int8`` (block-wise
    dynamic map), ``fp8`` (block-wise e4m3) or ``int4`` (block-wise signed, rank-1
    normalized non-negative)."""
    block: Annotated[int | None, BeforeValidator(_block)] = None
    """Elements per quantization block of ``int8``, ``fp8`` and ``int4``: a power of two from
    32 to 4096, filled in from ``DEFAULT_BLOCK`` when not given (256, 256, 128); always
    ``None`` for ``f32`` and ``bf16``, which have no blocks."""
    min_size: Annotated[int, BeforeValidator(_min_size)] = DEFAULT_MIN_SIZE
    """State tensors with fewer elements than this stay float32 (default 4096); ``0`` compacts
    every non-scalar state tensor. Only meaningful for a compact format, so ``f32`` keeps the
    default."""

    def __init__(self, /, **data: Any) -> None:
        """Validated fields; a bad one is a ``ValueError`` naming the field, the value and
        what is accepted (``CheckedModel``). Typed as taking any values: a format reads in
        any case, so a literal type would refuse what the value accepts."""
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _default_block(cls, data: Any) -> Any:
        # The default block is filled in here so that "int8" and "int8/block=256" are one
        # value (equal, one text form). A bad format is left for the field's own error.
        if isinstance(data, dict) and data.get("block") is None:
            fmt = data.get("format", "f32")
            key = fmt.strip().lower() if isinstance(fmt, str) else None
            if key in DEFAULT_BLOCK:
                data = {**data, "block": DEFAULT_BLOCK[key]}
        return data

    @model_validator(mode="after")
    def _fits_format(self) -> Self:
        if self.format in DEFAULT_BLOCK:
            return self
        if self.block is not None:
            raise ValueError(
                f"block={self.block} given for format {self.format}, which has no blocks; a "
                f"block applies to {', '.join(DEFAULT_BLOCK)} only"
            )
        if self.format == "f32" and self.min_size != DEFAULT_MIN_SIZE:
            raise ValueError(
                f"min_size={self.min_size} given for format f32, which keeps every tensor "
                f"float32; min_size applies to {', '.join(OPTIM_STATE_FLAGS[1:])} only"
            )
        return self

    @property
    def block_size(self) -> int:
        """The block size in elements (``0`` for ``f32`` and ``bf16``, which have none)."""
        return 0 if self.block is None else self.block

    @property
    def compact(self) -> bool:
        """Whether state is stored below float32 (every format but ``f32``)."""
        return self.format != "f32"

    @property
    def quantized(self) -> bool:
        """Whether state is stored as codes with scales (``int8``, ``fp8``, ``int4``)."""
        return self.format in DEFAULT_BLOCK

    def __str__(self) -> str:
        """The text form ``FORMAT[/block=N][/min=M]`` (only what differs from the defaults),
        which ``parse`` reads back."""
        parts: list[str] = [self.format]
        if self.block is not None and self.block != DEFAULT_BLOCK[self.format]:
            parts.append(f"block={self.block}")
        if self.min_size != DEFAULT_MIN_SIZE:
            parts.append(f"min={self.min_size}")
        return "/".join(parts)

    @classmethod
    def parse(cls, text: str) -> OptimState:
        """Read the text form ``FORMAT[/block=N][/min=M]`` (``"int8"``, ``"INT4/min=0/block=64"``):
        names in any case, the parts after ``FORMAT`` in any order (``min_size=M`` is read as
        ``min=M``). ``ValueError`` quoting ``text`` and naming the accepted form otherwise."""
        if not isinstance(text, str):
            raise TypeError(f"OptimState.parse takes a str, got {type(text).__name__}")
        shown = text.strip()
        head, *rest = [p.strip() for p in shown.split("/")]
        fmt = head.lower()
        if fmt not in OPTIM_STATE_FLAGS:
            raise ValueError(
                f"unknown optimizer state format {head!r} in {shown!r}; accepted: {_FORMATS} "
                f"(form {_FORM})"
            )
        data: dict[str, object] = {"format": fmt}
        for part in rest:
            key, sep, value = (s.strip() for s in part.partition("="))
            name = _TEXT_KEYS.get(key.lower())
            if not sep or name is None:
                raise ValueError(
                    f"bad part {part!r} in optimizer state {shown!r}; accepted: block=N, min=M "
                    f"(form {_FORM})"
                )
            if name in data:
                raise ValueError(f"{key.lower()} given twice in optimizer state {shown!r}")
            where = f"optimizer state {shown!r}"
            data[name] = text_int(key.lower(), value, where, f" (form {_FORM})")
        return cls._from_text(data, "optimizer state", shown)


def parse_optim_state(value: object) -> OptimState:
    """An ``OptimState`` from an ``OptimState``, its text form (``"int8"``,
    ``"int4/block=64"``) or its JSON form (a dict of ``format``, ``block``, ``min_size``, each
    optional). Anything else raises ``ValueError`` quoting it and naming the accepted forms (a
    dict with another key: naming the key and the three fields)."""
    return read_value(value, OptimState, OptimState.parse, "optimizer state", _TAKES, _ACCEPTED)


def _lenient(value: object) -> object:
    # Text ("int8/block=128") reads through OptimState.parse; a dict is left to pydantic, so
    # its errors carry the field's location; anything else gets parse_optim_state's error.
    return value if isinstance(value, dict) else parse_optim_state(value)


OptimStateField = Annotated[OptimState, BeforeValidator(_lenient)]
"""An ``OptimState`` field (``ComputeCtx.optim_state``) that also reads the text form."""
