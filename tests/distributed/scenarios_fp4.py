"""4-bit linears under torch's DDP on 2 gloo ranks (``test_fp4_ranks.py``).

Two SGD steps of a model of two ``Fp4Linear`` (NVFP4, TE's recipe: stochastic rounding) under
``DistributedDataParallel`` with its defaults (``broadcast_buffers=True``), the ranks holding
different numbers of rows (so their stochastic-rounding counters differ), and between the two
steps rank 0 alone runs a validation forward under ``no_grad`` while rank 1 waits on the store
(no collective). Then the trained model is frozen for serving (4-bit buffers: gloo sends no
float4) and wrapped in DDP again, with an ``inference_mode`` forward on both ranks and one on
rank 0 alone; so are two fp8 models frozen for serving (float8 codes), one layer by layer
then ``exclude_frozen_from_ddp``, one by ``load_serving_weights(mode="serve")``, each rank's
built from its own seed: ``broadcast_frozen`` after the wrap gives every rank rank 0's frozen
codes, as ``parallelize``'s wrap does (``partly_frozen_parallelized``). A lone call
that issued a collective (DDP broadcasting registered buffers before a forward) would time
out on a group whose collectives wait ``TIMEOUT_S``; the ranks then stop there, and the test
fails in seconds."""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx
from computectx.distributed import broadcast_frozen, expert_parallel, parallelize
from computectx.formats import (
    QuantizedLinear,
    calibrate_fp4_activations,
    convert_to_quantized,
    exclude_frozen_from_ddp,
    load_serving_weights,
    serving_weights,
)
from computectx.formats.linear.fp4 import Fp4Linear
from computectx.formats.linear.fp4_freeze import freeze_fp4_for_serving
from computectx.formats.linear.fp4_frozen import FrozenFp4Linear
from computectx.nn import GroupedExperts, MoE
from computectx.recipes import DelayedScaling, Fp8Scheme, Recipe

ROWS = (20, 12)
"""Each rank's rows a step: the counters advance by different amounts on the two ranks."""
LR = 0.1
TIMEOUT_S = 5.0


def model() -> nn.Sequential:
    """Two ``Fp4Linear`` under ``nvfp4`` (stochastic rounding, the Hadamard transform)."""
    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_quantized(seq, ctx, include_head=True, min_features=16)
    return seq


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows at ``step`` (bf16)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ROWS[rank], 32, generator=gen).bfloat16()


def eval_batch() -> torch.Tensor:
    """What rank 0 validates on alone."""
    return torch.randn(6, 32, generator=torch.Generator().manual_seed(7)).bfloat16()


def keys(seq: nn.Module) -> list[list[int]]:
    """Each ``Fp4Linear``'s ``[seed, counter]``."""
    return [m.sr_key.tolist() for m in seq.modules() if isinstance(m, Fp4Linear)]


def eval_on_one_rank(params: dict[str, Any]) -> dict[str, Any]:
    """Step, rank 0's lone ``no_grad`` forward, step: the outcome of the lone call (``runs``
    or the error), its output beside the plain module's, each rank's counters after each step,
    its weights at the end."""
    group = dist.new_group(
        list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    seq = model()
    ddp = DistributedDataParallel(seq, process_group=group)
    opt = torch.optim.SGD(seq.parameters(), lr=LR)
    out: dict[str, Any] = {"keys": [keys(seq)]}

    def step(i: int) -> None:
        opt.zero_grad()
        ddp(batch(i, rank)).float().square().mean().backward()
        opt.step()
        out["keys"].append(keys(seq))

    step(0)
    if rank == 0:
        try:
            with torch.no_grad():
                got = ddp(eval_batch())
                want = seq(eval_batch())
            out["eval"] = "runs"
            out["eval_equal"] = bool(torch.equal(got, want))
        except Exception as e:  # recorded: the test says what went wrong
            out["eval"] = f"{type(e).__name__}: {e}"
        store.set("fp4/eval", "runs" if out["eval"] == "runs" else "failed")
    else:
        store.wait(["fp4/eval"], datetime.timedelta(seconds=60))
    if store.get("fp4/eval") != b"runs":
        return out  # the group is broken: both ranks stop here
    out["eval_keys"] = keys(seq)
    step(1)
    out["weights"] = [p.detach().clone() for p in seq.parameters()]
    out["frozen"] = _frozen_under_ddp(seq, group, store)
    out["fp8_frozen"] = fp8_frozen_under_ddp(group, store)
    out["parallelized"] = partly_frozen_parallelized(group, store)
    out["experts"] = frozen_experts_parallelized(store)
    out["lonely"] = _outside_group()
    out["static"] = static_fp4_shared(group)
    return out


def static_fp4_shared(group: dist.ProcessGroup) -> list[dict[str, Any]]:
    """A 4-bit W4A4 model with a static input amax, calibrated on one rank only (rank 0,
    then rank 1), ``broadcast_frozen`` on the bare model: each rank's ``input_calibrated``,
    and the output or the forward's error."""
    out = []
    for calibrated in (0, 1):
        seq = model()
        freeze_fp4_for_serving(seq, "w4a4", activation_amax="static")
        if dist.get_rank() == calibrated:
            calibrate_fp4_activations(seq, [eval_batch()])
        got: dict[str, Any] = {"sent": broadcast_frozen(seq, group=group)}
        got["calibrated"] = [m.input_calibrated for m in seq if isinstance(m, FrozenFp4Linear)]
        try:
            with torch.inference_mode():
                got["out"] = seq(eval_batch()).clone()
        except RuntimeError as e:
            got["out"] = str(e)
        out.append(got)
    return out


def _frozen_under_ddp(seq: nn.Module, group: dist.ProcessGroup, store: Any) -> dict[str, Any]:
    # The trained model frozen for serving (its buffers float4 and float8: gloo sends
    # neither), served under DDP (_served_under_ddp).
    freeze_fp4_for_serving(seq)
    return _served_under_ddp(seq, group, store, "fp4/frozen")


def fp8_model(seed: int, ctx: ComputeCtx | None = None) -> nn.Sequential:
    """Two ``QuantizedLinear`` under ``ctx`` (``fp8_hybrid``)."""
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu") if ctx is None else ctx
    convert_to_quantized(seq, ctx, include_head=True, min_features=16)
    return seq


def fp8_frozen_under_ddp(group: dist.ProcessGroup, store: Any) -> dict[str, Any]:
    """fp8 models frozen for serving (float8 codes: gloo sends none) served under DDP
    (``_served_under_ddp``): ``layers``, its linears frozen one by one, then
    ``exclude_frozen_from_ddp``; ``loaded``, another model served by
    ``load_serving_weights(mode="serve")`` of the first's codes. Each rank builds ``layers``
    from its own seed (as a checkpoint loaded on rank 0 only): its codes differ until
    ``broadcast_frozen``. Then ``refused``: what ``broadcast_frozen`` refuses on every rank."""
    layers = fp8_model(dist.get_rank())
    for m in layers.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    exclude_frozen_from_ddp(layers)
    loaded = fp8_model(0)  # the same biases (a serve load gives the weights only)
    load_serving_weights(loaded, serving_weights(layers), mode="serve")
    return {
        "layers": _served_under_ddp(layers, group, store, "fp8/layers"),
        "loaded": _served_under_ddp(loaded, group, store, "fp8/loaded"),
        "refused": _refused(group),
    }


def _refused(group: dist.ProcessGroup) -> list[str]:
    # broadcast_frozen where the ranks froze other layers (rank 1 its head too), then over a
    # DDP that wrapped before a layer was frozen (it would broadcast the float8 codes before
    # its next forward): each a ValueError on every rank, recorded.
    out = []
    seq = fp8_model(0)
    for m in list(seq)[: 1 + 2 * dist.get_rank()]:
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    late, compiled = fp8_model(0), fp8_model(0)
    # Rank 0 holds one frozen linear at two places, rank 1 two linears of the same shape:
    # the same names, shapes and dtypes, but one broadcast against two.
    tied = fp8_model(0)
    tied[2] = tied[0] if dist.get_rank() == 0 else fp8_model(1)[0]
    for m in tied.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    served = fp8_model(0)
    for m in served.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    exclude_frozen_from_ddp(served)
    # A bare model (no DDP sent the rest) of each rank's seed: rank 0's codes beside rank 1's
    # biases would be a model no rank held. Then one whose rank 1 runs another recipe of the
    # same shapes (margin 2): rank 0's fp8_meta would not be its recipe's.
    bare, margin = fp8_model(dist.get_rank()), fp8_model(0)
    if dist.get_rank() == 1:
        other = Recipe(format=Fp8Scheme.HYBRID, scaling=DelayedScaling(margin=2))
        margin = fp8_model(0, ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(recipe=other))
    # Bare models the check must not refuse (adversarial s47 G8): none frozen, of each rank's
    # seed (nothing is sent); a rank's own serving counter, listed for DDP to leave out (and
    # unlisted: refused, the message naming the list); a bias zero of either sign.
    unfrozen, counted, listed = fp8_model(dist.get_rank()), fp8_model(0), fp8_model(0)
    for m in (counted, listed):
        m.register_buffer("served", torch.tensor([dist.get_rank()]), persistent=False)
    vars(listed)["_ddp_params_and_buffers_to_ignore"] = ["served"]
    signed = fp8_model(0)
    with torch.no_grad():
        signed.get_parameter("0.bias")[0] = -0.0 if dist.get_rank() else 0.0
    for m in [*bare.modules(), *margin.modules(), *counted.modules(), *listed.modules()]:
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    for m in signed.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    calls: list[Callable[[], object]] = [
        lambda: broadcast_frozen(seq, group=group),
        lambda: broadcast_frozen(_frozen_late(late, group)),
        lambda: broadcast_frozen(Compiled(_frozen_late(compiled, group))),
        lambda: broadcast_frozen(tied, group=group),
        # DDP's wrap sent rank 0's state: rank 1's codes beside it, a model no rank held.
        lambda: broadcast_frozen(DistributedDataParallel(served, process_group=group), src=1),
        lambda: broadcast_frozen(bare, group=group),
        lambda: broadcast_frozen(margin, group=group),
        lambda: broadcast_frozen(unfrozen, group=group),
        lambda: broadcast_frozen(counted, group=group),
        lambda: broadcast_frozen(listed, group=group),
        lambda: broadcast_frozen(signed, group=group),
    ]
    for call in calls:
        try:
            call()
            out.append("runs")
        except ValueError as e:
            out.append(str(e))
    return out


class Compiled(nn.Module):
    """What ``broadcast_frozen`` reads of ``torch.compile``'s wrapper (an ``OptimizedModule``):
    its module, as ``_orig_mod`` (a stand-in: importing dynamo costs seconds a rank)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module


def _frozen_late(seq: nn.Sequential, group: dist.ProcessGroup) -> DistributedDataParallel:
    ddp = DistributedDataParallel(seq, process_group=group)
    first = seq[0]
    assert isinstance(first, QuantizedLinear)
    first.freeze_for_serving()
    return ddp


def _served_under_ddp(
    seq: nn.Module, group: dist.ProcessGroup, store: Any, tag: str
) -> dict[str, Any]:
    # A frozen model wrapped in DDP with its defaults, an inference_mode forward on every
    # rank, then rank 0's alone: the outcome, the outputs and the plain frozen module's on the
    # same rows.
    got: dict[str, Any] = {}
    try:
        served = DistributedDataParallel(seq, process_group=group)
        # Rank 0's frozen codes, as DDP's wrap sent the rest of its state.
        got["sent"] = broadcast_frozen(served)
        with torch.inference_mode():
            # Rank 0's lone forward first: DDP syncs its buffers before its first forward
            # (any grad mode), a collective, unless every buffer is left out.
            if dist.get_rank() == 0:
                try:
                    got["alone"] = served(eval_batch()).clone()
                finally:
                    store.set(f"{tag}/alone", "done")
            store.wait([f"{tag}/alone"], datetime.timedelta(seconds=30))
            got["out"] = served(eval_batch()).clone()
            got["plain"] = seq(eval_batch()).clone()
        got["wrap"] = "runs"
    except Exception as e:  # recorded: the test says what went wrong
        got["wrap"] = f"{type(e).__name__}: {e}"
    store.set(f"{tag}/{dist.get_rank()}", "done")
    store.wait([f"{tag}/{r}" for r in range(2)], datetime.timedelta(seconds=30))
    return got


def partly_frozen_parallelized(group: dist.ProcessGroup, store: Any) -> dict[str, Any]:
    """An fp8 model whose first linear alone is frozen for serving (its float8 codes, with no
    ``exclude_frozen_from_ddp``) handed to ``parallelize(strategy="ddp")``, then one SGD step
    of the trainable rest on each rank's rows: the outcome, what DDP leaves out, the weights,
    the frozen codes. Each rank builds its model from its own seed: the wrap sends rank 0's
    trainable weights and (``broadcast_frozen``) its frozen codes. Then the head is frozen
    too, and the next step's outcome recorded (``frozen_late``)."""
    seq = fp8_model(dist.get_rank())
    first = seq[0]
    assert isinstance(first, QuantizedLinear)
    if dist.get_rank() == 0:
        # Rank 0 alone trained its first linear (as a checkpoint loaded on rank 0 only):
        # its input ledger holds the step a frozen layer serves with, rank 1's none.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one rank records unsynced, on purpose
            first(batch(0, 0))
    first.freeze_for_serving()
    got: dict[str, Any] = {}
    try:
        ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
        par = parallelize(seq, ctx, optimizer_class=torch.optim.SGD, lr=LR, join_timeout=TIMEOUT_S)
        got["ignored"] = sorted(getattr(par.model, "parameters_to_ignore", ()))
        got["ledger"] = first.scaling.input.ledger.clone()
        with torch.inference_mode():
            got["served"] = par.model(eval_batch()).clone()
        par.model(batch(0, dist.get_rank())).float().square().mean().backward()
        par.step()
        got["weights"] = [p.detach().clone() for p in seq[2].parameters()]
        got["codes"] = first.weight_fp8.view(torch.uint8).clone()
        got["wrap"] = "runs"
        # The head frozen after the wrap, then a backward: the step names the cause (DDP's
        # reducer still holds the dropped weight) instead of DDP's next forward, its way.
        head = seq[2]
        assert isinstance(head, QuantizedLinear)
        head.freeze_for_serving()
        par.model(batch(0, dist.get_rank())).float().square().mean().backward()
        par.step()
        got["frozen_late"] = "runs"
    except Exception as e:  # recorded: the test says what went wrong
        got["wrap" if "wrap" not in got else "frozen_late"] = f"{type(e).__name__}: {e}"
    store.set(f"fp8/parallelize/{dist.get_rank()}", "done")
    store.wait([f"fp8/parallelize/{r}" for r in range(2)], datetime.timedelta(seconds=30))
    return got


def frozen_experts_parallelized(store: Any) -> dict[str, Any]:
    """An fp8 linear and an fp8 MoE whose experts are spread (``expert_parallel``), both then
    frozen for serving, rank 1's linear codes made its own, handed to
    ``parallelize(strategy="ddp")``: the outcome, the outputs of a ``no_grad`` forward on
    every rank (the linear's codes rank 0's, each rank its own experts), whether the
    experts' codes stayed each rank's. Then ``freeze_first``: experts frozen before
    ``expert_parallel``, refused."""
    got: dict[str, Any] = {}
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 32), MoE(ctx, 32, 32, 4, 2))
        convert_to_quantized(net, ctx, include_head=True, min_features=16)
        return net

    def freeze(net: nn.Module) -> None:
        for m in net.modules():
            if isinstance(m, QuantizedLinear | GroupedExperts):
                m.freeze_for_serving()

    try:
        net = build()
        expert_parallel(net, join_timeout=TIMEOUT_S)
        freeze(net)
        own = {n: b.view(torch.uint8).clone() for n, b in net.named_buffers() if "_fp8" in n}
        if dist.get_rank() == 1:
            codes = net[0].weight_fp8
            assert isinstance(codes, torch.Tensor)
            with torch.no_grad():
                codes.view(torch.uint8).add_(1)
        par = parallelize(net, ctx, optimizer_class=torch.optim.SGD, lr=LR, join_timeout=TIMEOUT_S)
        with torch.no_grad():
            got["out"] = par.model(eval_batch()).clone()
        got["kept"] = all(
            torch.equal(b.view(torch.uint8), own[n])
            for n, b in net.named_buffers()
            if n in own and "experts" in n
        )
        got["wrap"] = "runs"
    except Exception as e:  # recorded: the test says what went wrong
        got["wrap"] = f"{type(e).__name__}: {e}"
    store.set(f"fp8/experts/{dist.get_rank()}", "done")
    store.wait([f"fp8/experts/{r}" for r in range(2)], datetime.timedelta(seconds=30))
    first = build()
    freeze(first)
    try:
        expert_parallel(first, join_timeout=TIMEOUT_S)
        got["freeze_first"] = "runs"
    except Exception as e:
        got["freeze_first"] = f"{type(e).__name__}: {e}"
    return got


def _outside_group() -> str:
    # A group of rank 1 alone (every rank creates it): rank 0 is no member; rank 1 sends to
    # itself.
    alone = dist.new_group([1])
    seq = fp8_model(0)
    for m in seq.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    try:
        return f"runs: {len(broadcast_frozen(seq, group=alone))}"
    except ValueError as e:
        return str(e)
