"""Activation checkpointing of fp8 layers under FSDP2's fp8 all-gather and the amax sync."""

from __future__ import annotations

import pytest
import torch

from .conftest import RunRanks

STEPS = 3


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_checkpointed_fsdp2_training_is_bit_identical_to_plain(
    run_ranks: RunRanks, scaling: str
) -> None:
    ranks = run_ranks(
        "scenarios_activation_checkpointing.py:train_each",
        scaling=scaling,
        impls=["non_reentrant", "reentrant"],
        steps=STEPS,
    )
    for rank, result in enumerate(ranks):
        plain = result["plain"]
        for impl in ("non_reentrant", "reentrant"):
            got = result[impl]
            assert torch.equal(got["losses"], plain["losses"]), (rank, impl)
            for step, (g, want) in enumerate(zip(got["grads"], plain["grads"], strict=True)):
                for name, value in want.items():
                    assert torch.equal(g[name], value), (rank, impl, step, name)
            for key, ledger in plain["ledgers"].items():
                assert torch.equal(got["ledgers"][key], ledger), (rank, impl, key)
            assert got["elements"] == plain["elements"], (rank, impl)
