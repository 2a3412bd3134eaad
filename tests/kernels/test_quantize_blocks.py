"""The block quantize kernels against their pure-torch twins: fp8 bytes and scales bit for bit.

Runs on an fp8 GPU when there is one, else under ``TRITON_INTERPRET=1`` (see conftest).
Every granularity (row-wise, 1x128, 128x128, MX) and option, its column-wise (transposed)
variant, given scales, and the inputs where rounding is decided: the fp8 midpoints, the
carries into the exponent that the interpreter's own fp8 conversion gets wrong, subnormal
steps, NaN and ±inf blocks. The twins themselves are pinned in tests/formats/ops/test_blockwise.py.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from computectx import capability
from computectx.dtypes import Fp8Format
from computectx.formats import Backend
from computectx.formats.numerics import layouts
from computectx.formats.numerics.layouts import Granularity, MxRounding
from computectx.formats.ops import blockwise as block_ops

pytestmark = [
    pytest.mark.interpreter,
    # The interpreter evaluates x / step in numpy, which warns on the inf and NaN that the
    # special-value inputs are meant to produce.
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


def _import_interpreted() -> None:
    # The conftest imports the older kernel modules interpreted; this one the same way,
    # before any test runs.
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = sys.modules.get("computectx.kernels.quantize_blocks")
        if module is None:
            importlib.import_module("computectx.kernels.quantize_blocks")
        elif not module.INTERPRETED:
            importlib.reload(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not capability.fp8_tensor_cores():
    _import_interpreted()

from computectx.kernels import quantize_blocks as kb  # noqa: E402  (imported interpreted above)

TRITON = Backend.TRITON
REF = Backend.REFERENCE
FORMATS = list(Fp8Format)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPTIONS: list[tuple[Granularity, bool | None, MxRounding | None]] = [
    ("row", None, None),  # power-of-two steps
    ("row", False, None),
    ("1x128", None, None),
    ("1x128", True, None),
    ("128x128", None, None),
    ("128x128", True, None),
    ("mx", None, None),  # rceil
    ("mx", None, "floor"),
]
OPTION_IDS = [f"{g}-{p}-{m}" for g, p, m in OPTIONS]
BAD_RULE: Any = "mean"  # typed Any so that the launcher's own check runs


def assert_same(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        assert g.is_contiguous()
        gb, wb = g.cpu().reshape(-1).view(torch.uint8), w.cpu().reshape(-1).view(torch.uint8)
        bad = (gb != wb).nonzero()
        assert bad.numel() == 0, f"{bad.numel()} bytes of {g.dtype} differ, first at {bad[0]}"


Option = tuple[Granularity, bool | None, MxRounding | None]


def both(
    x: torch.Tensor, fmt: Fp8Format, option: Option, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize on the kernels and on the twin; compare the data and the scale, bit for bit;
    return the kernels' ``(data, scale)``."""
    g, pow2, mx = option
    if "scale" not in kw:
        kw = {"power_of_two": pow2, "mx_rounding": mx, **kw}
    got = block_ops.quantize_granular(x, fmt, g, backend=TRITON, **kw)
    cpu: dict[str, Any] = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    want = block_ops.quantize_granular(x.cpu(), fmt, g, backend=REF, **cpu)
    assert_same(got, want)
    return got


def hard(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of magnitudes 1e-30 .. 1e30 (saturating in half dtypes), the last of magnitude
    1 (finite and nonzero in every dtype: a seed may put every other row outside fp16's
    range), a row of float32 subnormals (flushed to zero in half dtypes), a zero row, a
    NaN, ±inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x *= 10.0 ** (torch.rand(rows, 1, generator=gen) * 60 - 30)
    x[-1] = torch.randn(cols, generator=gen)
    x[0] = torch.randn(cols, generator=gen) * 1e-39
    x[1] = 0.0
    x[2, cols // 2] = math.nan
    x[3, cols - 1] = math.inf
    x[4, 0] = -math.inf
    return x.to(dtype)


# Each option at float32 and at one half dtype, bf16 and fp16 in turn (the options come in
# pairs per kernel: each kernel reads both), each with both formats. The input dtype only
# changes how the kernels load x (bf16 as its bits, the others widened); past the load the
# kernels compute in float32, on values that differ only as hard() rounds them to the dtype
# (saturated to inf, flushed to zero: classes the float32 rows hold already), so the third
# dtype of each option adds no path (each case runs interpreted).
BIT_EXACT_CASES = [
    (option, dtype)
    for i, option in enumerate(OPTIONS)
    for dtype in (torch.float32, DTYPES[1 + i % 2])
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("option", "dtype"),
    BIT_EXACT_CASES,
    ids=[f"{OPTION_IDS[OPTIONS.index(o)]}-{str(d)[6:]}" for o, d in BIT_EXACT_CASES],
)
def test_bit_exact(
    option: Option, fmt: Fp8Format, dtype: torch.dtype, device: torch.device
) -> None:
    # 6 x 172: two row tiles (the interpreter's 4 rows, then a ragged 2), ragged blocks along
    # K (172 = 128 + 44 = 5 x 32 + 12), several K chunks per row; a random row beside hard()'s
    # five special ones; 130 x 257 for 128x128 (partial blocks both ways).
    shape = (130, 257) if option[0] == "128x128" else (6, 172)
    both(hard(*shape, seed=len(option[0]), dtype=dtype).to(device), fmt, option)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
def test_columnwise_bit_exact(option: Option, fmt: Fp8Format, device: torch.device) -> None:
    # The kernels read x.t() in place (strides (1, rows)); the twin's data is contiguous.
    shape = (257, 130) if option[0] == "128x128" else (70, 9)
    x = hard(*shape, seed=3).to(device)
    both(x, fmt, option, columnwise=True)
    both(x.t(), fmt, option)  # the same through a transposed view


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
def test_given_scales_bit_exact(option: Option, device: torch.device) -> None:
    # Measured scales reused, then scales the kernels never produce: for float32 steps 0,
    # NaN, inf, a subnormal and a negative one; for E8M0 the bytes 0 (2**-127) and 255 (NaN).
    g = option[0]
    x = hard(*((130, 300) if g == "128x128" else (6, 172)), seed=4).to(device)
    _, scale = block_ops.quantize_granular(x, "e4m3", g, backend=REF if x.is_cpu else TRITON)
    both(x, Fp8Format.E4M3, option, scale=scale)
    odd = scale.clone().reshape(-1)
    if g == "mx":
        codes = torch.tensor([0, 255, 1, 254], dtype=torch.uint8)
        odd.view(torch.uint8)[: codes.numel()] = codes.to(device)
    else:
        specials = torch.tensor([0.0, math.nan, math.inf, 1e-42, -0.5])
        odd[: min(odd.numel(), specials.numel())] = specials[: odd.numel()].to(device)
    both(x, Fp8Format.E4M3, option, scale=odd.reshape(scale.shape))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rounding_boundaries_bit_exact(fmt: Fp8Format, device: torch.device) -> None:
    # Every fp8 grid value, every midpoint, and one float32 ulp either side, under unit
    # steps (given) and under measured power-of-two steps (which divide exactly). 31.19 is
    # the interpreter's own conversion bug (it gives 16.0, not 32.0, in E4M3).
    codes = torch.arange(0, 128, dtype=torch.uint8).view(fmt.torch).to(torch.float32)
    g = codes[torch.isfinite(codes)]
    mid = (g[:-1] + g[1:]) / 2
    up = torch.nextafter(mid, torch.full_like(mid, math.inf))
    down = torch.nextafter(mid, torch.zeros_like(mid))
    probes = torch.cat([g, mid, up, down, torch.tensor([31.19, fmt.max * 1.125])])
    probes = torch.cat([probes, -probes])
    x = torch.cat([probes, torch.zeros((-probes.numel()) % 128)]).reshape(-1, 128).to(device)
    ones = torch.ones(x.shape[0], 1, device=device)
    both(x, fmt, ("1x128", None, None), scale=ones)
    both(x, fmt, ("row", None, None))
    both(x, fmt, ("mx", None, None))
    q, _ = block_ops.quantize_granular(x, fmt, "1x128", ones, backend=TRITON)
    if fmt is Fp8Format.E4M3:
        at = (x == 31.19).nonzero()[0]
        assert q[at[0], at[1]].float().item() == 32.0


@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
def test_random_bit_patterns_bit_exact(option: Option, device: torch.device) -> None:
    # Every float32 class in every block: normals of all exponents, subnormals, ±inf, NaN
    # payloads of both signs (most blocks then hold a NaN: step 1), and a block of
    # normals scaled down so that its steps are subnormal.
    gen = torch.Generator().manual_seed(12)
    bits = torch.randint(-(2**31), 2**31, (12, 200), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x[:4] = torch.randn(4, 200, generator=gen) * 2.0**-130
    if option[0] == "128x128":
        x = x.repeat(11, 2)
    both(x.to(device), Fp8Format.E5M2, option)
    both(x.to(device), Fp8Format.E4M3, option)


@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (1, 1), (3, 2, 40)])
@pytest.mark.parametrize("option", OPTIONS, ids=OPTION_IDS)
def test_edge_shapes(shape: tuple[int, ...], option: Option, device: torch.device) -> None:
    x = torch.randn(shape).to(device)
    try:
        layouts.layout_of(option[0], shape)
    except ValueError as refused:  # a shape the granularity cannot serve: refused alike
        for backend in (TRITON, REF):
            with pytest.raises(ValueError, match=re.escape(str(refused))):
                block_ops.quantize_granular(x, "e4m3", option[0], backend=backend)
        return
    both(x, Fp8Format.E4M3, option)


@settings(max_examples=25)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(32, 300),
    option=st.sampled_from(OPTIONS),
    magnitude=st.integers(-40, 40),
    dtype=st.sampled_from(DTYPES),
)
def test_random_shapes_bit_exact(
    rows: int, cols: int, option: Option, magnitude: int, dtype: torch.dtype, device: torch.device
) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    both((x * 2.0**magnitude).to(dtype).to(device), Fp8Format.E4M3, option)


def test_launcher_rejects_what_it_cannot_serve(device: torch.device) -> None:
    x = torch.ones(4, 64, device=device)
    e4m3 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"must be one of"):
        kb.quantize_blocks(x=x, fp8=e4m3, block_rows=2, block_cols=64, rule="amax")
    with pytest.raises(ValueError, match="'mean'"):
        kb.quantize_blocks(x=x, fp8=e4m3, block_rows=1, block_cols=128, rule=BAD_RULE)
    with pytest.raises(ValueError, match="whole rows"):
        kb.quantize_blocks(x=x, fp8=e4m3, block_rows=1, block_cols=None, rule="mx_rceil")
    with pytest.raises(ValueError, match=r"2-D.*\(4, 4, 4\)"):
        kb.quantize_blocks(
            x=torch.ones(4, 4, 4, device=device), fp8=e4m3, block_rows=1, block_cols=32,
            rule="amax",
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"float8_e4m3fn or float8_e5m2"):
        kb.quantize_blocks(x=x, fp8=torch.int8, block_rows=1, block_cols=32, rule="amax")
    with pytest.raises(ValueError, match=r"shape \(4, 2\)"):
        kb.quantize_blocks(
            x=x, fp8=e4m3, block_rows=1, block_cols=32, rule="amax",
            scale=torch.ones(4, 3, device=device),
        )  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_constants_match_the_format_table(fmt: Fp8Format) -> None:
    # The kernels import only torch and triton, so they derive each format's constants from
    # torch.finfo; these must be the numbers computectx.dtypes publishes.
    from computectx.kernels.quantize_cast import fp8_constants

    c = fp8_constants(fmt.torch)
    assert fmt.max == c.FMAX
    assert math.floor(math.log2(fmt.max)) == c.EMAX
    assert fmt.mantissa_bits == c.MANT
    assert 2 ** (fmt.exponent_bits - 1) - 1 == c.BIAS
    assert fmt.min_subnormal * 2.0**23 == c.SUB_MAGIC


@pytest.mark.parametrize("fmt", FORMATS)
def test_float32_max_bit_exact_and_finite(fmt: Fp8Format, device: torch.device) -> None:
    # Power-of-two steps of an amax near float32's max exceed FLT_MAX / fmt.max: the codes
    # stop at the largest whose product with the step is finite, on the kernels as on the twin.
    x = torch.zeros(4, 64)
    x[0, 3], x[1, 40], x[2, 0], x[3, 63] = 3.4e38, -3.4e38, torch.finfo(torch.float32).max, 3e38
    for option in [("row", None, None), ("1x128", True, None), ("mx", None, None)]:
        q, scale = both(x.to(device), fmt, option)  # type: ignore[arg-type]
        layout = layouts.layout_of(option[0], x.shape)  # type: ignore[arg-type]
        steps = scale.cpu().to(torch.float32).repeat_interleave(layout.block_rows, 0)
        steps = steps.repeat_interleave(layout.block_cols, 1)[: x.shape[0], : x.shape[1]]
        assert torch.isfinite(q.cpu().to(torch.float32) * steps).all(), option
