"""fp8 training and serving: policy, scaling state, reference twins, autograd, modules.

Modules in this package import ``ComputeCtx`` only for type checking: ``computectx.ctx``
imports ``computectx.fp8.policy``, so a run-time import back into ``computectx.ctx`` from
here would be circular.
"""

from computectx.fp8.policy import DelayedScaling, DynamicScaling, Fp8Policy, Fp8Scheme

__all__ = ["DelayedScaling", "DynamicScaling", "Fp8Policy", "Fp8Scheme"]
