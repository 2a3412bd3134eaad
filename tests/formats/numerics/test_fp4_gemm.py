"""The 4-bit GEMM twins (``numerics.fp4_gemm``): the dense GEMM's arithmetic, its stated error
bound on random shapes with extreme values, the operands of the wgrad GEMM (the Hadamard
transform needs no inverse), and the grouped GEMMs as the dense GEMM on each group's rows.

The one-block GEMM is checked bit for bit against float64 arithmetic rounded once (every block
term is exact, so ``alpha * T`` is the only rounding there); the bound is asserted on shapes
and magnitudes drawn by hypothesis (amaxes from 1e-30 to 1e20, zero and underflowing blocks,
±inf saturating, both tiles, both MX rules, bias, f32/bf16 outputs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from computectx.formats.numerics import e2m1, fp4, fp4_gemm
from computectx.formats.numerics.e2m1 import Stochastic
from computectx.formats.numerics.fp4_gemm import Fp4Quant

NV, MX = Fp4Quant(), Fp4Quant(format="mxfp4", hadamard=False)
HOWS = {
    "nvfp4": NV,
    "nvfp4-1x16": Fp4Quant(weight_tile="1x16"),
    "mxfp4-rceil": MX,
    "mxfp4-floor": Fp4Quant(format="mxfp4", mx_rounding="floor", hadamard=False),
}


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return 10 * math.log10(float(ref.pow(2).sum()) / float((ref - got).pow(2).sum()))


def exact_product(a: fp4_gemm.Fp4Operand, b: fp4_gemm.Fp4Operand) -> torch.Tensor:
    da, db = fp4_gemm.dequantize_operand(a), fp4_gemm.dequantize_operand(b)
    return da.double() @ db.double().t()


# ----- the dense GEMM -----------------------------------------------------------------------


def test_alpha_is_tes_tensor_scale_in_float32() -> None:
    f32 = np.float32
    for amax_a, amax_b in ((1.0, 1.0), (3.7e5, 2.2e-3), (1e-20, 1e-20), (6.0, 448.0)):
        want = (f32(amax_a) * f32(amax_b)) * f32(1.0 / (6.0 * 6.0 * 448.0 * 448.0))
        got = fp4_gemm.tensor_scale_alpha(torch.tensor(amax_a), torch.tensor(amax_b))
        assert got.dtype == torch.float32 and float(got) == float(want)


@pytest.mark.parametrize(("scale_x", "scale_w"), [(1.0, 1e-37), (1e-38, 1.0), (1e36, 1.0)])
def test_alpha_is_the_encodings_at_both_ends(scale_x: float, scale_w: float) -> None:
    # TE's (amax_a * amax_b) * f32(1/(36*448**2)) is wrong at the ends: an amax below ~7.9e-36
    # has its S_enc saturated at FLT_MAX (the output came out 8x too small at 1e-37, 1500x at
    # 1e-38), and amaxes whose product passes FLT_MAX (1e38 x 8) gave inf. The factor the
    # encoding used keeps the GEMM within its usual 4-bit error of the exact product.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=gen, dtype=torch.float64)
    w = torch.randn(32, 64, generator=gen, dtype=torch.float64)
    if scale_x == 1e36:  # one input of 1e38 against a weight of amax 8: amax product 8e38
        x[3, 5], w[:, 5], w[7, 9] = 100.0, 1e-3, 8.0
    how = HOWS["nvfp4"]
    qx = fp4_gemm.quantize_rows((x * scale_x).float(), how)
    qw = fp4_gemm.quantize_rows((w * scale_w).float(), how, weight=True)
    got = fp4_gemm.reference_fp4_mm(qx, qw, torch.float32).double() / (scale_x * scale_w)
    exact = x @ w.t()
    assert bool(torch.isfinite(got).all())
    sqnr = 10 * torch.log10(exact.pow(2).sum() / (got - exact).pow(2).sum())
    assert sqnr > 12, float(sqnr)  # 4-bit noise: ~16 dB at ordinary magnitudes


def test_alpha_floor_is_where_s_enc_saturates() -> None:
    floor = fp4_gemm.AMAX_FLOOR
    assert float(torch.tensor(2688.0) / torch.tensor(torch.finfo(torch.float32).max)) == floor
    one = torch.tensor(1.0)
    below = fp4_gemm.tensor_scale_alpha(torch.tensor(floor / 4), one)
    assert float(below) == float(fp4_gemm.tensor_scale_alpha(torch.tensor(floor), one))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4-rceil"])
def test_one_block_is_exact_up_to_the_epilogue(name: str) -> None:
    # One K block: P * s_a * s_b is exact, so the float32 result is the float64 value of the
    # block term times alpha rounded once, bit for bit.
    how = HOWS[name]
    gen = torch.Generator().manual_seed(3)
    k = how.block
    a = fp4_gemm.quantize_rows(torch.randn(16, k, generator=gen) * 7, how)
    b = fp4_gemm.quantize_rows(torch.randn(32, k, generator=gen) / 3, how, weight=True)
    got = fp4_gemm.reference_fp4_mm(a, b, torch.float32)
    ea = e2m1.code_values(e2m1.unpack_codes(a.codes)).double() * a.scale.double().reshape(16, 1)
    scale_b = b.scale.double()
    if isinstance(b, fp4.Nvfp4Operand) and b.tile == "16x16":
        scale_b = scale_b.repeat_interleave(16, dim=0)
    eb = e2m1.code_values(e2m1.unpack_codes(b.codes)).double() * scale_b.reshape(32, 1)
    want = ea @ eb.t()
    if isinstance(a, fp4.Nvfp4Operand) and isinstance(b, fp4.Nvfp4Operand):
        want = want * fp4_gemm.tensor_scale_alpha(a.amax, b.amax).double()
    assert torch.equal(got, want.float())


magnitudes = st.sampled_from([1e-30, 1e-12, 1e-3, 1.0, 300.0, 1e8, 1e20])


@settings(max_examples=12)
@given(
    name=st.sampled_from(sorted(HOWS)),
    m16=st.integers(1, 3),
    n16=st.integers(1, 3),
    kb=st.integers(1, 4),
    scale_a=magnitudes,
    scale_b=magnitudes,
    seed=st.integers(0, 2**16),
    out=st.sampled_from([torch.float32, torch.bfloat16]),
    extremes=st.booleans(),
)
def test_the_error_bound_holds(
    name: str,
    m16: int,
    n16: int,
    kb: int,
    scale_a: float,
    scale_b: float,
    seed: int,
    out: torch.dtype,
    extremes: bool,
) -> None:
    assume(scale_a * scale_b <= 1e28)  # results in float32's range (beyond it: inf)
    how = HOWS[name]
    gen = torch.Generator().manual_seed(seed)
    m, n, k = 16 * m16, 16 * n16, how.block * kb
    x = torch.randn(m, k, generator=gen) * scale_a
    w = torch.randn(n, k, generator=gen) * scale_b
    if extremes:
        x[0, :16] = 0.0  # a zero block
        x[1, : how.block] *= 1e-12  # a block whose scale underflows (NVFP4: zero scale)
        x[2, 3] = 1e4 * scale_a  # an outlier
        if how.format == "nvfp4":  # an MXFP4 inf block dequantizes to inf: not finite
            w[0, 5] = float("inf")  # saturates: the block's largest code
    bias = torch.randn(n, generator=gen) * scale_a * scale_b
    a = fp4_gemm.quantize_rows(x, how)
    b = fp4_gemm.quantize_rows(w, how, weight=True)
    got = fp4_gemm.reference_fp4_mm(a, b, out, bias).double()
    bound = fp4_gemm.fp4_mm_error_bound(a, b, out, bias)
    err = (got - (exact_product(a, b) + bias.double())).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


class _HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Counts the reads of a tensor's value to the host (``.item()``, ``bool()``, ``.tolist()``
    all dispatch ``aten._local_scalar_dense``): a device synchronisation on a GPU."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _on(q: fp4_gemm.Fp4Operand, device: str) -> fp4_gemm.Fp4Operand:
    if isinstance(q, fp4.Nvfp4Operand):
        return fp4.Nvfp4Operand(q.codes.to(device), q.scale.to(device), q.amax.to(device), q.tile)
    return fp4.Mxfp4Operand(q.codes.to(device), q.scale.to(device))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4-rceil"])
def test_the_dense_gemm_reads_no_device_tensor_to_the_host(name: str) -> None:
    # Whether the scaled values multiply exactly is the format's (E4M3 scales), or for MXFP4
    # read only on the CPU: no host synchronisation per GEMM on a GPU. On the meta device a
    # host read raises; NVFP4 reads nothing on the CPU either.
    how = HOWS[name]
    gen = torch.Generator().manual_seed(5)
    a = fp4_gemm.quantize_rows(torch.randn(16, 2 * how.block, generator=gen), how)
    b = fp4_gemm.quantize_rows(torch.randn(16, 2 * how.block, generator=gen), how, weight=True)
    out = fp4_gemm.reference_fp4_mm(_on(a, "meta"), _on(b, "meta"), torch.bfloat16)
    assert out.shape == (16, 16) and out.device.type == "meta"
    with _HostReads() as reads:
        fp4_gemm.reference_fp4_mm(a, b, torch.bfloat16)
    assert (reads.count == 0) == (name == "nvfp4")


def _by_route(a: fp4_gemm.Fp4Operand, b: fp4_gemm.Fp4Operand, prescaled: bool) -> torch.Tensor:
    # float32 acc of the module docstring by one route: the GEMM of the scaled values, or each
    # block's GEMM of the E2M1 values times s_a * s_b; K blocks summed in order.
    va, sa, w = fp4_gemm._parts(a, "a")
    vb, sb, _ = fp4_gemm._parts(b, "b")
    acc = torch.zeros(va.shape[0], vb.shape[0])
    for kb in range(sa.shape[1]):
        pa, pb = va[:, kb * w : (kb + 1) * w], vb[:, kb * w : (kb + 1) * w]
        if prescaled:
            acc += (pa * sa[:, kb : kb + 1]) @ (pb * sb[:, kb : kb + 1]).t()
        else:
            acc += (pa @ pb.t()) * (sa[:, kb : kb + 1] * sb[:, kb].reshape(1, -1))
    return acc


def test_both_routes_give_the_same_bits_where_either_is_taken() -> None:
    # NVFP4 prescales whatever its E4M3 scales (0, subnormal 2**-9 .. 448), the route the
    # unscaled products' sum gives bit for bit; MXFP4 with scales within 2**+-50 prescales on
    # the CPU and multiplies by s_a * s_b on a GPU: the same bits.
    gen = torch.Generator().manual_seed(9)
    codes = torch.randint(0, 256, (32, 32), dtype=torch.uint8, generator=gen)
    e4m3 = torch.tensor([0.0, 2.0**-9, 0.0625, 1.5, 448.0]).to(torch.float8_e4m3fn)
    nv = [
        fp4.Nvfp4Operand(
            codes[16 * i : 16 * i + 16].view(torch.float4_e2m1fn_x2),
            e4m3[torch.randint(0, 5, (16, 4), generator=gen)],
            torch.tensor(3.0),
            "1x16",
        )
        for i in range(2)
    ]
    got = fp4_gemm.reference_fp4_mm(nv[0], nv[1], torch.float32)
    alpha = fp4_gemm.tensor_scale_alpha(nv[0].amax, nv[1].amax)
    assert torch.equal(got, _by_route(nv[0], nv[1], prescaled=False) * alpha)
    exps = torch.randint(127 - 50, 127 + 51, (2, 16, 2), generator=gen, dtype=torch.int32)
    mx = [
        fp4.Mxfp4Operand(
            codes[16 * i : 16 * i + 16].view(torch.float4_e2m1fn_x2),
            exps[i].to(torch.uint8).view(torch.float8_e8m0fnu),
        )
        for i in range(2)
    ]
    got = fp4_gemm.reference_fp4_mm(mx[0], mx[1], torch.float32)
    assert torch.equal(got, _by_route(mx[0], mx[1], prescaled=True))
    assert torch.equal(got, _by_route(mx[0], mx[1], prescaled=False))  # a GPU's route


def test_an_rceil_weight_decoding_to_inf_stays_finite_in_the_gemm() -> None:
    # docs/fp4.md, "Non-finite values": an element of at least 7 * 2**125 codes 4 at scale
    # 2**126 under "rceil", so its dequantized value is 2**128 = inf; the GEMM multiplies the
    # two scales first (2**126 * s_x), so its product stays finite where 2**128 * x does.
    w = torch.full((2, 32), 1e-3)
    w[0, 0] = -3e38
    x = torch.full((3, 32), 2.0**-20)
    x[1, 0], x[2, 0] = 0.5, 0.0
    qw, qx = fp4.quantize_mxfp4(w), fp4.quantize_mxfp4(x)
    assert fp4.dequantize_mxfp4(qw)[0, 0] == -math.inf
    y = fp4_gemm.reference_fp4_mm(qx, qw, torch.float32)
    # Row 0 of the weight decodes to [-2**128, 0, ..., 0] (1e-3 codes 0 at 2**126).
    assert y[:, 0].tolist() == [-(2.0**108), -(2.0**127), 0.0]
    deq = fp4.dequantize_mxfp4(qx) @ fp4.dequantize_mxfp4(qw).t()  # the weight-only route
    assert deq[0, 0] == deq[1, 0] == -math.inf and math.isnan(deq[2, 0])


def test_mixed_pairs_and_two_ks_are_refused() -> None:
    x = torch.randn(16, 64)
    with pytest.raises(ValueError, match="two NVFP4 or two MXFP4"):
        fp4_gemm.reference_fp4_mm(fp4.quantize_nvfp4(x), fp4.quantize_mxfp4(x), torch.float32)
    short = fp4.quantize_nvfp4(x[:, :32])
    with pytest.raises(ValueError, match="the same K"):
        fp4_gemm.reference_fp4_mm(fp4.quantize_nvfp4(x), short, torch.float32)


def test_fp4_quant_refuses_bad_values() -> None:
    for kwargs in (
        {"format": "fp4"},
        {"weight_tile": "32x32"},
        {"mx_rounding": "even"},
        {"hadamard": 1},
        {"signs": (1,) * 15},
    ):
        with pytest.raises(ValueError, match="must be"):
            Fp4Quant(**kwargs)


def test_a_16x16_weights_dgrad_operand_is_the_forwards_transposed() -> None:
    # dX's b operand, Wᵀ quantized at 16x16, is the forward's W operand transposed: the same
    # tiles (a tile's amax is its transpose's), the same amax, the codes moved.
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(8)).bfloat16()
    fwd, dgrad = (
        fp4_gemm.quantize_rows(w, NV, weight=True),
        fp4_gemm.quantize_rows(w.t(), NV, weight=True),
    )
    assert isinstance(fwd, fp4.Nvfp4Operand) and isinstance(dgrad, fp4.Nvfp4Operand)
    codes = e2m1.unpack_codes(fwd.codes).t()
    assert torch.equal(e2m1.unpack_codes(dgrad.codes), codes)
    assert torch.equal(dgrad.scale.view(torch.uint8), fwd.scale.view(torch.uint8).t())
    assert torch.equal(dgrad.amax, fwd.amax)


# ----- the wgrad operands and the grouped GEMMs ---------------------------------------------


@pytest.mark.parametrize("hadamard", [True, False])
def test_the_wgrad_operands_need_no_inverse_transform(hadamard: bool) -> None:
    # dYᵀ X from two column-wise operands (23 rows: padded to 32) is the product itself,
    # transformed or not: an operand transformed on one side only would score about 0 dB.
    gen = torch.Generator().manual_seed(5)
    dy, x = torch.randn(23, 32, generator=gen), torch.randn(23, 48, generator=gen)
    how = Fp4Quant(hadamard=hadamard)
    qd = fp4_gemm.wgrad_operand(dy, how, stochastic=Stochastic(7))
    qx = fp4_gemm.wgrad_operand(x, how)
    assert qd.codes.shape == (32, 16) and qx.codes.shape == (48, 16)
    dw = fp4_gemm.reference_fp4_mm(qd, qx, torch.float32)
    assert sqnr(dy.t().double() @ x.double(), dw) > 12


def test_each_group_is_the_dense_gemm_on_its_rows() -> None:
    gen = torch.Generator().manual_seed(6)
    e, n, k = 4, 32, 64
    a = torch.randn(40, k, generator=gen).bfloat16()
    a[5:9] *= 1e4  # group 1's own amax: no other group sees it
    b = torch.randn(e, n, k, generator=gen).bfloat16()
    bounds = [(0, 5), (5, 5), (5, 30), (30, 37)]  # an empty group, rows 37-39 past the last
    key = Stochastic(11, 100)
    for how, stochastic in ((NV, None), (NV, key), (MX, None)):
        out = fp4_gemm.reference_fp4_grouped_mm(a, b, bounds, how, torch.bfloat16, stochastic)
        for g, (start, end) in enumerate(bounds):
            if end == start:
                continue
            sk = None if stochastic is None else Stochastic(11, 100 + start * k)
            qa = fp4_gemm.quantize_rows(a[start:end], how, stochastic=sk)
            qb = fp4_gemm.quantize_rows(b[g], how, weight=True)
            assert torch.equal(out[start:end], fp4_gemm.reference_fp4_mm(qa, qb, torch.bfloat16))
        assert torch.equal(out[37:], torch.zeros(3, n, dtype=torch.bfloat16))
    counters = fp4_gemm.grouped_counters(bounds, k, NV, wgrad=False)
    assert counters == 37 * k


def test_each_groups_wgrad_is_the_dense_one_on_its_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    dy, x = torch.randn(40, 32, generator=gen), torch.randn(40, 48, generator=gen)
    bounds = [(0, 5), (5, 5), (5, 30), (30, 37)]
    key = Stochastic(3, 0)
    out = fp4_gemm.reference_fp4_grouped_wgrad(dy, x, bounds, NV, key)
    assert torch.equal(out[1], torch.zeros(32, 48))  # the empty group
    consumed = 0
    for g in (0, 2, 3):
        start, end = bounds[g]
        qd = fp4_gemm.wgrad_operand(dy[start:end], NV, stochastic=Stochastic(3, consumed))
        consumed += 32 * qd.codes.shape[1] * 2
        qx = fp4_gemm.wgrad_operand(x[start:end], NV)
        assert torch.equal(out[g], fp4_gemm.reference_fp4_mm(qd, qx, torch.float32))
    assert fp4_gemm.grouped_counters(bounds, 32, NV, wgrad=True) == consumed == 32 * 64
    again = fp4_gemm.reference_fp4_grouped_wgrad(dy, x, bounds, NV, key)
    assert torch.equal(out, again)  # reproducible from its key
