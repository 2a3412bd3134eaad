"""Parity with torchao 0.18 (issue 16 item 7): the row-wise linear and the MX quantize.

**The row-wise linear.** ``QuantizedLinear`` under ``fp8_rowwise`` / ``fp8_rowwise_gw_hp`` and
torchao's ``Float8Linear`` under its ``ROWWISE`` / ``ROWWISE_WITH_GW_HP`` recipes with
``emulate=True`` run the same layer on the same bf16 activations and output gradients (the
flags' compute dtype), with the weight in float32 (the flags' master weights) or bf16. The
SQNR of the output, dX and dW against the float64 result on the same values must be within
0.5 dB of torchao's. Both quantize every operand row-wise along its contraction dimension
with power-of-two steps (torchao rounds ``fmt.max / amax`` down to a power of two, we round
``amax / fmt.max`` up: the same step), so the codes are the same and the figures agree to a
few hundredths of a dB. Two differences by design, both asserted below:

- ``ROWWISE_WITH_GW_HP``'s dgrad quantizes W per tensor (``cast_config_weight_for_grad_input``
  is tensorwise); ours quantizes Wᵀ row-wise along N (docs/fp8.md). On Gaussian weights the
  two give the same SQNR; on a weight with outlier input channels ours is the better one.
- With ``gw_hp``, torchao's high-precision wgrad is ``torch.mm`` of the bf16 operands, rounded
  to bf16 before autograd widens it to a float32 weight's dtype; ours keeps the float32
  product for a float32 weight (computectx/formats/linear/blockwise.py). With a float32 weight ours
  is
  therefore far more accurate, and rounded to bf16 it is within 0.5 dB of torchao's; with a bf16
  weight both round once to bf16.

torchao's public ``convert_to_float8_training`` patches inductor's Triton code generation for
the whole process (``torchao/float8/_inductor_patch.py``), which other tests in the same run
compile through; these tests build the layer with ``Float8Linear.from_float``, the per-layer
step that ``convert_to_float8_training`` runs, and leave inductor alone.

**The MX quantize.** ``quantize_tensor(x, fmt, granularity="mx", mx_rounding=r)`` gives the same
codes and E8M0 scales, byte for byte, as ``MXTensor.to_mx(x, fmt, 32, scaling_mode=R)`` for
``r``/``R`` = ``"floor"``/``FLOOR`` and ``"rceil"``/``RCEIL``, E4M3 and E5M2, float32 and bf16
inputs, on every block whose amax is finite, positive and not tiny. Where the two differ by
definition, the tests check what is comparable:

- an all-zero block: ours has step 1 (byte 127), torchao's byte 0 (``2**-127``); the codes
  (all zero) agree;
- a block whose E8M0 byte is 0 (amax below about ``2**-118``): the bytes agree, but torchao
  does not quantize with the step its byte says: FLOOR divides by ``2**-126`` (its scale is
  clamped to float32's smallest normal), RCEIL by 1 (its reciprocal of byte 0 is 1); ours
  divides by ``2**-127``. torchao's codes are ours under a given byte 1 (FLOOR) or 127 (RCEIL);
- a block holding a NaN or ±inf: ours is quantized with step 1 (byte 127, the per-tensor
  rule applied to that block), torchao's byte is 255 (NaN) or the exponent of inf (247 under
  FLOOR for E4M3, 254 under RCEIL) and its finite elements become 0 or NaN. A NaN element is
  the fp8 NaN and ±inf saturates to ±max in both, and every other block is unaffected;
- RCEIL when ``amax / fmt.max`` is a few float32 ulps above a power of two far from 1: ours
  takes the exact ``ceil(log2(.))`` (integer arithmetic, as TransformerEngine and cuBLAS do);
  torchao's eager ``to_mx`` takes ``ceil`` of a float32 ``log2``, which rounds the excess
  away, and so picks the exponent one lower and saturates the block's largest element.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats import MxRounding, QuantizedLinear, quantize_tensor

float8 = pytest.importorskip("torchao.float8")
float8_linear = pytest.importorskip("torchao.float8.float8_linear")
mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")

import bench_granularity as bench  # noqa: E402  (after the skips above)

sqnr: Callable[[torch.Tensor, torch.Tensor], float] = bench.sqnr  # the bench's SQNR, in dB

E8M0 = torch.float8_e8m0fnu
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MODES: dict[MxRounding, str] = {"floor": "FLOOR", "rceil": "RCEIL"}


# ---------------------------------------------------------------------------------------
# The row-wise linear.

RECIPES = [("fp8_rowwise", "rowwise"), ("fp8_rowwise_gw_hp", "rowwise_with_gw_hp")]
SHAPES = [(128, 256, 192), (96, 160, 320)]  # (tokens M, in_features K, out_features N)


@dataclasses.dataclass(frozen=True)
class LinearCase:
    x: torch.Tensor  # [M, K] bf16
    weight: torch.Tensor  # [N, K]
    bias: torch.Tensor  # [N]
    dy: torch.Tensor  # [M, N] bf16
    outlier_channels: tuple[int, ...] = ()  # input channels (columns of W) scaled up

    def exact(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Output, dX and dW in float64 on the same (already rounded) values."""
        x, w, dy = self.x.double(), self.weight.double(), self.dy.double()
        return x @ w.t() + self.bias.double(), dy @ w, dy.t() @ x


def linear_case(
    shape: tuple[int, int, int],
    weight_dtype: torch.dtype,
    token_outliers: float | None = None,
    channel_outliers: float | None = None,
) -> LinearCase:
    """Gaussian X, W (std 1/sqrt(K)), bias and dY; optionally 4 tokens (rows of X and dY)
    times ``token_outliers``, or 4 input channels of W (columns) times ``channel_outliers``."""
    m, k, n = shape
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g) / 10
    dy = torch.randn(m, n, generator=g)
    if token_outliers is not None:
        rows = torch.randperm(m, generator=g)[:4]
        x[rows] *= token_outliers
        dy[rows] *= token_outliers
    channels: tuple[int, ...] = ()
    if channel_outliers is not None:
        channels = tuple(int(c) for c in torch.randperm(k, generator=g)[:4])
        w[:, channels] *= channel_outliers
    return LinearCase(x.bfloat16(), w.to(weight_dtype), b.to(weight_dtype), dy.bfloat16(), channels)


def ours(flag: str, case: LinearCase) -> nn.Linear | QuantizedLinear:
    n, k = case.weight.shape
    ctx = ComputeCtx.from_flag(flag, "cpu")
    layer = QuantizedLinear(k, n, ctx=ctx, dtype=case.weight.dtype)
    assert layer.bias is not None
    with torch.no_grad():
        layer.weight.copy_(case.weight)
        layer.bias.copy_(case.bias)
    return layer


def torchaos(recipe: str, case: LinearCase) -> nn.Module:
    n, k = case.weight.shape
    plain = nn.Linear(k, n, dtype=case.weight.dtype)
    with torch.no_grad():
        plain.weight.copy_(case.weight)
        plain.bias.copy_(case.bias)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=True)
    assert config.round_scales_to_power_of_2 and config.emulate
    layer: nn.Module = float8_linear.Float8Linear.from_float(plain, config=config)
    return layer


def run(layer: nn.Module, case: LinearCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output, dX and dW for ``case`` (one forward and backward)."""
    x = case.x.clone().requires_grad_()
    y = layer(x)
    y.backward(case.dy)
    weight = layer.weight
    assert isinstance(weight, torch.Tensor) and weight.grad is not None and x.grad is not None
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert weight.grad.dtype == case.weight.dtype
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_outliers", [None, 1e4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("flag", "recipe"), RECIPES)
def test_rowwise_linear_sqnr_is_within_half_a_db_of_torchao(
    flag: str,
    recipe: str,
    shape: tuple[int, int, int],
    token_outliers: float | None,
    weight_dtype: torch.dtype,
) -> None:
    case = linear_case(shape, weight_dtype, token_outliers)
    exact = case.exact()
    got = run(ours(flag, case), case)
    want = run(torchaos(recipe, case), case)
    figures = {
        name: (sqnr(g, e), sqnr(w, e))
        for name, g, w, e in zip(("output", "dX", "dW"), got, want, exact, strict=True)
    }
    for name, (mine, theirs) in figures.items():
        if name == "dW" and flag.endswith("gw_hp") and weight_dtype == torch.float32:
            # Ours keeps the float32 product; torchao's bf16 GEMM rounds it to bf16 first.
            assert mine > theirs + 40, figures
            assert abs(sqnr(got[2].bfloat16(), exact[2]) - theirs) <= 0.5, figures
        else:
            assert abs(mine - theirs) <= 0.5, (name, figures)
    # fp8 E4M3 on both operands: about 28.5 dB, whatever the outlier tokens (row-wise steps).
    assert figures["output"][0] > 26 and figures["dX"][0] > 26, figures


def test_gw_hp_dgrad_requantizes_the_weight_rowwise_where_torchao_scales_it_per_tensor() -> None:
    # A weight with 4 input channels 1e5 times the rest: torchao's per-tensor W in the dgrad
    # takes its step from them, and the other channels fall below E4M3's smallest subnormal;
    # ours gives each row of Wᵀ (each channel) its own step.
    case = linear_case(SHAPES[0], torch.float32, channel_outliers=1e5)
    exact = case.exact()
    got = run(ours("fp8_rowwise_gw_hp", case), case)
    want = run(torchaos("rowwise_with_gw_hp", case), case)
    # dX's columns outside the outlier channels (those carry almost all of its energy).
    body = torch.ones(exact[1].shape[1], dtype=torch.bool)
    body[list(case.outlier_channels)] = False
    mine, theirs = (
        sqnr(got[1][:, body], exact[1][:, body]),
        sqnr(want[1][:, body], exact[1][:, body]),
    )
    assert mine > 26 and mine > theirs + 3, (mine, theirs)
    # The forward quantizes W along K in both (its rows): the same figure.
    assert abs(sqnr(got[0], exact[0]) - sqnr(want[0], exact[0])) <= 0.5


# ---------------------------------------------------------------------------------------
# The MX quantize.


def to_mx(x: torch.Tensor, fmt: str, rounding: MxRounding) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's ``(codes, E8M0 scales)`` as uint8."""
    mode = getattr(mx_config.ScaleCalculationMode, MODES[rounding])
    t = mx_tensor.MXTensor.to_mx(x, FP8[fmt], 32, scaling_mode=mode)
    codes, scale = t.qdata, t.scale
    assert isinstance(codes, torch.Tensor) and isinstance(scale, torch.Tensor)
    assert codes.dtype == FP8[fmt] and scale.dtype == E8M0
    return codes.view(torch.uint8), scale.view(torch.uint8)


def mx(
    x: torch.Tensor, fmt: str, rounding: MxRounding, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours, as uint8; ``scale`` (E8M0 bytes as uint8) is given when not None."""
    given = None if scale is None else scale.view(E8M0)
    if given is None:
        q, s = quantize_tensor(x, fmt, granularity="mx", mx_rounding=rounding)
    else:
        q, s = quantize_tensor(x, fmt, given, granularity="mx")
    return q.view(torch.uint8), s.view(torch.uint8)


def spread(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian blocks scaled by 2**e, e drawn per block from [-100, 100] (the first three
    blocks get 0, -100 and 100), and within each block by 2**[-12, 0] per element; the first
    three elements of every row are 0 and the fourth -0."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    x = torch.randn(shape, generator=g)
    e = torch.randint(-100, 101, (*lead, k // 32, 1), generator=g).to(torch.float32)
    e.view(-1)[:3] = torch.tensor([0.0, -100.0, 100.0])  # both ends, and ordinary values
    inner = torch.randint(-12, 1, (*lead, k // 32, 32), generator=g).to(torch.float32)
    x = x * torch.exp2(e + inner).reshape(shape)
    x[..., :3] = 0.0  # blocks with some zeros
    x[..., 3] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("shape", [(64, 256), (3, 5, 96)])
def test_mx_codes_and_scales_are_torchaos_byte_for_byte(
    shape: tuple[int, ...], rounding: MxRounding, fmt: str, dtype: torch.dtype
) -> None:
    x = spread(shape, dtype, seed=len(shape))
    q, s = mx(x, fmt, rounding)
    tq, ts = to_mx(x, fmt, rounding)
    assert s.shape == ts.shape == (*shape[:-1], shape[-1] // 32)
    assert torch.equal(s, ts)
    assert torch.equal(q, tq)
    # Exponents far from 127 both ways, and saturation under floor, were exercised.
    assert int(s.min()) < 40 and int(s.max()) > 200
    if rounding == "floor":
        fmax = torch.finfo(FP8[fmt]).max
        assert bool((q.view(FP8[fmt]).float().abs() == fmax).any()), "no element saturated"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_zero_blocks_differ_only_in_their_scale(rounding: MxRounding, fmt: str) -> None:
    x = spread((4, 128), torch.float32, seed=0)
    x[1] = 0.0  # four all-zero blocks
    x[2, 32:64] = -0.0
    q, s = mx(x, fmt, rounding)
    tq, ts = to_mx(x, fmt, rounding)
    assert torch.equal(q, tq)  # the zeros keep their sign in both
    zero = (x.reshape(4, 4, 32) == 0).all(-1)
    assert int(zero.sum()) == 5
    assert bool((s[zero] == 127).all()) and bool((ts[zero] == 0).all())  # 1.0 vs 2**-127
    assert torch.equal(s[~zero], ts[~zero])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_tiny_blocks(rounding: MxRounding, fmt: str) -> None:
    # Block amaxes from 2**-100 down to float32 subnormals: bytes 1 and up agree entirely;
    # at byte 0 the bytes agree and torchao quantizes with another step than its byte's.
    g = torch.Generator().manual_seed(1)
    amax_exp = torch.arange(-100, -148, -1).to(torch.float32)  # 48 blocks
    x = torch.rand(48, 32, generator=g) * torch.exp2(amax_exp).unsqueeze(1)
    x[:, 0] = torch.exp2(amax_exp)  # each block's amax, exactly
    x = x.reshape(2, 768)
    q, s = mx(x, fmt, rounding)
    tq, ts = to_mx(x, fmt, rounding)
    assert torch.equal(s, ts)
    byte0 = (s == 0).repeat_interleave(32, dim=1)
    assert 0 < int(byte0.sum()) < x.numel()  # both kinds of block are here
    assert torch.equal(q[~byte0], tq[~byte0])
    # Ours divides by 2**-127, the step its byte says: x / 2**-127 exactly (a power of two).
    assert torch.equal(q, mx(x, fmt, rounding, s)[0])
    # torchao's byte-0 codes are ours with step 2**-126 (FLOOR) or 1 (RCEIL).
    other = torch.full_like(s, 1 if rounding == "floor" else 127)
    assert torch.equal(tq[byte0], mx(x, fmt, rounding, other)[0][byte0])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_non_finite_blocks_agree_where_comparable(rounding: MxRounding, fmt: str) -> None:
    x = spread((4, 128), torch.float32, seed=2)
    x[0, 5] = math.nan
    x[1, 40] = math.inf
    x[2, 70] = -math.inf
    x[3, 100], x[3, 101] = math.nan, 1e30
    q, s = mx(x, fmt, rounding)
    tq, ts = to_mx(x, fmt, rounding)
    bad = ~torch.isfinite(x.reshape(4, 4, 32)).all(-1)
    assert int(bad.sum()) == 4
    # Every finite block is untouched by its neighbours, in both.
    blocks = bad.repeat_interleave(32, dim=1)
    assert torch.equal(q[~blocks], tq[~blocks]) and torch.equal(s[~bad], ts[~bad])
    # The non-finite blocks: ours has step 1; torchao's byte is NaN's or inf's exponent.
    assert bool((s[bad] == 127).all()) and bool((ts[bad] != 127).all())
    nan, inf = torch.isnan(x), torch.isinf(x)
    value = q.view(FP8[fmt]).float()
    assert torch.equal(q[nan], tq[nan]) and bool(value[nan].isnan().all())
    assert torch.equal(q[inf], tq[inf])
    assert torch.equal(value[inf], x[inf].sign() * torch.finfo(FP8[fmt]).max)


def exact_ceil_log2(q: float) -> int:
    m, e = math.frexp(q)  # q = m * 2**e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


@pytest.mark.parametrize(("fmt", "k"), [("e4m3", 20), ("e4m3", -40), ("e5m2", 30)])
def test_mx_rceil_is_exact_where_a_float32_log2_rounds(fmt: str, k: int) -> None:
    # amax = fmt.max * 2**k, one float32 ulp up: amax / fmt.max rounds to 2**k (1 + 2**-23),
    # whose exact ceil(log2) is k + 1. float32 log2 gives k + 2**-23/ln 2, and at |k| >= 16
    # that rounds to k: torchao picks 2**k, and its amax then saturates to fmt.max.
    fmax = torch.finfo(FP8[fmt]).max
    amax = torch.nextafter(torch.tensor(fmax * 2.0**k), torch.tensor(math.inf))
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = amax, amax / 3
    q, s = mx(x, fmt, "rceil")
    quotient = float(amax / torch.tensor(fmax))  # the float32 division, as both do
    assert int(s) - 127 == exact_ceil_log2(quotient) == k + 1
    fmax_code = torch.tensor(fmax, dtype=FP8[fmt]).view(torch.uint8)
    assert int(q[0, 0]) < int(fmax_code)  # nothing saturates under the exact exponent
    tq, ts = to_mx(x, fmt, "rceil")
    if int(ts) == int(s):  # a torchao that rounds exactly agrees in full
        assert torch.equal(q, tq)
    else:  # torchao 0.18: one exponent lower, and its amax saturates
        assert int(ts) == int(s) - 1 and int(tq[0, 0]) == int(fmax_code)
