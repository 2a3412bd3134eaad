"""The block-scaled GEMM (``computectx.formats.numerics.blockwise``): its twin against float64
within
the documented bound for every pair, its exact semantics where they are observable, the
cuBLAS paths on the CPU (and under CUDA's rules), bad input, and the operator under
``torch.compile``.

The bound is the module docstring's (``numerics.blockwise.scaled_mm_error_bound``); the float64
result here is computed independently: each operand dequantized in float64 (its steps
broadcast over their blocks by indexing, not by the module's helpers), one float64 matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo.testing

from computectx.dtypes import Fp8Format
from computectx.formats import quantize_tensor
from computectx.formats.backend import Backend
from computectx.formats.numerics import blockwise, tensorwise
from computectx.formats.numerics.layouts import PAIRS, BlockGranularity
from computectx.formats.ops.blockwise import block_scaled_mm
from computectx.kernels import cublas

REF, CUBLAS = Backend.REFERENCE, Backend.CUBLAS
E4M3, E5M2 = Fp8Format.E4M3, Fp8Format.E5M2
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def quantized(
    shape: tuple[int, int], g: BlockGranularity, fmt: Fp8Format, seed: int, spread: int = 6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes and scale of a random operand at granularity ``g``; also its float32 source.

    Rows and columns get magnitudes up to ``2**±spread`` apart, so a scale applied to the
    wrong block shows. 1x128 and 128x128 steps are not powers of two (the ``amax`` rule).
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (shape[0], 1), generator=gen).float())
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (1, shape[1]), generator=gen).float())
    q, s = quantize_tensor(x, fmt, granularity=g)
    return q, s, x


def steps64(scale: torch.Tensor, g: BlockGranularity, rows: int, k: int) -> torch.Tensor:
    """Each element's step in float64, by index arithmetic (independent of the module)."""
    s = scale.to(torch.float32).to(torch.float64)  # E8M0 widens exactly
    i = torch.arange(rows).reshape(-1, 1)
    j = torch.arange(k).reshape(1, -1)
    if g == "row":
        return s[i, 0].expand(rows, k)
    if g == "mx":
        return s[i, j // 32]
    if g == "1x128":
        return s[i, j // 128]
    return s[i // 128, j // 128]


def exact(
    a: torch.Tensor,
    sa: torch.Tensor,
    ga: BlockGranularity,
    b: torch.Tensor,
    sb: torch.Tensor,
    gb: BlockGranularity,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    k = a.shape[1]
    da = a.to(torch.float64) * steps64(sa, ga, a.shape[0], k)
    db = b.to(torch.float64) * steps64(sb, gb, b.shape[0], k)
    out = da @ db.t()
    return out if bias is None else out + bias.to(torch.float64)


def check_within_bound(
    out: torch.Tensor,
    a: torch.Tensor,
    sa: torch.Tensor,
    ga: BlockGranularity,
    b: torch.Tensor,
    sb: torch.Tensor,
    gb: BlockGranularity,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> None:
    bound = blockwise.scaled_mm_error_bound(
        blockwise.BlockGemmArgs(a, b, sa, ga, sb, gb, bias, out_dtype)
    )
    err = (out.cpu().to(torch.float64) - exact(a, sa, ga, b, sb, gb, bias)).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


# (M, N, K): ragged in K (partial 128 and 32 blocks), rows over one 128-row block, K < 128.
SHAPES = [(37, 29, 300), (130, 5, 64), (3, 131, 161), (1, 1, 32)]


@pytest.mark.parametrize(("ga", "gb"), PAIRS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("with_bias", "out_dtype"), [(False, torch.bfloat16), (True, torch.float32)]
)
def test_twin_is_within_the_bound_of_float64(
    ga: BlockGranularity,
    gb: BlockGranularity,
    shape: tuple[int, int, int],
    with_bias: bool,
    out_dtype: torch.dtype,
) -> None:
    m, n, k = shape
    a, sa, _ = quantized((m, k), ga, E4M3, seed=m + k)
    b, sb, _ = quantized((n, k), gb, E5M2 if ga == "row" else E4M3, seed=n * 7 + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)) if with_bias else None
    out = block_scaled_mm(a, b, sa, ga, sb, gb, bias, out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    check_within_bound(out, a, sa, ga, b, sb, gb, bias, out_dtype)


def test_bound_is_tight_enough_to_catch_a_wrong_block_scale() -> None:
    # The checker can fail: swapping two K blocks' steps of one operand breaks the bound.
    a, sa, _ = quantized((8, 256), "1x128", E4M3, seed=1)
    b, sb, _ = quantized((8, 256), "1x128", E4M3, seed=2)
    wrong = sa.flip(1).contiguous()
    out = block_scaled_mm(a, b, wrong, "1x128", sb, "1x128", None, torch.float32)
    with pytest.raises(AssertionError, match="worst excess"):
        check_within_bound(out, a, sa, "1x128", b, sb, "1x128", None, torch.float32)


def test_row_pair_is_reference_scaled_mm_bit_for_bit() -> None:
    a, sa, _ = quantized((33, 70), "row", E4M3, seed=5)
    b, sb, _ = quantized((17, 70), "row", E4M3, seed=6)
    bias = torch.randn(17, dtype=torch.bfloat16)
    got = block_scaled_mm(a, b, sa, "row", sb, "row", bias, torch.bfloat16)
    want = tensorwise.scaled_mm(tensorwise.GemmArgs(a, b, sa, sb, bias, torch.bfloat16))
    assert torch.equal(got, want)


@pytest.mark.parametrize(("ga", "gb"), [p for p in PAIRS if p[0] != "row"])
def test_exact_partial_sums_round_once(ga: BlockGranularity, gb: BlockGranularity) -> None:
    # Small-integer codes and power-of-two steps: every partial sum and scaled partial is
    # exact in float32, so the result is the float64 value rounded once to bf16.
    gen = torch.Generator().manual_seed(9)
    m, n, k = 131, 9, 200
    a = torch.randint(-8, 9, (m, k), generator=gen).float().to(torch.float8_e4m3fn)
    b = torch.randint(-8, 9, (n, k), generator=gen).float().to(torch.float8_e4m3fn)

    def pow2_scale(g: BlockGranularity, rows: int) -> torch.Tensor:
        from computectx.formats.numerics import layouts

        shape = layouts.layout_of(g, (rows, k)).scale_shape
        e = torch.randint(-3, 4, shape, generator=gen)
        if g == "mx":
            return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
        return torch.exp2(e.float())

    sa, sb = pow2_scale(ga, m), pow2_scale(gb, n)
    bias = torch.randint(-50, 50, (n,), generator=gen).float() / 8
    got = block_scaled_mm(a, b, sa, ga, sb, gb, bias, torch.bfloat16)
    assert torch.equal(got, exact(a, sa, ga, b, sb, gb, bias).to(torch.bfloat16))


def test_blocks_are_added_in_order_into_a_float32_accumulator() -> None:
    # Four 128-wide K blocks. Block 0's scaled partial is 2**25; blocks 1-3 add 1 each.
    # In order in float32, each 2**25 + 1 rounds back to 2**25 (ulp 4), so the result is
    # 2**25; the exact 2**25 + 3 would round to 2**25 + 4.
    k = 512
    a = torch.zeros(1, k)
    b = torch.zeros(1, k)
    a[0, 0], b[0, 0] = 2.0**5, 1.0  # partial 32, scaled by 2**20
    for kb in (1, 2, 3):
        a[0, kb * 128], b[0, kb * 128] = 1.0, 1.0
    fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    sa = torch.tensor([[2.0**20, 1.0, 1.0, 1.0]])
    sb = torch.ones(1, 4)
    got = block_scaled_mm(fa, fb, sa, "1x128", sb, "1x128", None, torch.float32)
    assert got.item() == 2.0**25
    assert torch.tensor(2.0**25 + 3, dtype=torch.float64).to(torch.float32).item() == 2.0**25 + 4


def test_zero_k_blocks_and_empty_outputs() -> None:
    a = torch.zeros(0, 256).to(torch.float8_e4m3fn)
    b = torch.zeros(3, 256).to(torch.float8_e4m3fn)
    out = block_scaled_mm(a, b, torch.ones(0, 2), "1x128", torch.ones(3, 2), "1x128", None,
                          torch.bfloat16)  # fmt: skip
    assert out.shape == (0, 3)


# ----- the bound for a narrower accumulator (the Triton kernel on a GPU) -----------------


def _narrow_gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    ga: BlockGranularity,
    b: torch.Tensor,
    sb: torch.Tensor,
    gb: BlockGranularity,
    step: int,
) -> torch.Tensor:
    # A model of the fp8 tensor cores: each step of `step` products summed one by one with
    # the running sum truncated to 14 significant bits after every addition, then promoted
    # to float32, scaled by its block's steps and added to a float32 accumulator.
    m, k = a.shape
    n = b.shape[0]
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    width = k if ga == "row" else (32 if ga == "mx" else 128)
    step = min(step, width)
    ea = steps64(sa, ga, m, k).to(torch.float32)
    eb = steps64(sb, gb, n, k).to(torch.float32)
    acc = torch.zeros(m, n, dtype=torch.float32)
    for lo in range(0, k, step):
        part = torch.zeros(m, n, dtype=torch.float64)
        for j in range(lo, min(k, lo + step)):
            part = part + a64[:, j : j + 1] * b64[:, j].reshape(1, n)
            mant, exp = torch.frexp(part)
            part = torch.ldexp(torch.trunc(mant * 2.0**14) / 2.0**14, exp)
        if ga == "row":
            acc = acc + part.to(torch.float32)
        else:
            scale = ea[:, lo : lo + 1] * eb[:, lo].reshape(1, n)
            acc = acc + part.to(torch.float32) * scale
    if ga == "row":
        acc = acc * (ea[:, :1] * eb[:, 0].reshape(1, n))
    return acc


@pytest.mark.parametrize(("ga", "gb"), [("row", "row"), ("1x128", "128x128"), ("mx", "mx")])
@pytest.mark.parametrize("step", [128, 64])
def test_the_narrow_accumulation_bound_holds_for_a_14_bit_accumulator(
    ga: BlockGranularity, gb: BlockGranularity, step: int
) -> None:
    # Same signs, so partial sums grow and the truncation bites: the float32 bound must
    # fail for this model (the wider one is needed), the NARROW_ACCUMULATION one hold.
    a, sa, _ = quantized((12, 300), ga, E4M3, seed=3, spread=2)
    b, sb, _ = quantized((10, 300), gb, E4M3, seed=4, spread=2)
    a, b = a.abs(), b.abs()
    out = _narrow_gemm(a, sa, ga, b, sb, gb, step)
    err = (out.to(torch.float64) - exact(a, sa, ga, b, sb, gb, None)).abs()
    args = blockwise.BlockGemmArgs(a, b, sa, ga, sb, gb, None, torch.float32)
    f32 = blockwise.scaled_mm_error_bound(args)
    wide = blockwise.scaled_mm_error_bound(args, accumulation=blockwise.NARROW_ACCUMULATION)
    assert bool((err > f32).any()), "the model is within the float32 bound: not a test"
    assert bool((err <= wide).all()), f"worst excess {(err - wide).max().item()}"


# ----- the cuBLAS paths on the CPU ------------------------------------------------------


def test_the_probe_reports_what_runs_on_the_cpu() -> None:
    found = cublas.cublas_recipes(torch.device("cpu"))
    assert set(found) == set(cublas.RECIPES)
    # torch 2.13's CPU _scaled_mm multiplies with row-wise scales; its v2 refuses the
    # block and MX recipes on the CPU.
    assert found["row"][0], found["row"]
    for name in ("1x128x128x128", "1x128x1x128", "mx"):
        assert not found[name][0] and "cpu" in found[name][1], (name, found[name])


@pytest.mark.parametrize(("m", "n", "k"), [(37, 29, 45), (16, 32, 64), (5, 70, 33)])
@pytest.mark.parametrize(("bias_dtype", "out_dtype"), [(None, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
    (torch.float16, torch.float32)])  # fmt: skip
def test_cublas_rowwise_is_within_the_bound(
    m: int, n: int, k: int, bias_dtype: torch.dtype | None, out_dtype: torch.dtype
) -> None:
    # spread 2: the sums stay inside fp16's range
    a, sa, _ = quantized((m, k), "row", E4M3, seed=m, spread=2)
    b, sb, _ = quantized((n, k), "row", E5M2, seed=n, spread=2)
    gen = torch.Generator().manual_seed(k)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    out = block_scaled_mm(a, b, sa, "row", sb, "row", bias, out_dtype, backend=CUBLAS)
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    check_within_bound(out, a, sa, "row", b, sb, "row", bias, out_dtype)


def test_cublas_block_pairs_fall_back_to_the_twin_on_the_cpu() -> None:
    for ga, gb in PAIRS[1:]:
        a, sa, _ = quantized((20, 100), ga, E4M3, seed=1)
        b, sb, _ = quantized((12, 100), gb, E4M3, seed=2)
        got = block_scaled_mm(a, b, sa, ga, sb, gb, None, torch.bfloat16, backend=CUBLAS)
        want = block_scaled_mm(a, b, sa, ga, sb, gb, None, torch.bfloat16)
        assert torch.equal(got, want), (ga, gb)


Calls = list[tuple[tuple[int, ...], tuple[int, ...]]]


def _strict_rowwise(real: Callable[..., torch.Tensor], calls: Calls) -> Callable[..., Any]:
    # torch._scaled_mm as its CUDA build checks a row-wise call (ScaledBlas.cpp,
    # _scaled_mm_out_cuda and is_rowwise_scaling), then the real CPU kernel.
    def scaled_mm(
        mat1: torch.Tensor,
        mat2: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        bias: torch.Tensor | None = None,
        scale_result: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        use_fast_accum: bool = False,
    ) -> torch.Tensor:
        def refuse(why: str) -> None:
            raise RuntimeError(f"strict _scaled_mm (CUDA rules): {why}")

        if mat1.dtype == mat2.dtype == torch.float8_e5m2:
            refuse("Multiplication of two Float8_e5m2 matrices is not supported")
        if not (mat1.stride(1) == 1 and mat1.stride(0) > 1):
            refuse(f"self must be row_major, got stride {mat1.stride()}")
        if not (mat2.stride(0) == 1 and mat2.stride(1) > 1):
            refuse(f"mat2 must be col_major, got stride {mat2.stride()}")
        if mat1.shape[1] % 16 or mat2.shape[0] % 16 or mat2.shape[1] % 16:
            refuse(f"sizes must be divisible by 16, got {tuple(mat1.shape)} {tuple(mat2.shape)}")
        for name, t in (("mat1", mat1), ("mat2", mat2)):
            if max(t.stride()) % 16 or t.storage_offset() % 16:
                refuse(f"{name} rows must be 16-byte aligned, got stride {t.stride()}")
        m, n = mat1.shape[0], mat2.shape[1]
        for s, shape in ((scale_a, (m, 1)), (scale_b, (1, n))):
            if s.dtype != torch.float32 or tuple(s.shape) != shape or not s.is_contiguous():
                refuse(f"row-wise scales are contiguous float32 {shape}, got {s.dtype} {s.shape}")
        if bias is not None and not (bias.dtype == out_dtype != torch.float32):
            refuse(f"a bias of {bias.dtype} with out_dtype {out_dtype}")
        calls.append((tuple(mat1.shape), tuple(mat2.shape)))
        return real(mat1, mat2, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)

    return scaled_mm


@pytest.fixture
def cuda_rules(monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls: Calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _strict_rowwise(torch._scaled_mm, calls))
    return calls


def test_the_strict_rowwise_stand_in_refuses_what_cuda_refuses(cuda_rules: Calls) -> None:
    a = torch.randn(24, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(24, 1), torch.ones(1, 16)
    bad: list[tuple[str, Callable[[], object]]] = [
        ("divisible by 16", lambda: torch._scaled_mm(a[:, :24], b[:, :24].t(), sa, sb)),
        ("row_major", lambda: torch._scaled_mm(a.t().contiguous().t(), b.t(), sa, sb)),
        ("col_major", lambda: torch._scaled_mm(a, b.t().contiguous(), sa, sb)),
        ("row-wise scales", lambda: torch._scaled_mm(a, b.t(), sa, sb.t())),
        ("Float8_e5m2", lambda: torch._scaled_mm(a.to(E5M2.torch), b.to(E5M2.torch).t(), sa, sb)),
        ("a bias", lambda: torch._scaled_mm(a, b.t(), sa, sb, bias=torch.zeros(16))),
    ]
    for needle, call in bad:
        with pytest.raises(RuntimeError, match=needle):
            call()
    assert cuda_rules == []


@pytest.mark.parametrize(("m", "n", "k", "bias_dtype", "out_dtype"), [
    (37, 29, 45, None, torch.bfloat16), (5, 70, 33, torch.bfloat16, torch.bfloat16),
    (8, 16, 32, torch.float32, torch.bfloat16), (3, 5, 7, torch.bfloat16, torch.float32),
])  # fmt: skip
def test_cublas_rowwise_keeps_cudas_rules(
    cuda_rules: Calls,
    m: int,
    n: int,
    k: int,
    bias_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> None:
    a, sa, _ = quantized((m, k), "row", E4M3, seed=1)
    b, sb, _ = quantized((n, k), "row", E4M3, seed=2)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    # a transposed view (dgrad/wgrad hand these in) is copied row-major
    b_view = b.t().contiguous().t()
    out = block_scaled_mm(a, b_view, sa, "row", sb, "row", bias, out_dtype, backend=CUBLAS)
    # One GEMM (besides a first-use probe of 144 x 144 x 160, under the same rules).
    assert len([c for c in cuda_rules if c != ((144, 160), (160, 144))]) == 1
    check_within_bound(out, a, sa, "row", b, sb, "row", bias, out_dtype)


def test_two_e5m2_operands_take_the_twin_under_cudas_rules(cuda_rules: Calls) -> None:
    a, sa, _ = quantized((8, 32), "row", E5M2, seed=1)
    b, sb, _ = quantized((8, 32), "row", E5M2, seed=2)
    got = block_scaled_mm(a, b, sa, "row", sb, "row", None, torch.float32, backend=CUBLAS)
    assert cuda_rules == []
    assert torch.equal(got, block_scaled_mm(a, b, sa, "row", sb, "row", None, torch.float32))


def test_cublas_scale_layouts() -> None:
    # The layouts torch's CUDA v2 path checks (ScaledBlas.cpp): 1x128 column-major
    # (rows, K/128); 128x128 (K/128 padded to 4, rows/128) with strides (1, padded); MX in
    # 128 x 4 tiles, element (i, j) of a tile at (i % 32) * 16 + (i // 32) * 4 + j.
    s = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    one = cublas.cublas_scales(s, "1x128", 32, 384, operand="a")
    assert one.shape == (32, 3) and one.stride() == (1, 32)
    assert torch.equal(one[:20], s) and bool((one[20:] == 1).all())
    blk = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3)
    two = cublas.cublas_scales(blk, "128x128", 256, 384, operand="b")
    assert two.shape == (4, 2) and two.stride() == (1, 4)
    assert torch.equal(two[:3].t(), blk) and bool((two[3] == 1).all())
    e = torch.randint(0, 255, (130, 5), dtype=torch.uint8)
    sw = cublas.cublas_scales(e.view(torch.float8_e8m0fnu), "mx", 130, 160, operand="a")
    flat = sw.view(torch.uint8)
    assert flat.numel() == 256 * 8  # rows to 256, K blocks to 8
    tiles_per_row = 2
    for i, j in [(0, 0), (1, 0), (31, 3), (32, 0), (33, 2), (127, 3), (128, 4), (129, 1)]:
        tile = (i // 128) * tiles_per_row + j // 4
        r, c = i % 128, j % 4
        assert flat[tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c] == e[i, j], (i, j)
    # padding holds byte 127 (a step of 1): row 130 (absent), and K block 5 (absent)
    assert flat[1 * 512 * tiles_per_row + (2 % 32) * 16] == 127
    assert flat[1 * 512 + 1] == 127


# ----- bad input --------------------------------------------------------------------------


def _args() -> dict[str, Any]:
    a, sa, _ = quantized((4, 64), "1x128", E4M3, seed=1)
    b, sb, _ = quantized((3, 64), "1x128", E4M3, seed=2)
    return {"a": a, "b": b, "scale_a": sa, "granularity_a": "1x128", "scale_b": sb,
            "granularity_b": "1x128", "bias": None, "out_dtype": torch.bfloat16}  # fmt: skip


@pytest.mark.parametrize(("change", "needle"), [
    ({"granularity_b": "row"}, r"does not multiply granularity '1x128' by 'row'.*accepted"),
    ({"granularity_a": "tensor"}, r"unknown GEMM granularity 'tensor'; accepted"),
    ({"granularity_a": "128x128", "granularity_b": "128x128"}, r"'128x128' by '128x128'"),
    ({"scale_a": torch.ones(4, 2)}, r"scale_a .* \(4, 1\).* got torch.float32, shape \(4, 2\)"),
    ({"scale_b": torch.ones(3, 1, dtype=torch.float64)}, r"scale_b .*got torch.float64"),
    ({"b": torch.zeros(3, 65).to(torch.float8_e4m3fn)}, r"same K; got a \(4, 64\), b \(3, 65\)"),
    ({"a": torch.zeros(4, 64)}, r"a must be a 2-D float8_e4m3fn or float8_e5m2 tensor"),
    ({"bias": torch.zeros(4)}, r"bias must be .* shape \(3,\); got .* shape \(4,\)"),
    ({"out_dtype": torch.float8_e4m3fn}, r"out_dtype .* not supported; accepted"),
])  # fmt: skip
def test_bad_input_is_refused_with_the_value_and_what_is_accepted(
    change: dict[str, Any], needle: str
) -> None:
    kwargs = _args() | change
    with pytest.raises(ValueError, match=needle):
        block_scaled_mm(**kwargs)


def test_mx_needs_e8m0_scales_and_k_of_one_block() -> None:
    a = torch.zeros(2, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"float8_e8m0fnu tensor of shape \(2, 2\)"):
        block_scaled_mm(a, a, torch.ones(2, 2), "mx", torch.ones(2, 2), "mx", None, torch.bfloat16)
    small = torch.zeros(2, 16).to(torch.float8_e4m3fn)
    e8 = torch.ones(2, 1).to(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"'mx' needs K .* >= 32"):
        block_scaled_mm(small, small, e8, "mx", e8, "mx", None, torch.bfloat16)


def test_backend_is_a_member_or_its_name() -> None:
    by_name = block_scaled_mm(**_args(), backend="reference")
    assert torch.equal(by_name, block_scaled_mm(**_args(), backend=Backend.REFERENCE))
    with pytest.raises(ValueError, match=r"unknown fp8 backend 'tpu'; accepted: .*'triton'"):
        block_scaled_mm(**_args(), backend="tpu")
    with pytest.raises(TypeError, match="backend must be a Backend"):
        block_scaled_mm(**_args(), backend=3)  # type: ignore[arg-type]


def test_a_triton_backend_that_cannot_run_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU without TRITON_INTERPRET=1 the kernels would compile for a GPU: the error is
    # the capability probe's reason, not a list of names that includes the one given.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for backend in ("triton", Backend.TRITON):
        with pytest.raises(ValueError, match=r"triton fp8 backend cannot run on cpu: .*TRITON_INT"):
            block_scaled_mm(**_args(), backend=backend)


# ----- the operator -----------------------------------------------------------------------


def _op_cases() -> Iterator[tuple[object, ...]]:
    # Every pair once, the two argument forms in turn (row-major B, no bias, bf16 out; a
    # column-major B, a bias, float32 out): one fake serves every pair, and each opcheck
    # (aot_dispatch_dynamic above all) costs a compile, so each pair is not checked twice.
    for i, (ga, gb) in enumerate(PAIRS):
        a, sa, _ = quantized((6, 64), ga, E4M3, seed=1)
        b, sb, _ = quantized((16, 64), gb, E4M3, seed=2)
        if i % 2 == 0:
            yield (a, b, sa, ga, sb, gb, None, torch.bfloat16)
        else:
            yield (a, b.t().contiguous().t(), sa, ga, sb, gb, torch.randn(16), torch.float32)


@pytest.mark.parametrize("backend", ["reference", "cublas"])
def test_opcheck(backend: str) -> None:
    op = torch.ops.computectx.fp8_block_scaled_mm
    for args in _op_cases():
        full = (*args, backend)
        torch.library.opcheck(op, full, test_utils=WITHOUT_SCHEMA)
        tensors = [t for t in full if isinstance(t, torch.Tensor)]
        before = [t.clone() for t in tensors]
        out = op(*full)
        for t, t0 in zip(tensors, before, strict=True):
            v, v0 = (t.view(torch.uint8), t0.view(torch.uint8)) if t.dtype in FP8 else (t, t0)
            assert torch.equal(v, v0)
            assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.parametrize(("ga", "gb"), [("1x128", "128x128"), ("mx", "mx"), ("row", "row")])
def test_compiles_with_no_graph_break_and_equals_eager(
    ga: BlockGranularity, gb: BlockGranularity
) -> None:
    torch._dynamo.reset()
    a, sa, _ = quantized((6, 160), ga, E4M3, seed=1)
    b, sb, _ = quantized((10, 160), gb, E4M3, seed=2)
    bias = torch.randn(10)

    def f(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        return block_scaled_mm(a, b, sa, ga, sb, gb, bias, torch.bfloat16, backend=REF) * 2

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = torch.compile(f, backend=counter, fullgraph=True)(a, b, sa, sb)
    assert counter.frame_count == 1
    assert torch.equal(got, f(a, b, sa, sb))
    torch._dynamo.reset()


@pytest.mark.parametrize(("ga", "gb"), [("1x128", "1x128"), ("mx", "mx")])
def test_an_enclosing_autocast_changes_nothing(ga: BlockGranularity, gb: BlockGranularity) -> None:
    # The partial sums stay float32 under torch.autocast (a bf16 matmul would round them).
    a, sa, _ = quantized((9, 200), ga, E4M3, seed=1)
    b, sb, _ = quantized((7, 200), gb, E4M3, seed=2)
    plain = block_scaled_mm(a, b, sa, ga, sb, gb, None, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = block_scaled_mm(a, b, sa, ga, sb, gb, None, torch.float32)
    assert torch.equal(under, plain)


# ----- the block and MX cuBLAS calls, against a stand-in for CUDA's scaled_mm v2 ----------


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _decode_scale(s: torch.Tensor, kind: str, rows: int, k: int) -> torch.Tensor:
    # Each element's step from a scale laid out as torch's CUDA v2 path checks it
    # (ScaledBlas.cpp: _scaled_block1x128_block1x128 and siblings, _scaled_mxfp8_mxfp8).
    def refuse(why: str) -> None:
        raise RuntimeError(f"strict scaled_mm v2 (CUDA rules): {why}")

    kb = -(-k // 128)
    i = torch.arange(rows).reshape(-1, 1)
    j = torch.arange(k).reshape(1, -1)
    if kind == "BlockWise1x128":
        if s.dtype != torch.float32 or tuple(s.shape) != (rows, kb):
            refuse(f"1x128 scale must be float32 ({rows}, {kb}), got {s.dtype} {tuple(s.shape)}")
        if s.stride(0) != 1 or (kb > 1 and s.stride(1) != rows):
            refuse(f"1x128 scale strides must be (1, {rows}), got {s.stride()}")
        return s.double()[i, j // 128]
    if kind == "BlockWise128x128":
        # torch's meta (_check_scaled_mm_sizes_v2, is_1x128_128x128): shape
        # (round_up(K / 128, 4), rows // 128), strides (1, L4) (or (1, 1) for one column).
        # rows // 128 floors: only whole 128-row blocks have a step.
        kb4, rb = _round_up(k // 128, 4), rows // 128
        if s.dtype != torch.float32 or tuple(s.shape) != (kb4, rb):
            refuse(f"128x128 scale must be float32 ({kb4}, {rb}), got {tuple(s.shape)}")
        if s.stride(0) != 1 or not (s.stride(1) == kb4 or (rb == 1 and s.stride(1) == 1)):
            refuse(f"128x128 scale strides must be (1, {kb4}), got {s.stride()}")
        if rows % 128:
            refuse(f"rows {rows} of a 128x128 operand: rows {rb * 128}.. have no step")
        return s.double()[j // 128, i // 128]
    if kind == "BlockWise1x32":
        c4 = _round_up(-(-k // 32), 4)
        if s.dtype != torch.float8_e8m0fnu or s.numel() != _round_up(rows, 128) * c4:
            refuse(f"MX scale must be e8m0 with {_round_up(rows, 128) * c4} elements")
        flat = s.view(torch.uint8).flatten().long()
        jb = j // 32
        at = ((i // 128) * (c4 // 4) + jb // 4) * 512 + (i % 32) * 16 + (i % 128 // 32) * 4 + jb % 4
        return torch.exp2(flat[at].double() - 127)
    refuse(f"unexpected recipe {kind}")
    raise AssertionError


@pytest.fixture
def cuda_v2(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """``torch.nn.functional.scaled_mm`` as CUDA's v2 path checks its block and MX calls
    (E4M3 operands, K and N multiples of 16, row-major a, column-major b, the scale layouts),
    computing the product in float64 from the scales as laid out; the recipes it saw."""
    f = torch.nn.functional
    seen: list[str] = []

    def scaled_mm(
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        scale_a: torch.Tensor,
        recipe_a: Any,
        scale_b: torch.Tensor,
        recipe_b: Any,
        swizzle_a: Any = None,
        swizzle_b: Any = None,
        bias: torch.Tensor | None = None,
        output_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        (m, k), n = mat_a.shape, mat_b.shape[1]
        if mat_a.dtype != torch.float8_e4m3fn or mat_b.dtype != torch.float8_e4m3fn:
            raise RuntimeError("strict scaled_mm v2 (CUDA rules): E4M3 operands only")
        if k % 16 or n % 16 or mat_a.stride(1) != 1 or mat_b.stride(0) != 1:
            raise RuntimeError("strict scaled_mm v2 (CUDA rules): shapes or layouts")
        mx = recipe_a.name == "BlockWise1x32"
        want = f.SwizzleType.SWIZZLE_32_4_4 if mx else f.SwizzleType.NO_SWIZZLE
        if swizzle_a != want or swizzle_b != want:
            raise RuntimeError("strict scaled_mm v2 (CUDA rules): swizzle")
        if bias is not None and bias.dtype != output_dtype:
            raise RuntimeError("strict scaled_mm v2 (CUDA rules): bias dtype")
        da = mat_a.double() * _decode_scale(scale_a, recipe_a.name, m, k)
        db = mat_b.t().double() * _decode_scale(scale_b, recipe_b.name, n, k)
        out = da @ db.t() + (0 if bias is None else bias.double())
        seen.append(f"{recipe_a.name} x {recipe_b.name} {m}x{k}x{n}")
        return out.to(output_dtype)

    monkeypatch.setattr(f, "scaled_mm", scaled_mm)
    cublas._probe.cache_clear()
    yield seen
    cublas._probe.cache_clear()


@pytest.mark.parametrize(("ga", "gb"), PAIRS[1:])
@pytest.mark.parametrize(("m", "n", "k", "bias_dtype", "out_dtype"), [
    (37, 29, 300, None, torch.bfloat16), (130, 5, 64, torch.bfloat16, torch.bfloat16),
    (3, 131, 161, torch.float32, torch.float32),
])  # fmt: skip
def test_block_and_mx_cublas_calls_keep_cudas_layouts(
    cuda_v2: list[str],
    ga: BlockGranularity,
    gb: BlockGranularity,
    m: int,
    n: int,
    k: int,
    bias_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> None:
    assert all(runs for runs, _ in cublas.cublas_recipes(torch.device("cpu")).values())
    a, sa, _ = quantized((m, k), ga, E4M3, seed=m)
    b, sb, _ = quantized((n, k), gb, E4M3, seed=n)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    out = block_scaled_mm(a, b, sa, ga, sb, gb, bias, out_dtype, backend=CUBLAS)
    # The GEMM ran on the stand-in (not on the twin), K padded to 128, N to 16, and the rows
    # of a 128x128 operand to whole 128-row blocks.
    mp = _round_up(m, 128) if ga == "128x128" else m
    np_ = _round_up(n, 128 if gb == "128x128" else 16)
    assert cuda_v2[-1].endswith(f" {mp}x{_round_up(k, 128)}x{np_}"), cuda_v2
    assert out.shape == (m, n) and out.dtype == out_dtype and out.is_contiguous()
    check_within_bound(out, a, sa, ga, b, sb, gb, bias, out_dtype)


@pytest.mark.parametrize(("ga", "gb"), PAIRS)
@pytest.mark.parametrize(("m", "n", "k"), [(256, 256, 256), (256, 144, 256), (256, 96, 160),
    (144, 96, 160), (40, 96, 64), (20, 32, 32), (3, 131, 161)])  # fmt: skip
def test_every_cublas_call_passes_torchs_own_meta_check(
    ga: BlockGranularity, gb: BlockGranularity, m: int, n: int, k: int
) -> None:
    # torch's meta functions of _scaled_mm and _scaled_mm_v2 state the shapes and scale
    # layouts its CUDA build accepts; the call, run on meta tensors, must pass them as it is
    # (ragged shapes included: a 128x128 operand's rows padded to whole blocks).
    meta = torch.device("meta")
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=meta)
    b = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=meta)

    def scale(g: BlockGranularity, rows: int) -> torch.Tensor:
        from computectx.formats.numerics import layouts

        layout = layouts.layout_of(g, (rows, k))
        return torch.empty(layout.scale_shape, dtype=layout.scale_dtype, device=meta)

    for bias, out_dtype in [(None, torch.bfloat16), (torch.empty(n, device=meta), torch.float32)]:
        out = cublas.scaled_mm(
            a=a, b=b, scale_a=scale(ga, m), granularity_a=ga, scale_b=scale(gb, n),
            granularity_b=gb, bias=bias, out_dtype=out_dtype,
        )  # fmt: skip
        assert out.shape == (m, n) and out.dtype == out_dtype


def test_a_torch_without_the_v2_api_reports_it_and_runs_the_twin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch.nn.functional, "scaled_mm")
    cublas._probe.cache_clear()
    try:
        found = cublas.cublas_recipes(torch.device("cpu"))
        assert found["row"][0]
        assert found["mx"] == (False, f"this torch ({torch.__version__}) has no "
                               "torch.nn.functional.scaled_mm")  # fmt: skip
        a, sa, _ = quantized((4, 64), "mx", E4M3, seed=1)
        got = block_scaled_mm(a, a, sa, "mx", sa, "mx", None, torch.float32, backend=CUBLAS)
        assert torch.equal(got, block_scaled_mm(a, a, sa, "mx", sa, "mx", None, torch.float32))
    finally:
        cublas._probe.cache_clear()
