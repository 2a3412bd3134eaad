"""Causal self-attention computing in ``ctx.compute`` with a KV cache stored at ``ctx.kv``."""

from __future__ import annotations

import math

import torch
from torch import nn

from computectx.ctx import ComputeCtx
from computectx.nn.gemm import Gemm
from computectx.nn.linears import apply_fp8_policy, param_dtype
from computectx.nn.ops import softmax
from computectx.nn.rope import RotaryEmbedding

__all__ = ["Attention", "KVCache"]


class KVCache:
    """Keys and values of one attention layer for a batch, stored at ``ctx.kv``.

    Preallocated for ``max_len`` positions. ``append`` casts new keys/values with
    ``ctx.to_kv`` (the cache-append boundary: the only place their dtype changes on the way
    in) and returns every cached position so far, still at ``ctx.kv``.
    """

    def __init__(
        self, ctx: ComputeCtx, batch: int, n_heads: int, head_dim: int, max_len: int
    ) -> None:
        for name, value in (
            ("batch", batch),
            ("n_heads", n_heads),
            ("head_dim", head_dim),
            ("max_len", max_len),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCache {name} must be a positive int, got {value!r}")
        self.ctx = ctx
        self.max_len = max_len
        shape = (batch, n_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=ctx.kv.torch, device=ctx.device)
        self.v = torch.zeros(shape, dtype=ctx.kv.torch, device=ctx.device)
        self.length = 0

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (``ctx.kv``)."""
        return self.k.dtype

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` (``(batch, n_heads, T, head_dim)``) after the cached positions and
        return keys and values of all positions so far (views into the cache)."""
        b, h, cap, d = self.k.shape
        if k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
            raise ValueError(
                f"KVCache.append: got k {tuple(k.shape)} and v {tuple(v.shape)}; expected "
                f"both ({b}, {h}, T, {d})"
            )
        t = k.shape[2]
        if self.length + t > cap:
            raise ValueError(
                f"KVCache.append: {t} new position(s) after {self.length} cached exceed "
                f"max_len={cap}; at most {cap - self.length} more fit"
            )
        end = self.length + t
        self.k[:, :, self.length : end] = self.ctx.to_kv(k)
        self.v[:, :, self.length : end] = self.ctx.to_kv(v)
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    """Multi-head causal self-attention with RoPE.

    Projections (``Fp8Linear`` when ``ctx.fp8`` is set, else ``nn.Linear``), the scores and
    the weighted sum are GEMMs at ``ctx.compute`` with float32 accumulation (``Gemm``: torch's
    kernel, or its float32 emulation on CPUs without a half-precision one), inside
    ``ctx.autocast()``; RoPE and the softmax go through ``ctx.precise``. With a ``KVCache``,
    new keys/values are stored at ``ctx.kv`` and read back with ``ctx.to_compute``, and
    queries take positions after the cached ones.
    """

    def __init__(
        self, ctx: ComputeCtx, dim: int, n_heads: int, max_len: int, rope_base: float = 10000.0
    ) -> None:
        super().__init__()
        if n_heads <= 0 or dim % n_heads:
            raise ValueError(
                f"Attention dim={dim!r} must be a positive multiple of n_heads={n_heads!r}"
            )
        self.ctx = ctx
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.max_len = max_len
        dt = param_dtype(ctx)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, device=ctx.device, dtype=dt)
        self.out = nn.Linear(dim, dim, bias=False, device=ctx.device, dtype=dt)
        self.rope = RotaryEmbedding(ctx, self.head_dim, max_len, rope_base)
        apply_fp8_policy(self, ctx)
        self.gemm = Gemm.for_ctx(ctx)

    def new_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """An empty cache for this layer (``max_len`` defaults to the RoPE table length)."""
        return KVCache(self.ctx, batch, self.n_heads, self.head_dim, max_len or self.max_len)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        b, t, dim = x.shape
        start = 0 if cache is None else cache.length
        with self.ctx.autocast():
            qkv = self.ctx.to_compute(self.gemm.project(self.qkv, x))
            q, k, v = qkv.view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q = self.rope(q, start)
            k = self.rope(k, start)
            if cache is not None:
                k_all, v_all = cache.append(k, v)
                k, v = self.ctx.to_compute(k_all), self.ctx.to_compute(v_all)
            # Query i sits at position start + i and sees keys 0 .. start + i.
            causal = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(start)
            scores = self.gemm.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            # -inf (not a large negative number) so masked keys get exactly zero weight in
            # every dtype; each query sees at least itself, so no row is all -inf.
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = softmax(self.ctx, scores, dim=-1)
            mixed = self.gemm.matmul(probs, v).transpose(1, 2).reshape(b, t, dim)
            return self.ctx.to_compute(self.gemm.project(self.out, mixed))
