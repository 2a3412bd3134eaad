"""Text generation from a ``ByteLM``: greedy or temperature/top-k sampling, KV-cached; and
teacher-forced logits through the cache (``decode_logits``), the loss a cache setting gives."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from computectx.nn.kv_cache import KVCache
from computectx.nn.lm import BYTE_VOCAB, ByteLM

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

    Sampling runs in float32 on ``generator``'s device (the CPU when ``generator`` is
    ``None`` or a CPU generator): a BF16 probability carries 8 bits, too coarse to sample
    the tail of 256 bytes faithfully. Returns int64 ids ``(batch,)`` on ``logits``' device.
    """
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    vocab = logits.shape[-1]
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= vocab):
        raise ValueError(f"top_k must be an int in 1..{vocab} or None, got {top_k!r}")
    wide = logits.float()
    if temperature == 0.0:
        return wide.argmax(dim=-1)
    if top_k is not None and top_k < vocab:
        kth = wide.topk(top_k, dim=-1).values[..., -1:]
        wide = wide.masked_fill(wide < kth, float("-inf"))
    where = generator.device if generator is not None else torch.device("cpu")
    probs = torch.softmax(wide.to(where) / temperature, dim=-1)
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
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if prompt.dtype != torch.long or prompt.dim() not in (1, 2) or prompt.shape[-1] == 0:
        raise ValueError(
            f"prompt must be non-empty int64 ids of shape (T,) or (batch, T), got "
            f"{prompt.dtype} {tuple(prompt.shape)}"
        )
    if int(prompt.min()) < 0 or int(prompt.max()) >= BYTE_VOCAB:
        raise ValueError(f"prompt ids must lie in 0..{BYTE_VOCAB - 1}")
    plen = prompt.shape[-1]
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
    ids = (prompt[None, :] if prompt.dim() == 1 else prompt).to(model.ctx.device)
    step = model.decode_step if decode_step is None else decode_step
    was_training = model.training
    model.eval()
    try:
        caches = model.new_caches(ids.shape[0], length) if use_cache else None
        nxt = ids[:, -1:]
        # The position of the first decoded id, moved on the device after each step (a new
        # tensor from the host every step would wait for the device on CUDA).
        pos = torch.tensor(plen, dtype=torch.long, device=ids.device)
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
            nxt = next_token(logits, temperature, top_k, generator)[:, None]
            ids = torch.cat((ids, nxt), dim=1)
    finally:
        model.train(was_training)
    return ids[0] if prompt.dim() == 1 else ids


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
    step = model.decode_step if decode_step is None else decode_step
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
