"""The precise ops: computed once at the accumulation dtype, rounded back once."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from computectx import ComputeCtx, DType
from computectx.nn import RMSNorm, RotaryEmbedding, apply_rope, rms_norm, rope_tables, softmax

CPU = torch.device("cpu")
BF16 = ComputeCtx.new(DType.BF16, CPU)
F32 = ComputeCtx.parity(CPU)
F64 = ComputeCtx.new(DType.F64, CPU)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    # Spacing of bf16 numbers around |x|: 2**(floor(log2|x|) - 7) (8 significant bits).
    mag = x.abs().double().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def _ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64, w64 = x.double(), w.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**31 - 1),
    dim=st.sampled_from([64, 384, 4096]),
    offset=st.floats(-50.0, 50.0),
    spread=st.floats(1e-3, 1e3),
)
def test_bf16_rms_norm_is_within_one_ulp_of_float64(
    seed: int, dim: int, offset: float, spread: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, dim, generator=g, dtype=torch.float64) * spread + offset).to(torch.bfloat16)
    w = torch.rand(dim, generator=g) + 0.5
    out = rms_norm(BF16, x, w)
    assert out.dtype == torch.bfloat16
    ref = _ref_rms(x, w, 1e-6)
    # Lifted to f32, the only coarse rounding is the final one to bf16: within one bf16
    # ulp of the exact value (half an ulp from that rounding plus f32 noise far below it).
    err = (out.double() - ref).abs()
    assert bool((err <= _bf16_ulp(ref)).all()), float((err / _bf16_ulp(ref)).max())


def test_rms_norm_rounds_once_from_the_accum_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 512, generator=g) * 3 + 1).to(torch.bfloat16)
    w = torch.rand(512, generator=g) + 0.5
    lifted = x.float()
    expected = (lifted * torch.rsqrt(lifted.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(
        torch.bfloat16
    )
    assert torch.equal(rms_norm(BF16, x, w), expected)
    # The same ops run natively in bf16 round every intermediate and land elsewhere.
    native = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(torch.bfloat16)
    assert not torch.equal(native, expected)


def test_rms_norm_module_matches_function_and_keeps_dtype() -> None:
    norm = RMSNorm(BF16, 32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 32))
    x = torch.randn(2, 5, 32).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out, rms_norm(BF16, x, norm.weight.detach(), 1e-5))
    assert norm.weight.dtype == torch.float32


@pytest.mark.parametrize(("dim", "eps"), [(0, 1e-6), (8, 0.0), (8, -1.0)])
def test_rms_norm_rejects_bad_sizes(dim: int, eps: float) -> None:
    with pytest.raises(ValueError, match="RMSNorm"):
        RMSNorm(F32, dim, eps)


def test_softmax_runs_at_accum_and_rows_sum_to_one() -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(8, 256, generator=g) * 4).to(torch.bfloat16)
    out = softmax(BF16, x, dim=-1)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.softmax(x.float(), dim=-1).to(torch.bfloat16))
    # 256 terms each rounded once to bf16 (relative 2**-9): the row sum stays within that.
    sums = out.double().sum(-1)
    assert bool(((sums - 1).abs() <= 2.0**-8).all())


def test_softmax_f32_policy_passes_tensor_straight_through() -> None:
    x = torch.randn(3, 7)
    assert torch.equal(softmax(F32, x, 0), torch.softmax(x, 0))


def test_rope_tables_match_the_formula() -> None:
    cos, sin = rope_tables(8, 20, base=100.0)
    assert cos.shape == (20, 4) and cos.dtype == torch.float32
    for pos in (0, 7, 19):
        for i in range(4):
            angle = pos * 100.0 ** (-2 * i / 8)
            assert math.isclose(float(cos[pos, i]), math.cos(angle), abs_tol=1e-7)
            assert math.isclose(float(sin[pos, i]), math.sin(angle), abs_tol=1e-7)


@pytest.mark.parametrize(("head_dim", "max_len"), [(7, 4), (0, 4), (8, 0)])
def test_rope_tables_reject_bad_sizes(head_dim: int, max_len: int) -> None:
    with pytest.raises(ValueError, match="RoPE"):
        rope_tables(head_dim, max_len)


def test_rope_is_a_rotation_and_depends_on_relative_position() -> None:
    cos, sin = rope_tables(16, 64)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(16, generator=g, dtype=torch.float64)
    k = torch.randn(16, generator=g, dtype=torch.float64)

    def at(v: torch.Tensor, pos: int) -> torch.Tensor:
        return apply_rope(F64, v[None, :], cos[pos : pos + 1], sin[pos : pos + 1])[0]

    assert torch.equal(at(q, 0), q)
    assert torch.allclose(at(q, 37).norm(), q.norm(), rtol=1e-6)
    # <R_m q, R_n k> = <q, R_{n-m} k>: attention scores see only the offset.
    dots = [float(at(q, m) @ at(k, m + 5)) for m in (0, 3, 40)]
    assert max(dots) - min(dots) < 1e-5


def test_bf16_rope_rounds_once_from_f32() -> None:
    cos, sin = rope_tables(32, 128)
    x = torch.randn(2, 128, 32).to(torch.bfloat16)
    out = apply_rope(BF16, x, cos, sin)
    xf = x.float()
    a, b = xf[..., :16], xf[..., 16:]
    expected = torch.cat((a * cos - b * sin, a * sin + b * cos), -1).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_apply_rope_rejects_mismatched_tables() -> None:
    cos, sin = rope_tables(8, 4)
    with pytest.raises(ValueError, match="apply_rope"):
        apply_rope(F32, torch.randn(4, 10), cos, sin)


def test_rotary_embedding_rotates_consecutive_positions_from_start() -> None:
    rope = RotaryEmbedding(F32, head_dim=8, max_len=12)
    cos, sin = rope_tables(8, 12)
    x = torch.randn(2, 3, 5, 8)
    assert torch.equal(rope(x), apply_rope(F32, x, cos[:5], sin[:5]))
    assert torch.equal(rope(x, 7), apply_rope(F32, x, cos[7:12], sin[7:12]))
    # A cached step continues the sequence: position 4 alone equals row 4 of the full pass.
    assert torch.equal(rope(x[..., 4:5, :], 4), rope(x)[..., 4:5, :])
    with pytest.raises(ValueError, match=r"positions 8\.\.12 are outside the RoPE table"):
        rope(x, 8)
    with pytest.raises(ValueError, match=r"accepted positions: 0\.\.11"):
        rope(x, -1)


@pytest.mark.parametrize(
    ("spec", "kind"),
    [("precise:fp8", "precise"), ("precise:recompute", "precise"), ("attention:fp8", "attention")],
)
def test_softmax_refuses_a_double_backward_naming_keep(spec: str, kind: str) -> None:
    # Its gradient is formed from the kept probabilities with no graph: the second-order
    # term would be lost (silently when dy needs no gradient), so it is refused by name.
    x = torch.randn(4, 8, requires_grad=True)
    y = softmax(F32.with_activations(spec), x, kind=kind)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=f"create_graph=True.*'{kind}:keep'"):
        torch.autograd.grad((y * torch.arange(8.0)).sum(), x, create_graph=True)


def test_softmax_under_keep_takes_a_double_backward() -> None:
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    grads = []
    for y in (softmax(F64, x), torch.softmax(x, -1)):
        (g,) = torch.autograd.grad((y * torch.arange(8.0)).sum(), x, create_graph=True)
        grads.append(torch.autograd.grad(g.pow(2).sum(), x)[0])
    assert torch.equal(grads[0], grads[1])
