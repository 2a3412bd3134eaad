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


def _tied() -> nn.ModuleDict:
    m = _model()
    m["b"].gate_up, m["b"].down = m["a"].gate_up, m["a"].down
    return m


def test_tied_experts_weights_are_refused_naming_every_holder_and_nothing_changes() -> None:
    # Wrapping each holder apart made two Parameters of one: Adam stepped the weight twice.
    m = _tied()
    held = [id(p) for p in m.parameters()]
    with pytest.raises(ValueError, match=r"a\.gate_up is tied: .* a\.gate_up and b\.gate_up"):
        enable_fp4_expert_gather(m)
    assert [id(p) for p in m.parameters()] == held and m["a"].gate_up is m["b"].gate_up
    assert type(m["a"].gate_up) is nn.Parameter
    # Left out (parallelize's way: tied weights gather high precision), the tie holds.
    assert enable_fp4_expert_gather(m, skip=frozenset({id(m["a"].gate_up)})) == 0
    assert m["a"].gate_up is m["b"].gate_up and m["a"].down is m["b"].down


@pytest.mark.parametrize(
    ("skip", "got"),
    [(set(), "set"), ([], "list"), (None, "NoneType"), (7, "int"), (frozenset({"w"}), "str")],
)
def test_skip_that_is_no_frozenset_of_ids_is_our_type_error(skip: object, got: str) -> None:
    m = _model()
    with pytest.raises(TypeError, match=f"skip is a frozenset of the weights' ids .*got .*{got}"):
        enable_fp4_expert_gather(m, skip=skip)  # type: ignore[arg-type]
    assert type(m["a"].gate_up) is nn.Parameter


def test_the_wrappers_view_and_detach_under_inference_mode() -> None:
    # FSDP2's lazy init views each shard (local_tensor.view(-1)) at the first forward, which
    # may run under inference_mode: the shared base (GatheredAsFp8), dense fp4 and fp8 too,
    # and the gathered experts' own detach. Each stays a normal tensor, not an inference one.
    from computectx.distributed._fp8_gather import GatherMeta
    from computectx.distributed.fp4_all_gather import WeightGatheredFp4
    from computectx.distributed.fp4_all_gather import _Gather as Dense4
    from computectx.distributed.fp8_all_gather import WeightGatheredQuantized
    from computectx.distributed.fp8_all_gather import _Gather as Dense8
    from computectx.formats import Fp4Experts, Fp4Recipe

    wrapped = [
        ExpertsGatheredFp4(torch.randn(2, 32, 32), GatherMeta("experts.gate_up")),
        WeightGatheredFp4(torch.randn(32, 32), Dense4("lin.weight")),
        WeightGatheredQuantized(torch.randn(32, 32), Dense8("lin.weight")),
    ]
    spec = Fp4Experts(Fp4Recipe.parse("nvfp4")).experts_gather
    gathered = spec.experts(spec.expert_inputs(torch.randn(2, 32, 32)), torch.float32)
    with torch.inference_mode():
        for w in wrapped:
            flat = w.view(-1)
            assert type(flat) is type(w) and not flat.is_inference(), type(w).__name__
            assert torch.equal(flat, w.hp.view(-1))
        alias = gathered.detach()
        assert type(alias) is type(gathered) and not alias.is_inference()
    with torch.inference_mode():  # made under the mode: pieces of it are inference tensors
        inner = ExpertsGatheredFp4(torch.randn(2, 32, 32), GatherMeta("e"))
        assert inner.view(-1).is_inference()
