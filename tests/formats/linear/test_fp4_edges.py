"""Fp4Linear at its edges: no rows, a dtype it does not take, a double backward, and
non-finite inputs (docs/fp4.md, "Non-finite values")."""

from __future__ import annotations

import math

import pytest
import torch

from computectx import ComputeCtx
from computectx.formats.linear.fp4 import Fp4Linear
from computectx.fp4_recipe import Fp4Recipe

RECIPES = {
    "nvfp4": Fp4Recipe(seed=5),
    "nvfp4+w1x16+no_rht": Fp4Recipe(weight_tile="1x16", hadamard=False),
    "mxfp4": Fp4Recipe(format="mxfp4"),
    "mxfp4+sr+rht": Fp4Recipe(format="mxfp4", stochastic=True, hadamard=True),
}


def _lin(name: str, k: int = 64, n: int = 32) -> Fp4Linear:
    torch.manual_seed(0)
    return Fp4Linear(k, n, ctx=ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=RECIPES[name]))


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
@pytest.mark.parametrize("name", list(RECIPES))
def test_no_rows_give_an_empty_output_and_zero_gradients(name: str, shape: tuple[int, ...]) -> None:
    lin = _lin(name)
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    assert y.shape == (*shape[:-1], 32) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for p in (lin.weight, lin.bias):
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert torch.equal(p.grad, torch.zeros_like(p))
    assert lin.sr_key.tolist()[1] == 0  # nothing drawn, nothing advanced
    with torch.no_grad():
        assert lin(x.detach()).shape == y.shape


def test_a_float64_input_is_refused_by_its_dtype_never_its_values() -> None:
    lin = _lin("nvfp4")
    x = torch.full((2, 64), 123.456, dtype=torch.float64)
    with pytest.raises(
        TypeError, match=r"takes bf16, fp16 or fp32 inputs, got float64 \(2, 64\); cast it first"
    ) as e:
        lin(x)
    assert "123.4" not in str(e.value) and "tensor(" not in str(e.value)
    with pytest.raises(TypeError, match=r"takes a tensor, got list"):
        lin([1.0] * 64)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_a_double_backward_is_refused_at_the_first_backward(name: str) -> None:
    lin = _lin(name)
    x = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\)"):
        torch.autograd.grad(lin(x).square().sum(), x, create_graph=True)
    torch.autograd.grad(lin(x).square().sum(), x)  # first order runs


def _grads(name: str, where: str, value: float) -> dict[str, torch.Tensor]:
    lin = _lin(name)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    (x if where == "x" else dy)[2, 5] = value
    x.requires_grad_(True)
    y = lin(x)
    y.backward(dy)
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    return {"y": y.detach(), "dx": x.grad, "dw": lin.weight.grad, "db": lin.bias.grad}


def _bad(t: torch.Tensor, axis: int = 0) -> list[int]:
    """The indices along ``axis`` of ``t``'s non-finite elements."""
    return sorted(set((~torch.isfinite(t)).nonzero()[:, axis].tolist()))


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_nan_reaches_the_rows_and_columns_it_enters_in_both_formats(name: str) -> None:
    got = _grads(name, "x", math.nan)  # X[2, 5]: all of Y's row 2, dW's column 5
    assert _bad(got["y"]) == [2] and not torch.isfinite(got["y"][2]).any()
    assert _bad(got["dx"]) == [] and _bad(got["dw"], axis=1) == [5]
    got = _grads(name, "dy", math.nan)  # dY[2, 5]: dX's row 2, dW's row 5, db[5]
    assert _bad(got["dx"]) == [2] and _bad(got["dw"]) == [5] and _bad(got["db"]) == [5]


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_an_inf_saturates_its_block_nvfp4_stays_finite_mxfp4_overflows_the_wgrad(
    name: str, value: float
) -> None:
    # The rule (docs/fp4.md, "Non-finite values"): ±inf codes ±6 at its block's largest
    # scale. NVFP4's block scales sit under the per-tensor scale of the finite elements: the
    # inf stands for ±(their amax), and the three GEMMs stay finite. MXFP4 has no per-tensor
    # scale: the block's E8M0 scale is 2**127 and ±6 * 2**127 overflows float32 in the GEMM
    # whose other operand's scale is not small: the weight gradient (the weight's is).
    for where in ("x", "dy"):
        got = _grads(name, where, value)
        assert _bad(got["y"]) == _bad(got["dx"]) == []
        if name.startswith("nvfp4"):
            assert _bad(got["dw"]) == []
        else:  # dW's column 5 (X[2, 5]) or row 5 (dY[2, 5]), as ±inf (never NaN)
            assert _bad(got["dw"], axis=1 if where == "x" else 0) == [5]
            assert not got["dw"].isnan().any()
        # db is dY's exact float32 sum: an inf in dY reaches it, in both formats.
        assert _bad(got["db"]) == ([5] if where == "dy" else [])
