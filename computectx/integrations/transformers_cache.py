"""A transformers ``Cache`` that stores keys and values as a ``ComputeCtx``'s ``kv`` says.

``CtxStaticCache(config, ctx, max_cache_len)`` is to ``ComputeCtx.kv`` what transformers'
``StaticCache`` is to the model's dtype: one preallocated ``(B, H, max_cache_len, D)`` buffer
per layer, written in place at the cache's position tensor (``index_copy_``), so a compiled
decode step (``torch.compile(model.forward, fullgraph=True)``) sees one shape and no host
read, and does not recompile as the position moves. Each layer holds a
``computectx.nn.KVCache``, the store computectx's own attention uses:

- a ``kv`` in the lattice (``f32``, ``bf16``, ``f16``) stores the keys and values at that
  dtype (``ctx.to_kv``, a plain cast);
- an fp8 ``kv`` (``KvFp8``) stores fp8 codes and steps at ``kv.step``'s format (f32, bf16
  or e8m0, ``computectx.formats.numerics.kv_quant`` and ``computectx.nn.kv_steps``):
  ``per_token_head`` takes a step from each (token, head) vector as it is written, and the
  static ``per_head`` / ``per_tensor`` take theirs from a calibrated amax
  (``calibrate_transformers_kv``), given as ``kv_amax``. A static scheme with no ``kv_amax``
  is refused when the cache is built: a step of 1.0 is never assumed. With ``kv.recent =
  N > 0`` each layer also holds the last N positions written at the dtype of the model's
  keys (a ring of N slots).

What the model's attention reads back (``update``'s result) is the whole buffer: the stored
values cast to the dtype of the keys the model passed in, or the codes dequantized (code
times step, in float32), the window's positions taken unquantized, and rounded once to
that dtype. The attention itself is the model's
(its ``attn_implementation``); positions past the cache's length are masked as for
``StaticCache`` (``get_mask_sizes``). So with fp8 codes the scores and the weighted sum run
at the model's dtype, not in float32 as ``computectx.formats.ops.attention`` runs them.

Every layer must be a full-attention layer (``layer_types``: ``"full_attention"``): sliding,
chunked and linear-attention layers are refused by name. The buffers live on the device of
the first keys written (as for ``StaticCache``), whatever ``ctx.device`` says. Beam search
(``reorder_cache``) and ``reset`` work in place; offloading is not offered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    StaticLayer,
    get_layer_types_and_kwargs,
)
from transformers.configuration_utils import PreTrainedConfig

from computectx._checks import fault
from computectx.ctx import ComputeCtx
from computectx.dtypes import DType
from computectx.formats.seam import static_kv_steps
from computectx.kv_policy import KvFp8
from computectx.nn.kv_cache import KVCache, kv_bytes_per_token

__all__ = ["CtxStaticCache", "CtxStaticLayer", "calibrate_transformers_kv"]

_LAYER_TYPE = "full_attention"


def _kv_heads_and_dim(config: PreTrainedConfig) -> tuple[int, int]:
    """The key/value heads and head dim of a decoder config (``num_key_value_heads``, else
    ``num_attention_heads``; ``head_dim``, else ``hidden_size // num_attention_heads``)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and heads:
        head_dim = getattr(config, "hidden_size", 0) // heads
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int) or kv_heads <= 0:
        raise ValueError(
            f"{type(config).__name__} has no key/value head count and head dim "
            f"(num_key_value_heads / num_attention_heads, head_dim / hidden_size): got "
            f"{kv_heads!r} heads of {head_dim!r}"
        )
    return kv_heads, head_dim


def _checked_amax(kv_amax: torch.Tensor, layers: int, heads: int) -> torch.Tensor:
    """``kv_amax`` as float32 ``(layers, 2, heads)``, finite and positive, or ``ValueError``."""
    if not isinstance(kv_amax, torch.Tensor):
        raise ValueError(f"kv_amax must be a tensor, got {type(kv_amax).__name__}")
    want = (layers, 2, heads)
    if tuple(kv_amax.shape) != want:
        raise ValueError(
            f"kv_amax must have shape (layers, 2, key/value heads) = {want} for this config, "
            f"got {tuple(kv_amax.shape)} (calibrate_transformers_kv(model, batches) makes one)"
        )
    wide = kv_amax.detach().to(torch.float32)
    bad = _first_bad_amax(wide)
    if bad is not None:
        where, what = bad
        raise ValueError(f"kv_amax must be finite and positive: {where} is {what}")
    return wide


def _first_bad_amax(amax: torch.Tensor) -> tuple[str, str] | None:
    # The first (layer, keys/values, head) of a (layers, 2, heads) amax that is not finite
    # and positive, as "layer L keys|values of head H", with what is wrong with it (NaN, inf,
    # -inf, 0, negative: never its value); None when all are.
    bad = ~(torch.isfinite(amax) & (amax > 0))
    if not bool(bad.any()):
        return None
    layer, which, head = (int(i) for i in bad.nonzero()[0])
    where = f"layer {layer} {'keys' if which == 0 else 'values'} of head {head}"
    return where, fault(amax[layer, which, head])


def _check_states(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """``ValueError`` unless the keys and values are tensors of one 4-d shape."""
    for name, x in (("keys", key_states), ("values", value_states)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"CtxStaticCache stores (B, H, T, D) {name}; got {got}")
    if key_states.shape != value_states.shape:
        raise ValueError(
            f"CtxStaticCache stores keys and values of one shape (B, H, T, D); got keys "
            f"{tuple(key_states.shape)} and values {tuple(value_states.shape)}"
        )


class CtxStaticLayer(StaticLayer):
    """One full-attention layer of a ``CtxStaticCache``: a ``KVCache`` built at the first
    ``update`` (batch, heads, head dim and device from the keys) and written in place at
    ``cumulative_length`` (a 0-d int64 tensor, as ``StaticLayer``'s)."""

    def __init__(
        self,
        max_cache_len: int,
        ctx: ComputeCtx,
        steps: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.ctx = ctx
        self.steps = steps
        """The calibrated (key, value) steps of a static fp8 ``kv``; ``None`` otherwise."""
        self.store: KVCache | None = None
        """The storage, once the first keys have been seen."""
        self.read_dtype: torch.dtype | None = None
        """The dtype of the keys the model writes: what ``update`` returns."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _check_states(key_states, value_states)
        # The store is built (and may be refused) before any attribute of the layer changes.
        b, h, _, d = key_states.shape
        store = KVCache(
            self.ctx.replace(device=key_states.device),
            b,
            h,
            d,
            self.max_cache_len,
            steps=self.steps,
            window_dtype=key_states.dtype if isinstance(self.ctx.kv, KvFp8) else None,
        )
        self.device = key_states.device
        self.batch_size, self.num_heads = b, h
        self.k_head_dim = self.v_head_dim = d
        self.read_dtype = key_states.dtype
        self.store = store
        self.keys, self.values = store.k, store.v
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():
            # Fixed addresses, as StaticLayer marks its buffers: no recompile, CUDA graphs.
            for t in (*store.held, self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def _stored(self) -> KVCache:
        if self.store is None:
            raise RuntimeError("CtxStaticLayer: no keys written yet")
        return self.store

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key_states`` / ``value_states`` (``(B, H, T, D)``) at positions
        ``cumulative_length ..`` and return the whole buffer as the model reads it.

        Positions that do not fit in ``max_cache_len`` (more new ones than it holds, or
        running past its end after earlier writes) raise ``ValueError``, and nothing is
        stored or counted then, the layer's first call included (it builds no store). The
        end is checked in eager mode with no host read (``KVCache.write``); a compiled step
        checks no value and trusts ``generate`` to stop at the end."""
        _check_states(key_states, value_states)
        t = key_states.shape[-2]
        if t > self.max_cache_len:
            raise ValueError(
                f"CtxStaticCache: {t} new positions do not fit in "
                f"max_cache_len={self.max_cache_len}; build the cache for the prompt plus the "
                f"new tokens"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self._stored()
        try:
            store.write(key_states, value_states, self.cumulative_length)
        except ValueError as e:
            raise ValueError(
                f"CtxStaticCache (max_cache_len={self.max_cache_len}): {e}; build the cache "
                f"for the prompt plus the new tokens"
            ) from None
        self.cumulative_length.add_(t)
        return self.read()

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position of the buffer (``max_cache_len``) at the dtype of the model's keys:
        values cast, or fp8 codes dequantized in float32 and then rounded once."""
        store = self._stored()
        dtype = self.read_dtype
        assert dtype is not None  # set with the store
        k, v = store.read(store.max_len)
        return k.to(dtype), v.to(dtype)

    def reset(self) -> None:
        """Empty the cache in place (same buffers, so a compiled step stays valid)."""
        if self.store is not None:
            self.store.reset()
        self.cumulative_length.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (a rollback: the next ``update``
        writes over them), as ``StaticLayer.crop``; ``ValueError`` for anything but an int
        ``-cumulative_length <= tokens_to_remove <= 0`` (one host read), nothing changed."""
        self.check_crop(tokens_to_remove)
        self.cumulative_length.sub_(-tokens_to_remove)

    def check_crop(self, tokens_to_remove: int) -> None:
        """``crop``'s checks, changing nothing."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise ValueError(
                f"CtxStaticCache.crop takes an int <= 0 (minus the positions to forget), got "
                f"{tokens_to_remove!r}"
            )
        held = int(self.cumulative_length)
        if not -held <= tokens_to_remove <= 0:
            raise ValueError(
                f"CtxStaticCache.crop: tokens_to_remove={tokens_to_remove} with {held} "
                f"position(s) cached; accepted: an int from {-held} to 0"
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows for beam search, in place: codes or values, the steps of
        ``per_token_head`` (static steps are shared by every row) and the window."""
        if self.store is None:
            return
        self.store.reorder(beam_idx.to(self.device))

    def offload(self) -> None:
        raise NotImplementedError("CtxStaticCache does not offload its layers")

    def prefetch(self) -> None:
        raise NotImplementedError("CtxStaticCache does not offload its layers")


class CtxStaticCache(Cache):
    """A static (preallocated, compile-friendly) transformers cache storing keys and values as
    ``ctx.kv`` says; pass it as ``model.generate(..., past_key_values=cache)`` or
    ``model(..., cache=cache)``. The module docstring gives the storage and what attention
    reads.

    ``config``: the model's config (every decoder layer must be full attention);
    ``ctx``: the policy whose ``kv`` says how to store (its other fields are not used:
    the model computes at its own dtype); ``max_cache_len``: the positions each layer holds
    (prompt plus new tokens). ``kv_amax``: for a static fp8 ``kv`` (``per_head``,
    ``per_tensor``), the calibrated amax, ``(layers, 2, key/value heads)`` float32, finite
    and positive (``calibrate_transformers_kv``); refused for any other ``kv``.
    """

    def __init__(
        self,
        config: PreTrainedConfig,
        ctx: ComputeCtx,
        max_cache_len: int,
        *,
        kv_amax: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(ctx, ComputeCtx):
            raise ValueError(f"CtxStaticCache takes a ComputeCtx, got {type(ctx).__name__}")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int):
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        if max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        text = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text)
        others = sorted({t for t in layer_types if t != _LAYER_TYPE})
        if others:
            raise ValueError(
                f"CtxStaticCache serves full-attention layers only ({_LAYER_TYPE!r}); this "
                f"config has layer types {others}"
            )
        kv = ctx.kv
        self.ctx = ctx
        self.kv: DType | KvFp8 = kv
        """The KV setting every layer stores."""
        heads, head_dim = _kv_heads_and_dim(text)
        self.bytes_per_token = len(layer_types) * kv_bytes_per_token(kv, heads, head_dim)
        """Bytes one more cached position costs over all layers (``kv_bytes_per_token``)."""
        static = isinstance(kv, KvFp8) and kv.static
        steps: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(layer_types)
        if kv_amax is not None and not static:
            raise ValueError(
                f"kv={kv} takes no kv_amax: only the static fp8 schemes (per_head, "
                f"per_tensor) take their steps from a calibration"
            )
        if static:
            assert isinstance(kv, KvFp8)
            if kv_amax is None:
                raise ValueError(
                    f"kv={kv} is a static scheme: CtxStaticCache needs the calibrated kv_amax "
                    f"(a step of 1.0 is never assumed); make it with "
                    f"calibrate_transformers_kv(model, batches), or use "
                    f"kv={kv.format}/per_token_head, which needs no calibration"
                )
            amax = _checked_amax(kv_amax, len(layer_types), heads)
            steps = [static_kv_steps(amax[i], kv) for i in range(len(layer_types))]
        layers = [CtxStaticLayer(max_cache_len, ctx, s) for s in steps]
        super().__init__(layers=list(layers))

    def crop(self, max_length: int) -> None:
        """Forget the last ``-max_length`` positions of every layer (``CtxStaticLayer.crop``),
        every layer checked before any changes."""
        for layer in self.layers:
            if isinstance(layer, CtxStaticLayer):
                layer.check_crop(max_length)
        super().crop(max_length)

    @property
    def nbytes(self) -> int:
        """Bytes the preallocated buffers hold (0 before the first ``update``): codes or
        values, steps, and the window of recent positions."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, CtxStaticLayer) and layer.store is not None:
                total += layer.store.nbytes
        return total


def _layer_amax(cache: DynamicCache) -> torch.Tensor:
    """``(layers, 2, heads)``: each layer's per-head amax of the keys and values it holds."""
    rows = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise ValueError(f"calibrate_transformers_kv: a layer held no keys ({layer!r})")
        pair = [
            t.detach().abs().to(torch.float32).amax(dim=(0, 2, 3))
            for t in (layer.keys, layer.values)
        ]
        rows.append(torch.stack(pair))
    return torch.stack(rows).cpu()


@torch.no_grad()
def calibrate_transformers_kv(model: nn.Module, batches: Iterable[object]) -> torch.Tensor:
    """Each layer's per-head amax of keys (after RoPE, as they enter the cache) and values
    over ``batches``: ``(layers, 2, key/value heads)`` float32, row 0 keys, row 1 values, the
    ``kv_amax`` a static fp8 ``CtxStaticCache`` takes (``computectx.nn.calibrate_kv`` is the
    same for a computectx model).

    Each batch is a tensor of input ids or a mapping of the model's keyword arguments
    (``input_ids``, ``attention_mask``, ...); the model runs it in eval mode, without
    gradients, with a fresh ``DynamicCache`` whose keys and values are measured. Positions
    an ``attention_mask`` pads are measured too. ``ValueError`` when ``batches`` is empty or
    a head's amax is not finite or is zero.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, PreTrainedConfig):
        raise ValueError(
            f"calibrate_transformers_kv takes a transformers model, got {type(model).__name__}"
        )
    modes = [(m, m.training) for m in model.modules()]  # each module's own, restored
    model.eval()
    found: torch.Tensor | None = None
    count = 0
    try:
        for batch in batches:
            kwargs = dict(batch) if isinstance(batch, Mapping) else {"input_ids": batch}
            cache = DynamicCache(config=config)
            model(**kwargs, cache=cache, use_cache=True)
            now = _layer_amax(cache)
            found = now if found is None else torch.maximum(found, now)
            count += 1
    finally:
        for m, training in modes:
            m.training = training
    if found is None:
        raise ValueError("calibrate_transformers_kv: batches is empty; calibration needs a batch")
    bad = _first_bad_amax(found)
    if bad is not None:
        where, what = bad
        raise ValueError(
            f"calibrate_transformers_kv: {where} have an amax that is {what} over {count} "
            f"batch(es); "
            f"a calibrated amax must be finite and positive"
        )
    return found
