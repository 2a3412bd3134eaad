"""The Triton scaled GEMM against float64 and its twin, within a derived error bound.

The bound (``numerics.tensorwise.scaled_mm_error_bound``, derived in its docstring): fp8 products
are exact in float32, so the only errors are float32 summation of K terms in some order,
``gamma_K * sum|a||b|`` with ``gamma_K = K u / (1 - K u)``, ``u = 2**-24``, three more
float32 roundings in the epilogue (``step_a * step_b``, the scaling, the bias add), and the
final rounding to the output dtype, half an ulp (``2**-8`` relative for bf16, ``2**-11`` for
fp16, ``2**-24`` for fp32). That is the bound under the interpreter, whose dot is float32;
on CUDA the tensor cores sum each ``BLOCK_K`` tile in a narrower accumulator before
promoting it, and the tests use the wider bound for that accumulation
(``accumulation=numerics.blockwise.NARROW_ACCUMULATION``). When every partial sum is exact
(small integers, power-of-two steps; exact in the narrow accumulator too) the bound leaves only the
output rounding, and the kernel must match exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from computectx.dtypes import Fp8Format
from computectx.formats import Backend
from computectx.formats.numerics import blockwise, tensorwise
from computectx.formats.ops import tensorwise as tensor_ops

pytestmark = pytest.mark.interpreter

TRITON = Backend.TRITON
REF = Backend.REFERENCE
E4M3, E5M2 = Fp8Format.E4M3, Fp8Format.E5M2


def fp8(
    shape: tuple[int, int], fmt: Fp8Format, gen: torch.Generator, transposed: bool
) -> torch.Tensor:
    x = (torch.randn(shape, generator=gen) * 3).clamp(-fmt.max, fmt.max).to(fmt.torch)
    # Same values in column-major storage: the strides a .t() view hands to dgrad/wgrad.
    return x.t().contiguous().t() if transposed else x


def exact(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    out = (a.double() @ b.double().t()) * (sa.double() * sb.double())
    return out if bias is None else out + bias.double()


def check_within_bound(
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor,
    sb: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> None:
    # On a GPU the tensor cores sum each BLOCK_K tile in a narrower accumulator: the bound
    # for that accumulation (numerics.tensorwise.scaled_mm_error_bound's docstring); the
    # interpreter's dot, and the twin, are float32.
    narrow = blockwise.NARROW_ACCUMULATION if out.device.type == "cuda" else None
    a, b, sa, sb, out = a.cpu(), b.cpu(), sa.cpu(), sb.cpu(), out.cpu()
    bias = None if bias is None else bias.cpu()
    bound = tensorwise.scaled_mm_error_bound(
        tensorwise.GemmArgs(a, b, sa, sb, bias, out_dtype), accumulation=narrow
    )
    err = (out.double() - exact(a, b, sa, sb, bias)).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


CASES = [
    # (M, N, K, fa, fb, a transposed, b transposed, bias dtype, out dtype)
    (1, 1, 1, E4M3, E4M3, False, False, None, torch.bfloat16),
    (37, 29, 45, E4M3, E4M3, False, False, torch.bfloat16, torch.bfloat16),
    (37, 29, 45, E5M2, E4M3, False, True, None, torch.bfloat16),  # dgrad: g x w.t()
    (29, 37, 45, E5M2, E4M3, True, True, None, torch.float32),  # wgrad: g.t() x x.t()
    (5, 70, 33, E4M3, E5M2, True, False, torch.float32, torch.float16),
    (33, 17, 100, E4M3, E4M3, False, False, torch.float16, torch.float32),
    (64, 32, 16, E5M2, E5M2, True, True, torch.bfloat16, torch.bfloat16),
    (3, 5, 7, E4M3, E4M3, False, False, None, torch.float16),
    (2, 3, 0, E4M3, E4M3, False, False, torch.float32, torch.float32),  # empty sum: bias
    (0, 3, 5, E4M3, E4M3, False, False, None, torch.bfloat16),
    (3, 0, 5, E4M3, E5M2, False, True, None, torch.float32),
]


@pytest.mark.parametrize(("m", "n", "k", "fa", "fb", "ta", "tb", "bias_dtype", "out_dtype"), CASES)
def test_odd_shapes_within_bound(
    m: int,
    n: int,
    k: int,
    fa: Fp8Format,
    fb: Fp8Format,
    ta: bool,
    tb: bool,
    bias_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
    device: torch.device,
) -> None:
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    a = fp8((m, k), fa, gen, ta).to(device)
    b = fp8((n, k), fb, gen, tb).to(device)
    sa = torch.tensor([0.37], device=device)
    sb = torch.tensor([2.3e-3], device=device)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype).to(device)
    out = tensor_ops.scaled_mm(a, b, sa, sb, bias, out_dtype, backend=TRITON)
    assert out.shape == (m, n)
    assert out.dtype == out_dtype
    check_within_bound(out, a, b, sa, sb, bias, out_dtype)
    twin = tensor_ops.scaled_mm(a, b, sa, sb, bias, out_dtype, backend=REF)
    check_within_bound(twin, a, b, sa, sb, bias, out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_exact_sums_give_identical_outputs(
    out_dtype: torch.dtype, transposed: bool, device: torch.device
) -> None:
    # Small-integer fp8 values and power-of-two steps: every partial sum is exact in
    # float32, so kernel and twin round the same exact value once and must agree bit for
    # bit, including round-to-nearest-even into bf16/fp16 in the epilogue.
    gen = torch.Generator().manual_seed(4)
    m, n, k = 19, 23, 50
    a = torch.randint(-8, 9, (m, k), generator=gen).float().to(E4M3.torch)
    b = torch.randint(-8, 9, (n, k), generator=gen).float().to(E4M3.torch)
    if transposed:
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
    a, b = a.to(device), b.to(device)
    sa = torch.tensor([2.0**-3], device=device)
    sb = torch.tensor([2.0**-7 * 3], device=device)  # 3/128: exact products, rounding in out
    bias = (torch.randint(-50, 50, (n,), generator=gen).float() / 8).to(device)
    out = tensor_ops.scaled_mm(a, b, sa, sb, bias, out_dtype, backend=TRITON)
    twin = tensor_ops.scaled_mm(a, b, sa, sb, bias, out_dtype, backend=REF)
    assert torch.equal(out.cpu(), twin.cpu())


def _edges(test: Any) -> Any:
    # Whatever the draw: two ragged row and column tiles (32 x 32) with a K tail past two
    # whole BLOCK_K steps (80 = 2 * 32 + 16), for each pair of formats and each operand
    # layout, both output dtypes, with and without bias; then one tile of one element.
    for i, (fa, fb) in enumerate([(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2), (E5M2, E4M3)]):
        test = example(
            m=40, n=33, k=80, fa=fa, fb=fb, ta=i in (1, 2), tb=i in (1, 3), log_sa=-12 + 6 * i,
            log_sb=6 - 6 * i, with_bias=i % 2 == 0,
            out_dtype=(torch.bfloat16, torch.float32)[i % 2], seed=i,
        )(test)  # fmt: skip
    return example(
        m=1, n=1, k=1, fa=E5M2, fb=E4M3, ta=False, tb=True, log_sa=0, log_sb=0, with_bias=True,
        out_dtype=torch.bfloat16, seed=4,
    )(test)  # fmt: skip


# A quarter of the profile's examples (25 in CI, 500 under HYPOTHESIS_PROFILE=thorough): each
# runs interpreted, and _edges holds the tile and K edges whatever the draw.
@settings(max_examples=max(1, settings().max_examples // 4))
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    k=st.integers(1, 80),
    fa=st.sampled_from([E4M3, E5M2]),
    fb=st.sampled_from([E4M3, E5M2]),
    ta=st.booleans(),
    tb=st.booleans(),
    log_sa=st.integers(-12, 6),
    log_sb=st.integers(-12, 6),
    with_bias=st.booleans(),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**20),
)
@_edges
def test_random_shapes_within_bound(
    m: int,
    n: int,
    k: int,
    fa: Fp8Format,
    fb: Fp8Format,
    ta: bool,
    tb: bool,
    log_sa: int,
    log_sb: int,
    with_bias: bool,
    out_dtype: torch.dtype,
    seed: int,
    device: torch.device,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    a = fp8((m, k), fa, gen, ta).to(device)
    b = fp8((n, k), fb, gen, tb).to(device)
    # Steps that are not powers of two, over a wide range of magnitudes.
    sa = torch.tensor([1.3 * 2.0**log_sa], device=device)
    sb = torch.tensor([0.7 * 2.0**log_sb], device=device)
    bias = torch.randn(n, generator=gen).to(device) if with_bias else None
    out = tensor_ops.scaled_mm(a, b, sa, sb, bias, out_dtype, backend=TRITON)
    check_within_bound(out, a, b, sa, sb, bias, out_dtype)


@pytest.mark.xfail(
    not torch.cuda.is_available(),
    strict=True,
    reason="known: the interpreted kernel exceeds the bound by 2.6e-5 on this E4M3 x E5M2 input "
    "(found by hypothesis on 2026-12-02; the same at 0.1.0, 1f53250); not yet explained",
)
def test_known_excess_e4m3_by_e5m2_k8(device: torch.device) -> None:
    # The example hypothesis found: kernel error 5.7e-5 against a bound of 3.1e-5 at the
    # worst element; the twin is exact here. Strict: when a fix lands this passes and fails
    # the suite, so the mark comes off.
    gen = torch.Generator().manual_seed(1048575)
    a = fp8((1, 8), E4M3, gen, False).to(device)
    b = fp8((16, 8), E5M2, gen, False).to(device)
    sa = torch.tensor([1.3], device=device)
    sb = torch.tensor([0.7], device=device)
    out = tensor_ops.scaled_mm(a, b, sa, sb, None, torch.float32, backend=TRITON)
    check_within_bound(out, a, b, sa, sb, None, torch.float32)


def test_launcher_rejects_mismatched_k(device: torch.device) -> None:
    from computectx.kernels import scaled_mm as kg

    a = torch.zeros(2, 3, device=device).to(E4M3.torch)
    b = torch.zeros(2, 4, device=device).to(E4M3.torch)
    one = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="disagree on K"):
        kg.scaled_mm(a=a, b=b, step_a=one, step_b=one, bias=None, out_dtype=torch.bfloat16)
