"""4-bit linears under FSDP2 (docs/fp4.md, "Ranks"; docs/distributed.md, "What FSDP2
all-gathers"): ``parallelize(strategy="fsdp")`` gathers the weights in 4 bits, bit for bit
the operands one process makes, in 0.5039 bytes an element (NVFP4 16x16); the training equals
one process per rank with DDP's average; rank 0 alone gets a clear error from a forward and
runs ``state_dict()``; DCP checkpoints reshard 1 -> 2 and 2 -> 1 with the weights and the
counters bit for bit. Two launches of 2 gloo ranks (``scenarios_fp4_fsdp.py``: a 10 s
collective timeout, a 1 s join timeout, a 120 s wall limit)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from computectx.distributed import parallelize
from computectx.formats import Fp4Linear
from computectx.formats.linear.fp4 import fp4_quant
from computectx.formats.linear.fp4_streams import stream_of
from computectx.formats.ops import fp4 as fp4_ops

from .conftest import _run
from .scenarios_fp4_fsdp import LR, ROWS, STEPS, batch, counters, ctx_of, layers, model

RECIPES = ("nvfp4", "nvfp4+w1x16", "mxfp4")
LIMIT_S = 120.0
BYTES_PER_ELEMENT = {
    "nvfp4": 0.5 + 1 / 256,
    "nvfp4+w1x16": 2 * (0.5 + 1 / 16),
    "mxfp4": 2 * (0.5 + 1 / 32),
}
"""What a weight shard sends per element: codes and tile scales (NVFP4 16x16); both
operands' codes and scales where blocks do not transpose."""


@pytest.fixture(scope="module")
def gathered(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fp4-fsdp")
    params = {"recipes": list(RECIPES), "lone": "nvfp4", "default_mp": "nvfp4"}
    return _run(tmp, "scenarios_fp4_fsdp.py:gather", 2, LIMIT_S, params)


def _simulated(recipe: str) -> tuple[list[dict[str, torch.Tensor]], list[list[int]]]:
    # One process per rank, each on its own rows with its own counter; the gradients
    # averaged as FSDP2 averages them (halving is exact), the same SGD step on both copies,
    # and after each step every counter the larger of the two (Parallel.step's agreement).
    sims = [model(recipe), model(recipe)]
    opts = [torch.optim.SGD(s.parameters(), lr=LR) for s in sims]
    weights, keys = [], []
    for i in range(STEPS):
        for rank, (s, o) in enumerate(zip(sims, opts, strict=True)):
            o.zero_grad()
            s(batch(i, rank)).square().mean().backward()
        for a, b in zip(sims[0].parameters(), sims[1].parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            mean = (a.grad + b.grad) / 2
            a.grad, b.grad = mean, mean.clone()
        for o in opts:
            o.step()
        for la, lb in zip(layers(sims[0]), layers(sims[1]), strict=True):
            la.sr_key = lb.sr_key = torch.maximum(la.sr_key, lb.sr_key)
        weights.append({n: p.detach().clone() for n, p in sims[0].named_parameters()})
        keys.append(counters(sims[0]))
    return weights, keys


def _one_process_operands(recipe: str) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    # The forward's operand and the dgrad's (Wᵀ quantized at the weight's block) of the
    # initial weights, as one process makes them.
    out: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    for name, m in model(recipe).named_modules():
        if isinstance(m, Fp4Linear):
            w = m.weight.detach()
            ops = (m.quantized_weight(), fp4_ops.quantize(w.t(), fp4_quant(m.recipe), weight=True))
            out[name] = [
                (
                    q.codes.view(torch.uint8),
                    q.scale.view(torch.uint8),
                    getattr(q, "amax", torch.zeros(())),
                )
                for q in ops
            ]
    return out


def _same_operands(got: Any, want: list[tuple[torch.Tensor, ...]], where: str) -> None:
    assert got != "hp", f"{where} gathered high precision"
    for g, w, what in zip(got, want, ("forward", "dgrad"), strict=True):
        for a, b, part in zip(g, w, ("codes", "scales", "amax"), strict=True):
            assert torch.equal(a, b.reshape(a.shape)), (where, what, part)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_gathers_the_one_process_operands_and_trains_as_one_process_per_rank(
    gathered: list[dict[str, Any]], recipe: str
) -> None:
    ranks = [r[recipe] for r in gathered]
    want_ops = _one_process_operands(recipe)
    fallback = recipe == "mxfp4"  # layer 2's shards of 16 rows cut Wᵀ's 32-row blocks
    for rank, r in enumerate(ranks):
        assert r["wrapped"] == ["WeightGatheredFp4", "WeightGatheredFp4"], rank
        _same_operands(r["operands"]["0"], want_ops["0"], f"rank {rank} layer 0")
        if fallback:
            assert r["operands"]["2"] == "hp"
            assert len(r["warnings"]) == 1 and "'2.weight'" in r["warnings"][0], r["warnings"]
            assert "multiple of 32 x the shard count" in r["warnings"][0]
        else:
            _same_operands(r["operands"]["2"], want_ops["2"], f"rank {rank} layer 2")
            assert r["warnings"] == [], r["warnings"]
    want_weights, want_keys = _simulated(recipe)
    if recipe != "mxfp4":
        assert want_keys[0] == [64 * (ROWS[0] + 32), 32 * (ROWS[0] + 32)]  # rank 0's: dY, dYᵀ
    for rank, r in enumerate(ranks):
        assert r["counters"] == want_keys, rank
        for step, (got, want) in enumerate(zip(r["weights"], want_weights, strict=True)):
            for name in want:
                assert torch.equal(got[name], want[name]), (rank, step, name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_wire_carries_the_4_bit_bytes_and_nvfp4_one_amax_reduce_per_forward_gather(
    gathered: list[dict[str, Any]], recipe: str
) -> None:
    r = gathered[0][recipe]
    sent: dict[str, int] = {}
    for dtype, nbytes in r["gathers"]:
        sent[str(dtype)] = sent.get(str(dtype), 0) + nbytes
    # Each step gathers each unit twice (forward, and again for the backward): a weight shard
    # of 32 x 64 and one of 16 x 64, each with its float32 bias shard riding along.
    per_step = 2 * STEPS
    if recipe == "mxfp4":  # layer 2 falls back: its float32 weight and bias
        assert sent == {
            "torch.uint8": per_step * int(32 * 64 * BYTES_PER_ELEMENT[recipe] + 32 * 4),
            "torch.float32": per_step * (16 * 64 + 16) * 4,
        }
        assert r["reduces"] == []  # no per-tensor scale, no stochastic rounding
    else:
        weights = (32 + 16) * 64
        assert sent == {
            "torch.uint8": per_step * (int(weights * BYTES_PER_ELEMENT[recipe]) + 48 * 4)
        }
        # Per step: one MAX of the amax per weight at the forward gather (the backward's
        # re-gather reuses it), then Parallel.step's one all-reduce of the counters.
        assert r["reduces"] == ["torch.float32", "torch.float32", "torch.int64"] * STEPS
    if recipe == "nvfp4":
        per_element = (sent["torch.uint8"] / per_step - 48 * 4) / ((32 + 16) * 64)
        assert per_element <= 0.6, per_element
    # Every rank issued the same collectives, the same number of times.
    other = gathered[1][recipe]
    assert other["reduces"] == r["reduces"] and len(other["gathers"]) == len(r["gathers"])


def test_rank_0_alone_gets_a_clear_error_from_a_forward_and_saves_and_the_group_trains_on(
    gathered: list[dict[str, Any]],
) -> None:
    lone = gathered[0]["nvfp4"]["lone"]
    assert lone["state_dict"] == "runs"
    assert lone["eval forward"].startswith("raises RuntimeError"), lone
    assert "rank(s) 1 of the group did not join it" in lone["eval forward"], lone
    # ...and step 2, after the lone calls, is the simulated step 2 (the parametrized test).


def test_under_the_default_mixed_precision_the_operands_are_the_master_weights(
    gathered: list[dict[str, Any]],
) -> None:
    # parallelize's default gathers high precision at ctx.compute (bf16); the 4-bit gather
    # quantizes the float32 shards: the operands one process makes from the float32 weight.
    want = _one_process_operands("nvfp4")
    for rank, r in enumerate(gathered):
        for name in ("0", "2"):
            _same_operands(r["default_mp"][name], want[name], f"rank {rank} layer {name}")


def _one_process(recipe: str, seed: int) -> Any:
    return parallelize(
        model(recipe, seed),
        ctx_of(recipe),
        optimizer_class=torch.optim.SGD,
        lr=LR,
        accumulate=False,
        offload=False,
    )


def _whole(par: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
    return {n: p.detach().clone() for n, p in par.module.named_parameters()}, counters(par.module)


def _equal(got: tuple[dict[str, torch.Tensor], list[int]], want: Any, what: str) -> None:
    assert got[1] == want[1], (what, got[1], want[1])
    for name, w in want[0].items():
        assert torch.equal(got[0][name], w), (what, name)


def test_dcp_checkpoints_reshard_1_to_2_and_2_to_1_weights_and_counters_bit_for_bit(
    tmp_path: Path,
) -> None:
    recipe = "nvfp4"
    one, two = tmp_path / "one", tmp_path / "two"
    par = _one_process(recipe, seed=3)
    for i in range(2):
        par.model(batch(i, 0)).square().mean().backward()
        par.step()
    save(par.state_dict(), checkpoint_id=one)
    saved_one = _whole(par)
    assert saved_one[1][0] > 0
    ranks = _run(
        tmp_path,
        "scenarios_fp4_fsdp.py:checkpoint",
        2,
        LIMIT_S,
        {"recipe": recipe, "one": str(one), "two": str(two)},
    )
    for rank, r in enumerate(ranks):
        assert r["plain_masters"], rank
        _equal(r["loaded_one"], saved_one, f"1 -> 2, rank {rank}")  # every rank: the saved
        _equal(r["saved_two"], ranks[0]["saved_two"], f"rank {rank} at the save")
        _equal(r["resumed"], r["uninterrupted"], f"2 -> 2 resumed, rank {rank}")
        _equal(r["loaded_two"], ranks[0]["saved_two"], f"2 -> 2 loaded, rank {rank}")
        # A counter out of range in rank 1's state alone: every rank refuses, naming rank 1,
        # and no rank loads (rank 0 loaded alone before the check ran inside the agreement).
        # A step refused on rank 1 alone changes no counter on any rank (the counters' sync
        # ran before the agreed checks: every rank's counters moved to the larger).
        before, after, refused = r["refused_step"]
        assert "rank 1" in refused and after == before, (refused, before, after)
        error, stayed = r["one_rank_bad"]
        assert "failed on rank(s) 1" in error and "counter -5" in error, (rank, error)
        assert stayed, rank
        # Another fp8_filter on rank 1: FSDP2 gathered rank 0's layer 0 in 4 bits and rank
        # 1's in float32 (both timed out); now every rank refuses at setup, naming both.
        assert "rank(s) 1 differ from rank 0 in their 4-bit layers" in r["filter_differs"], (
            rank,
            r["filter_differs"],
        )
        zero = f"Fp4Linear under nvfp4 on stream {stream_of('0')}"
        assert f"'0': rank 0 holds {zero}, rank 1 holds no 4-bit layer" in r["filter_differs"]
        # Another stream on rank 1 (its uniforms other than rank 0's): refused at setup too.
        streams = r["streams_differ"]
        assert "rank(s) 1 differ from rank 0 in their 4-bit layers" in streams, (rank, streams)
        want = f"'0': rank 0 holds {zero}, rank 1 holds Fp4Linear under nvfp4 on stream 12345"
        assert want in streams, streams
        # Under DDP a bad stream in rank 1's state alone was refused on rank 1 only: rank 0
        # loaded (and installed its stream 555) and trained on. Now every rank refuses,
        # naming rank 1, promptly, with nothing changed; so does another valid stream on
        # rank 1 (the ranks would draw on different streams from then on).
        loads = r["ddp_loads"]
        error, secs, stayed = loads["bad"]
        assert "failed on rank(s) 1" in error and "stream -1" in error, (rank, error)
        assert stayed and secs < 5.0, (rank, stayed, secs)
        error, secs, stayed = loads["other"]
        assert "rank(s) 1 differ from rank 0; the first is '0._extra_state'" in error, error
        assert "on rank 0, 77 on rank 1" in error and stayed and secs < 5.0, (error, stayed, secs)
        # assign_fp4_streams through the DDP wrapper hashed 'module.0' (another stream, a
        # refusal after training); now the module's own names: no change.
        kept, after = loads["assign_through_ddp"]
        assert kept == after == [stream_of("0"), stream_of("2")], loads["assign_through_ddp"]
        # Two layers on one stream draw the same uniforms: the setup check names both.
        assert any(
            "'0' and '2' share the stochastic-rounding stream 7" in w
            for w in loads["shared_warnings"]
        ), loads["shared_warnings"]
        # Column shards (Shard(1)): torch's "shape '[128, 32]' is invalid for input of size
        # 2048" from inside FSDP2 before; now ours, naming the weight.
        column = r["column_shards"]
        assert "'0.weight' ((64, 64)) is sharded by FSDP2 along another dim" in column, column
        # fp8's gather the same (it said "The size of tensor a (32) must match ... (64)").
        fp8 = r["fp8_column_shards"]
        assert "'0.weight' ((64, 64)) is sharded by FSDP2 along another dim" in fp8, fp8
        assert "gathers in fp8 only in row shards" in fp8, fp8
    # The ranks' rows differ, so their counters part ways within a step; Parallel.step made
    # them the larger, and that is what the checkpoint holds.
    assert ranks[0]["saved_two"][1][0] > saved_one[1][0]
    back = _one_process(recipe, seed=4)
    state = back.state_dict()
    load(state, checkpoint_id=two)
    back.load_state_dict(state)
    _equal(_whole(back), ranks[0]["saved_two"], "2 -> 1")


def test_a_checkpoint_of_another_seed_is_refused_before_anything_loads(tmp_path: Path) -> None:
    par = _one_process("nvfp4", seed=3)
    par.model(batch(0, 0)).square().mean().backward()
    par.step()
    save(par.state_dict(), checkpoint_id=tmp_path)
    other = _one_process("nvfp4+seed=5", seed=4)
    before = _whole(other)
    state = other.state_dict()
    load(state, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match=r"saved under the 4-bit recipe 'nvfp4'.*'nvfp4\+seed=5'"):
        other.load_state_dict(state)
    # dcp.load wrote into the state's own tensors (the parameters); the counters, checked
    # first, are untouched.
    assert counters(other.module) == before[1]
