"""``KVCache``: one attention layer's keys and values, stored as ``ctx.kv`` says.

A ``kv`` in the lattice (``DType``) stores values at that dtype (``ctx.to_kv``, a plain
cast). An fp8 ``kv`` (``KvFp8``) stores codes plus steps at ``kv.step``'s format
(``computectx.fp8.numerics.kv_quant`` quantizes; ``computectx.nn.kv_steps`` rounds the steps
up to their format); the layout is the one ``computectx.fp8.serving.decode_attention`` reads::

    k, v            (B, H, T_max, D)  float8_e4m3fn / float8_e5m2 codes
    k_step, v_step  (B, H, T_max) per_token_head (written with each position),
                    (H,) per_head or (1,) per_tensor (calibrated, fixed when the cache is built);
                    float32, bfloat16 or float8_e8m0fnu as kv.step says
    k_recent,       (B, H, N, D) at the compute dtype, with kv.recent = N > 0: the last N
    v_recent        positions written, also held unquantized (a ring, ``kv_steps``)

Bytes per token per layer (``kv_bytes_per_token``): ``2 * H * D * itemsize`` for a dtype
cache; ``2 * H * D`` codes plus, for ``per_token_head``, ``2 * H * s`` bytes of steps (``s`` = 4,
2 or 1 for f32, bf16, e8m0 steps) for fp8. The static schemes' steps are a fixed ``2 * H * s``
or ``2 * s`` bytes per layer, not per token, and the window a fixed ``kv_window_bytes`` per
layer and batch row. So at D = 32 an fp8 ``per_token_head`` cache takes 72, 68 or 66 bytes per
head per token (f32, bf16, e8m0 steps) against 128 for bf16: 0.5625, 0.53 and 0.516 of it.
"""

from __future__ import annotations

import warnings

import torch

from computectx.ctx import ComputeCtx
from computectx.dtypes import DType, PromotionError, dtype_of
from computectx.fp8 import Fp8Backend
from computectx.fp8.seam import (
    KERNEL_HEAD_DIMS,
    check_backend,
    check_kernel_head_dim,
    default_backend,
    dequantize_kv,
    parse_backend,
    quantize_kv,
    uses_kernels,
)
from computectx.kv_policy import KvFp8
from computectx.nn.kv_steps import (
    copy_positions,
    ones_steps,
    splice_window,
    stored_steps,
    window_slots,
)

__all__ = [
    "DecodeKernelFallbackWarning",
    "KVCache",
    "decode_backend",
    "kv_bytes_per_token",
    "kv_window_bytes",
]


class DecodeKernelFallbackWarning(UserWarning):
    """``decode_backend`` chose the reference twin where the device's default backend runs
    the Triton decode kernel, because the kernel cannot serve the head dim (filter or catch
    it by this class). Issued once per (device, head dim) in a process."""


_WARNED_FALLBACKS: set[tuple[str, int]] = set()


def kv_bytes_per_token(kv: DType | KvFp8, n_heads: int, head_dim: int) -> int:
    """Bytes one more cached position costs in one layer: keys and values of ``n_heads`` heads
    of ``head_dim``, plus their per-token steps (``kv.step_bytes`` each) for an fp8
    ``per_token_head`` cache. A window of recent positions is a fixed cost on top
    (``kv_window_bytes``), not a cost per position."""
    if isinstance(kv, KvFp8):
        steps = 2 * n_heads * kv.step_bytes if kv.scaling == "per_token_head" else 0
        return 2 * n_heads * head_dim * kv.format.torch.itemsize + steps
    return 2 * n_heads * head_dim * kv.torch.itemsize


def kv_window_bytes(
    kv: DType | KvFp8, n_heads: int, head_dim: int, dtype: torch.dtype | DType
) -> int:
    """Bytes the window of an fp8 cache with ``kv.recent = N`` holds in one layer per batch
    row: ``2 * n_heads * N * head_dim`` values at ``dtype`` (the compute dtype); 0 for a dtype
    cache or ``N = 0``."""
    if not isinstance(kv, KvFp8):
        return 0
    size = dtype.torch.itemsize if isinstance(dtype, DType) else dtype.itemsize
    return 2 * n_heads * kv.recent * head_dim * size


def decode_backend(ctx: ComputeCtx, head_dim: int, backend: Fp8Backend | str | None) -> Fp8Backend:
    """The backend that reads an fp8 cache in a decode step.

    ``None``: ``default_backend(ctx.device)``, except that a head dim the Triton kernel cannot
    serve (``KERNEL_HEAD_DIMS``) falls back to the reference twin, with a
    ``DecodeKernelFallbackWarning`` (once per device and head dim). A backend asked for by
    name or member must run on ``ctx.device``, and a kernel backend must serve ``head_dim``:
    ``ValueError`` naming the head dim otherwise (the reference backend serves any).
    """
    probe = torch.empty(0, device=ctx.device)
    if backend is None:
        chosen = default_backend(ctx.device)
        if uses_kernels(chosen, probe) and head_dim not in KERNEL_HEAD_DIMS:
            key = (str(ctx.device), head_dim)
            if key not in _WARNED_FALLBACKS:
                _WARNED_FALLBACKS.add(key)
                warnings.warn(
                    f"the fp8 KV cache on {ctx.device} is read by the reference decode "
                    f"attention (pure torch), not the {chosen} backend's Triton kernel: the "
                    f"kernel cannot serve head dim D={head_dim} (it takes multiples of 16 up "
                    f"to 256). Pass backend='reference' to choose it explicitly",
                    DecodeKernelFallbackWarning,
                    stacklevel=3,
                )
            return Fp8Backend.REFERENCE
        return chosen
    chosen = check_backend(parse_backend(backend), probe)
    if uses_kernels(chosen, probe):
        check_kernel_head_dim(head_dim)
    return chosen


class KVCache:
    """Keys and values of one attention layer for a batch, preallocated for ``max_len``
    positions and stored as ``ctx.kv`` says (the module docstring gives the layout).

    ``append`` writes new positions after ``length`` (the eager path: ``length`` is a python
    int); ``write`` writes at a position tensor and leaves ``length`` alone (the static-shape
    decode step, ``ByteLM.decode_step``). ``read`` returns the cached keys and values as
    attention sees them: at ``kv`` for a dtype, dequantized to float32 for fp8.

    An fp8 cache of a static scheme (``per_head``, ``per_tensor``) takes its calibrated
    ``steps`` (keys, values) when it is built (``Attention.new_cache`` passes the layer's);
    without them it is refused, never run with a step of 1.0. ``backend`` picks how decode
    steps read an fp8 cache (``decode_backend``); it is ``None`` for a dtype cache.
    """

    def __init__(
        self,
        ctx: ComputeCtx,
        batch: int,
        n_heads: int,
        head_dim: int,
        max_len: int,
        *,
        steps: tuple[torch.Tensor, torch.Tensor] | None = None,
        backend: Fp8Backend | str | None = None,
        window_dtype: torch.dtype | None = None,
    ) -> None:
        for name, value in (
            ("batch", batch),
            ("n_heads", n_heads),
            ("head_dim", head_dim),
            ("max_len", max_len),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCache {name} must be a positive int, got {value!r}")
        self.ctx = ctx
        self.kv: DType | KvFp8 = ctx.kv
        """The KV setting the cache was built for; attention under another refuses it."""
        self.max_len = max_len
        self.length = 0
        """Positions written through ``append`` (``write`` does not move it)."""
        shape = (batch, n_heads, max_len, head_dim)
        kv = ctx.kv
        self.k_step: torch.Tensor | None = None
        self.v_step: torch.Tensor | None = None
        self.backend: Fp8Backend | None = None
        self.recent = 0
        """Positions held unquantized too (``kv.recent``; 0 for a dtype cache)."""
        self.k_recent: torch.Tensor | None = None
        self.v_recent: torch.Tensor | None = None
        self.window_end = torch.zeros((), dtype=torch.int64, device=ctx.device)
        """One past the last position written (a 0-d tensor; the window ends there)."""
        if isinstance(kv, DType):
            if steps is not None or backend is not None or window_dtype is not None:
                raise ValueError(
                    f"a kv={kv} cache stores values, not fp8 codes: it takes no steps and no "
                    f"decode backend, nor a window dtype (those are for an fp8 kv such as "
                    f"'e4m3/per_token_head')"
                )
            store = kv.torch
        else:
            store = kv.format.torch
            self.backend = decode_backend(ctx, head_dim, backend)
            if kv.static:
                self.k_step, self.v_step = _static_steps(kv, steps, n_heads, ctx.device)
            elif steps is not None:
                raise ValueError(
                    f"kv={kv} computes a step for every (token, head) as it is written; it "
                    f"takes no calibrated steps (those are for per_head and per_tensor)"
                )
            else:
                self.k_step = ones_steps(shape[:3], kv.step, ctx.device)
                self.v_step = ones_steps(shape[:3], kv.step, ctx.device)
            if kv.recent:
                self.recent = kv.recent
                ring = (batch, n_heads, kv.recent, head_dim)
                at = ctx.compute.torch if window_dtype is None else window_dtype
                self.k_recent = torch.zeros(ring, dtype=at, device=ctx.device)
                self.v_recent = torch.zeros(ring, dtype=at, device=ctx.device)
        self.k = torch.zeros(shape, dtype=store, device=ctx.device)
        self.v = torch.zeros(shape, dtype=store, device=ctx.device)

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype: ``ctx.kv``'s dtype, or the fp8 code dtype."""
        return self.k.dtype

    @property
    def fp8(self) -> KvFp8 | None:
        """The fp8 setting of the cache, or ``None`` for a dtype cache."""
        return self.kv if isinstance(self.kv, KvFp8) else None

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position takes in this layer (``kv_bytes_per_token``)."""
        _, h, _, d = self.k.shape
        return kv_bytes_per_token(self.kv, h, d)

    @property
    def nbytes(self) -> int:
        """Bytes the whole preallocated cache holds: keys, values, steps and the window."""
        parts = (self.k, self.v, self.k_step, self.v_step, self.k_recent, self.v_recent)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def check_read_under(self, ctx: ComputeCtx) -> None:
        """``ValueError`` unless this cache was built for ``ctx.kv``: a cache of one policy read
        under another would reinterpret its storage (codes as values, or the wrong steps)."""
        if ctx.kv != self.kv:
            raise ValueError(
                f"this KV cache was built for kv={self.kv} but is read under kv={ctx.kv}; "
                f"build the caches from the model that reads them (model.new_caches(...))"
            )

    def _check_new(self, k: torch.Tensor, v: torch.Tensor, where: str) -> int:
        # One rule for every cache, before anything is written: keys and values enter at a
        # compute dtype (f16, bf16, f32, f64). A dtype cache casts them (ctx.to_kv) and an
        # fp8 cache quantizes them; either way an integer, bool, complex or raw fp8 tensor is
        # a PromotionError (dtypes.dtype_of, the check cast_if makes), never cast silently.
        for name, x in (("k", k), ("v", v)):
            try:
                dtype_of(x)
            except PromotionError as e:
                raise PromotionError(f"KVCache.{where}: {name}: {e}") from None
        b, h, _, d = self.k.shape
        if k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
            raise ValueError(
                f"KVCache.{where}: got k {tuple(k.shape)} and v {tuple(v.shape)}; expected "
                f"both ({b}, {h}, T, {d})"
            )
        return int(k.shape[2])

    def _encode(
        self, x: torch.Tensor, step: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kv = self.kv
        if isinstance(kv, DType):
            return self.ctx.to_kv(x), None
        if kv.static:
            assert step is not None  # a static cache holds its steps from the start
            codes, _ = quantize_kv(x, kv.format, step.to(torch.float32))
            return codes, None
        codes, exact = quantize_kv(x, kv.format)
        if kv.step == "f32":
            return codes, exact
        # A compact step is the exact one rounded up; the codes are made with it.
        stored = stored_steps(exact, kv.step)
        codes, _ = quantize_kv(x, kv.format, stored.to(torch.float32))
        return codes, stored

    def _hold_recent(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        # The window keeps the last `recent` of the positions written (all of them when fewer).
        n = self.recent
        if self.k_recent is None or self.v_recent is None:
            return
        if positions.shape[0] > n:
            k, v, positions = k[:, :, -n:], v[:, :, -n:], positions[-n:]
        slots = window_slots(positions, n)
        self.k_recent.index_copy_(2, slots, k.to(self.k_recent.dtype))
        self.v_recent.index_copy_(2, slots, v.to(self.v_recent.dtype))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``(batch, n_heads, T, head_dim)``) after the cached positions and
        move ``length`` past them; ``read()`` then returns every position so far. A dtype
        cache casts them with ``ctx.to_kv`` (the cache-append boundary); an fp8 cache
        quantizes them. A refused append (too many positions, bad shapes) changes nothing."""
        t = self._check_new(k, v, "append")
        cap = self.max_len
        if self.length + t > cap:
            raise ValueError(
                f"KVCache.append: {t} new position(s) after {self.length} cached exceed "
                f"max_len={cap}; at most {cap - self.length} more fit"
            )
        end = self.length + t
        for store, step, x in ((self.k, self.k_step, k), (self.v, self.v_step, v)):
            codes, new_step = self._encode(x, step)
            store[:, :, self.length : end] = codes
            if new_step is not None and step is not None:
                step[:, :, self.length : end] = new_step
        if self.recent:
            self._hold_recent(k, v, torch.arange(self.length, end, device=self.k.device))
            self.window_end.fill_(end)
        self.length = end

    def write(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store ``k``/``v`` (``(batch, n_heads, T, head_dim)``) at positions ``pos ..
        pos + T - 1`` (``pos`` a 0-d int64 tensor, the same for every row), with no host
        read and no change to ``length``: shapes are static, so a compiled decode step does
        not recompile as ``pos`` moves. Positions must lie within ``max_len`` (an index
        beyond it raises in eager mode)."""
        t = self._check_new(k, v, "write")
        if pos.dim() != 0 or pos.dtype != torch.int64:
            raise ValueError(
                f"KVCache.write takes pos as a 0-d int64 tensor, got {pos.dtype} {tuple(pos.shape)}"
            )
        index = pos + torch.arange(t, device=pos.device)
        for store, step, x in ((self.k, self.k_step, k), (self.v, self.v_step, v)):
            codes, new_step = self._encode(x, step)
            copy_positions(store, index, codes)
            if new_step is not None and step is not None:
                copy_positions(step, index, new_step)
        if self.recent:
            self._hold_recent(k, v, index)
            self.window_end.copy_(pos + t)

    def read(self, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. end - 1`` (default ``length``): views at
        ``kv`` for a dtype cache; float32 copies dequantized with their steps for fp8, the
        positions in the window (``recent``) taken unquantized from it.

        ``end`` is an int in ``[0, max_len]`` (``ValueError`` naming it otherwise); positions
        from ``length`` on hold what ``write`` stored there, zeros where nothing was."""
        if end is not None and (
            isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= self.max_len
        ):
            raise ValueError(
                f"KVCache.read: end={end!r} is not a position count of this cache; accepted: "
                f"an int with 0 <= end <= {self.max_len} (max_len), or None for length="
                f"{self.length}"
            )
        stop = self.length if end is None else end
        k, v = self.k[:, :, :stop], self.v[:, :, :stop]
        if self.k_step is None or self.v_step is None:
            return k, v
        ks, vs = self.k_step, self.v_step
        if ks.dim() == 3:
            ks, vs = ks[:, :, :stop], vs[:, :, :stop]
        kf, vf = dequantize_kv(k, ks), dequantize_kv(v, vs)
        if self.k_recent is None or self.v_recent is None:
            return kf, vf
        return (
            splice_window(kf, self.k_recent, self.window_end, self.recent),
            splice_window(vf, self.v_recent, self.window_end, self.recent),
        )

    def reset(self) -> None:
        """Empty the cache in place (the same buffers): codes and window zero, per-token steps
        1.0, ``length`` and ``window_end`` 0."""
        for t in (self.k, self.v, self.k_recent, self.v_recent):
            if t is not None:
                t.view(torch.uint8).zero_()
        for step in (self.k_step, self.v_step):
            if step is not None and step.dim() == 3 and self.fp8 is not None:
                step.copy_(ones_steps(tuple(step.shape), self.fp8.step, step.device))
        self.length = 0
        self.window_end.zero_()

    def reorder(self, rows: torch.Tensor) -> None:
        """Take batch rows ``rows`` (int64 ``(B,)``), in place (beam search): codes or values,
        per-token steps and the window (static steps are shared by every row)."""
        parts = [self.k, self.v, self.k_recent, self.v_recent]
        parts += [s for s in (self.k_step, self.v_step) if s is not None and s.dim() == 3]
        for t in parts:
            if t is not None:
                raw = t.view(torch.uint8) if t.element_size() == 1 else t
                raw.copy_(raw.index_select(0, rows))


def _static_steps(
    kv: KvFp8,
    steps: tuple[torch.Tensor, torch.Tensor] | None,
    n_heads: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked static steps: float32, ``(H,)`` per_head or ``(1,)`` per_tensor, finite and
    positive, on ``device``."""
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
        if not bool((torch.isfinite(wide) & (wide > 0)).all()):
            raise ValueError(
                f"kv={kv}: the {name} steps must be finite and positive, got {wide.tolist()}"
            )
        out.append(stored_steps(wide, kv.step).clone())
    return out[0], out[1]
