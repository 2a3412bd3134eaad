"""The optimizers of ``computectx.memory``: master weights, compact state and the step.

- ``offloaded``: ``OffloadedOptimizer``, any ``torch.optim`` class stepping master copies
  (``ctx.master``) on ``ctx.offload_device``;
- ``compact``: ``CompactOptimizer``, any ``torch.optim`` class stepping the model's own
  parameters, its state stored as ``ctx.optim_state``;
- ``_wrapper``: what both share (the inner optimizer's objects, the step, the skip of
  non-finite gradients, the load); ``_masters`` (groups and master weights),
  ``_grad_ingest`` (gradients onto the masters), ``_grad_health`` (the clip norm and the
  non-finite verdict);
- ``stepper``: ``Stepper``, the per-parameter step over compact state and weights below
  float32; ``fused``: the Adam(W) update on packed state in one (compilable) function;
- ``checkpoint``: what an optimizer checkpoint holds and the checks a saved one passes;
- ``state``: optimizer state in its stored form (codecs, quantization maps, the
  per-parameter entry, loading a state dict saved under any format).

"State" in this package means the optimizer state torch keeps per parameter (moments,
``step``); the fp8 scaling state is ``computectx.formats.scaling``'s.
"""

from computectx.memory.optim.compact import CompactOptimizer
from computectx.memory.optim.offloaded import OffloadedOptimizer

__all__ = ["CompactOptimizer", "OffloadedOptimizer"]
