"""fp8 scaling under DDP: ranks on different shards, against one process on the whole batch."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx
from computectx.distributed import enable_quantized_all_gather, sync_scaling
from computectx.formats import QuantizedLinear, convert_to_quantized

BATCH = 8


def _model(ctx: ComputeCtx) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    return model


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # The second half of every batch (rank 1's shard) is 40x larger: unsynchronised ranks
    # would scale the same layer very differently.
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(BATCH, 32, generator=gen)
        x[BATCH // 2 :] *= 40.0
        out.append((x, torch.randn(BATCH, 16, generator=gen)))
    return out


def _ledgers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{role}": op.ledger.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
        for role, op in m.scaling.operands.items()
    }


def train(params: dict[str, Any]) -> dict[str, Any]:
    """``steps`` SGD steps; each rank takes its half of every batch (one process: all of it).

    ``sync``: merge the ledgers before each forward (``current_amax``: whose amax the first,
    seeding call takes; default the group's). ``nan_at``: the step whose last rank's
    shard holds a NaN in its input (forward only, then a final merge).
    """
    ctx = ComputeCtx.from_flag(params["flag"], "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(ctx)
    run: nn.Module = DistributedDataParallel(model) if world > 1 else model
    current = params.get("current_amax", "group")
    sync = sync_scaling(run, current_amax=current) if params["sync"] else None
    if params.get("compile"):
        # As `computectx demo --nproc N --compile` does: the DDP module, hook included.
        run = torch.compile(run, backend="aot_eager")  # type: ignore[assignment]
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    losses = []
    per = BATCH // world
    for x, y in _batches(params["steps"]):
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = nn.functional.mse_loss(run(xs).float(), ys)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        if world > 1:
            dist.all_reduce(whole)
            whole /= world
        losses.append(float(whole))
    if sync is not None:
        sync.sync()
    before_nan = _ledgers(model)
    if params.get("nan"):
        x, _ = _batches(1)[0]
        x[-1, 0] = math.nan
        # A training forward (grad enabled): only those record, eval and no_grad calls
        # leave the ledgers alone.
        run(x[rank * per : (rank + 1) * per])
        if sync is not None:
            sync.sync()
    return {
        "losses": torch.tensor(losses),
        "ledgers": _ledgers(model),
        "before_nan": before_nan,
    }


def compiled_and_eager(params: dict[str, Any]) -> dict[str, Any]:
    """``train`` compiled (seeding from the group's amax), then eager seeding from the rank's
    own (``current_amax="local"``), in this one launch."""
    return {
        "compiled": train({**params, "compile": True}),
        "eager": train({**params, "current_amax": "local"}),
    }


def fsdp_checkpoint(params: dict[str, Any]) -> dict[str, Any]:
    """Train ``steps`` steps (sharded with FSDP2 on more than one rank, gathering fp8
    weights with ``fp8_gather=True``, with the amax sync unless ``sync=False``) and save with
    DCP to ``path``; or, with ``load=True``, load that checkpoint into a fresh model sharded
    over this run's ranks. Reports the forward output on a fixed input and the ledgers."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ctx = ComputeCtx.from_flag(params["flag"], "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(ctx)
    if params.get("fp8_gather"):
        enable_quantized_all_gather(model)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    probe = torch.linspace(-3.0, 3.0, 4 * 32).reshape(4, 32)
    view_warnings = 0
    if params.get("load"):
        state = get_model_state_dict(model)
        load(state, checkpoint_id=params["path"])
        set_model_state_dict(model, state)
        sync = sync_scaling(model)
    else:
        sync = sync_scaling(model)
        if not params.get("sync", True):
            sync.remove()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        per = BATCH // world
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in _batches(params["steps"]):
                xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
                out = model(xs).float()
                nn.functional.mse_loss(out, ys).backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad()
        view_warnings = sum("view tensor" in str(w.message) for w in caught)
        if params.get("sync", True):
            sync.sync()  # the last step's amaxes of every rank go into the checkpoint
        save(get_model_state_dict(model), checkpoint_id=params["path"])
    with torch.no_grad():
        out = model(probe)
    if params.get("sync", True):
        sync.sync()  # the probe's amaxes merged (with fp8_gather: its weight shards' too)
    return {"out": out, "ledgers": _ledgers(model), "view_warnings": view_warnings}
