"""What dtypes the data-parallel collectives run at: the policy's, read from the ``ComputeCtx``.

``fsdp_mixed_precision(ctx)`` is the ``MixedPrecisionPolicy`` FSDP2 takes under ``ctx``:
every parameter gathers (and the layers compute) at ``ctx.compute``, gradients are
reduce-scattered at ``ctx.grad``, and the floating-point inputs of each sharded module are
cast to ``ctx.compute`` (FSDP2's default, as torchtitan's ``mixed_precision_param`` /
``mixed_precision_reduce`` do). ``parallelize(strategy="fsdp")`` passes it to every
``fully_shard``; call it yourself where you shard by hand (Lightning's
``ModelParallelStrategy``, a torchtitan ``parallelize_fn``).

The fp8 weights are unaffected: a ``WeightGatheredQuantized`` hands FSDP2 its own all-gather
inputs (``fsdp_pre_all_gather``: the codes of its high-precision shard, as ``uint8``), which
FSDP2 never casts, so the codes and the bytes are those of the float32 master; only the
nominal dtype of the gathered ``QuantizedWeight`` (the dtype of its gradient) becomes
``ctx.compute``. docs/distributed.md, "Mixed precision under FSDP2 and DDP", has the bytes,
the bounds against one process and why DDP's all-reduce keeps its own dtype.
"""

from __future__ import annotations

from torch.distributed.fsdp import MixedPrecisionPolicy

from computectx.ctx import ComputeCtx

__all__ = ["fsdp_mixed_precision"]


def fsdp_mixed_precision(ctx: ComputeCtx) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` under ``ctx``: ``param_dtype=ctx.compute``,
    ``reduce_dtype=ctx.grad`` (FSDP2 leaves parameters already at ``ctx.compute``, and
    integer ones, as they are)."""
    if not isinstance(ctx, ComputeCtx):
        raise TypeError(f"ctx must be a computectx.ComputeCtx, got {type(ctx).__name__}")
    return MixedPrecisionPolicy(param_dtype=ctx.compute.torch, reduce_dtype=ctx.grad.torch)
