"""computectx on many ranks: the one place that talks to ``torch.distributed``.

A process group or a ``DeviceMesh`` is runtime, not policy: it is passed where it is used, never
stored in ``ComputeCtx`` (whose text and JSON forms stay lossless). Nothing in the core imports
this package.
"""

from computectx.distributed.expert_parallel import (
    AllToAllDispatch,
    clip_grad_norm_with_experts,
    expert_parallel,
    expert_parallel_group,
    expert_parameters,
    full_state_dict,
    moe_local_buffers,
    update_expert_bias,
)
from computectx.distributed.fp4_all_gather import WeightGatheredFp4, enable_fp4_all_gather
from computectx.distributed.fp4_counters import sync_fp4_counters
from computectx.distributed.fp4_expert_gather import ExpertsGatheredFp4, enable_fp4_expert_gather
from computectx.distributed.fp8_all_gather import (
    GatherFallbackWarning,
    WeightGatheredQuantized,
    enable_quantized_all_gather,
    gathers_quantized,
)
from computectx.distributed.fp8_amax_sync import (
    AmaxSync,
    rescale_grad_ledger,
    scaling_buffer_names,
    sync_scaling,
)
from computectx.distributed.fp8_expert_gather import (
    ExpertsGatheredQuantized,
    enable_quantized_expert_gather,
)
from computectx.distributed.frozen_broadcast import broadcast_frozen
from computectx.distributed.grad_accumulator import DataParallelGradAccumulator
from computectx.distributed.group import agree, agree_ok, data_parallel_group, join
from computectx.distributed.mixed_precision import fsdp_mixed_precision
from computectx.distributed.optimizer_checkpoint import (
    check_optimizer_state_dict,
    optimizer_state_dict,
    set_optimizer_state_dict,
)
from computectx.distributed.parallel import Parallel, Strategy, parallelize
from computectx.distributed.same_setup import check_same_policy
from computectx.distributed.sharding import ShardedParams
from computectx.distributed.tensor_parallel import dtensor_quantized_linear

__all__ = [
    "AllToAllDispatch",
    "AmaxSync",
    "DataParallelGradAccumulator",
    "ExpertsGatheredFp4",
    "ExpertsGatheredQuantized",
    "GatherFallbackWarning",
    "Parallel",
    "ShardedParams",
    "Strategy",
    "WeightGatheredFp4",
    "WeightGatheredQuantized",
    "agree",
    "agree_ok",
    "broadcast_frozen",
    "check_optimizer_state_dict",
    "check_same_policy",
    "clip_grad_norm_with_experts",
    "data_parallel_group",
    "dtensor_quantized_linear",
    "enable_fp4_all_gather",
    "enable_fp4_expert_gather",
    "enable_quantized_all_gather",
    "enable_quantized_expert_gather",
    "expert_parallel",
    "expert_parallel_group",
    "expert_parameters",
    "fsdp_mixed_precision",
    "full_state_dict",
    "gathers_quantized",
    "join",
    "moe_local_buffers",
    "optimizer_state_dict",
    "parallelize",
    "rescale_grad_ledger",
    "scaling_buffer_names",
    "set_optimizer_state_dict",
    "sync_fp4_counters",
    "sync_scaling",
    "update_expert_bias",
]


# The 0.1.0 names, plain aliases of the names above until 0.3.0 (CHANGELOG.md; not in __all__).
ExpertsGatheredAsFp8 = ExpertsGatheredQuantized
Fp8AmaxSync = AmaxSync
Fp8GatherFallbackWarning = GatherFallbackWarning
WeightGatheredAsFp8 = WeightGatheredQuantized
dtensor_fp8_linear = dtensor_quantized_linear
enable_fp8_all_gather = enable_quantized_all_gather
enable_fp8_expert_gather = enable_quantized_expert_gather
fp8_buffer_names = scaling_buffer_names
gathers_as_fp8 = gathers_quantized
sync_fp8_scaling = sync_scaling
