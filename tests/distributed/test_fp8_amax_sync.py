"""fp8 amax reduction under DDP: ledgers bit-identical on every rank, close to one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from computectx.formats.numerics.ledger import (
    ledger_history,
    ledger_nonfinite,
    ledger_saturated,
    ledger_step,
)

from .conftest import RunRanks, in_world


@pytest.mark.parametrize("flag", ["fp8_hybrid"])
def test_synced_ledgers_are_identical_on_every_rank_and_track_one_process(
    run_ranks: RunRanks, flag: str
) -> None:
    steps = 6
    two = run_ranks("scenarios_amax.py:train", flag=flag, steps=steps, sync=True, nan=True)
    one = run_ranks("scenarios_amax.py:train", world_size=1, flag=flag, steps=steps, sync=True)[0]
    r0, r1 = two
    assert r0["ledgers"].keys() == one["ledgers"].keys()
    for key in r0["ledgers"]:
        assert torch.equal(r0["ledgers"][key], r1["ledgers"][key]), key
        assert torch.equal(r0["before_nan"][key], r1["before_nan"][key]), key
    # The merged ledger is what one process on the whole batch holds, from the seed of step 1
    # (the group's amax) on: history, step and saturations; what remains is the order of
    # the gradient sums. Output gradients of a mean-reduced loss are world_size times larger
    # on a rank than in the whole batch (DDP averages afterwards): a power of two here, so
    # they quantize to the same fp8 codes.
    for key, ledger in one["ledgers"].items():
        mine, want = r0["before_nan"][key], in_world(ledger, key, 2.0)
        torch.testing.assert_close(
            ledger_history(mine), ledger_history(want), rtol=1e-5, atol=0.0, msg=key
        )
        torch.testing.assert_close(ledger_step(mine), ledger_step(want), rtol=1e-5, atol=0)
        assert torch.equal(ledger_saturated(mine), ledger_saturated(ledger)), key
    # Losses track one process (the target is the fp8 bound, 0.5 % per step).
    rel = (r0["losses"] - one["losses"]).abs() / one["losses"].abs()
    assert float(rel.max()) <= 1e-5, (r0["losses"], one["losses"])
    # A NaN in the last rank's shard: every rank does what one process does with a NaN in
    # the batch: counts it once, keeps the step, records nothing (the oldest amax moves to
    # the newest slot as the history advances).
    for r in two:
        after, before = r["ledgers"]["0.input"], r["before_nan"]["0.input"]
        assert float(ledger_nonfinite(after) - ledger_nonfinite(before)) == 1.0
        assert torch.equal(ledger_history(after), torch.roll(ledger_history(before), -1))
        assert torch.equal(ledger_step(after), ledger_step(before))
        # The weight saw no NaN: its ledger moved on normally on both ranks.
        assert float(ledger_nonfinite(r["ledgers"]["0.weight"])) == 0.0


@pytest.mark.parametrize(("sync", "fp8_gather"), [(False, False), (True, True)])
def test_fsdp2_checkpoint_saved_on_two_ranks_loads_in_one_process(
    run_ranks: RunRanks, tmp_path: Path, sync: bool, fp8_gather: bool
) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(
        "scenarios_amax.py:fsdp_checkpoint",
        flag="fp8_hybrid",
        steps=4,
        path=path,
        sync=sync,
        fp8_gather=fp8_gather,
    )
    loaded = run_ranks(
        "scenarios_amax.py:fsdp_checkpoint", world_size=1, flag="fp8_hybrid", path=path, load=True
    )[0]
    # QuantizedLinear returns a new tensor, not a view: FSDP2 has no in-place hazard to warn about.
    assert [r["view_warnings"] for r in saved] == [0, 0]
    # The gradient ledgers are in per-rank units (a mean loss per rank): the sync on one
    # process rescales them by 1/2 (rescale_grad_ledger); everything else loads as saved.
    same = [
        torch.equal(r["out"], loaded["out"])
        and all(
            torch.equal(in_world(r["ledgers"][k], k, 0.5), ledger)
            for k, ledger in loaded["ledgers"].items()
        )
        for r in saved
    ]
    # Without the sync the checkpoint holds one rank's scaling state, and the other rank's
    # model is not the one that loads (the issue measured outputs 4.87 apart).
    if sync:
        assert same == [True, True]
    else:  # which rank's copy of the replicated state DCP keeps is its choice
        assert sorted(same) == [False, True]
        # ...because unsynced ranks scale the same layer by their own shards: rank 1's
        # inputs are 40x larger, and so is its step.
        step0 = float(ledger_step(saved[0]["ledgers"]["0.input"]))
        step1 = float(ledger_step(saved[1]["ledgers"]["0.input"]))
        assert step1 > 10 * step0


def test_checkpoint_saved_in_one_process_loads_on_two_fsdp2_ranks(
    run_ranks: RunRanks, tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    (saved,) = run_ranks(
        "scenarios_amax.py:fsdp_checkpoint", world_size=1, flag="fp8_hybrid", steps=4, path=path
    )
    # Loaded into FSDP2 ranks that gather fp8 (the plain FSDP2 load is the same DCP path).
    loaded = run_ranks(
        "scenarios_amax.py:fsdp_checkpoint",
        flag="fp8_hybrid",
        path=path,
        load=True,
        fp8_gather=True,
    )
    for r in loaded:
        assert torch.equal(r["out"], saved["out"])
        for key, ledger in saved["ledgers"].items():
            assert torch.equal(r["ledgers"][key], in_world(ledger, key, 2.0)), key


def test_compiled_ddp_keeps_the_sync_and_matches_eager(run_ranks: RunRanks) -> None:
    # torch.compile of the DDP module (what `demo --nproc N --compile` does): the merge
    # before each forward still runs, and every ledger and loss equals eager DDP's. A compiled
    # first call seeds from the rank's own amax (the seeded check is a device value there),
    # which is what eager does with current_amax="local".
    ranks = run_ranks("scenarios_amax.py:compiled_and_eager", flag="fp8_hybrid", steps=3, sync=True)
    compiled, eager = [r["compiled"] for r in ranks], [r["eager"] for r in ranks]
    for c, e in zip(compiled, eager, strict=True):
        assert torch.equal(c["losses"], e["losses"])
        for key, ledger in e["ledgers"].items():
            assert torch.equal(c["ledgers"][key], ledger), key
