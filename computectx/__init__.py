"""computectx: one immutable compute policy for PyTorch models.

``ComputeCtx`` decides compute, KV-cache (a dtype or fp8) and accumulation dtypes, weight
residency, the device, and the fp8 and memory policy (optimizer state included); everything
downstream reads it and never re-decides.
The names below load on first use, so ``computectx --help`` answers without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from computectx.activations import Activations, parse_activations
    from computectx.ctx import ComputeCtx
    from computectx.dtypes import (
        DType,
        Fp8Format,
        PromotionError,
        cast_if,
        dtype_of,
        promote,
        promoted,
    )
    from computectx.kv_policy import KvFp8
    from computectx.optim_state import OPTIM_STATE_FLAGS, OptimState, parse_optim_state
    from computectx.residency import Residency, available_bytes

__version__ = "0.2.0"

__all__ = [
    "OPTIM_STATE_FLAGS",
    "Activations",
    "ComputeCtx",
    "DType",
    "Fp8Format",
    "KvFp8",
    "OptimState",
    "PromotionError",
    "Residency",
    "__version__",
    "available_bytes",
    "cast_if",
    "dtype_of",
    "parse_activations",
    "parse_optim_state",
    "promote",
    "promoted",
]

_HOME = {
    "Activations": "activations",
    "parse_activations": "activations",
    "ComputeCtx": "ctx",
    "DType": "dtypes",
    "Fp8Format": "dtypes",
    "KvFp8": "kv_policy",
    "PromotionError": "dtypes",
    "cast_if": "dtypes",
    "dtype_of": "dtypes",
    "promote": "dtypes",
    "promoted": "dtypes",
    "OPTIM_STATE_FLAGS": "optim_state",
    "OptimState": "optim_state",
    "parse_optim_state": "optim_state",
    "Residency": "residency",
    "available_bytes": "residency",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
