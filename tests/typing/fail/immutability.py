"""A ComputeCtx never changes in place: every assignment is a type error."""

import torch

from computectx import ComputeCtx, DType
from computectx.fp8 import DelayedScaling

ctx = ComputeCtx.new(DType.BF16, "cpu")
ctx.compute = DType.F32  # E: misc
ctx.kv = DType.F32  # E: misc
ctx.device = torch.device("cpu")  # E: misc
policy = DelayedScaling()
policy.history_len = 4  # E: misc
