"""The Triton block-scaled GEMM against float64 and its twin, within the twin's bound.

The bound is ``numerics.blockwise.scaled_mm_error_bound`` (derived in
the module docstring of ``computectx.formats.numerics.blockwise``): it allows any float32 order
inside a scale block and
across the scaled partial sums, which is what the kernel's narrower K steps change. On a GPU (CUDA)
it is the bound for the tensor cores' narrower accumulation of each K step
(``numerics.blockwise.NARROW_ACCUMULATION``); under the interpreter, the float32 one. When
every partial sum is exact (small-integer codes, power-of-two steps) the kernel and the twin round
the same exact value once and must agree bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from computectx.formats import quantize_tensor
from computectx.formats.backend import Backend
from computectx.formats.numerics import blockwise, layouts
from computectx.formats.numerics.layouts import PAIRS, BlockGranularity
from computectx.formats.ops.blockwise import block_scaled_mm

pytestmark = pytest.mark.interpreter

TRITON, REF = Backend.TRITON, Backend.REFERENCE
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def operand(
    shape: tuple[int, int],
    g: BlockGranularity,
    fp8: torch.dtype,
    seed: int,
    transposed: bool,
    spread: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Rows and columns up to 2**±spread apart: a scale on the wrong block shows.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (shape[0], 1), generator=gen).float())
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (1, shape[1]), generator=gen).float())
    q, s = quantize_tensor(x, "e4m3" if fp8 == E4M3 else "e5m2", granularity=g)
    # Same values in column-major storage: the strides a .t() view hands to dgrad/wgrad.
    return (q.t().contiguous().t() if transposed else q), s


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

    def deq(t: torch.Tensor, s: torch.Tensor, g: BlockGranularity) -> torch.Tensor:
        s64 = s.cpu().to(torch.float32).to(torch.float64)
        i = torch.arange(t.shape[0]).reshape(-1, 1)
        j = torch.arange(k).reshape(1, -1)
        steps = {
            "row": lambda: s64[i, 0].expand(t.shape[0], k),
            "1x128": lambda: s64[i, j // 128],
            "128x128": lambda: s64[i // 128, j // 128],
            "mx": lambda: s64[i, j // 32],
        }[g]()
        return t.cpu().to(torch.float64) * steps

    out = deq(a, sa, ga) @ deq(b, sb, gb).t()
    return out if bias is None else out + bias.cpu().to(torch.float64)


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
    # On a GPU the tensor cores sum each BLOCK_K step in a narrower accumulator: the bound
    # for that accumulation (block_gemm's docstring); the interpreter's dot is float32.
    narrow = blockwise.NARROW_ACCUMULATION if out.device.type == "cuda" else None
    bound = blockwise.scaled_mm_error_bound(
        blockwise.BlockGemmArgs(a, b, sa, ga, sb, gb, bias, out_dtype), accumulation=narrow
    )
    err = (out.cpu().to(torch.float64) - exact(a, sa, ga, b, sb, gb, bias)).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


CASES = [
    # (M, N, K, a transposed, b transposed, bias dtype, out dtype)
    (37, 29, 300, False, False, torch.bfloat16, torch.bfloat16),
    (130, 5, 64, False, True, None, torch.float32),  # two 128-row blocks of a; K < 128
    (3, 70, 161, True, True, torch.float32, torch.float16),  # dgrad/wgrad strides
    (1, 1, 32, False, False, None, torch.bfloat16),
]


@pytest.mark.parametrize(("ga", "gb"), PAIRS)
@pytest.mark.parametrize(("m", "n", "k", "ta", "tb", "bias_dtype", "out_dtype"), CASES)
def test_every_pair_is_within_the_twins_bound(
    ga: BlockGranularity,
    gb: BlockGranularity,
    m: int,
    n: int,
    k: int,
    ta: bool,
    tb: bool,
    bias_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
    device: torch.device,
) -> None:
    fb = E5M2 if ga in ("row", "mx") else E4M3
    spread = 1 if out_dtype == torch.float16 else 4  # sums inside fp16's range
    a, sa = operand((m, k), ga, E4M3, m + k, ta, spread)
    b, sb = operand((n, k), gb, fb, n + 3 * k, tb, spread)
    gen = torch.Generator().manual_seed(k)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype)
    a, b, sa, sb = a.to(device), b.to(device), sa.to(device), sb.to(device)
    bias = None if bias is None else bias.to(device)
    out = block_scaled_mm(a, b, sa, ga, sb, gb, bias, out_dtype, backend=TRITON)
    assert out.shape == (m, n) and out.dtype == out_dtype
    check_within_bound(out, a, sa, ga, b, sb, gb, bias, out_dtype)


@pytest.mark.parametrize(("ga", "gb"), PAIRS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_exact_sums_give_the_twins_bits(
    ga: BlockGranularity, gb: BlockGranularity, out_dtype: torch.dtype, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(4)
    m, n, k = 133, 19, 200

    def codes(rows: int) -> torch.Tensor:
        return torch.randint(-8, 9, (rows, k), generator=gen).float().to(E4M3)

    def pow2(g: BlockGranularity, rows: int) -> torch.Tensor:
        shape = layouts.layout_of(g, (rows, k)).scale_shape
        e = torch.randint(-4, 5, shape, generator=gen)
        if g == "mx":
            return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
        return torch.exp2(e.float()) * (3 if g == "row" else 1)  # 3 x 2**e: still exact

    a, b = codes(m).to(device), codes(n).to(device)
    sa, sb = pow2(ga, m).to(device), pow2(gb, n).to(device)
    bias = (torch.randint(-50, 50, (n,), generator=gen).float() / 8).to(device)
    got = block_scaled_mm(a, b, sa, ga, sb, gb, bias, out_dtype, backend=TRITON)
    twin = block_scaled_mm(a, b, sa, ga, sb, gb, bias, out_dtype, backend=REF)
    assert torch.equal(got.cpu(), twin.cpu())


# 32 * 2**127 overflows float32 on purpose (asserted below); the interpreter's numpy says so.
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_e8m0_extremes_read_as_the_twin_reads_them(device: torch.device) -> None:
    # Byte 0 is 2**-127 (a float32 subnormal), 254 is 2**127, 255 is NaN.
    k = 64
    a = torch.ones(4, k)
    a[1, 32:] = 0  # row 1: only its first MX block counts
    b = torch.ones(2, k)
    sa = torch.full((4, 2), 127, dtype=torch.uint8)
    sa[1, 0], sa[2, 1], sa[3, 0] = 0, 255, 254
    sb = torch.full((2, 2), 127, dtype=torch.uint8)
    sb[1, 0] = 1  # 2**-126
    sa8, sb8 = sa.view(torch.float8_e8m0fnu), sb.view(torch.float8_e8m0fnu)
    args = (a.to(E4M3).to(device), b.to(E4M3).to(device), sa8.to(device), "mx",
            sb8.to(device), "mx", None)  # fmt: skip
    got = block_scaled_mm(*args, torch.float32, backend=TRITON).cpu()  # type: ignore[arg-type]
    twin = block_scaled_mm(*args, torch.float32, backend=REF).cpu()  # type: ignore[arg-type]
    assert torch.equal(got.isnan(), twin.isnan()) and bool(got[2].isnan().all())
    assert torch.equal(got.nan_to_num(), twin.nan_to_num())
    assert got[1, 0].item() == 32 * 2.0**-127  # the subnormal step, exactly
    assert got[1, 1].item() == 0.0  # 2**-127 * 2**-126 underflows in float32
    assert got[3, 1].item() == 32 * 2.0 + 32  # 2**127 * 2**-126 = 2
    assert got[3, 0].item() == float("inf")  # 32 * 2**127 overflows float32


def _every_pair(test: Any) -> Any:
    # Each pair once at the edges the kernel has: two row and two column tiles (32 x 32),
    # both ragged, a K tail past the last whole BLOCK_K (300 = 2 * 128 + 44), with and
    # without bias, b row- and column-major (odd seeds); then one tile of one element.
    for i, pair in enumerate(PAIRS):
        test = example(m=40, n=33, k=300, pair=pair, with_bias=i % 2 == 0, seed=i)(test)
    return example(m=1, n=1, k=32, pair=PAIRS[-1], with_bias=True, seed=1)(test)


# A quarter of the profile's examples (25 in CI, 500 under HYPOTHESIS_PROFILE=thorough): each
# runs interpreted, and _every_pair holds the edges whatever the draw.
@settings(max_examples=max(1, settings().max_examples // 4))
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    k=st.integers(32, 300),
    pair=st.sampled_from(PAIRS),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**20),
)
@_every_pair
def test_random_shapes_within_bound(
    m: int,
    n: int,
    k: int,
    pair: tuple[BlockGranularity, BlockGranularity],
    with_bias: bool,
    seed: int,
    device: torch.device,
) -> None:
    ga, gb = pair
    a, sa = operand((m, k), ga, E4M3, seed, False)
    b, sb = operand((n, k), gb, E4M3, seed + 1, seed % 2 == 1)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed)) if with_bias else None
    a, b, sa, sb = a.to(device), b.to(device), sa.to(device), sb.to(device)
    bias = None if bias is None else bias.to(device)
    out = block_scaled_mm(a, b, sa, ga, sb, gb, bias, torch.bfloat16, backend=TRITON)
    check_within_bound(out, a, sa, ga, b, sb, gb, bias, torch.bfloat16)


def test_launcher_rejects_bad_blocks_and_scales(device: torch.device) -> None:
    from computectx.kernels import scaled_mm_blocks as kb

    a = torch.zeros(2, 64, device=device).to(E4M3)
    ones = torch.ones(2, 1, device=device)

    def call(b: torch.Tensor, block_k: int) -> None:
        kb.scaled_mm_blocks(
            a=a,
            b=b,
            scale_a=ones,
            block_rows_a=1,
            scale_b=ones,
            block_rows_b=1,
            block_k=block_k,
            bias=None,
            out_dtype=torch.float32,
        )

    with pytest.raises(ValueError, match="disagree on K"):
        call(a[:, :32], 0)
    with pytest.raises(ValueError, match="block_k=64"):
        call(a, 64)
    with pytest.raises(ValueError, match=r"scale_a must be a torch.float8_e8m0fnu .* \(2, 2\)"):
        call(a, 32)


def test_opcheck_on_the_triton_backend(device: torch.device) -> None:
    op = torch.ops.computectx.fp8_block_scaled_mm
    without_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    pairs: list[tuple[BlockGranularity, BlockGranularity]] = [("1x128", "128x128"), ("mx", "mx")]
    for ga, gb in pairs:
        a, sa = operand((6, 64), ga, E4M3, 1, False)
        b, sb = operand((16, 64), gb, E4M3, 2, False)
        args = (a.to(device), b.to(device), sa.to(device), ga, sb.to(device), gb, None,
                torch.bfloat16, "triton")  # fmt: skip
        torch.library.opcheck(op, args, test_utils=without_schema)
