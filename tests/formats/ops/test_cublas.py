"""The CUBLAS backend under CUDA's rules for ``torch._scaled_mm``, on the CPU.

torch's CPU ``_scaled_mm`` multiplies any shapes and formats; cuBLASLt does not. The
``cuda_rules`` fixture puts a strict ``torch._scaled_mm`` in place that refuses what the
CUDA build refuses (the checks of torch's own meta function for CUDA, plus the two the
CUDA kernel adds: no E5M2 x E5M2, a bias only for a 16-bit output of its dtype), then runs
the real CPU kernel. Every GEMM the CUBLAS backend issues here must pass those rules and
agree with the reference backend within the GEMM bound of docs/fp8-kernels.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear
from computectx.formats.backend import Backend
from computectx.formats.numerics import tensorwise
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.recipes import DelayedScaling, Fp8Scheme

from ..conftest import CtxFor

CUBLAS, REF = Backend.CUBLAS, Backend.REFERENCE
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
Calls = list[tuple[tuple[int, ...], tuple[int, ...]]]


def _strict_scaled_mm(real: Callable[..., torch.Tensor], calls: Calls) -> Callable[..., Any]:
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

        if mat1.dtype == mat2.dtype == E5M2:
            refuse("Multiplication of two Float8_e5m2 matrices is not supported")
        if not (mat1.stride(1) == 1 and mat1.stride(0) > 1):
            refuse(f"self must be row_major, got stride {mat1.stride()}")
        if not (mat2.stride(0) == 1 and mat2.stride(1) > 1):
            refuse(f"mat2 must be col_major, got stride {mat2.stride()}")
        if mat1.shape[1] % 16:
            refuse(f"Expected self.size(1) to be divisible by 16, got {tuple(mat1.shape)}")
        if mat2.shape[0] % 16 or mat2.shape[1] % 16:
            refuse(f"Expected both dimensions of mat2 to be divisible by 16, got {mat2.shape}")
        for name, t in (("mat1", mat1), ("mat2", mat2)):
            if max(t.stride()) % 16 or t.storage_offset() % 16:
                refuse(f"{name} rows must be 16-byte aligned, got stride {t.stride()}")
        for s in (scale_a, scale_b):
            if s.dtype != torch.float32 or s.numel() != 1:
                refuse(f"tensor-wise scales must be float32 scalars, got {s.dtype} {s.shape}")
        if bias is not None and not (bias.dtype == out_dtype != torch.float32):
            refuse(f"a bias of {bias.dtype} with out_dtype {out_dtype}")
        calls.append((tuple(mat1.shape), tuple(mat2.shape)))
        return real(mat1, mat2, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)

    return scaled_mm


@pytest.fixture
def cuda_rules(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """``torch._scaled_mm`` that refuses what CUDA refuses; returns the calls it let through."""
    calls: Calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _strict_scaled_mm(torch._scaled_mm, calls))
    return calls


def _codes(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).mul(8).to(dtype)


def test_the_strict_scaled_mm_refuses_what_cuda_refuses(cuda_rules: Calls) -> None:
    # The fixture is not vacuous: each of CUDA's rules is enforced.
    s = torch.ones(())
    a, b = _codes(24, 32, dtype=E4M3, seed=0), _codes(16, 32, dtype=E4M3, seed=1)
    bad: list[tuple[str, Callable[[], object]]] = [
        ("divisible by 16", lambda: torch._scaled_mm(a[:, :24], b[:, :24].t(), s, s)),
        ("divisible by 16", lambda: torch._scaled_mm(a, b[:8].t(), s, s)),
        ("Float8_e5m2", lambda: torch._scaled_mm(a.to(E5M2), b.to(E5M2).t(), s, s)),
        ("row_major", lambda: torch._scaled_mm(a.t().contiguous().t(), b.t(), s, s)),
        ("col_major", lambda: torch._scaled_mm(a, b.t().contiguous(), s, s)),
        ("float32 scalars", lambda: torch._scaled_mm(a, b.t(), s.double(), s)),
        ("a bias", lambda: torch._scaled_mm(a, b.t(), s, s, bias=torch.zeros(16))),
    ]
    for needle, call in bad:
        with pytest.raises(RuntimeError, match=needle):
            call()
    assert cuda_rules == []
    assert torch._scaled_mm(a, b.t(), s, s, out_dtype=torch.bfloat16).shape == (24, 16)
    assert cuda_rules == [((24, 32), (32, 16))]


@pytest.mark.parametrize(("m", "n", "k"), [(24, 32, 48), (5, 20, 24), (1, 16, 1), (33, 7, 16)])
@pytest.mark.parametrize(
    ("bias_dtype", "out"),
    [(None, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
)
@pytest.mark.parametrize("view", ["row-major", "transposed"])
def test_cublas_pads_k_and_n_and_matches_the_reference_within_the_gemm_bound(
    m: int,
    n: int,
    k: int,
    bias_dtype: torch.dtype | None,
    out: torch.dtype,
    view: str,
    cuda_rules: Calls,
) -> None:
    a = _codes(m, k, dtype=E4M3, seed=m)
    b = _codes(n, k, dtype=E5M2, seed=n)
    if view == "transposed":  # the .t() views dgrad and wgrad pass
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
    sa, sb = torch.full((1,), 0.125), torch.full((1,), 3.0)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    got = tensor_ops.scaled_mm(a, b, sa, sb, bias, out, backend=CUBLAS)
    want = tensor_ops.scaled_mm(a, b, sa, sb, bias, out, backend=REF)
    assert cuda_rules == [((m, -(-k // 16) * 16), (-(-k // 16) * 16, -(-n // 16) * 16))]
    assert got.shape == (m, n) and got.dtype == out and got.is_contiguous()
    # Both are within the bound of the exact product, so within twice it of each other.
    bound = tensorwise.scaled_mm_error_bound(tensorwise.GemmArgs(a, b, sa, sb, bias, out))
    assert bool(((got.double() - want.double()).abs() <= 2 * bound).all())


def test_two_e5m2_operands_run_on_the_twin_not_on_scaled_mm(cuda_rules: Calls) -> None:
    a, b = _codes(24, 32, dtype=E5M2, seed=2), _codes(16, 32, dtype=E5M2, seed=3)
    s = torch.full((1,), 0.5)
    got = tensor_ops.scaled_mm(a, b, s, s, None, torch.bfloat16, backend=CUBLAS)
    assert cuda_rules == []
    assert torch.equal(
        got, tensorwise.scaled_mm(tensorwise.GemmArgs(a, b, s, s, None, torch.bfloat16))
    )


def _fwd_bwd(
    ctx: ComputeCtx, backend: Backend, x: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    layer = QuantizedLinear(
        x.shape[-1], dy.shape[-1], ctx=ctx, backend=backend, dtype=torch.float32
    )
    xr = x.clone().requires_grad_(True)
    y = layer(xr)
    y.backward(dy)
    assert xr.grad is not None and layer.weight.grad is not None and layer.bias is not None
    assert layer.bias.grad is not None
    weights = (layer.weight.detach(), layer.bias.detach())
    return y.detach(), xr.grad, layer.weight.grad, layer.bias.grad, *weights


@pytest.mark.parametrize("scheme", [Fp8Scheme.HYBRID, Fp8Scheme.E4M3, Fp8Scheme.E5M2])
def test_an_fp8_linear_trains_on_cublas_with_24_tokens_like_the_reference(
    scheme: Fp8Scheme, ctx_for: CtxFor, cuda_rules: Calls
) -> None:
    # M = 3 x 8 = 24 tokens: the inner dimension of the weight-gradient GEMM dYᵀ X, which
    # CUDA's _scaled_mm refuses unpadded.
    ctx = ctx_for(DelayedScaling(history_len=4), scheme)
    gen = torch.Generator().manual_seed(7)
    x, dy = torch.randn(3, 8, 32, generator=gen), torch.randn(3, 8, 48, generator=gen)
    got = _fwd_bwd(ctx, CUBLAS, x, dy)
    calls = list(cuda_rules)
    want = _fwd_bwd(ctx, REF, x, dy)
    if scheme is Fp8Scheme.E5M2:
        # Every GEMM multiplies two E5M2 operands, which cuBLAS refuses: all on the twin.
        assert calls == []
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        return
    # Forward, dgrad, wgrad: the last with K = 24 padded to 32.
    assert calls == [((24, 32), (32, 48)), ((24, 48), (48, 32)), ((48, 32), (32, 32))]
    # The operands both backends multiply: on its first call each ledger is seeded from the
    # operand's own amax (margin 0), which is dynamic scaling's step.
    fwd, bwd = scheme.forward, scheme.backward
    w, bias = got[4], got[5]
    xq, sx, _ = tensorwise.quantize_dynamic(x.reshape(24, 32), fwd, 0)
    wq, sw, _ = tensorwise.quantize_dynamic(w, fwd, 0)
    gq, sg, _ = tensorwise.quantize_dynamic(dy.reshape(24, 48), bwd, 0)
    gemm, f32 = torch.bfloat16, torch.float32  # ctx.compute; dW stays float32
    gemms = [  # forward, dgrad, wgrad
        tensorwise.GemmArgs(xq, wq, sx, sw, bias, gemm),
        tensorwise.GemmArgs(gq, wq.t(), sg, sw, None, gemm),
        tensorwise.GemmArgs(gq.t(), xq.t(), sg, sx, None, f32),
    ]
    for i, (g, r, args) in enumerate(zip(got[:3], want[:3], gemms, strict=True)):
        bound = tensorwise.scaled_mm_error_bound(args)
        assert bool(((g.double() - r.double()).abs().reshape(bound.shape) <= 2 * bound).all()), i
    # The reconstruction is the one the layer used: the reference backend's dW is exactly
    # the twin's GEMM of those operands.
    assert torch.equal(want[2], tensorwise.scaled_mm(gemms[2]))
    assert torch.equal(got[3], want[3])  # the bias gradient never goes through fp8
