"""How an fp8 KV cache stores its steps (``KvFp8.step``) and its window of recent positions
(``KvFp8.recent``): the pieces ``KVCache`` builds on.

Steps. The quantizer (``computectx.fp8.numerics.kv_quant``) computes a float32 step
``amax / fmt.max``. A cache whose ``step`` is ``bf16`` or ``e8m0`` stores that step rounded
*up* to the next value of its format (``stored_steps``) and quantizes with the stored value,
so ``code * step`` reads back exactly what was quantized and no code exceeds ``fmt.max``. An
e8m0 step is a power of two ``2**e`` with ``e`` in ``[-126, 127]`` (float32's normal range,
so every reader, the Triton kernel's bit shift included, widens it exactly).

Window. A cache with ``recent = N > 0`` holds the last ``N`` positions written also at the
compute dtype, in a ring of ``N`` slots (position ``p`` in slot ``p % N``); ``window_end`` (a
0-d int64 tensor, so a compiled step reads no host value) is one past the last position
written. Reading position ``p`` takes the ring's value when ``window_end - N <= p <
window_end`` and the dequantized codes otherwise (``splice_window``).
"""

from __future__ import annotations

import torch

from computectx.kv_policy import STEP_DTYPES, KvStep

__all__ = ["copy_positions", "ones_steps", "splice_window", "stored_steps", "window_slots"]

_E8M0_BIAS = 127
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -126, 127


def stored_steps(step: torch.Tensor, fmt: KvStep) -> torch.Tensor:
    """``step`` (float32, finite and positive) stored as ``fmt``: itself for ``f32``; the
    smallest bf16 at or above it for ``bf16``; the smallest power of two at or above it
    (exponent clamped to ``[-126, 127]``) as ``torch.float8_e8m0fnu`` for ``e8m0``."""
    wide = step.to(torch.float32)
    if fmt == "f32":
        return wide
    if fmt == "bf16":
        near = wide.to(torch.bfloat16)
        up = torch.nextafter(near, torch.full_like(near, float("inf")))
        return torch.where(near.to(torch.float32) < wide, up, near)
    mant, exp = torch.frexp(wide)
    exp = exp - (mant == 0.5).to(exp.dtype)  # an exact power of two keeps its exponent
    code = exp.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP) + _E8M0_BIAS
    return code.to(torch.uint8).view(torch.float8_e8m0fnu)


def ones_steps(shape: tuple[int, ...], fmt: KvStep, device: torch.device) -> torch.Tensor:
    """Steps of 1.0 at ``fmt`` (what an unwritten per_token_head position holds)."""
    if fmt == "e8m0":
        ones = torch.full(shape, _E8M0_BIAS, dtype=torch.uint8, device=device)
        return ones.view(torch.float8_e8m0fnu)
    return torch.ones(shape, dtype=STEP_DTYPES[fmt], device=device)


def copy_positions(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(2, index, src)`` for any dtype: torch has no index_copy_ for fp8 or
    e8m0 tensors, so 1-byte ones are copied as their bytes."""
    if dst.element_size() == 1:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(2, index, src)


def window_slots(positions: torch.Tensor, recent: int) -> torch.Tensor:
    """The ring slot of each position (``p % recent``)."""
    return torch.remainder(positions, recent)


def splice_window(
    deq: torch.Tensor, ring: torch.Tensor, window_end: torch.Tensor, recent: int
) -> torch.Tensor:
    """``deq`` (``(B, H, T, D)`` float32, positions ``0 .. T - 1``) with the positions in the
    window, ``window_end - recent <= p < window_end``, taken from ``ring`` (``(B, H, recent,
    D)``, widened to float32, exact)."""
    t = deq.shape[2]
    pos = torch.arange(t, device=deq.device)
    held = ring.index_select(2, window_slots(pos, recent)).to(deq.dtype)
    inside = (pos >= window_end - recent) & (pos < window_end)
    return torch.where(inside.view(1, 1, t, 1), held, deq)
