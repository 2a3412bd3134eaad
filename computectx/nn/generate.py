"""Text generation from a ``ByteLM``: greedy or temperature/top-k sampling, KV-cached."""

from __future__ import annotations

import torch

from computectx.nn.lm import BYTE_VOCAB, ByteLM

__all__ = ["generate", "next_token"]


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
) -> torch.Tensor:
    """``prompt`` (int64 ids, ``(T,)`` or ``(batch, T)``) followed by ``max_new_tokens`` ids.

    With ``use_cache`` the prompt is run once into per-layer KV caches (stored at
    ``ctx.kv``) and each new id costs one position; without it every step recomputes the
    whole sequence (the reference the cached path is tested against). The two agree up to
    float reassociation when ``ctx.kv`` is at or above ``ctx.compute``; a narrower ``kv``
    rounds the cached keys and values, which is what that policy asks for. The result has
    the prompt's shape with ``max_new_tokens`` more positions.
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
    total = prompt.shape[-1] + max_new_tokens
    if total > model.config.max_len:
        raise ValueError(
            f"prompt of {prompt.shape[-1]} plus {max_new_tokens} new ids is {total} positions, "
            f"beyond the model's max_len={model.config.max_len}"
        )
    ids = (prompt[None, :] if prompt.dim() == 1 else prompt).to(model.ctx.device)
    was_training = model.training
    model.eval()
    try:
        caches = model.new_caches(ids.shape[0], total) if use_cache else None
        step_input = ids
        for _ in range(max_new_tokens):
            logits = model(step_input if use_cache else ids, caches)[:, -1, :]
            nxt = next_token(logits, temperature, top_k, generator)[:, None]
            ids = torch.cat((ids, nxt), dim=1)
            step_input = nxt
    finally:
        model.train(was_training)
    return ids[0] if prompt.dim() == 1 else ids
