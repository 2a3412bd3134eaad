"""FSDP2 all-gathering fp8 weights (enable_quantized_all_gather), against one process."""

from __future__ import annotations

from typing import Any

import torch

from .conftest import RunRanks, in_world

STEPS = 4
Result = dict[str, Any]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_delayed_scaling_gathers_fp8_as_one_process_trains(run_ranks: RunRanks) -> None:
    # With the memory policy's optimizer: masters and AdamW state as plain local shards.
    both = run_ranks(
        "scenarios_fsdp.py:train_each",
        scaling="delayed",
        gathers=["fp8", "hp"],
        steps=STEPS,
        offloaded=True,
    )
    fp8 = [r["fp8"] for r in both]
    assert all(r["plain_masters"] for r in fp8)
    one = run_ranks(
        "scenarios_fsdp.py:train",
        world_size=1,
        scaling="delayed",
        gather="none",
        steps=STEPS,
        offloaded=True,
    )[0]
    _check_against_one_process(fp8, one, converted=2)
    _check_fp8_traffic(fp8[0])
    # FSDP2's own float32 gather: each shard quantized with the group's step is the whole
    # weight quantized with it, so the codes are the same and so is the training, bit for
    # bit, ledgers included (saturations of a weight every rank quantizes whole count once, as
    # the fp8 shards' add up), in about a quarter of the bytes.
    hp = both[0]["hp"]
    assert torch.equal(fp8[0]["losses"], hp["losses"])
    for name in hp["weights"]:
        assert torch.equal(fp8[0]["weights"][name], hp["weights"][name]), name
        assert torch.equal(fp8[0]["first_grads"][name], hp["first_grads"][name]), name
    for key in hp["ledgers"]:
        assert torch.equal(fp8[0]["ledgers"][key], hp["ledgers"][key]), key
    fp8_bytes, hp_bytes = sum(_traffic(fp8[0]).values()), sum(_traffic(hp).values())
    assert set(_traffic(hp)) == {torch.float32}
    assert hp_bytes / fp8_bytes > 3.5, (hp_bytes, fp8_bytes)


def test_dynamic_scaling_uses_whole_batch_scales_under_fsdp2_and_ddp(run_ranks: RunRanks) -> None:
    # Each quantize's amax reduced over the group: the one-process scales, under FSDP2's fp8
    # all-gather (whose weight amax is reduced per gather) and under DDP.
    one = run_ranks(
        "scenarios_fsdp.py:train", world_size=1, scaling="dynamic", gather="none", steps=STEPS
    )[0]
    both = run_ranks(
        "scenarios_fsdp.py:train_each", scaling="dynamic", gathers=["fp8", "ddp"], steps=STEPS
    )
    _check_against_one_process([r["fp8"] for r in both], one, converted=2)
    _check_fp8_traffic(both[0]["fp8"])
    _check_against_one_process([r["ddp"] for r in both], one, converted=0)


def _check_against_one_process(two: list[Result], one: Result, converted: int) -> None:
    r0, r1 = two
    assert r0["converted"] == converted
    # Whole-batch scales on every rank (the ledger merge, the seeding and the dynamic amax
    # reductions): what remains is the summation order of the sharded gradients.
    rel = (r0["losses"] - one["losses"]).abs() / one["losses"].abs()
    assert float(rel.max()) <= 1e-5, (r0["losses"], one["losses"])
    for name, g in one["first_grads"].items():
        assert _relative(r0["first_grads"][name], g) <= 1e-5, name
    for name in r0["weights"]:
        assert torch.equal(r0["weights"][name], r1["weights"][name]), name
    for key, ledger in one["ledgers"].items():
        assert torch.equal(r0["ledgers"][key], r1["ledgers"][key]), key
        # A rank's output gradient under a mean loss is world_size x the batch's (a power
        # of two: exact).
        mine = in_world(r0["ledgers"][key], key, 0.5)
        torch.testing.assert_close(mine, ledger, rtol=1e-5, atol=0.0, msg=key)
    assert not [w for w in r0["warnings"] if "view" in w], r0["warnings"]


def _check_fp8_traffic(r0: Result) -> None:
    # On the wire: the weights as fp8 bytes (uint8), and nothing in float32.
    sent = _traffic(r0)
    assert set(sent) == {torch.uint8}, sent
    # Forward and backward gathers: 2 per step. Biases ride along as their own bytes.
    per_element = sent[torch.uint8] / (2 * STEPS * r0["shard_weight_elements"])
    assert per_element <= 1.1, per_element


def _traffic(result: dict[str, Any]) -> dict[torch.dtype, int]:
    out: dict[torch.dtype, int] = {}
    for dtype, nbytes in result["gathers"]:
        out[dtype] = out.get(dtype, 0) + nbytes
    return out


def test_compiled_fullgraph_dynamic_scaling_reduces_as_eager_does(run_ranks: RunRanks) -> None:
    # The merge hook and each quantize's amax all-reduce trace into one graph per step.
    ranks = run_ranks("scenarios_fsdp.py:compiled_dynamic")
    compiled, eager = [r["compiled"] for r in ranks], [r["eager"] for r in ranks]
    for c, e in zip(compiled, eager, strict=True):
        assert torch.equal(c["outs"], e["outs"])
        for name, w in e["weights"].items():
            assert torch.equal(c["weights"][name], w), name
        for key, ledger in e["ledgers"].items():
            assert torch.equal(c["ledgers"][key], ledger), key
    # ...and the ranks quantized with the same (whole-batch) steps.
    for key, ledger in eager[0]["ledgers"].items():
        assert torch.equal(eager[1]["ledgers"][key], ledger), key
