"""Memory policy driven by ``ComputeCtx``: where gradients, master weights, optimizer state
and checkpoint weights live, at which dtype, and how many bytes each device holds.

- ``LowPrecGradAccumulator``: drains gradients during backward into ``ctx.grad`` buffers
  on ``ctx.offload_device`` and sums micro-batches (bounded error; nearest or stochastic).
- ``OffloadedOptimizer``: any ``torch.optim`` optimizer stepping ``ctx.master`` copies on
  ``ctx.offload_device``; a ``torch.optim.Optimizer`` to schedulers and checkpoints.
- ``CompactOptimizer``: any ``torch.optim`` optimizer stepping the model's own parameters
  with its state stored as ``ctx.optim_state`` (bf16, int8, fp8, int4), bf16 weights
  updated with stochastic rounding (``OffloadedOptimizer`` does the same on its masters).
- ``memory_report`` / ``MemoryReport``: bytes per device and role, each storage once.
- ``save_weights`` / ``load_weights``: safetensors checkpoints placed by ``ctx.residency``.
- ``expert_residency`` / ``prefetch_experts``: how many bytes of each memory-mapped expert
  are resident, and reading ahead only the experts a batch selects.
"""

from computectx.memory.accounting import MemoryReport, memory_report
from computectx.memory.accumulator import LowPrecGradAccumulator
from computectx.memory.activation_bytes import SavedActivations
from computectx.memory.expert_residency import ExpertResidency, expert_residency, prefetch_experts
from computectx.memory.optim import CompactOptimizer, OffloadedOptimizer
from computectx.memory.weights import load_weights, save_weights

__all__ = [
    "CompactOptimizer",
    "ExpertResidency",
    "LowPrecGradAccumulator",
    "MemoryReport",
    "OffloadedOptimizer",
    "SavedActivations",
    "expert_residency",
    "load_weights",
    "memory_report",
    "prefetch_experts",
    "save_weights",
]
