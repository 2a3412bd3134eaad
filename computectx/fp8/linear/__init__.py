"""The fp8 linear: its plan, the router and the tensor-wise and block-wise autograd functions,
recompute and autocast, the fp8 weight subclasses, and ``Fp8Linear`` (``linear.module``).

Up to 0.1.0 this name was the module holding ``Fp8Linear``; reading one of that
module's names here still works for one release, with a ``DeprecationWarning``.
"""

from typing import TYPE_CHECKING

from computectx._moved import package_getattr as _package_getattr

if not TYPE_CHECKING:  # mypy reads the real modules: a typo stays an error
    __getattr__ = _package_getattr(
        "computectx.fp8.linear", "Fp8Linear's module", ("computectx.fp8.linear.module",)
    )
