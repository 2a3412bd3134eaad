"""The ranks agree at every step boundary: what one rank may do alone, and setups that differ.

``rank0_habits``: ``parallelize`` under DDP; after a first step rank 0 alone runs the three
things nearly every training script does (an eval-mode forward with grad through
``par.model``, a train-mode forward with no backward, ``par.state_dict()``), then both ranks
train on. The same run without rank 0's calls, in the same launch, is the reference. Under a
delayed, a dynamic and a row-wise policy, one launch for all three.

``different_setups``: ranks that convert different layers (DDP, another ``fp8_filter``) or
build different models (FSDP2, another width) are named at setup, and the group still works.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import parallelize, sync_scaling
from computectx.formats import QuantizedLinear, convert_to_quantized

WIDTH = 32


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every fp8 scaling tensor (ledgers, tallies, meta) of ``model``, by buffer name."""
    return {
        f"{name}.{key}": t.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
        for key in m.scaling.tensor_names()
        if (t := m._buffers.get(key)) is not None
    }


def _x(rows: int, seed: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=gen) * scale


def _loop(flag: str, habits: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    ctx = ComputeCtx.from_flag(flag, "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))
    par = parallelize(
        model,
        ctx,
        optimizer_class=torch.optim.SGD,
        fp8_filter=lambda m, fqn: True,
        lr=1e-2,
    )
    assert par.sync is not None
    out: dict[str, Any] = {"losses": [], "states": [], "current_amax": par.sync.current_amax}
    saved: dict[str, torch.Tensor] = {}
    for step in range(4):
        if step == 1:
            out["at_habits"] = _state(model)
            if habits and rank == 0:
                # (1) validation in eval mode, grad on (DDP rebuilds its buckets here).
                par.model.eval()
                par.model(_x(3, 100, 50.0)).float().sum()
                par.model.train()
                # (2) a validation loss in train mode, never backpropagated.
                par.model(_x(3, 101, 80.0)).float().square().mean()
                # (3) the usual DDP save, on rank 0 alone.
                buffer = io.BytesIO()
                torch.save(par.state_dict(), buffer)
                buffer.seek(0)
                state = torch.load(buffer, weights_only=True)["model"]
                saved = {k: v for k, v in state.items() if k in out["at_habits"]}
        loss = par.model(_x(4, 10 * step + rank, 1.0 + 30 * rank)).float().square().mean()
        loss.backward()
        par.step()
        out["losses"].append(float(loss.detach()))
        out["states"].append(_state(model))  # no explicit merge: the backward's
    out["saved"] = saved
    out["probe"] = model.eval()(_x(2, 7, 1.0)).detach()
    return out


def rank0_habits(params: dict[str, Any]) -> dict[str, Any]:
    """For each flag: the loop with rank 0's calls, and without (the reference)."""
    return {
        flag: {"habits": _loop(flag, True), "plain": _loop(flag, False)} for flag in params["flags"]
    }


def _after_error(run: Any) -> dict[str, Any]:
    try:
        run()
    except ValueError as e:
        error = str(e)
    else:
        error = ""
    # The group still works: no abort, no collective left half done.
    alive = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(alive)
    return {"error": error, "alive": float(alive)}


def different_setups(params: dict[str, Any]) -> dict[str, Any]:
    """Another ``fp8_filter`` on rank 1 under DDP (``parallelize`` and ``sync_scaling``),
    another hidden width on rank 1 under FSDP2 (``parallelize``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    skip = "" if rank == 0 else "2"

    def mlp(hidden: int = 64) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(WIDTH, hidden), nn.ReLU(), nn.Linear(hidden, WIDTH))

    def ddp_filter() -> None:
        parallelize(mlp(), ctx, fp8_filter=lambda m, fqn: fqn != skip, lr=1e-2)

    def sync_filter() -> None:
        model = mlp()
        convert_to_quantized(model, ctx, module_filter=lambda m, fqn: fqn != skip)
        sync_scaling(model)

    def fsdp_width() -> None:
        parallelize(
            mlp(64 if rank == 0 else 96),
            ctx,
            strategy="fsdp",
            fp8_filter=lambda m, fqn: True,
            lr=1e-2,
        )

    def fsdp_sync_width() -> None:
        model = mlp(64 if rank == 0 else 96)
        convert_to_quantized(model, ctx, module_filter=lambda m, fqn: True)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model, mesh=mesh)
        sync_scaling(model)

    return {
        "ddp_filter": _after_error(ddp_filter),
        "sync_filter": _after_error(sync_filter),
        "fsdp_width": _after_error(fsdp_width),
        "fsdp_sync_width": _after_error(fsdp_sync_width),
    }


def local_amax_cost(params: dict[str, Any]) -> dict[str, Any]:
    """``scenarios_amax.py:train`` (rank 1's shard 40x rank 0's) for each flag, with the
    rank's own current amax (DDP's default) and with the group's; one process: the group's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / "scenarios_amax.py"
    spec = importlib.util.spec_from_file_location("scenarios_amax", path)
    assert spec is not None and spec.loader is not None
    amax = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(amax)
    kinds = ("local", "group") if dist.get_world_size() > 1 else ("group",)
    return {
        flag: {
            kind: amax.train(
                {"flag": flag, "steps": params["steps"], "sync": True, "current_amax": kind}
            )["losses"]
            for kind in kinds
        }
        for flag in params["flags"]
    }
