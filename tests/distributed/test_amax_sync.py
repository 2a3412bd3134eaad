"""fp8 amax reduction under DDP: rings bit-identical on every rank, close to one process."""

from __future__ import annotations

import pytest
import torch

from computectx.fp8.ring import ring_history, ring_nonfinite, ring_step

from .conftest import RunRanks


@pytest.mark.parametrize("flag", ["fp8_hybrid"])
def test_synced_rings_are_identical_on_every_rank_and_track_one_process(
    run_ranks: RunRanks, flag: str
) -> None:
    steps = 6
    two = run_ranks("scenarios_amax.py:train", flag=flag, steps=steps, sync=True, nan=True)
    one = run_ranks("scenarios_amax.py:train", world_size=1, flag=flag, steps=steps, sync=True)[0]
    r0, r1 = two
    assert r0["rings"].keys() == one["rings"].keys()
    for key in r0["rings"]:
        assert torch.equal(r0["rings"][key], r1["rings"][key]), key
        assert torch.equal(r0["before_nan"][key], r1["before_nan"][key]), key
    # The merged history is what one process on the whole batch records, up to the fp8
    # rounding of the first step (seeded from each rank's own shard). Output gradients of a
    # mean-reduced loss are world_size times larger on a rank than in the whole batch (DDP
    # averages afterwards): a power of two here, so they quantize to the same fp8 codes.
    for key, ring in one["rings"].items():
        factor = 2.0 if key.endswith(".grad") else 1.0
        torch.testing.assert_close(
            ring_history(r0["before_nan"][key]), factor * ring_history(ring), rtol=0.05, atol=0.0
        )
    # Losses track one process within the fp8 bound (0.5 % per step).
    rel = (r0["losses"] - one["losses"]).abs() / one["losses"].abs()
    assert float(rel.max()) <= 5e-3, (r0["losses"], one["losses"])
    # A NaN in the last rank's shard: every rank counts it and keeps history and step.
    for r in two:
        after, before = r["rings"]["0.input"], r["before_nan"]["0.input"]
        assert float(ring_nonfinite(after) - ring_nonfinite(before)) == 1.0
        assert torch.equal(ring_history(after), ring_history(before))
        assert torch.equal(ring_step(after), ring_step(before))
        # The weight saw no NaN: its ring moved on normally on both ranks.
        assert float(ring_nonfinite(r["rings"]["0.weight"])) == 0.0


def test_without_the_sync_ranks_scale_the_same_layer_differently(run_ranks: RunRanks) -> None:
    r0, r1 = run_ranks("scenarios_amax.py:train", flag="fp8_hybrid", steps=3, sync=False)
    step0 = float(ring_step(r0["rings"]["0.input"]))
    step1 = float(ring_step(r1["rings"]["0.input"]))
    assert step1 > 10 * step0  # rank 1's shard is 40x larger
