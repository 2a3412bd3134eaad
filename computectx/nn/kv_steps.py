"""How an fp8 KV cache stores its steps (``KvFp8.step``) and its window of recent positions
(``KvFp8.recent``): the pieces ``KVCache`` builds on.

Steps. The quantizer (``computectx.formats.numerics.kv_quant``) computes a float32 step
``amax / fmt.max``. A cache whose ``step`` is ``bf16`` or ``e8m0`` stores that step rounded
*up* to the next value of its format (``stored_steps``) and quantizes with the stored value,
so ``code * step`` reads back exactly what was quantized and no code exceeds ``fmt.max``. An
e8m0 step is a power of two ``2**e`` with ``e`` in ``[-126, 127]`` (float32's normal range,
so every reader, the Triton kernel's bit shift included, widens it exactly).

The cache holds e8m0 steps as their bytes (``uint8``, ``HELD_DTYPES``) and shows them as
``torch.float8_e8m0fnu`` (a view of the same bytes): Inductor's CPU code generator has no
``float8_e8m0fnu`` (``DTYPE_TO_CPP``), so a compiled step computes, writes and widens the
bytes (``held_steps``, ``widen_steps``) and only the decode operator, opaque to Inductor,
receives the e8m0 view, as the MX path keeps its E8M0 scales out of Inductor's kernels.

Window. A cache with ``recent = N > 0`` holds recently written positions also at the
compute dtype, in a ring of ``n = min(N, max_len)`` slots (position ``p`` in slot ``p % n``),
and beside it the position each slot holds (``window_pos``, int64 ``(n,)``, -1 for none; a
tensor, so a compiled step reads no host value). Every write of position ``p`` either puts
``p``'s values in slot ``p % n`` and tags it ``p``, or (a write of more than ``n``
positions) fills that slot with a later position of the same write. So a slot tagged ``p``
holds the last values written at ``p``, whatever order the writes came in (a rollback
rewrites an earlier position: the slots of the positions it displaced no longer carry
their tags), and reading ``p`` takes the ring's value exactly when the tag says so, the
dequantized codes otherwise (``splice_window``).
"""

from __future__ import annotations

from typing import Final

import torch

from computectx._checks import as_int, fault
from computectx.dtypes import FLOAT_DTYPES, DType
from computectx.kv_policy import KvFp8, KvStep

__all__ = [
    "HELD_DTYPES",
    "MAX_ELEMENTS",
    "WINDOW_DTYPES",
    "check_sizes",
    "check_window_dtype",
    "copy_positions",
    "held_steps",
    "ones_steps",
    "splice_window",
    "static_steps",
    "stored_steps",
    "widen_steps",
    "window_slots",
    "window_values",
]

_E8M0_BIAS = 127
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -126, 127

HELD_DTYPES: Final[dict[KvStep, torch.dtype]] = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "e8m0": torch.uint8,
}
"""The dtype a cache holds each step format's tensor at (e8m0 as its bytes)."""


def held_steps(step: torch.Tensor, fmt: KvStep) -> torch.Tensor:
    """``step`` (float32, finite and positive) as the cache holds it: itself for ``f32``;
    the smallest bf16 at or above it for ``bf16``; for ``e8m0`` the biased exponent byte
    (``uint8``) of the smallest power of two at or above it, the exponent clamped to
    ``[-126, 127]`` (bytes 1 .. 254)."""
    wide = step.to(torch.float32)
    if fmt == "f32":
        return wide
    if fmt == "bf16":
        near = wide.to(torch.bfloat16)
        up = torch.nextafter(near, torch.full_like(near, float("inf")))
        return torch.where(near.to(torch.float32) < wide, up, near)
    mant, exp = torch.frexp(wide)
    exp = exp - (mant == 0.5).to(exp.dtype)  # an exact power of two keeps its exponent
    return (exp.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP) + _E8M0_BIAS).to(torch.uint8)


def stored_steps(step: torch.Tensor, fmt: KvStep) -> torch.Tensor:
    """``held_steps`` at the step format's own dtype: e8m0 bytes viewed as
    ``torch.float8_e8m0fnu`` (the same bytes), the others as they are."""
    held = held_steps(step, fmt)
    return held.view(torch.float8_e8m0fnu) if fmt == "e8m0" else held


def widen_steps(held: torch.Tensor) -> torch.Tensor:
    """Held steps as float32, exactly: e8m0 bytes (``uint8``, or a ``float8_e8m0fnu`` view)
    by their bits, ``2**(byte - 127)`` (byte 0 the subnormal ``2**-127``, byte 255 NaN, as
    torch widens ``float8_e8m0fnu``), with no e8m0 arithmetic for Inductor to miss; float32
    and bf16 by a cast."""
    if held.dtype == torch.float8_e8m0fnu:
        held = held.view(torch.uint8)
    if held.dtype != torch.uint8:
        return held.to(torch.float32)
    byte = held.to(torch.int32)
    bits = torch.where(byte == 0, torch.full_like(byte, 0x400000), byte << 23)
    bits = torch.where(byte == 255, torch.full_like(byte, 0x7FC00000), bits)
    return bits.view(torch.float32)


def ones_steps(shape: tuple[int, ...], fmt: KvStep, device: torch.device) -> torch.Tensor:
    """Steps of 1.0 as the cache holds them (``HELD_DTYPES``): what an unwritten
    per_token_head position holds."""
    if fmt == "e8m0":
        return torch.full(shape, _E8M0_BIAS, dtype=torch.uint8, device=device)
    return torch.ones(shape, dtype=HELD_DTYPES[fmt], device=device)


def copy_positions(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_copy_(2, index, src)`` for any dtype: torch has no index_copy_ for fp8
    tensors, so 1-byte ones are copied as their bytes."""
    if dst.element_size() == 1:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(2, index, src)


MAX_ELEMENTS: Final[int] = (1 << 63) // 8 - 1
"""The most values one cache tensor may hold: its bytes (at most 8 per value) must fit
torch's int64 storage size (``KVCache`` refuses larger sizes naming them)."""

WINDOW_DTYPES: Final[tuple[torch.dtype, ...]] = (*FLOAT_DTYPES, torch.float64)
"""The dtypes a window may hold its values at (``KVCache(window_dtype=...)``): the compute
dtypes f16, bf16, f32 and f64."""


def check_sizes(batch: int, n_heads: int, head_dim: int, max_len: int) -> tuple[int, ...]:
    """``KVCache``'s sizes checked, as ints: each a positive Python or numpy integer
    (``_checks.as_int``), and together no more than ``MAX_ELEMENTS`` values per tensor;
    ``ValueError`` naming them otherwise (never torch's overflow at allocation)."""
    named = {"batch": batch, "n_heads": n_heads, "head_dim": head_dim, "max_len": max_len}
    sizes = []
    for name, value in named.items():
        count = as_int(value)  # a numpy integer reads as its value, as in KvFp8.recent
        if count is None or count <= 0:
            raise ValueError(f"KVCache {name} must be a positive int, got {value!r}")
        sizes.append(count)
    total = sizes[0] * sizes[1] * sizes[2] * sizes[3]
    if total > MAX_ELEMENTS:
        given = ", ".join(f"{k}={v}" for k, v in zip(named, sizes, strict=True))
        raise ValueError(
            f"KVCache {given} make {total} values per tensor, more than torch can address "
            f"(at most {MAX_ELEMENTS}); a smaller max_len (or batch) is accepted"
        )
    return tuple(sizes)


def check_window_dtype(value: object) -> torch.dtype | None:
    """``KVCache``'s ``window_dtype`` checked: ``None`` (the compute dtype), a ``DType`` or
    one of ``WINDOW_DTYPES``; anything else (an integer, bool or fp8 dtype, which would read
    0.7 back as 0 or 1, or a string) is a ``ValueError`` naming it and what is accepted."""
    if value is None:
        return None
    at = value.torch if isinstance(value, DType) else value
    if isinstance(at, torch.dtype) and at in WINDOW_DTYPES:
        return at
    raise ValueError(
        f"KVCache window_dtype={value!r} is not a dtype the window of recent positions can "
        f"hold values at; accepted: None (the compute dtype), a DType, or "
        f"{', '.join(str(d) for d in WINDOW_DTYPES)}"
    )


def window_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a window at ``dtype`` holds it: an inf or NaN entry as NaN (what its codes
    read back as, so a position reads the same in the window and after it), a finite one
    beyond ``dtype``'s range saturated to its finite max (the codes read it finite too; a
    plain cast to f16 would give inf)."""
    bad = ~torch.isfinite(x)
    top = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max > top:
        x = x.clamp(-top, top)
    return x.to(dtype).masked_fill(bad, float("nan"))


def window_slots(positions: torch.Tensor, slots: int) -> torch.Tensor:
    """The ring slot of each position (``p % slots``)."""
    return torch.remainder(positions, slots)


def splice_window(deq: torch.Tensor, ring: torch.Tensor, window_pos: torch.Tensor) -> torch.Tensor:
    """``deq`` (``(B, H, T, D)`` float32, positions ``0 .. T - 1``) with each position whose
    slot holds it (``window_pos[p % n] == p``) taken from ``ring`` (``(B, H, n, D)``,
    widened to float32, exact)."""
    t, n = deq.shape[2], ring.shape[2]
    pos = torch.arange(t, device=deq.device)
    slots = window_slots(pos, n)
    held = ring.index_select(2, slots).to(deq.dtype)
    inside = window_pos.index_select(0, slots) == pos
    return torch.where(inside.view(1, 1, t, 1), held, deq)


def static_steps(
    kv: KvFp8,
    steps: tuple[torch.Tensor, torch.Tensor] | None,
    n_heads: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked static steps, as the cache holds them (``held_steps``): ``(H,)``
    per_head or ``(1,)`` per_tensor, finite and positive, on ``device``."""
    if steps is None:
        raise ValueError(
            f"kv={kv} is a static scheme: the cache needs calibrated steps and none were given "
            f"(a step of 1.0 is never assumed). Calibrate the model "
            f"(computectx.nn.calibrate_kv(model, batches)), load a calibrated checkpoint, or "
            f"use kv={kv.format}/per_token_head, which needs no calibration"
        )
    want = (n_heads,) if kv.scaling == "per_head" else (1,)
    out: list[torch.Tensor] = []
    for name, s in zip(("key", "value"), steps, strict=True):
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != want:
            got = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"kv={kv} needs {name} steps of shape {want}, got {got}")
        wide = s.detach().to(device=device, dtype=torch.float32)
        bad = ~(torch.isfinite(wide) & (wide > 0))
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            at = f" of head {first}" if kv.scaling == "per_head" else ""
            count = int(bad.sum())
            more = f" ({count} of the {bad.numel()} refused)" if count > 1 else ""
            raise ValueError(
                f"kv={kv}: the {name} steps must be finite and positive; the {name} step{at} "
                f"is {fault(wide[first])}{more}"
            )
        out.append(held_steps(wide, kv.step).clone())
    return out[0], out[1]
