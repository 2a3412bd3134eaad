"""One rank of the accelerate recipe (docs/integrations.md), started by torchrun.

``python -m torch.distributed.run --nproc-per-node N accelerate_worker.py OUT_DIR``: trains an
fp8 MLP with an ``OffloadedOptimizer`` through ``Accelerator.prepare`` under bf16 mixed
precision, clips with ``accelerator.clip_grad_norm_``, saves with ``save_state()`` and loads the
state into a fresh model and optimizer with ``load_state()``. Every rank first runs the same
recipe as one process, on a group of one of its own (the environment ``torchrun
--nproc-per-node 1`` gives, in this launch: a launch's imports cost more than its training),
before the launch's group exists: the reference, under ``"one"``. Writes
``OUT_DIR/rank{R}.pt``.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import InitProcessGroupKwargs
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import sync_scaling
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.memory import OffloadedOptimizer

ROWS, WIDTH = 8, 32


def build(accelerator: Accelerator) -> tuple[nn.Module, OffloadedOptimizer, nn.Module]:
    """The model as prepared (DDP on many ranks), the prepared optimizer, the model itself."""
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(offload=torch.device("cpu"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU(), nn.Linear(64, WIDTH))
    convert_to_quantized(model, ctx, module_filter=lambda module, fqn: True)
    opt = OffloadedOptimizer(model.parameters(), ctx, torch.optim.AdamW, lr=1e-3)
    prepared, opt = accelerator.prepare(model, opt)
    return prepared, opt, model


def ledgers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{role}": op.ledger.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
        for role, op in m.scaling.operands.items()
    }


def same(a: object, b: object) -> bool:
    """Whether two optimizer state dicts hold equal values (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def train_step(
    model: nn.Module, opt: OffloadedOptimizer, accelerator: Accelerator, step: int
) -> float:
    rank, world = accelerator.process_index, accelerator.num_processes
    per = ROWS // world
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, WIDTH, generator=gen) * (1.0 + 10.0 * step)
    loss = model(x[rank * per : (rank + 1) * per]).float().square().mean()
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return float(accelerator.reduce(loss.detach(), reduction="mean"))


def run(out: Path) -> tuple[int, dict[str, Any]]:
    """The recipe on the group this process's environment names: its rank, its results."""
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=30))
    # bf16 mixed precision: accelerate runs the forward under torch.autocast, and the fp8
    # layers (float32 weights) then return bf16, as nn.Linear does.
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[timeout])
    model, opt, inner = build(accelerator)
    out_dtypes: list[str] = []
    for layer in inner.modules():
        if isinstance(layer, QuantizedLinear):
            layer.register_forward_hook(lambda m, args, y: out_dtypes.append(str(y.dtype)))
    # DDP under torchrun; nothing to keep in step alone. Every rank runs every training
    # forward, so the seeds may take the group's amax (the losses are then one process's).
    sync_scaling(model, current_amax="group")
    losses = [train_step(model, opt, accelerator, step) for step in range(4)]
    # No merge call before saving: the last backward merged every rank's fp8 state.
    probe = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(99))
    saved_ledgers = ledgers(inner)
    saved_opt = copy.deepcopy(opt.state_dict())
    inner.eval()
    with torch.no_grad():
        before = inner(probe)
    inner.train()
    accelerator.save_state(str(out / "state"))  # the defaults: safetensors for the model
    accelerator.wait_for_everyone()  # rank 0 writes; every rank reads
    train_step(model, opt, accelerator, 4)  # moves weights, ledgers and moments on
    accelerator.load_state(str(out / "state"))
    inner.eval()
    with torch.no_grad():
        after = inner(probe)
    loaded_opt = opt.state_dict()
    result = {
        "losses": torch.tensor(losses),
        "ledgers": saved_ledgers,
        "ledgers_loaded": ledgers(inner),
        "before": before,
        "after": after,
        "optimizer_equal": same(saved_opt, loaded_opt),
        "world": accelerator.num_processes,
        "out_dtypes": sorted(set(out_dtypes)),
        "distributed_type": str(accelerator.distributed_type),
    }
    accelerator.wait_for_everyone()  # no rank tears the group down while another uses it
    accelerator.end_training()
    return accelerator.process_index, result


def one_process(out: Path) -> dict[str, Any]:
    """The recipe as ``torchrun --nproc-per-node 1`` runs it (a gloo group of one, here on a
    store of its own), before the launch's group exists; accelerate's state then forgotten."""
    environ = dict(os.environ)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_PORT=str(port)
    )
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # the launch's store is not ours
    try:
        return run(out)[1]
    finally:
        os.environ.clear()
        os.environ.update(environ)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def main(out: Path) -> None:
    one = one_process(out / f"one{os.environ['RANK']}")
    rank, result = run(out / "two")
    torch.save({**result, "one": one}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
