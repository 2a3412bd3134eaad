"""Distributed checkpoints of model + fp8 scaling + ``OffloadedOptimizer``, resharded 2 <-> 1.

Three launches (starting rank processes is the cost): one process trains, saves and resumes
(the reference); two FSDP2 ranks train, save, resume, and load the one-process checkpoint; one
process loads the two-rank checkpoint. A load at another world size restores the state
bitwise (forward outputs, ledgers, weights, masters, moments); a resume at the same world size
goes on bitwise; training on at another world size matches the uninterrupted run up to float
summation order (figures at the assertion).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from computectx import ComputeCtx
from computectx.distributed.optimizer_checkpoint import set_optimizer_state_dict
from computectx.memory import OffloadedOptimizer

from . import scenarios_checkpoint as sc
from .conftest import RunRanks, in_world

Result = dict[str, Any]
PARAMS = ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]


def test_checkpoints_reshard_two_to_one_and_one_to_two(run_ranks: RunRanks, tmp_path: Path) -> None:
    one_path, two_path = str(tmp_path / "one"), str(tmp_path / "two")
    (one,) = run_ranks("scenarios_checkpoint.py:one_process", world_size=1, path=one_path)
    r0, r1 = run_ranks("scenarios_checkpoint.py:two_ranks", path=two_path, other=one_path)
    (back,) = run_ranks("scenarios_checkpoint.py:load_in_one_process", world_size=1, other=two_path)
    # Both ranks hold the same state (ledgers synced; weights, masters, moments gathered whole).
    assert_same(
        {k: r0[k] for k in ("saved", "uninterrupted", "resumed", "from_other")},
        {k: r1[k] for k in ("saved", "uninterrupted", "resumed", "from_other")},
        "rank 0 against rank 1",
    )

    # Resume at the same world size is bitwise: what loads is what was saved (and the forward
    # output on a probe), and training on from it equals the uninterrupted run, losses too.
    for r in (one, r0):
        assert_same(r["resumed_loaded"], r["saved"], "resume, loaded")
        assert_same(r["resumed"], r["uninterrupted"], "resume, trained on")

    # Saved on 2 ranks, loaded in one process: forward output, ledgers, weights, masters and
    # every moment identical; and the other way round.
    assert_same(back["from_other"]["loaded"], r0["saved"], "2 -> 1, loaded")
    assert_same(r0["from_other"]["loaded"], one["saved"], "1 -> 2, loaded")

    # Trained on at the other world size: equal to the uninterrupted run up to the summation
    # order of the gradients (two half-batch sums and a reduce-scatter against one sum). The
    # loss is each rank's own mean, so a rank's output gradient is world_size times the
    # batch's: the sync rescales the loaded gradient ledgers to its world size (without it, the
    # first backward after 1 -> 2 saturated and the losses ended 0.38 % off).
    # Observed over 3 steps, both ways: losses 8e-8 relative; weights and masters 3e-8
    # (largest 0.26), exp_avg 6e-9 (largest 0.036), exp_avg_sq 2e-11 (largest 1.6e-4):
    # all within 2e-7 of the tensor's largest element; ledgers 1.2e-7 relative; steps equal.
    assert_close(back["from_other"]["continued"], r0["uninterrupted"], "2 -> 1, trained on", 0.5)
    assert_close(r0["from_other"]["continued"], one["uninterrupted"], "1 -> 2, trained on", 2.0)

    # Keys are FQNs, the same as torch's model state dict; under DDP `module.` is left out.
    for r in (one, r0):
        assert r["keys"] == [k for k in r["model_keys"] if ".fp8_" not in k]
        assert r["keys"] == PARAMS
    assert one["ddp_keys"] == one["ddp_model_keys"] == one["ddp_names"] == PARAMS

    # Misfits are refused, naming the key and what is accepted, and change nothing: a DTensor
    # for a parameter that is not sharded, a plain tensor or another placement for one that is,
    # and (when saving) state that is not shaped like the parameter.
    assert "['2.bias'] is a DTensor, but the parameter is not sharded" in one["dtensor_for_plain"]
    assert "accepted: a plain tensor of shape [16]" in one["dtensor_for_plain"]
    for r in (r0, r1):
        assert "state_dict['master_weights']['0.weight'] is a plain tensor" in r["plain_master"]
        assert "accepted: a DTensor of shape [32, 32]" in r["plain_master"]
        assert "['2.weight']['exp_avg'] is a DTensor" in r["replicated_moment"]
        assert "placements (Replicate(),)" in r["replicated_moment"]
        assert "placements (Shard(dim=0),)" in r["replicated_moment"]
        assert r["plain_master_untouched"] and r["replicated_moment_untouched"]
        assert "'row_var' of '0.weight'" in r["adafactor"]
        assert "cannot be resharded" in r["adafactor"]

    check_dcp_files(two_path, r0["saved"])


def check_dcp_files(path: str, saved: Result) -> None:
    """The 2-rank checkpoint holds one global tensor per FQN; converted by
    ``dcp_to_torch_save`` it loads with ``weights_only=True`` and restores one process."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    for key, shape in [
        ("optim.master_weights.4.weight", [3, 16]),  # saved as rows 2 + 1
        ("optim.state.0.weight.exp_avg", [32, 32]),
    ]:
        entry = meta[key]
        assert isinstance(entry, TensorStorageMetadata) and list(entry.size) == shape, key
    file = Path(path).with_suffix(".pt")
    dcp_to_torch_save(path, file)
    full = torch.load(file, weights_only=True)  # nothing in it needs a safe-globals entry
    model = sc.make_model(seed=3)
    opt = OffloadedOptimizer(model.parameters(), ComputeCtx.from_flag("fp8_hybrid", "cpu"))
    model.load_state_dict(full["model"])
    set_optimizer_state_dict(model, opt, full["optim"])
    assert_same(
        {"optim": sc.whole_optimizer(model, opt), "ledgers": sc.ledgers(model)},
        {"optim": saved["optim"], "ledgers": saved["ledgers"]},
        "dcp_to_torch_save",
    )
    with torch.no_grad():
        assert torch.equal(model(sc.PROBE), saved["probe"])


def assert_same(a: Result, b: Result, what: str) -> None:
    """Every tensor of ``a`` equal to ``b``'s, bitwise, key by key."""
    assert a.keys() == b.keys(), what
    for key in a:
        if isinstance(a[key], dict):
            assert_same(a[key], b[key], f"{what}/{key}")
        else:
            assert torch.equal(a[key], b[key]), f"{what}/{key}"


def assert_close(a: Result, b: Result, what: str, grad_ratio: float) -> None:
    """``a`` within a few float32 ulps of ``b``: losses and ledgers relative, tensors relative to
    their largest element; optimizer step counts exact. ``b``'s gradient ledgers are taken to
    ``a``'s world size first (history and step times ``grad_ratio``)."""
    torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-6, atol=0, msg=what)
    for key in ("weights", "optim"):
        assert a[key].keys() == b[key].keys(), what
        for name, t in a[key].items():
            ref = b[key][name]
            if name.startswith("step/"):
                assert torch.equal(t, ref), f"{what}/{name}"
                continue
            err = float((t - ref).abs().max())
            assert err <= 1e-6 * float(ref.abs().max()), f"{what}/{name}: {err}"
    for name, ledger in a["ledgers"].items():
        ref = in_world(b["ledgers"][name], name, grad_ratio)
        torch.testing.assert_close(ledger, ref, rtol=1e-6, atol=0, msg=f"{what}/{name}")
