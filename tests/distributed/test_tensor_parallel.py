"""DTensor activations and tensor parallelism on 2 gloo ranks (scenarios_tensor_parallel.py).

Every amax an fp8 quantize takes of a DTensor is the whole tensor's, so tensor-parallel
training matches one process on the whole tensors. Each launch has a 60 s wall-clock limit
on top of the worker's 30 s collective timeout.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from computectx.formats.numerics.ledger import ledger_history, ledger_step

from .conftest import RunRanks

LIMIT_S = 60.0
SCENARIOS = "scenarios_tensor_parallel.py"


def test_the_amax_of_a_dtensor_is_the_whole_tensors_for_every_placement(
    run_ranks: RunRanks,
) -> None:
    for r in run_ranks(f"{SCENARIOS}:amax_placements", limit_s=LIMIT_S):
        # Rank 1's shard holds 3 * 11 - 1 = 32; rank 0's at most 3 - 1 = 2 (and |-1|).
        assert "Partial(max)" in r["amax_placements"]
        for key in ("sharded", "sharded_whole", "partial_max", "reference"):
            assert r[key].tolist() == [32.0], (key, r[key])
            assert type(r[key]) is torch.Tensor
        assert r["replicate"].tolist() == [7.0]
        assert r["partial_sum"].tolist() == [3.0]
        assert r["nan"].tolist() == [math.inf]
        assert r["argument_kept"]


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_fp8_training_on_dtensors_matches_one_process(run_ranks: RunRanks, scaling: str) -> None:
    # Both layouts in one launch; one process has no layout (the plain model, whole batch).
    layouts = ["tp", "batch"]
    each = run_ranks(
        f"{SCENARIOS}:train_each", limit_s=LIMIT_S, scaling=scaling, layouts=layouts, steps=4
    )
    (one,) = run_ranks(
        f"{SCENARIOS}:train", world_size=1, limit_s=LIMIT_S, scaling=scaling, layout="tp", steps=4
    )
    for layout in layouts:
        _check_against_one_process([r[layout] for r in each], one)


def _check_against_one_process(two: list[dict[str, Any]], one: dict[str, Any]) -> None:
    for r in two:
        # The scaling state stays plain tensors (parallelize_module replicates buffers as
        # DTensors), and the mesh spans the world: nothing to warn about.
        assert r["buffer_types"] == ["Tensor"]
        assert r["unsynced_warnings"] == 0
        # The same steps as one process: ledger histories and steps are equal, so the fp8
        # codes are; what differs is the order of float32 sums (partial products, and the
        # gradients summed over shards of the batch).
        for key, ledger in one["ledgers"].items():
            torch.testing.assert_close(
                ledger_history(r["ledgers"][key]), ledger_history(ledger), rtol=1e-6, atol=0
            )
            torch.testing.assert_close(
                ledger_step(r["ledgers"][key]), ledger_step(ledger), rtol=1e-6, atol=0
            )
        torch.testing.assert_close(r["outs"], one["outs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["eval"], one["eval"], rtol=1e-5, atol=1e-5)
        for name, grad in one["grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-5, atol=1e-5)
        for name, weight in one["weights"].items():
            torch.testing.assert_close(r["weights"][name], weight, rtol=1e-6, atol=1e-7)
    for key in two[0]["ledgers"]:
        assert torch.equal(
            ledger_history(two[0]["ledgers"][key]), ledger_history(two[1]["ledgers"][key])
        )
