"""Decode attention's pure-torch twin and its error bound.

``decode_attention_reference`` is what ``computectx::fp8_decode_attention`` computes on every
backend: one query position against a KV cache of fp8 codes and float32 steps (dequantized in
float32 by ``numerics.kv_quant``) or of 16/32-bit values, in blocks of ``block_t`` positions
with a running max and sum, in float32, rounded once to the query's dtype.
``decode_attention_error_bound`` bounds the kernel against it. The checked entry point is
``computectx.formats.ops.attention``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.kv_quant import dequantize_kv

__all__ = ["DecodeArgs", "decode_attention_error_bound", "decode_attention_reference"]


@dataclasses.dataclass(frozen=True)
class DecodeArgs:
    """``computectx::fp8_decode_attention``'s arguments but the backend, checked (``length``
    an int64 ``(B,)`` tensor): what the twin, its error bound and the kernel take. The
    operator's schema and this class are the argument list's two spellings."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_step: torch.Tensor | None
    v_step: torch.Tensor | None
    length: torch.Tensor
    sm_scale: float
    block_t: int


def decode_attention_reference(args: DecodeArgs) -> torch.Tensor:
    """The pure-torch twin (the module docstring's steps 1-5), all (b, h) at once; arguments
    already checked, ``length`` an int64 ``(B,)`` tensor. It visits every block of
    ``T_max``, masked, and reads no tensor value on the host (a CUDA graph can hold it); a
    block wholly beyond a row's length adds nothing to it (``alpha = 1``, ``p = 0``, both
    exact). ``decode_attention`` with an int length passes only the blocks that hold its
    first ``length`` positions, so eager callers pay for no more."""
    q, k, v, k_step, v_step, length = args.q, args.k, args.v, args.k_step, args.v_step, args.length
    sm_scale, block_t = args.sm_scale, args.block_t
    b, h, t_max, d = k.shape
    qf = q.to(torch.float32).unsqueeze(-2)  # (B, H, 1, D)

    def block_step(step: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
        # A per_token_head step's positions of the block; a static step as it is.
        return step[:, :, start:stop] if step is not None and step.dim() == 3 else step

    m = torch.full((b, h), -math.inf, dtype=torch.float32, device=q.device)
    l_sum = torch.zeros((b, h), dtype=torch.float32, device=q.device)
    acc = torch.zeros((b, h, d), dtype=torch.float32, device=q.device)
    limit = length.view(b, 1, 1)
    for start in range(0, t_max, block_t):
        stop = min(start + block_t, t_max)
        kb = dequantize_kv(k[:, :, start:stop], block_step(k_step, start, stop))
        vb = dequantize_kv(v[:, :, start:stop], block_step(v_step, start, stop))
        beyond = torch.arange(start, stop, device=q.device).view(1, 1, -1) >= limit
        # Whatever lies beyond a row's length (stale codes, NaN, zero steps) never reaches
        # the sums: the scores there are -inf and the values 0, as the kernel's masked loads.
        vb = vb.masked_fill(beyond.unsqueeze(-1), 0.0)
        # Products and sums elementwise, not a matmul: float32 whatever the float32 matmul
        # precision (a CUDA device may run matmuls in TF32, 10 mantissa bits).
        s = (kb * qf).sum(dim=-1) * sm_scale  # (B, H, t)
        s = s.masked_fill(beyond, -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        l_sum = l_sum * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + (p.unsqueeze(-1) * vb).sum(dim=-2)
        m = m_new
    return (acc / l_sum.unsqueeze(-1)).to(q.dtype)


_U32 = 2.0**-24


def decode_attention_error_bound(args: DecodeArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, bound)``, float64 ``(B, H, D)``: softmax attention over the dequantized cache
    computed in float64, and an a-priori bound on ``|decode_attention(...) - exact|`` for the
    twin and the kernel (any summation order, any split of T into blocks and programs).

    With ``u = 2**-24``, ``gamma_n = n u / (1 - n u)``, ``tiny = 2**-126`` (float32's
    smallest normal: a GPU's approximate ``exp`` need not keep subnormal results) and, per
    (b, h), over the valid positions ``t``:

    - score error: ``|s^_t - s_t| <= E_s = gamma_{D+2} * max_t sm_scale * sum_d |q_d k_td|``
      (dequantizing a key, D products and sums in any order, the ``sm_scale`` product),
      plus ``(D + 2) tiny sm_scale (1 + sum_d |q_d|)`` for underflow;
    - ``exp`` error: the exponential itself up to 8 ulp, and a rounded argument ``y``
      (``s - m``, and on a GPU its product with ``log2 e``) costs ``3 u |y|``. The
      arguments that touch term ``t`` (its own ``s_t - m_j``, the rescales
      ``m_{i-1} - m_i`` of later blocks, the merge of split partials ``m_s - M``) add up
      to ``x_t = max s - s_t`` (plus ``2 E_s``): the running max only grows;
    - with ``nb = ceil(length / block_t)`` blocks, each term meets at most ``nb + 2``
      exponentials and ``block_t + 3 nb + 4`` float32 roundings (the value's
      dequantization, ``p * v``, the block sum, the rescales, the cross-block and
      cross-split sums).

    So every term of ``acc = sum_t p_t v_t`` and of ``l = sum_t p_t`` is its exact value
    times a factor within ``1 +- a_t``,
    ``a_t = exp(E_s + 3 u x_t) (1 + 8u)**(nb+2) (1 + u)**(block_t + 3 nb + 4) - 1``, and

        |acc / l - exact| <= sum_t w_t a_t (|v_t| + |exact|) / (1 - max_t a_t)

    with ``w`` the exact softmax weights (``l >= 1``: the largest score's term is
    ``exp(0)``; underflowed weights and products add ``3 T tiny max|v|``). The division and
    the rounding to ``q``'s dtype add ``(u + u_out) |result|`` (``u_out`` = 2**-8 bf16,
    2**-11 f16, 2**-24 f32) and half the dtype's smallest subnormal.
    """
    q, k, v, k_step, v_step, length = args.q, args.k, args.v, args.k_step, args.v_step, args.length
    sm_scale, block_t = args.sm_scale, args.block_t
    b, _, t_max, d = k.shape
    tiny32 = 2.0**-126
    q64 = q.to(torch.float64)
    k64 = dequantize_kv(k, k_step, dtype=torch.float64)
    v64 = dequantize_kv(v, v_step, dtype=torch.float64)
    valid = torch.arange(t_max, device=q.device).view(1, 1, -1) < length.view(b, 1, 1)
    k64 = k64.masked_fill(~valid.unsqueeze(-1), 0.0)
    v64 = v64.masked_fill(~valid.unsqueeze(-1), 0.0)
    s = torch.einsum("bhtd,bhd->bht", k64, q64) * sm_scale
    mag = torch.einsum("bhtd,bhd->bht", k64.abs(), q64.abs()) * sm_scale
    s = s.masked_fill(~valid, -math.inf)
    w = torch.softmax(s, dim=-1)  # exact weights (float64), zero beyond the length
    exact = torch.einsum("bht,bhtd->bhd", w, v64)

    def gamma(n: float) -> float:
        return n * _U32 / (1 - n * _U32)

    q_abs = q64.abs().sum(dim=-1)
    e_s = gamma(d + 2) * mag.amax(dim=-1) + (d + 2) * tiny32 * sm_scale * (1 + q_abs)
    e_s = e_s.unsqueeze(-1)  # (B, H, 1)
    x = (s.amax(dim=-1, keepdim=True) - s).masked_fill(~valid, 0.0) + 2 * e_s
    nb = torch.ceil(length.to(torch.float64) / block_t).view(b, 1, 1)
    a = (
        torch.exp(e_s + 3 * _U32 * x)
        * torch.pow(1 + 8 * _U32, nb + 2)
        * torch.pow(1 + _U32, block_t + 3 * nb + 4)
        - 1
    ).masked_fill(~valid, 0.0)  # (B, H, T)
    wa = w * a
    err = torch.einsum("bht,bhtd->bhd", wa, v64.abs()) + wa.sum(-1, keepdim=True) * exact.abs()
    err = err / (1 - a.amax(dim=-1, keepdim=True))
    v_max = v64.abs().amax(dim=(-2, -1)).unsqueeze(-1)
    err = err + 3 * length.to(torch.float64).view(b, 1, 1) * tiny32 * v_max
    u_out = tensorwise.UNIT_ROUNDOFF[q.dtype]
    half_sub = torch.finfo(q.dtype).smallest_normal * u_out
    return exact, err + (_U32 + u_out) * (exact.abs() + err) + half_sub
