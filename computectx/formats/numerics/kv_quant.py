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
steps are always finite and positive and a finite input never yields a NaN. A finite value
whose nearest code times its step would pass float32's max (only within a code of 3.4e38)
takes the code below instead, so a finite input never reads back as inf either (up to one
code step off rather than half of one: the one saturation at the top of float32). An inf or
NaN input value becomes a NaN code (never a saturated finite one), so it shows in the attention
output as it would through an unquantized cache; the finite values of its vector are
quantized as if it were absent (the amax skips it), so they read back within half a code
step as in any other vector.

The layout (which ``computectx.formats.ops.attention`` reads): codes ``(B, H, T, D)``;
steps ``(B, H, T)`` per_token_head, ``(H,)`` per_head, ``(1,)`` per_tensor.
"""

from __future__ import annotations

import torch

from computectx._checks import fault
from computectx.dtypes import Fp8Format, dtype_of
from computectx.kv_policy import KvFp8

__all__ = ["dequantize_kv", "kv_step", "quantize_kv", "static_kv_steps", "step_layout"]


def kv_step(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """``amax / fmt.max`` in float32, with every step that is not finite and positive (a zero
    or non-finite ``amax``, or one whose quotient underflows) set to 1.0 (see the module
    docstring)."""
    step = amax.to(torch.float32) / fmt.max
    return torch.where(torch.isfinite(step) & (step > 0), step, torch.ones_like(step))


def step_layout(step: torch.Tensor, batch: int, heads: int, t_max: int) -> str:
    """``'per_token_head'``, ``'per_head'`` or ``'per_tensor'`` from a step's shape
    (``(B, H, T_max)``, ``(H,)``, ``(1,)``); ``ValueError`` naming the shape otherwise. A
    ``(1,)`` step with ``H == 1`` reads as per_tensor (the same function)."""
    shape = tuple(step.shape)
    if shape == (1,):
        return "per_tensor"
    if shape == (heads,):
        return "per_head"
    if shape == (batch, heads, t_max):
        return "per_token_head"
    raise ValueError(
        f"a KV step of shape {shape} fits no layout; accepted: per_token_head "
        f"{(batch, heads, t_max)}, per_head {(heads,)}, per_tensor (1,)"
    )


def _step_view(step: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    # The step of values of `shape` (B, H, T, D), broadcast to (B, H, T, 1) without copying.
    if len(shape) != 4:
        raise ValueError(f"KV codes and values are (B, H, T, D), got {tuple(shape)}")
    b, h, t, _ = shape
    layout = step_layout(step, b, h, t)
    if layout == "per_token_head":
        return step.unsqueeze(-1)
    if layout == "per_head":
        return step.view(1, h, 1, 1)
    return step.view(1, 1, 1, 1)


def quantize_kv(
    x: torch.Tensor, fmt: Fp8Format, step: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and steps of keys or values ``x`` (``(B, H, T, D)``, a compute dtype: f16,
    bf16, f32 or f64; anything else is a ``PromotionError``, as a dtype cache's cast).

    With ``step=None`` the steps are per_token_head, ``(B, H, T)`` from each vector's amax;
    with a static ``step`` (``(H,)`` or ``(1,)``, float32, finite and positive) that step is
    used and returned. Codes are ``fmt.torch``. A per_token_head amax is taken over the
    vector's finite entries; inf and NaN entries become NaN codes (the module docstring).
    """
    if x.dim() != 4:
        raise ValueError(f"quantize_kv takes (B, H, T, D) values, got {tuple(x.shape)}")
    dtype_of(x)  # PromotionError for integer, bool, complex and fp8 values (cast_if's rule)
    wide = x.to(torch.float32)
    if step is None:
        finite = torch.where(torch.isfinite(wide), wide.abs(), torch.zeros_like(wide))
        step = kv_step(finite.amax(dim=-1), fmt)
    per = _step_view(step, x.shape).to(torch.float32)
    scaled = wide / per
    # clamp keeps NaN as NaN but would turn inf into fmt.max: an inf input becomes NaN instead.
    # A finite input whose quotient overflows (beyond a calibrated step's range) saturates.
    saturated = torch.where(
        torch.isinf(wide), torch.full_like(scaled, float("nan")), scaled.clamp(-fmt.max, fmt.max)
    )
    codes = saturated.to(fmt.torch)
    # A finite value within a code of float32's max (3.4e38) may round to a code whose product
    # with its step passes the max (a step rounded up to bf16 or a power of two, or an f32
    # step's own rounding): that code becomes the one below it (the byte of the magnitude
    # minus one), so a finite value never reads back as inf.
    over = torch.isinf(codes.to(torch.float32) * per) & torch.isfinite(wide)
    raw = codes.view(torch.uint8)
    codes = torch.where(over, raw - 1, raw).view(fmt.torch)
    return codes, step


def dequantize_kv(
    codes: torch.Tensor, step: torch.Tensor | None, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes * step`` at ``dtype`` (float32 by default; float64 is exact), ``codes``
    ``(B, H, T, D)`` and ``step`` ``(B, H, T)``, ``(H,)`` or ``(1,)`` (``step_layout``:
    ``ValueError`` naming a shape that fits none). ``step=None`` (a 16/32-bit cache holds
    values): ``codes`` widened to ``dtype``. The one dequantization of the fp8 KV cache:
    the cache's reads, the decode twin's blocks and its error bound's exact reference."""
    wide = codes.to(dtype)
    if step is None:
        return wide
    return wide * _step_view(step, codes.shape).to(dtype)


def _refused(wide: torch.Tensor, bad: torch.Tensor) -> str:
    # The first refused amax of a (2, H) amax, named by keys/values and head with what is
    # wrong with it (an error path: host reads of flags, never of the values), and the count.
    which, head = (int(i) for i in bad.nonzero()[0])
    what = fault(wide[which, head])
    count = int(bad.sum())
    more = f" ({count} of the {bad.numel()} amaxes refused)" if count > 1 else ""
    return f"the {'keys' if which == 0 else 'values'}' amax of head {head} is {what}{more}"


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
    bad = ~(torch.isfinite(wide) & (wide > 0))
    if bool(bad.any()):
        raise ValueError(
            f"a calibrated KV amax must be finite and positive for kv={kv}: {_refused(wide, bad)}"
        )
    if kv.scaling == "per_tensor":
        wide = wide.amax(dim=1, keepdim=True)
    steps = kv_step(wide, kv.format)
    return steps[0].contiguous(), steps[1].contiguous()
