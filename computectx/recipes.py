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
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from computectx.dtypes import Fp8Format

__all__ = ["DelayedScaling", "DynamicScaling", "Fp8Policy", "Fp8Scheme", "Scaling"]


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


class DelayedScaling(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """Scale from the amax *history*: each step uses a scale derived from amaxes recorded
    on earlier steps, and records its own amax for later ones (one pass over the data).

    ``step = reduce(history) / (fmt.max / 2**margin)`` where ``reduce`` is the window max
    (``algo="max"``) or the newest entry (``algo="most_recent"``). The first call of an
    operand seeds the whole window with its current amax so step 1 is not blind.
    """

    kind: Literal["delayed"] = "delayed"
    """Discriminator for serialization; always ``"delayed"``."""
    history_len: int = Field(default=16, ge=1, le=1024)
    """Number of past amaxes kept per operand (the window of the ``max`` reduction)."""
    margin: int = Field(default=0, ge=0, le=16)
    """Headroom exponent: the scale leaves ``2**margin`` above the observed amax."""
    algo: Literal["max", "most_recent"] = "max"
    """Window reduction: ``"max"`` (stable) or ``"most_recent"`` (responsive)."""


class DynamicScaling(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """Scale from the *current* amax: measure, then quantize (an extra pass over the data,
    no state). ``step = amax(x) / (fmt.max / 2**margin)``."""

    kind: Literal["dynamic"] = "dynamic"
    """Discriminator for serialization; always ``"dynamic"``."""
    margin: int = Field(default=0, ge=0, le=16)
    """Headroom exponent: the scale leaves ``2**margin`` above the observed amax."""


Scaling = Annotated[DelayedScaling | DynamicScaling, Field(discriminator="kind")]


class Fp8Policy(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """How fp8 linears quantize: the format scheme and the scaling recipe.

    Text form (used inside a ``ComputeCtx`` policy string): ``hybrid/delayed/16/0/max``
    (scheme/recipe/history_len/margin/algo) or ``e4m3/dynamic/0`` (scheme/recipe/margin).
    """

    format: Fp8Scheme = Fp8Scheme.HYBRID
    """Format scheme: ``hybrid`` (E4M3 forward, E5M2 gradients), ``e4m3`` or ``e5m2``."""
    scaling: Scaling = Field(default_factory=DelayedScaling)
    """Scaling recipe: ``DelayedScaling`` (default) or ``DynamicScaling``."""

    def __str__(self) -> str:
        s = self.scaling
        if isinstance(s, DelayedScaling):
            return f"{self.format}/delayed/{s.history_len}/{s.margin}/{s.algo}"
        return f"{self.format}/dynamic/{s.margin}"

    @classmethod
    def parse(cls, text: str) -> Fp8Policy:
        """Read the text form ``str(policy)`` writes; trailing fields may be omitted and
        take their defaults (``"hybrid"``, ``"e4m3/dynamic"``)."""
        parts = [p.strip() for p in text.strip().split("/")]
        shape = "'SCHEME[/delayed[/HISTORY[/MARGIN[/ALGO]]]]' or 'SCHEME/dynamic[/MARGIN]'"
        schemes = ", ".join(repr(s.value) for s in Fp8Scheme)
        if not parts or parts[0] not in {s.value for s in Fp8Scheme}:
            raise ValueError(f"unknown fp8 scheme in {text!r}; accepted: {schemes} ({shape})")
        scheme = Fp8Scheme(parts[0])
        recipe = parts[1] if len(parts) > 1 else "delayed"
        args = parts[2:]
        try:
            if recipe == "delayed" and len(args) <= 3:
                names = ("history_len", "margin", "algo")
                fields: dict[str, object] = {
                    n: (v if n == "algo" else int(v)) for n, v in zip(names, args, strict=False)
                }
                return cls(format=scheme, scaling=DelayedScaling.model_validate(fields))
            if recipe == "dynamic" and len(args) <= 1:
                margin = {"margin": int(args[0])} if args else {}
                return cls(format=scheme, scaling=DynamicScaling.model_validate(margin))
        except ValueError as e:  # int() failures and pydantic's ValidationError alike
            raise ValueError(f"bad fp8 policy {text!r} ({shape}): {e}") from None
        raise ValueError(
            f"bad fp8 policy {text!r}; accepted recipes 'delayed', 'dynamic' in the form {shape}"
        )
