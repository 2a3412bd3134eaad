"""ByteLM under an fp8 policy: linears swap to Fp8Linear, the head stays, training works."""

from __future__ import annotations

import math

import torch

from computectx import ComputeCtx
from computectx.fp8 import Fp8Linear, convert_to_fp8, fp8_stats
from computectx.nn import ByteLM, LMConfig, encode_bytes, generate

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")
TINY = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48)


def _fp8_model() -> ByteLM:
    torch.manual_seed(0)
    model = ByteLM(CTX, TINY)
    convert_to_fp8(model, CTX, min_features=16)
    return model


def test_every_linear_but_the_head_runs_in_fp8() -> None:
    model = _fp8_model()
    fp8 = {name for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == {
        f"blocks.{i}.{layer}"
        for i in range(2)
        for layer in ("attn.qkv", "attn.out", "mlp.gate", "mlp.up", "mlp.down")
    }
    assert type(model.head) is torch.nn.Linear


def test_fp8_model_trains_and_reports_finite_scales() -> None:
    model = _fp8_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = encode_bytes(b"for i in range(9): print(i)\n")[None, :]
    assert model(ids).dtype == torch.bfloat16
    losses = []
    for _ in range(15):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 1.0
    stats = fp8_stats(model)
    assert len(stats) == 10
    for layer in stats.values():
        for role in ("input", "weight", "grad"):
            s = layer[role]
            assert s.nonfinite_count == 0 and math.isfinite(s.step) and s.step > 0
            assert s.elements > 0


def test_fp8_model_generates_with_a_cache_at_kv_dtype() -> None:
    model = _fp8_model()
    caches = model.new_caches(1)
    assert all(c.dtype == torch.bfloat16 for c in caches)
    out = generate(model, encode_bytes("x = "), 10, temperature=0.7, top_k=10,
                   generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert out.shape == (14,) and out.dtype == torch.long
