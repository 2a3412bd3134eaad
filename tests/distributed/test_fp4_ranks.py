"""4-bit linears on many ranks (docs/fp4.md, "Ranks"): under torch's DDP with its defaults, a
validation forward on rank 0 alone issues no collective, and each rank's stochastic-rounding
counter is its own (DDP neither broadcasts nor overwrites it). 2 gloo ranks
(``scenarios_fp4.py``: a 5 s collective timeout, a 60 s wall limit) against one process
simulating each rank."""

from __future__ import annotations

import torch

from computectx.formats import QuantizedLinear

from .conftest import RunRanks
from .scenarios_fp4 import LR, ROWS, batch, fp8_model, keys, model

LIMIT_S = 60.0


def _simulated(steps: int) -> tuple[list[list[list[list[int]]]], list[torch.Tensor]]:
    # One process per rank's model: each its own rows and counter, the gradients averaged
    # as DDP averages them (halving is exact), the same SGD step on both copies.
    sims = [model(), model()]
    opts = [torch.optim.SGD(s.parameters(), lr=LR) for s in sims]
    seen: list[list[list[list[int]]]] = [[keys(s)] for s in sims]
    for i in range(steps):
        for rank, (s, o) in enumerate(zip(sims, opts, strict=True)):
            o.zero_grad()
            s(batch(i, rank)).float().square().mean().backward()
        pairs = zip(sims[0].parameters(), sims[1].parameters(), strict=True)
        for a, b in pairs:
            assert a.grad is not None and b.grad is not None
            mean = (a.grad + b.grad) / 2
            a.grad, b.grad = mean, mean.clone()
        for rank, (s, o) in enumerate(zip(sims, opts, strict=True)):
            o.step()
            seen[rank].append(keys(s))
    return seen, [p.detach() for p in sims[0].parameters()]


def test_rank_0_validates_alone_under_ddp_and_the_counters_stay_each_ranks(
    run_ranks: RunRanks,
) -> None:
    ranks = run_ranks("scenarios_fp4.py:eval_on_one_rank", limit_s=LIMIT_S)
    assert ranks[0]["eval"] == "runs", ranks[0]["eval"]  # no collective on one rank
    assert ranks[0]["eval_equal"]  # DDP's output is the module's
    want_keys, want_weights = _simulated(2)
    assert want_keys[0] != want_keys[1]  # the ranks' rows differ: so do their counters
    for rank, r in enumerate(ranks):
        assert r["keys"] == want_keys[rank], rank  # each rank's own, never rank 0's
        assert r["eval_keys"] == want_keys[rank][1]  # a no_grad forward advances nothing
        # The step after the lone call: the ranks agree, and equal one process per rank.
        for got, want in zip(r["weights"], want_weights, strict=True):
            assert torch.equal(got, want), rank
    # Rank 1's 12 rows a step (its column-wise operands pad to 16): N * (12 + 16) a call.
    assert [k[1] for k in ranks[1]["keys"][1]] == [32 * (ROWS[1] + 16), 16 * (ROWS[1] + 16)]
    # Frozen for serving and wrapped again: DDP leaves the 4-bit buffers out of its
    # broadcasts, the ranks serve alike (their frozen weights are of equal weights), and
    # rank 0 may serve alone.
    frozen = [r["frozen"] for r in ranks]
    for rank, f in enumerate(frozen):
        assert f["wrap"] == "runs", (rank, f["wrap"])
        assert torch.equal(f["out"], f["plain"]), rank
    assert torch.equal(frozen[0]["out"], frozen[1]["out"])
    assert torch.equal(frozen[0]["alone"], frozen[0]["out"])
    # fp8 frozen for serving (float8 codes, which gloo refuses: 'Invalid scalar type'),
    # frozen layer by layer or by a serve load of the same codes: DDP wraps and serves alike,
    # though each rank froze a model of its own seed (broadcast_frozen sends rank 0's codes).
    fp8 = [r["fp8_frozen"][how] for r in ranks for how in ("layers", "loaded")]
    for f in fp8:
        assert f["wrap"] == "runs", f["wrap"]
        assert torch.equal(f["out"], f["plain"]) and torch.equal(f["out"], fp8[0]["out"])
        # The codes and steps, then the frozen linears' scaling state (their input steps).
        # Each layer's codes and steps, then its scaling state (its input step): all left
        # out of DDP's broadcasts (exclude_frozen_from_ddp), so rank 0 served alone first.
        held = [(f"{i}.weight_fp8", f"{i}.weight_step", *scaling_names(f"{i}.")) for i in (0, 2)]
        assert f["sent"] == (*held[0], *held[1]), f["sent"]
    assert all(torch.equal(f["alone"], f["out"]) for f in fp8 if "alone" in f)
    # What broadcast_frozen refuses, on every rank alike: ranks that froze other layers, and
    # a DDP that wrapped before a layer was frozen (its next forward would broadcast codes).
    # So are: a torch.compile wrapper of such a DDP (unwrapped first), ranks that share a
    # frozen tensor differently (rank 0 holds one linear at two places: one broadcast
    # against two, which would hang), and src=1 over a DDP whose wrap sent rank 0's state.
    # So are a bare model whose rest (the biases: no wrap sent them) differs across ranks,
    # and frozen layers of the same shapes under another recipe (rank 1's margin 2).
    for r in ranks:
        refused = r["fp8_frozen"]["refused"]
        differ, late, compiled, tied, src1, bare, margin, *lets = refused
        assert "rank(s) 1 differ from rank 0; the first is '2.weight_fp8'" in differ, differ
        assert "broadcasts '0.weight_fp8' (and 8 more frozen buffers)" in late, late
        assert "broadcasts '0.weight_fp8' (and 8 more frozen buffers)" in compiled, compiled
        assert "the first is '2.weight_fp8'" in tied, tied
        assert "the same tensor as '0.weight_fp8'" in tied, tied
        assert "src 1 is global rank 1, but the DistributedDataParallel's wrap sent global " in src1
        assert "only the frozen layers' buffers are sent, and the rest must already" in bare, bare
        assert "rank(s) 1 hold another '0.bias' than rank 0" in bare, bare
        assert "the first is '0.weight_fp8'" in margin, margin
        assert "policy hybrid/delayed/16/0/max" in margin and "hybrid/delayed/16/2/max" in margin
        # Not refused: a bare model of each rank's seed with nothing frozen (nothing to send),
        # a rank's own counter listed for DDP to leave out (unlisted: refused, the message
        # says how), biases of 0.0 and -0.0 (before: each refused, adversarial s47 G8).
        unfrozen, counted, listed, signed = lets
        assert unfrozen == "runs" and listed == "runs" and signed == "runs", lets
        assert "hold another 'served' than rank 0" in counted, counted
        assert "_ddp_params_and_buffers_to_ignore" in counted, counted
    # A static W4A4 layer calibrated on one rank: its input_amax and whether it is calibrated
    # are rank 0's on every rank (rank 0 calibrated: both serve alike; rank 1 alone
    # calibrated: both refuse to serve uncalibrated, none serves NaN).
    first, second = (r["static"] for r in ranks)
    for got in (first[0], second[0]):
        assert got["calibrated"] == [True, True], got["calibrated"]
        assert torch.equal(got["out"], first[0]["out"])
    for got in (first[1], second[1]):
        assert got["calibrated"] == [False, False], got["calibrated"]
        assert "input_amax is not calibrated" in got["out"], got["out"]
    # A rank outside the group is told so; the group's member sends to itself.
    assert "this rank (global rank 0) is not a member of group" in ranks[0]["lonely"]
    assert ranks[1]["lonely"].startswith("runs"), ranks[1]["lonely"]
    # A model frozen layer by layer, without exclude_frozen_from_ddp, handed to parallelize:
    # its DDP wrap leaves the float8 codes out itself, and the trainable rest steps alike.
    # Each rank built its own seed's model: the wrap sent rank 0's weights and frozen codes.
    par = [r["parallelized"] for r in ranks]
    for p in par:
        assert p["wrap"] == "runs", p["wrap"]
        assert {"0.weight_fp8", "0.weight_step"} <= set(p["ignored"]), p["ignored"]
    for a, b in zip(par[0]["weights"], par[1]["weights"], strict=True):
        assert torch.equal(a, b)
    zero = fp8_model(0)[0]
    assert isinstance(zero, QuantizedLinear)
    codes = zero.freeze_for_serving().weight_fp8
    assert isinstance(codes, torch.Tensor)
    # Rank 0 alone had recorded its first linear's input step: the wrap sent its scaling
    # state with its codes, and the ranks serve rank 0's model (under delayed scaling the
    # input step of a frozen layer comes from its ledger, which nothing else sends).
    assert not torch.equal(par[0]["ledger"], zero.scaling.input.ledger)  # recorded, not fresh
    assert torch.equal(par[1]["ledger"], par[0]["ledger"])
    assert torch.equal(par[1]["served"], par[0]["served"])
    for p in par:
        assert torch.equal(p["codes"], codes.view(torch.uint8))
        # A layer frozen after parallelize: the next step names it, on every rank.
        assert p["frozen_late"].startswith(
            "RuntimeError: Parallel.step failed on rank(s) 0, 1 of the group (every rank "
            "raises this): Parallel.step: DDP did not reduce every weight"
        ), p["frozen_late"]
        assert "1 of the weights it wraps are no longer the model's" in p["frozen_late"]
    # Frozen fp8 experts of an expert-parallel MoE under parallelize: no weight to average,
    # their codes each rank's own; the frozen linear's codes are rank 0's on every rank.
    experts = [r["experts"] for r in ranks]
    for e in experts:
        assert e["wrap"] == "runs", e["wrap"]
        assert e["kept"]
        # Frozen before expert_parallel: refused on every rank, naming the experts.
        assert "1.experts are frozen for serving" in e["freeze_first"], e["freeze_first"]
        assert "Call expert_parallel first, then freeze the experts" in e["freeze_first"]
    assert torch.equal(experts[0]["out"], experts[1]["out"])


def scaling_names(prefix: str) -> tuple[str, ...]:
    """A frozen fp8 linear's scaling-state buffer names under ``prefix``."""
    roles = ("input", "weight", "grad")
    return (
        *(f"{prefix}fp8_{r}_{p}" for r in roles for p in ("ledger", "tally")),
        f"{prefix}fp8_meta",
    )
