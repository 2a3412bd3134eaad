"""Expert parallelism at its edges (issue 32, items 1, 9, 10): one rank's checkpoint, one
rank's forward, one rank's failed setup check. One launch; the checks live in
``test_expert_parallel_edges.py``. Each case also runs in the same process without the edge,
so what the edge must leave unchanged is compared bit for bit."""

from __future__ import annotations

import io
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from computectx import ComputeCtx
from computectx.distributed import expert_parallel, full_state_dict, parallelize
from computectx.nn import MoE

DIM, EXPERTS, TOP_K, ROWS = 16, 4, 2, 8
JOIN_S = 1.0


class Net(nn.Module):
    """A linear layer, then an MoE: the smallest model with a replicated and an expert part."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        ctx = ComputeCtx.from_flag("fp32", "cpu")
        self.proj = nn.Linear(DIM, DIM)
        self.moe = MoE(ctx, DIM, DIM, EXPERTS, TOP_K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.moe(self.proj(x))
        return out


def _x(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))


def _setup(seed: int = 0, **ep: Any) -> tuple[Net, Any]:
    model = Net(seed)
    expert_parallel(model, join_timeout=JOIN_S, **ep)
    par = parallelize(
        model,
        ComputeCtx.from_flag("fp32", "cpu"),
        optimizer_class=torch.optim.AdamW,
        lr=1e-2,
        join_timeout=JOIN_S,
    )
    return model, par


def _train(par: Any, steps: int, first: int = 0) -> torch.Tensor:
    losses = []
    for step in range(first, first + steps):
        loss = par.model(_x(100 * step + dist.get_rank())).square().mean()
        loss.backward()
        par.step()
        losses.append(float(loss))
    return torch.tensor(losses, dtype=torch.float64)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _error(call: Any) -> str:
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _moments(par: Any) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in par.module.named_parameters()}
    return {
        names[id(p)]: s["exp_avg"].clone() for p, s in par.optimizer.state.items() if "exp_avg" in s
    }


def checkpoint(params: dict[str, Any]) -> dict[str, Any]:
    """Item 1: rank 0 alone saves ``par.state_dict()`` and the module's; every rank loads
    them. Then the ways that work: ``full_state_dict`` saved on rank 0 (into a fresh
    expert-parallel model and into one process), and DCP 2 -> 2 with AdamW moments."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    rank = dist.get_rank()
    model, par = _setup()
    _train(par, 2)
    files = [io.BytesIO(), io.BytesIO()]
    if rank == 0:  # the documented one-rank save
        torch.save(par.state_dict(), files[0])
        torch.save(model.state_dict(), files[1])
    blobs: list[Any] = [[f.getvalue() for f in files]]
    dist.broadcast_object_list(blobs, src=0)
    saved = [torch.load(io.BytesIO(b), weights_only=True) for b in blobs[0]]
    before = _params(model)
    out: dict[str, Any] = {
        "parallel_error": _error(lambda: par.load_state_dict(saved[0])),
        "module_error": _error(lambda: model.load_state_dict(saved[1])),
    }
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in _params(model).items())
    # The gathered checkpoint: whole experts, saved by one rank, loads anywhere.
    whole = full_state_dict(model)
    out["whole_shape"] = tuple(whole["moe.experts.gate_up"].shape)
    fresh, _ = _setup(seed=5)
    fresh.load_state_dict(whole)
    out["fresh_equal"] = all(torch.equal(p, before[n]) for n, p in _params(fresh).items())
    plain = Net(seed=6)
    plain.load_state_dict(whole)
    ref = Net(seed=0)
    ref.load_state_dict(whole)
    x = _x(77)
    out["plain_equal"] = torch.equal(plain(x), ref(x))
    # DCP on every rank, 2 -> 2: the model and the AdamW moments of each rank's experts.
    path = params["path"]
    save(par.state_dict(), checkpoint_id=path)
    again_model, again = _setup(seed=9)
    _train(again, 1, first=50)  # other moments, other weights: the load must bring them
    state = again.state_dict()
    load(state, checkpoint_id=path)
    again.load_state_dict(state)
    want = _moments(par)
    got = _moments(again)
    out["dcp_weights_equal"] = all(
        torch.equal(p, before[n]) for n, p in _params(again_model).items()
    )
    out["dcp_moments_equal"] = sorted(got) == sorted(want) and all(
        torch.equal(got[n], want[n]) for n in want
    )
    return out


def lone_forward(params: dict[str, Any]) -> dict[str, Any]:
    """Item 9: rank 0 alone runs an eval forward (``par.model`` under DDP, and the module),
    then both ranks train; the same training without the lone calls, bit for bit."""
    rank = dist.get_rank()
    runs: dict[str, Any] = {}
    for lone in (True, False):
        model, par = _setup()
        _train(par, 1)
        errors, seconds = [], []
        if lone and rank == 0:
            for run in (par.model, par.module, model.moe):
                run.eval()
                start = time.monotonic()
                with torch.no_grad():
                    errors.append(_error(lambda run=run: run(_x(5))))
                seconds.append(time.monotonic() - start)
                run.train()
        dist.barrier()
        losses = _train(par, 2, first=1)
        runs["lone" if lone else "joint"] = {
            "errors": errors,
            "seconds": seconds,
            "losses": losses,
            "params": _params(model),
        }
    return runs


class _Dispatch:
    """A dispatch some earlier call set (on one rank only)."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: Any) -> torch.Tensor:
        raise AssertionError("never called")

    def __repr__(self) -> str:
        return "_Dispatch()"


def disagree(params: dict[str, Any]) -> dict[str, Any]:
    """Item 10: a setup check that fails on rank 1 only raises the same error on every rank,
    promptly: expert_parallel (rank 1's MoE already set up; rank 1's expert count that the
    group cannot divide) and parallelize (rank 1's learning rate)."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def timed(key: str, call: Any) -> None:
        start = time.monotonic()
        out[key] = _error(call)
        out[f"{key}_s"] = time.monotonic() - start

    model = Net()
    if rank == 1:
        model.moe.dispatch = _Dispatch()
    timed("dispatch", lambda: expert_parallel(model))
    three = Net()
    if rank == 1:
        three.moe = MoE(ComputeCtx.from_flag("fp32", "cpu"), DIM, DIM, 3, TOP_K)
    timed("count", lambda: expert_parallel(three))
    plain = Net()
    weight = plain.proj.weight.detach().clone()
    lr = 0.1 if rank == 0 else -1.0
    timed(
        "lr",
        lambda: parallelize(
            plain, ComputeCtx.from_flag("fp32", "cpu"), optimizer_class=torch.optim.SGD, lr=lr
        ),
    )
    out["lr_unchanged"] = torch.equal(plain.proj.weight, weight) and not hasattr(
        plain, "_ddp_params_and_buffers_to_ignore"
    )
    # The group is still usable: an all-reduce after the refused calls.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


class Net2(nn.Module):
    """Two MoE layers: a refusal in the second must not move the first."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        ctx = ComputeCtx.from_flag("fp32", "cpu")
        self.moe = MoE(ctx, DIM, DIM, EXPERTS, TOP_K)
        self.moe2 = MoE(ctx, DIM, DIM, EXPERTS, TOP_K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.moe2(self.moe(x))
        return out


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # NaN compares equal to NaN here: a refused call left it where it was.
    return a.keys() == b.keys() and all(
        torch.equal(a[k].nan_to_num(), b[k].nan_to_num()) for k in a
    )


def helpers(params: dict[str, Any]) -> dict[str, Any]:
    """The expert helpers at their edges (the adversarial pass on issue 32): one rank alone
    calls each helper that is a collective; ranks that disagree in parallelize's choices, in
    whether they are expert-parallel, in an expert's width; a non-finite bias in a second
    layer on one rank; a whole expert weight of the same size and another shape; a
    rollback to a full_state_dict; a fullgraph compile; an MoE layer called alone."""
    from computectx.distributed import (
        clip_grad_norm_with_experts,
        expert_parameters,
        update_expert_bias,
    )

    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def timed(key: str, call: Any) -> None:
        start = time.monotonic()
        out[key] = _error(call)
        out[f"{key}_s"] = time.monotonic() - start

    # 1. Each collective helper on rank 0 alone: a prompt error naming rank 1; then together.
    model, par = _setup()
    _train(par, 1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    group = dist.group.WORLD
    assert group is not None
    experts = tuple(expert_parameters(model))
    calls: dict[str, Any] = {
        "lone_full": lambda: full_state_dict(model),
        "lone_bias": lambda: update_expert_bias(model),
        "lone_clip": lambda: clip_grad_norm_with_experts(
            list(model.parameters()), experts, group, 1.0
        ),
    }
    # The setup calls too: their first collective (agree's all_gather_object) is joined.
    ctx = ComputeCtx.from_flag("fp32", "cpu")
    calls["lone_expert_parallel"] = lambda: expert_parallel(Net(), join_timeout=JOIN_S)
    calls["lone_parallelize"] = lambda: parallelize(
        Net(), ctx, strategy="ddp", optimizer_class=torch.optim.SGD, lr=0.1, join_timeout=JOIN_S
    )
    if rank == 0:
        for key, call in calls.items():
            timed(key, call)
    dist.barrier()
    out["together"] = {k: _error(call) for k, call in calls.items()}
    # 2. Ranks that set up differently: every rank raises the same error at once.
    model = Net()
    expert_parallel(model, join_timeout=JOIN_S)
    ctx = ComputeCtx.from_flag("fp32", "cpu")
    strategy = "fsdp" if rank == 1 else "ddp"
    timed("strategy", lambda: parallelize(model, ctx, strategy=strategy, lr=0.1))  # type: ignore[arg-type]

    def ep_on_rank_1() -> None:
        plain = Net()
        if rank == 1:
            expert_parallel(plain, join_timeout=JOIN_S)
        parallelize(plain, ctx, lr=0.1, join_timeout=JOIN_S)

    timed("ep_one_rank", ep_on_rank_1)
    wide = Net()
    if rank == 1:
        wide.moe = MoE(ctx, DIM, 2 * DIM, EXPERTS, TOP_K)
    timed("hidden", lambda: expert_parallel(wide, join_timeout=JOIN_S))
    # 3. A NaN router bias in the second layer on rank 1 only: every rank refuses, nothing
    # moves (the first layer's bias and counts included).
    two = Net2()
    expert_parallel(two, join_timeout=JOIN_S)
    two(_x(rank)).sum().backward()
    if rank == 1:
        with torch.no_grad():
            two.moe2.router.bias[1] = float("nan")
    before = _buffers(two)
    timed("nan_bias", lambda: update_expert_bias(two))
    out["nan_bias_unchanged"] = _same(before, _buffers(two))
    # 4. A whole expert weight of the same size and another shape: refused naming both
    # shapes, before anything loads.
    wider = Net()
    wider.moe = MoE(ctx, DIM, 2 * DIM, EXPERTS, TOP_K)  # down (4, 16, 32)
    expert_parallel(wider, join_timeout=JOIN_S)
    whole = full_state_dict(wider)
    bad = {**whole, "moe.experts.down": whole["moe.experts.down"].reshape(EXPERTS, 2 * DIM, DIM)}
    bad["proj.weight"] = torch.zeros(DIM, DIM)
    params_before = _params(wider)
    timed("shape", lambda: wider.load_state_dict(bad))
    out["shape_unchanged"] = _same(params_before, _params(wider))
    # 5. full_state_dict is a snapshot: after a step, loading it brings back every weight.
    model, par = _setup()
    _train(par, 1)
    snap = full_state_dict(model)
    at_snap = _params(model)
    _train(par, 1, first=1)
    model.load_state_dict(snap)
    out["rollback_equal"] = _same(at_snap, _params(model))
    # 6. A fullgraph compile refuses with our reason; an MoE layer alone joins as an MoE.
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    out["compile"] = _error(lambda: compiled(_x(rank)))
    torch.compiler.reset()
    if rank == 0:
        timed("moe_alone", lambda: model.moe(_x(5)))
    dist.barrier()
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


def edges(params: dict[str, Any]) -> dict[str, Any]:
    """Every case above in one launch."""
    return {
        "helpers": helpers(params),
        "disagree": disagree(params),
        "lone_forward": lone_forward(params),
        "checkpoint": checkpoint(params),
        "frozen_checkpoint": frozen_checkpoint(params),
        "late_frozen_experts": late_frozen_experts(params),
        "frozen_mode_differs": frozen_mode_differs(params),
    }


def _frozen_net(seed: int, flag: str, spread: bool = True, freeze: bool = True) -> Net:
    """``Net`` under ``flag``'s recipe, its experts spread over the ranks (``spread``), then
    frozen (``freeze``)."""
    from computectx.formats import convert_to_quantized, freeze_fp4_for_serving

    ctx = ComputeCtx.from_flag(flag, "cpu")
    torch.manual_seed(seed)
    model = Net.__new__(Net)
    nn.Module.__init__(model)
    model.proj = nn.Linear(DIM, DIM)
    model.moe = MoE(ctx, DIM, DIM, EXPERTS, TOP_K)
    convert_to_quantized(model, ctx, min_features=DIM)
    if spread:
        expert_parallel(model, join_timeout=JOIN_S)
    if not freeze:
        return model
    if flag == "nvfp4":
        freeze_fp4_for_serving(model.moe)
    else:
        model.moe.experts.freeze_for_serving()
    return model


def late_frozen_experts(params: dict[str, Any]) -> dict[str, Any]:
    """fp8 experts spread over the ranks, ``parallelize``, a backward, then the experts
    frozen for serving on rank 1 only: ``Parallel.step``'s outcome and whether it changed any
    weight (rank 1's check is exchanged: every rank raises it, before rank 0 steps)."""
    model = _frozen_net(0, "fp8_hybrid", freeze=False)
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    par = parallelize(model, ctx, optimizer_class=torch.optim.SGD, lr=0.1, join_timeout=JOIN_S)
    par.model(_x(dist.get_rank())).float().square().mean().backward()
    if dist.get_rank() == 1:
        model.moe.experts.freeze_for_serving()
    before = _params(model)
    error = _error(par.step)
    after = _params(model)
    return {"error": error, "unchanged": all(torch.equal(after[n], p) for n, p in before.items())}


def frozen_mode_differs(params: dict[str, Any]) -> dict[str, Any]:
    """NVFP4 experts spread over the ranks and frozen weight-only on rank 0, W4A4 on rank 1
    (each rank's own, which no broadcast compares): ``parallelize``'s outcome and whether
    anything changed (before: it ran, a model no process held, adversarial s48 I3)."""
    from computectx.formats import freeze_fp4_for_serving

    model = _frozen_net(0, "nvfp4", freeze=False)
    freeze_fp4_for_serving(model.moe, "w4a4" if dist.get_rank() else "weight_only")
    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    before = _expert_state(model)
    call = lambda: parallelize(model, ctx, optimizer_class=torch.optim.SGD, lr=0.1)  # noqa: E731
    error = _error(call)
    after = _expert_state(model)
    return {"error": error, "unchanged": all(torch.equal(after[n], b) for n, b in before.items())}


def _expert_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: b.detach().view(torch.uint8).clone()
        for n, b in model.named_buffers()
        if n.startswith("moe.experts.") and b.dim() and b.dtype != torch.int64
    }


def frozen_checkpoint(params: dict[str, Any]) -> dict[str, Any]:
    """Frozen experts (fp8 codes and steps, 4-bit codes, scales and amaxes) in checkpoints,
    each rank its own (other seeds): rank 0's ``torch.save`` is refused on rank 1 as the
    trainable experts' is; DCP on every rank brings each rank its own back;
    ``full_state_dict`` holds every expert and loads into one process."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for flag in ("fp8_hybrid", "nvfp4"):
        model = _frozen_net(rank, flag)
        mine = _expert_state(model)
        blob = [io.BytesIO()]
        if rank == 0:
            torch.save(model.state_dict(), blob[0])
        blobs: list[Any] = [blob[0].getvalue()]
        dist.broadcast_object_list(blobs, src=0)
        saved = torch.load(io.BytesIO(blobs[0]), weights_only=True)
        error = _error(lambda model=model, saved=saved: model.load_state_dict(saved))
        kept = _expert_state(model)
        path = f"{params['path']}-{flag}"
        save(model.state_dict(), checkpoint_id=path)
        other = _frozen_net(10 + rank, flag)
        state = other.state_dict()
        load(state, checkpoint_id=path)
        other.load_state_dict(state)
        back = _expert_state(other)
        whole = full_state_dict(model)
        everyone: list[Any] = [None, None]
        dist.all_gather_object(everyone, mine)
        one = _frozen_net(20, flag, spread=False)
        one_error = _error(lambda one=one, whole=whole: one.load_state_dict(whole))
        in_one = _expert_state(one)
        out[flag] = {
            "error": error,
            "unchanged": sorted(kept) == sorted(mine)
            and all(torch.equal(kept[k], mine[k]) for k in mine),
            "dcp_back": sorted(back) == sorted(mine)
            and all(torch.equal(back[k], mine[k]) for k in mine),
            "whole": {
                k: torch.equal(whole[k].view(torch.uint8), torch.cat([e[k] for e in everyone]))
                for k in mine
            },
            "one_error": one_error,
            "one_equal": all(torch.equal(in_one[k], whole[k].view(torch.uint8)) for k in mine),
        }
    return out
