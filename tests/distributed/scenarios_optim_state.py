"""Scenarios for compact optimizer state (``ctx.optim_state``) on many ranks
(``test_parallel_optim_state.py``).

The gradients are exact, so every difference is the optimizer's. The loss is linear in every
weight (``Net``: ``sum(out * y)`` times a power of two, ``out`` linear in the weights), the data
are small integers, and a rank's loss carries ``world / 2**9``: each rank's gradient is an
exact sum of small products, DDP's and FSDP2's averages over the ranks are exact, and equal to
the one process's gradient of the whole batch bit for bit. Adam's update is element-wise, so
two runs whose quantization blocks hold the same elements step identically, bit for bit:

- DDP (every rank steps the whole parameters, as one process does) is compared bitwise with
  one process running the same ``Net``, masters (bf16, stochastic rounding) and packed parts.
- FSDP2 steps each rank's shard: its blocks (and ``int4``'s rank-1 scales) are the shard's.
  The one-process reference is the same ``Net`` built with every weight split at the shard
  boundaries into separate parameters (``pieces=2``): rank r's state is piece r's, bitwise.
- ``parallelize`` (DDP with its gradient accumulator, FSDP2) wires the same runs: bitwise
  equal to the hand-built ones.
- DCP checkpoints decode packed state to float32 (``computectx.memory.optim.state.load``);
  loading encodes it again with the loading ranks' blocks. Weights whose shards hold whole
  blocks are re-formed exactly at either world size (``DCP_ALIGNED``); the others
  (``int8``'s ``c_w``, 640 elements a shard; ``int4``'s ``d_w`` second moment, rank-1 scales
  over a rank's rows) are re-encoded, within one round trip's bound of what was saved.

Every rank reports what it holds; the test compares ranks and worlds.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx, DType
from computectx.distributed import Parallel, ShardedParams, parallelize
from computectx.distributed.optimizer_checkpoint import (
    optimizer_state_dict,
    parameter_fqns,
    set_optimizer_state_dict,
)
from computectx.distributed.parallel import Strategy
from computectx.memory import OffloadedOptimizer

Result = dict[str, Any]

IN, WIDE = 16, 128
SHAPES = {
    "a_w": (64, IN),
    "a_b": (64,),
    "b_w": (64, IN),
    "c_w": (80, IN),
    "d_w": (96, WIDE),
}
"""The weights: ``a_w``, ``b_w`` shard into 512 elements (2 blocks of 256, 16 of 32), ``c_w``
into 640 (2.5 blocks of 256), ``d_w`` into 48 x 128 (``int4``'s second moment rank-1
normalized: 48 + 128 scales, fewer than 192 blocks of 32); the bias stays float32 (under
``min``)."""
ROWS, STEPS, BEFORE, AFTER = 8, 3, 2, 2
LR = 1e-2
DDP_FORMATS = ("int8/min=512", "int4/block=32/min=512")
FSDP_FORMATS = DDP_FORMATS
DCP_ALIGNED = {
    "int8/min=512": ("a_w", "a_b", "b_w", "d_w"),
    "int4/block=32/min=512": ("a_w", "a_b", "b_w", "c_w"),
}
"""Per format saved and loaded through DCP: the weights whose shards hold whole blocks, so
2 ranks and one process quantize them alike (``int4``'s ``d_w`` second moment is rank-1
normalized over the rank's rows: its column scales differ; ``int8``'s ``c_w`` is 2.5 blocks
a shard)."""


def ctx_for(optim_state: str, master: DType) -> ComputeCtx:
    return (
        ComputeCtx.parity("cpu")
        .replace(master=master, offload=torch.device("cpu"))
        .with_optim_state(optim_state)
    )


class Net(nn.Module):
    """``((x a_w^T + a_b + 2x b_w^T) * ya).sum() + (x c_w^T * yc).sum() + (xd d_w^T * yd).sum()``,
    times ``scale``.

    With ``pieces > 1`` every weight is that many parameters (``a_w_0``, ``a_w_1``, ...), its
    rows split as FSDP2 shards them, concatenated in the forward: the same function, the
    same gradients, but each piece quantized on its own.
    """

    def __init__(self, seed: int, pieces: int = 1) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.pieces = pieces
        for name, shape in SHAPES.items():
            whole = torch.randn(shape, generator=gen) * 0.1
            if pieces == 1:
                self.register_parameter(name, nn.Parameter(whole))
            else:
                for k, part in enumerate(whole.chunk(pieces)):
                    self.register_parameter(f"{name}_{k}", nn.Parameter(part.clone()))

    def weight(self, name: str) -> torch.Tensor:
        if self.pieces == 1:
            w: torch.Tensor = getattr(self, name)
            return w
        return torch.cat([getattr(self, f"{name}_{k}") for k in range(self.pieces)])

    def forward(self, batch: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
        x, ya, yc, xd, yd = batch
        out = x @ self.weight("a_w").t() + self.weight("a_b") + (2 * x) @ self.weight("b_w").t()
        loss = (out * ya).sum() + ((x @ self.weight("c_w").t()) * yc).sum()
        loss = loss + ((xd @ self.weight("d_w").t()) * yd).sum()
        return loss * scale


def batches() -> list[tuple[torch.Tensor, ...]]:
    """Small integers (exact products and sums in float32), one global batch per step."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(max(STEPS, BEFORE + AFTER)):
        shapes = [
            (ROWS, IN),
            (ROWS, SHAPES["a_w"][0]),
            (ROWS, SHAPES["c_w"][0]),
            (ROWS, WIDE),
            (ROWS, SHAPES["d_w"][0]),
        ]
        out.append(tuple(torch.randint(-3, 4, s, generator=gen).float() for s in shapes))
    return out


def train(model: nn.Module, opt: OffloadedOptimizer | Parallel, steps: range) -> None:
    """Each rank its rows of the global batch; a rank's loss scaled so the average over the
    ranks is the one process's gradient (both exact). ``opt`` a ``Parallel``: its ``step``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per = ROWS // world
    data = batches()
    for s in steps:
        batch = tuple(t[rank * per : (rank + 1) * per] for t in data[s])
        model(batch, world / 2**9).backward()
        opt.step()
        if isinstance(opt, OffloadedOptimizer):
            opt.zero_grad()


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.detach().clone()


def snapshot(model: nn.Module, opt: OffloadedOptimizer) -> Result:
    """What the optimizer holds: its packed parts as this rank keeps them (``parts/FQN/key``,
    position form), and the checkpoint form gathered whole (``masters/FQN``, ``decoded/FQN/
    name``: every rank calls this, the gathers are collectives)."""
    names = parameter_fqns(model)  # without DDP's "module."
    fqns = [names[id(p)] for p in opt.compute_params]
    position = opt.state_dict()
    out: Result = {"optim_state": str(position.get("optim_state"))}
    for i, per_param in position["state"].items():
        for key, value in per_param.items():
            out[f"parts/{fqns[i]}/{key}"] = value.detach().clone()
    form = optimizer_state_dict(model, opt)
    for fqn, master in form["master_weights"].items():
        out[f"masters/{fqn}"] = _whole(master)
    for fqn, per_param in form["state"].items():
        for name, value in per_param.items():
            out[f"decoded/{fqn}/{name}"] = _whole(value)
    out["form_optim_state"] = str(form.get("optim_state"))
    return out


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "gather",
    "scatter",
    "reduce",
    "all_to_all_single",
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


def rank0_alone(model: nn.Module, opt: OffloadedOptimizer) -> list[str]:
    """Rank 0 takes both state dicts alone (the rank-0 rule: no collective); the others wait
    at a barrier. A collective in there would pair with the barrier or hang to the timeout."""
    calls: list[str] = []
    if dist.get_rank() == 0:
        with counting_collectives() as calls:
            opt.state_dict()
            optimizer_state_dict(model, opt)
    dist.barrier()
    return calls


# ----- DDP ---------------------------------------------------------------------------------


def ddp_family(params: Result) -> Result:
    """Per format: DDP (one process: the plain ``Net``), bf16 masters, ``STEPS`` steps."""
    out: Result = {}
    for fmt in DDP_FORMATS:
        net = Net(seed=0)
        model: nn.Module = net if dist.get_world_size() == 1 else DistributedDataParallel(net)
        opt = OffloadedOptimizer(model.parameters(), ctx_for(fmt, DType.BF16), lr=LR)
        with counting_collectives() as calls:
            train(model, opt, range(STEPS))
        out[f"{fmt}/step_collectives"] = list(calls)
        out[f"{fmt}/rank0_alone"] = rank0_alone(model, opt)
        out.update({f"{fmt}/{k}": v for k, v in snapshot(model, opt).items()})
    return out


def parallelize_family(params: Result) -> Result:
    """``parallelize`` (DDP with bf16 masters: its gradient accumulator; FSDP2 with f32
    masters), ``int8``: the same run as the hand-built ``ddp_family``/``fsdp_family`` one."""
    fmt, out = DDP_FORMATS[0], {}
    runs: tuple[tuple[Strategy, DType], ...] = (("ddp", DType.BF16), ("fsdp", DType.F32))
    for strategy, master in runs:
        ctx = ctx_for(fmt, master)
        par = parallelize(Net(seed=0), ctx, strategy=strategy, lr=LR)
        train(par.model, par, range(STEPS))
        assert isinstance(par.optimizer, OffloadedOptimizer)
        out.update({f"{strategy}/{k}": v for k, v in snapshot(par.module, par.optimizer).items()})
    return out


def _held(par: Parallel) -> list[torch.Tensor]:
    """This rank's weights, masters and stored state tensors, copied."""
    assert isinstance(par.optimizer, OffloadedOptimizer)
    held = [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for p in par.module.parameters()
    ]
    held += [m.detach().clone() for m in par.optimizer.master_params]
    held += [
        v.detach().clone()
        for per_param in par.optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    ]
    return held


def _refused(par: Parallel, call: Any) -> Result:
    """``call()``'s error (type and message) on this rank, how long it took, and whether
    anything this rank holds changed."""
    before = _held(par)
    start = time.monotonic()
    try:
        call()
        error = ""
    except Exception as e:  # recorded, judged by the test
        error = f"{type(e).__name__}: {e}"
    after = _held(par)
    changed = len(before) != len(after) or any(
        not torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, after, strict=True)
    )
    return {"error": error, "s": time.monotonic() - start, "changed": changed}


def one_rank_faults(params: Result) -> Result:
    """State that only rank 1 holds bad, through ``parallelize`` (int8, f32 masters): a
    ``step`` count of -1 in its optimizer state, then ``Parallel.step`` (DDP and FSDP2); a
    checkpoint whose optimizer ``step`` is NaN on rank 1 only, then ``Parallel.load_state_dict``
    (FSDP2, where the load is a collective). Every rank must raise the same error naming rank
    1, promptly, with nothing changed on either rank; the group then trains on."""
    rank, out, fmt = dist.get_rank(), Result(), DDP_FORMATS[0]
    runs: tuple[Strategy, ...] = ("ddp", "fsdp")
    for strategy in runs:
        par = parallelize(Net(seed=0), ctx_for(fmt, DType.F32), strategy=strategy, lr=LR)
        assert isinstance(par.optimizer, OffloadedOptimizer)
        train(par.model, par, range(1))
        first = next(iter(par.optimizer.state.values()))
        good = first["step"].clone()
        if rank == 1:
            first["step"].fill_(-1.0)
        batch = tuple(t[rank * 4 : (rank + 1) * 4] for t in batches()[1])
        par.model(batch, 1 / 2**9).backward()
        out[f"{strategy}/step"] = _refused(par, par.step)
        first["step"].copy_(good)
        par.optimizer.zero_grad()
        if strategy == "fsdp":
            sd = par.state_dict()
            if rank == 1:
                opt_part = sd["optimizer"]
                opt_part["state"][next(iter(opt_part["state"]))]["step"] = torch.tensor(math.nan)
            load = functools.partial(par.load_state_dict, sd)
            out[f"{strategy}/load"] = _refused(par, load)
        if strategy == "fsdp" and isinstance(par.optimizer.sharding, ShardedParams):
            out["fsdp/one_group"] = par.optimizer.sharding.group is par.group
        train(par.model, par, range(2, 3))  # the group goes on
        out[f"{strategy}/trained_on"] = [p.detach().clone() for p in par.optimizer.master_params]
    return out


# ----- FSDP2 -------------------------------------------------------------------------------


def fsdp_family(params: Result) -> Result:
    """Per format: FSDP2 on 2 ranks (one process: ``Net(pieces=2)``), f32 masters."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    out: Result = {}
    for fmt in FSDP_FORMATS:
        model, opt = build_fsdp(mesh, fmt, seed=0, pieces=2 if mesh is None else 1)
        train(model, opt, range(STEPS))
        out[f"{fmt}/rank0_alone"] = rank0_alone(model, opt) if mesh is not None else []
        out.update({f"{fmt}/{k}": v for k, v in snapshot(model, opt).items()})
        names = parameter_fqns(model)
        out[f"{fmt}/local_shapes"] = {
            names[id(p)]: list(m.shape)
            for p, m in zip(opt.compute_params, opt.master_params, strict=True)
        }
    return out


def build_fsdp(
    mesh: DeviceMesh | None, fmt: str, seed: int, pieces: int = 1
) -> tuple[nn.Module, OffloadedOptimizer]:
    model = Net(seed, pieces)
    ctx = ctx_for(fmt, DType.F32)
    if mesh is None:
        return model, OffloadedOptimizer(model.parameters(), ctx, lr=LR)
    fully_shard(model, mesh=mesh)
    sharding = ShardedParams(mesh)
    return model, OffloadedOptimizer(model.parameters(), ctx, sharding=sharding, lr=LR)


# ----- DCP ---------------------------------------------------------------------------------


def _mesh() -> DeviceMesh | None:
    world = dist.get_world_size()
    return init_device_mesh("cpu", (world,)) if world > 1 else None


def _save(model: nn.Module, opt: OffloadedOptimizer, path: str) -> None:
    save({"optim": optimizer_state_dict(model, opt)}, checkpoint_id=path)


def _load(model: nn.Module, opt: OffloadedOptimizer, path: str) -> list[str]:
    """Load ``path`` into the optimizer; the UserWarnings it gave (a conversion warns)."""
    state = {"optim": optimizer_state_dict(model, opt)}
    load(state, checkpoint_id=path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_optimizer_state_dict(model, opt, state["optim"])
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def dcp_train_save_resume(mesh: DeviceMesh | None, fmt: str, path: str) -> Result:
    """Train ``BEFORE`` steps, save, go on ``AFTER`` (uninterrupted); a fresh optimizer (other
    initial weights) loads the checkpoint and trains the same ``AFTER`` steps."""
    model, opt = build_fsdp(mesh, fmt, seed=0)
    train(model, opt, range(BEFORE))
    _save(model, opt, path)
    out: Result = {"saved": snapshot(model, opt)}
    train(model, opt, range(BEFORE, BEFORE + AFTER))
    out["uninterrupted"] = snapshot(model, opt)
    model2, opt2 = build_fsdp(mesh, fmt, seed=5)
    out["resume_warnings"] = _load(model2, opt2, path)
    out["resumed_loaded"] = snapshot(model2, opt2)
    train(model2, opt2, range(BEFORE, BEFORE + AFTER))
    out["resumed"] = snapshot(model2, opt2)
    return out


def dcp_load_and_go_on(mesh: DeviceMesh | None, fmt: str, path: str) -> Result:
    model, opt = build_fsdp(mesh, fmt, seed=7)
    out: Result = {"warnings": _load(model, opt, path)}
    out["loaded"] = snapshot(model, opt)
    train(model, opt, range(BEFORE, BEFORE + AFTER))
    out["continued"] = snapshot(model, opt)
    return out


# ----- the launches ------------------------------------------------------------------------


def _dcp_path(params: Result, key: str, fmt: str) -> str:
    return f"{params[key]}-{fmt.split('/')[0]}"


def one_process(params: Result) -> Result:
    """World size 1, the reference of everything; saves ``path`` (DCP) for the 2 ranks."""
    out: Result = {f"ddp/{k}": v for k, v in ddp_family(params).items()}
    out.update({f"fsdp/{k}": v for k, v in fsdp_family(params).items()})
    for fmt in DCP_ALIGNED:
        run = dcp_train_save_resume(None, fmt, _dcp_path(params, "path", fmt))
        out.update({f"dcp/{fmt}/{k}": v for k, v in run.items()})
    return out


def two_ranks(params: Result) -> Result:
    """Two gloo ranks: DDP, FSDP2, parallelize, DCP (save ``path``, resume, load ``other``:
    one process's)."""
    out: Result = {f"ddp/{k}": v for k, v in ddp_family(params).items()}
    out.update({f"fsdp/{k}": v for k, v in fsdp_family(params).items()})
    out.update({f"parallelize/{k}": v for k, v in parallelize_family(params).items()})
    out.update({f"faults/{k}": v for k, v in one_rank_faults(params).items()})
    mesh = _mesh()
    for fmt in DCP_ALIGNED:
        run = dcp_train_save_resume(mesh, fmt, _dcp_path(params, "path", fmt))
        run.update(
            {
                f"from_other/{k}": v
                for k, v in dcp_load_and_go_on(mesh, fmt, _dcp_path(params, "other", fmt)).items()
            }
        )
        out.update({f"dcp/{fmt}/{k}": v for k, v in run.items()})
    return out


def load_in_one_process(params: Result) -> Result:
    """World size 1: load ``other`` (saved on 2 ranks) and train on."""
    out: Result = {}
    for fmt in DCP_ALIGNED:
        run = dcp_load_and_go_on(None, fmt, _dcp_path(params, "other", fmt))
        out.update({f"dcp/{fmt}/from_other/{k}": v for k, v in run.items()})
    return out
