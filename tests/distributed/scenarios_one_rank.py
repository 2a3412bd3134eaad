"""What one rank may call, under each strategy (``test_one_rank.py``; docs/distributed.md's
table "What one rank may call" is checked against what this reports).

Each family (``ddp``, ``fsdp``, ``ep``, ``ep+ddp``) is set up twice from the same weights. In
the first, rank 0 alone makes every call of ``CALLS`` while rank 1 waits on the store (no
collective); each call either returns (``runs``; its result is checked here against a plain
copy of the model) or raises (``raises``: the message). Then both ranks train two steps
together, in both setups: the steps after the lone calls must equal the steps without them
bit for bit, so the group is still usable and nothing the lone calls did leaked into it.

The families of ``BUFFER_FAMILIES`` run a model that holds buffers (a tiny ``ByteLM``: RoPE
tables, ``kv_amax``; with MoE, the router bias and the load counters) under DDP: rank 0 alone
runs the evaluation forwards of ``BUFFER_CALLS`` after one joint step, which must issue no
collective (DDP's buffer broadcast before a forward, or its bucket rebuild at the first forward
with grad on after a backward, would leave the ranks' collectives one apart). In the same
launch (``before_first_step``), a DDP run between its first backward and first step: rank 0's
lone forward with grad on, in which DDP would rebuild its buckets, and one with no_grad."""

from __future__ import annotations

import copy
import datetime
import io
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from computectx import ComputeCtx
from computectx.distributed import expert_parallel, parallelize
from computectx.nn import ByteLM, LMConfig, MoE

DIM, ROWS = 16, 8
JOIN_S = 0.5
FAMILIES = ("ddp", "fsdp", "ep", "ep+ddp")
CALLS = (
    "forward, train mode, grad on",
    "forward, eval mode, grad on",
    "forward, eval mode, no_grad",
    "forward, inference_mode",
    "module forward, eval mode, no_grad",
    "state_dict()",
    "torch.save(state_dict())",
    "load_state_dict(state)",
    "step()",
    "optimizer.clip_grad_norm(1.0)",
    "optimizer.step()",
)
BUFFER_FAMILIES = ("ddp lm", "ddp lm moe")
BUFFER_CALLS = CALLS[1:5]
"""The calls a ``BUFFER_FAMILIES`` family makes: the evaluation forwards (a train-mode one
counts an MoE's load, which the next step moves the router bias by)."""
NOT_APPLICABLE = "absent"
"""The outcome of a call the family's optimizer has not (a plain torch optimizer's
``clip_grad_norm``)."""


class Net(nn.Module):
    """A linear layer, then (``moe``) an MoE of 4 experts, top 2, or a second linear."""

    def __init__(self, moe: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(DIM, DIM)
        ctx = ComputeCtx.from_flag("fp32", "cpu")
        self.out: nn.Module = MoE(ctx, DIM, DIM, 4, 2) if moe else nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.relu(self.proj(x)))
        return out


class NotApplicableError(Exception):
    """The family's optimizer has no such call."""


class _Plain:
    """What ``parallelize`` returns, for a model under expert parallelism alone."""

    def __init__(self, model: nn.Module) -> None:
        self.model = self.module = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)


def _lm(moe: bool) -> nn.Module:
    torch.manual_seed(0)
    config = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=16)
    if moe:
        config = LMConfig(**{**config.model_dump(), "n_experts": 4, "top_k": 2, "moe_hidden": 16})
    return ByteLM(ComputeCtx.from_flag("fp32", "cpu"), config)


def _setup(family: str, mesh: DeviceMesh) -> tuple[Any, nn.Module]:
    if family in BUFFER_FAMILIES:
        model = _lm(moe=family.endswith("moe"))
    else:
        model = Net(moe=family.startswith("ep"))
    ref = copy.deepcopy(model)
    if family.startswith("ep"):
        expert_parallel(model, mesh, join_timeout=JOIN_S)
    if family == "ep":
        return _Plain(model), ref
    par = parallelize(
        model,
        ComputeCtx.from_flag("fp32", "cpu"),
        mesh,
        strategy="fsdp" if family == "fsdp" else "ddp",
        optimizer_class=torch.optim.SGD,
        lr=0.1,
        mp_policy=MixedPrecisionPolicy() if family == "fsdp" else None,
        join_timeout=JOIN_S,
        # Under FSDP2 an OffloadedOptimizer: its clip and step reduce over the shards.
        offload=True if family == "fsdp" else None,
    )
    return par, ref


def _x(family: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if family in BUFFER_FAMILIES:
        return torch.randint(0, 256, (2, 8), generator=g)
    return torch.randn(ROWS, DIM, generator=g)


def _forward(run: nn.Module, ref: nn.Module, train: bool, mode: Any, x: torch.Tensor) -> None:
    run.train(train)
    ref.train(train)
    try:
        with mode():
            got, want = run(x), ref(x)
    finally:
        run.train(True)
        ref.train(True)
    if not torch.equal(got.detach(), want.detach()):
        raise AssertionError("a lone forward returned another result than the plain model")


def _calls(par: Any, ref: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    def state() -> None:
        got = par.state_dict()
        model = got.get("model", got)
        if sorted(model) != sorted(ref.state_dict()):
            raise AssertionError(f"state_dict keys {sorted(model)}")

    def save() -> None:
        buf = io.BytesIO()
        torch.save(par.state_dict(), buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)

    def load() -> None:
        before = {n: p.detach().clone() for n, p in par.module.named_parameters()}
        par.load_state_dict(par.state_dict())
        for n, p in par.module.named_parameters():
            if not torch.equal(p.detach(), before[n]):
                raise AssertionError(f"loading its own state changed {n}")

    def step() -> None:
        par.step()

    def clip() -> None:
        clip_grad_norm = getattr(par.optimizer, "clip_grad_norm", None)
        if clip_grad_norm is None:
            raise NotApplicableError
        clip_grad_norm(1.0)

    m, r = par.model, ref
    return {
        CALLS[0]: lambda: _forward(m, r, True, torch.enable_grad, x),
        CALLS[1]: lambda: _forward(m, r, False, torch.enable_grad, x),
        CALLS[2]: lambda: _forward(m, r, False, torch.no_grad, x),
        CALLS[3]: lambda: _forward(m, r, False, torch.inference_mode, x),
        CALLS[4]: lambda: _forward(par.module, r, False, torch.no_grad, x),
        CALLS[5]: state,
        CALLS[6]: save,
        CALLS[7]: load,
        CALLS[8]: step,
        CALLS[9]: clip,
        CALLS[10]: lambda: par.optimizer.step(),
    }


def _train(par: Any, family: str, steps: int) -> dict[str, torch.Tensor]:
    losses = []
    for step in range(steps):
        loss = par.model(_x(family, 10 * step + dist.get_rank())).square().mean()
        loss.backward()
        par.step()
        losses.append(float(loss.detach()))
    out = {"losses": torch.tensor(losses, dtype=torch.float64)}
    for n, p in par.module.named_parameters():
        local = getattr(p, "to_local", None)
        out[n] = (local() if local is not None else p).detach().clone()
    local_buffers = MoE.local_buffer_names()  # each rank's own load counters
    for n, b in par.module.named_buffers():
        if n.rsplit(".", 1)[-1] not in local_buffers:
            out[f"buffer {n}"] = b.detach().clone()
    return out


def family(name: str, mesh: DeviceMesh, params: dict[str, Any]) -> dict[str, Any]:
    """One family: the lone calls' outcomes, and the training after them and without them."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    par, ref = _setup(name, mesh)
    # A model with buffers takes one joint step first: DDP's first forward with grad on after
    # a backward rebuilds its buckets (a broadcast), which a lone one must not make alone.
    warm = 1 if name in BUFFER_FAMILIES else 0
    if warm:
        _train(par, name, warm)
        ref.load_state_dict(par.module.state_dict())
    if rank == 0:
        calls = BUFFER_CALLS if name in BUFFER_FAMILIES else CALLS
        for call, fn in _calls(par, ref, _x(name, 3)).items():
            if call not in calls:
                continue
            start = time.monotonic()
            try:
                fn()
                out[call] = ("runs", "")
            except NotApplicableError:
                out[call] = (NOT_APPLICABLE, "")
            except Exception as e:  # recorded, judged by the test
                out[call] = ("raises", f"{type(e).__name__}: {e}")
            out[f"{call} s"] = time.monotonic() - start
        store.set(f"one-rank/{name}", "done")
    else:
        store.wait([f"one-rank/{name}"], datetime.timedelta(seconds=60))
    dist.barrier()
    out["after"] = _train(par, name, 2)
    again, _ = _setup(name, mesh)
    _train(again, name, warm)
    out["without"] = _train(again, name, 2)
    return out


def before_first_step(mesh: DeviceMesh) -> dict[str, Any]:
    """DDP between the first backward and the first step: rank 0 alone runs a forward with
    grad on (DDP would make its bucket rebuild there, a broadcast) and one with no_grad; then
    two joint steps. Rank 0's outcomes, and what every rank holds after."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    par, _ = _setup("ddp", mesh)
    par.model(_x("ddp", rank)).square().mean().backward()
    out: dict[str, Any] = {}
    if rank == 0:
        for call, grad in (("grad on", True), ("no_grad", False)):
            try:
                with torch.set_grad_enabled(grad):
                    par.model(_x("ddp", 3))
                out[call] = "runs"
            except RuntimeError as e:  # judged by the test
                out[call] = f"raises {e}"
        store.set("one-rank/before-first-step", "done")
    else:
        store.wait(["one-rank/before-first-step"], datetime.timedelta(seconds=60))
    par.step()
    out["after"] = _train(par, "ddp", 2)
    return out


def table(params: dict[str, Any]) -> dict[str, Any]:
    """Every family of ``params["families"]`` in one launch, on a group whose collectives
    time out after 10 s (a lone collective would fail the test in seconds, not hang it)."""
    group = dist.new_group(
        list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=10)
    )
    mesh = DeviceMesh.from_group(group, "cpu")
    out = {name: family(name, mesh, params) for name in params["families"]}
    out["before first step"] = before_first_step(mesh)
    return out
