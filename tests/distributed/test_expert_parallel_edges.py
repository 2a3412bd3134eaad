"""Expert parallelism at its edges on 2 gloo ranks (scenarios in scenarios_ep_edges.py, one
launch shared by the tests below, 1 s join timeout, 90 s wall limit over the workers' 30 s
collective timeout): one rank's checkpoint is refused, not loaded into another rank's
experts; one rank's forward raises instead of hanging and leaves the group's training
unchanged; one rank's failed setup check raises the same error on every rank at once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .conftest import _run

LIMIT_S = 90.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ep-edges")
    return _run(tmp, "scenarios_ep_edges.py:edges", 2, LIMIT_S, {"path": str(tmp / "dcp")})


def test_one_ranks_checkpoint_is_refused_and_the_gathered_or_dcp_one_loads(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["checkpoint"] for r in ranks)
    # The model's own load: rank 0 loads its own slice; rank 1 refuses rank 0's, naming both
    # and the fixes. Parallel.load_state_dict agrees over the ranks (as under FSDP2): every
    # rank refuses, naming rank 1, and no rank loads.
    assert r0["module_error"] == ""
    agreed = "ValueError: Parallel.load_state_dict failed on rank(s) 1 of the group"
    assert r0["parallel_error"].startswith(agreed), r0["parallel_error"]
    assert r1["parallel_error"].startswith(agreed), r1["parallel_error"]
    # Parallel checks the experts' AdamW moments first (they are marked as the weights are).
    for error, start in (
        (r0["parallel_error"], "the optimizer state of moe.experts.gate_up: exp_avg "),
        (r1["parallel_error"], "the optimizer state of moe.experts.gate_up: exp_avg "),
        (r1["module_error"], "ValueError: moe.experts.gate_up "),
    ):
        assert start in error, error
        assert "experts 0..1 that rank 0 of 2 saved" in error, error
        assert "rank 1 of 2 (experts 2..3)" in error, error
        assert "torch.distributed.checkpoint" in error and "full_state_dict" in error, error
    # The refused load changed nothing (the check runs before any module loads).
    assert r1["unchanged"]
    for r in (r0, r1):
        assert r["whole_shape"][0] == 4  # every expert
        assert r["fresh_equal"] and r["plain_equal"]
        assert r["dcp_weights_equal"] and r["dcp_moments_equal"]


def test_one_ranks_forward_raises_names_the_absent_rank_and_changes_nothing(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["lone_forward"] for r in ranks)
    lone = r0["lone"]
    assert len(lone["errors"]) == 3  # par.model (DDP), par.module, one MoE layer alone
    for error, seconds in zip(lone["errors"], lone["seconds"], strict=True):
        assert error.startswith("RuntimeError: forward of "), error
        assert "rank(s) 1 of the group did not join it within 1 s" in error, error
        assert "every rank of the group must run it together" in error, error
        assert "evaluation forwards included" in error, error
        assert seconds < 10.0, seconds  # the join timeout, not the group's 30 s
    for r in (r0, r1):
        assert torch.equal(r["lone"]["losses"], r["joint"]["losses"])
        for name, p in r["joint"]["params"].items():
            assert torch.equal(r["lone"]["params"][name], p), name


def test_a_check_failing_on_one_rank_raises_the_same_error_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["disagree"] for r in ranks)
    for key, kind, text in (
        ("dispatch", "ValueError", "moe already has a dispatch (_Dispatch())"),
        ("count", "ValueError", "moe has 3 experts, which 2 ranks cannot share evenly"),
        ("lr", "ValueError", "Invalid learning rate: -1.0"),
    ):
        assert r0[key] == r1[key], key
        assert r0[key].startswith(f"{kind}: "), r0[key]
        assert "failed on rank(s) 1 of the group (every rank raises this)" in r0[key]
        assert text in r0[key], r0[key]
        assert r0[f"{key}_s"] < 10.0 and r1[f"{key}_s"] < 10.0
    assert r0["lr_unchanged"] and r1["lr_unchanged"]
    assert r0["after"] == r1["after"] == 2.0


def test_each_collective_helper_alone_raises_naming_the_absent_rank(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["helpers"] for r in ranks)
    for key, call in (
        ("lone_full", "full_state_dict"),
        ("lone_bias", "update_expert_bias"),
        ("lone_clip", "clip_grad_norm_with_experts"),
        ("lone_expert_parallel", "expert_parallel"),
        ("lone_parallelize", "parallelize"),
    ):
        assert r0[key].startswith(f"RuntimeError: {call} on rank 0: rank(s) 1 "), r0[key]
        assert "did not join it within 1 s" in r0[key], r0[key]
        assert r0[f"{key}_s"] < 10.0
    # Then every rank calls them together, and they go through.
    assert r0["together"] == r1["together"] == {k: "" for k in r0["together"]}
    assert r0["after"] == r1["after"] == 2.0


def test_ranks_that_set_up_differently_raise_the_same_error_at_once(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["helpers"] for r in ranks)
    # Ranks in different setup calls meet in the setup's join, which names each rank's call.
    for key, kind, text in (
        ("strategy", "ValueError: ", "rank(s) 1 differ from rank 0 in their strategy (rank 0: "
         "'ddp', rank 1: 'fsdp')"),
        ("ep_one_rank", "RuntimeError: ", "entered different collective calls together (rank 0: "
         "parallelize; rank 1: expert_parallel)"),
        ("hidden", "ValueError: ", "the first that differs is 'moe': rank 0 holds MoE(dim 16, "
         "hidden 16,"),
    ):  # fmt: skip
        assert r0[key] == r1[key], (r0[key], r1[key])
        assert r0[key].startswith(kind) and text in r0[key], r0[key]
        assert r0[f"{key}_s"] < 10.0 and r1[f"{key}_s"] < 10.0
    assert "down (4, 16, 32) torch.float32" in r1["hidden"]


def test_a_bad_bias_on_one_rank_is_refused_on_every_rank_before_anything_moves(
    ranks: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["helpers"] for r in ranks)
    want = "ValueError: update_expert_bias refused on rank(s) 1 of the group (every rank raises"
    assert r0["nan_bias"].startswith(want) and r1["nan_bias"].startswith(want)
    assert "moe2: the router bias must be finite" in r1["nan_bias"]
    assert r0["nan_bias_unchanged"] and r1["nan_bias_unchanged"]


def test_a_whole_expert_weight_of_another_shape_is_refused_before_anything_loads(
    ranks: list[dict[str, Any]],
) -> None:
    for r in (r["helpers"] for r in ranks):
        assert r["shape"].startswith(
            "ValueError: moe.experts.down holds a tensor of shape (4, 32, 16), and this "
            "expert-parallel model's down is (4, 16, 32)"
        ), r["shape"]
        assert r["shape_unchanged"]


def test_full_state_dict_is_a_snapshot_and_compile_and_a_lone_moe_say_what_they_are(
    ranks: list[dict[str, Any]],
) -> None:
    for r in (r["helpers"] for r in ranks):
        assert r["rollback_equal"]
        assert "cannot be one graph: compile with fullgraph=False" in r["compile"], r["compile"]
    moe = ranks[0]["helpers"]["moe_alone"]
    assert moe.startswith("RuntimeError: forward of MoE (train, grad on) on rank 0"), moe


def test_frozen_experts_are_each_ranks_own_in_every_checkpoint(
    ranks: list[dict[str, Any]],
) -> None:
    # Frozen experts (fp8 codes and steps; nvfp4 codes, scales and amaxes) are sharded and
    # refused as the trainable ones are: rank 0's torch.save is refused on rank 1, nothing
    # changed; DCP gives each rank its own experts back; full_state_dict holds all 4 experts
    # (rank 0's then rank 1's) and loads into one process.
    for flag, key in (("fp8_hybrid", "gate_up_fp8"), ("nvfp4", "fp8.gate_up_fp4")):
        r0, r1 = (r["frozen_checkpoint"][flag] for r in ranks)
        assert r0["error"] == "", r0["error"]
        assert r1["error"].startswith(f"ValueError: moe.experts.{key} holds the experts 0..1 "
                                      "that rank 0 of 2 saved"), r1["error"]  # fmt: skip
        for r in (r0, r1):
            assert r["unchanged"] and r["dcp_back"], flag
            assert r["whole"] and all(r["whole"].values()), (flag, r["whole"])
            assert r["one_error"] == "" and r["one_equal"], (flag, r["one_error"])


def test_experts_frozen_after_parallelize_are_refused_at_the_step(
    ranks: list[dict[str, Any]],
) -> None:
    # Before: the step ran, the optimizer kept the dropped expert weights and the frozen
    # experts silently stopped training. Frozen on rank 1 only: every rank raises rank 1's
    # error (before: rank 1 alone, rank 0 waiting out the join).
    for r in (r["late_frozen_experts"] for r in ranks):
        assert r["error"].startswith(
            "RuntimeError: Parallel.step failed on rank(s) 1 of the group (every rank raises "
            "this): Parallel.step: 2 of the expert-parallel expert weights parallelize took "
            "are no longer the model's: experts were frozen for serving after parallelize"
        ), r["error"]
        assert r["unchanged"]


def test_expert_parallel_frozen_experts_of_another_mode_are_refused_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    # Each rank's frozen 4-bit experts are its own (no broadcast compares them): frozen
    # weight-only on rank 0 and W4A4 on rank 1, parallelize ran and served a model no process
    # held (adversarial s48 I3). Refused on every rank, naming the experts, nothing changed.
    r0, r1 = (r["frozen_mode_differs"] for r in ranks)
    assert r0["error"] == r1["error"], (r0["error"], r1["error"])
    assert "rank(s) 1 differ from rank 0 in their 4-bit layers" in r0["error"], r0["error"]
    assert "'moe.experts.fp8'" in r0["error"] and "mode=w4a4" in r0["error"], r0["error"]
    assert r0["unchanged"] and r1["unchanged"]
