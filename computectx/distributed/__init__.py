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
from computectx.distributed.fp8_all_gather import (
    Fp8GatherFallbackWarning,
    WeightGatheredAsFp8,
    enable_fp8_all_gather,
    gathers_as_fp8,
)
from computectx.distributed.fp8_amax_sync import (
    Fp8AmaxSync,
    fp8_buffer_names,
    rescale_grad_ledger,
    sync_fp8_scaling,
)
from computectx.distributed.fp8_expert_gather import (
    ExpertsGatheredAsFp8,
    enable_fp8_expert_gather,
)
from computectx.distributed.grad_accumulator import DataParallelGradAccumulator
from computectx.distributed.group import (
    agree,
    agree_ok,
    check_same_policy,
    data_parallel_group,
    join,
)
from computectx.distributed.mixed_precision import fsdp_mixed_precision
from computectx.distributed.optimizer_checkpoint import (
    check_optimizer_state_dict,
    optimizer_state_dict,
    set_optimizer_state_dict,
)
from computectx.distributed.parallel import Parallel, Strategy, parallelize
from computectx.distributed.sharding import ShardedParams
from computectx.distributed.tensor_parallel import dtensor_fp8_linear

__all__ = [
    "AllToAllDispatch",
    "DataParallelGradAccumulator",
    "ExpertsGatheredAsFp8",
    "Fp8AmaxSync",
    "Fp8GatherFallbackWarning",
    "Parallel",
    "ShardedParams",
    "Strategy",
    "WeightGatheredAsFp8",
    "agree",
    "agree_ok",
    "check_optimizer_state_dict",
    "check_same_policy",
    "clip_grad_norm_with_experts",
    "data_parallel_group",
    "dtensor_fp8_linear",
    "enable_fp8_all_gather",
    "enable_fp8_expert_gather",
    "expert_parallel",
    "expert_parallel_group",
    "expert_parameters",
    "fp8_buffer_names",
    "fsdp_mixed_precision",
    "full_state_dict",
    "gathers_as_fp8",
    "join",
    "moe_local_buffers",
    "optimizer_state_dict",
    "parallelize",
    "rescale_grad_ledger",
    "set_optimizer_state_dict",
    "sync_fp8_scaling",
    "update_expert_bias",
]
