"""DataParallelGradAccumulator inherits the accumulator's checkpoint: on 2 gloo ranks a
stochastic-rounding run resumed from it is bitwise the uninterrupted run."""

from __future__ import annotations

import torch

from .conftest import RunRanks


def test_a_data_parallel_stochastic_resume_is_bitwise_on_every_rank(run_ranks: RunRanks) -> None:
    r0, r1 = run_ranks("scenarios_accumulator_state.py:resume")
    for r in (r0, r1):
        assert torch.equal(r["resumed"], r["weights"])
        assert not torch.equal(r["unloaded"], r["weights"])  # the generator state is needed
    # Every rank draws alike, so the saved states are one state (safe to save from rank 0).
    assert torch.equal(r0["generator"], r1["generator"])
    assert torch.equal(r0["weights"], r1["weights"])
