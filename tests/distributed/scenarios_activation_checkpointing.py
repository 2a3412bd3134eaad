"""Activation checkpointing under FSDP2's fp8 all-gather and the amax sync, on two ranks.

The model is a block (two fp8 linears) wrapped with ``checkpoint_wrapper`` before
``fully_shard``, as torchtitan applies activation checkpointing; every rank trains on its
shard of each batch. The same training without checkpointing is the reference: the
recomputation in the backward, which runs while the sync is not armed and FSDP2 gathers the
weights again, must replay the forward's steps and issue no collective of its own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from computectx import ComputeCtx
from computectx.distributed import enable_quantized_all_gather, sync_scaling
from computectx.formats import DynamicScaling, QuantizedLinear, Recipe, convert_to_quantized

BATCH = 8
IN, HIDDEN, OUT = 64, 128, 64


def _train(scaling: str, impl: str | None, steps: int) -> dict[str, Any]:
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    if scaling == "dynamic":
        ctx = ctx.replace(recipe=Recipe(scaling=DynamicScaling()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    layers = [m for m in model if isinstance(m, QuantizedLinear)]
    enable_quantized_all_gather(model)
    block: nn.Module = model
    if impl is not None:
        kind = CheckpointImpl.REENTRANT if impl == "reentrant" else CheckpointImpl.NO_REENTRANT
        block = checkpoint_wrapper(model, checkpoint_impl=kind)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(block, mesh=mesh)
    sync = sync_scaling(block)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    world, rank = dist.get_world_size(), dist.get_rank()
    per = BATCH // world
    gen = torch.Generator().manual_seed(3)
    losses, grads = [], []
    for step in range(steps):
        x = torch.randn(BATCH, IN, generator=gen) * (1.0 + 3.0 * step)
        y = torch.randn(BATCH, OUT, generator=gen)
        xs = x[rank * per : (rank + 1) * per].requires_grad_()
        loss = nn.functional.mse_loss(block(xs).float(), y[rank * per : (rank + 1) * per])
        loss.backward()  # type: ignore[no-untyped-call]
        grads.append(
            {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        )
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    sync.sync()
    return {
        "losses": torch.stack(losses),
        "grads": grads,
        "ledgers": {
            f"{i}.{role}": getattr(layer.scaling, role).ledger.detach().clone()
            for i, layer in enumerate(layers)
            for role in ("input", "weight", "grad")
        },
        "elements": {
            f"{i}.{role}": getattr(layer.scaling, role).elements
            for i, layer in enumerate(layers)
            for role in ("input", "weight", "grad")
        },
    }


def train_each(params: dict[str, Any]) -> dict[str, Any]:
    """``_train`` without checkpointing and once per checkpoint implementation in ``impls``."""
    scaling, steps = params["scaling"], params["steps"]
    out = {"plain": _train(scaling, None, steps)}
    for impl in params["impls"]:
        out[impl] = _train(scaling, impl, steps)
    return out
