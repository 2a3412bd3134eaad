"""Scenarios for the fp8 scaling state as buffers on many ranks (``test_scaling_state.py``).

DDP must not broadcast the scaling buffers (the amax sync merges them; a rank-local ledger
is the rank's own), and a model built on the meta device, sharded with ``fully_shard``,
materialised with ``to_empty`` and initialised trains as one built on the CPU.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx
from computectx.distributed import (
    enable_quantized_all_gather,
    parallelize,
    scaling_buffer_names,
    sync_scaling,
)
from computectx.formats import QuantizedLinear, ScalingNotSyncedWarning, convert_to_quantized
from computectx.nn import MoE
from computectx.recipes import DelayedScaling

WIDTH = 32


def _ctx() -> ComputeCtx:
    return ComputeCtx.from_flag("fp8_hybrid", "cpu")


def _plain() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))


def _fp8(model: nn.Module) -> nn.Module:
    convert_to_quantized(model, _ctx(), module_filter=lambda module, fqn: True)
    return model


def _x(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, WIDTH, generator=gen) * (1.0 + 30 * rank)


def _scaling(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every scaling buffer of ``model`` by name (copies)."""
    names = set(scaling_buffer_names(model))
    return {k: t.detach().clone() for k, t in model.named_buffers() if k in names}


def ddp_leaves_the_scaling_buffers_alone(params: dict[str, Any]) -> dict[str, Any]:
    """Rank-local scaling under DDP (``sync.remove()``), against a copy of the model that
    no wrapper touches, fed the same data: training forwards and an eval-mode forward and
    backward with gradients on (DDP broadcasts buffers before each), no optimizer step."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _fp8(_plain())
    twin = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    sync_scaling(ddp).remove()  # each rank scales on its own, by choice
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScalingNotSyncedWarning)
        for step in range(3):
            if step == 2:
                ddp.eval()
                twin.eval()
            ddp(_x(step, rank)).square().mean().backward()
            twin(_x(step, rank)).square().mean().backward()
    torch.manual_seed(0)
    par = parallelize(_plain(), _ctx(), strategy="ddp", fp8_filter=lambda module, fqn: True)
    assert isinstance(par.model, DistributedDataParallel)
    return {
        "ddp": _scaling(model),
        "twin": _scaling(twin),
        "broadcast": sorted(ddp.named_module_buffers),
        "parallelize_broadcast": sorted(par.model.named_module_buffers),
        "parallelize_ignored": sorted(par.model.parameters_to_ignore),
    }


def meta_build_fully_shard(params: dict[str, Any]) -> dict[str, Any]:
    """The same fp8 MLP built on the meta device and on the CPU; each converted, (with
    ``gather="fp8"``) set to all-gather fp8, sharded with ``fully_shard``, materialised
    (``to_empty``, meta only), initialised with ``reset_parameters`` under one seed, synced
    and trained 3 steps with each rank's data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for build in ("meta", "cpu"):
        if build == "meta":
            with torch.device("meta"):
                model = _fp8(_plain())
        else:
            model = _fp8(_plain())
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        if params["gather"] == "fp8":
            enable_quantized_all_gather(model)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if build == "meta":
            everything = [*model.parameters(), *model.buffers()]
            out["was_meta"] = all(t.is_meta for t in everything)
            model.to_empty(device="cpu")
            out["materialised"] = not any(
                t.is_meta for t in [*model.parameters(), *model.buffers()]
            )
            fresh = _scaling(_fp8(_plain()))
            out["fresh"] = all(torch.equal(t, fresh[k]) for k, t in _scaling(model).items())
        torch.manual_seed(0)
        for layer in layers:
            layer.reset_parameters()
        sync = sync_scaling(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        outs = []
        for step in range(3):
            y = model(_x(step, rank))
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y.detach())
        sync.sync()
        out[f"{build}_outs"] = torch.stack(outs)
        out[f"{build}_scaling"] = _scaling(model)
    return out


def meta_build_each(params: dict[str, Any]) -> dict[str, Any]:
    """``meta_build_fully_shard`` once per gather of ``gathers``, in this one launch."""
    return {g: meta_build_fully_shard({**params, "gather": g}) for g in params["gathers"]}


def _fp8_seq(model: nn.Sequential) -> nn.Sequential:
    _fp8(model)
    return model


def _trained() -> nn.Module:
    """The fp8 MLP after two SGD steps (its ledgers seeded): a checkpoint."""
    torch.manual_seed(0)
    model = _fp8_seq(_plain())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ScalingNotSyncedWarning)
        for step in range(2):
            model(_x(step, 0)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return model


def rank0_checkpoint(params: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 alone loaded a trained checkpoint (its ledgers seeded); its first linear is
    frozen for serving, then ``parallelize``, a ``no_grad`` forward before any step, and
    (DDP) one step on the same batch on every rank: against one process of the checkpoint
    (served) and DDP where every rank loaded it (``every``: the step).
    Under DDP rank 1 built its own seed's model; under FSDP2 (which sends no weight) it
    loaded the checkpoint's trainable weights, not the frozen layer's weight nor any
    scaling state."""
    rank = dist.get_rank()
    saved = _trained().state_dict()
    x, lr = _x(9, 0), 0.05

    def frozen(model: nn.Sequential) -> nn.Sequential:
        first = model[0]
        assert isinstance(first, QuantizedLinear)
        first.freeze_for_serving()
        return model

    ref = _fp8_seq(_plain())
    ref.load_state_dict(saved)
    frozen(ref)
    codes = ref[0].weight_fp8
    assert isinstance(codes, torch.Tensor)
    with torch.no_grad():
        out: dict[str, Any] = {"ref": ref(x), "codes": codes.view(torch.uint8)}
    for strategy in ("ddp", "every", "fsdp"):  # every: DDP, every rank loaded it
        wrap: Literal["ddp", "fsdp"] = "fsdp" if strategy == "fsdp" else "ddp"
        torch.manual_seed(1 + rank)
        model = _fp8_seq(_plain())
        if rank == 0 or strategy == "every":
            model.load_state_dict(saved)
        elif strategy == "fsdp":
            weights = {k: v for k, v in saved.items() if k.endswith(("weight", "bias"))}
            model.load_state_dict({k: v for k, v in weights.items() if k != "0.weight"}, False)
        frozen(model)
        par = parallelize(
            model, _ctx(), strategy=wrap,
            optimizer_class=torch.optim.SGD, lr=lr,
            join_timeout=10.0,
        )  # fmt: skip
        codes = model[0].weight_fp8
        assert isinstance(codes, torch.Tensor)
        got: dict[str, Any] = {"scaling": _scaling(model), "codes": codes.view(torch.uint8)}
        with torch.no_grad():
            got["served"] = par.model(x).detach().clone()
        if strategy == "fsdp":  # a layer frozen after the wrap: refused, nothing changed
            before = _bytes(model)
            head = model[2]
            assert isinstance(head, QuantizedLinear)
            got["late_freeze"] = _error(head.freeze_for_serving)
            got["late_unchanged"] = _same(before, _bytes(model))
        else:
            par.model(x).square().mean().backward()
            par.step()
            got["stepped"] = [p.detach().clone() for p in model.parameters()]
        out[strategy] = got
    return out


def _bytes(model: nn.Module) -> dict[str, Any]:
    """Every parameter and buffer of ``model`` as bytes (a DTensor's local shard), and DDP's
    list of what it leaves out."""
    out: dict[str, Any] = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        local = t.to_local() if isinstance(t, DTensor) else t
        out[n] = local.detach().contiguous().reshape(-1).view(torch.uint8).clone()
    out["ignored"] = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items()
    )


def _error(call: Any) -> str:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def refused_before_anything(params: dict[str, Any]) -> dict[str, Any]:
    """``parallelize(strategy="ddp")`` of models DDP would refuse, each with a frozen layer
    of each rank's own seed: ``shape``, a parameter of another shape on rank 1 ((4, 6)
    against (6, 4)); ``untrained``, every layer frozen and no bias (no parameter requires a
    gradient); ``policy``, rank 1's layers converted under an amax history of 8 where the ctx
    passed (rank 0's layers') keeps 16 (before: rank 1 alone raised convert_to_quantized's
    refusal after the agreement, rank 0 waited); ``experts_policy``, the same of an MoE's
    experts (built under each rank's ctx), the linears unconverted. The errors, and whether
    each rank's model stayed as it was."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for case in ("shape", "untrained", "policy", "experts_policy"):
        torch.manual_seed(1 + rank)
        if case in ("policy", "experts_policy"):
            recipe = _ctx().recipe
            assert recipe is not None
            short = recipe.model_copy(update={"scaling": DelayedScaling(history_len=8)})
            ctx = _ctx() if rank == 0 else _ctx().model_copy(update={"recipe": short})
            model = _plain()
            if case == "experts_policy":  # the experts built under each rank's ctx
                model = nn.Sequential(*model, MoE(ctx, WIDTH, WIDTH, 4, 2))
            else:
                convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
            layers = []
        elif case == "shape":
            model = _fp8_seq(_plain())
            shape = (4, 6) if rank == 0 else (6, 4)
            model.register_parameter("extra", nn.Parameter(torch.zeros(shape)))
            layers = [model[0]]
        else:
            model = _fp8_seq(nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False)))
            layers = list(model)
        for layer in layers:
            assert isinstance(layer, QuantizedLinear)
            layer.freeze_for_serving()
        before = _bytes(model)
        out[case] = _error(
            lambda model=model: parallelize(
                model, _ctx(), optimizer_class=torch.optim.SGD, lr=0.1, join_timeout=10.0
            )
        )
        out[f"{case}_unchanged"] = _same(before, _bytes(model))
    return out


def assign_load(params: dict[str, Any]) -> dict[str, Any]:
    """``parallelize(strategy="ddp")``, a backward, then ``load_state_dict(..., assign=True)``
    on every rank (new Parameter objects: DDP and the optimizer keep the old ones): the next
    step's outcome and whether the model's weights moved (before: three steps ran and trained
    nothing, adversarial s48 N2b)."""
    torch.manual_seed(0)
    model = _plain()
    par = parallelize(model, _ctx(), optimizer_class=torch.optim.SGD, lr=0.1, join_timeout=10.0)
    par.model(_x(0, dist.get_rank())).float().square().mean().backward()
    model.load_state_dict(model.state_dict(), assign=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    error = _error(par.step)
    same = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return {"error": error, "unchanged": same}


def wrapped(params: dict[str, Any]) -> dict[str, Any]:
    """The wraps' scenarios in one launch."""
    return {
        "leave": ddp_leaves_the_scaling_buffers_alone(params),
        "rank0": rank0_checkpoint(params),
        "refused": refused_before_anything(params),
        "assign": assign_load(params),
    }
