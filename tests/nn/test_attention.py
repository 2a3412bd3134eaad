"""Attention: computes at ctx.compute, caches at ctx.kv, masks the future."""

from __future__ import annotations

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.nn import MLP, Attention, KVCache

CPU = torch.device("cpu")
F32 = ComputeCtx.parity(CPU)
BF16 = ComputeCtx.new(DType.BF16, CPU)
SERVING = ComputeCtx.serving(CPU)  # bf16 compute, f32 KV cache


def _attn(ctx: ComputeCtx, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    return Attention(ctx, dim=32, n_heads=4, max_len=64)


@pytest.mark.parametrize(("ctx", "dtype"), [(F32, torch.float32), (BF16, torch.bfloat16)])
def test_output_shape_and_compute_dtype(ctx: ComputeCtx, dtype: torch.dtype) -> None:
    attn = _attn(ctx)
    x = torch.randn(3, 10, 32)
    out = attn(x)
    assert out.shape == (3, 10, 32)
    assert out.dtype == dtype


def test_causal_mask_hides_the_future() -> None:
    attn = _attn(F32)
    x = torch.randn(2, 12, 32)
    y = x.clone()
    y[:, 7:] = torch.randn(2, 5, 32)  # change positions 7.. only
    a, b = attn(x), attn(y)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_first_position_attends_only_to_itself() -> None:
    attn = _attn(F32)
    x = torch.randn(1, 6, 32)
    # With one visible key the softmax weight is exactly 1: out = W_o v_0.
    single = attn(x[:, :1])
    assert torch.allclose(attn(x)[:, :1], single, atol=1e-6)


@pytest.mark.parametrize(
    ("ctx", "kv_dtype"),
    [
        (F32, torch.float32),
        (BF16, torch.bfloat16),
        (SERVING, torch.float32),
        (F32.with_kv(DType.BF16), torch.bfloat16),
    ],
)
def test_kv_cache_is_stored_at_ctx_kv(ctx: ComputeCtx, kv_dtype: torch.dtype) -> None:
    attn = _attn(ctx)
    cache = attn.new_cache(batch=2)
    assert cache.dtype == kv_dtype
    with torch.no_grad():
        out = attn(torch.randn(2, 5, 32), cache)
    assert cache.length == 5
    assert cache.k.dtype == kv_dtype and cache.v.dtype == kv_dtype
    assert out.dtype == ctx.compute.torch
    assert bool(cache.k[:, :, :5].abs().sum() > 0) and bool((cache.k[:, :, 5:] == 0).all())


@pytest.mark.parametrize("ctx", [F32, SERVING])
def test_incremental_cached_attention_equals_full(ctx: ComputeCtx) -> None:
    # kv ⊒ compute: to_kv is exact, so caching changes nothing but the matmul shapes.
    attn = _attn(ctx)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        full = attn(x).float()
        cache = attn.new_cache(batch=2)
        parts = [attn(x[:, :4], cache)] + [attn(x[:, i : i + 1], cache) for i in range(4, 9)]
    stepped = torch.cat(parts, dim=1).float()
    tol = 1e-5 if ctx.compute is DType.F32 else 2e-2
    assert torch.allclose(stepped, full, atol=tol, rtol=tol)


def test_kv_cache_rejects_overflow_and_bad_shapes() -> None:
    cache = KVCache(F32, batch=1, n_heads=2, head_dim=4, max_len=3)
    k = torch.zeros(1, 2, 2, 4)
    cache.append(k, k)
    with pytest.raises(ValueError, match="at most 1 more"):
        cache.append(k, k)
    assert cache.length == 2  # a refused append leaves the cache as it was
    with pytest.raises(ValueError, match="expected both"):
        cache.append(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    with pytest.raises(ValueError, match="positive int"):
        KVCache(F32, batch=0, n_heads=2, head_dim=4, max_len=3)


def test_attention_rejects_indivisible_heads_and_far_positions() -> None:
    with pytest.raises(ValueError, match="multiple of n_heads"):
        Attention(F32, dim=30, n_heads=4, max_len=8)
    attn = Attention(F32, dim=16, n_heads=2, max_len=4)
    with pytest.raises(ValueError, match=r"positions 0\.\.4 are outside the RoPE table"):
        attn(torch.randn(1, 5, 16))


def test_attention_backward_reaches_every_weight() -> None:
    attn = _attn(BF16)
    attn(torch.randn(2, 6, 32)).float().pow(2).mean().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert bool(p.grad.abs().sum() > 0), name


@pytest.mark.parametrize(("ctx", "dtype"), [(F32, torch.float32), (BF16, torch.bfloat16)])
def test_mlp_shape_and_dtype(ctx: ComputeCtx, dtype: torch.dtype) -> None:
    mlp = MLP(ctx, 32, 48)
    out = mlp(torch.randn(2, 3, 32))
    assert out.shape == (2, 3, 32) and out.dtype == dtype
    with pytest.raises(ValueError, match="MLP sizes"):
        MLP(ctx, 0, 48)
