"""Lightning Fabric (docs/integrations.md): an fp8 model under ``DDPStrategy``, under
``ModelParallelStrategy`` data parallel (FSDP2) and tensor parallel, on 2 gloo ranks against
one process; under DDP and FSDP2 ``fabric.save`` / ``fabric.load`` with no merge call.

The three strategies run in one torchrun launch (the launch's imports are most of its cost);
each test reads its strategy's part of the ranks' results (under xdist too)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from computectx.formats.numerics.ledger import ledger_history, ledger_step

from .conftest import skip_unless_installed, torchrun_once

skip_unless_installed("lightning.fabric")  # only the launched ranks import it (4 CPU-s)


STRATEGIES = ["ddp", "fsdp", "tensor_parallel"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of one launch that runs each strategy in turn, by strategy."""
    return torchrun_once(tmp_path_factory, "fabric", "fabric_worker.py", 2, *STRATEGIES)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fabric_trains_an_fp8_model_on_two_ranks_as_one_process(
    launch: list[dict[str, Any]], strategy: str
) -> None:
    ranks = [r[strategy] for r in launch]
    for r in ranks:
        one = r["one"]
        assert r["world"] == 2
        for key, ledger in ranks[0]["ledgers"].items():
            # The same scales on every rank (under tensor parallelism the counts of
            # saturations are each shard's).
            assert torch.equal(ledger_history(r["ledgers"][key]), ledger_history(ledger)), key
            assert torch.equal(ledger_step(r["ledgers"][key]), ledger_step(ledger)), key
        # One process on the whole batch: the same losses, weights and scales. What differs
        # is the order of float32 sums (of the ranks' gradients, or of partial products).
        torch.testing.assert_close(r["losses"], one["losses"], rtol=1e-5, atol=0)
        for name, weight in one["weights"].items():
            torch.testing.assert_close(r["weights"][name], weight, rtol=1e-5, atol=1e-7)
        for key, one_ledger in one["ledgers"].items():
            mine = r["ledgers"][key]
            # Under data parallelism a rank's output gradient of a mean loss is world_size
            # times the whole batch's (the gradients are averaged afterwards), and so is its
            # gradient ledger.
            ledger = one_ledger.clone()
            if strategy != "tensor_parallel" and key.endswith(".grad"):
                ledger_history(ledger).mul_(2.0)
                ledger_step(ledger).mul_(2.0)
            torch.testing.assert_close(
                ledger_history(mine), ledger_history(ledger), rtol=1e-5, atol=0
            )
            torch.testing.assert_close(ledger_step(mine), ledger_step(ledger), rtol=1e-5, atol=0)
    if strategy == "tensor_parallel":
        return
    # fabric.save right after a step, with no merge call, holds the world's fp8 state: every
    # rank's fp8 buffers are the same before the save and after fabric.load, and every
    # rank's outputs after the load are its outputs before the save, bit for bit (saving
    # rank 0's unmerged state moved rank 1's outputs by up to 8 % under DDP, 9 % under FSDP2).
    for r in ranks:
        assert r["saved"].keys() == ranks[0]["saved"].keys() and len(r["saved"]) == 2 * 7
        for key, buffer in ranks[0]["saved"].items():
            assert torch.equal(r["saved"][key], buffer), key
            assert torch.equal(r["loaded"][key], buffer), key
        assert r["stepped_changed"]  # the step between moved the state the load replaced
        assert torch.equal(r["after"], r["before"])
