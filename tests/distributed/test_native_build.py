"""The native CPU Adam kernel builds on rank 0 and fails to build on rank 1 (2 gloo ranks,
``scenarios_native_build.py``; a 2 s join timeout, a 30 s collective timeout, a 90 s wall
limit).

The kernel and its torch-ops twin differ in the last bits, so a rank on the twin beside a
rank on the kernel would leave the replicas (or the shards' numerics) apart: no rank may
step while another raises. Under ``parallelize`` every rank raises the same error naming
rank 1 and the compiler's failure, promptly, with nothing changed on either rank and the same
collectives called on both (``Parallel.step`` agrees on the optimizer's checks, the build
among them). A hand-built sharded ``OffloadedOptimizer`` raises on rank 1 before any
collective, and rank 0's verdict all-reduce, joining first, raises naming rank 1 after the
join timeout: neither steps, neither hangs, and the group is still usable."""

from __future__ import annotations

from typing import Any

from .conftest import RunRanks
from .scenarios_native_build import JOIN_S

Result = dict[str, Any]


def test_a_build_failing_on_one_rank_fails_every_rank_and_hangs_none(run_ranks: RunRanks) -> None:
    r0, r1 = run_ranks("scenarios_native_build.py:one_rank_cannot_build", limit_s=90.0)
    for strategy in ("ddp", "fsdp"):
        a, b = r0[f"{strategy}/step"], r1[f"{strategy}/step"]
        for got in (a, b):
            assert got["error"].startswith("RuntimeError: Parallel.step failed on rank(s) 1 of"), (
                strategy,
                got["error"],
            )
            assert "could not be built with 'false' on rank 1 of 2" in got["error"], got["error"]
            assert got["s"] < 5.0, (strategy, got["s"])
            assert not got["changed"], strategy
        assert a["collectives"] == b["collectives"], strategy
    a, b = r0["sharded/step"], r1["sharded/step"]
    assert "could not be built with 'false' on rank 1 of 2" in b["error"], b["error"]
    assert b["collectives"] == []
    assert "rank(s) 1 of the group did not join it" in a["error"], a["error"]
    assert a["s"] < JOIN_S + 5.0
    assert not a["changed"] and not b["changed"]
