"""Causal self-attention computing in ``ctx.compute`` with a KV cache stored as ``ctx.kv`` says."""

from __future__ import annotations

import functools
import math
import warnings
import weakref

import torch
from torch import nn

from computectx._checks import fault
from computectx.ctx import BuiltUnder, ComputeCtx
from computectx.dtypes import FLOAT_DTYPES, dtype_of, promote
from computectx.formats import Backend
from computectx.formats.seam import decode_attention, static_kv_steps
from computectx.kv_policy import KvFp8
from computectx.nn.gemm import Gemm, GemmPath
from computectx.nn.kv_cache import KVCache
from computectx.nn.kv_steps import held_steps, widen_steps
from computectx.nn.params import apply_recipe, param_dtype
from computectx.nn.precise import softmax
from computectx.nn.rope import RotaryEmbedding
from computectx.saved import saved_call, tagged

__all__ = ["Attention", "Float32MatmulPrecisionWarning", "KVCache"]


class Float32MatmulPrecisionWarning(UserWarning):
    """An fp8 KV cache's prefill ran on a CUDA device where float32 matmuls may use TF32
    (``torch.set_float32_matmul_precision`` not ``"highest"``, or
    ``torch.backends.cuda.matmul.allow_tf32``): its scores and weighted sum then round
    their operands to 10 mantissa bits, and the float32 reading of the cache documented in
    docs/serving.md does not hold. Issued once per process."""


_TF32_WARNED: list[bool] = []


def _check_float32_matmul(device: torch.device) -> None:
    """Warn (``Float32MatmulPrecisionWarning``, once per process) when float32 matmuls on
    ``device`` may run in TF32: a CUDA device with ``torch.get_float32_matmul_precision()``
    other than ``"highest"``. A no-op elsewhere and while ``torch.compile`` traces."""
    if device.type != "cuda" or _TF32_WARNED or torch.compiler.is_compiling():
        return
    precision = torch.get_float32_matmul_precision()
    if precision == "highest":
        return
    _TF32_WARNED.append(True)
    warnings.warn(
        f"float32 matmuls on {device} may run in TF32 (float32 matmul precision "
        f"{precision!r}): the fp8 KV cache's prefill attention (scores and weighted sum) "
        f"then rounds its operands to 10 mantissa bits instead of reading the cache in "
        f"float32. Call torch.set_float32_matmul_precision('highest') for the documented "
        f"accuracy (decode steps are unaffected: they use no matmul)",
        Float32MatmulPrecisionWarning,
        stacklevel=3,
    )


def _attention_core(
    gemm: Gemm,
    head_dim: int,
    work: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """``Attention._attend`` under ``keep``, op for op (the softmax lifted to ``work`` as
    ``ctx.precise`` lifts it), for ``saved_call`` to run again in the backward: the
    recomputed probabilities are the forward's bit for bit."""
    scores = _matmul(gemm, q, k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
    scores = scores.masked_fill(~visible, float("-inf"))
    wide = scores if scores.dtype == work else scores.to(work)
    probs = torch.softmax(wide, dim=-1)
    return _matmul(gemm, probs if probs.dtype == scores.dtype else probs.to(scores.dtype), v)


def _matmul(gemm: Gemm, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # gemm.matmul in ops torch.func differentiates: compiled, saved_call's backward is a
    # torch.func.vjp, which gets the upcast path's autograd.Function wrong (torch 2.13: its
    # gradients came out unrelated to eager's). The same float32 GEMM rounded once.
    if gemm.path is not GemmPath.UPCAST:
        return gemm.matmul(a, b)
    with torch.autocast(a.device.type, enabled=False):
        wide = a.to(gemm.dtype).to(torch.float32) @ b.to(gemm.dtype).to(torch.float32)
    return wide.to(gemm.dtype)


class Attention(BuiltUnder, nn.Module):
    """Multi-head causal self-attention with RoPE.

    Projections (``QuantizedLinear`` when ``ctx.recipe`` is set, else ``nn.Linear``), the scores and
    the weighted sum are GEMMs at ``ctx.compute`` with float32 accumulation (``Gemm``: torch's
    kernel, or its float32 emulation on CPUs without a half-precision one), inside
    ``ctx.autocast()``; RoPE and the softmax go through ``ctx.precise``. With a ``KVCache``,
    new keys/values are stored as ``ctx.kv`` says and queries take positions after the cached
    ones; every key and value attention reads then comes out of the cache.

    With an fp8 ``kv`` (``KvFp8``) the cache is read in float32: scores, softmax and the
    weighted sum of dequantized keys and values run in float32 (never at the compute dtype).
    One query position (a decode step) runs ``computectx.formats.ops.attention``, which
    dequantizes block by block with float32 accumulation within and across blocks; several
    (a prefill) dequantize the cached prefix to float32 and run the causal attention there.
    The decode step uses no matmul; the prefill's are float32 matmuls, which a CUDA device
    runs in TF32 unless ``torch.get_float32_matmul_precision()`` is ``"highest"`` (the
    default): there the prefill warns once (``Float32MatmulPrecisionWarning``). A cache with a
    window of recent positions (``KvFp8.recent``) is read in float32 in every step:
    ``KVCache.read`` splices the window's unquantized positions into the dequantized codes
    and one query attends over them (``decode_attention`` reads codes only); a prefill over
    such a cache reads as those steps would, each query the window as of its own position.

    Every cache is checked before anything is written (``check_cache``): its ``kv``, heads,
    head dim and, for a static scheme, that its steps are this layer's calibration.

    The buffer ``kv_amax`` (``(2, H)`` float32: row 0 keys, row 1 values) holds each head's
    calibrated amax (``computectx.nn.calibrate_kv``), from which the static fp8 schemes take
    their steps; all zeros means not calibrated. It is saved and loaded with the weights and
    checked on load (``check_state_tensors``); a checkpoint without it loads it as zeros
    (``default_state_tensors``).
    """

    kv_amax: torch.Tensor

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
        apply_recipe(self, ctx)
        self.gemm = Gemm.for_ctx(ctx)
        self.register_buffer("kv_amax", torch.zeros(2, n_heads, device=ctx.device))
        self.kv_observed: torch.Tensor | None = None
        """While ``calibrate_kv`` runs: the running per-head amax of keys and values."""

    # ----- calibration state ------------------------------------------------------------------

    @property
    def kv_calibrated(self) -> bool:
        """Whether ``kv_amax`` holds a calibration (it is all zeros until one is made)."""
        return bool((self.kv_amax != 0).any())

    def kv_steps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The static key and value steps of ``ctx.kv`` (``per_head`` or ``per_tensor``) from
        ``kv_amax``; ``ValueError`` when the layer is not calibrated, or when ``kv_amax``
        holds an entry that is not finite and positive (set by hand, or loaded around
        ``load_weights``' check)."""
        kv = self.ctx.kv
        if not isinstance(kv, KvFp8) or not kv.static:
            raise ValueError(f"kv={kv} has no static steps (only fp8 per_head and per_tensor do)")
        if not self.kv_calibrated:
            raise ValueError(
                f"kv={kv} is a static scheme and this attention layer has no calibrated KV "
                f"amax (a step of 1.0 is never assumed): run computectx.nn.calibrate_kv(model, "
                f"batches), or load a calibrated checkpoint, before building caches; or use "
                f"kv={kv.format}/per_token_head, which needs no calibration"
            )
        return static_kv_steps(self.kv_amax, kv)

    def check_state_tensors(self, tensors: dict[str, torch.Tensor], *, prefix: str = "") -> None:
        """``load_weights``' check of this layer's tensors before anything is replaced:
        ``kv_amax`` must be finite, and all zeros (not calibrated) or all positive. The
        ``ValueError`` names the tensor by its full key, ``prefix`` (this layer's key prefix
        in the model, ``'blocks.1.attn.'``) then ``kv_amax``."""
        amax = tensors.get("kv_amax")
        if amax is None:
            return
        wide = amax.to(torch.float32)
        finite = bool(torch.isfinite(wide).all())
        if not finite or not (bool((wide == 0).all()) or bool((wide > 0).all())):
            raise ValueError(
                f"{prefix}kv_amax must be finite and either all zero (not calibrated) or all "
                f"positive (a calibration); {_amax_fault(wide)}"
            )

    def default_state_tensors(self) -> dict[str, torch.Tensor]:
        """What ``load_weights`` loads for state a checkpoint lacks: a checkpoint written
        before ``kv_amax`` existed loads as not calibrated (zeros), never keeping a
        calibration made for other weights."""
        return {"kv_amax": torch.zeros_like(self.kv_amax)}

    def observe_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fold the per-head amax of ``k`` and ``v`` (``(B, H, T, D)``) into ``kv_observed``
        (a no-op unless ``calibrate_kv`` armed it)."""
        seen = self.kv_observed
        if seen is None:
            return
        now = torch.stack([t.detach().abs().to(torch.float32).amax(dim=(0, 2, 3)) for t in (k, v)])
        self.kv_observed = torch.maximum(seen, now)

    # ----- caches -----------------------------------------------------------------------------

    def new_cache(
        self, batch: int, max_len: int | None = None, *, backend: Backend | str | None = None
    ) -> KVCache:
        """An empty cache for this layer (``max_len`` defaults to the RoPE table length; any
        other value must be a positive int: ``ValueError`` otherwise, 0 included).

        For a static fp8 ``kv`` it carries this layer's calibrated steps (``kv_steps``: an
        error when there are none). ``backend`` picks how an fp8 cache is read in decode
        steps (``computectx.nn.kv_cache.decode_backend``).
        """
        kv = self.ctx.kv
        steps = self.kv_steps() if isinstance(kv, KvFp8) and kv.static else None
        cache = KVCache(
            self.ctx,
            batch,
            self.n_heads,
            self.head_dim,
            self.max_len if max_len is None else max_len,
            steps=steps,
            backend=backend,
        )
        if steps is not None:
            cache.steps_tag = self._calibration_tag()
        return cache

    def _calibration_tag(self) -> tuple[weakref.ref[torch.Tensor], int] | None:
        # This layer's kv_amax and its version counter: the same tensor, unchanged since
        # (calibrate_kv and load_state_dict write it in place, which moves the counter).
        amax = self.kv_amax
        try:
            return weakref.ref(amax), amax._version
        except RuntimeError:  # an inference tensor keeps no version counter
            return None

    def check_cache(self, cache: KVCache, batch: int | None = None, new: int | None = None) -> None:
        """Refuse a cache this layer cannot read or write, before anything is written
        (``ByteLM`` checks every layer's cache this way before any layer writes): a
        ``ValueError`` when it was built for another ``kv`` (``KVCache.check_read_under``),
        another number of heads, head dim or (``batch`` given) batch, when ``new`` more
        positions would not fit after its ``length``, or, for a static fp8 ``kv``, when it
        holds steps other than this layer's calibration gives now (a cache built by another
        model, or before a new calibration or load: its codes were made with other steps).

        The steps are compared by a tag the cache got from ``new_cache`` (no host read while
        the layer's ``kv_amax`` is the same tensor, unchanged), by value otherwise (one host
        read; a match tags the cache). Under ``torch.compile`` the steps are not compared: a
        compiled step trusts its caller, as with ``pos``."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"expected a KVCache, got {type(cache).__name__}")
        cache.check_read_under(self.ctx)
        b, h, _, d = cache.k.shape
        if (h, d) != (self.n_heads, self.head_dim) or (batch is not None and b != batch):
            want = f"batch {batch}, " if batch is not None else ""
            raise ValueError(
                f"this KV cache holds batch {b}, {h} heads of dim {d}; this attention layer "
                f"reads {want}{self.n_heads} heads of dim {self.head_dim} (build the caches "
                f"from the model that reads them, for this batch: model.new_caches(batch))"
            )
        if new is not None and cache.length + new > cache.max_len:
            raise ValueError(
                f"{new} new position(s) after the {cache.length} cached exceed the cache's "
                f"max_len={cache.max_len}; at most {cache.max_len - cache.length} more fit"
            )
        kv = self.ctx.kv
        if not isinstance(kv, KvFp8) or not kv.static or torch.compiler.is_compiling():
            return
        tag, now = cache.steps_tag, self._calibration_tag()
        if isinstance(tag, tuple) and now is not None and tag[0]() is now[0]() and tag[1] == now[1]:
            return
        ks, vs = cache.k_step, cache.v_step
        assert ks is not None and vs is not None  # a static fp8 cache holds its steps
        try:
            mine = [held_steps(s, kv.step) for s in self.kv_steps()]
        except ValueError:
            mine = []
        same = bool(mine) and all(
            torch.equal(widen_steps(a), widen_steps(b)) for a, b in zip((ks, vs), mine, strict=True)
        )
        if not same:
            differ = [
                name
                for name, a, b in zip(("key", "value"), (ks, vs), mine, strict=True)
                if not torch.equal(widen_steps(a), widen_steps(b))
            ]
            ours = (
                f"its {' and '.join(differ)} steps differ from this layer's calibration"
                if mine
                else "this layer is not calibrated"
            )
            raise ValueError(
                f"this kv={kv} cache holds the static steps of another calibration ({ours}): "
                f"its codes were made with those steps. Build the caches from the model that "
                f"reads them, after calibrating or loading (model.new_caches(...))"
            )
        cache.steps_tag = now

    # ----- forward ----------------------------------------------------------------------------

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        qkv = self.ctx.to_compute(self.gemm.project(self.qkv, x))
        q, k, v = qkv.view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        # At the compute dtype: GEMMs through Gemm, the softmax through ctx.precise. Under
        # ctx.activations' attention other than keep the backward keeps q, k and v only (as
        # fp8 groups, on the host, or as they are) and computes the scores and probabilities
        # again: neither the GEMMs' operands nor the T x T probabilities wait for it.
        activations = self.ctx.activations
        if activations.attention != "keep" and torch.is_grad_enabled():
            work = promote(dtype_of(q), self.ctx.accum).torch
            core = functools.partial(_attention_core, self.gemm, self.head_dim, work)
            mode, group = activations.attention, activations.group
            # v is a view of the fused projection's output: kept as it is, it would pin the
            # whole of it (q and k before RoPE too); a compact copy is what keep's GEMM keeps.
            v = v if mode == "fp8" else v.contiguous()
            return saved_call(
                core, q, k, v, visible, mode=mode, group=group, inputs=3, kind="attention"
            )
        # What the GEMMs keep (q, k, v, the probabilities) counts as attention.
        return tagged("attention", self._attend_keeping, q, k, v, visible)

    def _attend_keeping(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        scores = self.gemm.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        # -inf (not a large negative number) so masked keys get exactly zero weight in
        # every dtype; each query sees at least itself, so no row is all -inf.
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = softmax(self.ctx, scores, dim=-1, kind="attention")
        return self.gemm.matmul(probs, v)

    def _attend_f32(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        # An fp8 cache's prefill: dequantized keys/values and the scores in float32 (float32
        # matmuls: TF32 on a CUDA device would round them, which _check_float32_matmul warns of).
        _check_float32_matmul(q.device)
        with torch.autocast(q.device.type, enabled=False):
            scores = q.to(torch.float32) @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.head_dim))
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = softmax(self.ctx, scores, dim=-1, kind="attention")
            return probs @ v

    def _attend_window(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        before: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        # A prefill of T > 1 positions into a cache with a window of n slots, read as T
        # decode steps read it: the query at position s sees position p <= s unquantized
        # (as the window holds it) when s - n < p, from its codes otherwise. Positions
        # before the prefill come as the window held them before it (``before``: a later
        # position of this prefill may take their slot), the prefill's own from k and v.
        end, t = cache.length, q.shape[2]
        start = end - t
        k_codes, v_codes = cache.read(end, window=False)
        k_win = torch.cat([before[0], cache.windowed(k)], dim=2)
        v_win = torch.cat([before[1], cache.windowed(v)], dim=2)
        at = torch.arange(end, device=q.device)
        query_at = (start + torch.arange(t, device=q.device)).view(t, 1)
        visible = at <= query_at
        recent = visible & (at > query_at - cache.recent)
        _check_float32_matmul(q.device)
        with torch.autocast(q.device.type, enabled=False):
            qf, scale = q.to(torch.float32), 1.0 / math.sqrt(self.head_dim)
            scores = torch.where(
                recent,
                qf @ k_win.transpose(-2, -1) * scale,
                qf @ k_codes.transpose(-2, -1) * scale,
            )
            masked = scores.masked_fill(~visible, float("-inf"))
            probs = softmax(self.ctx, masked, dim=-1, kind="attention")
            # Each weight multiplies the value it read (the other reading gets weight 0).
            from_win = probs.masked_fill(~recent, 0.0) @ v_win
            from_codes = probs.masked_fill(recent, 0.0) @ v_codes
            return from_win + from_codes

    def _decode_fp8(
        self, q: torch.Tensor, cache: KVCache, length: torch.Tensor | int
    ) -> torch.Tensor:
        # One query per (batch, head) over the fp8 cache: (B, H, 1, D) -> (B, H, 1, D).
        q1 = q[:, :, 0]
        if q1.dtype not in FLOAT_DTYPES:
            q1 = q1.to(torch.float32)
        assert cache.backend is not None  # an fp8 cache always has one
        with torch.autocast(q.device.type, enabled=False):
            out = decode_attention(
                q1,
                cache.k,
                cache.v,
                cache.k_step,
                cache.v_step,
                length,
                sm_scale=1.0 / math.sqrt(self.head_dim),
                backend=cache.backend,
                # The cache's steps are finite and positive by construction (kv_quant), and
                # checked when static ones were given: no host read per step.
                check_values=False,
            )
        return out.unsqueeze(2)

    def _merge(self, mixed: torch.Tensor) -> torch.Tensor:
        flat = self.ctx.to_compute(mixed).transpose(1, 2).flatten(2)  # batch 0 too
        return self.ctx.to_compute(self.gemm.project(self.out, flat))

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        t = x.shape[1]
        start = 0 if cache is None else cache.length
        if cache is not None:
            self.check_cache(cache)
        with self.ctx.autocast():
            q, k, v = self._qkv(x)
            q = self.rope(q, start)
            k = self.rope(k, start)
            self.observe_kv(k, v)
            if cache is None:
                keys, values = k, v
            else:
                windowed = cache.fp8 is not None and cache.recent > 0 and t > 1
                # A prefill over a window reads each position as a decode step at each query
                # would: the positions before it as the window held them before it.
                before = cache.read(start) if windowed else None
                cache.append(k, v)
                if before is not None:
                    return self._merge(self._attend_window(q, k, v, cache, before))
                if cache.fp8 is not None and t == 1 and not cache.recent:
                    return self._merge(self._decode_fp8(q, cache, cache.length))
                keys, values = cache.read()
            # Query i sits at position start + i and sees keys 0 .. start + i.
            visible = torch.ones(t, keys.shape[2], dtype=torch.bool, device=x.device).tril(start)
            if cache is not None and cache.fp8 is not None:
                return self._merge(self._attend_f32(q, keys, values, visible))
            keys, values = self.ctx.to_compute(keys), self.ctx.to_compute(values)
            return self._merge(self._attend(q, keys, values, visible))

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new position per row (``x`` ``(B, 1, dim)``) at position ``pos`` (a 0-d int64
        tensor), attending to cached positions ``0 .. pos``: the static-shape decode step.

        Keys and values are written with ``cache.write`` (no host read; ``cache.length`` is
        left alone) and attention runs over the whole preallocated cache with the positions
        after ``pos`` masked (their scores ``-inf``, their values zero: whatever stale value
        a slot past ``pos`` holds, inf and NaN included, never reaches the output), so shapes
        never change and a compiled step does not recompile as ``pos`` moves. An fp8 cache
        runs ``decode_attention`` with ``length = pos + 1``.
        """
        self.check_cache(cache)
        b, t, _ = x.shape
        if t != 1:
            raise ValueError(f"Attention.decode takes one position per row, got x {x.shape}")
        with self.ctx.autocast():
            q, k, v = self._qkv(x)
            q = self.rope.at(q, pos)
            k = self.rope.at(k, pos)
            cache.write(k, v, pos)
            if cache.fp8 is not None and not cache.recent:
                length = (pos + 1).expand(b).contiguous()
                return self._merge(self._decode_fp8(q, cache, length))
            visible = (torch.arange(cache.max_len, device=x.device) <= pos).view(1, -1)
            if cache.fp8 is not None:  # a window: the float32 read, masked past pos
                keys, values = cache.read(cache.max_len)
                values = values.masked_fill(~visible.view(1, 1, -1, 1), 0.0)
                return self._merge(self._attend_f32(q, keys, values, visible))
            keys, values = self.ctx.to_compute(cache.k), self.ctx.to_compute(cache.v)
            # Slots past pos may hold anything (a previous sequence, inf, NaN): their scores
            # are -inf (weight 0) and their values zeroed here, since 0 * inf or 0 * NaN in
            # the weighted sum would be NaN. Only positions 0 .. pos reach the output.
            values = values.masked_fill(~visible.view(1, 1, -1, 1), 0.0)
            return self._merge(self._attend(q, keys, values, visible))


def _amax_fault(wide: torch.Tensor) -> str:
    # What is wrong with a refused (2, H) kv_amax, named by its first refused entry, never
    # printed (an error path: host reads of flags): a non-finite or negative entry, else
    # zeros mixed with positive entries.
    bad = ~torch.isfinite(wide) | (wide < 0)
    if not bool(bad.any()):
        zeros = int((wide == 0).sum())
        return f"{zeros} of its {wide.numel()} entries are 0 and the others positive"
    at = tuple(int(i) for i in bad.nonzero()[0])
    count = int(bad.sum())
    more = f" ({count} of its {wide.numel()} entries refused)" if count > 1 else ""
    return f"kv_amax{list(at)} is {fault(wide[at])}{more}"
