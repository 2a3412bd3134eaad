"""The blocks under an fp8 policy: linears are QuantizedLinear, the head stays, training works."""

from __future__ import annotations

import math

import pytest
import torch

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, convert_to_quantized, scaling_stats
from computectx.nn import MLP, Attention, ByteLM, LMConfig, encode_bytes, generate

CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu")
TINY = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48)


def _fp8_model() -> ByteLM:
    torch.manual_seed(0)
    return ByteLM(CTX, TINY)


def test_every_linear_but_the_head_runs_in_fp8() -> None:
    model = _fp8_model()
    expected = {
        f"blocks.{i}.{layer}"
        for i in range(2)
        for layer in ("attn.qkv", "attn.out", "mlp.gate", "mlp.up", "mlp.down")
    }
    assert set(model.fp8_layers()) == expected
    assert type(model.head) is torch.nn.Linear
    assert all(isinstance(m, QuantizedLinear) and m.ctx == CTX for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not model.head)  # fmt: skip
    # Converting again finds nothing left to do but the head it is told to leave alone.
    again = convert_to_quantized(model, CTX, min_features=16)
    assert again.converted == ()


def test_without_fp8_the_blocks_keep_plain_linears() -> None:
    model = ByteLM(ComputeCtx.from_flag("bf16", "cpu"), TINY)
    assert model.fp8_layers() == []
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_standalone_blocks_follow_ctx_fp8() -> None:
    mlp = MLP(CTX, 32, 64)
    attn = Attention(CTX, 32, 2, max_len=8)
    assert all(
        isinstance(m, QuantizedLinear) for m in (mlp.gate, mlp.up, mlp.down, attn.qkv, attn.out)
    )
    x = torch.randn(2, 5, 32)
    assert mlp(x).dtype == torch.bfloat16 and attn(x).shape == (2, 5, 32)


def test_fp8_blocks_refuse_widths_fp8_cannot_tile() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        MLP(CTX, 32, 40)
    with pytest.raises(ValueError, match="qkv: in_features=24"):
        Attention(CTX, 24, 2, max_len=8)


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
    stats = scaling_stats(model)
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


def test_a_4bit_recipe_keeps_its_hp_layers_of_a_standalone_block() -> None:
    # hp=*up keeps mlp.up high by choice: the block builds (it raised "cannot run its linears
    # in fp8"), the other two linears are 4-bit.
    from computectx.formats import Fp4Linear
    from computectx.fp4_recipe import Fp4Recipe

    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    ctx = ctx.replace(recipe=Fp4Recipe.parse("nvfp4+hp=up"))
    mlp = MLP(ctx, 32, 64)
    assert type(mlp.up) is torch.nn.Linear
    assert isinstance(mlp.gate, Fp4Linear) and isinstance(mlp.down, Fp4Linear)
    with pytest.raises(ValueError, match=r"cannot run its linears in nvfp4"):
        MLP(ComputeCtx.from_flag("nvfp4", "cpu"), 32, 40)  # 40: not a multiple of 16


def test_fp8_layers_lists_no_4bit_layer() -> None:
    # A 4-bit ByteLM's layers are Fp4Linear / Fp4Experts: none of them runs in fp8.
    from computectx.formats import Fp4Experts, Fp4Linear

    cfg = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=48, n_experts=4)
    model = ByteLM(ComputeCtx.from_flag("nvfp4", "cpu"), cfg)
    assert any(isinstance(m, Fp4Linear) for m in model.modules())
    assert any(isinstance(m, Fp4Experts) for m in model.modules())
    assert model.fp8_layers() == []
