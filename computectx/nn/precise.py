"""The precision-sensitive ops, each run through ``ctx.precise``: RMS norm, softmax, RoPE.

These are the places where a low-precision dtype loses the answer rather than a few low
bits: a mean of squares over thousands of features, an exponential over logits, and a
sine/cosine rotation whose angle grows with position. Each is lifted to ``ctx.accum`` (the
join with the input's dtype), computed there, and rounded back to the input's dtype once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from computectx.activations import ACTIVATION_KINDS, ActivationKind
from computectx.ctx import ComputeCtx
from computectx.dtypes import dtype_of, promote
from computectx.saved import SAVING, refuse_double_backward

__all__ = ["apply_rope", "rms_norm", "rope_tables", "softmax"]


def rms_norm(
    ctx: ComputeCtx,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    kind: ActivationKind = "precise",
) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension, computed at ``x.dtype ⊔ ctx.accum``.

    In BF16 the mean of squares of a few hundred features carries ~3 significant digits and
    the reciprocal square root another rounding; at F32 the only BF16 rounding left is the
    final one, so the result is the correctly rounded norm to within an ulp.

    The backward keeps what ``ctx.activations`` says for ``precise``. A norm on the residual
    stream (``kind="residual"``: the LM's blocks' norms, whose input is the stream at a block
    boundary) keeps its input as ``residual`` says when that is not ``keep`` (fp8 groups, or
    in host memory, its internals computed again), else as ``precise`` says.
    """
    if kind == "residual" and ctx.activations.residual == "keep":
        kind = "precise"

    def f(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        inv = torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + eps)
        return t * inv * w.to(t.dtype)

    # The weight is an operand, not a closure: under ctx.activations' fp8 or recompute the
    # backward runs f again and differentiates it with respect to its arguments only.
    return ctx.precise(x, f, weight, kind=kind)


def softmax(
    ctx: ComputeCtx, x: torch.Tensor, dim: int = -1, kind: ActivationKind = "precise"
) -> torch.Tensor:
    """Softmax along ``dim`` computed at ``x.dtype ⊔ ctx.accum``, returned at ``x.dtype``.

    The normalizing sum runs at the accumulation dtype, so rows of many small
    probabilities still sum to one before the single rounding back. The backward keeps
    what ``ctx.activations`` says for ``kind`` (attention's probabilities: ``"attention"``):
    under ``keep`` the float32 probabilities ``torch.softmax`` saves; under ``recompute`` and
    ``fp8`` only the returned probabilities at ``x.dtype``, the tensor the next GEMM keeps
    anyway (so nothing more), from which the backward forms ``y * (dy - sum(dy * y))`` at
    the accumulation dtype (a softmax's gradient needs its output, never its input); under
    ``offload`` its input in host memory, the softmax computed again (``saved_call``). A
    double backward (``create_graph=True``) under any of those is a ``RuntimeError`` naming
    ``'KIND:keep'``; under ``keep`` it is torch's softmax's.
    """
    if kind not in ACTIVATION_KINDS:  # as ctx.precise: a field name like "group" is no kind
        raise ValueError(f"unknown activation kind {kind!r}; accepted: {ACTIVATION_KINDS}")
    mode = getattr(ctx.activations, kind)
    if mode in ("keep", "offload") or not (torch.is_grad_enabled() and x.requires_grad):
        # offload: saved_call keeps the input in host memory and computes the softmax again.
        return ctx.precise(x, lambda t: torch.softmax(t, dim=dim), kind=kind)
    work = promote(dtype_of(x), ctx.accum).torch
    if torch.compiler.is_compiling():  # a compiled graph's saves carry no kind
        return _softmax_keeping_output(x, dim, work, kind)
    token = SAVING.set(kind)
    try:
        return _softmax_keeping_output(x, dim, work, kind)
    finally:
        SAVING.reset(token)


def _softmax_keeping_output(
    x: torch.Tensor, dim: int, work: torch.dtype, kind: ActivationKind
) -> torch.Tensor:
    y: torch.Tensor = _SoftmaxKeepingOutput.apply(x, dim, work, kind)  # type: ignore[no-untyped-call]
    return y


class _SoftmaxKeepingOutput(torch.autograd.Function):
    """Softmax at ``work`` returned at ``x``'s dtype, keeping only that returned tensor (for
    ``kind`` under ``recompute`` or ``fp8``: a first-order backward only)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, dim: int, work: torch.dtype, kind: ActivationKind
    ) -> torch.Tensor:
        y = torch.softmax(x.to(work), dim=dim).to(x.dtype)
        ctx.save_for_backward(y)
        c: Any = ctx
        c.dim, c.work, c.kind = dim, work, kind
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The gradient is formed from the kept output with no graph: no double backward.
        refuse_double_backward(ctx.kind, "recompute")
        return _SoftmaxKeepingOutput.first_order(ctx, dy)

    @staticmethod
    @once_differentiable
    def first_order(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (y,) = ctx.saved_tensors
        yw, dyw = y.to(ctx.work), dy.to(ctx.work)
        dx = yw * (dyw - (dyw * yw).sum(dim=ctx.dim, keepdim=True))
        return dx.to(y.dtype), None, None, None


def rope_tables(
    head_dim: int, max_len: int, base: float = 10000.0, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of shape ``(max_len, head_dim // 2)`` in float32.

    The angles ``pos * base**(-2i/head_dim)`` are formed in float64: at position 4096 an
    angle is ~4e3 rad, and float32 would already misplace it by ~2e-4 rad before the sine.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"RoPE needs a positive even head_dim, got {head_dim!r}")
    if max_len <= 0:
        raise ValueError(f"RoPE needs a positive max_len, got {max_len!r}")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (
        angles.cos().to(torch.float32).to(device),
        angles.sin().to(torch.float32).to(device),
    )


def apply_rope(
    ctx: ComputeCtx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate feature pairs ``(x[..., i], x[..., i + d/2])`` of ``x`` (``(..., T, d)``) by
    the angles whose ``cos``/``sin`` rows (``(T, d/2)``) match ``x``'s positions.

    The rotation runs at ``x.dtype ⊔ ctx.accum``: a BF16 cos/sin pair is off by up to
    2**-9, which would shrink or grow the rotated vector on every position.
    """
    half = x.shape[-1] // 2
    if x.shape[-1] != 2 * cos.shape[-1] or cos.shape != sin.shape:
        raise ValueError(
            f"apply_rope: x has {x.shape[-1]} features but the tables hold "
            f"{tuple(cos.shape)} / {tuple(sin.shape)}; expected (T, {half}) for both"
        )

    def f(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, s = cos.to(t.dtype), sin.to(t.dtype)
        a, b = t[..., :half], t[..., half:]
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)

    return ctx.precise(x, f, cos, sin)
