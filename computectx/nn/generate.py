"""Text generation from a ``ByteLM``: greedy or temperature/top-k sampling, KV-cached; and
teacher-forced logits through the cache (``decode_logits``), the loss a cache setting gives."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

import torch

from computectx.nn.kv_cache import KVCache
from computectx.nn.lm import BYTE_VOCAB, ByteLM, check_ids

__all__ = ["DecodeStep", "decode_logits", "generate", "next_token"]

DecodeStep = Callable[[torch.Tensor, torch.Tensor, Sequence[KVCache]], torch.Tensor]
"""``(ids (B, 1), pos (0-d int64), caches) -> logits (B, 256)``: ``ByteLM.decode_step``, or
``torch.compile(model.decode_step, fullgraph=True)``."""


def next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one id per row of ``logits`` (``(batch, vocab)``): argmax when ``temperature``
    is 0, else a sample from ``softmax(logits / temperature)`` restricted to the ``top_k``
    largest logits (all when ``None``), drawn with ``generator``.

    ``temperature`` is a finite real number >= 0 and ``top_k`` an int from 1 to ``vocab`` (or
    ``None``); another type is a ``TypeError`` naming the argument (``bool`` included), another
    value a ``ValueError``. Every finite positive temperature samples, however small: the
    logits are shifted by their row maximum and divided in float64, so ``1e-300`` is not an
    overflow but the limit of sampling as the temperature goes to 0 (uniform over the ids
    tied at the maximum; greedy decoding takes the first of them). A row with a NaN logit
    raises ``ValueError`` naming the row (one host read); so does a ``+inf`` logit when
    sampling (``-inf`` masks an id, as ``top_k`` does).

    Sampling runs in float32 on ``generator``'s device (the CPU when ``generator`` is
    ``None`` or a CPU generator): a BF16 probability carries 8 bits, too coarse to sample
    the tail of 256 bytes faithfully. Returns int64 ids ``(batch,)`` on ``logits``' device.
    """
    vocab = logits.shape[-1]
    temp, k = _sampling_args(temperature, top_k, vocab, "next_token")
    if temp == 0.0:
        _check_no_nan(logits, "next_token")
    return _pick(logits, temp, k, generator)


def _sampling_args(
    temperature: object, top_k: object, vocab: int, who: str
) -> tuple[float, int | None]:
    """``temperature`` and ``top_k`` checked: a float >= 0 that is finite, and an int in
    ``1..vocab`` or ``None``."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(
            f"{who}: temperature must be a real number >= 0 (0 = greedy), got "
            f"{type(temperature).__name__} {temperature!r}"
        )
    temp = float(temperature)
    if not (math.isfinite(temp) and temp >= 0.0):
        raise ValueError(
            f"{who}: temperature must be finite and >= 0 (0 = greedy), got {temperature!r}"
        )
    if top_k is None:
        return temp, None
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(
            f"{who}: top_k must be an int in 1..{vocab} or None, got "
            f"{type(top_k).__name__} {top_k!r}"
        )
    if not 1 <= int(top_k) <= vocab:
        raise ValueError(f"{who}: top_k must be an int in 1..{vocab} or None, got {top_k!r}")
    return temp, int(top_k)


def _check_no_nan(logits: torch.Tensor, who: str) -> None:
    rows = logits.isnan().any(dim=-1).nonzero()
    if rows.numel():
        raise ValueError(
            f"{who}: the logits of batch row {int(rows[0, 0])} hold NaN; no id can be picked "
            f"from them"
        )


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    # Arguments checked (_sampling_args); greedy decoding reads nothing on the host here.
    wide = logits.float()
    if temperature == 0.0:
        return wide.argmax(dim=-1)
    vocab = wide.shape[-1]
    if top_k is not None and top_k < vocab:
        kth = wide.topk(top_k, dim=-1).values[..., -1:]
        wide = wide.masked_fill(wide < kth, float("-inf"))
    where = generator.device if generator is not None else torch.device("cpu")
    wide = wide.to(where)
    top = wide.amax(dim=-1, keepdim=True)
    bad = ((wide.isnan() | wide.isposinf()).any(dim=-1) | top[:, 0].isneginf()).nonzero()
    if bad.numel():
        raise ValueError(
            f"the logits of batch row {int(bad[0, 0])} hold NaN or +inf, or are all -inf; "
            f"sampling needs finite logits (-inf masks an id)"
        )
    # Shifted by the row maximum (each row's largest logit becomes 0) and divided in float64:
    # no temperature, however small, overflows to inf - inf; the far tail underflows to 0.
    scaled = ((wide.double() - top.double()) / temperature).float()
    probs = torch.softmax(scaled, dim=-1)
    picked = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return picked.to(logits.device)


@torch.no_grad()
def generate(
    model: ByteLM,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    decode_step: DecodeStep | None = None,
    cache_len: int | None = None,
) -> torch.Tensor:
    """``prompt`` (int64 ids, ``(T,)`` or ``(batch, T)``) followed by ``max_new_tokens`` ids.

    With ``use_cache`` the prompt is run once into per-layer KV caches (stored as ``ctx.kv``
    says: a dtype, or fp8 codes and steps) and each new id costs one ``decode_step``
    (default ``model.decode_step``; pass ``torch.compile(model.decode_step,
    fullgraph=True)`` for the compiled path). The caches hold ``cache_len`` positions
    (default: the prompt plus the new ids); a compiled step sees one shape when every call
    passes the same ``cache_len`` (``model.config.max_len``, say). Without ``use_cache``
    every step recomputes the whole sequence (the reference the cached path is tested
    against). The two agree up to float reassociation when ``ctx.kv`` is at or above
    ``ctx.compute``; a narrower or fp8 ``kv`` rounds the cached keys and values, which is
    what that policy asks for. The result has the prompt's shape with ``max_new_tokens``
    more positions.

    Arguments are checked before the model runs: ``max_new_tokens`` an int >= 0,
    ``temperature`` and ``top_k`` as ``next_token`` says (a wrong type is a ``TypeError``
    naming the argument, a wrong value a ``ValueError``), the prompt's ids in ``[0, 256)``.
    Logits holding a NaN raise ``ValueError`` naming the step, the position and the batch
    row; greedy decoding keeps that check on the device and reads it once, at the end, so
    the decode loop waits for the device no more than before. The default step is
    ``model.decode_step`` without its per-call value checks (``generate`` makes the ids
    and positions itself).
    """
    temp, k, length = _generate_args(model, prompt, max_new_tokens, temperature, top_k, cache_len)
    ids = (prompt[None, :] if prompt.dim() == 1 else prompt).to(model.ctx.device)
    step = model._decode if decode_step is None else decode_step
    was_training = model.training
    model.eval()
    try:
        caches = model.new_caches(ids.shape[0], length) if use_cache else None
        ids = _extend(model, ids, max_new_tokens, temp, k, generator, caches, step)
    finally:
        model.train(was_training)
    return ids[0] if prompt.dim() == 1 else ids


def _generate_args(
    model: ByteLM,
    prompt: object,
    max_new_tokens: object,
    temperature: object,
    top_k: object,
    cache_len: object,
) -> tuple[float, int | None, int]:
    """``generate``'s arguments checked, in its documented order; returns the temperature,
    ``top_k`` and the caches' length."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(
            f"generate: max_new_tokens must be an int >= 0, got "
            f"{type(max_new_tokens).__name__} {max_new_tokens!r}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    temp, k = _sampling_args(temperature, top_k, BYTE_VOCAB, "generate")
    plen = _checked_prompt(prompt).shape[-1]
    return temp, k, _cache_length(model, plen, max_new_tokens, cache_len)


def _checked_prompt(prompt: object) -> torch.Tensor:
    """``prompt``, checked: non-empty int64 ids of shape ``(T,)`` or ``(batch, T)``, each in
    ``[0, 256)``."""
    if not isinstance(prompt, torch.Tensor):
        raise TypeError(
            f"generate: prompt must be a tensor of int64 ids, got {type(prompt).__name__}"
        )
    if prompt.dtype != torch.long or prompt.dim() not in (1, 2) or prompt.shape[-1] == 0:
        raise ValueError(
            f"prompt must be non-empty int64 ids of shape (T,) or (batch, T), got "
            f"{prompt.dtype} {tuple(prompt.shape)}"
        )
    if int(prompt.min()) < 0 or int(prompt.max()) >= BYTE_VOCAB:
        raise ValueError(f"prompt ids must lie in 0..{BYTE_VOCAB - 1}")
    return prompt


def _cache_length(model: ByteLM, plen: int, max_new_tokens: int, cache_len: object) -> int:
    """How many positions the caches hold: ``cache_len``, by default the prompt's ``plen``
    plus the new ids; both within the model's ``max_len``."""
    total = plen + max_new_tokens
    limit = model.config.max_len
    if total > limit:
        raise ValueError(
            f"prompt of {plen} plus {max_new_tokens} new ids is {total} positions, "
            f"beyond the model's max_len={limit}"
        )
    length = total if cache_len is None else cache_len
    if isinstance(length, bool) or not isinstance(length, int) or not total <= length <= limit:
        raise ValueError(
            f"cache_len must be an int from {total} (prompt plus new ids) to max_len={limit}, "
            f"got {cache_len!r}"
        )
    return length


def _extend(
    model: ByteLM,
    ids: torch.Tensor,
    max_new_tokens: int,
    temp: float,
    k: int | None,
    generator: torch.Generator | None,
    caches: list[KVCache] | None,
    step: DecodeStep,
) -> torch.Tensor:
    """``ids`` (``(batch, T)``, on the model's device) followed by ``max_new_tokens`` ids
    picked one step at a time: through ``caches`` (the prompt in one pass, then one ``step``
    per id) or, without caches, recomputing the whole sequence."""
    plen = ids.shape[1]
    nxt = ids[:, -1:]
    # The position of the first decoded id, moved on the device after each step (a new
    # tensor from the host every step would wait for the device on CUDA).
    pos = torch.tensor(plen, dtype=torch.long, device=ids.device)
    # Greedy decoding reads nothing on the host per step: the first step whose logits
    # held a NaN (and its row) is kept on the device and read once at the end.
    nan_step = torch.tensor(-1, dtype=torch.long, device=ids.device)
    nan_row = torch.tensor(-1, dtype=torch.long, device=ids.device)
    for i in range(max_new_tokens):
        if caches is None:
            logits = model(ids)[:, -1, :]
        elif i == 0:
            logits = model(ids, caches)[:, -1, :]  # the prompt, in one pass
        else:
            # The last id as its own (batch, 1) tensor: a view into the growing ids
            # would change strides every step, and a compiled step would recompile.
            logits = step(nxt, pos, caches)
            pos = pos + 1
        if temp == 0.0:
            rows = logits.isnan().any(dim=-1)
            first = (nan_step < 0) & rows.any()
            nan_row = torch.where(first, rows.long().argmax(), nan_row)
            nan_step = torch.where(first, i, nan_step)
        try:
            nxt = _pick(logits, temp, k, generator)[:, None]
        except ValueError as e:
            raise ValueError(f"generate: step {i} (position {plen + i}): {e}") from None
        ids = torch.cat((ids, nxt), dim=1)
    if int(nan_step) >= 0:
        s, r = int(nan_step), int(nan_row)
        raise ValueError(
            f"generate: step {s} (position {plen + s}): the logits of batch row {r} hold "
            f"NaN; greedy decoding cannot pick an id from them (the model's weights or "
            f"activations are not finite)"
        )
    return ids


@torch.no_grad()
def decode_logits(
    model: ByteLM,
    ids: torch.Tensor,
    *,
    prefill: int = 1,
    decode_step: DecodeStep | None = None,
    caches: Sequence[KVCache] | None = None,
) -> torch.Tensor:
    """Teacher-forced logits ``(batch, T, 256)`` of ``ids`` (``(batch, T)`` int64) through the
    KV cache: the first ``prefill`` positions in one pass, then one ``decode_step`` per
    position (default ``model.decode_step``), each reading every earlier key and value back
    from the cache as generation does.

    ``model.loss_of(decode_logits(model, ids), targets)`` is the loss a KV setting gives on
    the path serving runs. ``caches`` defaults to ``model.new_caches(batch, T)``; pass caches
    built by hand to measure one ``KVCache`` constructor call's setting (steps given
    explicitly, say). The model runs in eval mode.
    """
    if ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] == 0:
        raise ValueError(
            f"decode_logits takes int64 ids of shape (batch, T), got {ids.dtype} {tuple(ids.shape)}"
        )
    b, t = ids.shape
    if isinstance(prefill, bool) or not isinstance(prefill, int) or not 1 <= prefill <= t:
        raise ValueError(f"prefill must be an int from 1 to T={t}, got {prefill!r}")
    # The ids are checked once here (one host read); the default step then runs without its
    # per-call checks, and the positions are made here, within the caches.
    check_ids("decode_logits", ids)
    if caches is not None and min(c.max_len for c in caches) < t:
        raise ValueError(
            f"decode_logits: the caches hold {min(c.max_len for c in caches)} positions, "
            f"fewer than the T={t} of ids"
        )
    step = model._decode if decode_step is None else decode_step
    was_training = model.training
    model.eval()
    try:
        if caches is None:
            caches = model.new_caches(b, t)
        out = [model(ids[:, :prefill], list(caches))]
        pos = torch.tensor(prefill, dtype=torch.long, device=ids.device)  # moved on the device
        for i in range(prefill, t):
            # A fresh contiguous (batch, 1) tensor, strided as generate's ids are: a compiled
            # step specializes on its inputs' strides.
            new = ids[:, i : i + 1].clone(memory_format=torch.contiguous_format)
            out.append(step(new, pos, caches)[:, None, :])
            pos = pos + 1
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)
