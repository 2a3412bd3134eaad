"""4-bit linears under torch's DDP on 2 gloo ranks (``test_fp4_ranks.py``).

Two SGD steps of a model of two ``Fp4Linear`` (NVFP4, TE's recipe: stochastic rounding) under
``DistributedDataParallel`` with its defaults (``broadcast_buffers=True``), the ranks holding
different numbers of rows (so their stochastic-rounding counters differ), and between the two
steps rank 0 alone runs a validation forward under ``no_grad`` while rank 1 waits on the store
(no collective). Then the trained model is frozen for serving (4-bit buffers: gloo sends no
float4) and wrapped in DDP again, with an ``inference_mode`` forward on both ranks and one on
rank 0 alone. A lone call that issued a collective (DDP broadcasting registered buffers
before a forward) would time out on a group whose collectives wait ``TIMEOUT_S``; the ranks
then stop there, and the test fails in seconds."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from computectx import ComputeCtx
from computectx.formats import convert_to_quantized
from computectx.formats.linear.fp4 import Fp4Linear
from computectx.formats.linear.fp4_freeze import freeze_fp4_for_serving

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
    return out


def _frozen_under_ddp(seq: nn.Module, group: dist.ProcessGroup, store: Any) -> dict[str, Any]:
    # The trained model frozen for serving, wrapped in DDP with its defaults (its buffers
    # float4 and float8: gloo sends neither), an inference_mode forward on every rank, then
    # rank 0's alone: the outcome, the outputs and the plain frozen module's on the same rows.
    freeze_fp4_for_serving(seq)
    got: dict[str, Any] = {}
    try:
        served = DistributedDataParallel(seq, process_group=group)
        with torch.inference_mode():
            got["out"] = served(eval_batch()).clone()
            got["plain"] = seq(eval_batch()).clone()
            if dist.get_rank() == 0:
                got["alone"] = served(eval_batch()).clone()
        got["wrap"] = "runs"
    except Exception as e:  # recorded: the test says what went wrong
        got["wrap"] = f"{type(e).__name__}: {e}"
    store.set(f"fp4/frozen/{dist.get_rank()}", "done")
    store.wait([f"fp4/frozen/{r}" for r in range(2)], datetime.timedelta(seconds=30))
    return got
