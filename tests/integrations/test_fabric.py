"""Lightning Fabric (docs/integrations.md): an fp8 model under ``DDPStrategy`` and under
``ModelParallelStrategy`` (tensor parallel) on 2 gloo ranks, against one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from computectx.fp8.ledger import ledger_history, ledger_step

pytest.importorskip(
    "lightning.fabric",
    reason="lightning is in the optional extra: pip install -e '.[integrations]'",
)

from .conftest import torchrun


@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
def test_fabric_trains_an_fp8_model_on_two_ranks_as_one_process(
    tmp_path: Path, strategy: str
) -> None:
    two = torchrun("fabric_worker.py", 2, tmp_path / "two", strategy)
    (one,) = torchrun("fabric_worker.py", 1, tmp_path / "one", "single")
    for r in two:
        assert r["world"] == 2
        for key, ledger in two[0]["ledgers"].items():
            # The same scales on every rank (the counts of saturations are each shard's).
            assert torch.equal(ledger_history(r["ledgers"][key]), ledger_history(ledger)), key
            assert torch.equal(ledger_step(r["ledgers"][key]), ledger_step(ledger)), key
        # One process on the whole batch: the same losses, weights and scales. What differs
        # is the order of float32 sums (of the ranks' gradients, or of partial products).
        torch.testing.assert_close(r["losses"], one["losses"], rtol=1e-5, atol=0)
        for name, weight in one["weights"].items():
            torch.testing.assert_close(r["weights"][name], weight, rtol=1e-5, atol=1e-7)
        for key, one_ledger in one["ledgers"].items():
            mine = r["ledgers"][key]
            # Under DDP a rank's output gradient of a mean loss is world_size times the whole
            # batch's (DDP averages afterwards), and so is its gradient ledger.
            ledger = one_ledger.clone()
            if strategy == "ddp" and key.endswith(".grad"):
                ledger_history(ledger).mul_(2.0)
                ledger_step(ledger).mul_(2.0)
            torch.testing.assert_close(
                ledger_history(mine), ledger_history(ledger), rtol=1e-5, atol=0
            )
            torch.testing.assert_close(ledger_step(mine), ledger_step(ledger), rtol=1e-5, atol=0)
