"""Frozen 4-bit experts' operators (``formats.ops.fp4_grouped_frozen``): ``torch.library.opcheck``
on each, and the held grouped GEMM against the training one (``fp4_grouped_mm``) group for group."""

from __future__ import annotations

import pytest
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
        fmt, op_tile = how.format, tile if how.format == "nvfp4" else "1x16"
        args = (x, codes, scale, amax, offs, fmt, op_tile, how.mx_rounding, None, bf16, em, True)
        torch.library.opcheck(ops.fp4_grouped_mm_gathered, args, test_utils=WITHOUT_SCHEMA)
        deq = (codes, scale, amax, tile, torch.float32, em)
        torch.library.opcheck(ops.fp4_dequantize_experts, deq, test_utils=WITHOUT_SCHEMA)
        assert dequantize_experts(codes, scale, amax, tile, torch.bfloat16).shape == (3, 16, 32)


def test_the_operators_check_every_operand_against_the_codes_expert_count() -> None:
    # Each was accepted (a silent number) or a torch IndexError / RuntimeError before.
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 32, generator=gen).bfloat16(), torch.randn(4, 32, 32, generator=gen)
    codes, scale, amax = held(w, NV)
    assert amax is not None
    offs, bf16, em = offsets([2, 1, 0, 2]), torch.bfloat16, "emulated"
    # The frozen W4A4 GEMM is computectx::fp4_grouped_mm_gathered with per_row (or not).
    mm, dq = (
        torch.ops.computectx.fp4_grouped_mm_gathered,
        torch.ops.computectx.fp4_dequantize_experts,
    )
    rule, tail = ("nvfp4", "16x16", "rceil", None), (em, True)
    bad = [
        ((x, codes, scale, amax, offs[:3], *rule, bf16, *tail), r"offs \[E\] for codes"),
        ((x, codes, scale, amax, offsets([1] * 5), *rule, bf16, *tail), r"offs \[E\] for codes"),
        ((x, codes, scale, amax[:3], offs, *rule, bf16, *tail), r"one float32 amax each, \(4,\)"),
        ((x, codes, scale[:3], amax, offs, *rule, bf16, *tail), r"expected .*\(4, 2, 2\)"),
        ((x, codes, scale, amax.neg(), offs, *rule, bf16, *tail), "finite and >= 0"),
        ((x, codes, scale, amax * float("nan"), offs, *rule, bf16, *tail), "finite and >= 0"),
        ((x, codes, scale, amax, offs, *rule, torch.int32, *tail), "out_dtype must be one of"),
        ((x, codes, scale, None, offs, *rule, bf16, *tail), "NVFP4 experts take their amaxes"),
        ((x[:, :16], codes, scale, amax, offs, *rule, bf16, *tail), r"takes a \[M, K\]"),
        ((x, codes, scale, amax, offs, *rule[:3], torch.tensor([1, 2]), bf16, *tail), "per_row"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            mm(*args)
    with pytest.raises(ValueError, match=r"E >= 1 experts, got codes \(0, 32, 16\)"):
        mm(x, codes[:0], scale[:0], amax[:0], offs[:0], *rule, bf16, *tail)
    dq_bad: list[tuple[tuple[object, ...], str]] = [
        ((codes, scale, amax, "16x16", torch.int32, em), "out_dtype must be one of"),
        ((codes, scale, amax, "1x16", torch.float32, em), r"scale \(nvfp4 1x16\)"),
        ((codes[:0], scale[:0], amax[:0], "16x16", torch.float32, em), "with E >= 1"),
        ((codes, scale, amax[:3], "16x16", torch.float32, em), r"one float32 amax each"),
    ]
    for dq_args, match in dq_bad:
        with pytest.raises(ValueError, match=match):
            dq(*dq_args)
    # The training operator shares the offs-length check (checked_bounds): E - 1 entries left
    # the last group's rows zero, E + 1 an IndexError.
    train = torch.ops.computectx.fp4_grouped_mm
    for short in (offs[:3], offsets([1] * 5)):
        with pytest.raises(ValueError, match=r"offs must be int32 \(4,\)"):
            train(x, w.bfloat16(), short, "nvfp4", "16x16", "rceil", None, bf16, em)


def test_dequantize_experts_reads_the_format_from_the_scales_as_the_dense_operator() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2, 16, 64, generator=gen)
    codes, scale, _ = held(w, MX)
    stray = torch.ones(2, dtype=torch.float32)  # an amax beside E8M0 scales: not NVFP4
    dense = torch.stack([fp4_ops.dequantize(fp4_ops.quantize(w[e], MX, weight=True), torch.float32)
                         for e in range(2)])  # fmt: skip
    dq = torch.ops.computectx.fp4_dequantize_experts
    assert torch.equal(dq(codes, scale, stray, "1x32", torch.float32, "emulated"), dense)
    nv_codes, nv_scale, _ = held(w, NV)
    with pytest.raises(ValueError, match="needs its per-expert amax"):
        dq(nv_codes, nv_scale, None, "16x16", torch.float32, "emulated")
