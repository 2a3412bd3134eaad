"""computectx: one immutable compute policy for PyTorch models.

``ComputeCtx`` decides compute, KV-cache and accumulation dtypes, weight residency, the
device, and the fp8 and memory policy; everything downstream reads it and never re-decides.
"""

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
from computectx.residency import Residency, available_bytes

__version__ = "0.1.0"

__all__ = [
    "ComputeCtx",
    "DType",
    "Fp8Format",
    "PromotionError",
    "Residency",
    "__version__",
    "available_bytes",
    "cast_if",
    "dtype_of",
    "promote",
    "promoted",
]
