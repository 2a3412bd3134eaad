"""HF accelerate (docs/integrations.md): ``prepare`` under bf16 mixed precision with an
``OffloadedOptimizer``, ``clip_grad_norm_``, ``save_state``/``load_state`` with their defaults,
on 2 gloo ranks under torchrun (``accelerate launch --cpu`` starts one process on one machine),
against the same recipe on a group of one process (run by each rank, in the same launch,
before the 2-rank group exists)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "accelerate", reason="accelerate is in the optional extra: pip install -e '.[integrations]'"
)

from .conftest import torchrun


def test_accelerate_trains_on_two_ranks_as_one_process_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    two = torchrun("accelerate_worker.py", 2, tmp_path)
    one = two[0]["one"]
    for r in two:
        # The reference is one process on a group of its own, as torchrun with one rank runs
        # it, the same on each rank.
        assert r["one"]["distributed_type"] == "DistributedType.MULTI_CPU"
        assert r["one"]["world"] == 1
        assert torch.equal(r["one"]["losses"], one["losses"])
        assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["world"] == 2
        assert r["out_dtypes"] == ["torch.bfloat16"]  # under accelerate's bf16 autocast
        # The synced ledgers are the same on both ranks and the losses are one process's
        # on the whole batch (the fp8 bound is 0.5 %; what differs is the gradient sums).
        for key, ledger in two[0]["ledgers"].items():
            assert torch.equal(r["ledgers"][key], ledger), key
        torch.testing.assert_close(r["losses"], one["losses"], rtol=1e-5, atol=0)
        # load_state after one more step: the model's outputs, every ledger and the
        # optimizer's state (masters and moments) are those saved, bit for bit.
        assert torch.equal(r["after"], r["before"])
        for key, ledger in r["ledgers"].items():
            assert torch.equal(r["ledgers_loaded"][key], ledger), key
        assert r["optimizer_equal"]
