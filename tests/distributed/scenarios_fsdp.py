"""FSDP2 with fp8 all-gather: bytes on the wire, and the training it gives against one process."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import ShardedParams, enable_quantized_all_gather, sync_scaling
from computectx.formats import DynamicScaling, QuantizedLinear, Recipe, convert_to_quantized
from computectx.memory import OffloadedOptimizer

BATCH = 8
IN, HIDDEN, OUT = 64, 128, 64


def _ctx(scaling: str) -> ComputeCtx:
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    if scaling == "dynamic":
        ctx = ctx.replace(recipe=Recipe(scaling=DynamicScaling()))
    return ctx


def _model(ctx: ComputeCtx) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    return model


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randn(BATCH, IN, generator=gen)
        x[BATCH // 2 :] *= 20.0  # rank 1's shard: another range
        out.append((x, torch.randn(BATCH, OUT, generator=gen)))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    out: torch.Tensor = full() if full is not None else t
    return out.detach().clone()


class _CountGathers:
    """Bytes this rank hands to all-gathers, split by the dtype they travel in."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, int]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _CountGathers:
        for name in ("all_gather_single", "all_gather_into_tensor"):
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counting(out: Any, inp: Any, *args: Any, _f: Any = original, **kw: Any) -> Any:
                self.calls.append((inp.dtype, inp.numel() * inp.element_size()))
                return _f(out, inp, *args, **kw)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def train(params: dict[str, Any]) -> dict[str, Any]:
    """``steps`` SGD steps on a 2-layer fp8 MLP; the ranks split every batch.

    ``gather``: ``"fp8"`` (enable_quantized_all_gather), ``"hp"`` (FSDP2's own float32 gather),
    ``"ddp"`` (DistributedDataParallel, no gather) or ``"none"`` (the one-process reference).
    ``offloaded``: AdamW in an ``OffloadedOptimizer`` (``ShardedParams`` under FSDP2), not SGD.
    Reports the losses, the first step's full gradients, the final full weights, the ledgers
    and the all-gather traffic.
    """
    ctx = _ctx(params["scaling"])
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(ctx)
    layers = [m for m in model if isinstance(m, QuantizedLinear)]
    converted = 0
    if params["gather"] == "fp8":
        converted = enable_quantized_all_gather(model)
    run: nn.Module = model
    if params["gather"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(model)
    elif params["gather"] != "none":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=params.get("reshard", True))
        fully_shard(model, mesh=mesh)
    # The group's current amax: the one-process scales under DDP too (its default there is
    # the rank's own, whose cost test_step_boundary.py measures).
    sync = sync_scaling(run, current_amax=params.get("current_amax", "group"))
    opt: torch.optim.Optimizer
    if params.get("offloaded"):
        # Masters and AdamW state as local shards (ShardedParams), for FSDP2 models.
        sharding = ShardedParams() if params["gather"] in ("fp8", "hp") else None
        opt = OffloadedOptimizer(
            model.parameters(), ctx, torch.optim.AdamW, sharding=sharding, lr=1e-3
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=params.get("lr", 0.01))
    per = BATCH // world
    losses, first_grads = [], {}
    with _CountGathers() as counter, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_batches(params["steps"])):
            xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            loss = nn.functional.mse_loss(run(xs).float(), ys)
            loss.backward()  # type: ignore[no-untyped-call]
            if i == 0:
                first_grads = {
                    n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None
                }
            opt.step()
            opt.zero_grad()
            t = loss.detach().reshape(1)
            dist.all_reduce(t)
            losses.append(float(t) / world)
    sync.sync()
    masters = opt.master_params if isinstance(opt, OffloadedOptimizer) else ()
    return {
        "plain_masters": all(type(m.data) is torch.Tensor for m in masters),
        "converted": converted,
        "losses": torch.tensor(losses, dtype=torch.float64),
        "first_grads": first_grads,
        "weights": {n: _full(p) for n, p in model.named_parameters()},
        "ledgers": {
            f"{i}.{role}": op.ledger.detach().clone()
            for i, layer in enumerate(layers)
            for role, op in layer.scaling.operands.items()
        },
        "gathers": counter.calls,
        "shard_weight_elements": sum(layer.weight.numel() for layer in layers) // world,
        "warnings": [str(w.message) for w in caught],
    }


def train_each(params: dict[str, Any]) -> dict[str, Any]:
    """``train`` once per entry of ``gathers``, in this one launch (each on a fresh model)."""
    return {gather: train({**params, "gather": gather}) for gather in params["gathers"]}


def compiled_dynamic(params: dict[str, Any]) -> dict[str, Any]:
    """Two steps of a dynamic-scaling fp8 linear with the sync, eager and then compiled with
    ``fullgraph=True`` (the merge hook and every quantize's amax all-reduce in the graph)."""
    return {"eager": _dynamic_steps(compile=False), "compiled": _dynamic_steps(compile=True)}


def _dynamic_steps(compile: bool) -> dict[str, Any]:
    ctx = _ctx("dynamic")
    rank = dist.get_rank()
    # One layer whose input requires grad: its three quantizes (input, weight, output
    # gradient) and both backward GEMMs are traced, each compile half of two layers'.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT))
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    sync = sync_scaling(model, current_amax="group")  # the reductions traced
    run: Any = model
    if compile:
        run = torch.compile(model, fullgraph=True, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outs = []
    for x, _ in _batches(2):
        xs = x[rank * 4 : (rank + 1) * 4].requires_grad_()
        y = run(xs)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    sync.sync()
    return {
        "outs": torch.stack(outs),
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "ledgers": {
            f"{i}.{role}": op.ledger.detach().clone()
            for i, layer in enumerate(m for m in model if isinstance(m, QuantizedLinear))
            for role, op in layer.scaling.operands.items()
        },
    }
