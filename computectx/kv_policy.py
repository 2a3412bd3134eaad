"""The fp8 KV cache in the policy: ``KvFp8`` (a code format, how steps are shared, how each step
is stored, and a window of recent positions kept unquantized), its text and JSON forms, and
``parse_kv``, which reads a KV-cache setting (a dtype or an fp8 cache) from any of them.

``KvFp8`` is not a lattice member: the cache quantizes what enters it, which no cast can do
(``computectx.dtypes`` explains that to whoever casts to one).
"""

from __future__ import annotations

from typing import Annotated, Final, Literal, get_args

import torch
from pydantic import BeforeValidator, Field

from computectx._checks import CheckedModel, checked_int
from computectx.dtypes import (
    FP8_DTYPES,
    DType,
    Fp8Format,
    accepted_dtype_spellings,
)

__all__ = [
    "KV_RECENT_MAX",
    "KV_SCALINGS",
    "KV_STEPS",
    "KvField",
    "KvFp8",
    "KvScaling",
    "KvStep",
    "parse_kv",
]

KvScaling = Literal["per_token_head", "per_head", "per_tensor"]
"""Which cached values share one step in an fp8 KV cache, and where the steps come from:
``per_token_head`` (dynamic: one step per (token, head) vector, from its amax when it is
written; no calibration), ``per_head`` (static: one step per head, from calibration) or
``per_tensor`` (static: one step per layer for keys and one for values, from calibration)."""
KV_SCALINGS: Final[tuple[KvScaling, ...]] = get_args(KvScaling)

KvStep = Literal["f32", "bf16", "e8m0"]
"""How each step of an fp8 KV cache is stored: ``f32`` (4 bytes, the exact ``amax / max``),
``bf16`` (2 bytes) or ``e8m0`` (1 byte, ``torch.float8_e8m0fnu``: a power of two). A bf16 or
e8m0 step is ``amax / max`` rounded *up* to the next value of its format, so no code of a
vector ever exceeds the format's max (nothing saturates that would not at f32)."""
KV_STEPS: Final[tuple[KvStep, ...]] = get_args(KvStep)
STEP_DTYPES: Final[dict[KvStep, torch.dtype]] = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "e8m0": torch.float8_e8m0fnu,
}
"""The torch dtype each step format is stored as."""
_STEP_ALIASES: Final[dict[str, KvStep]] = {
    "f32": "f32", "fp32": "f32", "float32": "f32",
    "bf16": "bf16", "bfloat16": "bf16",
    "e8m0": "e8m0", "e8m0fnu": "e8m0", "float8_e8m0fnu": "e8m0",
}  # fmt: skip

KV_RECENT_MAX: Final[int] = 1 << 20
"""The largest ``KvFp8.recent`` accepted (2**20 positions): a window is meant to be a few
recent positions; a cache holds at most ``max_len`` of them whatever ``recent`` says."""

_KV_FORM = (
    "'FORMAT[/SCALING][/STEP][/recent=N]' (FORMAT e4m3 or e5m2; SCALING "
    + ", ".join(KV_SCALINGS)
    + "; STEP "
    + ", ".join(KV_STEPS)
    + "; N a count of positions >= 0; the parts after FORMAT in any order)"
)


def _kv_format(value: object) -> object:
    # The format reads every spelling Fp8Format.parse does, in any case.
    if isinstance(value, (str, torch.dtype)):
        return Fp8Format.parse(value)
    return value


def _kv_lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


def _kv_step(value: object) -> object:
    if isinstance(value, torch.dtype):
        for name, dt in STEP_DTYPES.items():
            if dt == value:
                return name
    if isinstance(value, str):
        return _STEP_ALIASES.get(value.strip().lower(), value)
    return value


_RECENT = f"recent must be an int count of positions from 0 to {KV_RECENT_MAX}, got "


def _kv_recent(value: object) -> int:
    # A bool, a float, a str (a JSON "4") or None is refused rather than read as 0/1,
    # truncated or coerced.
    not_int = _RECENT + "{value!r} ({type})"
    return checked_int(value, not_int, range(KV_RECENT_MAX + 1), _RECENT + "{n}")


class KvFp8(CheckedModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """An fp8 KV cache: keys and values stored as fp8 codes of ``format``, each code standing
    for ``code * step`` with steps shared as ``scaling`` says and stored as ``step`` says;
    the ``recent`` most recently written positions are also held unquantized.

    ``ComputeCtx.kv`` holds a ``DType`` (a cache at that dtype: a plain cast) or a ``KvFp8``
    (a cache that quantizes what enters it). Serving with an fp8 cache is
    ``ComputeCtx.serving(device).with_kv(KvFp8())``: bf16 compute, e4m3 codes, dynamic
    ``per_token_head`` float32 steps (the default, which needs no calibration). The static
    schemes ``per_head`` and ``per_tensor`` take their steps from calibration
    (``computectx.nn.calibrate_kv``); a cache of a static scheme with no calibrated steps is
    refused when it is built, never run with a step of 1.0.

    Text form ``FORMAT/SCALING`` then ``/STEP`` when it is not ``f32`` and ``/recent=N`` when
    N > 0 (``e4m3/per_token_head``, ``e4m3/per_token_head/e8m0/recent=8``), which ``parse``
    reads back with everything after the format optional, in any order and any case; JSON
    form ``{"format": "e4m3", "scaling": "per_token_head", "step": "e8m0", "recent": 8}``,
    which leaves out ``step`` and ``recent`` at their defaults (so a setting of the earlier
    form dumps as it did: ``{"format": "e4m3", "scaling": "per_token_head"}``).
    """

    format: Annotated[Fp8Format, BeforeValidator(_kv_format)] = Fp8Format.E4M3
    """Storage format of the codes: ``e4m3`` (default: 3 mantissa bits, max 448) or ``e5m2``
    (2 mantissa bits, max 57344)."""
    scaling: Annotated[KvScaling, BeforeValidator(_kv_lower)] = "per_token_head"
    """Which values share a step: ``per_token_head`` (default, dynamic), ``per_head`` or
    ``per_tensor`` (static, calibrated)."""
    step: Annotated[KvStep, BeforeValidator(_kv_step), Field(exclude_if=lambda v: v == "f32")] = (
        "f32"
    )
    """How each step is stored (``KvStep``): ``f32`` (default, 4 bytes), ``bf16`` (2 bytes) or
    ``e8m0`` (1 byte, a power of two), rounded up to that format. It matters for
    ``per_token_head``, whose steps cost ``2 * H`` of them per token and layer (4 bytes per
    head at f32: 12.5% of the codes at head dim 32); a static scheme's few steps may take any
    format too, for the same reading everywhere."""
    recent: Annotated[
        int,
        BeforeValidator(_kv_recent),
        Field(ge=0, le=KV_RECENT_MAX, exclude_if=lambda v: v == 0),
    ] = 0
    """Positions kept unquantized (default 0): the cache also holds the last ``recent``
    positions written at the compute dtype of the keys written, and attention reads those
    positions from there instead of from their codes. Every position has its codes too
    (quantization is position-local, so codes written on entry are the codes of a position
    leaving the window), so the window costs ``2 * H * recent * D`` values of the compute
    dtype per layer and batch row, a fixed cost on top of ``kv_bytes_per_token``. An int
    from 0 to ``KV_RECENT_MAX`` (a numpy integer reads as its value; a bool, float, str or
    None is refused); a cache of ``max_len`` positions holds ``min(recent, max_len)``."""

    @property
    def static(self) -> bool:
        """Whether the steps come from calibration (``per_head``, ``per_tensor``) rather than
        from each (token, head) vector as it is written."""
        return self.scaling != "per_token_head"

    @property
    def step_dtype(self) -> torch.dtype:
        """The torch dtype the steps are stored as (``STEP_DTYPES``)."""
        return STEP_DTYPES[self.step]

    @property
    def step_bytes(self) -> int:
        """Bytes of one stored step: 4 (f32), 2 (bf16) or 1 (e8m0)."""
        return STEP_DTYPES[self.step].itemsize

    def __str__(self) -> str:
        """The text form ``FORMAT/SCALING[/STEP][/recent=N]``, which ``parse`` reads back."""
        text = f"{self.format}/{self.scaling}"
        if self.step != "f32":
            text += f"/{self.step}"
        if self.recent:
            text += f"/recent={self.recent}"
        return text

    def outside_lattice_message(self) -> str:
        """Why this setting is not a compute dtype (``computectx.dtypes`` quotes it)."""
        return (
            f"kv={self} is an fp8 KV cache, not a compute dtype: values enter it through the "
            f"cache's quantizer, which computes their steps (computectx.nn.KVCache), and leave "
            f"it dequantized in float32; no plain cast reaches it. Compute dtypes are "
            f"{', '.join(str(d) for d in DType)}"
        )

    @classmethod
    def parse(cls, text: str) -> KvFp8:
        """Read the text form ``FORMAT[/SCALING][/STEP][/recent=N]`` (``"e4m3/per_head"``,
        ``"E5M2"``, ``"e4m3/e8m0/recent=16"``): the parts after the format in any order, each
        at most once (``step=STEP`` is read as ``STEP``); ``ValueError`` quoting ``text`` and
        naming the accepted form otherwise."""
        if not isinstance(text, str):
            raise TypeError(f"KvFp8.parse takes a str, got {type(text).__name__}")
        whole = text.strip()
        parts = [p.strip().lower() for p in whole.split("/")]
        try:
            fmt = Fp8Format.parse(parts[0])
        except ValueError:
            raise ValueError(
                f"unknown fp8 KV cache format {parts[0]!r} in {whole!r}; form {_KV_FORM}"
            ) from None
        if len(parts) > 4:
            raise ValueError(f"too many fields in fp8 KV cache {whole!r}; form {_KV_FORM}")
        fields: dict[str, object] = {"format": fmt}
        for part in parts[1:]:
            key, value = _field_of(part, whole)
            if key in fields:
                raise ValueError(
                    f"the {key} of fp8 KV cache {whole!r} is given twice ({fields[key]!r} and "
                    f"{value!r}); form {_KV_FORM}"
                )
            fields[key] = value
        try:
            return cls(**{str(k): v for k, v in fields.items()})  # type: ignore[arg-type]
        except ValueError as e:  # recent beyond KV_RECENT_MAX
            raise ValueError(f"fp8 KV cache {whole!r}: {e} (form {_KV_FORM})") from None


def _field_of(part: str, whole: str) -> tuple[str, object]:
    """The field one ``/``-separated part of the text form sets, checked."""
    if part in KV_SCALINGS:
        return "scaling", part
    name, sep, value = part.partition("=")
    name, value = name.strip(), value.strip()
    if not sep and part in _STEP_ALIASES:
        return "step", _STEP_ALIASES[part]
    if sep and name == "step":
        if value in _STEP_ALIASES:
            return "step", _STEP_ALIASES[value]
        raise ValueError(
            f"unknown KV step format {value!r} in {whole!r}; accepted: "
            f"{', '.join(repr(s) for s in KV_STEPS)} (form {_KV_FORM})"
        )
    if sep and name == "recent":
        if not value.isdigit():
            raise ValueError(
                f"recent={value!r} in {whole!r} is not a count of positions; accepted: an "
                f"int >= 0 (form {_KV_FORM})"
            )
        return "recent", int(value)
    if sep:
        raise ValueError(
            f"unknown KV cache field {name!r} in {whole!r}; accepted: step=STEP "
            f"({', '.join(KV_STEPS)}) and recent=N (form {_KV_FORM})"
        )
    raise ValueError(
        f"unknown KV scaling {part!r} in {whole!r}; accepted: "
        f"{', '.join(repr(s) for s in KV_SCALINGS)}, or a step format "
        f"({', '.join(repr(s) for s in KV_STEPS)}) or recent=N (form {_KV_FORM})"
    )


def parse_kv(value: object) -> DType | KvFp8:
    """A KV-cache setting from a ``DType``, a ``KvFp8``, a dict of ``KvFp8`` fields (its JSON
    form), a lattice ``torch.dtype`` or text: a dtype spelling (``"f32"``) or an fp8 cache
    (``"e4m3/per_token_head"``, ``"e5m2"``, ``"e4m3/e8m0/recent=16"``).

    A bare fp8 format (an ``Fp8Format``, a torch fp8 dtype, ``"e4m3"``) is that format with
    the default, dynamic ``per_token_head`` float32 steps, as in the text form. Anything else
    raises ``ValueError`` quoting it and naming both accepted forms (a dict with a key other
    than ``KvFp8``'s fields: naming the key and the fields).
    """
    if isinstance(value, (DType, KvFp8)):
        return value
    if isinstance(value, dict):
        return KvFp8.from_fields(
            value,
            "fp8 KV cache",
            f"a KvFp8 dict takes 'format' (e4m3 or e5m2), 'scaling' ({', '.join(KV_SCALINGS)}), "
            f"'step' ({', '.join(KV_STEPS)}) and 'recent' (an int >= 0), all optional",
        )
    if isinstance(value, Fp8Format) or (isinstance(value, torch.dtype) and value in FP8_DTYPES):
        return KvFp8(format=Fp8Format.parse(value))
    if isinstance(value, str):
        try:
            return DType.parse(value)
        except ValueError:
            pass
        try:
            Fp8Format.parse(value.split("/")[0])
        except ValueError:
            if "/" in value:  # FORMAT/... with a bad format: KvFp8.parse names it
                return KvFp8.parse(value)
        else:
            return KvFp8.parse(value)
        raise ValueError(
            f"unknown kv {value.strip()!r}; accepted: a dtype ({accepted_dtype_spellings()}) "
            f"or an fp8 cache {_KV_FORM}"
        )
    try:
        return DType.parse(value)  # type: ignore[arg-type]
    except ValueError as err:  # it names the dtypes; add the fp8 cache forms
        raise ValueError(
            f"{err}; or an fp8 KV cache: a KvFp8, its dict {{'format': ..., 'scaling': ..., "
            f"'step': ..., 'recent': ...}}, an fp8 format (Fp8Format, a torch fp8 dtype) or "
            f"the text {_KV_FORM}"
        ) from None


KvField = Annotated[DType | KvFp8, BeforeValidator(parse_kv)]
"""The ``ComputeCtx.kv`` field: a dtype (as ``DType.parse`` reads it) or an fp8 cache (a
``KvFp8``, its dict or its text form), as ``parse_kv`` reads them."""
