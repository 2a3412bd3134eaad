"""Scenario for ``test_grad_accumulator.py``: a DataParallelGradAccumulator's stochastic
rounding resumed from its ``state_dict`` on every rank, bit for bit."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx, DType
from computectx.distributed import DataParallelGradAccumulator
from computectx.memory import OffloadedOptimizer

CTX = ComputeCtx.parity("cpu").replace(grad=DType.BF16)
STEPS, MICRO = 6, 3


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class _Run:
    def __init__(self, init_seed: int, acc_seed: int) -> None:
        torch.manual_seed(init_seed)
        net = torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 2))
        self.model = DistributedDataParallel(net)  # rank 0's initial weights on every rank
        self.acc = DataParallelGradAccumulator(self.model, CTX, mode="stochastic", seed=acc_seed)
        self.opt = OffloadedOptimizer(net.parameters(), CTX, lr=1e-2)

    def train(self, steps: range) -> None:
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        batches = [torch.randn(MICRO, 4, 6, generator=g) * 2 for _ in range(STEPS)]
        for s in steps:
            for micro in batches[s]:
                with self.model.no_sync():
                    self.model(micro).sin().pow(2).mean().backward()
            self.opt.ingest_grads(self.acc)
            self.opt.step()
            self.opt.zero_grad()

    def weights(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def resume(params: dict[str, Any]) -> dict[str, Any]:
    """Train, save (model, optimizer, accumulator), train on; fresh objects load and train on."""
    half = STEPS // 2
    run = _Run(0, acc_seed=9)
    run.train(range(half))
    saved = _roundtrip(
        {
            "model": run.model.module.state_dict(),
            "opt": run.opt.state_dict(),
            "acc": run.acc.state_dict(),
        }
    )
    run.train(range(half, STEPS))
    fresh = _Run(1, acc_seed=0)
    fresh.model.module.load_state_dict(saved["model"])
    fresh.opt.load_state_dict(saved["opt"])
    fresh.acc.load_state_dict(saved["acc"])
    fresh.train(range(half, STEPS))
    unloaded = _Run(1, acc_seed=9)  # the same seed, but the generator starts over
    unloaded.model.module.load_state_dict(saved["model"])
    unloaded.opt.load_state_dict(saved["opt"])
    unloaded.train(range(half, STEPS))
    return {
        "weights": run.weights(),
        "resumed": fresh.weights(),
        "unloaded": unloaded.weights(),
        "generator": saved["acc"]["generator.cpu"],
    }
