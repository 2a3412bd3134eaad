"""The native CPU Adam kernel failing to build on one rank only (``test_native_build.py``).

Rank 1's build is made to fail (its compiler is ``false``, as on a node without ``g++``);
rank 0 builds as usual. Under ``parallelize`` (DDP and FSDP2, ``int8`` state on the CPU) and
under a hand-built ``OffloadedOptimizer`` with a ``ShardedParams`` (FSDP2), each rank steps
once and reports the step's error, how long it took, whether anything it holds changed, the
collectives it called, and its weights after. The claim (``test_native_build.py``): no rank
runs the kernel while another runs its twin (they differ in the last bits), no rank hangs,
and every rank raises, promptly under ``Parallel.step``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from computectx import ComputeCtx
from computectx.distributed import ShardedParams, parallelize
from computectx.kernels import host_adam
from computectx.memory import OffloadedOptimizer

Result = dict[str, Any]

JOIN_S = 2.0
LR = 1e-2
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce_scatter")


class Net(nn.Module):
    """Two linear layers (FSDP2 shards each weight over the ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.relu(self.a(x)))
        return out


def ctx() -> ComputeCtx:
    return (
        ComputeCtx.parity("cpu").replace(offload=torch.device("cpu")).with_optim_state("int8/min=0")
    )


@contextlib.contextmanager
def counting_collectives() -> Iterator[list[str]]:
    """The names of the ``torch.distributed`` collectives called while active."""
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return saved[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _held(model: nn.Module, opt: OffloadedOptimizer) -> list[torch.Tensor]:
    held = [_local(p) for p in model.parameters()] + [_local(m) for m in opt.master_params]
    return held + [
        v.detach().clone()
        for per_param in opt.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    ]


def _stepped(model: nn.Module, opt: OffloadedOptimizer, step: Callable[[], Any]) -> Result:
    """One backward, then ``step()``: its error, seconds, collectives, whether this rank's
    weights, masters or state changed, and the weights after."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    before = _held(model, opt)
    start = time.monotonic()
    with counting_collectives() as calls:
        try:
            step()
            error = ""
        except Exception as e:  # recorded, judged by the test
            error = f"{type(e).__name__}: {e}"
    after = _held(model, opt)
    changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    weights = [_local(p) for p in model.parameters()]
    return {
        "error": error,
        "s": time.monotonic() - start,
        "collectives": list(calls),
        "changed": changed,
        "weights": weights,
    }


def one_rank_cannot_build(params: Result) -> Result:
    """Rank 1 without a compiler: ``Parallel.step`` under DDP and FSDP2, then a hand-built
    sharded ``OffloadedOptimizer``'s ``step``."""
    if dist.get_rank() == 1:
        host_adam.COMPILER = "false"  # a node without g++: `false --version` fails
        host_adam._load.cache_clear()
    out: Result = {}
    for strategy in ("ddp", "fsdp"):
        start = time.monotonic()
        try:
            par = parallelize(Net(), ctx(), strategy=strategy, lr=LR, join_timeout=JOIN_S)
        except Exception as e:  # recorded, judged by the test
            out[f"{strategy}/setup"] = {"error": f"{type(e).__name__}: {e}"}
            out[f"{strategy}/setup"]["s"] = time.monotonic() - start
            continue
        assert isinstance(par.optimizer, OffloadedOptimizer)
        out[f"{strategy}/step"] = _stepped(par.model, par.optimizer, par.step)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Net()
    for layer in (model.a, model.b):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharding = ShardedParams(mesh, join_timeout=JOIN_S)
    opt = OffloadedOptimizer(model.parameters(), ctx(), sharding=sharding, lr=LR)
    out["sharded/step"] = _stepped(model, opt, opt.step)
    dist.barrier()  # the group is still usable
    return out
