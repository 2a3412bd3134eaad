"""What user code may do with the policy API; mypy must accept it and it must run."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import assert_type

from computectx import (
    ComputeCtx,
    DType,
    Fp8Format,
    KvFp8,
    OptimState,
    Residency,
    cast_if,
    promote,
    promoted,
)
from computectx.formats import (
    DelayedScaling,
    DynamicScaling,
    Fp4Recipe,
    Fp8Scheme,
    QuantizedLinear,
    Recipe,
)
from computectx.formats.convert import Converter
from computectx.optim_state import StateFormat
from computectx.recipes import parse_scaling

ctx = ComputeCtx.new(DType.BF16, "cpu")
serving = ComputeCtx.serving(torch.device("cpu")).with_kv(DType.F32).with_accum(DType.F64)
assert_type(serving, ComputeCtx)
# An fp8 KV cache is a KvFp8 in the same field: kv is a dtype or an fp8 cache setting.
fp8_kv = ComputeCtx.serving("cpu").with_kv(KvFp8(format=Fp8Format.E5M2, scaling="per_head"))
assert_type(fp8_kv.kv, DType | KvFp8)
assert_type(ctx.replace(kv=KvFp8()), ComputeCtx)
assert_type(KvFp8.parse("e4m3/per_tensor").static, bool)
if isinstance(fp8_kv.kv, KvFp8):
    assert_type(fp8_kv.kv.format, Fp8Format)
fp8 = ctx.replace(recipe=Recipe(format=Fp8Scheme.HYBRID, scaling=DynamicScaling(margin=1)))
assert_type(fp8.fp8, Recipe | Fp4Recipe | None)  # the old name of recipe, 4-bit too
assert_type(ctx.compute, DType)
assert_type(ctx.device, torch.device)
assert_type(promote(ctx.compute, DType.F16), DType)
assert_type(Residency.AUTO.resolve(10, 20), Residency)
assert_type(Fp8Format.E4M3.max, float)

x = torch.randn(2, 8, dtype=torch.bfloat16)
y = ctx.precise(x, lambda t: torch.softmax(t, dim=-1))
assert_type(y, torch.Tensor)
a, b = promoted(x, torch.zeros(2, 8))
assert_type(a, torch.Tensor)
assert_type(cast_if(x, DType.F32), torch.Tensor)
assert_type(ComputeCtx.parse(str(ctx)), ComputeCtx)
assert_type(DType.parse("half"), DType)
with ctx.autocast():
    pass

# Text forms read back to typed values; the fp8 conversion's extension point takes
# QuantizedLinear.from_linear as a converter.
assert_type(parse_scaling("dynamic/2"), DelayedScaling | DynamicScaling)
assert_type(ComputeCtx.from_flag("fp8_hybrid_dynamic", "cpu"), ComputeCtx)

# How optimizer state is stored: an OptimState, set by value or by its text form.
int8 = ctx.replace(optim_state=OptimState(format="int8"))
assert_type(int8, ComputeCtx)
assert_type(int8.optim_state, OptimState)
assert_type(int8.optim_state.format, StateFormat)
assert_type(int8.optim_state.block_size, int)
assert_type(ctx.with_optim_state("int4/block=64").optim_state.quantized, bool)
assert_type(OptimState.parse("bf16").compact, bool)


class TitanLinear(nn.Linear):
    pass


converters: dict[type[nn.Linear], Converter] = {TitanLinear: QuantizedLinear.from_linear}
