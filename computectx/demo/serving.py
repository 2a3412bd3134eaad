"""The demo's serving section: each trained model's validation loss through the KV cache.

For every trained policy and every KV setting of ``SERVING_KV`` (f32, bf16, fp8
``per_token_head``: the ones that need no calibration), the trained weights are loaded into
a model of the same policy with that ``kv`` (``ctx.with_kv``), and the validation batches
run through the cached decode path (``computectx.nn.decode_logits``: the first byte in one
pass, then one ``decode_step`` per byte, every earlier key and value read back from the
cache, as generation reads them). The f32 row is the reference: the cache then rounds
nothing, and its loss equals the full forward's up to float reassociation.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from computectx.dtypes import DType
from computectx.kv_policy import KvFp8, parse_kv
from computectx.nn import ByteLM, decode_logits

__all__ = ["SERVING_KV", "ServingRow", "serving_rows"]

SERVING_KV: tuple[str, ...] = ("f32", "bf16", "e4m3/per_token_head")
"""The KV settings of the serving section, in table order (text forms of ``ctx.kv``)."""


@dataclasses.dataclass(frozen=True)
class ServingRow:
    """One trained policy read through one KV setting."""

    kv: str
    """The KV setting's text form (``"e4m3/per_token_head"``)."""
    val_loss: float
    """Mean next-byte loss of the validation batches through the cached decode path."""
    kv_bytes_per_token: int
    """Bytes of KV cache one more position costs, over every layer."""
    decode_tokens_per_s: float
    """Bytes decoded per second along the way (every row of a batch counts)."""


def _with_kv(model: ByteLM, kv: DType | KvFp8) -> ByteLM:
    """A copy of ``model`` (same weights and fp8 state) whose caches store ``kv``."""
    if model.ctx.kv == kv:
        return model
    twin = ByteLM(model.ctx.with_kv(kv), model.config)
    twin.load_state_dict(model.state_dict())
    return twin


@torch.no_grad()
def serving_rows(
    model: ByteLM,
    val: list[tuple[torch.Tensor, torch.Tensor]],
    kvs: tuple[str, ...] = SERVING_KV,
) -> list[ServingRow]:
    """One ``ServingRow`` per setting of ``kvs`` for the trained ``model`` on the validation
    batches ``val`` (all batches decoded together, one position per step). ``model`` is
    left as it was (mode and weights)."""
    if not val:
        raise ValueError("serving_rows needs at least one validation batch")
    dev = model.ctx.device
    ids = torch.cat([x for x, _ in val]).to(dev)
    targets = torch.cat([y for _, y in val]).to(dev)
    rows = []
    for text in kvs:
        kv = parse_kv(text)
        if isinstance(kv, KvFp8) and kv.static:
            raise ValueError(
                f"the serving section runs settings that need no calibration; got kv={text}"
            )
        served = _with_kv(model, kv)
        t0 = time.perf_counter()
        logits = decode_logits(served, ids)
        seconds = time.perf_counter() - t0
        rows.append(
            ServingRow(
                kv=str(kv),
                val_loss=float(served.loss_of(logits, targets)),
                kv_bytes_per_token=served.kv_bytes_per_token(),
                decode_tokens_per_s=ids.numel() / seconds if seconds > 0 else float("inf"),
            )
        )
    return rows
