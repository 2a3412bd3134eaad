"""Frozen weights left out of DDP's broadcasts (``linear.frozen_ddp``): every float8 and
float4 buffer of a frozen model is named in its ``_ddp_params_and_buffers_to_ignore`` (gloo
sends neither), whether fp8 layers and experts were frozen one by one
(``exclude_frozen_from_ddp``) or by ``load_serving_weights(mode="serve")``. The 2-rank launch
wrapping such models in DDP is ``tests/distributed/test_fp4_ranks.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx, KvFp8
from computectx.formats import (
    QuantizedLinear,
    convert_to_quantized,
    exclude_frozen_from_ddp,
    load_serving_weights,
    serving_weights,
)
from computectx.nn import ByteLM, GroupedExperts, LMConfig

UNSENDABLE = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2}
"""What gloo refuses to broadcast ('Invalid scalar type')."""


def unsendable(model: nn.Module) -> set[str]:
    return {n for n, b in model.named_buffers() if b.dtype in UNSENDABLE}


def fp8_moe_lm() -> ByteLM:
    torch.manual_seed(0)
    moe = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=8, n_experts=2, top_k=1)
    return ByteLM(ComputeCtx.from_flag("fp8_hybrid", "cpu").with_kv(KvFp8()), moe)


def test_fp8_layers_and_experts_frozen_one_by_one_are_left_out() -> None:
    model = fp8_moe_lm()
    assert not unsendable(model)  # the fp8 KV cache is no buffer of the model: nothing to do
    for m in model.modules():
        if isinstance(m, QuantizedLinear | GroupedExperts):
            m.freeze_for_serving()
    assert "blocks.0.mlp.experts.gate_up_fp8" in unsendable(model)
    ignore = DistributedDataParallel._set_params_and_buffers_to_ignore_for_model
    ignore(model, ["mine"])  # type: ignore[no-untyped-call]  # a user's entry stays
    names = exclude_frozen_from_ddp(model)
    assert {"blocks.0.mlp.experts.down_step", "blocks.0.attn.qkv.weight_step"} <= set(names)
    assert unsendable(model) <= set(names)
    assert model._ddp_params_and_buffers_to_ignore == ["mine", *names]
    assert exclude_frozen_from_ddp(model) == names  # each name once, however often
    assert model._ddp_params_and_buffers_to_ignore == ["mine", *names]


def test_a_serve_load_leaves_the_codes_out_and_a_train_load_nothing() -> None:
    def model(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        seq = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        convert_to_quantized(
            seq, ComputeCtx.from_flag("fp8_hybrid", "cpu"), include_head=True, min_features=16
        )
        return seq

    given = serving_weights(model(0))
    trained = model(1)
    load_serving_weights(trained, given, mode="train")
    assert not hasattr(trained, "_ddp_params_and_buffers_to_ignore")
    served = model(1)
    load_serving_weights(served, given, mode="serve")
    # Each frozen linear's codes and step, and its scaling state (its forward reads its input
    # ledger): none of them is broadcast before a forward, which one rank may run alone.
    scaling = [f"fp8_{r}_{p}" for r in ("input", "weight", "grad") for p in ("ledger", "tally")]
    held = [f"{i}.{n}" for i in (0, 2) for n in ("weight_fp8", "weight_step", *scaling, "fp8_meta")]
    assert served._ddp_params_and_buffers_to_ignore == held


def test_a_ddp_wrapped_model_is_refused_before_anything_changes() -> None:
    seq = nn.Sequential(nn.Linear(32, 32))
    convert_to_quantized(
        seq, ComputeCtx.from_flag("fp8_hybrid", "cpu"), include_head=True, min_features=16
    )
    given = serving_weights(seq)
    # A DistributedDataParallel around it without a process group (its construction takes 2
    # s): only its class matters to the refusal; the 2-rank launch wraps real ones.
    wrapped = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(wrapped)
    wrapped.module = seq
    for model in (wrapped, nn.Sequential(wrapped)):
        with pytest.raises(TypeError, match=r"DistributedDataParallel; call this on"):
            exclude_frozen_from_ddp(model)
        assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
        with pytest.raises(TypeError, match=r"DistributedDataParallel; load into the"):
            load_serving_weights(model, given, mode="serve")
        assert not seq[0].frozen
