"""``enable_fp4_expert_gather`` in one process (``distributed.fp4_expert_gather``): which
weights it wraps, what it leaves alone, and that a wrapped weight is its high-precision
tensor everywhere but FSDP2's gather (the 2-rank runs: ``test_fp4_expert_fsdp.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import ExpertsGatheredFp4, enable_fp4_expert_gather
from computectx.formats import convert_to_quantized
from computectx.nn import GroupedExperts

F32 = ComputeCtx.from_flag("fp32", "cpu")


def _model() -> nn.ModuleDict:
    torch.manual_seed(0)
    m = nn.ModuleDict({"a": GroupedExperts(F32, 32, 32, 4), "b": GroupedExperts(F32, 32, 32, 4)})
    convert_to_quantized(m, ComputeCtx.from_flag("nvfp4", "cpu"), min_features=16)
    return m


def test_it_wraps_the_4_bit_experts_weights_but_skipped_ones_and_saves_plain_tensors() -> None:
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    skipped = m["b"].gate_up
    assert enable_fp4_expert_gather(m, skip=frozenset({id(skipped)})) == 1
    assert isinstance(m["a"].gate_up, ExpertsGatheredFp4) and isinstance(m["a"].down, nn.Parameter)
    assert m["b"].gate_up is skipped and not isinstance(m["b"].down, ExpertsGatheredFp4)
    assert enable_fp4_expert_gather(m) == 1  # "a" is wrapped already; "b" now
    state = m.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    assert all(torch.equal(state[k], v) for k, v in before.items())
    # Everywhere but FSDP2's gather the weight is its high-precision tensor.
    w = m["a"].gate_up
    assert torch.equal(w * 2, before["a.gate_up"] * 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x, offs = torch.randn(6, 32), torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    torch.autograd.backward(m["a"](x, offs).square().sum())
    opt.step()
    assert not torch.equal(m["a"].gate_up.hp, before["a.gate_up"])


def test_it_leaves_high_precision_experts_alone_and_refuses_what_is_no_module() -> None:
    m = nn.ModuleDict({"a": GroupedExperts(F32, 32, 32, 4)})
    assert enable_fp4_expert_gather(m) == 0
    assert type(m["a"].gate_up) is nn.Parameter
    with pytest.raises(TypeError, match=r"takes the converted nn\.Module, got Tensor"):
        enable_fp4_expert_gather(torch.zeros(1))  # type: ignore[arg-type]
