"""The Triton 4-bit GEMM (``computectx.kernels.fp4_gemm``) against its twin,
``numerics.fp4_gemm.reference_fp4_mm``.

On exact data (codes and scales whose products and every partial sum are exact in float32) the
kernel and the twin round the same exact sum the same way: bit for bit, NVFP4 at every tile
pair and MXFP4, with bias and each output dtype, strided codes, NaN and zero scales. On
quantized random data the kernel sums in its own order: within the twin's bound with its
accumulation term counting every product's addition (``widened_bound``). Runs interpreted on the
CPU, or compiled on a GPU with FP4 tensor cores (sm_100+); on a GPU without them the launcher
refuses (checked here, the numerics skipped: there is nothing to run them on).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest
import torch

from computectx.formats.numerics import fp4_gemm as twin
from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.fp4 import (
    Mxfp4Operand,
    Nvfp4Operand,
    Nvfp4Tile,
    quantize_mxfp4,
    quantize_nvfp4,
)
from computectx.formats.numerics.fp4_gemm import Fp4Operand

from .conftest import ON_GPU

pytestmark = pytest.mark.interpreter

_FP4_KERNELS = (
    "computectx.kernels.fp4_gemm",  # first: the others import its functions
    "computectx.kernels.fp4_quantize",
    "computectx.kernels.fp4_grouped",
)


def fp4_kernel_module(name: str) -> ModuleType:
    """The module ``name``, with the 4-bit kernel modules decorated for the interpreter on the
    CPU (as tests/kernels/conftest.py does for the older ones): each imported, or reloaded in
    order if something imported it compiled before."""
    if ON_GPU:
        return importlib.import_module(name)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for kernels in _FP4_KERNELS:
            module = sys.modules.get(kernels)
            if module is None:
                importlib.import_module(kernels)
            elif not getattr(module, "INTERPRETED", False):
                importlib.reload(module)
        return importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


kf = fp4_kernel_module("computectx.kernels.fp4_gemm")
FP4_GPU = ON_GPU and kf.fp4_tensor_cores(torch.device("cuda")) is None
DEVICE = torch.device("cuda" if FP4_GPU else "cpu")
needs_fp4 = pytest.mark.skipif(
    ON_GPU and not FP4_GPU, reason="the 4-bit GEMM runs on sm_100+ or in the CPU interpreter"
)


def run(
    qa: Fp4Operand, qb: Fp4Operand, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel on two twin operands (the operator's arguments)."""

    def args(q: Fp4Operand) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str]:
        if isinstance(q, Nvfp4Operand):
            return q.codes, q.scale, q.amax.reshape(1), q.tile
        return q.codes, q.scale, None, "1x32"

    (a, sa, ma, ta), (b, sb, mb, tb) = args(qa), args(qb)
    out: torch.Tensor = kf.fp4_scaled_mm(
        a=a, scale_a=sa, amax_a=ma, tile_a=ta, b=b, scale_b=sb, amax_b=mb, tile_b=tb,
        bias=bias, out_dtype=out_dtype,
    )  # fmt: skip
    return out


def to_device(q: Fp4Operand) -> Fp4Operand:
    if isinstance(q, Nvfp4Operand):
        return Nvfp4Operand(q.codes.to(DEVICE), q.scale.to(DEVICE), q.amax.to(DEVICE), q.tile)
    return Mxfp4Operand(q.codes.to(DEVICE), q.scale.to(DEVICE))


# Scale values with two significant bits in [2**-2, 4]: every product of two scaled E2M1
# values is a multiple of 2**-6 below 576, so at K <= 160 every partial sum of them, in any
# order, is exact in float32 (below 2**23 quanta).
_E4M3_EXACT = torch.tensor([0.25, 0.375, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0])
_E8M0_EXACT = torch.arange(125, 130)  # 2**-2 .. 2**2


def exact_operand(
    rows: int, k: int, tile: str, gen: torch.Generator, strided: bool = False
) -> Fp4Operand:
    """Random codes (every byte, negative zeros included) and scales from the exact sets."""
    codes = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
    if strided:
        # The same bytes in column-major storage.
        codes = codes.t().contiguous().t()
    packed = codes.view(torch.float4_e2m1fn_x2)
    if tile == "1x32":
        pick = torch.randint(0, len(_E8M0_EXACT), (rows, k // 32), generator=gen)
        return Mxfp4Operand(packed, _E8M0_EXACT[pick].to(torch.uint8).view(torch.float8_e8m0fnu))
    per_rows = 16 if tile == "16x16" else 1
    pick = torch.randint(0, len(_E4M3_EXACT), (rows // per_rows, k // 16), generator=gen)
    amax = torch.rand((), generator=gen) * 100  # any float32: alpha rounds alike on both
    nv_tile: Nvfp4Tile = "16x16" if tile == "16x16" else "1x16"
    return Nvfp4Operand(packed, _E4M3_EXACT[pick].to(torch.float8_e4m3fn), amax, nv_tile)


def assert_same(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit, NaN where the twin has NaN."""
    o, r = out.cpu().float(), ref.cpu().float()
    assert torch.equal(o.isnan(), r.isnan())
    ok = ~r.isnan()
    assert torch.equal(o[ok].view(torch.int32), r[ok].view(torch.int32)), (
        f"max |kernel - twin| {(o[ok] - r[ok]).abs().max().item()}"
    )


EXACT_CASES = [
    # (M, N, K, tile a, tile b, strided a, bias dtype, out dtype)
    (37, 48, 160, "1x16", "16x16", False, torch.bfloat16, torch.bfloat16),
    (48, 29, 96, "16x16", "1x16", True, None, torch.float32),
    (5, 33, 16, "1x16", "1x16", False, torch.float32, torch.float16),
    (33, 35, 160, "1x32", "1x32", True, torch.bfloat16, torch.float32),
    (1, 70, 64, "1x32", "1x32", False, None, torch.bfloat16),
]


@needs_fp4
@pytest.mark.parametrize(
    ("m", "n", "k", "ta", "tb", "strided", "bias_dtype", "out_dtype"), EXACT_CASES
)
def test_exact_data_is_the_twins_bit_for_bit(
    m: int,
    n: int,
    k: int,
    ta: str,
    tb: str,
    strided: bool,
    bias_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    qa = exact_operand(m, k, ta, gen, strided)
    qb = exact_operand(n, k, tb, gen)
    bias = None if bias_dtype is None else (torch.randn(n, generator=gen) * 8).to(bias_dtype)
    ref = twin.reference_fp4_mm(qa, qb, out_dtype, bias)
    out = run(to_device(qa), to_device(qb), out_dtype, None if bias is None else bias.to(DEVICE))
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert_same(out, ref)


@needs_fp4
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_nan_and_zero_scales_are_the_twins(fmt: str) -> None:
    # A NaN block scale (a block that held a NaN) makes its row's results NaN; an E4M3 zero
    # scale (a block that underflowed) adds nothing; E8M0's smallest byte, 2**-127, squared
    # underflows to zero in both.
    gen = torch.Generator().manual_seed(7)
    tile = "1x16" if fmt == "nvfp4" else "1x32"
    qa, qb = exact_operand(20, 64, tile, gen), exact_operand(18, 64, tile, gen)
    sa, sb = qa.scale.view(torch.uint8).clone(), qb.scale.view(torch.uint8).clone()
    sa[3, 1] = 0x7F if fmt == "nvfp4" else 255
    sa[4, :] = 0
    sb[5, 0] = 0
    if isinstance(qa, Nvfp4Operand) and isinstance(qb, Nvfp4Operand):
        qa = Nvfp4Operand(qa.codes, sa.view(torch.float8_e4m3fn), qa.amax, qa.tile)
        qb = Nvfp4Operand(qb.codes, sb.view(torch.float8_e4m3fn), qb.amax, qb.tile)
    else:
        qa = Mxfp4Operand(qa.codes, sa.view(torch.float8_e8m0fnu))
        qb = Mxfp4Operand(qb.codes, sb.view(torch.float8_e8m0fnu))
    ref = twin.reference_fp4_mm(qa, qb, torch.float32)
    out = run(to_device(qa), to_device(qb), torch.float32)
    assert bool(ref[3].isnan().all()) and not bool(ref[:3].isnan().any())
    assert_same(out, ref)


def widened_bound(
    qa: Fp4Operand, qb: Fp4Operand, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """The twin's bound with its accumulation term for all K products' additions in any
    float32 order (``n = K + 16``, NVFP4; ``K + 4``, MXFP4) instead of the blocks' ``n_kb``:
    every term of the bound scaled by the ratio of the two gammas (at least 1)."""
    k = qa.codes.shape[1] * 2
    nv = isinstance(qa, Nvfp4Operand)
    width = 16 if nv else 32
    extra = 16 if nv else 4
    ratio = tensorwise.accumulation_gamma(k + extra, width) / tensorwise.accumulation_gamma(
        k // width + extra, width
    )
    return twin.fp4_mm_error_bound(qa, qb, out_dtype, bias) * ratio


@needs_fp4
@pytest.mark.parametrize(
    ("fmt", "m", "n", "k", "out_dtype"),
    [
        ("nvfp4", 37, 48, 192, torch.bfloat16),
        ("nvfp4", 16, 29, 64, torch.float32),
        ("mxfp4", 33, 20, 160, torch.float16),
    ],
)
def test_quantized_data_is_within_the_bound(
    fmt: str, m: int, n: int, k: int, out_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(k)
    # Rows and columns up to 2**±6 apart: block scales over many binades.
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen))
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (1, k), generator=gen))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    if fmt == "nvfp4":
        qa: Fp4Operand = quantize_nvfp4(x)
        qb: Fp4Operand = quantize_nvfp4(w, tile="16x16") if n % 16 == 0 else quantize_nvfp4(w)
    else:
        qa, qb = quantize_mxfp4(x), quantize_mxfp4(w)
    out = run(to_device(qa), to_device(qb), out_dtype, bias.to(DEVICE)).cpu().double()
    da, db = twin.dequantize_operand(qa).double(), twin.dequantize_operand(qb).double()
    exact = da @ db.t() + bias.double()
    err = (out - exact).abs()
    bound = widened_bound(qa, qb, out_dtype, bias)
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


@needs_fp4
def test_empty_shapes() -> None:
    gen = torch.Generator().manual_seed(1)
    qa, qb = exact_operand(0, 32, "1x16", gen), exact_operand(16, 32, "1x16", gen)
    assert run(to_device(qa), to_device(qb), torch.bfloat16).shape == (0, 16)
    # K = 0: the epilogue on a zero sum, the bias rounded once.
    qa, qb = exact_operand(3, 0, "1x32", gen), exact_operand(5, 0, "1x32", gen)
    bias = torch.randn(5, generator=gen)
    ref = twin.reference_fp4_mm(qa, qb, torch.bfloat16, bias)
    assert_same(run(to_device(qa), to_device(qb), torch.bfloat16, bias.to(DEVICE)), ref)


def test_the_tensor_scale_constant_is_the_twins() -> None:
    assert kf.ALPHA_FACTOR_INV == twin.ALPHA_FACTOR_INV
    assert kf.AMAX_FLOOR == twin.AMAX_FLOOR


def _args(**change: object) -> dict[str, object]:
    gen = torch.Generator().manual_seed(2)
    qa, qb = exact_operand(16, 32, "1x16", gen), exact_operand(16, 32, "16x16", gen)
    assert isinstance(qa, Nvfp4Operand) and isinstance(qb, Nvfp4Operand)
    args: dict[str, object] = dict(
        a=qa.codes, scale_a=qa.scale, amax_a=qa.amax.reshape(1), tile_a="1x16",
        b=qb.codes, scale_b=qb.scale, amax_b=qb.amax.reshape(1), tile_b="16x16",
        bias=None, out_dtype=torch.bfloat16,
    )  # fmt: skip
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tile_a": "1x64"}, "tile_a must be one of"),
        ({"tile_b": "1x32"}, "two NVFP4"),
        ({"a": torch.zeros(16, 16, dtype=torch.uint8)}, "float4_e2m1fn_x2"),
        ({"b": torch.zeros(16, 8, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}, "same K"),
        ({"scale_a": torch.zeros(16, 2, dtype=torch.float8_e5m2)}, r"float8_e4m3fn \(16, 2\)"),
        ({"scale_b": torch.zeros(16, 2, dtype=torch.float8_e4m3fn)}, r"\(1, 2\)"),
        ({"amax_b": None}, "amax_b of an NVFP4 operand"),
        ({"amax_a": torch.ones(1, dtype=torch.float64)}, "amax_a"),
        ({"bias": torch.zeros(3)}, "bias must have shape"),
        ({"out_dtype": torch.float8_e4m3fn}, "out_dtype"),
    ],
)
def test_bad_arguments_are_refused_by_name(change: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kf.fp4_scaled_mm(**_args(**change))


def test_an_mxfp4_operand_takes_no_amax() -> None:
    gen = torch.Generator().manual_seed(3)
    qa = exact_operand(4, 32, "1x32", gen)
    args = _args(a=qa.codes, scale_a=qa.scale, tile_a="1x32", b=qa.codes, scale_b=qa.scale)
    args.update(tile_b="1x32", amax_b=None)
    with pytest.raises(ValueError, match="amax_a must be None"):
        kf.fp4_scaled_mm(**args)
    with pytest.raises(ValueError, match=r"rows of 16"):
        kf.fp4_scaled_mm(**_args(tile_a="16x16", a=qa.codes, scale_a=qa.scale))


def test_a_device_without_fp4_tensor_cores_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # An H100 (sm_90): Triton would compile dot_scaled to a bf16 emulation; the launcher
    # names the device and refuses, never another precision. (The capability is read from
    # torch.cuda, faked here.)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=None: "NVIDIA H100")
    reason = kf.fp4_tensor_cores(torch.device("cuda", 0))
    assert reason is not None and "9.0 < 10.0" in reason and "H100" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _=None: (10, 0))
    assert kf.fp4_tensor_cores(torch.device("cuda", 0)) is None
    # A compiled launch checks the device before anything else runs.
    monkeypatch.setattr(kf, "INTERPRETED", False)
    with pytest.raises(ValueError, match="cpu is not a CUDA device"):
        kf.fp4_scaled_mm(**_args())
