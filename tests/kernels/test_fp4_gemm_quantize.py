"""The Triton 4-bit quantize (``computectx.kernels.fp4_quantize``) against its twins, bit for
bit: codes, scales and amax of ``numerics.fp4_gemm.quantize_rows`` (NVFP4 1x16 and 16x16,
MXFP4 rceil and floor) and ``wgrad_operand`` (padding, the Hadamard transform), round to
nearest and stochastic (Philox bits keyed by ``(seed, counter)``, the seed above 2**63 too),
with NaN, ±inf, zero, subnormal and near-overflow blocks, bf16/fp16/fp32 inputs and strided
ones. Interpreted on the CPU, compiled on a GPU (any CUDA device runs the quantize: it needs
no FP4 tensor cores).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from computectx.formats.numerics import fp4_gemm as twin
from computectx.formats.numerics.e2m1 import HADAMARD_SIZE, WGRAD_SIGNS, Stochastic, philox_randint
from computectx.formats.numerics.fp4 import Nvfp4Operand, tensor_amax
from computectx.formats.numerics.fp4_gemm import Fp4Format, Fp4Quant

from .conftest import ON_GPU
from .test_fp4_gemm import fp4_kernel_module

pytestmark = [
    pytest.mark.interpreter,
    # The interpreter's numpy warns on the NaN and inf the special values are meant to make.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

kq = fp4_kernel_module("computectx.kernels.fp4_quantize")
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SEED_HIGH = Stochastic(2**63 + 12345, 77)  # a seed stored as a negative int64


def rng_of(key: Stochastic | None) -> torch.Tensor | None:
    if key is None:
        return None
    seed = key.seed - 2**64 if key.seed >= 2**63 else key.seed
    return torch.tensor([seed, key.offset], dtype=torch.int64, device=DEVICE)


def data(rows: int, cols: int, dtype: torch.dtype, seed: int, special: bool) -> torch.Tensor:
    """Rows 2**±8 apart; with ``special``: a NaN, ±inf, a zero block, a subnormal one and one
    whose amax / 6 is subnormal (MXFP4 rceil's exponent -126 there)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x = x * torch.exp2(torch.randint(-8, 9, (rows, 1), generator=gen).float())
    if special:
        x[1, 3], x[2, 5], x[2, 40] = float("nan"), float("inf"), -float("inf")
        x[4, :32] = 0.0
        x[5, 32:64] = x[5, 32:64] * 2.0**-130  # subnormal in float32, zero in bf16/fp16
        x[6, 64:96] = x[6, 64:96] / x[6, 64:96].abs().max() * 5e-38
    return x.to(dtype)


def assert_same(
    got: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
) -> None:
    c, s, a = (t.cpu() for t in got)
    assert c.dtype == torch.float4_e2m1fn_x2 and s.dtype == scale.dtype and a.shape == (1,)
    assert torch.equal(s.view(torch.uint8), scale.view(torch.uint8)), "scales"
    differ = (c.view(torch.uint8) != codes.view(torch.uint8)).sum().item()
    assert differ == 0, f"{differ} code bytes differ"
    assert torch.equal(a.view(torch.int32), amax.reshape(1).float().view(torch.int32))


ROW_CASES = [
    # (format, tile, mx rounding, dtype, stochastic key, special values, strided x)
    ("nvfp4", "1x16", "rceil", torch.float32, None, True, False),
    ("nvfp4", "16x16", "rceil", torch.bfloat16, SEED_HIGH, True, True),
    ("nvfp4", "1x16", "rceil", torch.float16, Stochastic(3, 2**40), False, False),
    ("mxfp4", "1x16", "rceil", torch.bfloat16, SEED_HIGH, True, False),
    ("mxfp4", "1x32", "floor", torch.float32, None, True, True),
]


@pytest.mark.parametrize(
    ("fmt", "tile", "rounding", "dtype", "key", "special", "strided"), ROW_CASES
)
def test_row_wise_operands_are_the_twins(
    fmt: Fp4Format,
    tile: str,
    rounding: str,
    dtype: torch.dtype,
    key: Stochastic | None,
    special: bool,
    strided: bool,
) -> None:
    x = data(48, 96, dtype, len(tile) + len(rounding), special)
    how = Fp4Quant(
        format=fmt,
        weight_tile="16x16" if tile == "16x16" else "1x16",
        mx_rounding="floor" if rounding == "floor" else "rceil",
    )
    ref = twin.quantize_rows(x, how, weight=tile == "16x16", stochastic=key)
    arg = x.t().contiguous().t() if strided else x  # column-major storage, same values
    got = kq.fp4_quantize(
        arg.to(DEVICE), fmt, tile, rounding, False, False, list(WGRAD_SIGNS), rng_of(key)
    )
    amax = ref.amax if isinstance(ref, Nvfp4Operand) else tensor_amax(x)
    assert_same(got, ref.codes, ref.scale, amax)


COLUMN_CASES = [
    # (format, Hadamard transform, dtype, M (padded to 16 or 32), stochastic key)
    ("nvfp4", True, torch.bfloat16, 37, Stochastic(5, 1000)),
    ("nvfp4", False, torch.float32, 20, None),
    ("mxfp4", True, torch.bfloat16, 45, SEED_HIGH),
    ("mxfp4", False, torch.float16, 32, Stochastic(8, 0)),
]


@pytest.mark.parametrize(("fmt", "hadamard", "dtype", "m", "key"), COLUMN_CASES)
def test_wgrad_operands_are_the_twins(
    fmt: Fp4Format, hadamard: bool, dtype: torch.dtype, m: int, key: Stochastic | None
) -> None:
    # bf16 runs of 16 within 12 binades: the transform's float32 sums are exact, so they
    # round as the twin's float64 ones (numerics.e2m1).
    x = data(m, 40, dtype, m, special=False)
    how = Fp4Quant(format=fmt, hadamard=hadamard)
    ref = twin.wgrad_operand(x, how, stochastic=key)
    signs = list(WGRAD_SIGNS)
    got = kq.fp4_quantize(x.to(DEVICE), fmt, "1x16", "rceil", True, hadamard, signs, rng_of(key))
    amax = ref.amax if isinstance(ref, Nvfp4Operand) else tensor_amax(x)
    assert_same(got, ref.codes, ref.scale, amax)


def test_every_stochastic_rounding_is_the_twins_on_a_grid_sweep() -> None:
    # Every fraction between the grid's neighbours, both signs, and the saturated ends,
    # under one scale (a block amax of 6 and a per-tensor amax making S_dec = 1).
    v = torch.linspace(-6.5, 6.5, 16 * 52).reshape(52, 16)
    v[:, 0] = 6.0
    key = Stochastic(11, 5)
    ref = twin.quantize_rows(v, Fp4Quant(format="nvfp4"), stochastic=key)
    got = kq.fp4_quantize(
        v.to(DEVICE), "nvfp4", "1x16", "rceil", False, False, list(WGRAD_SIGNS), rng_of(key)
    )
    assert isinstance(ref, Nvfp4Operand)
    assert_same(got, ref.codes, ref.scale, ref.amax)


def test_a_draw_equal_to_the_fraction_rounds_down() -> None:
    # P(up) = ceil(frac * 2**32) / 2**32: up only when the draw is below frac * 2**32. An
    # element whose fraction times 2**32 is exactly its draw (a draw that is a multiple of
    # 2**9, so 1 + draw / 2**32 is a float32) rounds down. MXFP4 with a 6 in the block:
    # the encode factor is 1, the value reaches the rounding as it is.
    key = Stochastic(21, 0)
    draws = philox_randint(key.seed, torch.arange(4096))
    i = int(torch.nonzero(draws % 512 == 0)[0])
    x = torch.zeros(i // 32 + 1, 32)
    x[:, 0] = 6.0
    x.view(-1)[i] = (1.0 + float(draws[i]) / 2.0**32) * 0.5  # t = 1 + frac, frac = draw / 2**32
    ref = twin.quantize_rows(x, Fp4Quant(format="mxfp4"), stochastic=key)
    got = kq.fp4_quantize(
        x.to(DEVICE), "mxfp4", "1x32", "rceil", False, False, list(WGRAD_SIGNS), rng_of(key)
    )
    assert (int(ref.codes.view(torch.uint8).view(-1)[i // 2]) >> (4 * (i % 2))) & 0xF == 1  # 0.5
    assert_same(got, ref.codes, ref.scale, tensor_amax(x))


def test_an_all_tiny_tensor_saturates_the_encode_scale_as_the_twin() -> None:
    # amax 1e-40: 2688 / amax overflows float32, S_enc is FLT_MAX.
    x = torch.full((16, 32), 1e-40)
    x[3, 7] = -3e-41
    ref = twin.quantize_rows(x, Fp4Quant(format="nvfp4"))
    got = kq.fp4_quantize(
        x.to(DEVICE), "nvfp4", "1x16", "rceil", False, False, list(WGRAD_SIGNS), None
    )
    assert isinstance(ref, Nvfp4Operand)
    assert_same(got, ref.codes, ref.scale, ref.amax)


def test_the_transforms_size_is_the_twins() -> None:
    assert kq.HADAMARD_SIZE == HADAMARD_SIZE


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_wgrad_row_multiple_is_the_twins(fmt: Fp4Format, hadamard: bool) -> None:
    how = Fp4Quant(format=fmt, hadamard=hadamard)
    assert kq.wgrad_row_multiple(how.block, hadamard) == twin.wgrad_row_multiple(how)


def test_empty_and_bad_arguments() -> None:
    signs = list(WGRAD_SIGNS)
    codes, scale, amax = kq.fp4_quantize(
        torch.zeros(0, 32, device=DEVICE), "mxfp4", "1x16", "floor", False, False, signs, None
    )
    assert codes.shape == (0, 16) and scale.shape == (0, 1) and float(amax) == 0.0
    x = torch.zeros(16, 32, device=DEVICE)
    for args, match in (
        ((torch.zeros(16, 32, dtype=torch.float64), "nvfp4", "1x16"), "2-D bf16, fp16 or fp32"),
        ((x, "nvfp4", "1x32"), "format and tile"),
        ((x, "int4", "1x16"), "format and tile"),
        ((x[:, :24], "nvfp4", "1x16"), "multiple of 16"),
        ((x[:8], "nvfp4", "16x16"), "rows of 16"),
    ):
        with pytest.raises(ValueError, match=match):
            kq.fp4_quantize(*args, "rceil", False, False, signs, None)
    with pytest.raises(ValueError, match="mx_rounding"):
        kq.fp4_quantize(x, "mxfp4", "1x16", "ceil", False, False, signs, None)
    with pytest.raises(ValueError, match="signs must be 16"):
        kq.fp4_quantize(x, "nvfp4", "1x16", "rceil", True, True, [1] * 8, None)
    with pytest.raises(ValueError, match="rng must be"):
        kq.fp4_quantize(x, "nvfp4", "1x16", "rceil", False, False, signs, torch.zeros(2))


class _Launches:
    """Stands in for ``_quantize_kernel``: records each launch's arguments, runs nothing."""

    def __init__(self) -> None:
        self.args: list[tuple[object, ...]] = []

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: object, **_: object) -> None:
            self.args.append(args)

        return launch


def test_a_host_key_reaches_the_launch_as_two_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    # A key on the CPU (a layer's plain state) is read on the host and passed by value: the
    # kernel takes no tensor of it, so nothing is copied to the device per call.
    launches = _Launches()
    monkeypatch.setattr(kq, "_quantize_kernel", launches)
    key = torch.tensor([-5, 2**40 + 3], dtype=torch.int64)
    x = torch.ones(16, 32, device=DEVICE)
    kq.fp4_quantize(x, "nvfp4", "1x16", "rceil", False, False, list(WGRAD_SIGNS), key)
    (args,) = launches.args
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(t.device == x.device and t.data_ptr() != key.data_ptr() for t in tensors)
    assert args[5:7] == (-5, 2**40 + 3)


KEYS = [
    Stochastic(2**64 - 5, 3),  # a seed of 32 bits as a negative int64: sign-extended
    Stochastic(7, 2**40),  # a counter past 32 bits
    SEED_HIGH,
]


@pytest.mark.parametrize("key", KEYS, ids=["negative-seed", "counter-2**40", "seed-high"])
def test_a_key_in_device_memory_draws_the_host_keys_bits(
    key: Stochastic, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel reads a key on the device itself; here, interpreted, the CPU key is sent
    # down that path as well: both draw the twin's bits.
    x = data(32, 64, torch.bfloat16, 4, special=False)
    ref = twin.quantize_rows(x, Fp4Quant(format="nvfp4"), stochastic=key)
    assert isinstance(ref, Nvfp4Operand)
    rng = rng_of(key)
    assert rng is not None
    args = ("nvfp4", "1x16", "rceil", False, False, list(WGRAD_SIGNS), rng.cpu())
    assert_same(kq.fp4_quantize(x.to(DEVICE), *args), ref.codes, ref.scale, ref.amax)
    monkeypatch.setattr(kq, "_key_args", lambda rng: (rng.to(DEVICE), 0, 0))
    assert_same(kq.fp4_quantize(x.to(DEVICE), *args), ref.codes, ref.scale, ref.amax)
