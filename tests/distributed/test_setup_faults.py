"""Fault injection for the setup calls, in one process (a gloo world of one): ``expert_parallel``
and ``parallelize`` refused at each of their local checks in turn leave every parameter,
buffer, attribute, hook and submodule type of the model as it was (the ``freeze`` fixture,
tests/conftest.py: each module by all its attributes, hook dicts included, each tensor by its
values, metadata, storage and hooks).

What a world of one cannot reach: the checks that only many ranks make (an expert count the
group cannot divide, another expert-parallel group, the accumulator and optimizer rules of an
expert-parallel model, FSDP2 with an accumulator, ranks that disagree) run inside the same
``agree`` before anything changes and are tested on two ranks in test_expert_parallel_edges.py and
test_safety.py. Here every argument those paths read is checked too, so none of them can stop
``parallelize`` after the model changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx, DType
from computectx.distributed import expert_parallel, parallelize
from computectx.formats import convert_to_quantized
from computectx.memory import OffloadedOptimizer
from computectx.nn import MoE
from computectx.optim_state import OptimState

Freeze = Callable[..., object]
F32 = ComputeCtx.from_flag("fp32", "cpu")
FP8 = ComputeCtx.from_flag("fp8_hybrid", "cpu")
ALL: Callable[[nn.Module, str], bool] = lambda m, fqn: True  # noqa: E731


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 32)
        self.blocks = nn.ModuleList([MoE(F32, 32, 32, 4, 2), MoE(F32, 32, 32, 4, 2)])
        self.out = nn.Linear(32, 32)


def _refused(
    freeze: Freeze, model: nn.Module, call: Callable[[], object], error: type[Exception], match: str
) -> None:
    before = freeze(model)
    with pytest.raises(error, match=match):
        call()
    assert freeze(model) == before


def test_refused_expert_parallel_changes_nothing(world_of_one: None, freeze: Freeze) -> None:
    model = Net()
    moe = model.blocks[1]
    assert isinstance(moe, MoE)
    _refused(freeze, model, lambda: expert_parallel(model, join_timeout=-1), ValueError, "join")
    bad_group: Any = "all"
    _refused(freeze, model, lambda: expert_parallel(model, group=bad_group), TypeError, "group")

    # The second layer fails each check in turn; the first, which passes, is left alone too.
    experts = moe.experts
    moe.experts = nn.Linear(2, 2)  # type: ignore[assignment]
    _refused(freeze, model, lambda: expert_parallel(model), TypeError, "blocks.1.experts")
    moe.experts = experts

    moe.dispatch = object()  # type: ignore[assignment]
    _refused(freeze, model, lambda: expert_parallel(model), ValueError, "already has a dispatch")
    moe.dispatch = None

    mesh = init_device_mesh("cpu", (1,))
    whole = experts.gate_up
    experts.gate_up = nn.Parameter(distribute_tensor(whole.detach(), mesh, [Shard(0)]))
    _refused(freeze, model, lambda: expert_parallel(model), RuntimeError, "already sharded")
    experts.gate_up = whole

    # The control: the same model passes (and a world of one changes nothing).
    assert expert_parallel(model) == ["blocks.0", "blocks.1"]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


# name -> (ctx, parallelize's keywords, error, match)
PARALLELIZE_FAULTS: dict[str, tuple[Any, dict[str, Any], type[Exception], str]] = {
    "ctx": ("cpu", {}, TypeError, "ComputeCtx"),
    "strategy": (FP8, {"strategy": "zero3"}, ValueError, "strategy"),
    "join_timeout": (FP8, {"join_timeout": 0}, ValueError, "join_timeout"),
    "mp_policy type": (FP8, {"mp_policy": "bf16", "strategy": "fsdp"}, TypeError, "mp_policy"),
    "mp_policy under ddp": (FP8, {"mp_policy": MixedPrecisionPolicy()}, ValueError, "mp_policy"),
    "accumulate as text": (FP8, {"accumulate": "no"}, TypeError, "accumulate"),
    "offload as text": (FP8, {"offload": "no"}, TypeError, "offload"),
    "fp8_all_gather as text": (FP8, {"fp8_all_gather": "x"}, TypeError, "fp8_all_gather"),
    "fp8_filter": (FP8, {"fp8_filter": 3}, TypeError, "fp8_filter"),
    "fp8_filter raises": (FP8, {"fp8_filter": lambda m, f: 1 / 0}, ZeroDivisionError, "division"),
    "current_amax": (FP8, {"current_amax": "mine"}, ValueError, "current_amax"),
    "loss_normalization": (FP8, {"loss_normalization": "sum"}, ValueError, "loss_normalization"),
    "shard_units not a list": (FP8, {"shard_units": 3}, TypeError, "shard_units"),
    "shard_units stray": (FP8, {"shard_units": [nn.Linear(2, 2)]}, ValueError, "shard_units"),
    "optimizer_class text": (FP8, {"optimizer_class": "AdamW"}, TypeError, "optimizer_class"),
    "optimizer_class wrapper": (
        FP8,
        {"optimizer_class": OffloadedOptimizer, "offload": True},
        TypeError,
        "cannot itself",
    ),
    "learning rate": (FP8, {"lr": -1.0}, ValueError, "learning rate"),
    "unknown optimizer argument": (FP8, {"momentum": 0.9}, TypeError, "momentum"),
    # Refused by the OffloadedOptimizer itself: used to be after the model was converted.
    "LBFGS offloaded": (
        FP8,
        {"optimizer_class": torch.optim.LBFGS, "offload": True},
        ValueError,
        "LBFGS",
    ),
    "offloaded transfer": (FP8, {"offload": True, "transfer": "pinned"}, ValueError, "transfer"),
    "offloaded sharding": (FP8, {"offload": True, "sharding": None}, ValueError, "sharding"),
    "compact state, offload=False": (
        FP8.replace(optim_state=OptimState.parse("int8")),
        {"offload": False},
        ValueError,
        "optim_state",
    ),
}


@pytest.mark.parametrize("fault", sorted(PARALLELIZE_FAULTS))
def test_refused_parallelize_changes_nothing(fault: str, freeze: Freeze) -> None:
    ctx, kwargs, error, match = PARALLELIZE_FAULTS[fault]
    model = _mlp()
    call = lambda: parallelize(model, ctx, fp8_filter=ALL, **kwargs)  # noqa: E731
    if "fp8_filter" in kwargs:
        call = lambda: parallelize(model, ctx, **kwargs)  # noqa: E731
    _refused(freeze, model, call, error, match)


def test_parallelize_controls_pass(freeze: Freeze) -> None:
    # The faults above are refusals of these arguments, not of the model: each good twin
    # converts the model (so a change would have shown).
    for kwargs in (
        {},
        {"offload": True, "compile": False},
        {"accumulate": False, "loss_normalization": "global", "current_amax": "local"},
    ):
        model = _mlp()
        before = freeze(model)
        par = parallelize(model, FP8.replace(grad=DType.BF16), fp8_filter=ALL, **kwargs)
        assert freeze(model) != before and par.world_size == 1


def test_a_model_converted_under_another_policy_is_refused(freeze: Freeze) -> None:
    # A ctx without a recipe for an fp8-converted model: no sync kept the ranks' scaling in
    # step, and the replicas drifted apart silently (adversarial s48 I2); another recipe.
    for ctx in (F32, ComputeCtx.from_flag("fp8_rowwise", "cpu")):
        model = _mlp()
        convert_to_quantized(model, FP8, module_filter=ALL)
        call = lambda model=model, ctx=ctx: parallelize(model, ctx)  # noqa: E731
        _refused(freeze, model, call, ValueError, r"is already a QuantizedLinear under recipe")


def test_refused_parallelize_of_a_wrapped_model_changes_nothing(
    world_of_one: None, freeze: Freeze
) -> None:
    ddp = DistributedDataParallel(_mlp())
    _refused(freeze, ddp, lambda: parallelize(ddp, FP8), ValueError, "wrapped already")
    sharded = _mlp()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
    _refused(freeze, sharded, lambda: parallelize(sharded, FP8), ValueError, "wrapped already")


@pytest.mark.parametrize("end", ["rebuilt", "wrapper freed"])
def test_the_rebuild_joins_hooks_go_once_rebuilt_or_with_the_wrapper(
    world_of_one: None, end: str
) -> None:
    # The rebuild is recorded where DDP records its own (a WeakSet shadowed it: DDP's flag
    # stayed False), and join_until_rebuilt's two hooks go after it (they stayed for good),
    # the weight's with the wrapper (it stayed on the user's weight).
    import gc

    from computectx.distributed.parallel_steps import join_until_rebuilt, rebuild_ddp_buckets

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    run = DistributedDataParallel(net)
    before = len(run._forward_pre_hooks)
    join_until_rebuilt(run, dist.group.WORLD, 5.0)  # type: ignore[arg-type]
    weight = next(net.parameters())
    assert len(run._forward_pre_hooks) == before + 1 and weight._post_accumulate_grad_hooks
    run(torch.randn(3, 4)).sum().backward()
    if end == "rebuilt":
        rebuild_ddp_buckets(run)
        assert run._has_rebuilt_buckets
        run(torch.randn(3, 4)).sum().backward()
        assert len(run._forward_pre_hooks) == before
    else:
        del run
        gc.collect()
    assert not weight._post_accumulate_grad_hooks


def test_the_wraps_share_of_scaling_state_leaves_a_model_built_on_meta_alone(
    world_of_one: None,
) -> None:
    # docs/fp8.md, "The meta device": build on meta, shard, then to_empty. parallelize's share
    # of rank 0's scaling state (share_scaling) has nothing to send from meta: it copied out of
    # the meta tensors, torch's NotImplementedError on every rank (adversarial s47 G2; a world
    # of one never reaches it through parallelize, so the share itself is called here).
    from computectx.distributed.parallel_steps import share_scaling
    from computectx.formats import convert_to_quantized

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        convert_to_quantized(model, FP8, min_features=32)
    assert any(b.is_meta for b in model.buffers())  # the layers' scaling state
    group = dist.group.WORLD
    assert group is not None
    share_scaling(model, group)
    assert all(b.is_meta for b in model.buffers())


def test_the_ranks_compare_strides_meta_and_training_of_every_parameter() -> None:
    # What DDP refuses on one rank after the wrap sent rank 0's buffers (other strides, a
    # parameter that does not train on that rank), and a model built on meta on one rank
    # only (the wrap would copy out of it), differ in what check_same_model compares: every
    # rank refuses before anything is sent (adversarial s47 G1, G3, G4).
    from computectx.distributed.same_setup import _parameters_of

    def entries(model: nn.Module) -> list[tuple[str, object]]:
        return list(_parameters_of(model))

    plain = nn.Linear(4, 6)
    base = entries(plain)
    transposed = nn.Linear(4, 6)
    transposed.weight = nn.Parameter(torch.empty(4, 6).t())
    frozen = nn.Linear(4, 6)
    frozen.bias.requires_grad_(False)
    with torch.device("meta"):
        meta = nn.Linear(4, 6)
    for other in (transposed, frozen, meta):
        assert entries(other) != base
    assert entries(nn.Linear(4, 6)) == base


def test_the_ranks_compare_the_buffers_ddp_would_broadcast() -> None:
    # DDP's wrap broadcast rank 0's buffers into whatever each rank held: another dtype
    # aborted rank 1 in gloo after the frozen codes were written, another shape or size read
    # rank 0's bytes silently; scaling state on meta beside real weights made rank 1 alone
    # raise in the share (a 30 s hang). check_same_model compares them now (adversarial s48
    # I4, I5); the names a model lists for DDP to leave out stay each rank's own.
    from computectx.distributed.same_setup import _buffers_of

    def model(t: torch.Tensor, ignored: bool = False) -> nn.Module:
        m = nn.Linear(4, 4)
        m.register_buffer("count", t)
        if ignored:
            vars(m)["_ddp_params_and_buffers_to_ignore"] = ["count"]
        return m

    base = _buffers_of(model(torch.zeros(4)))
    for other in (torch.zeros(4, dtype=torch.float64), torch.zeros(5), torch.zeros(2, 2)):
        assert _buffers_of(model(other)) != base, other
    assert _buffers_of(model(torch.zeros(4, device="meta"))) != base
    assert _buffers_of(model(torch.ones(4))) == base  # values are the wrap's to send
    assert _buffers_of(model(torch.zeros(5), ignored=True)) == []


def test_the_step_refuses_replaced_weights_that_ddp_reduces_only(world_of_one: None) -> None:
    # Parallel.step's check under DDP (check_reduced): a trained weight replaced after the
    # wrap (load_state_dict(assign=True)) is refused; a requires_grad=False one, which DDP
    # never reduces, was refused too (adversarial s48 pass 6) and is not now.
    from computectx.distributed.parallel_steps import check_reduced

    emb, lin = nn.Embedding(8, 4), nn.Linear(4, 4)
    emb.weight.requires_grad_(False)
    run = DistributedDataParallel(nn.Sequential(emb, lin))
    run(torch.tensor([1, 2])).sum().backward()
    emb.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
    check_reduced(run)
    lin.weight = nn.Parameter(lin.weight.detach().clone())
    with pytest.raises(RuntimeError, match="1 of the weights it wraps are no longer the model's"):
        check_reduced(run)
