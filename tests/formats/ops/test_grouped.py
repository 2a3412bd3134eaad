"""``quantized_grouped_mm``: each group is the dense fp8 linear on its own rows, bit for bit.

The contract (computectx/formats/ops/grouped.py): on the reference backend, group ``g``'s rows
of the output, of dX and the expert's dW are exactly what a ``QuantizedLinear`` holding ``w[g]``
computes from those rows under the same (dynamic) policy. Groups may be empty or ragged (not
multiples of 16, 32 or 128); rows past the last group are zero, with zero gradients; an
empty group's expert gets a zero gradient. Bad ``offs`` raise naming what is wrong.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from computectx import ComputeCtx, DType
from computectx.formats import (
    Backend,
    QuantizedExperts,
    QuantizedLinear,
    Recipe,
    convert_to_quantized,
    quantized_grouped_mm,
)
from computectx.formats.ops.grouped import checked_bounds

POLICIES = {
    "tensor": "e4m3/tensor/dynamic/0",
    "row": "e4m3/row/dynamic/0",
    "row+gw_hp": "e4m3/row+gw_hp/dynamic/0",
    "block": "e4m3/block/dynamic/0",
    "mx": "e4m3/mx/dynamic/0",
    "hybrid-tensor": "hybrid/tensor/dynamic/0",
}
SIZES = [0, 37, 5, 0, 150, 20]  # empty, ragged, more than one 128-row block
K, N = 160, 96


def operands(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    m = sum(SIZES) + 3  # 3 rows past the last group
    x = torch.randn(m, K, generator=gen).to(dtype)
    w = (torch.randn(len(SIZES), N, K, generator=gen) * 0.05).to(dtype)
    return x, w


def offsets() -> torch.Tensor:
    return torch.tensor(SIZES, dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_group_is_the_dense_fp8_linear_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    policy = Recipe.parse(POLICIES[name])
    x, w = operands(dtype)
    offs = offsets()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_grouped_mm(xg, wg, offs, policy, backend="reference")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y.backward(dy)  # type: ignore[no-untyped-call]
    assert y.dtype == dtype and xg.grad is not None and wg.grad is not None
    compute = DType.BF16 if dtype == torch.bfloat16 else DType.F32
    ctx = ComputeCtx.new(compute, "cpu").replace(recipe=policy)
    start = 0
    for g, size in enumerate(SIZES):
        rows = slice(start, start + size)
        start += size
        if size == 0:
            assert torch.equal(wg.grad[g], torch.zeros_like(wg.grad[g]))
            continue
        dense = nn.Linear(K, N, bias=False, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(w[g])
        layer = QuantizedLinear.from_linear(dense, ctx, backend="reference")
        xd = x[rows].clone().requires_grad_()
        yd = layer(xd)
        yd.backward(dy[rows])
        assert xd.grad is not None and layer.weight.grad is not None
        assert torch.equal(y[rows], yd), (name, g)
        assert torch.equal(xg.grad[rows], xd.grad), (name, g)
        assert torch.equal(wg.grad[g], layer.weight.grad), (name, g)
    tail = slice(start, None)
    assert torch.equal(y[tail], torch.zeros_like(y[tail]))
    assert torch.equal(xg.grad[tail], torch.zeros_like(xg.grad[tail]))


def test_close_to_the_exact_grouped_product() -> None:
    x, w = operands(torch.float32, seed=3)
    offs = offsets()
    y = quantized_grouped_mm(x, w, offs, Recipe.parse(POLICIES["block"]), backend="reference")
    exact = torch.zeros_like(y)
    start = 0
    for g, size in enumerate(SIZES):
        exact[start : start + size] = x[start : start + size] @ w[g].t()
        start += size
    err = (y - exact).norm() / exact.norm()
    assert 0 < err < 0.06  # e4m3 on both operands: ~2**-4 relative per element at worst


POLICY = Recipe.parse(POLICIES["row"])


@pytest.mark.parametrize(
    ("offs", "error", "match"),
    [
        (torch.tensor([2, 4, 6], dtype=torch.int64), TypeError, "int32"),
        (torch.tensor([[2, 4, 6]], dtype=torch.int32), ValueError, "1-D"),
        (torch.tensor([2, 4], dtype=torch.int32), ValueError, "E = 3"),
        (torch.tensor([4, 2, 6], dtype=torch.int32), ValueError, r"offs\[1\] = 2 is below"),
        (torch.tensor([-1, 2, 6], dtype=torch.int32), ValueError, r"offs\[0\] = -1 is negative"),
        (torch.tensor([2, 4, 9], dtype=torch.int32), ValueError, r"offs\[2\] = 9 is past the 8"),
        ([2, 4, 6], TypeError, "int32 tensor"),
    ],
)
def test_bad_offs_raise_naming_the_problem(offs: object, error: type, match: str) -> None:
    x, w = torch.randn(8, 32), torch.randn(3, 16, 32)
    with pytest.raises(error, match=match):
        quantized_grouped_mm(x, w, offs, POLICY, backend="reference")  # type: ignore[arg-type]


def test_a_long_offs_is_capped_in_the_message() -> None:
    # offs is metadata and may be named, but capped: its first 8 ends and how many it holds.
    offs = torch.arange(1, 13, dtype=torch.int32)  # 12 ends, the last two past M = 10
    shown = r"\(offs = \[1, 2, 3, 4, 5, 6, 7, 8, \.\.\. \(12 values\)\]\)$"
    with pytest.raises(ValueError, match=r"offs\[10\] = 11 is past the 10 rows .*" + shown):
        checked_bounds(offs, 10)


@pytest.mark.parametrize(
    ("x", "w", "match"),
    [
        (torch.randn(8, 32), torch.randn(16, 32), "3-D"),
        (torch.randn(8, 32), torch.randn(3, 16, 48), "w\\[g\\] is \\[N, K\\]"),
        (torch.randn(8, 32).to(torch.int8), torch.randn(3, 16, 32), "bfloat16, float16"),
    ],
)
def test_bad_operands_raise(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    offs = torch.tensor([2, 4, 8], dtype=torch.int32)
    with pytest.raises((TypeError, ValueError), match=match):
        quantized_grouped_mm(x, w, offs, POLICY, backend="reference")


def test_a_ctx_is_not_a_policy() -> None:
    x, w = torch.randn(8, 32), torch.randn(3, 16, 32)
    offs = torch.tensor([2, 4, 8], dtype=torch.int32)
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    with pytest.raises(TypeError, match="Recipe"):
        quantized_grouped_mm(x, w, offs, ctx, backend="reference")  # type: ignore[arg-type]


def test_experts_fp8_checks_its_settings_when_built() -> None:
    # Before: each of these was accepted and failed at the first GEMM.
    ctx = ComputeCtx.from_flag("fp8_rowwise", "cpu")
    assert isinstance(ctx.recipe, Recipe)
    for policy, backend, error, match in [
        (None, Backend.REFERENCE, TypeError, "Recipe .ctx.recipe. as its policy, got NoneType"),
        ("fp8_rowwise", Backend.REFERENCE, TypeError, "as its policy, got str"),
        (ctx, Backend.REFERENCE, TypeError, "as its policy, got ComputeCtx"),
        (ctx.recipe, None, TypeError, "Backend as its backend .* got NoneType"),
        (ctx.recipe, 3, TypeError, "Backend as its backend .* got int 3"),
        (ctx.recipe, "bogus", ValueError, "unknown fp8 backend 'bogus'"),
    ]:
        with pytest.raises(error, match=match):
            QuantizedExperts(policy, backend)  # type: ignore[arg-type]
    named = QuantizedExperts(ctx.recipe, "reference")  # type: ignore[arg-type]
    assert named == QuantizedExperts(ctx.recipe, Backend.REFERENCE)


FLAGS = [
    "fp8_e4m3",  # tensor-wise delayed: the dense layer's ledger, the experts dynamic
    "fp8_e4m3_dynamic",
    "fp8_rowwise",
    "fp8_rowwise_gw_hp",
    "fp8_block",
    "fp8_mx",
]
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("case", ["inf_weight", "nan_and_inf_input", "huge_weight"])
@pytest.mark.parametrize("flag", FLAGS)
def test_nonfinite_operands_give_what_the_converted_dense_linear_gives(
    flag: str, case: str
) -> None:
    # One expert's weight (or the input) holding ±inf, NaN or 3e38, through quantized_grouped_mm
    # and through an nn.Linear that convert_to_quantized converted (a filter forces it): the same
    # bits, forward and backward, under every recipe. ±inf saturates to ±fmt.max, so it gives
    # finite outputs on both paths; a NaN makes its output column (weight) or row (input)
    # NaN; 3e38 quantizes finite and its products overflow the sum as in float32.
    ctx = ComputeCtx.from_flag(flag, "cpu")
    gen = torch.Generator().manual_seed(7)
    k, n, m = 64, 32, 5
    w = torch.randn(2, n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    if case == "inf_weight":
        w[1, 3, 5], w[1, 7, 9] = INF, -INF
    elif case == "huge_weight":
        w[1, 3, 5] = -3e38
    else:
        w[1, 10, 2], x[1, 5], x[3, 8] = NAN, INF, NAN
    linear = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(w[1])
    dense = nn.Sequential(linear)
    convert_to_quantized(dense, ctx, module_filter=lambda _m, _fqn: True)
    layer = dense[0]
    assert isinstance(layer, QuantizedLinear)
    dy = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    xd, xg, wg = x.clone().requires_grad_(), x.clone().requires_grad_(), w.requires_grad_()
    yd = dense(xd)
    yd.backward(dy)
    offs = torch.tensor([0, m], dtype=torch.int32)  # every row to expert 1
    assert isinstance(ctx.recipe, Recipe)
    yg = quantized_grouped_mm(xg, wg, offs, ctx.recipe)
    yg.backward(dy)  # type: ignore[no-untyped-call]
    assert xd.grad is not None and xg.grad is not None and wg.grad is not None
    got = (yg, xg.grad, wg.grad[1])
    want = (yd, xd.grad, layer.weight.grad)
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert b is not None
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
    if case == "inf_weight":
        assert torch.isfinite(yg).all() and torch.isfinite(xg.grad).all()
    elif case == "nan_and_inf_input":
        assert torch.isnan(yg[:, 10]).all() and torch.isnan(yg[3]).all()
        assert torch.isfinite(yg[[0, 1, 2, 4]][:, [c for c in range(n) if c != 10]]).all()
