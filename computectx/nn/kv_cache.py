"""``KVCache``: one attention layer's keys and values, stored as ``ctx.kv`` says.

A ``kv`` in the lattice (``DType``) stores values at that dtype (``ctx.to_kv``, a plain
cast). An fp8 ``kv`` (``KvFp8``) stores codes plus steps at ``kv.step``'s format
(``computectx.formats.numerics.kv_quant`` quantizes; ``computectx.nn.kv_steps`` rounds the steps
up to their format); the layout is the one ``computectx.formats.ops.attention`` reads::

    k, v            (B, H, T_max, D)  float8_e4m3fn / float8_e5m2 codes
    k_step, v_step  (B, H, T_max) per_token_head (written with each position),
                    (H,) per_head or (1,) per_tensor (calibrated, fixed when the cache is built);
                    float32, bfloat16 or float8_e8m0fnu as kv.step says (e8m0 held as its
                    uint8 bytes and shown as a float8_e8m0fnu view, ``kv_steps``)
    k_recent,       (B, H, n, D) at the compute dtype, with kv.recent = N > 0 and
    v_recent        n = min(N, max_len): recently written positions also held unquantized
                    (a ring, ``kv_steps``)
    window_pos      (n,) int64: the position each ring slot holds (-1: none)

Bytes per token per layer (``kv_bytes_per_token``): ``2 * H * D * itemsize`` for a dtype
cache; ``2 * H * D`` codes plus, for ``per_token_head``, ``2 * H * s`` bytes of steps (``s`` = 4,
2 or 1 for f32, bf16, e8m0 steps) for fp8. The static schemes' steps are a fixed ``2 * H * s``
or ``2 * s`` bytes per layer, not per token, and the window a fixed ``kv_window_bytes`` per
layer and batch row (``min(N, max_len)`` positions). So at D = 32 an fp8 ``per_token_head``
cache takes 72, 68 or 66 bytes per head per token (f32, bf16, e8m0 steps) against 128 for
bf16: 0.5625, 0.53 and 0.516 of it.
"""

from __future__ import annotations

import warnings

import torch

from computectx._checks import shown_ints
from computectx.ctx import ComputeCtx
from computectx.dtypes import DType, PromotionError, dtype_of
from computectx.formats import Backend
from computectx.formats.seam import (
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
    check_sizes,
    check_window_dtype,
    copy_positions,
    held_steps,
    ones_steps,
    splice_window,
    static_steps,
    widen_steps,
    window_slots,
    window_values,
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
    kv: DType | KvFp8,
    n_heads: int,
    head_dim: int,
    dtype: torch.dtype | DType,
    *,
    max_len: int | None = None,
) -> int:
    """Bytes the window of an fp8 cache with ``kv.recent = N`` holds in one layer per batch
    row: ``2 * n_heads * n * head_dim`` values at ``dtype`` (the compute dtype), ``n = N``,
    or ``min(N, max_len)`` for a cache of ``max_len`` positions (it never holds more); 0 for
    a dtype cache or ``N = 0``. The slots' positions (``n`` int64) are not counted."""
    if not isinstance(kv, KvFp8):
        return 0
    size = dtype.torch.itemsize if isinstance(dtype, DType) else dtype.itemsize
    slots = kv.recent if max_len is None else min(kv.recent, max_len)
    return 2 * n_heads * slots * head_dim * size


def decode_backend(ctx: ComputeCtx, head_dim: int, backend: Backend | str | None) -> Backend:
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
            return Backend.REFERENCE
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

    Every mutating call (``append``, ``write``, ``reorder``) checks all its arguments before
    it changes anything: a refused call leaves every tensor and attribute as it was.

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
        backend: Backend | str | None = None,
        window_dtype: torch.dtype | DType | None = None,
    ) -> None:
        batch, n_heads, head_dim, max_len = check_sizes(batch, n_heads, head_dim, max_len)
        window_at = check_window_dtype(window_dtype)
        self.ctx = ctx
        self.kv: DType | KvFp8 = ctx.kv
        """The KV setting the cache was built for; attention under another refuses it."""
        self.max_len = max_len
        self.length = 0
        """Positions written through ``append`` (``write`` does not move it)."""
        shape = (batch, n_heads, max_len, head_dim)
        kv = ctx.kv
        self._k_held: torch.Tensor | None = None
        self._v_held: torch.Tensor | None = None
        self.backend: Backend | None = None
        self.recent = 0
        """Ring slots of the window: ``min(kv.recent, max_len)`` (0 for a dtype cache)."""
        self.k_recent: torch.Tensor | None = None
        self.v_recent: torch.Tensor | None = None
        self.window_pos = torch.full((0,), -1, dtype=torch.int64, device=ctx.device)
        """The position each ring slot holds, -1 for none (``kv_steps``)."""
        self.steps_tag: object = None
        """The calibration the static steps came from (``Attention.check_cache``)."""
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
                self._k_held, self._v_held = static_steps(kv, steps, n_heads, ctx.device)
            elif steps is not None:
                raise ValueError(
                    f"kv={kv} computes a step for every (token, head) as it is written; it "
                    f"takes no calibrated steps (those are for per_head and per_tensor)"
                )
            else:
                self._k_held = ones_steps(shape[:3], kv.step, ctx.device)
                self._v_held = ones_steps(shape[:3], kv.step, ctx.device)
            if kv.recent:
                # Never more slots than positions: a window as long as the cache holds all.
                self.recent = min(kv.recent, max_len)
                ring = (batch, n_heads, self.recent, head_dim)
                at = ctx.compute.torch if window_at is None else window_at
                self.k_recent = torch.zeros(ring, dtype=at, device=ctx.device)
                self.v_recent = torch.zeros(ring, dtype=at, device=ctx.device)
                self.window_pos = torch.full(
                    (self.recent,), -1, dtype=torch.int64, device=ctx.device
                )
        self.k = torch.zeros(shape, dtype=store, device=ctx.device)
        self.v = torch.zeros(shape, dtype=store, device=ctx.device)

    @property
    def k_step(self) -> torch.Tensor | None:
        """The key steps at their format's dtype (``kv.step_dtype``; a view of the held
        bytes for e8m0), or ``None`` for a dtype cache."""
        return _shown(self._k_held, self.kv)

    @property
    def v_step(self) -> torch.Tensor | None:
        """The value steps, as ``k_step``."""
        return _shown(self._v_held, self.kv)

    @property
    def held(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the cache holds (codes or values, steps as held, window, its slots'
        positions): what a refused call leaves unchanged and a compiled step keeps at fixed
        addresses."""
        parts = (self.k, self.v, self._k_held, self._v_held, self.k_recent, self.v_recent)
        return (*(t for t in parts if t is not None), self.window_pos)

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
        """Bytes the whole preallocated cache holds: keys, values, steps and the window
        (its values; not the ``recent`` int64 positions of its slots)."""
        parts = (self.k, self.v, self._k_held, self._v_held, self.k_recent, self.v_recent)
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
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"KVCache.{where}: {name} must be a tensor, got {type(x).__name__}")
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
        for name, x in (("k", k), ("v", v)):
            if x.device != self.k.device:
                raise ValueError(
                    f"KVCache.{where}: {name} is on {x.device}; the cache is on "
                    f"{self.k.device} (move it there first)"
                )
        return int(k.shape[2])

    def _encode(
        self, x: torch.Tensor, held: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Codes and, for per_token_head, the steps as held (e8m0 as bytes: no e8m0 tensor
        # is computed, so Inductor compiles the write; kv_steps).
        kv = self.kv
        if isinstance(kv, DType):
            return self.ctx.to_kv(x), None
        if kv.static:
            assert held is not None  # a static cache holds its steps from the start
            codes, _ = quantize_kv(x, kv.format, widen_steps(held))
            return codes, None
        codes, exact = quantize_kv(x, kv.format)
        if kv.step == "f32":
            return codes, exact
        # A compact step is the exact one rounded up; the codes are made with it.
        new = held_steps(exact, kv.step)
        codes, _ = quantize_kv(x, kv.format, widen_steps(new))
        return codes, new

    def _hold_recent(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        # The window keeps the last `recent` of the positions written (all of them when
        # fewer) and tags each slot with its position (kv_steps: why a tag makes rollbacks safe).
        n = self.recent
        if self.k_recent is None or self.v_recent is None:
            return
        if positions.shape[0] > n:
            k, v, positions = k[:, :, -n:], v[:, :, -n:], positions[-n:]
        slots = window_slots(positions, n)
        self.k_recent.index_copy_(2, slots, window_values(k, self.k_recent.dtype))
        self.v_recent.index_copy_(2, slots, window_values(v, self.v_recent.dtype))
        self.window_pos.index_copy_(0, slots, positions)

    def _store(self, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
        # Everything is checked: encode both, then write codes, steps and window.
        encoded = [self._encode(x, held) for x, held in ((k, self._k_held), (v, self._v_held))]
        for store, held, (codes, new) in zip(
            (self.k, self.v), (self._k_held, self._v_held), encoded, strict=True
        ):
            copy_positions(store, index, codes)
            if new is not None and held is not None:
                copy_positions(held, index, new)
        if self.recent:
            self._hold_recent(k, v, index)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``(batch, n_heads, T, head_dim)``) after the cached positions and
        move ``length`` past them; ``read()`` then returns every position so far. A dtype
        cache casts them with ``ctx.to_kv`` (the cache-append boundary); an fp8 cache
        quantizes them. A refused append (too many positions, bad shapes, dtypes or
        devices) changes nothing."""
        t = self._check_new(k, v, "append")
        cap = self.max_len
        if self.length + t > cap:
            raise ValueError(
                f"KVCache.append: {t} new position(s) after {self.length} cached exceed "
                f"max_len={cap}; at most {cap - self.length} more fit"
            )
        end = self.length + t
        self._store(k, v, torch.arange(self.length, end, device=self.k.device))
        self.length = end

    def write(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store ``k``/``v`` (``(batch, n_heads, T, head_dim)``) at positions ``pos ..
        pos + T - 1`` (``pos`` a 0-d int64 tensor on the cache's device, the same for every
        row) and leave ``length`` alone: shapes are static, so a compiled decode step does
        not recompile as ``pos`` moves. Writing an earlier position again (a rollback) is
        allowed; ``read`` then returns the last values written at each position.

        Everything is checked before anything is written (``TypeError``/``ValueError``
        naming the argument; a refused write changes nothing): types, shapes, dtypes,
        devices, and in eager mode the range ``0 <= pos`` and ``pos + T <= max_len``, by
        torch's own bounds check of a gather (no host read unless it fails, so a decode
        step stays free of host reads; on CUDA a failing check is torch's device-side
        assert). Under ``torch.compile`` nothing checks a value: a compiled step trusts its
        caller to keep ``pos`` in range, as ``ByteLM.decode_step``'s eager checks and
        ``generate`` do."""
        t = self._check_new(k, v, "write")
        if not isinstance(pos, torch.Tensor):
            raise TypeError(
                f"KVCache.write takes pos as a 0-d int64 tensor, got {type(pos).__name__}"
            )
        if pos.dim() != 0 or pos.dtype != torch.int64:
            raise ValueError(
                f"KVCache.write takes pos as a 0-d int64 tensor, got {pos.dtype} {tuple(pos.shape)}"
            )
        if pos.device != self.k.device:
            raise ValueError(
                f"KVCache.write: pos is on {pos.device}; the cache is on {self.k.device}"
            )
        index = pos + torch.arange(t, device=pos.device)
        if t > self.max_len:
            raise ValueError(
                f"KVCache.write: {t} new positions do not fit in max_len={self.max_len}"
            )
        if not torch.compiler.is_compiling():
            try:
                # A gather (of one byte expanded) raises on pos or pos + T outside
                # [0, max_len], T = 0 included, and reads nothing on the host otherwise.
                one = torch.zeros((), dtype=torch.uint8, device=pos.device)
                one.expand(self.max_len + 1).index_select(0, torch.stack([pos, pos + t]))
            except IndexError:
                at = int(pos)
                raise ValueError(
                    f"KVCache.write: positions {at} .. {at + t - 1} (pos={at}, T={t}) do not "
                    f"fit in max_len={self.max_len}; accepted: 0 <= pos <= {self.max_len - t}"
                ) from None
        self._store(k, v, index)

    def read(
        self, end: int | None = None, *, window: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. end - 1`` (default ``length``): views at
        ``kv`` for a dtype cache; float32 copies dequantized with their steps for fp8, the
        positions the window holds (``recent``) taken unquantized from it (with
        ``window=False``: every position from its codes, as it reads once it leaves the
        window).

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
        if self._k_held is None or self._v_held is None:
            return k, v
        ks, vs = self._k_held, self._v_held
        if ks.dim() == 3:
            ks, vs = ks[:, :, :stop], vs[:, :, :stop]
        kf, vf = dequantize_kv(k, widen_steps(ks)), dequantize_kv(v, widen_steps(vs))
        if self.k_recent is None or self.v_recent is None or not window:
            return kf, vf
        return (
            splice_window(kf, self.k_recent, self.window_pos),
            splice_window(vf, self.v_recent, self.window_pos),
        )

    def windowed(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (keys or values at a compute dtype) as this cache's window holds it, widened
        to float32: at the window's dtype, an inf or NaN entry as NaN, a finite one beyond
        the window dtype's range at its finite max. A cache with no window: ``ValueError``."""
        if self.k_recent is None:
            raise ValueError(f"this kv={self.kv} cache has no window of recent positions")
        return window_values(x, self.k_recent.dtype).to(torch.float32)

    def reset(self) -> None:
        """Empty the cache in place (the same buffers): codes and window zero, per-token steps
        1.0, no slot holding a position, ``length`` 0."""
        for t in (self.k, self.v, self.k_recent, self.v_recent):
            if t is not None:
                t.view(torch.uint8).zero_()
        for held in (self._k_held, self._v_held):
            if held is not None and held.dim() == 3 and self.fp8 is not None:
                held.copy_(ones_steps(tuple(held.shape), self.fp8.step, held.device))
        self.length = 0
        self.window_pos.fill_(-1)

    def reorder(self, rows: torch.Tensor) -> None:
        """Take batch rows ``rows`` (int64 or int32 ``(B,)`` on the cache's device, each in
        ``[0, B)``), in place (beam search): codes or values, per-token steps and the window
        (static steps are shared by every row). Checked before anything moves (the range by
        torch's bounds check of the first gather); a refused call changes nothing."""
        b = self.k.shape[0]
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"KVCache.reorder takes rows as a tensor, got {type(rows).__name__}")
        wrong = rows.dtype not in (torch.int64, torch.int32) or tuple(rows.shape) != (b,)
        if wrong or rows.device != self.k.device:
            raise ValueError(
                f"KVCache.reorder takes rows as int64 or int32 ({b},) on {self.k.device} (one "
                f"source row per batch row), got {rows.dtype} {tuple(rows.shape)} on {rows.device}"
            )
        parts = [self.k, self.v, self.k_recent, self.v_recent]
        parts += [s for s in (self._k_held, self._v_held) if s is not None and s.dim() == 3]
        raws = [t.view(torch.uint8) if t.element_size() == 1 else t for t in parts if t is not None]
        try:
            taken = raws[0].index_select(0, rows)  # raises on a row outside [0, B), writes nothing
        except IndexError:
            out = ((rows < 0) | (rows >= b)).nonzero().flatten()
            raise ValueError(
                f"KVCache.reorder: rows {shown_ints(rows)} hold {out.numel()} row(s) outside "
                f"[0, {b}) (this cache's batch rows): rows[{int(out[0])}] = {int(rows[out[0]])}"
            ) from None
        raws[0].copy_(taken)
        for raw in raws[1:]:
            raw.copy_(raw.index_select(0, rows))


def _shown(held: torch.Tensor | None, kv: DType | KvFp8) -> torch.Tensor | None:
    # e8m0 steps are held as bytes and shown at their own dtype (a view: the same bytes).
    if held is not None and isinstance(kv, KvFp8) and kv.step == "e8m0":
        return held.view(torch.float8_e8m0fnu)
    return held
