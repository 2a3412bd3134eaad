"""Setups a user gets wrong, and data that differs by rank: never silent, never a hang.

Each function is one launch of ``conftest.run_ranks``; the worker's collective timeout (30 s)
turns a hang into an exception, so a scenario that hangs fails its test in under a minute.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx
from computectx.distributed import enable_quantized_all_gather, parallelize, sync_scaling
from computectx.formats import (
    DynamicScaling,
    QuantizedLinear,
    Recipe,
    ScalingNotSyncedWarning,
    convert_to_quantized,
)

WIDTH = 32


def _ctx(scaling: str) -> ComputeCtx:
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    if scaling == "dynamic":
        ctx = ctx.replace(recipe=Recipe(scaling=DynamicScaling()))
    return ctx


def _mlp(ctx: ComputeCtx) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    return model


def _x(rows: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=gen) * scale


def _ledgers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{role}": op.ledger.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
        for role, op in m.scaling.operands.items()
    }


def _train_step(run: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = run(x)
    out.float().square().sum().backward()  # type: ignore[no-untyped-call]
    return out.detach()


def each(params: dict[str, Any]) -> dict[str, Any]:
    """The scenario called ``name`` once per params dict of ``cases``, in this one launch."""
    scenario = globals()[params["name"]]
    return {"cases": [scenario(case) for case in params["cases"]]}


def fsdp_gather_without_sync(params: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 gathering fp8 with no ``sync_scaling``; each rank's data at another range.
    Delayed scaling must refuse at the first forward; dynamic scaling must train as FSDP2's
    own float32 gather does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for gather in ("fp8", "hp"):
        model = _mlp(_ctx(params["scaling"]))
        if gather == "fp8":
            enable_quantized_all_gather(model)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        outs = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ScalingNotSyncedWarning)
                for step in range(4):
                    outs.append(_train_step(model, _x(4, 10 * step + rank, 1.0 + 30 * rank)))
                    opt.step()
                    opt.zero_grad()
            out[gather] = {"outs": torch.stack(outs), "error": ""}
        except RuntimeError as e:
            out[gather] = {"outs": torch.zeros(0), "error": str(e)}
    return out


def rank_local_calls(params: dict[str, Any]) -> dict[str, Any]:
    """Synced DDP; rank 0 alone runs eval, no_grad and inference_mode forwards, a sample
    loop and a training-mode call on the unwrapped module (with a backward); then both
    ranks train a step. Reports the ledgers around rank 0's calls and at the end."""
    ctx = _ctx(params["scaling"])
    rank = dist.get_rank()
    model = _mlp(ctx)
    ddp = DistributedDataParallel(model)
    sync = sync_scaling(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    _train_step(ddp, _x(4, rank, 1.0 + 30 * rank))
    opt.step()
    opt.zero_grad()
    before = _ledgers(model)
    if rank == 0:
        ddp.eval()
        with torch.no_grad():
            ddp(_x(3, 7, 50.0))
        ddp.train(True)  # type: ignore[no-untyped-call]
        with torch.inference_mode():
            ddp(_x(3, 8, 50.0))
        with torch.no_grad():
            h = _x(1, 9)
            for _ in range(3):  # sampling: each output feeds the next call
                h = model(h)
        model(_x(2, 11, 80.0)).sum().backward()  # the unwrapped module, in training mode
        opt.zero_grad()
    after_local = _ledgers(model)
    _train_step(ddp, _x(4, 20 + rank, 1.0 + 30 * rank))
    opt.step()
    sync.sync()
    return {"before": before, "after_local": after_local, "end": _ledgers(model)}


def empty_shard(params: dict[str, Any]) -> dict[str, Any]:
    """Synced DDP in which the last rank's micro-batch is empty at step ``empty_at``
    (an expert that got no tokens, an uneven last batch)."""
    ctx = _ctx(params["scaling"])
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _mlp(ctx)
    inner: nn.Module = model
    reentrant = params.get("checkpoint")
    if reentrant is not None:
        inner = _Checkpointed(model, reentrant == "reentrant")
    run: nn.Module = DistributedDataParallel(inner, static_graph=True) if world > 1 else inner
    sync = sync_scaling(run)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    outs = []
    for step in range(3):
        x = _x(4, 30 + step, 5.0)
        mine = x[:0] if step == params["empty_at"] and rank == world - 1 else x
        outs.append(_train_step(run, mine))
        opt.step()
        opt.zero_grad()
    sync.sync()
    return {"ledgers": _ledgers(model), "shapes": [tuple(o.shape) for o in outs]}


class _Checkpointed(nn.Module):
    """``model`` under activation checkpointing (its forward recomputed in the backward)."""

    def __init__(self, model: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.model = model
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if self.reentrant:
            x = x.detach().requires_grad_()  # a reentrant region needs an input that does
        out: torch.Tensor = checkpoint(self.model, x, use_reentrant=self.reentrant)
        return out


def compiled_then_eager(params: dict[str, Any]) -> dict[str, Any]:
    """Delayed scaling, synced: two compiled training steps, then an eager one on every
    rank, then an eager eval forward on rank 0 alone, then one more eager step."""
    ctx = _ctx("delayed")
    rank = dist.get_rank()
    model = _mlp(ctx)
    ddp = DistributedDataParallel(model)
    sync = sync_scaling(ddp)
    compiled = torch.compile(ddp, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(2):
        _train_step(compiled, _x(4, 40 + step + 10 * rank, 1.0 + 3 * rank))
        opt.step()
        opt.zero_grad()
    sync.sync()
    before = _ledgers(model)
    _train_step(ddp, _x(4, 50 + 10 * rank, 1.0 + 3 * rank))
    opt.step()
    opt.zero_grad()
    sync.sync()
    eager = _ledgers(model)
    if rank == 0:
        with torch.no_grad():
            model.eval()
            ddp(_x(2, 60))
            model.train()
    _train_step(ddp, _x(4, 70 + 10 * rank, 1.0 + 3 * rank))
    sync.sync()
    return {"before": before, "eager": eager, "end": _ledgers(model)}


def warnings_and_order(params: dict[str, Any]) -> dict[str, Any]:
    """DDP with no sync (warned once per process; not for row-wise scaling, which keeps no
    history); the sync built before ``fully_shard`` (refused at the first forward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    # Row-wise scaling keeps no history: nothing to sync, so no warning (checked first, as
    # the warning is given once per process).
    rowwise = DistributedDataParallel(_mlp(ComputeCtx.from_flag("fp8_rowwise", "cpu")))
    with warnings.catch_warnings(record=True) as caught_row:
        warnings.simplefilter("always")
        for step in range(2):
            _train_step(rowwise, _x(4, step + rank))
    unsynced_row = [str(w.message) for w in caught_row if w.category is ScalingNotSyncedWarning]
    model = _mlp(_ctx("delayed"))
    ddp = DistributedDataParallel(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _train_step(ddp, _x(4, step + rank))
    unsynced = [str(w.message) for w in caught if w.category is ScalingNotSyncedWarning]

    misordered = _mlp(_ctx("delayed"))
    sync_scaling(misordered)  # too early: before fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(misordered, mesh=mesh)
    order_error = ""
    try:
        _train_step(misordered, _x(4, 5 + rank))
    except RuntimeError as e:
        order_error = str(e)
    return {"unsynced": unsynced, "unsynced_row": unsynced_row, "order_error": order_error}


class _TiedLM(nn.Module):
    """An embedding, blocks, and an output head sharing the embedding's weight."""

    def __init__(self, ctx: ComputeCtx) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.head = nn.Linear(WIDTH, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        out: torch.Tensor = self.head(h)
        return out


def tied_and_copied(params: dict[str, Any]) -> dict[str, Any]:
    """``parallelize`` on a model whose fp8 head is tied to its embedding (FSDP2 or DDP),
    a few steps, then an EMA copy of the prepared module run on its own."""
    ctx = _ctx("delayed")
    rank = dist.get_rank()
    lm = _TiedLM(ctx)
    par = parallelize(
        lm,
        ctx,
        strategy=params["strategy"],
        fp8_filter=lambda module, fqn: True,
        lr=1e-2,
    )
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        tokens = torch.randint(0, 64, (4, 8), generator=gen)
        logits = par.model(tokens)
        nn.functional.cross_entropy(logits.reshape(-1, 64).float(), tokens.reshape(-1)).backward()  # type: ignore[no-untyped-call]
        par.step()
    head, embed = lm.head, lm.embed
    tied = head.weight is embed.weight
    ema = copy.deepcopy(par.module) if params["strategy"] == "ddp" else None
    copy_ledgers_own = True
    if ema is not None:
        original = _ledgers(par.module)
        with torch.no_grad():
            for p in ema.parameters():
                p.mul_(0.5)
        ema.eval()
        with torch.no_grad():
            probe = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(9))
            differs = not torch.equal(ema(probe), lm.eval()(probe))
            lm.train()
        copy_ledgers_own = differs and all(
            torch.equal(original[k], v) for k, v in _ledgers(par.module).items()
        )
        copy_ledgers_own = copy_ledgers_own and all(
            a.scaling is not b.scaling
            for a, b in zip(ema.modules(), par.module.modules(), strict=True)
            if isinstance(a, QuantizedLinear) and isinstance(b, QuantizedLinear)
        )
    weight = head.weight
    full = getattr(weight, "full_tensor", None)
    return {
        "tied": tied,
        "head_is_fp8": isinstance(head, QuantizedLinear),
        "head": (full() if full is not None else weight).detach().clone(),
        "copy_ledgers_own": copy_ledgers_own,
    }


def parallel_loop(params: dict[str, Any]) -> dict[str, Any]:
    """The whole loop through ``parallelize``: ``steps`` steps with clipping on the ranks'
    shares of every batch (one process: all of it), then a DCP checkpoint of
    ``par.state_dict()`` to ``path``; with ``load=True``, a fresh setup on this run's ranks
    loads it. Reports the losses and the output on a fixed probe."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    ctx = _ctx(params["scaling"]).replace(offload=torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1 if params.get("load") else 0)  # a load must restore the weights
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))
    par = parallelize(
        model,
        ctx,
        strategy=params["strategy"],
        fp8_filter=lambda m, fqn: True,
        current_amax=params.get("current_amax"),
        # FSDP2 gathers float32, as one process computes, for the 1e-5 and bitwise
        # comparisons (the ctx's bf16 gathers: test_mixed_precision.py).
        mp_policy=MixedPrecisionPolicy() if params["strategy"] == "fsdp" else None,
        lr=1e-2,
    )
    losses = []
    if params.get("load"):
        state = par.state_dict()
        load(state, checkpoint_id=params["path"])
        par.load_state_dict(state)
    else:
        per = 8 // world
        for step in range(params["steps"]):
            x = _x(8, 80 + step)
            x[4:] *= 20.0
            xs = x[rank * per : (rank + 1) * per]
            loss = par.model(xs).float().square().mean()
            loss.backward()
            par.step(max_norm=1.0)
            whole = loss.detach().reshape(1)
            dist.all_reduce(whole)
            losses.append(float(whole) / world)
        save(par.state_dict(), checkpoint_id=params["path"])
    with torch.no_grad():
        probe = par.model(torch.linspace(-2.0, 2.0, 4 * WIDTH).reshape(4, WIDTH))
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "probe": probe,
        "offloaded": type(par.optimizer).__name__,
        "synced": par.sync is not None,
    }
