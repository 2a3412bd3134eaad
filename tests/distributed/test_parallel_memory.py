"""The memory policy on 2 gloo ranks, each scenario compared with one process on the whole batch.

Tolerances: the 2-rank runs compute the same averages as the one process but sum in another
order (each rank's half, then the all-reduce), so f32 results agree to a few ulps per step
(observed max differences are noted at each assertion); the checkpoint resume reruns the same
math on the same ranks and is bitwise.
"""

from __future__ import annotations

from typing import Any

import torch

from .conftest import RunRanks

Result = dict[str, Any]

SCENARIO = "scenarios_memory.py:memory_policy"


def test_memory_policy_on_two_ranks_matches_one_process(run_ranks: RunRanks) -> None:
    """One 2-rank run and one single-process run (rank processes are the cost), both settings."""
    two = run_ranks(SCENARIO)
    (one,) = run_ranks(SCENARIO, world_size=1)
    check_ddp_accumulator(
        *[{k[4:]: v for k, v in r.items() if k.startswith("ddp/")} for r in (*two, one)]
    )
    check_fsdp2_optimizer(
        *[{k[6:]: v for k, v in r.items() if k.startswith("fsdp2/")} for r in (*two, one)]
    )


def check_ddp_accumulator(r0: Result, r1: Result, one: Result) -> None:
    """DDP + DataParallelGradAccumulator: once-per-step reduction, equal to one process."""
    two = (r0, r1)
    # The ranks never diverge: identical weights, norms and gradient sums, bitwise.
    assert torch.equal(r0["weights"], r1["weights"])
    assert torch.equal(r0["norm"], r1["norm"])
    assert torch.equal(r0["bf16_grads"], r1["bf16_grads"])
    # Exactly one all-reduce per optimizer step (DDP's own reduction does no communication).
    assert r0["all_reduce_per_step"] == 1.0
    assert r0["masters_on"] == "cpu"
    # Against one process on the whole batch (f32 sums): summation order only (observed max
    # differences: loss 3e-8, norm 1.2e-7, weights 3e-8 with weights up to 0.37).
    torch.testing.assert_close(r0["loss"], one["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(r0["norm"], one["norm"], rtol=1e-6, atol=0)
    torch.testing.assert_close(r0["weights"], one["weights"], rtol=0, atol=1e-6)
    # bf16 sums: each rank rounds its half-batch sums, the average is rounded once; the one
    # process rounds whole-batch sums. Within a few bf16 ulps of the gradient's scale
    # (observed: 2**-8 with gradients up to 0.61).
    scale = one["bf16_grads"].abs().max()
    assert (r0["bf16_grads"] - one["bf16_grads"]).abs().max() <= 3 * 2**-8 * scale
    # Resume from the mid-run checkpoint is bitwise, on every rank and in one process.
    for r in (r0, r1, one):
        assert torch.equal(r["resumed_weights"], r["weights"])
    # Misuse is a clear error on every rank, not a silent divergence, and changes nothing.
    for r in two:
        # the plain accumulator under DDP with no_sync on all but the last micro-batch
        assert "DataParallelGradAccumulator(ddp_model, ctx)" in r["plain_error"]
        assert "never reduced across ranks" in r["plain_error"]
        assert r["plain_untouched"]  # nothing ingested, the local sums kept
        # built from ddp.parameters() instead of the DDP module: DDP still reduced (zeros)
        assert "build the accumulator from the DDP module itself" in r["params_error"]
        # a second accumulator on one DDP module
        assert "one comm hook" in r["second_error"]


def check_fsdp2_optimizer(r0: Result, r1: Result, one: Result) -> None:
    """FSDP2 + OffloadedOptimizer(sharding=ShardedParams): local-shard masters, global norm."""
    # Masters and state are this rank's plain local shards on the offload device.
    assert r0["master_types"] == ["Parameter"] and r0["master_devices"] == ["cpu"]
    assert r0["master_numel"] + r1["master_numel"] == one["master_numel"]
    assert r0["state_numel"] + r1["state_numel"] == one["state_numel"]
    # The global norm, the same on both ranks, equal to one process's norm of the whole batch.
    assert torch.equal(r0["norm"].nan_to_num(), r1["norm"].nan_to_num())
    # (observed max differences: norm 7e-8, loss 1.5e-7, weights 1.5e-8)
    torch.testing.assert_close(r0["norm"], one["norm"], rtol=1e-6, atol=0, equal_nan=True)
    # The infs that only the last rank saw (step 1 without a clip, step 2 written after the
    # clip) made every rank skip both steps, as one process does.
    assert r0["skipped"] == r1["skipped"] == one["skipped"] == 2
    torch.testing.assert_close(r0["loss"], one["loss"], rtol=1e-6, atol=0)
    assert torch.equal(r0["weights"], r1["weights"])
    torch.testing.assert_close(r0["weights"], one["weights"], rtol=0, atol=1e-6)
    for r in (r0, r1, one):
        assert torch.equal(r["resumed_weights"], r["weights"])
    assert "DTensors (FSDP2 fully_shard)" in r0["accumulator_error"]
    assert "sharding=computectx.distributed.ShardedParams(mesh)" in r0["unsharded_error"]
