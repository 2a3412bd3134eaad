"""Mixture-of-experts pieces of ``computectx.distributed`` in one process: the fp8 expert
gather's round trip, its state dict, the router-bias update, and the errors."""

from __future__ import annotations

import pytest
import torch

from computectx import ComputeCtx
from computectx.distributed import (
    ExpertsGatheredQuantized,
    enable_quantized_expert_gather,
    expert_parallel,
    parallelize,
    update_expert_bias,
)
from computectx.distributed.fp8_expert_gather import dequantize_expert_blocks
from computectx.formats import Backend, Recipe, quantized_grouped_mm
from computectx.formats.seam import quantize_blocks, step_rule_of
from computectx.nn import ByteLM, LMConfig, MoE

CONFIG = LMConfig(
    d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=16, n_experts=4, top_k=2,
    moe_hidden=32, moe_bias_rate=0.05,
)  # fmt: skip


@pytest.mark.parametrize("power_of_two", [False, True])
def test_gathered_expert_codes_requantize_to_the_same_gemm(power_of_two: bool) -> None:
    # What a rank sends (each expert's 128x128 codes and steps), rebuilt, is quantized by
    # the grouped GEMM to the same codes: the GEMM equals the one on the weight itself (the
    # amax rule's steps may move by an ulp: within 2**-20 of it).
    policy = Recipe(granularity="block", power_of_two=power_of_two)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 160, 136, generator=gen)
    w[1] *= 1e4
    fmt, rule = policy.format.forward, step_rule_of(policy)
    ref = Backend.REFERENCE
    pieces = [quantize_blocks(w[e], fmt, "128x128", rule, None, backend=ref) for e in range(3)]
    codes = torch.stack([c.view(torch.uint8) for c, _ in pieces]).view(fmt.torch)
    steps = torch.stack([s for _, s in pieces])
    rebuilt = dequantize_expert_blocks(codes, steps, torch.float32)
    x = torch.randn(40, 136, generator=gen)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    want = quantized_grouped_mm(x, w, offs, policy)
    got = quantized_grouped_mm(x, rebuilt, offs, policy)
    if power_of_two:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2.0**-20, atol=0.0)


def test_fp8_expert_gather_wraps_block_experts_and_saves_plain_tensors() -> None:
    ctx = ComputeCtx.from_flag("fp8_block", "cpu")
    torch.manual_seed(0)
    model = ByteLM(ctx, CONFIG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert enable_quantized_expert_gather(model, world=2) == 1
    experts = model.moe_layers()[0].experts
    assert isinstance(experts.gate_up.data, ExpertsGatheredQuantized)
    assert isinstance(experts.gate_up.detach(), ExpertsGatheredQuantized)
    state = model.state_dict()
    for key in ("blocks.0.mlp.experts.gate_up", "blocks.0.mlp.experts.down"):
        assert type(state[key]) is torch.Tensor
        assert torch.equal(state[key], before[key])
    # Three experts cannot be whole in each of 2 shards: they gather high precision, warned.
    odd = ByteLM(ctx, CONFIG.model_copy(update={"n_experts": 3}))
    with pytest.warns(UserWarning, match="3 experts"):
        assert enable_quantized_expert_gather(odd, world=2) == 0


def test_one_process_parallel_step_moves_router_biases_as_the_model_does() -> None:
    ctx = ComputeCtx.from_flag("fp32", "cpu")
    torch.manual_seed(0)
    model = ByteLM(ctx, CONFIG)
    twin = ByteLM(ctx, CONFIG)
    twin.load_state_dict(model.state_dict())
    par = parallelize(model, ctx, optimizer_class=torch.optim.SGD, lr=0.1)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    for m, step in ((model, par.step), (twin, opt.step)):
        m.loss(ids[:, :-1], ids[:, 1:]).backward()  # type: ignore[no-untyped-call]
        step()
    twin.update_expert_bias()
    bias = model.moe_layers()[0].router.bias
    assert bias.abs().sum() > 0
    assert torch.equal(bias, twin.moe_layers()[0].router.bias)
    assert int(model.moe_layers()[0].tokens_per_expert.sum()) == 0
    # Again with nothing counted: nothing moves.
    update_expert_bias(model)
    assert torch.equal(bias, twin.moe_layers()[0].router.bias)


def test_expert_parallel_needs_torch_distributed() -> None:
    moe = MoE(ComputeCtx.from_flag("fp32", "cpu"), 32, 32, 4, 2)
    with pytest.raises(RuntimeError, match="not initialised"):
        expert_parallel(moe)


def test_update_expert_bias_checks_every_layer_before_moving_any() -> None:
    # Layer 1's router bias is NaN: layer 0's bias and counts must not move before the refusal.
    ctx = ComputeCtx.from_flag("fp32", "cpu")
    torch.manual_seed(0)
    first, second = MoE(ctx, 16, 16, 4, 2), MoE(ctx, 16, 16, 4, 2)
    model = torch.nn.Sequential(first, second)
    model(torch.randn(8, 16)).sum().backward()
    for bad in (float("nan"), float("inf")):
        with torch.no_grad():
            second.router.bias[2] = bad
        before = {k: v.clone() for k, v in model.named_buffers()}
        refused = r"1: the router bias must be finite.*no layer's bias or count"
        with pytest.raises(ValueError, match=refused):
            update_expert_bias(model)
        for k, v in model.named_buffers():
            assert torch.equal(v.nan_to_num(), before[k].nan_to_num()), k
    # A bias that its step of bias_rate would overflow is refused alike (every expert at
    # 3e38: the ones below the mean load would step up to inf).
    with torch.no_grad():
        second.router.bias.fill_(3e38)
    second.bias_rate = 3e38
    with pytest.raises(ValueError, match=r"1: the router bias after update_bias must be finite"):
        update_expert_bias(model)
    assert int(first.tokens_per_expert.sum()) > 0


@pytest.mark.parametrize(
    ("max_norm", "error"),
    [(float("nan"), ValueError), (-1.0, ValueError), (0, ValueError), ("1", TypeError),
     (None, TypeError), (True, TypeError)],
)  # fmt: skip
def test_clip_grad_norm_with_experts_refuses_a_bad_max_norm_first(
    max_norm: object, error: type[Exception]
) -> None:
    from computectx.distributed import clip_grad_norm_with_experts

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(error, match=r"max_norm must be a real number > 0"):
        clip_grad_norm_with_experts([p], (p,), None, max_norm)  # type: ignore[arg-type]
    assert torch.equal(p.grad, torch.ones(3))


def test_the_expert_helpers_import_from_the_package() -> None:
    import computectx.distributed as cd

    for name in ("clip_grad_norm_with_experts", "expert_parameters", "moe_local_buffers"):
        assert name in cd.__all__ and callable(getattr(cd, name)), name


def test_the_gather_classes_keep_their_constructors() -> None:
    """The two FSDP2 gather classes share a base; each keeps its own second argument's name."""
    import inspect

    from computectx.distributed import ExpertsGatheredQuantized, WeightGatheredQuantized

    assert list(inspect.signature(ExpertsGatheredQuantized).parameters) == ["hp", "name"]
    assert list(inspect.signature(WeightGatheredQuantized).parameters) == ["hp", "gather"]
    w = ExpertsGatheredQuantized(torch.zeros(2, 3, 4), name="w1")
    assert isinstance(w, ExpertsGatheredQuantized) and "w1" in repr(w)
    assert torch.equal(w.hp, torch.zeros(2, 3, 4))


def test_fp8_expert_gather_refuses_tied_experts_naming_every_holder() -> None:
    # Each holder wrapped apart made two Parameters of one (the tie broken, Adam stepping
    # the weight twice), as the 4-bit gather did: refused before any weight changes.
    from torch import nn

    from computectx.formats import convert_to_quantized
    from computectx.nn import GroupedExperts

    f32 = ComputeCtx.from_flag("fp32", "cpu")
    torch.manual_seed(0)
    m = nn.ModuleDict({"a": GroupedExperts(f32, 32, 32, 4), "b": GroupedExperts(f32, 32, 32, 4)})
    convert_to_quantized(m, ComputeCtx.from_flag("fp8_block", "cpu"), min_features=16)
    m["b"].gate_up, m["b"].down = m["a"].gate_up, m["a"].down
    held = [id(p) for p in m.parameters()]
    with pytest.raises(ValueError, match=r"a\.gate_up is tied: .* a\.gate_up and b\.gate_up"):
        enable_quantized_expert_gather(m, world=2)
    assert [id(p) for p in m.parameters()] == held and type(m["a"].down) is nn.Parameter
    assert enable_quantized_expert_gather(m, 2, skip=frozenset({id(m["a"].down)})) == 0
    assert m["a"].gate_up is m["b"].gate_up
    with pytest.raises(TypeError, match="skip is a frozenset of the weights' ids"):
        enable_quantized_expert_gather(m, 2, skip={id(m["a"].down)})  # type: ignore[arg-type]
