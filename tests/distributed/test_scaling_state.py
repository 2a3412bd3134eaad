"""The fp8 scaling state as buffers on 2 gloo ranks (scenarios in scenarios_scaling_state.py).

Each launch has a 60 s wall-clock limit on top of the worker's 30 s collective timeout.
"""

from __future__ import annotations

import torch

from .conftest import RunRanks

LIMIT_S = 60.0


def test_ddp_never_broadcasts_the_scaling_buffers(run_ranks: RunRanks) -> None:
    results = run_ranks(
        "scenarios_scaling_state.py:ddp_leaves_the_scaling_buffers_alone", limit_s=LIMIT_S
    )
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
