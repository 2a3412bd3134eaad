"""fp8 on many ranks is never silent and never hangs (scenarios in scenarios_safety.py).

Every launch has a 60 s wall-clock limit on top of the worker's 30 s collective timeout, so
a scenario that would hang fails here within a minute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import RunRanks

LIMIT_S = 60.0


def test_fsdp2_fp8_gather_without_sync_refuses_delayed_and_is_exact_dynamic(
    run_ranks: RunRanks,
) -> None:
    delayed = run_ranks(
        "scenarios_safety.py:fsdp_gather_without_sync", limit_s=LIMIT_S, scaling="delayed"
    )
    for r in delayed:
        assert "sync_scaling" in r["fp8"]["error"]
        assert "parallelize" in r["fp8"]["error"]
        assert r["hp"]["error"] == ""
    dynamic = run_ranks(
        "scenarios_safety.py:fsdp_gather_without_sync", limit_s=LIMIT_S, scaling="dynamic"
    )
    for r in dynamic:
        assert r["fp8"]["error"] == "" and r["hp"]["error"] == ""
        # The whole weight's step on every rank: the same bytes as FSDP2's float32 gather.
        assert torch.equal(r["fp8"]["outs"], r["hp"]["outs"])


def _each(
    run_ranks: RunRanks, scenario: str, cases: list[dict[str, Any]]
) -> list[list[dict[str, Any]]]:
    """Each rank's result of ``scenario`` per case, all cases in one launch."""
    ranks = run_ranks("scenarios_safety.py:each", limit_s=LIMIT_S, name=scenario, cases=cases)
    return [[r["cases"][i] for r in ranks] for i in range(len(cases))]


def test_rank_local_forwards_issue_no_collective_and_record_nothing(run_ranks: RunRanks) -> None:
    cases = [{"scaling": "delayed"}, {"scaling": "dynamic"}]
    for case, (r0, r1) in zip(cases, _each(run_ranks, "rank_local_calls", cases), strict=True):
        for key, ledger in r0["before"].items():
            # Eval, no_grad, inference_mode, sampling and the unwrapped module left every
            # ledger.
            assert torch.equal(r0["after_local"][key], ledger), (case, key)
            assert torch.equal(r0["end"][key], r1["end"][key]), (case, key)


def test_an_empty_micro_batch_still_takes_part_in_every_reduction(run_ranks: RunRanks) -> None:
    # Under activation checkpointing too: the recomputation of the empty rank's call takes
    # the path its original took, and its backward reduces as the other rank's does.
    cases: list[dict[str, Any]] = [
        {"scaling": "dynamic", "empty_at": 1, "checkpoint": None},
        {"scaling": "delayed", "empty_at": 0, "checkpoint": None},
        {"scaling": "dynamic", "empty_at": 1, "checkpoint": "non_reentrant"},
        {"scaling": "dynamic", "empty_at": 1, "checkpoint": "reentrant"},
    ]
    for case, (r0, r1) in zip(cases, _each(run_ranks, "empty_shard", cases), strict=True):
        assert r1["shapes"][case["empty_at"]] == (0, 32), case
        for key, ledger in r0["ledgers"].items():
            assert torch.equal(ledger, r1["ledgers"][key]), (case, key)
        # The empty rank recorded what the other rank measured: its ledgers are those of a
        # run whose empty rank saw no data at all, the same everywhere (the amax merge is a
        # max).
        assert all(bool(torch.isfinite(ledger).all()) for ledger in r1["ledgers"].values()), case


def test_a_compiled_run_then_eager_calls_neither_reseed_nor_hang(run_ranks: RunRanks) -> None:
    r0, r1 = run_ranks("scenarios_safety.py:compiled_then_eager", limit_s=90.0)
    for key, before in r0["before"].items():
        eager = r0["eager"][key]
        assert torch.equal(eager, r1["eager"][key]), key
        assert torch.equal(r0["end"][key], r1["end"][key]), key
        # One more step rotated the history one slot: the older entries moved along; a
        # re-seed would have overwritten them all with one amax.
        n = before.numel() - 3
        assert torch.equal(eager[: n - 2], before[1 : n - 1]), key


def test_an_unsynced_fp8_model_warns_once_and_a_misordered_sync_raises(
    run_ranks: RunRanks,
) -> None:
    for r in run_ranks("scenarios_safety.py:warnings_and_order", limit_s=LIMIT_S):
        assert r["unsynced_row"] == []
        assert len(r["unsynced"]) == 1
        assert "sync_scaling" in r["unsynced"][0] and "parallelize" in r["unsynced"][0]
        assert "before fully_shard" in r["order_error"]


def test_a_tied_fp8_head_stays_tied_and_a_copy_scales_on_its_own(run_ranks: RunRanks) -> None:
    cases = [{"strategy": "fsdp"}, {"strategy": "ddp"}]
    for case, (r0, r1) in zip(cases, _each(run_ranks, "tied_and_copied", cases), strict=True):
        for r in (r0, r1):
            assert r["tied"] and r["head_is_fp8"] and r["copy_ledgers_own"], case
        assert torch.equal(r0["head"], r1["head"]), case


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_parallelize_trains_as_one_process_and_its_checkpoint_reshards(
    run_ranks: RunRanks, strategy: str, tmp_path: Path
) -> None:
    two_path, one_path = str(tmp_path / "two"), str(tmp_path / "one")
    # The group's current amax (the default under FSDP2; under DDP the default is the
    # rank's own, whose cost test_step_boundary measures): one process's scales exactly.
    common = {"scaling": "delayed", "strategy": strategy, "steps": 3, "current_amax": "group"}
    r0, r1 = run_ranks(
        "scenarios_safety.py:parallel_loop", limit_s=LIMIT_S, path=two_path, **common
    )
    (one,) = run_ranks("scenarios_safety.py:parallel_loop", world_size=1, path=one_path, **common)
    assert r0["synced"] and not one["synced"]
    assert r0["offloaded"] == one["offloaded"] == "OffloadedOptimizer"
    # Whole-batch scales on every rank: what remains is the gradients' summation order.
    rel = (r0["losses"] - one["losses"]).abs() / one["losses"].abs()
    assert float(rel.max()) <= 1e-5, (r0["losses"], one["losses"])
    assert torch.equal(r0["probe"], r1["probe"])
    # Saved on 2 ranks, loaded in one process: the same model, bit for bit.
    (loaded,) = run_ranks(
        "scenarios_safety.py:parallel_loop", world_size=1, path=two_path, load=True, **common
    )
    assert torch.equal(loaded["probe"], r0["probe"])
