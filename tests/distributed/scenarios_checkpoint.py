"""Scenarios for distributed checkpoints of model + fp8 scaling + ``OffloadedOptimizer``
(``test_optimizer_checkpoint.py``).

An fp8 model (two ``QuantizedLinear`` layers and a plain ``Linear`` whose 3 rows split 2/1 over two
ranks) trains with AdamW masters in an ``OffloadedOptimizer`` and ``sync_scaling``: on two
ranks sharded by FSDP2 (``sharding=ShardedParams(mesh)``), in one process (the reference) as a
plain module. After ``BEFORE`` steps everything is saved with ``torch.distributed.checkpoint``,
then training goes on for ``AFTER`` steps (the uninterrupted run). A fresh model (other initial
weights) loads a checkpoint, from this world size or the other, and trains the same ``AFTER``
steps. Each phase reports the state whole (DTensors gathered), so runs at different world
sizes compare directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

from computectx import ComputeCtx
from computectx.distributed import ShardedParams, sync_scaling
from computectx.distributed.optimizer_checkpoint import (
    optimizer_state_dict,
    parameter_fqns,
    set_optimizer_state_dict,
)
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.memory import OffloadedOptimizer

BATCH, BEFORE, AFTER = 8, 3, 3
Result = dict[str, Any]


def _ctx() -> ComputeCtx:
    return ComputeCtx.from_flag("fp8_hybrid", "cpu")  # masters f32 on the CPU


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3)
    )
    # The last layer (16 -> 3) is too narrow for fp8 and stays a plain Linear.
    convert_to_quantized(model, _ctx(), module_filter=lambda module, fqn: True)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(BEFORE + AFTER):
        x = torch.randn(BATCH, 32, generator=gen)
        x[BATCH // 2 :] *= 8.0  # rank 1's half: another range, so the amax sync matters
        out.append((x, torch.randn(BATCH, 3, generator=gen)))
    return out


PROBE = torch.linspace(-3.0, 3.0, 4 * 32).reshape(4, 32)


class Run:
    """One model, its optimizer and amax sync; sharded when there is a mesh."""

    def __init__(self, mesh: DeviceMesh | None, seed: int) -> None:
        self.model = make_model(seed)
        sharding = None
        if mesh is not None:
            for module in (self.model[0], self.model[2], self.model[4], self.model):
                fully_shard(module, mesh=mesh)
            sharding = ShardedParams(mesh)
        self.opt = OffloadedOptimizer(
            self.model.parameters(), _ctx(), torch.optim.AdamW, sharding=sharding, lr=1e-2
        )
        self.sync = sync_scaling(self.model)

    def train(self, steps: range) -> list[float]:
        world, rank = dist.get_world_size(), dist.get_rank()
        per = BATCH // world
        losses = []
        batches = _batches()
        for s in steps:
            x, y = batches[s]
            xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            # Each rank's own mean (FSDP2 averages the gradients): a rank's output gradient
            # is world_size times the whole batch's, so the gradient ledgers are in per-rank
            # units, and the sync rescales a checkpoint's ledgers saved at another world size.
            loss = nn.functional.mse_loss(self.model(xs).float(), ys)
            loss.backward()  # type: ignore[no-untyped-call]
            self.opt.clip_grad_norm(1.0)
            self.opt.step()
            self.opt.zero_grad()
            whole = loss.detach().clone()
            dist.all_reduce(whole)
            losses.append(float(whole) / world)
        return losses

    def state(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.model),
            "optim": optimizer_state_dict(self.model, self.opt),
        }

    def save(self, path: str) -> None:
        self.sync.sync()  # every rank's last amaxes go into the checkpoint
        save(self.state(), checkpoint_id=path)

    def load(self, path: str) -> None:
        state = self.state()
        load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.opt, state["optim"])

    def snapshot(self) -> Result:
        """Everything whole, then the forward output on PROBE (which records amaxes too)."""
        out: Result = {
            "ledgers": ledgers(self.model),
            "weights": {n: _whole(p) for n, p in self.model.named_parameters()},
            "optim": whole_optimizer(self.model, self.opt),
        }
        with torch.no_grad():
            out["probe"] = self.model(PROBE).detach().clone()
        return out

    def finish(self, steps: range) -> Result:
        losses = self.train(steps)
        self.sync.sync()
        return {
            "losses": torch.tensor(losses, dtype=torch.float64),
            "ledgers": ledgers(self.model),
            "weights": {n: _whole(p) for n, p in self.model.named_parameters()},
            "optim": whole_optimizer(self.model, self.opt),
        }


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.detach().clone()


def whole_optimizer(model: nn.Module, opt: OffloadedOptimizer) -> dict[str, torch.Tensor]:
    sd = optimizer_state_dict(model, opt)
    out = {f"master_weights/{fqn}": _whole(t) for fqn, t in sd["master_weights"].items()}
    for fqn, per_param in sd["state"].items():
        out.update({f"{name}/{fqn}": _whole(t) for name, t in per_param.items()})
    return out


def ledgers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{role}": op.ledger.detach().clone()
        for name, m in model.named_modules()
        if isinstance(m, QuantizedLinear)
        for role, op in m.scaling.operands.items()
    }


def _mesh() -> DeviceMesh | None:
    world = dist.get_world_size()
    return init_device_mesh("cpu", (world,)) if world > 1 else None


def _train_save_resume(mesh: DeviceMesh | None, path: str) -> Result:
    """Train, save, go on (uninterrupted); then a fresh model resumes from the checkpoint."""
    run = Run(mesh, seed=0)
    out: Result = {"losses_before": torch.tensor(run.train(range(BEFORE)), dtype=torch.float64)}
    run.save(path)
    out["saved"] = run.snapshot()
    out["uninterrupted"] = run.finish(range(BEFORE, BEFORE + AFTER))
    out["keys"] = sorted(optimizer_state_dict(run.model, run.opt)["master_weights"])
    out["model_keys"] = sorted(get_model_state_dict(run.model))
    resumed = Run(mesh, seed=5)
    resumed.load(path)
    out["resumed_loaded"] = resumed.snapshot()
    out["resumed"] = resumed.finish(range(BEFORE, BEFORE + AFTER))
    return out


def _load_and_go_on(mesh: DeviceMesh | None, path: str) -> Result:
    run = Run(mesh, seed=7)
    run.load(path)
    return {"loaded": run.snapshot(), "continued": run.finish(range(BEFORE, BEFORE + AFTER))}


def one_process(params: dict[str, Any]) -> Result:
    """World size 1, the reference: train, save ``path``, resume from it; FQNs under DDP."""
    out = _train_save_resume(None, params["path"])
    out.update(_wrapper_fqns())
    out.update(_unsharded_refusal())
    return out


def load_in_one_process(params: dict[str, Any]) -> Result:
    """World size 1: load ``other`` (saved on more ranks) and train on."""
    return {"from_other": _load_and_go_on(None, params["other"])}


def two_ranks(params: dict[str, Any]) -> Result:
    """Two FSDP2 ranks: train, save ``path``, resume from it, load ``other`` (one process's)."""
    mesh = _mesh()
    assert mesh is not None
    out = _train_save_resume(mesh, params["path"])
    out["from_other"] = _load_and_go_on(mesh, params["other"])
    out.update(_sharded_errors(mesh))
    return out


def _wrapper_fqns() -> Result:
    """FQNs under DDP, which needs a process group (here one of size 1): torch's keys."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(make_model(0))
    opt = OffloadedOptimizer(ddp.parameters(), _ctx(), torch.optim.AdamW)
    return {
        "ddp_keys": sorted(optimizer_state_dict(ddp, opt)["master_weights"]),
        "ddp_model_keys": sorted(k for k in get_model_state_dict(ddp) if ".fp8_" not in k),
        "ddp_names": sorted(parameter_fqns(ddp).values()),
    }


def _unsharded_refusal() -> Result:
    """A DTensor for a parameter that is not sharded is refused (a mesh of one rank)."""
    run = Run(None, seed=0)
    run.train(range(1))
    state = run.state()["optim"]
    mesh = init_device_mesh("cpu", (1,))
    master = state["master_weights"]["2.bias"]
    state["master_weights"]["2.bias"] = DTensor.from_local(master, mesh, [Replicate()])
    try:
        set_optimizer_state_dict(run.model, run.opt, state)
        return {"dtensor_for_plain": ""}
    except ValueError as e:
        return {"dtensor_for_plain": str(e)}


def _sharded_errors(mesh: DeviceMesh) -> Result:
    """Values that do not fit a sharded parameter are refused, naming them; nothing changes."""
    run = Run(mesh, seed=0)
    run.train(range(1))
    out: Result = {}

    def attempt(name: str, edit: Any) -> None:
        state = run.state()["optim"]
        before = whole_optimizer(run.model, run.opt)
        edit(state)
        try:
            set_optimizer_state_dict(run.model, run.opt, state)
            out[name] = ""
        except (TypeError, ValueError) as e:
            out[name] = str(e)
        after = whole_optimizer(run.model, run.opt)
        out[f"{name}_untouched"] = all(torch.equal(before[k], after[k]) for k in before)

    def plain_master(state: dict[str, Any]) -> None:
        state["master_weights"]["0.weight"] = torch.zeros(32, 32)

    def replicated_moment(state: dict[str, Any]) -> None:
        t = state["state"]["2.weight"]["exp_avg"]
        state["state"]["2.weight"]["exp_avg"] = DTensor.from_local(
            torch.zeros(16, 32), mesh, [Replicate()], run_check=False
        )
        assert t.shape == (16, 32)

    attempt("plain_master", plain_master)
    attempt("replicated_moment", replicated_moment)

    # Adafactor's factored moments are not shaped like the parameter: they cannot reshard.
    adafactor = OffloadedOptimizer(
        run.model.parameters(), _ctx(), torch.optim.Adafactor, sharding=ShardedParams(mesh)
    )
    try:
        optimizer_state_dict(run.model, adafactor)
        out["adafactor"] = ""
    except ValueError as e:
        out["adafactor"] = str(e)
    return out
