"""One rank of torchtitan's data parallelism around ``fp8_parallelize_fn``, started by torchrun.

``python -m torch.distributed.run --nproc-per-node 2 torchtitan_worker.py OUT_DIR``: an fp8 MLP
trained two steps in one process (the checkpoint, recorded at world size 1) is loaded on every
rank and set up by ``fp8_parallelize_fn`` around a ``parallelize_fn`` that does what
torchtitan's does for data parallelism: ``fully_shard`` over the ``loss`` mesh and
``disable_fsdp_gradient_division``. One more step then runs on each rank's rows with
torchtitan's loss normalization (the rank's summed loss over the global token count), once
with the hook's default and once with ``loss_normalization="per_rank"``. The reference, the
same step in one process on the whole batch, is computed before the group exists. Writes
``OUT_DIR/rank{R}.pt``.
"""

from __future__ import annotations

import copy
import datetime
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

from computectx import ComputeCtx, DType
from computectx.distributed import AmaxSync
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.formats.numerics.ledger import ledger_history, ledger_step
from computectx.integrations.torchtitan import fp8_parallelize_fn

ROWS, WIDTH = 8, 32  # a row is a token here: every one valid
CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(compute=DType.F32)


class Dims:
    """The one question ``fp8_parallelize_fn`` asks torchtitan's ``ParallelDims`` (whose
    ``build_mesh`` takes CUDA's device type on a machine without a GPU)."""

    def __init__(self, loss: DeviceMesh | None) -> None:
        self.loss = loss

    def get_optional_mesh(self, name: str) -> DeviceMesh | None:
        return self.loss if name == "loss" else None


def data_parallel(model: nn.Module, *, parallel_dims: Dims, **kwargs: Any) -> nn.Module:
    """torchtitan's data parallelism: FSDP2 over the mesh, summing (not averaging) grads."""
    sharded = fully_shard(model, mesh=parallel_dims.loss)
    disable_fsdp_gradient_division(model)
    sharded.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: a plain SUM
    return model


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))
    convert_to_quantized(model, CTX, module_filter=lambda module, fqn: True)
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(step)) * (1 + step)


def train_step(model: nn.Module, x: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = model(x).float().square().sum() / ROWS  # torchtitan: local sum / global tokens
    loss.backward()
    opt.step()
    opt.zero_grad()


def scaling(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each operand's history and step (the counts are each rank's)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            for role, op in m.scaling.operands.items():
                out[f"{name}.{role}.history"] = ledger_history(op.ledger).detach().clone()
                out[f"{name}.{role}.step"] = ledger_step(op.ledger).detach().clone()
    return out


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def main(out: Path) -> None:
    # One process first, before any group exists: two steps (the checkpoint), then the
    # reference third step on the whole batch.
    model = mlp()
    for step in range(2):
        train_step(model, batch(step))
    saved = copy.deepcopy(model.state_dict())
    train_step(model, batch(2))
    result: dict[str, Any] = {"one": scaling(model), "one_weights": weights(model)}

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = Dims(init_device_mesh("cpu", (world,)))
    rows = batch(2)[rank * ROWS // world : (rank + 1) * ROWS // world]
    hooks = {
        "default": fp8_parallelize_fn(data_parallel),
        "per_rank": fp8_parallelize_fn(data_parallel, loss_normalization="per_rank"),
    }
    for name, parallelize in hooks.items():
        plain = mlp()
        plain.load_state_dict(saved)
        parallel = parallelize(plain, parallel_dims=dims)
        train_step(parallel, rows)  # no sync() call: the merge runs at the backward's end
        result[name] = scaling(parallel)
        result[f"{name}_weights"] = weights(parallel)
        sync = getattr(parallel, "_computectx_fp8_sync")  # noqa: B009 (the hook's private slot)
        assert isinstance(sync, AmaxSync)
        result[f"{name}_normalization"] = sync.loss_normalization
    result["world"] = world
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
