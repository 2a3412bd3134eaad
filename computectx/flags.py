"""The ``--dtype`` flags: each flag's compute dtype and recipe, the table ``ComputeCtx.from_flag``
and ``computectx demo --dtype`` read. Pure data in the core layer, below ``ctx``."""

from __future__ import annotations

from computectx.dtypes import DType
from computectx.fp4_recipe import Fp4Recipe
from computectx.recipes import DelayedScaling, DynamicScaling, Fp8Scheme, Recipe

__all__ = ["DTYPE_FLAGS", "FLAGS", "flag_policy"]


def _fp8_flags(suffix: str, scaling: DelayedScaling | DynamicScaling) -> dict[str, Recipe]:
    order = (Fp8Scheme.E4M3, Fp8Scheme.E5M2, Fp8Scheme.HYBRID)
    return {f"fp8_{s}{suffix}": Recipe(format=s, scaling=scaling) for s in order}


FLAGS: dict[str, tuple[DType, Recipe | Fp4Recipe | None]] = {
    "fp32": (DType.F32, None),
    "fp16": (DType.F16, None),
    "bf16": (DType.BF16, None),
    **{k: (DType.BF16, p) for k, p in _fp8_flags("", DelayedScaling()).items()},
    **{k: (DType.BF16, p) for k, p in _fp8_flags("_dynamic", DynamicScaling()).items()},
    # Row-wise (torchao's ROWWISE and ROWWISE_WITH_GW_HP): E4M3 both ways, dynamic.
    "fp8_rowwise": (DType.BF16, Recipe(granularity="row")),
    "fp8_rowwise_gw_hp": (DType.BF16, Recipe(granularity="row", gw_hp=True)),
    # Blocks (DeepSeek-V3's recipe: float32 block scales, not TransformerEngine's default
    # power-of-two ones, "e4m3/block+pow2/dynamic/0") and MXFP8 (TransformerEngine's
    # MXFP8BlockScaling): E4M3 both ways, dynamic.
    "fp8_block": (DType.BF16, Recipe(granularity="block")),
    "fp8_mx": (DType.BF16, Recipe(granularity="mx")),
    # 4 bits: TransformerEngine's NVFP4BlockScaling (16x16 weight tiles, stochastic rounding
    # of gradients, the Hadamard transform on the wgrad operands) and MXFP4 (1x32 E8M0 blocks).
    "nvfp4": (DType.BF16, Fp4Recipe()),
    "mxfp4": (DType.BF16, Fp4Recipe(format="mxfp4")),
}
"""Each ``--dtype`` flag, its compute dtype and its recipe. fp32 is parity (``new(F32)`` is the
same value); the fp8 flags are BF16 activations with fp8 linears, delayed scaling by default and
dynamic with the ``_dynamic`` suffix; ``nvfp4`` and ``mxfp4`` BF16 activations with 4-bit
linears."""

DTYPE_FLAGS: tuple[str, ...] = tuple(FLAGS)
"""The ``--dtype`` flags ``ComputeCtx.from_flag`` reads, in order: ``fp32``, ``fp16``, ``bf16``,
the fp8 schemes with delayed scaling (``fp8_e4m3``, ``fp8_e5m2``, ``fp8_hybrid``), the same with
dynamic scaling (``fp8_e4m3_dynamic``, ...), ``fp8_rowwise``, ``fp8_rowwise_gw_hp``,
``fp8_block``, ``fp8_mx``, then the 4-bit ``nvfp4`` and ``mxfp4`` (``ComputeCtx.from_flag`` and
``FLAGS`` say what each is)."""


def flag_policy(name: str) -> tuple[DType, Recipe | Fp4Recipe | None]:
    """The compute dtype and recipe of the ``--dtype`` flag ``name``, in any case;
    ``ValueError`` naming the flag and every accepted one otherwise."""
    key = name.strip().lower() if isinstance(name, str) else name
    found = FLAGS.get(key) if isinstance(key, str) else None
    if found is None:
        raise ValueError(
            f"unknown --dtype flag {name!r}; accepted: {', '.join(repr(f) for f in DTYPE_FLAGS)}"
        )
    return found
