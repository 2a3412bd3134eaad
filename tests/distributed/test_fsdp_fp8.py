"""FSDP2 all-gathering fp8 weights (enable_fp8_all_gather), against one process on the batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .conftest import RunRanks

STEPS = 4


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize(
    ("scaling", "gather"), [("delayed", "fp8"), ("dynamic", "fp8"), ("dynamic", "ddp")]
)
def test_fp8_all_gather_trains_as_one_process_does(
    run_ranks: RunRanks, scaling: str, gather: str
) -> None:
    # DDP with dynamic scaling rides along: each quantize's amax reduced over the group.
    two = run_ranks("scenarios_fsdp.py:train", scaling=scaling, gather=gather, steps=STEPS)
    one = run_ranks(
        "scenarios_fsdp.py:train", world_size=1, scaling=scaling, gather="none", steps=STEPS
    )[0]
    r0, r1 = two
    assert r0["converted"] == (2 if gather == "fp8" else 0)
    # Whole-batch scales on every rank (the ring merge, the seeding and the dynamic amax
    # reductions): what remains is the summation order of the sharded gradients.
    rel = (r0["losses"] - one["losses"]).abs() / one["losses"].abs()
    assert float(rel.max()) <= 1e-5, (r0["losses"], one["losses"])
    for name, g in one["first_grads"].items():
        assert _relative(r0["first_grads"][name], g) <= 1e-5, name
    for name in r0["weights"]:
        assert torch.equal(r0["weights"][name], r1["weights"][name]), name
    for key, ring in one["rings"].items():
        assert torch.equal(r0["rings"][key], r1["rings"][key]), key
        # A rank's output gradient under a mean loss is world_size x the batch's.
        factor = 2.0 if key.endswith(".grad") else 1.0
        mine = r0["rings"][key].clone()
        n = mine.numel() - 3
        mine[:n] /= factor
        mine[n] /= factor  # the step scales with the amax (a power of two: exact)
        torch.testing.assert_close(mine, ring, rtol=1e-5, atol=0.0, msg=key)
    if gather != "fp8":
        return
    # On the wire: the weights as fp8 bytes (uint8), and nothing in float32.
    sent = _traffic(r0)
    assert set(sent) == {torch.uint8}, sent
    # Forward and backward gathers: 2 per step. Biases ride along as their own bytes.
    per_element = sent[torch.uint8] / (2 * STEPS * r0["shard_weight_elements"])
    assert per_element <= 1.1, per_element
    assert not [w for w in r0["warnings"] if "view" in w], r0["warnings"]


def test_fp8_all_gather_is_the_high_precision_gather_in_a_quarter_of_the_bytes(
    run_ranks: RunRanks,
) -> None:
    fp8 = run_ranks("scenarios_fsdp.py:train", scaling="delayed", gather="fp8", steps=STEPS)[0]
    hp = run_ranks("scenarios_fsdp.py:train", scaling="delayed", gather="hp", steps=STEPS)[0]
    # Each shard quantized with the group's step is the whole weight quantized with it:
    # the same codes, so the same training, bit for bit, and the same rings (saturations
    # of a weight every rank quantizes whole are counted once, as fp8 shards add up).
    assert torch.equal(fp8["losses"], hp["losses"])
    for name in hp["weights"]:
        assert torch.equal(fp8["weights"][name], hp["weights"][name]), name
        assert torch.equal(fp8["first_grads"][name], hp["first_grads"][name]), name
    for key in hp["rings"]:
        assert torch.equal(fp8["rings"][key], hp["rings"][key]), key
    fp8_bytes, hp_bytes = sum(_traffic(fp8).values()), sum(_traffic(hp).values())
    assert set(_traffic(hp)) == {torch.float32}
    assert hp_bytes / fp8_bytes > 3.5, (hp_bytes, fp8_bytes)


def _traffic(result: dict[str, Any]) -> dict[torch.dtype, int]:
    out: dict[torch.dtype, int] = {}
    for dtype, nbytes in result["gathers"]:
        out[dtype] = out.get(dtype, 0) + nbytes
    return out


def test_compiled_fullgraph_dynamic_scaling_reduces_as_eager_does(run_ranks: RunRanks) -> None:
    # The merge hook and each quantize's amax all-reduce trace into one graph per step.
    compiled = run_ranks("scenarios_fsdp.py:compiled_dynamic", compile=True)
    eager = run_ranks("scenarios_fsdp.py:compiled_dynamic", compile=False)
    for c, e in zip(compiled, eager, strict=True):
        assert torch.equal(c["outs"], e["outs"])
        for name, w in e["weights"].items():
            assert torch.equal(c["weights"][name], w), name
        for key, ring in e["rings"].items():
            assert torch.equal(c["rings"][key], ring), key
    # ...and the ranks quantized with the same (whole-batch) steps.
    for key, ring in eager[0]["rings"].items():
        assert torch.equal(eager[1]["rings"][key], ring), key
