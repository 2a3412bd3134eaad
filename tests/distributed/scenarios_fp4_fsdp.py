"""4-bit linears under ``parallelize(strategy="fsdp")`` on 2 gloo ranks (``test_fp4_fsdp.py``).

``gather``: for each recipe of ``params["recipes"]``, a 64 -> 64 -> 32 model of two
``Fp4Linear`` is set up by ``parallelize`` with FSDP2 gathering float32 where it gathers high
precision (``MixedPrecisionPolicy()``, as one process computes), and trained ``STEPS`` SGD
steps on ``ROWS[rank]`` rows a step (so the ranks' stochastic-rounding counters part ways
within a step). Each rank reports: the weight operands each layer multiplied with at its first
forward (forward and dgrad, as uint8), every all-gather's dtype and bytes and every
all-reduce, the warnings, the whole weights and the counters after each step. Between steps 1
and 2 rank 0 alone calls an evaluation forward and ``state_dict()`` (``lone``) while rank 1
waits on the store. With ``params["default_mp"]`` one more setup under ``parallelize``'s
default mixed precision (gather at ``ctx.compute``, bf16) reports its first operands.

``checkpoint``: a checkpoint saved in one process (``params["one"]``) loads on 2 ranks; they
train ``STEPS`` steps, save with DCP (``params["two"]``), train one more step; a fresh model
loads that checkpoint and trains the same step. Each phase reports the whole weights and the
counters. Then every rank loads zeroed weights, rank 1 with a counter out of range
(``one_rank_bad``: each rank's error and whether its weights stayed), and a ``parallelize``
whose ``fp8_filter`` converts layer 0 on rank 0 only (``filter_differs``: each rank's error), one
whose layer 0 runs on another stochastic-rounding stream on rank 1 (``streams_differ``), and
a model sharded by hand along dim 1 (``column_shards``: its first forward's error). Under
``strategy="ddp"`` (``ddp_loads``): rank 1's state alone with a bad stream, then with another
valid stream, is refused on every rank with nothing changed; ``assign_fp4_streams`` through the
DDP wrapper keeps the module's streams; a model whose two layers share a stream warns at setup.
"""

from __future__ import annotations

import datetime
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from computectx import ComputeCtx
from computectx.distributed import Parallel, enable_fp4_all_gather, parallelize
from computectx.formats import Fp4Linear, Fp4Recipe, assign_fp4_streams, convert_to_quantized
from computectx.memory import OffloadedOptimizer

ROWS = (20, 12)
"""Each rank's rows a step."""
STEPS = 3
LR = 0.1
JOIN_S = 1.0
TIMEOUT_S = 10.0


def ctx_of(recipe: str) -> ComputeCtx:
    """A CPU ctx under the 4-bit ``recipe`` (``Fp4Recipe.parse``'s text)."""
    return ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=Fp4Recipe.parse(recipe))


def model(recipe: str, seed: int = 0) -> nn.Sequential:
    """Two ``Fp4Linear``: 64 -> 64 (shards of 32 rows: whole 16- and 32-row blocks) and
    64 -> 32 (shards of 16 rows: whole NVFP4 tiles, but half an MXFP4 block of ``Wᵀ``)."""
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_quantized(seq, ctx_of(recipe), include_head=True, min_features=16)
    return seq


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows at ``step`` (float32)."""
    return torch.randn(ROWS[rank], 64, generator=torch.Generator().manual_seed(100 * step + rank))


def layers(seq: nn.Module) -> list[Fp4Linear]:
    return [m for m in seq.modules() if isinstance(m, Fp4Linear)]


def whole(seq: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor gathered), plain."""
    out = {}
    for n, p in seq.named_parameters():
        full = getattr(p, "full_tensor", None)
        t = full() if full is not None else p
        local = getattr(t, "hp", t)
        out[n] = local.detach().clone()
    return out


def counters(seq: nn.Module) -> list[int]:
    return [int(m.sr_key[1]) for m in layers(seq)]


def _setup(
    recipe: str, mesh: DeviceMesh | None, seed: int = 0, mp: bool = True, offload: bool = False
) -> Parallel:
    return parallelize(
        model(recipe, seed),
        ctx_of(recipe),
        mesh,
        strategy="fsdp",
        optimizer_class=torch.optim.SGD,
        lr=LR,
        mp_policy=MixedPrecisionPolicy() if mp else None,
        accumulate=False,
        offload=offload,
        join_timeout=JOIN_S,
    )


def _step(par: Parallel, i: int) -> None:
    par.model(batch(i, dist.get_rank())).square().mean().backward()
    par.step()


def _capture(seq: nn.Module) -> tuple[dict[str, Any], list[Any]]:
    """Record each layer's weight operands at its first forward (uint8 codes and scales, the
    amax; ``"hp"`` where the weight arrived in high precision)."""
    seen: dict[str, Any] = {}

    def hook(name: str) -> Any:
        def record(m: Fp4Linear, args: Any) -> None:
            if name in seen:
                return
            w = m.weight
            if not hasattr(w, "dgrad_operand"):
                seen[name] = "hp"
                return
            ops = (m.quantized_weight(), w.dgrad_operand())
            seen[name] = [
                (
                    q.codes.view(torch.uint8).clone(),
                    q.scale.view(torch.uint8).clone(),
                    getattr(q, "amax", torch.zeros(())).clone(),
                )
                for q in ops
            ]

        return record

    handles = [
        m.register_forward_pre_hook(hook(n))
        for n, m in seq.named_modules()
        if isinstance(m, Fp4Linear)
    ]
    return seen, handles


@contextmanager
def _traffic(seen: dict[str, list[Any]]) -> Iterator[None]:
    """Append every all-gather's (dtype, bytes) this rank hands in, and every all-reduce's
    dtype, to ``seen``."""
    names = ("all_gather_single", "all_gather_into_tensor", "all_reduce")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def gather(name: str) -> Any:
        def counted(out: Any, inp: Any, *args: Any, **kw: Any) -> Any:
            seen["gathers"].append((inp.dtype, inp.numel() * inp.element_size()))
            return saved[name](out, inp, *args, **kw)

        return counted

    def reduce(t: Any, *args: Any, **kw: Any) -> Any:
        seen["reduces"].append(str(t.dtype))
        return saved["all_reduce"](t, *args, **kw)

    for name in saved:
        setattr(dist, name, reduce if name == "all_reduce" else gather(name))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _lone(par: Parallel, tag: str) -> dict[str, str]:
    """Rank 0 alone: an evaluation forward and ``state_dict()``; rank 1 waits."""
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, str] = {}
    if dist.get_rank() == 0:
        par.model.eval()
        for call, fn in (
            ("eval forward", lambda: par.model(batch(9, 0))),
            ("state_dict", par.state_dict),
        ):
            try:
                with torch.no_grad():
                    fn()
                out[call] = "runs"
            except Exception as e:  # judged by the test
                out[call] = f"raises {type(e).__name__}: {e}"
        par.model.train()
        store.set(f"fp4-fsdp/{tag}", "done")
    else:
        store.wait([f"fp4-fsdp/{tag}"], datetime.timedelta(seconds=60))
    dist.barrier()
    return out


def _one_recipe(recipe: str, mesh: DeviceMesh, lone: bool) -> dict[str, Any]:
    par = _setup(recipe, mesh)
    operands, handles = _capture(par.module)
    out: dict[str, Any] = {"weights": [], "counters": [], "gathers": [], "reduces": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            if lone and i == 2:
                out["lone"] = _lone(par, recipe)
            with _traffic(out):  # the steps' collectives only
                _step(par, i)
            out["weights"].append(whole(par.module))
            out["counters"].append(counters(par.module))
    for h in handles:
        h.remove()
    out["operands"] = operands
    out["warnings"] = [str(w.message) for w in caught]
    out["wrapped"] = [
        type(getattr(m.weight, "_local_tensor", m.weight)).__name__ for m in layers(par.module)
    ]
    return out


def gather(params: dict[str, Any]) -> dict[str, Any]:
    """Each recipe of ``params["recipes"]`` (module docstring), on a group whose collectives
    time out after ``TIMEOUT_S``."""
    group = dist.new_group(list(range(2)), timeout=datetime.timedelta(seconds=TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    out: dict[str, Any] = {}
    for recipe in params["recipes"]:
        out[recipe] = _one_recipe(recipe, mesh, lone=recipe == params["lone"])
    if params.get("default_mp"):
        par = _setup(params["default_mp"], mesh, mp=False)
        operands, _ = _capture(par.module)
        with torch.no_grad():
            par.model(batch(0, dist.get_rank()))
        out["default_mp"] = operands
    return out


def _one_rank_bad_counter(par: Parallel) -> tuple[str, bool]:
    """Every rank loads zeroed weights, rank 1's state with a counter out of range: the
    error each rank raised and whether its weights stayed."""
    before = whole(par.module)
    state = par.state_dict()
    model = state["model"]
    for key, value in list(model.items()):
        if key.endswith("_extra_state"):
            if dist.get_rank() == 1:
                model[key] = value.clone()
                model[key][3] = -5  # [version, recipe code, seed, counter, stream]
        elif isinstance(value, torch.Tensor):
            model[key] = torch.zeros_like(value)
    try:
        par.load_state_dict(state)
        error = ""
    except ValueError as e:
        error = str(e)
    after = whole(par.module)
    return error, all(torch.equal(before[n], after[n]) for n in before)


def _filter_differs(recipe: str, mesh: DeviceMesh) -> str:
    """``parallelize`` of an unconverted model whose ``fp8_filter`` leaves layer 0 in high
    precision on rank 1 alone: the error this rank raised ("" if none)."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    skip = "0" if dist.get_rank() == 1 else None
    try:
        parallelize(
            seq,
            ctx_of(recipe),
            mesh,
            strategy="fsdp",
            optimizer_class=torch.optim.SGD,
            fp8_filter=lambda m, fqn: fqn != skip,
            join_timeout=JOIN_S,
        )
    except ValueError as e:
        return str(e)
    return ""


def _streams_differ(recipe: str, mesh: DeviceMesh) -> str:
    """``parallelize`` of a converted model whose layer 0 rank 1 moved to another
    stochastic-rounding stream (12345): the error this rank raised ("" if none)."""
    seq = model(recipe)
    if dist.get_rank() == 1:
        layers(seq)[0].set_sr_stream(12345)
    try:
        parallelize(
            seq,
            ctx_of(recipe),
            mesh,
            strategy="fsdp",
            optimizer_class=torch.optim.SGD,
            join_timeout=JOIN_S,
        )
    except ValueError as e:
        return str(e)
    return ""


def _column_shards(recipe: str, mesh: DeviceMesh) -> str:
    """``enable_fp4_all_gather`` and ``fully_shard`` by hand with every weight sharded along
    dim 1 (``shard_placement_fn``): the error of the first forward on this rank."""
    seq = model(recipe)
    enable_fp4_all_gather(seq)
    for layer in layers(seq):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(),
            shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None,
        )
    try:
        seq(batch(0, dist.get_rank()))
    except ValueError as e:
        return str(e)
    return ""


def _fp8_column_shards(mesh: DeviceMesh) -> str:
    """The same by hand for fp8 (``enable_fp8_all_gather``, per-tensor dynamic scaling)."""
    from computectx.distributed import enable_fp8_all_gather

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    ctx = ComputeCtx.from_flag("fp8_e4m3_dynamic", "cpu")
    convert_to_quantized(seq, ctx, include_head=True, min_features=16)
    enable_fp8_all_gather(seq)
    for layer in (seq[0], seq[2]):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=MixedPrecisionPolicy(),
            shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None,
        )
    try:
        seq(batch(0, dist.get_rank()))
    except ValueError as e:
        return str(e)
    return ""


def checkpoint(params: dict[str, Any]) -> dict[str, Any]:
    """Load ``params["one"]`` (saved in one process), train, save ``params["two"]``, train
    one more step; a fresh model loads ``params["two"]`` and trains that step (module
    docstring)."""
    group = dist.new_group(list(range(2)), timeout=datetime.timedelta(seconds=TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    recipe = params["recipe"]
    out: dict[str, Any] = {}
    par = _setup(recipe, mesh, seed=1)  # other initial weights: the load must replace them
    state = par.state_dict()
    load(state, checkpoint_id=params["one"])
    par.load_state_dict(state)
    out["loaded_one"] = (whole(par.module), counters(par.module))
    for i in range(STEPS):
        _step(par, i)
    save(par.state_dict(), checkpoint_id=params["two"])
    out["saved_two"] = (whole(par.module), counters(par.module))
    _step(par, STEPS)
    out["uninterrupted"] = (whole(par.module), counters(par.module))
    fresh = _setup(recipe, mesh, seed=2)
    state = fresh.state_dict()
    load(state, checkpoint_id=params["two"])
    fresh.load_state_dict(state)
    out["loaded_two"] = (whole(fresh.module), counters(fresh.module))
    _step(fresh, STEPS)
    out["resumed"] = (whole(fresh.module), counters(fresh.module))
    out["one_rank_bad"] = _one_rank_bad_counter(fresh)
    out["filter_differs"] = _filter_differs(recipe, mesh)
    out["streams_differ"] = _streams_differ(recipe, mesh)
    out["column_shards"] = _column_shards(recipe, mesh)
    out["ddp_loads"] = _ddp_loads(recipe, mesh)
    out["fp8_column_shards"] = _fp8_column_shards(mesh)
    # The memory policy's optimizer keeps plain masters of the 4-bit-gathered shards.
    par = _setup(recipe, mesh, offload=True)
    opt = par.optimizer
    assert isinstance(opt, OffloadedOptimizer)
    out["plain_masters"] = all(type(m.data) is torch.Tensor for m in opt.master_params)
    out["refused_step"] = _refused_step(par)
    return out


def _refused_step(par: Parallel) -> tuple[list[int], list[int], str]:
    """A step whose optimizer check fails on rank 1 alone: this rank's counters before and
    after (a refused step changes none) and its error."""
    par.model(batch(0, dist.get_rank())).square().mean().backward()
    before = counters(par.module)
    opt = par.optimizer
    assert isinstance(opt, OffloadedOptimizer)
    if dist.get_rank() == 1:

        def bad() -> None:
            raise ValueError("rank 1's optimizer state cannot step")

        opt.check_step = bad  # type: ignore[method-assign]
    try:
        par.step()
    except ValueError as e:
        return before, counters(par.module), str(e)
    return before, counters(par.module), ""


def _ddp(seq: nn.Module, recipe: str, mesh: DeviceMesh) -> Parallel:
    return parallelize(
        seq,
        ctx_of(recipe),
        mesh,
        strategy="ddp",
        optimizer_class=torch.optim.SGD,
        lr=LR,
        accumulate=False,
        join_timeout=JOIN_S,
    )


def _ddp_loads(recipe: str, mesh: DeviceMesh) -> dict[str, Any]:
    """Under DDP, after a step: each rank's error and seconds for a state whose streams are
    -1 on rank 1 and 555 on rank 0 (``bad``), then 77 on rank 1 alone (``other``), whether
    keys and weights stayed; the streams ``assign_fp4_streams(par.model)`` left; a step after
    (both ranks, together); the warnings of a setup whose two layers share stream 7."""
    par = _ddp(model(recipe), recipe, mesh)
    _step(par, 0)
    out: dict[str, Any] = {}
    for case, streams in (("bad", (555, -1)), ("other", (None, 77))):
        before = ([m.sr_key.clone() for m in layers(par.module)], whole(par.module))
        state = par.state_dict()
        for key, value in list(state["model"].items()):
            stream = streams[dist.get_rank()]
            if key.endswith("_extra_state") and stream is not None:
                state["model"][key] = value.clone()
                state["model"][key][4] = stream
            elif not key.endswith("_extra_state"):
                state["model"][key] = torch.zeros_like(value)
        start, error = time.monotonic(), ""
        try:
            par.load_state_dict(state)
        except ValueError as e:
            error = str(e)
        after = ([m.sr_key for m in layers(par.module)], whole(par.module))
        same = all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))
        same = same and all(torch.equal(before[1][n], after[1][n]) for n in before[1])
        out[case] = (error, time.monotonic() - start, same)
    kept = [m.sr_stream for m in layers(par.module)]
    assign_fp4_streams(par.model)  # through the DDP wrapper, after training: no change
    out["assign_through_ddp"] = (kept, [m.sr_stream for m in layers(par.module)])
    _step(par, 1)  # the ranks still step together: every collective ran on both
    shared = model(recipe)
    for layer in layers(shared):
        layer.set_sr_stream(7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ddp(shared, recipe, mesh)
    out["shared_warnings"] = [str(w.message) for w in caught if "share the" in str(w.message)]
    return out
