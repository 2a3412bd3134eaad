"""The fp8 recipe types, re-exported from the core module ``computectx.recipes``.

The recipe is data the policy carries, so it lives in the core; this module keeps the
import path ``computectx.fp8.policy`` working.
"""

from computectx.recipes import DelayedScaling, DynamicScaling, Fp8Policy, Fp8Scheme, Scaling

__all__ = ["DelayedScaling", "DynamicScaling", "Fp8Policy", "Fp8Scheme", "Scaling"]
