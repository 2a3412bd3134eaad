"""The old home of ``Fp8Linear`` and ``convert_to_fp8``, kept so its import path works.

``Fp8Linear`` lives in ``computectx.fp8.linear``; conversion (``convert_to_fp8``, its
report and its constants) in ``computectx.fp8.convert``. Import them from
``computectx.fp8``.
"""

from computectx.fp8.convert import (
    DEFAULT_MIN_FEATURES,
    FEATURE_MULTIPLE,
    Fp8ConversionReport,
    SkippedLinear,
    convert_to_fp8,
)
from computectx.fp8.linear import Fp8Linear

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FEATURE_MULTIPLE",
    "Fp8ConversionReport",
    "Fp8Linear",
    "SkippedLinear",
    "convert_to_fp8",
]
