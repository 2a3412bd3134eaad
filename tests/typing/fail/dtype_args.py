"""Only DType members go where a DType is required: not fp8 formats, strings or torch dtypes."""

import torch

from computectx import ComputeCtx, DType, Fp8Format, KvFp8, OptimState, cast_if, promote

ctx = ComputeCtx.new(DType.BF16, "cpu")
promote(DType.F16, Fp8Format.E4M3)  # E: arg-type
promote("bf16", DType.F32)  # E: arg-type
promote(DType.F32, torch.float32)  # E: arg-type
ctx.with_kv(Fp8Format.E5M2)  # E: arg-type
ctx.with_kv("f32")  # E: arg-type
ctx.with_accum(torch.float64)  # E: arg-type
cast_if(torch.zeros(2), Fp8Format.E4M3)  # E: arg-type
ComputeCtx.new(torch.bfloat16, "cpu")  # E: arg-type
ctx.replace(kv=Fp8Format.E4M3)  # E: arg-type
ctx.replace(compute="bf16")  # E: arg-type
ctx.replace(colour=DType.F32)  # E: call-arg
ctx.precise(torch.zeros(2), lambda t: t.tolist())  # E: arg-type return-value
ctx.with_kv("e4m3/per_head")  # E: arg-type
KvFp8.parse(Fp8Format.E4M3)  # E: arg-type
promote(DType.F32, KvFp8())  # E: arg-type
cast_if(torch.zeros(2), KvFp8())  # E: arg-type
ctx.replace(optim_state="int8")  # E: arg-type
ctx.with_optim_state(DType.BF16)  # E: arg-type
OptimState.parse(OptimState())  # E: arg-type
