"""Mixture-of-experts on many ranks: expert parallelism (``expert_parallel``) and MoE ByteLMs
through ``parallelize`` (DDP, FSDP2), each against one process on the whole batch, computed
in the same rank from the same initial weights (so each family is one launch).

Every scenario returns tensors and strings; the checks live in ``test_expert_parallel.py``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from computectx import ComputeCtx
from computectx.distributed import (
    expert_parallel,
    full_state_dict,
    parallelize,
    sync_fp4_counters,
)
from computectx.formats import Fp4Experts, convert_to_quantized
from computectx.fp4_recipe import Fp4Recipe
from computectx.nn import ByteLM, LMConfig, MoE

DIM, HIDDEN, EXPERTS, TOP_K = 32, 32, 4, 2
TOKENS = 16


def _moe(ctx: ComputeCtx, n_experts: int = EXPERTS) -> MoE:
    torch.manual_seed(0)
    return MoE(ctx, DIM, HIDDEN, n_experts, TOP_K)


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    out: torch.Tensor = full() if full is not None else t
    return out.detach().clone()


def _run_moe(moe: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward and backward of ``x`` under a loss normalized by the whole batch."""
    xs = x.clone().requires_grad_()
    y = moe(xs)
    (y.float().square().sum() / TOKENS).backward()
    grads = {n: p.grad.detach().clone() for n, p in moe.named_parameters() if p.grad is not None}
    assert xs.grad is not None
    return {"y": y.detach().clone(), "dx": xs.grad.clone(), **grads}


def _ep_case(ctx: ComputeCtx, skew: bool) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    moe = _moe(ctx)
    if skew:
        # Every token to rank 1's experts (the bias selects, never weighs).
        with torch.no_grad():
            moe.router.bias[EXPERTS // 2 :] = 100.0
    ref = copy.deepcopy(moe)
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(7))
    one = _run_moe(ref, x)
    local = EXPERTS // world
    expert_parallel(moe)
    per = TOKENS // world
    lo, hi = rank * per, (rank + 1) * per
    if skew:  # rank 0 has no token at all; rank 1 the whole batch
        lo, hi = (0, 0) if rank == 0 else (0, TOKENS)
    mine = _run_moe(moe, x[lo:hi])
    out: dict[str, Any] = {"dispatch": repr(moe.dispatch), "load": moe.last_load.clone()}
    if isinstance(moe.experts.fp8, Fp4Experts):  # 4 bits: the counter after the call
        out["experts.sr_key"] = (_counters(moe), _counters(ref))
    for key, got in mine.items():
        want = one[key]
        if key in ("y", "dx"):
            want = want[lo:hi]
        elif key.startswith("experts."):
            want = want[rank * local : (rank + 1) * local]
        else:  # router and shared weights: every rank holds its own tokens' part
            t = got.clone()
            dist.all_reduce(t)
            got = t
        out[key] = (got, want)
    return out


def expert_parallel_cases(params: dict[str, Any]) -> dict[str, Any]:
    """EP on the world's ranks against one process, per flag in ``flags``: an even split of
    the batch, then the skew (every token to rank 1's experts, rank 0 with none); and the
    error for an expert count the world does not divide."""
    out: dict[str, Any] = {}
    for flag in params["flags"]:
        ctx = ComputeCtx.from_flag(flag, "cpu")
        out[flag] = _ep_case(ctx, skew=False)
        out[f"{flag}-skew"] = _ep_case(ctx, skew=True)
    try:
        expert_parallel(_moe(ComputeCtx.from_flag("fp32", "cpu"), n_experts=3))
        out["error"] = ""
    except ValueError as e:
        out["error"] = str(e)
    # Compact optimizer state on an expert-parallel model: refused on every rank, whether
    # parallelize would build an OffloadedOptimizer (offload=None) or a plain one (False).
    compact = ComputeCtx.from_flag("fp32", "cpu").with_optim_state("int8")
    for offload in (None, False):
        moe = _moe(compact)
        expert_parallel(moe)
        try:
            parallelize(moe, compact, offload=offload, optimizer_class=torch.optim.SGD, lr=0.1)
            out[f"compact/offload={offload}"] = ""
        except ValueError as e:
            out[f"compact/offload={offload}"] = str(e)
    for fmt in params.get("train_fp4", ()):  # 4-bit experts trained under EP + DDP
        recipe = Fp4Recipe(format=fmt, stochastic=True, hp=("*.attn.*",))
        out[f"train-{fmt}"] = train_fp4_ep(recipe, 2, f"{params['path']}-{fmt}")
    return out


# ----- MoE ByteLMs through parallelize ------------------------------------------------------

CONFIG = LMConfig(
    d_model=DIM, n_layers=1, n_heads=2, d_ff=64, max_len=16, n_experts=EXPERTS, top_k=TOP_K,
    moe_hidden=HIDDEN, moe_bias_rate=0.05,
)  # fmt: skip
BATCH, SEQ = 4, 8


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _reference(model: ByteLM, steps: int, lr: float) -> dict[str, Any]:
    """One process on the whole batch: SGD, the router biases moved after every step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids, targets = _batch(step)
        loss = model.loss(ids, targets)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        model.update_expert_bias()
        losses.append(float(loss))
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "bias": torch.stack([m.router.bias.clone() for m in model.moe_layers()]),
    }


def train(params: dict[str, Any]) -> dict[str, Any]:
    """``steps`` SGD steps of an MoE ByteLM under ``flag`` for each setup of ``setups``
    (``"ddp"``, ``"fsdp"``, ``"ep+ddp"``, ``"ep+fsdp"``; ``"-unused"`` appended: expert 0 is
    never chosen; ``"@ACTS"`` appended: the ctx's activation policy in its text form), each
    rank its share of the batch, and the same model in one process on the whole batch.
    Reports both; ``"ep+ddp"`` also round-trips a DCP checkpoint (``path``)."""
    flag_ctx = ComputeCtx.from_flag(params["flag"], "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    steps, lr = params["steps"], params.get("lr", 0.1)
    out: dict[str, Any] = {}
    for named in params["setups"]:
        setup, _, acts = named.partition("@")
        ctx = flag_ctx.replace(activations=acts) if acts else flag_ctx
        torch.manual_seed(0)
        model = ByteLM(ctx, CONFIG)
        if setup.endswith("-unused"):  # no token ever chooses expert 0
            with torch.no_grad():
                for m in model.moe_layers():
                    m.router.bias[0] = -100.0
        ref = _reference(copy.deepcopy(model), steps, lr)
        strategy = setup.removeprefix("ep+").removesuffix("-unused")
        if setup.startswith("ep+"):
            expert_parallel(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            par = parallelize(
                model,
                ctx,
                strategy=strategy,
                optimizer_class=torch.optim.SGD,
                lr=lr,
                mp_policy=MixedPrecisionPolicy() if strategy == "fsdp" else None,
            )
            per = BATCH // world
            losses = []
            for step in range(steps):
                ids, targets = _batch(step)
                mine = slice(rank * per, (rank + 1) * per)
                loss = model.loss_of(par.model(ids[mine]), targets[mine])
                loss.backward()  # type: ignore[no-untyped-call]
                par.step()
                if strategy == "ddp" and not setup.startswith("ep+") and rank == 0:
                    # The rank-0 rules: rank 0 alone evaluates and saves (no collective).
                    model.eval()
                    with torch.no_grad():
                        model(ids)
                    model.train()
                    par.state_dict()
                t = loss.detach().reshape(1)
                dist.all_reduce(t)
                losses.append(float(t) / world)
        local = EXPERTS // world
        weights = {}
        for n, p in model.named_parameters():
            full = _full(p)
            want = ref["weights"][n]
            if setup.startswith("ep+") and ".experts." in n:
                want = want[rank * local : (rank + 1) * local]
            weights[n] = (full, want)
        if named == "ep+ddp":
            out["checkpoint"] = _checkpoint(par.state_dict(), params["path"], ctx, ref)
        out[named] = {
            "losses": (torch.tensor(losses, dtype=torch.float64), ref["losses"]),
            "weights": weights,
            "bias": (torch.stack([m.router.bias.clone() for m in model.moe_layers()]), ref["bias"]),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            "expert_0_load": int(model.moe_layers()[0].last_load[0]),
        }
    return out


def _checkpoint(state: dict[str, Any], path: str, ctx: ComputeCtx, ref: dict[str, Any]) -> Any:
    """An expert-parallel checkpoint saved with DCP, loaded into one process's model, and
    that model's whole weights loaded into a fresh expert-parallel one: each rank's experts
    (every weight against the one-process training)."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    save(state, checkpoint_id=path)
    torch.manual_seed(1)  # other initial weights: the loads must bring them
    plain = ByteLM(ctx, CONFIG)
    whole = {k: v for k, v in plain.state_dict().items() if k in state["model"]}
    load({"model": whole}, checkpoint_id=path)
    plain.load_state_dict(whole, strict=False)
    again = ByteLM(ctx, CONFIG)
    expert_parallel(again)
    again.load_state_dict(plain.state_dict())
    resumed = ByteLM(ctx, CONFIG)  # and the Parallel round trip, into a fresh setup
    expert_parallel(resumed)
    par = parallelize(resumed, ctx, optimizer_class=torch.optim.SGD, lr=0.1)
    fresh = par.state_dict()
    load(fresh, checkpoint_id=path)
    par.load_state_dict(fresh)
    rank, local = dist.get_rank(), EXPERTS // dist.get_world_size()
    out = {}
    for n, p in plain.named_parameters():
        out[n] = (p.detach().clone(), ref["weights"][n])
    for n, p in again.named_parameters():
        want = ref["weights"][n]
        if ".experts." in n:
            want = want[rank * local : (rank + 1) * local]
        out[f"again.{n}"] = (p.detach().clone(), want)
        out[f"resumed.{n}"] = (resumed.get_parameter(n).detach().clone(), want)
    return out


def fp8_expert_gather(params: dict[str, Any]) -> dict[str, Any]:
    """An fp8 ``block`` MoE ByteLM under FSDP2, the experts gathered as fp8 and, in the same
    launch, as float32: the bytes the expert weights put on the wire and the training."""
    ctx = ComputeCtx.from_flag("fp8_block", "cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for gather in (True, False):
        torch.manual_seed(0)
        model = ByteLM(ctx, CONFIG)
        calls: list[tuple[torch.dtype, int]] = []
        saved = {n: getattr(dist, n) for n in _GATHERS if hasattr(dist, n)}

        par = parallelize(
            model,
            ctx,
            strategy="fsdp",
            optimizer_class=torch.optim.SGD,
            lr=0.1,
            fp8_all_gather=gather,
            mp_policy=MixedPrecisionPolicy(),
        )
        kinds = sorted({type(_full_local(e.gate_up)).__name__ for e in _experts(model)})
        per = BATCH // world
        losses, outs = [], []
        for name, original in saved.items():
            setattr(dist, name, _counting(original, calls))
        try:
            for step in range(params["steps"]):
                ids, targets = _batch(step)
                mine = slice(rank * per, (rank + 1) * per)
                logits = par.model(ids[mine])
                loss = model.loss_of(logits, targets[mine])
                loss.backward()  # type: ignore[no-untyped-call]
                par.step()
                losses.append(float(loss))
                outs.append(logits.detach().float())
        finally:
            for name, original in saved.items():
                setattr(dist, name, original)
        out["fp8" if gather else "hp"] = {
            "kinds": kinds,
            "wire": calls,
            "losses": torch.tensor(losses, dtype=torch.float64),
            "outs": torch.stack(outs),
            "weights": {n: _full(p) for n, p in model.named_parameters()},
            "shard_expert_elements": sum(
                _full_local(w).numel() for e in _experts(model) for w in (e.gate_up, e.down)
            ),
        }
    return out


def _full_local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "to_local", None)
    out: torch.Tensor = local() if local is not None else t
    return out


_GATHERS = ("all_gather_single", "all_gather_into_tensor")


def _counting(original: Any, calls: list[tuple[torch.dtype, int]]) -> Any:
    def counting(o: Any, i: torch.Tensor, *a: Any, **kw: Any) -> Any:
        calls.append((i.dtype, i.numel() * i.element_size()))
        return original(o, i, *a, **kw)

    return counting


def _experts(model: nn.Module) -> list[Any]:
    return [m.experts for m in model.modules() if isinstance(m, MoE)]


# ----- 4-bit experts under expert parallelism -----------------------------------------------


def _fp4_lm(recipe: Fp4Recipe) -> ByteLM:
    """An MoE ByteLM whose experts alone are 4-bit (built in float32, converted whole with
    ``hp`` keeping the attention high: its dense GEMMs then match one process's to float32
    rounding, so what is compared is the experts')."""
    torch.manual_seed(0)
    model = ByteLM(ComputeCtx.from_flag("fp32", "cpu"), CONFIG)
    ctx4 = ComputeCtx.from_flag(recipe.format, "cpu").replace(recipe=recipe)
    report = convert_to_quantized(model, ctx4, min_features=16)
    assert report.experts == ("blocks.0.mlp.experts",), report.experts
    return model


def _gate_up(model: ByteLM) -> torch.Tensor:
    return model.get_parameter("blocks.0.mlp.experts.gate_up").detach().clone()


def _counters(model: nn.Module) -> torch.Tensor:
    return torch.stack([m.sr_key for m in model.modules() if isinstance(m, Fp4Experts)])


def train_fp4_ep(recipe: Fp4Recipe, steps: int, path: str) -> dict[str, Any]:
    """``steps`` SGD steps of a 4-bit-experts ByteLM under ``expert_parallel`` + DDP against
    one process on the whole batch: losses, weights, the experts' counters (after
    ``Parallel.step``'s counter sync); rank 0's lone eval forward and counter sync (the
    join's errors) and ``state_dict``; ``full_state_dict`` and a DCP round trip carrying the
    counters."""
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    world, rank = dist.get_world_size(), dist.get_rank()
    model = _fp4_lm(recipe)
    ref_model = copy.deepcopy(model)
    ref = _reference(ref_model, steps, 0.1)
    expert_parallel(model, join_timeout=0.5)
    ctx4 = ComputeCtx.from_flag(recipe.format, "cpu").replace(recipe=recipe)
    par = parallelize(model, ctx4, strategy="ddp", optimizer_class=torch.optim.SGD, lr=0.1)
    per, losses = BATCH // world, []
    out: dict[str, Any] = {}
    for step in range(steps):
        ids, targets = _batch(step)
        mine = slice(rank * per, (rank + 1) * per)
        loss = model.loss_of(par.model(ids[mine]), targets[mine])
        loss.backward()  # type: ignore[no-untyped-call]
        par.step()
        t = loss.detach().reshape(1)
        dist.all_reduce(t)
        losses.append(float(t) / world)
    if rank == 0:  # rank 0 alone (rank 1 waits in a barrier): an eval refuses, a save runs
        model.eval()
        try:
            with torch.no_grad():
                model(_batch(0)[0])
            out["lone_eval"] = ""
        except RuntimeError as e:
            out["lone_eval"] = str(e)
        model.train()
        out["lone_state"] = sorted(k for k in model.state_dict() if "experts" in k)
        before = _counters(model)
        assert par.group is not None
        try:  # the public counter sync alone: the join's error, nothing changed
            sync_fp4_counters(model, par.group, join_timeout=0.5)
            out["lone_sync"] = ""
        except RuntimeError as e:
            out["lone_sync"] = str(e)
        out["lone_sync_kept"] = torch.equal(before, _counters(model))
    dist.barrier()
    local = EXPERTS // world
    weights = {}
    for n, p in model.named_parameters():
        want = ref["weights"][n]
        weights[n] = (
            p.detach().clone(),
            want[rank * local : (rank + 1) * local] if ".experts." in n else want,
        )
    out["losses"] = (torch.tensor(losses, dtype=torch.float64), ref["losses"])
    out["weights"] = weights
    out["counters"] = (_counters(model), _counters(ref_model))
    # full_state_dict: whole experts and the agreed counter, into one process.
    whole = full_state_dict(model)
    plain = _fp4_lm(recipe)
    plain.load_state_dict(whole)
    out["full"] = (_counters(plain), _counters(ref_model))
    out["full_experts"] = (
        _gate_up(plain),
        ref["weights"]["blocks.0.mlp.experts.gate_up"],
    )
    # DCP: saved on the ranks, loaded into a fresh expert-parallel setup.
    save(par.state_dict(), checkpoint_id=path)
    fresh_model = _fp4_lm(recipe)
    expert_parallel(fresh_model, join_timeout=1.0)
    fresh = parallelize(fresh_model, ctx4, optimizer_class=torch.optim.SGD, lr=0.1)
    state = fresh.state_dict()
    load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    out["dcp"] = (_counters(fresh_model), _counters(ref_model))
    out["dcp_streams"] = [m.sr_stream for m in fresh_model.modules() if isinstance(m, Fp4Experts)]
    out["dcp_experts"] = (
        _gate_up(fresh_model),
        weights["blocks.0.mlp.experts.gate_up"][0],
    )
    return out
