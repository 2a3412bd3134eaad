"""DTensor activations and tensor parallelism: every amax is the whole tensor's.

Each function is one launch of ``conftest.run_ranks``. On one rank (the reference) the
same model runs as plain tensors on the whole batch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from computectx import ComputeCtx, DType
from computectx.distributed.collectives import GroupAmax, whole_amax
from computectx.formats import DynamicScaling, QuantizedLinear, Recipe, convert_to_quantized
from computectx.formats.numerics import tensorwise

WIDTH = 32
ROWS = 8


def amax_placements(params: dict[str, Any]) -> dict[str, Any]:
    """The amax of DTensors of each placement, through ``whole_amax`` and ``GroupAmax``:
    always the max over the whole tensor, on every rank; a NaN in one shard is +inf."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    seam = GroupAmax(mesh.get_group(0))
    local = torch.arange(4, dtype=torch.float32) * (1 + 10 * rank) - 1.0  # rank 1: 29 at most
    out: dict[str, Any] = {}
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    a = sharded.abs().amax().reshape(1)  # torch's amax of a sharded DTensor: Partial("max")
    out["amax_placements"] = str(a.placements) if isinstance(a, DTensor) else "plain"
    out["sharded"] = seam(a)
    out["sharded_whole"] = whole_amax(a)
    out["reference"] = seam(tensorwise.amax(sharded))  # replicated by its torch.where
    partial = DTensor.from_local(local.abs().amax().reshape(1), mesh, [Partial("max")])
    out["partial_max"] = seam(partial)
    replicated = DTensor.from_local(torch.tensor([7.0]), mesh, [Replicate()], run_check=False)
    out["replicate"] = whole_amax(replicated)
    summed = DTensor.from_local(torch.tensor([1.5]), mesh, [Partial("sum")], run_check=False)
    out["partial_sum"] = whole_amax(summed)  # the DTensor's value: the sum over ranks
    poisoned = local.clone()
    if rank == world - 1:
        poisoned[1] = math.nan
    nan_shard = DTensor.from_local(poisoned, mesh, [Shard(0)], run_check=False)
    out["nan"] = seam(nan_shard.abs().amax().reshape(1))
    out["argument_kept"] = isinstance(a, DTensor)
    return out


def _ctx(scaling: str) -> ComputeCtx:
    # float32 outputs: a row-wise layer sums float32 partial products, so the comparison
    # with one process is not blurred by rounding each partial to bf16.
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(compute=DType.F32)
    if scaling == "dynamic":
        ctx = ctx.replace(recipe=Recipe(scaling=DynamicScaling()))
    return ctx


def _mlp(ctx: ComputeCtx) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    return model


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, WIDTH, generator=gen) * (1.0 + 3.0 * step)


def _plain(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's whole value; full_tensor (and RowwiseParallel's local output) may be a
    # functional collective's wrapper, which torch.save cannot save for weights_only
    # loading: copied into a plain tensor.
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(whole.detach())
    return out


def _ledgers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{role}": op.ledger.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
        for role, op in m.scaling.operands.items()
    }


def train(params: dict[str, Any]) -> dict[str, Any]:
    """SGD steps of an fp8 MLP, tensor parallel on every rank of the world.

    ``layout="tp"``: ``ColwiseParallel`` then ``RowwiseParallel`` (a Megatron MLP: the
    first layer's weight and bias sharded by rows, the second's weight by columns, its
    output a partial sum). ``layout="batch"``: every parameter replicated on the mesh
    (``distribute_module``) and the input a DTensor sharded by rows, each rank its own
    rows (DTensor activations as torchtitan's full_dtensor mode has them). One rank: the
    plain model on the whole batch. Reports outputs, the first step's gradients, the
    weights, the ledgers, an eval forward, and the types of the scaling buffers.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _mlp(_ctx(params["scaling"]))
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        if params["layout"] == "tp":
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        else:
            distribute_module(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outs, grads = [], {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(params["steps"]):
            x = _batch(step)
            run_x: torch.Tensor = x
            if world > 1 and params["layout"] == "batch":
                per = ROWS // world
                mine = x[rank * per : (rank + 1) * per]
                run_x = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
            y = model(run_x)
            y.float().square().sum().backward()
            outs.append(_plain(y).detach())
            if step == 0:
                grads = {
                    n: _plain(p.grad).detach().clone()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
            opt.step()
            opt.zero_grad()
    model.eval()
    with torch.no_grad():
        x = _batch(99)
        ev = model(x if world == 1 or params["layout"] == "tp" else _as_rows(x, mesh, rank))
    return {
        "outs": torch.stack(outs),
        "grads": grads,
        "weights": {n: _plain(p).detach().clone() for n, p in model.named_parameters()},
        "ledgers": _ledgers(model),
        "eval": _plain(ev).detach(),
        "buffer_types": sorted({type(b).__name__ for b in model.buffers()}),
        "unsynced_warnings": sum("nothing keeping its scales" in str(w.message) for w in caught),
    }


def train_each(params: dict[str, Any]) -> dict[str, Any]:
    """``train`` once per layout of ``layouts``, in this one launch (each a fresh model)."""
    return {layout: train({**params, "layout": layout}) for layout in params["layouts"]}


def _as_rows(x: torch.Tensor, mesh: Any, rank: int) -> DTensor:
    per = x.shape[0] // mesh.size()
    return DTensor.from_local(x[rank * per : (rank + 1) * per], mesh, [Shard(0)], run_check=False)
