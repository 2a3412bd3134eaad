"""``calibrate_kv``: the per-head amax of keys and values, for the static fp8 KV schemes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from computectx._checks import fault
from computectx.nn.attention import Attention

__all__ = ["calibrate_kv"]


@torch.no_grad()
def calibrate_kv(model: nn.Module, batches: Iterable[object]) -> dict[str, torch.Tensor]:
    """Record each head's amax of keys and values in every ``Attention`` of ``model`` over
    ``batches`` and store it in the layers' ``kv_amax`` buffers; return ``{layer name:
    amax (2, H)}`` (row 0 keys, row 1 values).

    Each batch is passed to ``model`` as it is (``model(batch)``: byte ids for a ``ByteLM``),
    in eval mode and without gradients; keys are measured after RoPE, as they enter the
    cache. The static fp8 KV schemes take their steps from this amax (``per_head``: each
    head's ``amax / fmt.max``; ``per_tensor``: the largest head's), whatever the format,
    so one calibration serves e4m3 and e5m2, per head and per tensor. The buffers are saved
    and loaded with the weights (``save_weights`` / ``load_weights``). A new calibration
    replaces the old one.

    ``ValueError`` when ``model`` has no ``Attention``, when ``batches`` is empty or a batch
    is an empty tensor (``(B, 0)`` ids, say: no position to measure), or when a
    head's amax is not finite or is zero (a head that saw only zeros has no scale to learn);
    nothing is stored then: every layer keeps its previous amax. Each module's training
    mode is restored as it was, whatever happens.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"calibrate_kv: model must be an nn.Module, got {type(model).__name__}")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"calibrate_kv: {type(model).__name__} has no Attention layer")
    # Each module's own mode comes back (a frozen submodule kept in eval stays there), not
    # the root's mode spread over every module by model.train(...).
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    count = 0
    try:
        for _, layer in layers:
            layer.kv_observed = torch.zeros_like(layer.kv_amax)
        for batch in batches:
            if isinstance(batch, torch.Tensor) and batch.numel() == 0:
                raise ValueError(
                    f"calibrate_kv: batch {count} has shape {tuple(batch.shape)}, no positions "
                    f"to measure; every batch needs at least one row and one position; "
                    f"nothing was stored"
                )
            model(batch)
            count += 1
        seen = {name: layer.kv_observed for name, layer in layers}
    finally:
        for _, layer in layers:
            layer.kv_observed = None
        for m, training in modes:
            m.training = training
    if count == 0:
        raise ValueError("calibrate_kv: batches is empty; calibration needs at least one batch")
    found: dict[str, torch.Tensor] = {}
    for name, amax in seen.items():
        if amax is None:  # pragma: no cover - armed above, for the type checker
            raise RuntimeError(f"calibrate_kv: {name} lost its running amax")
        bad = ~(torch.isfinite(amax) & (amax > 0))
        if bool(bad.any()):
            which, head = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"calibrate_kv: {name or 'the model'} {'keys' if which == 0 else 'values'} of "
                f"head {head} have an amax that is {fault(amax[which, head])} over {count} "
                f"batch(es); a "
                f"calibrated amax must be finite and positive (non-finite inputs, or a head "
                f"that saw only zeros); nothing was stored"
            )
        found[name] = amax.clone()
    for name, layer in layers:
        layer.kv_amax.copy_(found[name])
    return found
