"""The data-parallel group and the same-policy check."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from computectx import ComputeCtx
from computectx.distributed import check_same_policy, data_parallel_group

from .conftest import RunRanks


def test_uninitialised_group_names_what_to_call() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        data_parallel_group()
    with pytest.raises(RuntimeError, match="init_process_group"):
        check_same_policy(ComputeCtx.parity("cpu"))


def test_same_policy_passes_on_every_rank(run_ranks: RunRanks) -> None:
    results = run_ranks("policy_check", flags=["fp8_hybrid", "fp8_hybrid"])
    assert results == [{"error": ""}, {"error": ""}]


def test_different_policies_fail_on_every_rank_naming_the_policy(run_ranks: RunRanks) -> None:
    results = run_ranks("policy_check", flags=["bf16", "fp8_hybrid"])
    assert "rank(s) 1 differ from rank 0" in results[0]["error"]
    assert "holds 'compute=bf16,kv=bf16,accum=f32" in results[0]["error"]
    assert "rank(s) 1 differ from rank 0" in results[1]["error"]
    assert "fp8=hybrid/delayed/16/0/max" in results[1]["error"]
