"""Mixture-of-experts on 2 gloo ranks (scenarios in scenarios_moe.py): expert parallelism and
MoE ByteLMs under DDP and FSDP2, each against one process on the whole batch.

Expert parallelism hands each expert its rows in one process's order (rank 0's, then rank
1's), so an expert's grouped GEMMs see exactly one process's rows: the outputs, the input
gradients and the expert gradients are one process's bit for bit, in float32 and in fp8 (the
grouped GEMM's groups and 128x128/1x128 blocks are one process's; reference backend). The
router's and shared weights' gradients are each rank's tokens' part, summed here in another
order than one process's: float32 rounding (``2**-20`` relative).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import RunRanks

LIMIT_S = 60.0
FLAGS = ["fp32", "fp8_block", "fp8_hybrid_dynamic", "nvfp4", "mxfp4"]
FP4 = ["nvfp4"]  # trained (mxfp4's frame: test_fp4_experts, its EP layer case above)
STEPS = 3


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    scale = float(want.abs().max().clamp_min(1e-30))
    err = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    assert err <= rel * scale, f"{what}: {err} > {rel} x {scale}"


def test_expert_parallel_equals_one_process_and_survives_skew(
    run_ranks: RunRanks, tmp_path: Path
) -> None:
    # 4-bit experts (nvfp4: stochastic rounding on) draw one process's bits: each rank's
    # slice of an experts module rounds its rows at one process's counters (the whole
    # batch's counts, experts_draw_frame), and its counter advances by the whole call's.
    ranks = run_ranks(
        "scenarios_moe.py:expert_parallel_cases",
        limit_s=LIMIT_S,
        flags=FLAGS,
        train_fp4=FP4,
        path=str(tmp_path / "ep-fp4"),
    )
    _check_fp4_training(ranks)
    for rank, r in enumerate(ranks):
        assert "3 experts" in r["error"] and "multiple of the group's size" in r["error"]
        assert "steps with a plain optimizer" in r["compact/offload=None"]
        assert "and ctx.optim_state='f32'" in r["compact/offload=None"]
        assert "offload=False would build a plain SGD" in r["compact/offload=False"]
        for flag in FLAGS:
            for case in (flag, f"{flag}-skew"):
                got = r[case]
                assert got["dispatch"] == (
                    f"AllToAllDispatch(rank {rank} of 2: experts {2 * rank}..{2 * rank + 1})"
                )
                for key, pair in got.items():
                    if not isinstance(pair, tuple):
                        continue
                    mine, one = pair
                    assert mine.shape == one.shape, (case, key)
                    if key in ("y", "dx") or key.startswith("experts."):
                        assert torch.equal(mine, one), (case, key)
                    else:
                        _close(mine, one, 2.0**-20, f"{case} {key}")
        # The skew: rank 0 routed nothing (it had no token), rank 1 everything to experts 2, 3.
        skew = r["fp32-skew"]
        assert skew["y"][0].shape[0] == (0 if rank == 0 else 16)
        if rank == 0:
            assert int(skew["load"].sum()) == 0
        else:
            assert skew["load"].tolist() == [0, 0, 16, 16]
        # ...and rank 0's experts got no row, yet a zero gradient (not None).
        if rank == 0:
            assert float(skew["experts.gate_up"][0].abs().sum()) == 0.0


def _check_fp4_training(ranks: list[dict[str, Any]]) -> None:
    """A 4-bit-experts ByteLM (attention kept high) under expert_parallel + DDP, 2 SGD steps,
    stochastic rounding on, against one process on the whole batch: the experts' counters
    are one process's exactly (every rank's slice advances by the whole call's draws, so
    the counter sync's MAX merges equal values), the weights to float32 rounding (the dense
    gradients are summed in another order; the experts' GEMMs are one process's given the
    same inputs). Rank 0 alone: the eval forward and sync_fp4_counters are the join's error,
    state_dict runs; the counters survive full_state_dict into one process and a DCP round trip."""
    for rank, r in enumerate(ranks):
        for fmt in FP4:
            got = r[f"train-{fmt}"]
            for key in ("counters", "full", "dcp"):
                assert torch.equal(*got[key]), (fmt, key)
            _close(got["losses"][0], got["losses"][1], 1e-5, f"{fmt} losses")
            for name, (mine, want) in got["weights"].items():
                _close(mine, want, 1e-5, f"{fmt} {name}")
            whole, want = got["full_experts"]
            _close(whole, want, 1e-5, f"{fmt} full_state_dict experts")
            assert torch.equal(*got["dcp_experts"]), fmt
            assert len(set(got["dcp_streams"])) == 1 and got["dcp_streams"][0] > 0
            if rank == 0:
                assert "rank(s) 1 of the group did not join it" in got["lone_eval"]
                assert "blocks.0.mlp.experts.fp8._extra_state" in got["lone_state"]
                assert "rank(s) 1 of the group did not join it" in got["lone_sync"]
                assert got["lone_sync_kept"]


def _check_training(result: dict[str, Any], rel: float) -> None:
    got, one = result["losses"]
    _close(got, one, rel, "losses")
    for name, (mine, want) in result["weights"].items():
        _close(mine, want, rel, name)
    bias, want_bias = result["bias"]
    assert torch.equal(bias, want_bias)


@pytest.mark.parametrize("flag", ["fp32"])
def test_moe_bytelm_trains_as_one_process_under_ddp_fsdp2_and_expert_parallelism(
    run_ranks: RunRanks, flag: str, tmp_path: Path
) -> None:
    # "@fp8": every saved activation kept as fp8 (ComputeCtx.activations): each rank's groups
    # are whole rows of its own tokens, so the ranks compress what one process compresses.
    setups = ["ddp", "fsdp", "ep+ddp", "ep+fsdp", "ddp-unused"]
    setups += ["ddp@fp8", "fsdp@fp8", "ep+fsdp@fp8"]
    ranks = run_ranks(
        "scenarios_moe.py:train",
        limit_s=LIMIT_S,
        flag=flag,
        setups=setups,
        steps=STEPS,
        path=str(tmp_path / "ep-checkpoint"),
    )
    for r in ranks:
        for setup in setups:
            _check_training(r[setup], 1e-5)
    # An expert no token chose has a zero gradient under DDP, not None: the reducer
    # finishes every step, and the expert stays as it was, as in one process.
    assert [r["ddp-unused"]["expert_0_load"] for r in ranks] == [0, 0]
    # The expert-parallel checkpoint (DCP) holds every rank's experts: loaded into one
    # process it is the one-process training; loaded back, each rank gets its own experts.
    for r in ranks:
        for name, (got, want) in r["checkpoint"].items():
            _close(got, want, 1e-5, f"checkpoint {name}")
    # Every rank's router biases moved alike (the loads all-reduced once per step).
    for setup in setups:
        assert torch.equal(ranks[0][setup]["bias"][0], ranks[1][setup]["bias"][0])


def test_fsdp2_gathers_block_fp8_experts_as_fp8(run_ranks: RunRanks) -> None:
    r0 = run_ranks("scenarios_moe.py:fp8_expert_gather", limit_s=LIMIT_S, steps=2)[0]
    fp8, hp = r0["fp8"], r0["hp"]
    assert fp8["kinds"] == ["ExpertsGatheredQuantized"] and hp["kinds"] == ["Tensor"]
    # One FSDP2 gather per unit and pass (forward, backward re-gather), 2 steps: the block
    # unit's bytes shrink by the expert shard's 3 bytes per element, less its block steps
    # (2 local experts x 2 weights, each one 128x128 block: 4 float32).
    fp8_bytes, hp_bytes = ([b for _, b in r["wire"]] for r in (fp8, hp))
    n = fp8["shard_expert_elements"]
    saved = [h - f for f, h in zip(fp8_bytes, hp_bytes, strict=True)]
    assert sorted(saved) == [0, 0] + [3 * n - 4 * 4] * 4, (saved, n)
    assert {d for d, _ in fp8["wire"]} == {torch.uint8, torch.float32}
    # The gathered experts are each expert's codes and steps: the grouped GEMM quantizes
    # them to the same codes, so the training is the float32 gather's (steps within an ulp).
    _close(fp8["outs"], hp["outs"], 1e-3, "outputs")
    _close(fp8["losses"], hp["losses"], 1e-5, "losses")
    for name, w in hp["weights"].items():
        _close(fp8["weights"][name], w, 1e-5, name)
