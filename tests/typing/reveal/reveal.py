"""What mypy infers for the policy API (checked against the R: comments)."""

import torch

from computectx import ComputeCtx, DType, promote, promoted

ctx = ComputeCtx.serving("cpu")
x = torch.zeros(2, dtype=torch.bfloat16)
reveal_type(promote(DType.F16, DType.BF16))  # R: computectx.dtypes.DType
reveal_type(ctx.precise(x, lambda t: t * 2))  # R: torch._tensor.Tensor
reveal_type(ctx.with_kv(DType.F32))  # R: computectx.ctx.ComputeCtx
reveal_type(ctx.replace(grad=DType.BF16))  # R: computectx.ctx.ComputeCtx
reveal_type(promoted(x, x))  # R: tuple[torch._tensor.Tensor, torch._tensor.Tensor]
reveal_type(ctx.accum)  # R: computectx.dtypes.DType
reveal_type(ctx.residency.resolve(1, 2))  # R: computectx.residency.Residency
reveal_type(ComputeCtx.from_flag("bf16", "cpu"))  # R: computectx.ctx.ComputeCtx
reveal_type(ctx.kv)  # R: computectx.dtypes.DType | computectx.kv_policy.KvFp8
reveal_type(ctx.with_optim_state("int8"))  # R: computectx.ctx.ComputeCtx
reveal_type(ctx.optim_state)  # R: computectx.optim_state.OptimState
