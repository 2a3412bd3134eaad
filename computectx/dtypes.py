"""The compute-dtype lattice, fp8 format constants, and the minimal casts built on them.

The lattice is data: ``_DIRECTLY_ABOVE`` says which dtype sits immediately above which.
Everything else (the order, the join, the golden table tests pin) is computed from it,
once, at import time. fp8 formats are deliberately *not* lattice members: an fp8 tensor
means nothing without its scale, so there is no implicit path from fp8 into the lattice.
``KvFp8`` (an fp8 KV cache, ``computectx.kv_policy``) is not one either: the cache quantizes
what enters it, which no cast can do.
"""

from __future__ import annotations

import enum
import itertools
from typing import Final

import torch

# Alias used in class bodies, where the `torch` properties would shadow the module name.
TorchDType = torch.dtype

__all__ = [
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "DType",
    "Fp8Format",
    "PromotionError",
    "cast_if",
    "dtype_of",
    "is_compute_dtype",
    "outside_lattice_message",
    "promote",
    "promoted",
]


class PromotionError(TypeError):
    """A dtype outside the compute lattice reached an operation that needs a lattice member."""


class DType(enum.Enum):
    """A floating-point compute dtype: a member of the promotion lattice.

    ``str(d)`` is the canonical name (``"bf16"``), ``DType.parse`` reads it back together
    with the usual aliases and ``torch.dtype`` values, and ``d.torch`` is the torch dtype.
    """

    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"
    F64 = "f64"

    # Members are singletons, so identity hashing is exact; it also keeps the lattice lookups
    # on precise()'s hot path in C (Enum's own __hash__ is a Python function).
    __hash__ = object.__hash__

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"DType.{self.name}"

    @property
    def torch(self) -> TorchDType:
        """The ``torch.dtype`` this member stands for."""
        return _TO_TORCH[self]

    @property
    def bits(self) -> int:
        """Storage width in bits."""
        return _TO_TORCH[self].itemsize * 8

    @classmethod
    def parse(cls, value: DType | str | TorchDType) -> DType:
        """Read a dtype from a canonical name, an alias, a ``torch.dtype`` or a ``DType``.

        Raises ``ValueError`` (naming the input and every accepted spelling) for anything
        else, including fp8, integer and complex dtypes.
        """
        if isinstance(value, DType):
            return value
        if isinstance(value, Fp8Format):
            raise ValueError(outside_lattice_message(value))
        if isinstance(value, torch.dtype):
            found = _FROM_TORCH.get(value)
            if found is None:
                raise ValueError(outside_lattice_message(value))
            return found
        if isinstance(value, str):
            found = _ALIASES.get(value.strip().lower())
            if found is None:
                raise ValueError(f"unknown dtype {value!r}; accepted: {accepted_dtype_spellings()}")
            return found
        raise ValueError(
            f"cannot read a dtype from {value!r} of type {type(value).__name__}; "
            f"accepted: a DType, a torch.dtype in the lattice, or one of "
            f"{accepted_dtype_spellings()}"
        )

    def __le__(self, other: object) -> bool:
        """Lattice order: ``a <= b`` when ``b`` represents every value of ``a``."""
        if not isinstance(other, DType):
            return NotImplemented
        return other in _UP_SET[self]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, DType):
            return NotImplemented
        return self is not other and other in _UP_SET[self]

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, DType):
            return NotImplemented
        return self in _UP_SET[other]

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, DType):
            return NotImplemented
        return self is not other and self in _UP_SET[other]


class Fp8Format(enum.Enum):
    """An 8-bit floating-point storage format (not a lattice member).

    Constants follow the OCP FP8 formats as torch implements them: ``E4M3`` is
    ``torch.float8_e4m3fn`` (finite only, no inf, max 448) and ``E5M2`` is
    ``torch.float8_e5m2`` (IEEE-like, max 57344).
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"Fp8Format.{self.name}"

    @property
    def torch(self) -> TorchDType:
        """The torch storage dtype."""
        return _FP8_TORCH[self]

    @property
    def max(self) -> float:
        """Largest finite magnitude; quantization saturates here."""
        return _FP8_CONSTANTS[self][0]

    @property
    def min_normal(self) -> float:
        """Smallest positive normal magnitude."""
        return _FP8_CONSTANTS[self][1]

    @property
    def min_subnormal(self) -> float:
        """Smallest positive (subnormal) magnitude: ``min_normal * 2**-mantissa_bits``."""
        return _FP8_CONSTANTS[self][1] * 2.0 ** -_FP8_CONSTANTS[self][2]

    @property
    def mantissa_bits(self) -> int:
        """Explicit mantissa bits; relative rounding error in the normal range is at most
        ``2**-(mantissa_bits + 1)``."""
        return _FP8_CONSTANTS[self][2]

    @property
    def exponent_bits(self) -> int:
        """Exponent field width."""
        return 7 - _FP8_CONSTANTS[self][2]

    @classmethod
    def parse(cls, value: Fp8Format | str | TorchDType) -> Fp8Format:
        """Read a format from ``"e4m3"``/``"fp8_e4m3"``/``"e5m2"``/``"fp8_e5m2"`` or a torch
        fp8 dtype; anything else raises ``ValueError`` naming the accepted spellings."""
        if isinstance(value, Fp8Format):
            return value
        if isinstance(value, torch.dtype):
            for fmt, dt in _FP8_TORCH.items():
                if dt == value:
                    return fmt
        elif isinstance(value, str):
            key = value.strip().lower()
            key = key.removeprefix("fp8_").removeprefix("float8_")
            key = key.removesuffix("fn")
            for fmt in Fp8Format:
                if fmt.value == key:
                    return fmt
        raise ValueError(
            f"unknown fp8 format {value!r}; accepted: 'e4m3', 'fp8_e4m3', 'e5m2', "
            f"'fp8_e5m2', torch.float8_e4m3fn, torch.float8_e5m2"
        )


_TO_TORCH: Final[dict[DType, torch.dtype]] = {
    DType.F16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.F32: torch.float32,
    DType.F64: torch.float64,
}
_FROM_TORCH: Final[dict[torch.dtype, DType]] = {v: k for k, v in _TO_TORCH.items()}

_ALIASES: Final[dict[str, DType]] = {
    "f16": DType.F16, "fp16": DType.F16, "float16": DType.F16, "half": DType.F16,
    "bf16": DType.BF16, "bfloat16": DType.BF16,
    "f32": DType.F32, "fp32": DType.F32, "float32": DType.F32, "float": DType.F32,
    "f64": DType.F64, "fp64": DType.F64, "float64": DType.F64, "double": DType.F64,
}  # fmt: skip

_FP8_TORCH: Final[dict[Fp8Format, torch.dtype]] = {
    Fp8Format.E4M3: torch.float8_e4m3fn,
    Fp8Format.E5M2: torch.float8_e5m2,
}
FP8_DTYPES: Final[tuple[torch.dtype, ...]] = tuple(_FP8_TORCH.values())
"""torch's fp8 dtypes of the two formats: what fp8 codes are stored as (weights, activations,
KV-cache codes, all-gathered shards)."""
FLOAT_DTYPES: Final[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16, torch.float32)
"""The floating dtypes fp8 works between: what it quantizes from, what its GEMMs and
dequantizes return, and what a 16/32-bit KV cache, a bias and a decode query may be."""
# (largest finite, smallest normal, mantissa bits). E4M3fn spends the all-ones exponent
# on normal numbers (only S.1111.111 is NaN), which is why its max is 1.75 * 2**8 = 448
# rather than the IEEE-style 240; E5M2 keeps IEEE inf/NaN, so max is 1.75 * 2**15.
_FP8_CONSTANTS: Final[dict[Fp8Format, tuple[float, float, int]]] = {
    Fp8Format.E4M3: (448.0, 2.0**-6, 3),
    Fp8Format.E5M2: (57344.0, 2.0**-14, 2),
}

# The lattice as data: each dtype and the dtypes *directly* above it. F16 and BF16 have the
# same width but different exponent/mantissa splits, so neither holds the other: they are
# incomparable and meet only at F32.
_DIRECTLY_ABOVE: Final[dict[DType, tuple[DType, ...]]] = {
    DType.F16: (DType.F32,),
    DType.BF16: (DType.F32,),
    DType.F32: (DType.F64,),
    DType.F64: (),
}


def _up_set(d: DType) -> frozenset[DType]:
    """``d`` and everything reachable upward from it (the reflexive-transitive closure)."""
    seen = {d}
    frontier = [d]
    while frontier:
        for above in _DIRECTLY_ABOVE[frontier.pop()]:
            if above not in seen:
                seen.add(above)
                frontier.append(above)
    return frozenset(seen)


_UP_SET: Final[dict[DType, frozenset[DType]]] = {d: _up_set(d) for d in DType}


def _least_upper_bound(a: DType, b: DType) -> DType:
    common = _UP_SET[a] & _UP_SET[b]
    # The least element of the common upper bounds is the one every other bound sits above.
    least = [c for c in common if all(o in _UP_SET[c] for o in common)]
    if len(least) != 1:  # pragma: no cover - guards edits to _DIRECTLY_ABOVE
        raise RuntimeError(f"the dtype lattice has no unique join for {a} and {b}")
    return least[0]


_JOIN: Final[dict[tuple[DType, DType], DType]] = {
    (a, b): _least_upper_bound(a, b) for a, b in itertools.product(DType, repeat=2)
}


def accepted_dtype_spellings() -> str:
    """The accepted dtype spellings, for error messages."""
    return ", ".join(repr(k) for k in _ALIASES)


def _explains(value: object) -> bool:
    """Whether ``value`` is a policy value that says why it is no dtype (a ``KvFp8``)."""
    return callable(getattr(value, "outside_lattice_message", None))


def is_compute_dtype(dt: torch.dtype) -> bool:
    """Whether ``dt`` is the torch dtype of a lattice member (f16, bf16, f32, f64)."""
    return dt in _FROM_TORCH


def outside_lattice_message(dt: object) -> str:
    """Why ``dt`` (an fp8 format, a torch dtype) is not a compute dtype, and what to do.

    The text every ``PromotionError`` about a non-lattice dtype carries: fp8 is pointed at
    its scale, anything else at an explicit cast.
    """
    explain = getattr(dt, "outside_lattice_message", None)
    if callable(explain):  # a policy value that is no dtype says why (KvFp8: an fp8 cache)
        return str(explain())
    if isinstance(dt, Fp8Format) or dt in _FP8_TORCH.values():
        return (
            f"{dt} is an fp8 storage format, not a compute dtype: an fp8 tensor means nothing "
            f"without its scale. Dequantize it through its scale first "
            f"(computectx.formats.dequantize_tensor(data, scale, dtype)); compute dtypes are "
            f"{', '.join(str(d) for d in DType)}"
        )
    return (
        f"{dt} is not in the compute lattice ({', '.join(str(d) for d in DType)}); "
        f"cast it explicitly to a floating dtype if that is what you mean"
    )


def dtype_of(t: torch.Tensor) -> DType:
    """The lattice member of ``t``'s dtype; ``PromotionError`` for fp8/int/bool/complex."""
    found = _FROM_TORCH.get(t.dtype)
    if found is None:
        raise PromotionError(outside_lattice_message(t.dtype))
    return found


def promote(a: DType, b: DType) -> DType:
    """The join ``a ⊔ b``: the least dtype that represents every value of both.

    Total, commutative, associative and idempotent on ``DType``. ``F16 ⊔ BF16 = F32``.
    Anything that is not a ``DType`` (an ``Fp8Format``, a ``torch.dtype``, a string)
    raises ``PromotionError``.
    """
    try:
        return _JOIN[(a, b)]
    except (KeyError, TypeError):
        bad = a if not isinstance(a, DType) else b
        raise PromotionError(
            f"promote takes two DType values, got {bad!r}; "
            + (
                outside_lattice_message(bad)
                if isinstance(bad, (Fp8Format, torch.dtype)) or _explains(bad)
                else "use DType.parse(...) to read a name or a torch.dtype"
            )
        ) from None


def cast_if(t: torch.Tensor, d: DType) -> torch.Tensor:
    """``t`` cast to ``d``, or ``t`` itself (the same object) when it is already ``d``.

    ``t`` must already hold a lattice dtype: an fp8 or integer tensor raises
    ``PromotionError`` instead of being cast silently.
    """
    target = _TO_TORCH.get(d) if isinstance(d, DType) else None
    if target is None:
        raise PromotionError(
            f"cast_if takes a DType target, got {d!r}; "
            + (
                outside_lattice_message(d)
                if isinstance(d, Fp8Format) or _explains(d)
                else "use DType.parse(...) to read a name or a torch.dtype"
            )
        )
    src = t.dtype
    if src is target:
        return t
    if src not in _FROM_TORCH:
        raise PromotionError(outside_lattice_message(src))
    return t.to(target)


def promoted(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bring two tensors to their join, casting only the operand below it.

    An operand already at the join comes back as the same tensor object.
    """
    p = _JOIN[(dtype_of(x), dtype_of(y))]
    return cast_if(x, p), cast_if(y, p)
