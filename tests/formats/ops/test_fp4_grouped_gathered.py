"""``computectx::fp4_grouped_mm_gathered`` (``ops.fp4_grouped_gathered``): given each expert's
operand as the grouped GEMM makes it, the result is ``fp4_grouped_mm``'s bit for bit, forward
and dgrad (stochastic rounding included); an ``Fp4Experts`` call on a gathered weight
(``Fp4GatheredExperts``) is the call on the high-precision weight, outputs, gradients and
counter; bad operands are refused naming shapes."""

from __future__ import annotations

import pytest
import torch

from computectx.formats import Fp4Experts, Fp4Recipe
from computectx.formats.linear.fp4 import fp4_quant
from computectx.formats.linear.fp4_gathered import Fp4ExpertsGather, Fp4GatheredExperts
from computectx.formats.numerics.fp4 import Mxfp4Operand, Nvfp4Operand
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.ops.fp4_grouped_gathered import fp4_grouped_mm_gathered, grouped_mm_gathered

RECIPES = ("nvfp4", "nvfp4+w1x16", "mxfp4")
OFFS = (5, 5, 14, 20)


def _stacked(w: torch.Tensor, recipe: str) -> Nvfp4Operand | Mxfp4Operand:
    how = fp4_quant(Fp4Recipe.parse(recipe))
    qs = [fp4_ops.quantize(w[e], how, weight=True) for e in range(w.shape[0])]
    codes = torch.stack([q.codes for q in qs])
    scale = torch.stack([q.scale for q in qs])
    if isinstance(qs[0], Nvfp4Operand):
        amax = torch.stack([q.amax.reshape(()) for q in qs if isinstance(q, Nvfp4Operand)])
        return Nvfp4Operand(codes, scale, amax, qs[0].tile)
    return Mxfp4Operand(codes, scale)


@pytest.mark.parametrize("recipe", RECIPES)
def test_given_each_experts_operand_the_product_is_the_grouped_gemms_bit_for_bit(
    recipe: str,
) -> None:
    torch.manual_seed(0)
    how = fp4_quant(Fp4Recipe.parse(recipe))
    w, x = torch.randn(4, 64, 32), torch.randn(20, 32, dtype=torch.bfloat16)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    key = torch.tensor([7, 1000], dtype=torch.int64)
    want = fp4_ops.grouped_mm(x, w, offs, how, stochastic=key)
    assert torch.equal(grouped_mm_gathered(x, _stacked(w, recipe), offs, how, stochastic=key), want)
    wt = w.transpose(1, 2)  # the dgrad's Wᵀ per expert
    dy = torch.randn(20, 64)
    want = fp4_ops.grouped_mm(dy, wt, offs, how, out_dtype=torch.bfloat16, stochastic=key)
    got = grouped_mm_gathered(
        dy, _stacked(wt, recipe), offs, how, out_dtype=torch.bfloat16, stochastic=key
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_experts_call_on_gathered_operands_is_the_call_on_the_weight(recipe: str) -> None:
    r = Fp4Recipe.parse(recipe)
    torch.manual_seed(1)
    w, x = torch.randn(4, 64, 32), torch.randn(20, 32)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    plain, gathered = Fp4Experts(r), Fp4Experts(r)
    spec = gathered.experts_gather
    assert isinstance(spec, Fp4ExpertsGather)
    # Two shards of whole experts, quantized apart and put back together: the whole's parts.
    halves = [spec.expert_inputs(w[:2]), spec.expert_inputs(w[2:])]
    parts = tuple(torch.cat(p) for p in zip(*halves, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(parts, spec.expert_inputs(w), strict=True))
    experts = spec.experts(parts, torch.float32)
    assert type(experts) is Fp4GatheredExperts and experts.shape == w.shape
    held = torch.nn.Parameter(experts)
    x1, w1, x2 = x.clone().requires_grad_(), w.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = plain.mm(x1, w1, offs), gathered.mm(x2, held, offs)
    torch.autograd.backward(y1.square().sum())  # Tensor.backward is untyped in torch
    torch.autograd.backward(y2.square().sum())
    assert x1.grad is not None and x2.grad is not None
    assert w1.grad is not None and held.grad is not None
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    assert torch.equal(w1.grad, held.grad)
    assert torch.equal(plain.sr_key, gathered.sr_key)


def test_bad_operands_are_refused_naming_the_shapes() -> None:
    how = fp4_quant(Fp4Recipe.parse("nvfp4"))
    torch.manual_seed(2)
    q = _stacked(torch.randn(4, 64, 32), "nvfp4")
    assert isinstance(q, Nvfp4Operand)
    x, offs = torch.randn(20, 32), torch.tensor(OFFS, dtype=torch.int32)
    bad = Nvfp4Operand(q.codes, q.scale[:, :2], q.amax, q.tile)
    with pytest.raises(
        ValueError, match=r"scales are .*e4m3fn \(4, 2, 2\), expected .*e4m3fn \(4, 4, 2\)"
    ):
        grouped_mm_gathered(x, bad, offs, how)
    with pytest.raises(ValueError, match=r"a \[M, K\] and offs \[E\].*got a \(20, 16\)"):
        grouped_mm_gathered(torch.randn(20, 16), q, offs, how)
    with pytest.raises(TypeError, match="takes a Nvfp4Operand, got Mxfp4Operand"):
        grouped_mm_gathered(x, Mxfp4Operand(q.codes, q.scale), offs, how)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_scales_of_another_dtype_are_refused_as_the_dense_gemm_refuses_them(recipe: str) -> None:
    # The dense GEMM's check_scale: NVFP4's scales E4M3, MXFP4's E8M0 (the bytes read as
    # another dtype are another number: a silent wrong product before).
    how = fp4_quant(Fp4Recipe.parse(recipe))
    torch.manual_seed(4)
    q = _stacked(torch.randn(4, 32, 32), recipe)
    x, offs = torch.randn(20, 32), torch.tensor(OFFS, dtype=torch.int32)
    right = "float8_e4m3fn" if recipe == "nvfp4" else "float8_e8m0fnu"
    other = torch.float8_e8m0fnu if recipe == "nvfp4" else torch.float8_e4m3fn
    for dtype in (torch.uint8, other):
        s = q.scale.view(dtype)
        bad = Nvfp4Operand(q.codes, s, q.amax, q.tile) if isinstance(q, Nvfp4Operand) else None
        with pytest.raises(
            ValueError, match=f"scales are torch.{str(dtype)[6:]} .*expected torch.{right}"
        ):
            grouped_mm_gathered(x, bad or Mxfp4Operand(q.codes, s), offs, how)
    s32 = q.scale.float()
    bad32 = Nvfp4Operand(q.codes, s32, q.amax, q.tile) if isinstance(q, Nvfp4Operand) else None
    with pytest.raises(ValueError, match=f"scales are torch.float32 .*expected torch.{right}"):
        grouped_mm_gathered(x, bad32 or Mxfp4Operand(q.codes, s32), offs, how)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_an_amax_not_finite_or_negative_is_refused(value: float) -> None:
    how = fp4_quant(Fp4Recipe.parse("nvfp4"))
    torch.manual_seed(5)
    q = _stacked(torch.randn(4, 32, 32), "nvfp4")
    assert isinstance(q, Nvfp4Operand)
    x, offs = torch.randn(20, 32), torch.tensor(OFFS, dtype=torch.int32)
    amax = q.amax.clone()
    amax[2] = value
    with pytest.raises(ValueError, match="each expert's amax must be finite and >= 0"):
        grouped_mm_gathered(x, Nvfp4Operand(q.codes, q.scale, amax, q.tile), offs, how)
    for bad in (q.amax.reshape(4, 1), q.amax.double()):
        with pytest.raises(ValueError, match=r"one float32 amax each, \(4,\), got"):
            grouped_mm_gathered(x, Nvfp4Operand(q.codes, q.scale, bad, q.tile), offs, how)


def test_the_raw_operator_checks_its_own_arguments() -> None:
    # Nothing reaches the reference or the Triton kernel past the operands' bounds.
    torch.manual_seed(6)
    q = _stacked(torch.randn(4, 32, 32), "nvfp4")
    assert isinstance(q, Nvfp4Operand)
    x, offs = torch.randn(20, 32), torch.tensor(OFFS, dtype=torch.int32)
    tail = ("rceil", None, torch.float32, "emulated")

    def op(*args: object, rng: object = None) -> object:
        full = (*args, "nvfp4", "16x16", "rceil", rng, torch.float32, "emulated")
        return fp4_grouped_mm_gathered(x, *full)

    with pytest.raises(ValueError, match=r"offs \[E\] for codes .* = \(2, 32, 16\)"):
        op(q.codes[:2], q.scale[:2], q.amax[:2], offs)
    with pytest.raises(ValueError, match=r"scales are .*\(2, 2, 2\), expected .*\(4, 2, 2\)"):
        op(q.codes, q.scale[:2], q.amax, offs)
    with pytest.raises(
        ValueError, match=r"one float32 amax each, \(4,\), got torch.float32 \(2,\)"
    ):
        op(q.codes, q.scale, q.amax[:2], offs)
    with pytest.raises(ValueError, match=r"rng is None or an int64 \(2,\).*got torch.int64 \(1,\)"):
        op(q.codes, q.scale, q.amax, offs, rng=torch.tensor([1]))
    with pytest.raises(ValueError, match="NVFP4 experts take their amaxes, MXFP4 experts none"):
        fp4_grouped_mm_gathered(x, q.codes, q.scale, None, offs, "nvfp4", "16x16", *tail)
    with pytest.raises(ValueError, match="offs must be int32"):
        op(q.codes, q.scale, q.amax, offs.long())


def test_the_operator_passes_opcheck() -> None:
    # Small operands (opcheck traces and runs the operator several times).
    torch.manual_seed(3)
    q = _stacked(torch.randn(2, 32, 32), "nvfp4")
    assert isinstance(q, Nvfp4Operand)
    args = (torch.randn(6, 32), q.codes, q.scale, q.amax, torch.tensor([2, 6], dtype=torch.int32))
    torch.library.opcheck(
        fp4_grouped_mm_gathered,
        (*args, "nvfp4", "16x16", "rceil", torch.tensor([5, 9]), torch.float32, "emulated"),
        # fp4/fp8 tensors crossing the operator: torch's schema check cannot copy them.
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_no_experts_dequantize_on_the_operands_device_at_the_dtype(recipe: str) -> None:
    spec = Fp4Experts(Fp4Recipe.parse(recipe)).experts_gather
    assert isinstance(spec, Fp4ExpertsGather)
    parts = spec.expert_inputs(torch.randn(1, 32, 32))
    for device in ("cpu", "meta"):  # meta: no op may leave the operands' device
        none = spec.experts(tuple(p[:0].to(device) for p in parts), torch.bfloat16)
        got = none.dequantize()
        assert (got.shape, got.dtype, got.device.type) == ((0, 32, 32), torch.bfloat16, device)
        assert none.dequantize(torch.float16).dtype == torch.float16
