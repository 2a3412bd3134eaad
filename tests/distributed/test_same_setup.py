"""The same-policy check across ranks (``computectx.distributed.same_setup``; the same-model
checks are exercised through ``parallelize`` in test_setup_faults.py and test_scaling_state.py)."""

from __future__ import annotations

from .conftest import RunRanks


def test_same_policy_passes_on_every_rank(run_ranks: RunRanks) -> None:
    results = run_ranks("policy_check", flags=["fp8_hybrid", "fp8_hybrid"])
    assert results == [{"error": ""}, {"error": ""}]


def test_different_policies_fail_on_every_rank_naming_the_policy(run_ranks: RunRanks) -> None:
    results = run_ranks("policy_check", flags=["bf16", "fp8_hybrid"])
    assert "rank(s) 1 differ from rank 0" in results[0]["error"]
    assert "holds 'compute=bf16,kv=bf16,accum=f32" in results[0]["error"]
    assert "rank(s) 1 differ from rank 0" in results[1]["error"]
    assert "recipe=hybrid/delayed/16/0/max" in results[1]["error"]
