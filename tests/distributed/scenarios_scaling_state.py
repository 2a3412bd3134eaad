"""Scenarios for the fp8 scaling state as buffers on many ranks (``test_scaling_state.py``).

DDP must not broadcast the scaling buffers (the amax sync merges them; a rank-local ledger
is the rank's own), and a model built on the meta device, sharded with ``fully_shard``,
materialised with ``to_empty`` and initialised trains as one built on the CPU.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx
from computectx.distributed import (
    enable_quantized_all_gather,
    parallelize,
    scaling_buffer_names,
    sync_scaling,
)
from computectx.formats import QuantizedLinear, ScalingNotSyncedWarning, convert_to_quantized

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
