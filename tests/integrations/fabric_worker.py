"""One rank of the Lightning Fabric recipes (docs/integrations.md), started by torchrun.

``python -m torch.distributed.run --nproc-per-node 2 fabric_worker.py OUT_DIR STRATEGY...``:
each STRATEGY in turn, in one launch (a launch's imports cost more than its training): ``ddp``
(``DDPStrategy``, each rank its rows of the batch), ``fsdp`` (``ModelParallelStrategy`` data
parallel only: FSDP2 with the fp8 all-gather, each rank its rows) or ``tensor_parallel``
(``ModelParallelStrategy`` tensor parallel over every rank, each rank the whole batch), each
with a fresh ``Fabric``, model and optimizer over the one process group (the first strategy's
``Fabric`` creates it; the others find it). Every rank first trains the same model in one
process on the whole batch, before any group exists (the reference). Under ``ddp`` and
``fsdp`` it then saves with ``fabric.save`` and no merge call, trains one more step and loads
with ``fabric.load``. Writes ``OUT_DIR/rank{R}.pt``: each strategy's results by its name.
"""

from __future__ import annotations

import copy
import datetime
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from computectx import ComputeCtx, DType
from computectx.distributed import enable_quantized_all_gather, sync_scaling
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.formats.linear.module import SCALING_PREFIX

ROWS, WIDTH, STEPS = 8, 32, 4
TIMEOUT = datetime.timedelta(seconds=30)
# float32 activations: the tensor-parallel layer sums float32 partial products, so the
# comparison with one process is not blurred by rounding each partial to bf16.
CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(compute=DType.F32)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))
    convert_to_quantized(model, CTX, module_filter=lambda module, fqn: True)
    return model


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """A ``parallelize_fn``: a Megatron MLP over the tensor-parallel dimension; the fp8 state
    merged over the data-parallel one."""
    parallelize_module(
        model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    sync_scaling(model, mesh["data_parallel"])
    return model


def data_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """A ``parallelize_fn``: FSDP2 over the data-parallel dimension, fp8 weights gathered as
    fp8; the sync after ``fully_shard`` (its hooks keep it: nothing else needs to)."""
    dp = mesh["data_parallel"]
    enable_quantized_all_gather(model)
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    sync_scaling(model, dp)
    return model


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, WIDTH, generator=gen) * (1.0 + 10.0 * step)


def fp8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every fp8 buffer (ledgers, tallies, meta), as plain copies."""
    return {
        n: b.detach().clone()
        for n, b in model.named_buffers()
        if n.rsplit(".", 1)[-1].startswith(SCALING_PREFIX)
    }


def ledgers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{role}": op.ledger.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
        for role, op in m.scaling.operands.items()
    }


def plain(t: torch.Tensor) -> torch.Tensor:
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(whole.detach())  # a plain copy (a functional collective's wrapper won't save)
    return out


def alone() -> dict[str, Any]:
    """The reference: one process, the whole batch, no Fabric."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        loss = model(batch(step)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {
        "losses": torch.tensor(losses),
        "ledgers": ledgers(model),
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def launch(strategy: str) -> Fabric:
    if strategy == "ddp":
        return Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=TIMEOUT))
    fn = tensor_parallel if strategy == "tensor_parallel" else data_parallel
    dp, tp = (1, 2) if strategy == "tensor_parallel" else (2, 1)
    mp = ModelParallelStrategy(fn, data_parallel_size=dp, tensor_parallel_size=tp, timeout=TIMEOUT)
    return Fabric(accelerator="cpu", devices=2, strategy=mp)


def run(strategy: str, out: Path, one: dict[str, Any]) -> dict[str, Any]:
    """One strategy's run on the group, with its own ``Fabric``, model and optimizer."""
    result: dict[str, Any] = {"one": one}
    fabric = launch(strategy)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    # The module first: the parallelize_fn replaces its parameters with DTensors, and the
    # optimizer must be built over those.
    model = fabric.setup_module(mlp())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-3))
    assert isinstance(opt, torch.optim.Optimizer)
    if strategy == "ddp":
        # Every rank runs every training forward: the seeds may take the group's amax.
        sync_scaling(model, current_amax="group")

    def train(step: int) -> float:
        x = batch(step)
        if strategy != "tensor_parallel":  # each rank its rows
            x = x[rank * ROWS // world : (rank + 1) * ROWS // world]
        loss = model(x).float().square().mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        return float(fabric.all_reduce(loss.detach(), reduce_op="mean"))

    result["losses"] = torch.tensor([train(step) for step in range(STEPS)])
    result["ledgers"] = ledgers(model.module)
    result["weights"] = {n: plain(p) for n, p in model.module.named_parameters()}
    result["world"] = world
    if strategy != "tensor_parallel":
        probe = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(99)) * 31.0
        model.eval()
        with torch.no_grad():
            result["before"] = model(probe)
        model.train()
        result["saved"] = fp8_state(model.module)
        state: dict[str, Any] = {"model": model, "optimizer": opt}
        # No sync() first: the merge ran at the end of the last backward.
        fabric.save(out / strategy / "checkpoint", state)
        moved = copy.deepcopy(result["saved"])
        train(STEPS)  # moves the weights and the fp8 state on
        result["moved"] = fp8_state(model.module)
        fabric.load(out / strategy / "checkpoint", state)
        result["loaded"] = fp8_state(model.module)
        model.eval()
        with torch.no_grad():
            result["after"] = model(probe)
        result["stepped_changed"] = any(
            not torch.equal(moved[k], v) for k, v in result["moved"].items()
        )
    fabric.barrier()  # every rank done with this strategy before the next one starts
    return result


def main(out: Path, strategies: list[str]) -> None:
    one = alone()
    results = {strategy: run(strategy, out, one) for strategy in strategies}
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()  # no rank tears the group down while another still uses it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
