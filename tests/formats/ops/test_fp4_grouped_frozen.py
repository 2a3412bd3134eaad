"""Frozen 4-bit experts' operators (``formats.ops.fp4_grouped_frozen``): ``torch.library.opcheck``
on each, and the held grouped GEMM against the training one (``fp4_grouped_mm``) group for group."""

from __future__ import annotations

import torch

from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Quant
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.ops.fp4_grouped_frozen import dequantize_experts, held_grouped_mm

NV = Fp4Quant(format="nvfp4", weight_tile="16x16", hadamard=False)
# test_schema copies the inputs, which torch cannot do for float4_e2m1fn_x2 (as for
# fp4_scaled_mm's float4 operands: tests/formats/ops/test_fp4_ops.py).
WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
MX = Fp4Quant(format="mxfp4", mx_rounding="floor", hadamard=False)


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def held(w: torch.Tensor, how: Fp4Quant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    ops = [fp4_ops.quantize(w[e], how, weight=True) for e in range(w.shape[0])]
    amax = [q.amax.reshape(()) for q in ops if isinstance(q, Nvfp4Operand)]
    codes, scale = torch.stack([q.codes for q in ops]), torch.stack([q.scale for q in ops])
    return codes, scale, torch.stack(amax) if amax else None


def test_held_grouped_mm_is_the_grouped_forward_and_passes_opcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=gen).bfloat16()
    w = torch.randn(3, 16, 32, generator=gen)
    offs = offsets([5, 0, 16])  # an empty expert; rows 21-23 past the last
    ops = torch.ops.computectx
    for how in (NV, MX):
        codes, scale, amax = held(w, how)
        tile = how.weight_tile if how.format == "nvfp4" else "1x32"
        rule = {"tile": tile, "mx_rounding": how.mx_rounding}
        got = held_grouped_mm(x, codes, scale, amax, offs, per_row=False, **rule)  # type: ignore[arg-type]
        assert torch.equal(got, fp4_ops.grouped_mm(x, w, offs, how))
        em, bf16 = "emulated", torch.bfloat16
        args = (x, codes, scale, amax, offs, tile, how.mx_rounding, True, bf16, em)
        torch.library.opcheck(ops.fp4_held_grouped_mm, args, test_utils=WITHOUT_SCHEMA)
        deq = (codes, scale, amax, tile, torch.float32, em)
        torch.library.opcheck(ops.fp4_dequantize_experts, deq, test_utils=WITHOUT_SCHEMA)
        assert dequantize_experts(codes, scale, amax, tile, torch.bfloat16).shape == (3, 16, 32)
