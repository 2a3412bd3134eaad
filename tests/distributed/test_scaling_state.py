"""The fp8 scaling state as buffers on 2 gloo ranks (scenarios in scenarios_scaling_state.py).

Each launch has a 60 s wall-clock limit on top of the worker's 30 s collective timeout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .conftest import RunRanks, _run

LIMIT_S = 60.0


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # One launch for the DDP and FSDP2 wraps' scenarios (scenarios_scaling_state.wrapped).
    tmp = tmp_path_factory.mktemp("scaling-wrapped")
    return _run(tmp, "scenarios_scaling_state.py:wrapped", 2, LIMIT_S, {})


def test_ddp_never_broadcasts_the_scaling_buffers(wrapped: list[dict[str, Any]]) -> None:
    results = [r["leave"] for r in wrapped]
    for r in reversed(results):  # rank 1 first: a broadcast would overwrite its ledgers
        # Each rank's ledgers are what its own data recorded, as in a copy no wrapper touched:
        # DDP's per-forward broadcast would have copied rank 0's over rank 1's.
        assert r["ddp"].keys() == r["twin"].keys() and len(r["ddp"]) == 14
        for name, t in r["ddp"].items():
            if name.endswith("fp8_meta"):  # recorded at 2 ranks, the copy at 1
                assert t[1] == 2 and torch.equal(t[2:], r["twin"][name][2:]), name
            else:
                assert torch.equal(t, r["twin"][name]), name
    for r in results:
        assert r["broadcast"] == [] and r["parallelize_broadcast"] == []
        assert "0.fp8_input_ledger" in r["parallelize_ignored"]  # from construction on


def test_a_model_built_on_meta_shards_materialises_and_trains(run_ranks: RunRanks) -> None:
    # FSDP2's float32 gather and the fp8 one, in one launch (each its own models).
    gathers = ["hp", "fp8"]
    ranks = run_ranks(
        "scenarios_scaling_state.py:meta_build_each", limit_s=LIMIT_S, gathers=gathers
    )
    for gather in gathers:
        r0, r1 = (r[gather] for r in ranks)
        for r in (r0, r1):
            assert r["was_meta"] and r["materialised"] and r["fresh"], gather
            # Bit for bit the model built on the CPU: outputs, ledgers, tallies, meta records.
            assert torch.equal(r["meta_outs"], r["cpu_outs"]), gather
            assert r["meta_scaling"].keys() == r["cpu_scaling"].keys()
            for name, t in r["meta_scaling"].items():
                assert torch.equal(t, r["cpu_scaling"][name]), (gather, name)
        for name, t in r0["meta_scaling"].items():  # merged: the same on both ranks
            assert torch.equal(t, r1["meta_scaling"][name]), (gather, name)


def test_the_wrap_sends_rank_0s_scaling_state_and_frozen_layers(
    wrapped: list[dict[str, Any]],
) -> None:
    # Rank 0 alone loaded the checkpoint (its ledgers seeded, its frozen layer's codes). Under
    # DDP every rank then serves rank 0's model before any step, and the first step equals the
    # one where every rank loaded it (before: rank 1 scaled by its own ledgers). Under
    # FSDP2 the first forward runs (before: rank 0 took its seeded step while rank 1 reduced
    # its amax, a hang) and serves the checkpoint's frozen codes (before: each rank its own),
    # the same on every rank (at ctx.compute, FSDP2's gather: not one float32 process's).
    r0, r1 = (r["rank0"] for r in wrapped)
    assert torch.equal(r0["fsdp"]["served"], r1["fsdp"]["served"])
    for strategy in ("ddp", "fsdp"):
        for r in (r0, r1):
            got = r[strategy]
            assert torch.equal(got["codes"], r["codes"]), strategy
            if strategy == "ddp":
                assert torch.equal(got["served"], r["ref"])
            assert got["scaling"].keys() == r0[strategy]["scaling"].keys()
            for name, t in got["scaling"].items():
                assert torch.equal(t, r0[strategy]["scaling"][name]), (strategy, name)
    for r in (r0, r1):
        # A layer frozen after parallelize(fsdp): its weight is a DTensor shard; refused, with
        # nothing written (before: torch's bare AssertionError, its weight ledger written).
        assert r["fsdp"]["late_freeze"].startswith(
            "ValueError: 2.freeze_for_serving: the layer was sharded by FSDP2 (fully_shard, "
            "or parallelize(strategy='fsdp')"
        ), r["fsdp"]["late_freeze"]
        assert r["fsdp"]["late_unchanged"]
        assert torch.equal(r["every"]["served"], r["ref"])
        for p, q in zip(r["ddp"]["stepped"], r["every"]["stepped"], strict=True):
            assert torch.equal(p, q)


def test_what_ddp_would_refuse_is_refused_before_the_frozen_layers_are_sent(
    wrapped: list[dict[str, Any]],
) -> None:
    # Before: the frozen codes were rank 0's and DDP's list changed, then DDP refused on rank
    # 1 (rank 0 waiting in its broadcast) or on every rank (no parameter needs a gradient).
    r0, r1 = (r["refused"] for r in wrapped)
    assert r0["shape"] == r1["shape"], (r0["shape"], r1["shape"])
    assert (
        "differ from rank 0 in their parameters; the first that differs is 'extra'" in (r0["shape"])
    ), r0["shape"]
    assert r0["untrained"] == r1["untrained"]
    assert "no parameter of the model requires a gradient" in r0["untrained"], r0["untrained"]
    # Layers converted under another recipe on rank 1: refused on every rank, naming rank 1,
    # inside the agreement (before: rank 1 alone, after it; rank 0 waited out the join).
    assert r0["policy"] == r1["policy"], (r0["policy"], r1["policy"])
    assert "rank(s) 1 " in r0["policy"] and "is already a QuantizedLinear under" in r0["policy"], (
        r0["policy"]
    )
    # The same of an MoE's experts (adversarial s48: a hang too).
    assert r0["experts_policy"] == r1["experts_policy"], r0["experts_policy"]
    assert "rank(s) 1 " in r0["experts_policy"], r0["experts_policy"]
    assert (
        "the experts '3.experts' already run in fp8 under hybrid/delayed/8/0/max"
        in (r0["experts_policy"])
    )
    for r in (r0, r1):
        assert r["shape_unchanged"] and r["untrained_unchanged"] and r["policy_unchanged"]
        assert r["experts_policy_unchanged"]


def test_weights_replaced_after_the_wrap_are_refused_at_the_step(
    wrapped: list[dict[str, Any]],
) -> None:
    # load_state_dict(assign=True) after parallelize: DDP and the optimizer held the old
    # Parameters and the steps trained nothing, silently (adversarial s48 N2b).
    for r in (r["assign"] for r in wrapped):
        assert r["error"].startswith("RuntimeError: Parallel.step failed on rank(s) 0, 1"), r
        assert (
            "weights were replaced after parallelize (a layer frozen for serving, " in (r["error"])
        ), r
        assert "load_state_dict(assign=True)" in r["error"], r
        assert r["unchanged"]
