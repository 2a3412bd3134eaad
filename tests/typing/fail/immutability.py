"""A ComputeCtx never changes in place: every assignment is a type error."""

import torch

from computectx import ComputeCtx, DType, OptimState
from computectx.formats import DelayedScaling

ctx = ComputeCtx.new(DType.BF16, "cpu")
ctx.compute = DType.F32  # E: misc
ctx.kv = DType.F32  # E: misc
ctx.device = torch.device("cpu")  # E: misc
policy = DelayedScaling()
policy.history_len = 4  # E: misc
ctx.optim_state = OptimState(format="int8")  # E: misc
state = OptimState(format="int4")
state.block = 64  # E: misc
