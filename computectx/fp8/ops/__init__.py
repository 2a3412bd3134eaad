"""The fp8 operations: the one registry of ``computectx::`` operators (``ops.registry``), the
checked entry points (``ops.quantize``, ``ops.gemm``), the ledger and block quantizes behind
them, and the cuBLAS and Triton launchers (``ops.triton`` is the one importer of
``computectx.kernels``).

Up to 0.1.0 this name was the module of the checked entry points; reading one of its
names here still works for one release, with a ``DeprecationWarning``.
"""

from typing import TYPE_CHECKING

from computectx._moved import package_getattr as _package_getattr

if not TYPE_CHECKING:  # mypy reads the real modules: a typo stays an error
    __getattr__ = _package_getattr(
        "computectx.fp8.ops",
        "the checked entry points",
        ("computectx.fp8.ops.quantize", "computectx.fp8.ops.gemm", "computectx.dtypes"),
        {"QUANTIZABLE_DTYPES": "FLOAT_DTYPES"},
    )
