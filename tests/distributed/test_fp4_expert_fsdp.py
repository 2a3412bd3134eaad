"""4-bit grouped experts under FSDP2 (docs/fp4.md, "Ranks"): ``parallelize(strategy="fsdp")``
gathers each ``Fp4Experts`` weight in 4 bits, each rank quantizing its own whole experts (no
collective), every expert's forward and dgrad operands bit for bit those one process makes;
training equals one process per rank with the gradients averaged; experts cut by the shards
or sharded along another dim gather high precision with the warning, and
``fp8_all_gather=False`` turns the 4-bit gather off; rank 0 alone gets the
join's error from a forward and runs ``state_dict()``. One launch of 2 gloo ranks
(``scenarios_fp4_expert_fsdp.py``: a 10 s collective timeout, a 1 s join timeout, a 120 s wall
limit)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from computectx.formats import Fp4Experts
from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.formats.ops import fp4 as fp4_ops

from .conftest import _run
from .scenarios_fp4_expert_fsdp import LR, STEPS, batch, counter, model

RECIPES = ("nvfp4", "nvfp4+w1x16", "mxfp4")
LIMIT_S = 120.0
BYTES_PER_ELEMENT = {
    "nvfp4": 0.5 + 1 / 256,
    "nvfp4+w1x16": 2 * (0.5 + 1 / 16),
    "mxfp4": 2 * (0.5 + 1 / 32),
}
"""What an expert weight shard sends per element (plus NVFP4's 4-byte amax per expert)."""
SHARD_ELEMENTS = 2 * (64 * 32) + 2 * (32 * 32)
"""Each rank's two experts of gate_up (64 x 32) and of down (32 x 32)."""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fp4-experts-fsdp")
    params = {"recipes": list(RECIPES), "lone": "nvfp4"}
    return _run(tmp, "scenarios_fp4_expert_fsdp.py:experts", 2, LIMIT_S, params)


def _simulated(recipe: str, n_experts: int = 4, steps: int = STEPS) -> tuple[list[Any], list[int]]:
    # One process per rank on its own rows with its own counter; the gradients averaged as
    # FSDP2 averages them (halving is exact), the same SGD step on both copies, and every
    # counter the larger of the two after each step (Parallel.step's agreement).
    sims = [model(recipe, n_experts), model(recipe, n_experts)]
    opts = [torch.optim.SGD(s.parameters(), lr=LR) for s in sims]
    weights, keys = [], []
    for i in range(steps):
        for rank, (s, o) in enumerate(zip(sims, opts, strict=True)):
            o.zero_grad()
            s(batch(i, rank)).square().mean().backward()
        for a, b in zip(sims[0].parameters(), sims[1].parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            mean = (a.grad + b.grad) / 2
            a.grad, b.grad = mean, mean.clone()
        for o in opts:
            o.step()
        fa, fb = (next(m for m in s.modules() if isinstance(m, Fp4Experts)) for s in sims)
        fa.sr_key = fb.sr_key = torch.maximum(fa.sr_key, fb.sr_key)
        weights.append({n: p.detach().clone() for n, p in sims[0].named_parameters()})
        keys.append(counter(sims[0]))
    return weights, keys


def _one_process_operands(recipe: str) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    # Each expert's forward operand and dgrad operand (W[e]ᵀ at the weight's block) of the
    # initial weights, as Fp4Experts' grouped GEMM makes them in one process, stacked.
    m = model(recipe)
    fp4 = m.experts.fp8
    assert isinstance(fp4, Fp4Experts)
    out: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    for name in ("gate_up", "down"):
        w = getattr(m.experts, name).detach()
        per_op: list[tuple[torch.Tensor, ...]] = []
        for dgrad in (False, True):
            qs = [
                fp4_ops.quantize(w[e].t() if dgrad else w[e], fp4.how, weight=True)
                for e in range(4)
            ]
            per_op.append(
                (
                    torch.stack([q.codes.view(torch.uint8) for q in qs]),
                    torch.stack([q.scale.view(torch.uint8) for q in qs]),
                    torch.stack([q.amax.reshape(()) for q in qs if isinstance(q, Nvfp4Operand)])
                    if fp4.how.format == "nvfp4"
                    else torch.zeros(()),
                )
            )
        out[name] = per_op
    return out


def _same_operands(got: Any, want: list[tuple[torch.Tensor, ...]], where: str) -> None:
    assert got != "hp", f"{where} gathered high precision"
    for g, w, what in zip(got, want, ("forward", "dgrad"), strict=True):
        for a, b, part in zip(g, w, ("codes", "scales", "amax"), strict=True):
            assert torch.equal(a, b.reshape(a.shape)), (where, what, part)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_gathers_each_experts_one_process_operands_and_trains_as_one_process_per_rank(
    ranks: list[dict[str, Any]], recipe: str
) -> None:
    want_ops = _one_process_operands(recipe)
    for rank, r in enumerate(ranks):
        got = r[recipe]
        assert got["wrapped"] == ["ExpertsGatheredFp4", "ExpertsGatheredFp4"], rank
        for name in ("gate_up", "down"):
            _same_operands(got["operands"][name], want_ops[name], f"rank {rank} {name}")
        assert got["warnings"] == [], got["warnings"]
        assert r["off"] == "Tensor", rank  # parallelize(..., fp8_all_gather=False)
        assert got["saved_as"] == ["Tensor"], got["saved_as"]  # checkpoints hold plain tensors
    want_weights, want_keys = _simulated(recipe)
    for rank, r in enumerate(ranks):
        assert r[recipe]["counters"] == want_keys, rank
        for step, (got_w, want_w) in enumerate(
            zip(r[recipe]["weights"], want_weights, strict=True)
        ):
            for name in want_w:
                assert torch.equal(got_w[name], want_w[name]), (rank, step, name)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_wire_carries_4_bit_experts_and_no_amax_collective(
    ranks: list[dict[str, Any]], recipe: str
) -> None:
    r = ranks[0][recipe]
    sent: dict[str, int] = {}
    for dtype, nbytes in r["gathers"]:
        sent[str(dtype)] = sent.get(str(dtype), 0) + nbytes
    per_step = 2 * STEPS  # each step gathers the experts twice: forward, and for the backward
    amaxes = 4 * 4 if recipe != "mxfp4" else 0  # two experts of each weight, a float32 each
    per_gather = int(SHARD_ELEMENTS * BYTES_PER_ELEMENT[recipe]) + amaxes
    assert sent == {"torch.uint8": per_step * per_gather}, sent
    # No amax all-reduce: each expert lies whole in one rank's shard. NVFP4 rounds
    # stochastically: Parallel.step's one all-reduce of the counters.
    assert r["reduces"] == (["torch.int64"] * STEPS if recipe != "mxfp4" else [])
    if recipe == "nvfp4":
        assert per_gather / SHARD_ELEMENTS <= 0.6, per_gather / SHARD_ELEMENTS
    other = ranks[1][recipe]
    assert other["reduces"] == r["reduces"] and len(other["gathers"]) == len(r["gathers"])


def test_rank_0_alone_gets_the_joins_error_from_a_forward_and_saves(
    ranks: list[dict[str, Any]],
) -> None:
    lone = ranks[0]["nvfp4"]["lone"]
    assert lone["state_dict"] == "runs"
    assert lone["eval forward"].startswith("raises RuntimeError"), lone
    assert "rank(s) 1 of the group did not join it" in lone["eval forward"], lone
    # ...and step 1, after the lone calls, is the simulated step 1 (the parametrized test).


def test_experts_cut_by_the_shards_gather_high_precision_with_one_warning_each(
    ranks: list[dict[str, Any]],
) -> None:
    weights, keys = _simulated("nvfp4", n_experts=3, steps=1)
    for rank, r in enumerate(ranks):
        fb = r["fallback"]
        assert fb["operands"] == {"gate_up": "hp", "down": "hp"}, rank
        cut = [w for w in fb["warnings"] if "all-gathers high precision" in w]
        assert len(cut) == 2, fb["warnings"]
        assert "'experts.gate_up' ((3, 64, 32))" in cut[0], cut
        assert "expert count is a multiple of the shard count" in cut[0], cut
        assert fb["counter"] == keys[0], rank
        for name, want in weights[0].items():
            assert torch.equal(fb["weights"][name], want), (rank, name)


def test_column_shards_gather_high_precision_and_compute_as_one_process(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(ranks):
        col = r["column"]
        cut = [w for w in col["warnings"] if "all-gathers high precision" in w]
        assert len(cut) == 2 and "another dim than the experts" in cut[0], col["warnings"]
        with torch.no_grad():
            want = model("nvfp4")(batch(0, rank))
        assert torch.equal(col["y"], want), rank


def test_under_the_default_mixed_precision_the_operands_are_the_master_weights(
    ranks: list[dict[str, Any]],
) -> None:
    # parallelize's default gathers at ctx.compute (bf16); the 4-bit gather quantizes the
    # float32 shards: the operands one process makes from the float32 experts.
    want = _one_process_operands("nvfp4")
    for rank, r in enumerate(ranks):
        for name in ("gate_up", "down"):
            _same_operands(r["default_mp"][name], want[name], f"rank {rank} {name}")


def test_tied_experts_weights_keep_their_tie_and_gather_high_precision(
    ranks: list[dict[str, Any]],
) -> None:
    # enable_fp4_expert_gather wrapped each holder apart: two Parameters of one, FSDP2's
    # shards of each trained on their own. parallelize leaves tied weights out of the 4-bit
    # gather: the same training as with the gather off.
    for rank, r in enumerate(ranks):
        on, off = r["tied"]["True"], r["tied"]["False"]
        assert on["tied"] and on["params"] == 2, (rank, on["params"])
        assert on["local"] == "Tensor", on["local"]  # not an ExpertsGatheredFp4
        assert on["weights"].keys() == off["weights"].keys()
        for name, want in off["weights"].items():
            assert torch.equal(on["weights"][name], want), (rank, name)


def test_the_first_forward_under_inference_mode_runs_and_is_one_processs(
    ranks: list[dict[str, Any]],
) -> None:
    # FSDP2's lazy init views each wrapped shard; under inference_mode that raised torch's
    # "Cannot set version_counter for inference tensor" (the base of every gather wrapper).
    for rank, r in enumerate(ranks):
        got = r["inference"]
        assert got["wrapped"] == ["WeightGatheredFp4", "WeightGatheredQuantized"], got["wrapped"]
        for name in ("experts", "dense fp4", "dense fp8"):
            y = got[name]
            assert isinstance(y, torch.Tensor), (rank, name, y)
            assert torch.equal(y, got["one process"][name]), (rank, name)
