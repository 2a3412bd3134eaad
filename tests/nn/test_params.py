"""``ctx.BuiltUnder``: a block's ``ctx`` is the policy it was built under."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from computectx import ComputeCtx, DType
from computectx.ctx import BuiltUnder
from computectx.nn import MLP, ByteLM, LMConfig, RMSNorm

BF16 = ComputeCtx.new(DType.BF16, "cpu")
F32 = ComputeCtx.new(DType.F32, "cpu")
CONFIG = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32, max_len=16)


def _blocks(model: nn.Module) -> list[BuiltUnder]:
    return [m for m in model.modules() if isinstance(m, BuiltUnder)]


def test_assigning_a_built_models_ctx_is_refused_and_changes_nothing() -> None:
    # Before, `model.ctx = F32` replaced the LM's own ctx while its blocks kept BF16's
    # (half a policy, silently).
    model = ByteLM(BF16, CONFIG)
    blocks = _blocks(model)
    assert len(blocks) > 5  # the LM, norms, attention, rope, MLPs: every block holds its ctx
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for block in blocks:
        with pytest.raises(AttributeError, match=r"policy it was built under.*Build a new"):
            block.ctx = F32
        assert block.ctx is BF16
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())


def test_the_ctx_is_set_once_by_the_constructor_and_survives_copies() -> None:
    norm = RMSNorm(F32, 8)
    assert norm.ctx is F32
    twin = copy.deepcopy(MLP(BF16, 32, 32))
    assert twin.ctx == BF16
    with pytest.raises(AttributeError):
        twin.ctx = F32
    with pytest.raises(TypeError, match="ctx must be a ComputeCtx, got str"):
        RMSNorm("bf16", 8)  # type: ignore[arg-type]
