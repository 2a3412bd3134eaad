"""The 4-bit twins (``numerics.e2m1``, ``numerics.fp4``) against an oracle written here.

The oracle restates TransformerEngine's NVFP4 chain as issue 37 gives it (torchao's
``nvfp4_reference.py`` transcription of ``core_nvfp4.cuh``), one element at a time in numpy
float32 scalars, with its own E2M1 and E4M3 rounding (nearest value of the format's table,
ties to the even code), its own bf16 rounding (on the bits) and its own Hadamard sums. It
shares no helper with the vectorized twin. Compared bit for bit: codes, scales and dequantized
values for 1x16 and 16x16 blocks, the Hadamard-transformed column-wise operands, zero and
underflowing blocks, the midpoints, inf/NaN under the documented rule, bf16 and f32 inputs.
MXFP4's bytes are compared with torchao's ``MXTensor``; NVFP4 with torchao's ``NVFP4Tensor``
where its chain is TE's, and where it is not. Stochastic rounding is held to its distribution.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from computectx.formats.numerics import e2m1, fp4

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # TE's wgrad signs


# ----- the oracle ---------------------------------------------------------------------------


def o_e2m1(v: float | np.float32) -> int:
    """cvt.rn.satfinite.e2m1x2.f32 on one value: the nearest grid value, ties to the even
    code, above 6 saturates, sign kept (also on zero), NaN -> +6."""
    v = float(v)
    if math.isnan(v):
        return 0x7
    sign = 0x8 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a > 6.0:
        return sign | 7
    return sign | min(range(8), key=lambda c: (abs(a - GRID[c]), c % 2))


def _e4m3_value(b: int) -> float:
    e, m = b >> 3, b & 7
    return m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3 = {b: _e4m3_value(b) for b in range(0x7F)}


def o_e4m3(v: float | np.float32) -> int:
    """The E4M3 byte of a value in [0, 448] (or NaN): nearest table value, ties to even."""
    if math.isnan(v):
        return 0x7F
    return min(E4M3, key=lambda b: (abs(float(v) - E4M3[b]), b % 2))


def o_bf16(v: np.float32) -> float:
    """float32 -> bf16 by round to nearest even on the bits."""
    bits = int(np.array(v, dtype=np.float32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array(bits, dtype=np.uint32).view(np.float32))


def o_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Each run of 16 along the last dim times diag(SIGNS) H16 / 4: the exact sum (Python
    floats, in order), then float32, then bf16."""
    rows = x.float().tolist()
    out = []
    for row in rows:
        new = []
        for base in range(0, len(row), 16):
            run = row[base : base + 16]
            for j in range(16):
                s = 0.0
                for i in range(16):
                    h = -1.0 if bin(i & j).count("1") % 2 else 1.0
                    s += run[i] * SIGNS[i] * h / 4
                new.append(o_bf16(F32(s)))
        out.append(new)
    return torch.tensor(out, dtype=torch.bfloat16)


def o_nvfp4(x: torch.Tensor, rows: int) -> tuple[list[int], list[int], list[float]]:
    """TE's chain on a 2-D x: (scale bytes, packed code bytes, dequantized values), row-major."""
    xs = x.float().numpy()
    r, k = xs.shape
    finite = [abs(float(v)) for v in xs.flat if math.isfinite(v)]
    amax = F32(max(finite, default=0.0))
    codes = np.zeros((r, k), dtype=np.int64)
    deq = np.zeros((r, k), dtype=np.float32)
    scales = []
    with np.errstate(all="ignore"):
        s_enc = F32(2688.0) / amax
        s_enc = FLT_MAX if s_enc > FLT_MAX else s_enc
        if amax == 0 or s_enc == 0:
            s_enc = F32(1.0)
        sixth = F32(1.0) / F32(6.0)
        for br in range(r // rows):
            for bc in range(k // 16):
                block = xs[br * rows : (br + 1) * rows, bc * 16 : (bc + 1) * 16]
                vals = [F32(v) for v in block.flat]
                nan = any(math.isnan(v) for v in vals)
                bamax = F32(math.nan) if nan else max(F32(abs(v)) for v in vals)
                t = bamax * (s_enc * sixth)
                t = F32(448.0) if t > 448.0 else t
                byte = o_e4m3(t)
                scales.append(byte)
                denom = F32(E4M3.get(byte, math.nan)) * (F32(1.0) / s_enc)
                enc = F32(1.0) / denom
                enc = FLT_MAX if enc > FLT_MAX else enc
                for i in range(rows):
                    for j in range(16):
                        c = o_e2m1(F32(block[i, j]) * enc)
                        codes[br * rows + i, bc * 16 + j] = c
                        value = -GRID[c & 7] if c & 8 else GRID[c & 7]
                        deq[br * rows + i, bc * 16 + j] = F32(value) * denom
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).flatten().tolist()
    return scales, packed, deq.flatten().tolist()


def _bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def _same_floats(a: torch.Tensor, b: list[float]) -> bool:
    """Bit for bit, every NaN counted equal to every NaN."""
    a, e = a.flatten(), torch.tensor(b, dtype=torch.float32)
    nan = torch.isnan(a)
    bits_equal = torch.equal(a[~nan].view(torch.int32), e[~nan].view(torch.int32))
    return torch.equal(nan, torch.isnan(e)) and bits_equal


def assert_matches_oracle(q: fp4.Nvfp4Operand, x: torch.Tensor, rows: int) -> None:
    scales, packed, deq = o_nvfp4(x, rows)
    assert _bytes(q.scale) == scales
    assert _bytes(q.codes) == packed
    assert _same_floats(fp4.dequantize_nvfp4(q), deq)


# ----- fixtures -----------------------------------------------------------------------------


def _operand() -> torch.Tensor:
    """32 x 64 float32: rows over six decades, a block on the midpoints under S_enc = 1
    (amax 2688), a zero block with negative zeros, an underflowing block."""
    gen = torch.Generator().manual_seed(37)
    x = torch.randn(32, 64, generator=gen) * torch.logspace(-2, 3, 32)[:, None]
    x[0, :16] = torch.tensor([2688.0] + [1.0] * 15)
    x[1, :16] = torch.tensor(
        [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 0.1, 7, 5.5, 3]
    )
    x[2, 16:32] = 0.0
    x[2, 20] = -0.0
    x[3, 32:48] = 1e-6 * torch.randn(16, generator=gen)  # S_dec underflows E4M3
    return x


@pytest.fixture(scope="module")
def operand() -> torch.Tensor:
    return _operand()


# ----- E2M1 ---------------------------------------------------------------------------------


def test_rounding_table_of_the_midpoints_and_the_edges() -> None:
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, math.inf, -math.inf])
    assert e2m1.e2m1_codes(v).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 0xF]
    v = torch.tensor([-0.0, -0.1, 0.0, math.nan, -math.nan, 0.26, -4.5])
    assert e2m1.e2m1_codes(v).tolist() == [0x8, 0x8, 0, 0x7, 0x7, 1, 0xE]


@given(st.lists(st.floats(width=32), min_size=1, max_size=64))
def test_e2m1_codes_are_the_oracles(values: list[float]) -> None:
    codes = e2m1.e2m1_codes(torch.tensor(values, dtype=torch.float32)).tolist()
    assert codes == [o_e2m1(v) for v in values]


@given(st.lists(st.floats(-6, 6, width=32), min_size=2, max_size=32))
def test_rounding_is_monotone_and_grid_values_are_fixed(values: list[float]) -> None:
    v = torch.tensor(sorted(values), dtype=torch.float32)
    q = e2m1.code_values(e2m1.e2m1_codes(v))
    assert bool((q[1:] >= q[:-1]).all())
    assert torch.equal(e2m1.code_values(e2m1.e2m1_codes(q)), q)


def test_packing_puts_the_even_element_low() -> None:
    codes = torch.tensor([[1, 2, 0xF, 0x8]], dtype=torch.uint8)
    packed = e2m1.pack_codes(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (1, 2)
    assert _bytes(packed) == [0x21, 0x8F]
    assert torch.equal(e2m1.unpack_codes(packed), codes)


def test_philox_is_the_known_answer_vector() -> None:
    # Random123's Philox-4x32-10 known answer for counter 0 and key 0 (first word); the
    # same function as Triton's tl.randint.
    assert e2m1.philox_randint(0, torch.tensor([0])).tolist() == [0x6627E8D5]


def test_hadamard_matrix_is_orthogonal_and_transform_is_the_oracles() -> None:
    t = e2m1.hadamard_matrix()
    assert torch.equal(t @ t.T, torch.eye(16, dtype=torch.float64))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(e2m1.hadamard16(x).view(torch.int16), o_hadamard(x).view(torch.int16))


# ----- NVFP4 against the oracle --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tile", ["1x16", "16x16"])
def test_nvfp4_is_te_chain_bit_for_bit(
    operand: torch.Tensor, dtype: torch.dtype, tile: str
) -> None:
    x = operand.to(dtype)
    q = fp4.quantize_nvfp4(x, tile=tile)  # type: ignore[arg-type]
    rows = 16 if tile == "16x16" else 1
    assert_matches_oracle(q, x, rows)
    if tile == "1x16":
        assert _bytes(q.scale[3, 2:3]) == [0]  # underflowed: a zero scale, no lower clamp
        assert _bytes(q.scale[2, 1:2]) == [0]  # the zero block
        assert set(_bytes(q.codes[2, 8:16])) <= {0x00, 0x80, 0x08, 0x88}
    assert not torch.isnan(fp4.dequantize_nvfp4(q)).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_wgrad_operand_is_the_hadamard_transformed_columns(dtype: torch.dtype) -> None:
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    q = fp4.quantize_wgrad_operand(x)  # 32 x 48: x.t(), blocks of 16 along the tokens
    assert q.codes.shape == (32, 24) and q.scale.shape == (32, 3)
    assert_matches_oracle(q, o_hadamard(x.t()), 1)
    plain = fp4.quantize_wgrad_operand(x, hadamard=False)
    assert_matches_oracle(plain, x.t(), 1)


def test_non_finite_inputs_follow_the_documented_rule(operand: torch.Tensor) -> None:
    x = operand.clone()
    x[4, 3] = math.nan
    x[5, 17] = math.inf
    x[6, 40] = -math.inf
    q = fp4.quantize_nvfp4(x)
    assert_matches_oracle(q, x, 1)
    clean = fp4.quantize_nvfp4(operand)
    assert torch.equal(q.amax, clean.amax)  # non-finite values never reach the tensor amax
    assert _bytes(q.scale[4, :1]) == [0x7F] and set(_bytes(q.codes[4, :8])) == {0x77}
    assert _bytes(q.scale[5, 1:2]) == [0x7E] and _bytes(q.codes[5, 8:9])[0] >> 4 == 0x7
    assert (e2m1.unpack_codes(q.codes[6, 16:24])[8] & 0xF).item() == 0xF  # -inf -> -6
    deq = fp4.dequantize_nvfp4(q)
    assert torch.isnan(deq[4, :16]).all() and not torch.isnan(deq[4, 16:]).any()
    others = torch.ones_like(x, dtype=torch.bool)
    others[4, :16] = others[5, 16:32] = others[6, 32:48] = False
    assert torch.equal(deq[others], fp4.dequantize_nvfp4(clean)[others])


@given(
    amax=st.floats(min_value=0, allow_infinity=False, width=32),
    ratio=st.floats(0, 1),
)
def test_scale_chain_is_the_oracles(amax: float, ratio: float) -> None:
    block = float(F32(amax) * F32(ratio))
    s_enc = fp4.global_encode_scale(torch.tensor(amax, dtype=torch.float32))
    byte = _bytes(fp4.nvfp4_block_scales(torch.tensor(block), s_enc))[0]
    with np.errstate(all="ignore"):
        o_enc = F32(2688.0) / F32(amax)
        o_enc = FLT_MAX if o_enc > FLT_MAX else o_enc
        o_enc = F32(1.0) if amax == 0 or o_enc == 0 else o_enc
        t = F32(block) * (o_enc * (F32(1.0) / F32(6.0)))
    assert s_enc.item() == float(o_enc)
    assert byte == o_e4m3(min(float(t), 448.0))
    assert byte <= 0x7E  # finite, at most 448
    if t <= 2.0**-10:
        assert byte == 0  # no lower clamp: an underflowing block scale is zero


# ----- torchao ------------------------------------------------------------------------------


def _mx_operand() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 128, generator=gen) * torch.logspace(-30, 30, 16)[:, None]
    x[0, :32] = 0.0
    x[1, 32:64] = 1e-39  # subnormal amax
    x[2, 64:96] = 3e38
    x[3, 5] = math.inf
    x[4, :32] = 6.0 * 2.0**-127
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp4_bytes_are_torchaos(dtype: torch.dtype, rounding: str) -> None:
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    modes = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode
    x = _mx_operand().to(dtype)
    scale, data = mx.to_mx(x, torch.float4_e2m1fn_x2, 32, getattr(modes, rounding.upper()))
    q = fp4.quantize_mxfp4(x, rounding=rounding)  # type: ignore[arg-type]
    assert q.scale.dtype == torch.float8_e8m0fnu and q.codes.dtype == torch.float4_e2m1fn_x2
    assert _bytes(q.scale) == _bytes(scale) and _bytes(q.codes) == _bytes(data)
    x[5, 40] = math.nan  # the NaN rule: the NaN scale (torchao's too), every code 0x7
    q = fp4.quantize_mxfp4(x, rounding=rounding)  # type: ignore[arg-type]
    assert _bytes(q.scale[5, 1:2]) == [0xFF] and set(_bytes(q.codes[5, 16:32])) == {0x77}
    assert torch.isnan(fp4.dequantize_mxfp4(q)[5, 32:64]).all()


# The finite inputs "rceil" decodes past float32: |x| >= 7 * 2**125 (0x7F600000). Its block's
# byte is 253 (amax / 6 in (2**125, FLT_MAX / 6], ceiling 126), x / 2**126 lies in [3.5, 4) and
# rounds to code 4 (the tie to the even code at 3.5), and 4 * 2**126 = 2**128. "floor" gives
# byte 252 (2**125) and saturates at 6 * 2**125: finite.
RCEIL_INF = 7.0 * 2.0**125


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rceil_decodes_finite_inputs_from_7_times_2_pow_125_to_inf_as_torchao_does(
    dtype: torch.dtype,
) -> None:
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    modes = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode
    below = float(torch.tensor(RCEIL_INF, dtype=dtype).nextafter(torch.tensor(0.0, dtype=dtype)))
    top = float(torch.finfo(dtype).max)
    x = torch.full((4, 64), 1e-3, dtype=dtype)
    x[0, 0], x[1, 0], x[2, 0], x[3, 0] = RCEIL_INF, -top, below, 1.3e38
    x[0, 32] = -RCEIL_INF  # a second block: the rule is the element's, whatever its sign
    for rounding in ("floor", "rceil"):
        q = fp4.quantize_mxfp4(x, rounding=rounding)
        scale, data = mx.to_mx(x, torch.float4_e2m1fn_x2, 32, getattr(modes, rounding.upper()))
        assert _bytes(q.scale) == _bytes(scale) and _bytes(q.codes) == _bytes(data), rounding
        deq = fp4.dequantize_mxfp4(q)
        if rounding == "floor":
            assert torch.isfinite(deq).all()
            continue
        assert _bytes(q.scale[:3, 0]) == [253, 253, 253]
        assert deq[0, 0] == math.inf and deq[0, 32] == -math.inf and deq[1, 0] == -math.inf
        assert deq[2, 0] == 3 * 2.0**126 and deq[3, 0] == 3 * 2.0**125  # finite below it
        assert torch.isfinite(deq[:, 1:32]).all() and torch.isfinite(deq[:, 33:]).all()


def test_nvfp4_is_torchaos_where_the_chains_agree_and_not_below_e4m3s_normals() -> None:
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=gen).clamp(0.2, 3) * torch.randn(32, 64, generator=gen).sign()
    x[0, 0] = 2688.0  # S_enc = 1 and torchao's per-tensor scale = 1: the same chain when
    ao = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=torch.tensor(1.0))
    q = fp4.quantize_nvfp4(x)  # ... every block scale is at least E4M3's smallest normal
    assert _bytes(q.scale) == _bytes(ao.scale) and _bytes(q.codes) == _bytes(ao.qdata)
    x[1, :16] = 1e-3  # block scale 1e-3 / 6 underflows: TE's chain gives 0, torchao 2**-6
    ao = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=torch.tensor(1.0))
    q = fp4.quantize_nvfp4(x)
    assert _bytes(q.scale[1, :1]) == [0] and _bytes(ao.scale[1, :1]) == [0x08]


# ----- stochastic rounding ------------------------------------------------------------------

SR_VALUES = (0.1, 0.3, 1.3, 2.2, 3.9, 5.1, -3.7, -0.6)
SR_COPIES = 4096


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour() -> None:
    v = torch.tensor(SR_VALUES).repeat_interleave(SR_COPIES)
    codes = e2m1.stochastic_codes(v, e2m1.Stochastic(seed=12345, offset=7))
    got = e2m1.code_values(codes).view(len(SR_VALUES), SR_COPIES)
    for row, value in zip(got, SR_VALUES, strict=True):
        a = abs(value)
        lo = max(g for g in GRID if g <= a)
        hi = min(g for g in GRID if g > a)
        assert set(row.abs().unique().tolist()) <= {lo, hi}
        # Bound: 6 standard deviations of the mean of SR_COPIES Bernoulli(p) draws of gap
        # hi - lo, plus the 2**-32 of a gap the 32-bit draw can miss by.
        p = (a - lo) / (hi - lo)
        bound = 6 * (hi - lo) * math.sqrt(p * (1 - p) / SR_COPIES) + (hi - lo) * 2.0**-32
        assert abs(row.double().mean().item() - value) <= bound, value


def test_stochastic_rounding_is_reproducible_and_counter_based() -> None:
    v = torch.full((256,), 1.3)
    key = e2m1.Stochastic(seed=99, offset=0)
    a = e2m1.stochastic_codes(v, key)
    assert torch.equal(a, e2m1.stochastic_codes(v, key))
    shifted = e2m1.stochastic_codes(v, e2m1.Stochastic(seed=99, offset=5))
    assert torch.equal(shifted[:-5], a[5:])  # element i draws the bits of counter offset + i
    assert not torch.equal(a, e2m1.stochastic_codes(v, e2m1.Stochastic(seed=100)))
    grid = torch.tensor([0.0, -0.5, 1.5, 3.0, 6.0, 9.0, math.nan])
    assert torch.equal(
        e2m1.stochastic_codes(grid, key), e2m1.e2m1_codes(grid)
    )  # grid values, saturation and NaN never move


def test_stochastic_nvfp4_keeps_the_scales_and_is_unbiased(operand: torch.Tensor) -> None:
    x, n = operand[8:24, :32], 100
    near = fp4.quantize_nvfp4(x)
    draws = [fp4.quantize_nvfp4(x, stochastic=e2m1.Stochastic(seed=s)) for s in range(n)]
    assert all(torch.equal(d.scale.view(torch.uint8), near.scale.view(torch.uint8)) for d in draws)
    mean = torch.stack([fp4.dequantize_nvfp4(d) for d in draws]).double().mean(0)
    # A block's gaps are at most 2 decode factors, so one draw's deviation from its mean is
    # at most one factor: the mean of n draws is within 6 / sqrt(n) factors (6 sigma).
    factor = near.scale.float() / fp4.global_encode_scale(near.amax)
    factor = factor.double().repeat_interleave(16, dim=1)
    assert ((mean - x.double()).abs() <= 6 * factor / math.sqrt(n)).all()


# ----- storage and checks -------------------------------------------------------------------


def test_storage_bytes_per_element() -> None:
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    n = w.numel()
    assert fp4.quantize_nvfp4(w).nbytes == 0.5625 * n + 4
    assert fp4.quantize_nvfp4(w, tile="16x16").nbytes == (0.5 + 1 / 256) * n + 4  # 0.5039
    assert fp4.quantize_mxfp4(w).nbytes == 0.53125 * n


def test_bad_inputs_are_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        fp4.quantize_nvfp4(torch.zeros(4, 24))
    with pytest.raises(ValueError, match="16x16"):
        fp4.quantize_nvfp4(torch.zeros(2, 16, 16), tile="16x16")
    with pytest.raises(ValueError, match="tile"):
        fp4.quantize_nvfp4(torch.zeros(16, 16), tile="32x32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bf16, f16 or f32"):
        fp4.quantize_mxfp4(torch.zeros(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="rounding"):
        fp4.quantize_mxfp4(torch.zeros(2, 32), rounding="even")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        e2m1.Stochastic(seed=-1)


class _HostData(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Counts the tensors made from host data (``torch.tensor(...)``: ``aten.lift_fresh``),
    each a copy to the device on a GPU."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


def test_the_decode_and_transform_tables_are_made_once_per_device() -> None:
    # The code, byte-pair and Hadamard tables are kept per device: a GEMM's twin copies no
    # host data to its device after the first.
    packed = e2m1.pack_codes(torch.arange(32, dtype=torch.uint8).reshape(2, 16) % 16)
    x = torch.randn(4, 32)
    first = (e2m1.packed_values(packed), e2m1.code_values(packed.view(torch.uint8)))
    e2m1.hadamard16(x)
    with _HostData() as made:
        again = (e2m1.packed_values(packed), e2m1.code_values(packed.view(torch.uint8)))
        e2m1.hadamard16(x)
    assert made.count == 0
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_a_table_first_made_under_inference_mode_serves_a_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(e2m1, "_CONSTANTS", {})
    with torch.inference_mode():
        e2m1.hadamard16(torch.randn(2, 16))
    x = torch.randn(2, 16, requires_grad=True)
    (grad,) = torch.autograd.grad(e2m1.hadamard16(x).float().sum(), x)
    assert grad.shape == x.shape


def test_a_table_asked_for_during_a_graph_capture_is_made_afresh_and_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A copy made while a CUDA stream captures is filled only when the graph replays: kept,
    # it would serve later eager calls an unfilled table. (The capture is stood in for.)
    monkeypatch.setattr(e2m1, "_CONSTANTS", {})
    monkeypatch.setattr(e2m1, "_capturing", lambda device: True)
    first = e2m1.hadamard16(torch.randn(2, 16))
    assert e2m1._CONSTANTS == {} and first.shape == (2, 16)
    monkeypatch.setattr(e2m1, "_capturing", lambda device: False)
    e2m1.hadamard16(torch.randn(2, 16))
    assert len(e2m1._CONSTANTS) == 1


def test_quantize_nvfp4_checks_a_given_amax() -> None:
    """A given per-tensor amax is a float32 () or (1,), finite and >= 0 (0: an all-zero
    tensor); anything else is refused naming what is wrong (never printing it), never cast."""
    x = torch.randn(4, 32)
    faults = {-2.5: "negative", math.nan: "NaN", math.inf: "inf", -math.inf: "-inf"}
    for bad, what in faults.items():
        for shape in ((), (1,)):
            want = f"quantize_nvfp4: amax must be finite and >= 0 (a max |x|), got {what}"
            with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
                fp4.quantize_nvfp4(x, amax=torch.full(shape, bad))
    for bad_t in (torch.tensor(2.0, dtype=torch.float64), torch.tensor([2.0, 3.0])):
        with pytest.raises(ValueError, match=r"float32 tensor of shape \(\) or \(1,\), got"):
            fp4.quantize_nvfp4(x, amax=bad_t)
    a = fp4.quantize_nvfp4(x, amax=torch.tensor([2.5]))
    b = fp4.quantize_nvfp4(x, amax=torch.tensor(2.5))
    assert a.amax.shape == () and torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
    assert fp4.quantize_nvfp4(torch.zeros(1, 16), amax=torch.tensor(0.0)).amax.item() == 0.0
