"""The fp8 linear: its plan, the router and the tensor-wise and block-wise autograd functions,
recompute and autocast, the fp8 weight subclasses, and ``Fp8Linear`` (``linear.module``).

Up to 0.1.0 this name was the module holding ``Fp8Linear``; reading one of that
module's names here still works for one release, with a ``DeprecationWarning``.
"""

from computectx._moved import package_getattr

__getattr__ = package_getattr(
    "computectx.fp8.linear", "Fp8Linear's module", ("computectx.fp8.linear.module",)
)
