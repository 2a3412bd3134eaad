"""One rank of the Lightning Fabric recipes (docs/integrations.md), started by torchrun.

``python -m torch.distributed.run --nproc-per-node N fabric_worker.py OUT_DIR STRATEGY``:
STRATEGY ``ddp`` (each rank its rows of the batch), ``model_parallel`` (Fabric's
``ModelParallelStrategy``: the fp8 MLP tensor parallel over every rank, each rank the whole
batch) or ``single`` (one process, the reference). Writes ``OUT_DIR/rank{R}.pt``.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from computectx import ComputeCtx, DType
from computectx.distributed import sync_fp8_scaling
from computectx.fp8 import Fp8Linear, convert_to_fp8

ROWS, WIDTH = 8, 32
TIMEOUT = datetime.timedelta(seconds=30)
# float32 activations: the tensor-parallel layer sums float32 partial products, so the
# comparison with one process is not blurred by rounding each partial to bf16.
CTX = ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(compute=DType.F32)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))
    convert_to_fp8(model, CTX, module_filter=lambda module, fqn: True)
    return model


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """The ``parallelize_fn`` of ``ModelParallelStrategy``: a Megatron MLP over the mesh's
    tensor-parallel dimension; ledgers merged over its data-parallel one."""
    parallelize_module(
        model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    sync_fp8_scaling(model, mesh["data_parallel"])
    return model


def ledgers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{role}": op.ledger.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, Fp8Linear)
        for role, op in m.scaling.operands.items()
    }


def plain(t: torch.Tensor) -> torch.Tensor:
    whole = t.full_tensor() if isinstance(t, DTensor) else t
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(whole.detach())  # a plain copy (a functional collective's wrapper won't save)
    return out


def main(out: Path, strategy: str) -> None:
    if strategy == "ddp":
        fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=TIMEOUT))
    elif strategy == "model_parallel":
        mp = ModelParallelStrategy(tensor_parallel, data_parallel_size=1, timeout=TIMEOUT)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=mp)
    else:
        fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    rank, world = fabric.global_rank, fabric.world_size
    # The module first: the parallelize_fn replaces its parameters with DTensors, and the
    # optimizer must be built over those.
    model = fabric.setup_module(mlp())
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-3))
    sync = sync_fp8_scaling(model) if strategy == "ddp" else None
    losses = []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(ROWS, WIDTH, generator=gen) * (1.0 + 10.0 * step)
        if strategy == "ddp":
            x = x[rank * ROWS // world : (rank + 1) * ROWS // world]
        loss = model(x).float().square().mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    if sync is not None:
        sync.sync()
    torch.save(
        {
            "losses": torch.tensor(losses),
            "ledgers": ledgers(model.module),
            "weights": {n: plain(p) for n, p in model.module.named_parameters()},
            "world": world,
        },
        out / f"rank{rank}.pt",
    )
    fabric.barrier()  # no rank tears the group down while another still uses it
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
