"""The frozen 4-bit linear's arithmetic (``linear.fp4_serving``): W4A4 against ``Fp4Linear``'s
forward bit for bit (per tensor: the batch; per row: each row alone), the per-row quantize
against ``quantize_nvfp4`` of each row, weight-only against ``F.linear`` of the dequantized
weight, and the checks of weights given from outside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from computectx import ComputeCtx
from computectx.formats import Fp4Linear, Fp4Recipe
from computectx.formats.linear.fp4 import fp4_quant
from computectx.formats.linear.fp4_serving import (
    UNIT_AMAX,
    check_bias,
    check_serving,
    check_weight,
    dequantized,
    nvfp4_rows,
    w4a4_mm,
    weight_only_mm,
)
from computectx.formats.numerics.fp4 import Mxfp4Operand, Nvfp4Operand, quantize_nvfp4
from computectx.formats.numerics.fp4_gemm import tensor_scale_alpha

RECIPES = ["nvfp4", "nvfp4+w1x16", "mxfp4", "mxfp4+floor"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def layer(recipe: str, bias: bool = True) -> Fp4Linear:
    torch.manual_seed(0)
    ctx = ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=Fp4Recipe.parse(recipe))
    lin = Fp4Linear(64, 64, bias, ctx=ctx)
    if lin.bias is not None:
        with torch.no_grad():
            lin.bias.normal_()
    return lin


def awkward_rows(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows whose amaxes differ by orders of magnitude, a zero row, a row with inf, one with
    NaN, one near float32's smallest normals."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g)
    x[1] *= 1000.0
    x[2] = 0.0
    x[3, 5] = float("inf")
    x[4, 9] = float("nan")
    x[5] *= 1e-30
    x[6] *= 3e4
    return x.to(dtype)


def test_two_unit_amaxes_have_alpha_exactly_one() -> None:
    one = torch.tensor(UNIT_AMAX)
    assert UNIT_AMAX == 448.0 * 6.0
    assert tensor_scale_alpha(one, one).item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_rows_is_quantize_nvfp4_of_each_row_alone(dtype: torch.dtype) -> None:
    x = awkward_rows(dtype)
    q, amax = nvfp4_rows(x)
    assert q.amax.item() == UNIT_AMAX and q.tile == "1x16"
    for i in range(x.shape[0]):
        alone = quantize_nvfp4(x[i : i + 1])
        assert same(q.codes[i : i + 1], alone.codes), i
        assert same(q.scale[i : i + 1], alone.scale), i
        assert same(amax[i], alone.amax), i


@pytest.mark.parametrize("recipe", RECIPES)
def test_w4a4_per_tensor_is_fp4_linears_forward_on_the_batch(recipe: str) -> None:
    lin = layer(recipe)
    x = awkward_rows()
    w = lin.quantized_weight()
    # TE's recipe rounds gradients stochastically; the forward never does, in any mode.
    for training, grad in ((True, True), (False, False)):
        lin.train(training)
        with torch.set_grad_enabled(grad):
            want = lin(x)
        got = w4a4_mm(x, w, fp4_quant(lin.recipe), "per_tensor", lin.bias, x.dtype)
        assert same(got, want.detach())


@pytest.mark.parametrize("recipe", RECIPES)
def test_w4a4_per_row_gives_each_row_its_answer_alone_whatever_the_batch(recipe: str) -> None:
    lin = layer(recipe)
    x = awkward_rows()
    w, how = lin.quantized_weight(), fp4_quant(lin.recipe)
    with torch.no_grad():
        alone = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])
    got = w4a4_mm(x, w, how, "per_row", lin.bias, x.dtype)
    assert same(got, alone)
    # The same request in other company: reversed, and beside one loud row only.
    flipped = w4a4_mm(x.flip(0), w, how, "per_row", lin.bias, x.dtype).flip(0)
    assert same(flipped, alone)
    pair = w4a4_mm(x[[0, 6]], w, how, "per_row", lin.bias, x.dtype)
    assert same(pair[0], alone[0])
    per_tensor = w4a4_mm(x[[0, 6]], w, how, "per_tensor", lin.bias, x.dtype)
    # NVFP4's per-tensor amax makes row 0 depend on row 6 (this test could fail); MXFP4 has
    # no per-tensor scale, so both rules are the same.
    assert same(per_tensor[0], alone[0]) == recipe.startswith("mxfp4")


def test_w4a4_per_row_handles_float32_and_fp16_outputs() -> None:
    lin = layer("nvfp4")
    w, how = lin.quantized_weight(), fp4_quant(lin.recipe)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(5, 64).to(dtype)
        with torch.no_grad():
            alone = torch.cat([lin(x[i : i + 1]) for i in range(5)])
        got = w4a4_mm(x, w, how, "per_row", lin.bias, dtype)
        assert got.dtype == dtype and same(got, alone)


@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_only_is_f_linear_of_the_dequantized_weight(recipe: str) -> None:
    lin = layer(recipe)
    w = lin.quantized_weight()
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(6, 64).to(dtype)
        deq = dequantized(w, torch.float32)
        want = F.linear(x, deq.to(dtype), lin.bias.to(dtype))
        assert same(weight_only_mm(x, w, lin.bias), want)
        assert same(dequantized(w, dtype), deq.to(dtype))


# ----- checks --------------------------------------------------------------------------------


def nv(tile: str = "1x16") -> Nvfp4Operand:
    w = torch.randn(32, 64)
    return quantize_nvfp4(w, tile=tile)  # type: ignore[arg-type]


def test_check_weight_takes_what_the_quantizers_make() -> None:
    for q in (nv(), nv("16x16"), layer("mxfp4").quantized_weight()):
        assert check_weight(q, "who") is q
    one = nv()
    amax_1 = Nvfp4Operand(one.codes, one.scale, one.amax.reshape(1), "1x16")
    assert check_weight(amax_1, "who") is amax_1
    zeros = quantize_nvfp4(torch.zeros(32, 64), tile="1x16")  # amax 0, every scale 0
    assert float(zeros.amax) == 0.0 and check_weight(zeros, "who") is zeros


def _bad_cases() -> list[tuple[object, type[Exception], str]]:
    q, t = nv(), nv("16x16")
    mx = layer("mxfp4").quantized_weight()
    assert isinstance(mx, Mxfp4Operand)
    nan_scale = q.scale.clone()
    nan_scale.view(torch.uint8)[0, 0] = 0x7F
    neg_scale = q.scale.clone()
    neg_scale.view(torch.uint8)[0, 0] |= 0x80
    nan_mx = mx.scale.clone()
    nan_mx.view(torch.uint8)[0, 0] = 0xFF
    return [
        (torch.randn(32, 64), TypeError, "takes an Nvfp4Operand or Mxfp4Operand"),
        (Nvfp4Operand(q.codes.view(torch.uint8), q.scale, q.amax, "1x16"), ValueError, "codes"),
        (Nvfp4Operand(q.codes[0], q.scale, q.amax, "1x16"), ValueError, "2-D"),
        (Nvfp4Operand(q.codes[:, :4], q.scale[:, :1], q.amax, "1x16"), ValueError, "block, 16"),
        (Nvfp4Operand(q.codes, q.scale.float(), q.amax, "1x16"), ValueError, "scale must be"),
        (Nvfp4Operand(q.codes, q.scale[:, :2], q.amax, "1x16"), ValueError, r"\(32, 4\)"),
        (Nvfp4Operand(q.codes, t.scale, q.amax, "1x16"), ValueError, "scale must be"),
        (Nvfp4Operand(q.codes[:24], q.scale[:24], q.amax, "16x16"), ValueError, "multiple of 16"),
        (Nvfp4Operand(q.codes, q.scale, q.amax, "4x4"), ValueError, "tile must be"),  # type: ignore[arg-type]
        (Nvfp4Operand(q.codes, q.scale, q.amax.double(), "1x16"), ValueError, "amax must be a"),
        (Nvfp4Operand(q.codes, q.scale, torch.ones(2), "1x16"), ValueError, "amax must be a"),
        (Nvfp4Operand(q.codes, q.scale, torch.tensor(-1.0), "1x16"), ValueError, "finite and"),
        (Nvfp4Operand(q.codes, q.scale, torch.tensor(float("inf")), "1x16"), ValueError, "finite"),
        (Nvfp4Operand(q.codes, q.scale, torch.tensor(0.0), "1x16"), ValueError, "amax is 0 but"),
        (Nvfp4Operand(q.codes, nan_scale, q.amax, "1x16"), ValueError, "block scales must be"),
        (Nvfp4Operand(q.codes, neg_scale, q.amax, "1x16"), ValueError, "block scales must be"),
        (Nvfp4Operand(q.codes, q.scale, q.amax.to("meta"), "1x16"), ValueError, "one device"),
        (Mxfp4Operand(mx.codes, q.scale), ValueError, "float8_e8m0fnu"),
        (Mxfp4Operand(mx.codes, nan_mx), ValueError, "block scales must be"),
    ]


def test_check_weight_refuses_naming_the_value() -> None:
    for value, error, match in _bad_cases():
        with pytest.raises(error, match=match):
            check_weight(value, "FrozenFp4Linear")


def test_check_serving_and_bias() -> None:
    check_serving("w4a4", "per_tensor", "who")
    with pytest.raises(ValueError, match=r"who: mode must be one of \('weight_only', 'w4a4'\)"):
        check_serving("w8a8", "per_row", "who")
    with pytest.raises(ValueError, match="activation_amax must be one of"):
        check_serving("w4a4", "per_token", "who")
    with pytest.raises(ValueError, match="activation_amax must be one of"):
        check_serving("w4a4", None, "who")
    cpu = torch.device("cpu")
    assert check_bias(None, 4, cpu, "who") is None
    b = torch.zeros(4)
    assert check_bias(b, 4, cpu, "who") is b
    for bad in (torch.zeros(5), torch.zeros(4, dtype=torch.int64), [0.0] * 4, torch.zeros(4, 1)):
        with pytest.raises(ValueError, match=r"bias must be None or a bf16, .* \(4,\)"):
            check_bias(bad, 4, cpu, "who")
