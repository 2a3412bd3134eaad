"""The fp8 KV cache's quantizer: keys and values to fp8 codes and float32 steps, and back.

One formula for every scaling of ``KvFp8`` (the recipes' convention with no margin)::

    step  = amax / fmt.max                       (float32)
    code  = saturate(round_to_fp8(x / step))     (saturate clamps to +-fmt.max)
    x_hat = code * step                          (dequantization, in float32)

``per_token_head`` takes ``amax`` from each (token, head) vector of ``head_dim`` values as it is
written: the largest magnitude among the vector's finite entries, so every vector uses the
whole fp8 range and no finite value saturates. ``per_head`` and ``per_tensor`` take it from
calibration (``static_kv_steps``): a value beyond the calibrated amax saturates at
``fmt.max * step``.

Edge cases, decided here once: a step that is not finite and positive (a vector with no
nonzero finite entry, or an amax so small that ``amax / fmt.max`` underflows) is 1.0, so
steps are always finite and positive and a finite input never yields a NaN. An inf or NaN
input value becomes a NaN code (never a saturated finite one), so it shows in the attention
output as it would through an unquantized cache; the finite values of its vector are
quantized as if it were absent (the amax skips it), so they read back within half a code
step as in any other vector.

The layout (which ``computectx.fp8.decode_attention`` reads): codes ``(B, H, T, D)``;
steps ``(B, H, T)`` per_token_head, ``(H,)`` per_head, ``(1,)`` per_tensor.
"""

from __future__ import annotations

import torch

from computectx.dtypes import Fp8Format, KvFp8

__all__ = ["dequantize_kv", "kv_step", "quantize_kv", "static_kv_steps"]


def kv_step(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """``amax / fmt.max`` in float32, with every step that is not finite and positive (a zero
    or non-finite ``amax``, or one whose quotient underflows) set to 1.0 (see the module
    docstring)."""
    step = amax.to(torch.float32) / fmt.max
    return torch.where(torch.isfinite(step) & (step > 0), step, torch.ones_like(step))


def _step_view(step: torch.Tensor, ndim: int) -> torch.Tensor:
    # (B, H, T) -> (B, H, T, 1); (H,) -> (1, H, 1, 1); (1,) -> (1, 1, 1, 1), for (B, H, T, D).
    if step.dim() == ndim - 1:
        return step.unsqueeze(-1)
    if step.dim() == 1:
        return step.view(1, -1, 1, 1)
    raise ValueError(
        f"a KV step of shape {tuple(step.shape)} fits no layout for {ndim}-d values; "
        f"accepted: (B, H, T) per_token_head, (H,) per_head, (1,) per_tensor"
    )


def quantize_kv(
    x: torch.Tensor, fmt: Fp8Format, step: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and steps of keys or values ``x`` (``(B, H, T, D)``, any floating dtype).

    With ``step=None`` the steps are per_token_head, ``(B, H, T)`` from each vector's amax;
    with a static ``step`` (``(H,)`` or ``(1,)``, float32, finite and positive) that step is
    used and returned. Codes are ``fmt.torch``. A per_token_head amax is taken over the
    vector's finite entries; inf and NaN entries become NaN codes (the module docstring).
    """
    if x.dim() != 4:
        raise ValueError(f"quantize_kv takes (B, H, T, D) values, got {tuple(x.shape)}")
    wide = x.to(torch.float32)
    if step is None:
        finite = torch.where(torch.isfinite(wide), wide.abs(), torch.zeros_like(wide))
        step = kv_step(finite.amax(dim=-1), fmt)
    scaled = wide / _step_view(step, 4)
    # clamp keeps NaN as NaN but would turn inf into fmt.max: an inf input becomes NaN instead.
    saturated = torch.where(
        torch.isinf(scaled), torch.full_like(scaled, float("nan")), scaled.clamp(-fmt.max, fmt.max)
    )
    return saturated.to(fmt.torch), step


def dequantize_kv(codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``codes * step`` in float32 (``codes`` ``(B, H, T, D)``; ``step`` ``(B, H, T)``,
    ``(H,)`` or ``(1,)``)."""
    return codes.to(torch.float32) * _step_view(step, codes.dim())


def static_kv_steps(amax: torch.Tensor, kv: KvFp8) -> tuple[torch.Tensor, torch.Tensor]:
    """The static key and value steps of ``kv`` (``per_head`` or ``per_tensor``) from a
    calibrated amax of shape ``(2, H)`` (row 0 keys, row 1 values): ``(H,)`` each per head,
    ``(1,)`` each per tensor (the largest head's amax).

    Every amax must be finite and positive (``ValueError`` otherwise): a static step is never
    the 1.0 that ``kv_step`` gives a zero or non-finite amax."""
    if not kv.static:
        raise ValueError(f"kv={kv} takes its steps from each vector as it is written, not static")
    if amax.dim() != 2 or amax.shape[0] != 2:
        raise ValueError(f"a calibrated KV amax has shape (2, H), got {tuple(amax.shape)}")
    wide = amax.to(torch.float32)
    if not bool((torch.isfinite(wide) & (wide > 0)).all()):
        raise ValueError(
            f"a calibrated KV amax must be finite and positive for kv={kv}, got {wide.tolist()}"
        )
    if kv.scaling == "per_tensor":
        wide = wide.amax(dim=1, keepdim=True)
    steps = kv_step(wide, kv.format)
    return steps[0].contiguous(), steps[1].contiguous()
