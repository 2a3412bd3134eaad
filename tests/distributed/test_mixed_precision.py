"""Scale-out reads the policy's dtypes (docs/distributed.md, "Mixed precision under FSDP2 and
DDP"): FSDP2 gathers at ``ctx.compute`` and reduce-scatters at ``ctx.grad``, fp8 weights keep
their fp8 gather, DDP keeps its float32 reduction; 2 gloo ranks against one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from computectx.formats.linear.fp4_counter import stream_word
from computectx.formats.linear.fp4_streams import stream_of

from .conftest import RunRanks

LIMIT_S = 90.0
STEPS = 4
LR = 0.1
U = 2.0**-8
"""bf16's unit roundoff (8 significant bits, round to nearest)."""

# Bytes per shard element of each all-gather, what the layer computes with, and the dtype
# FSDP2 reduce-scatters in, under the ctx's mixed precision.
EXPECTED: dict[str, tuple[float, str, str]] = {
    "embedding": (2.0, "Parameter:torch.bfloat16", "torch.float32"),
    "norm": (2.0, "Parameter:torch.bfloat16", "torch.float32"),
    "head (not fp8)": (2.0, "Parameter:torch.bfloat16", "torch.float32"),
    # The fp8 gathers: the codes (and block scales), unchanged by the bf16 policy.
    "fp8 tensor, delayed": (1.0, "QuantizedWeight:torch.bfloat16", "torch.float32"),
    "fp8 tensor, dynamic": (1.0, "QuantizedWeight:torch.bfloat16", "torch.float32"),
    "fp8 block": (1 + 4 / 128**2, "QuantizedBlockWeight:torch.bfloat16", "torch.float32"),
    # Row and mx weights gather high precision: now bf16.
    "fp8 row": (2.0, "Parameter:torch.bfloat16", "torch.float32"),
    "fp8 mx": (2.0, "Parameter:torch.bfloat16", "torch.float32"),
    "bf16 model": (2.0, "Parameter:torch.bfloat16", "torch.float32"),
    "fp32 model": (4.0, "Parameter:torch.float32", "torch.float32"),
    "bf16 model, bf16 gradients": (2.0, "Parameter:torch.bfloat16", "torch.bfloat16"),
}
FP8_GATHERS = {"fp8 tensor, delayed", "fp8 tensor, dynamic", "fp8 block"}


def test_fsdp2_gathers_at_ctx_compute_and_fp8_weights_keep_their_fp8_gather(
    run_ranks: RunRanks,
) -> None:
    ranks = run_ranks("scenarios_mixed_precision.py:dtypes", limit_s=LIMIT_S, steps=2)
    for r in ranks:
        assert set(r["fsdp"]) == set(EXPECTED)
        for kind, (per_element, weight, reduce) in EXPECTED.items():
            got = r["fsdp"][kind]
            assert got["bytes_per_element"] == pytest.approx(per_element, rel=1e-12), (kind, got)
            assert got["weight"] == weight, (kind, got)
            assert got["reduce_dtypes"] == [reduce], (kind, got)
            wire = "torch.uint8" if kind in FP8_GATHERS else weight.split(":")[1]
            assert got["gather_dtypes"] == [wire], (kind, got)
            # The layers compute at ctx.compute (FSDP2 casts the float inputs too).
            assert got["out"] == ("torch.float32" if kind == "fp32 model" else "torch.bfloat16")
        _check_ddp(r["ddp"])
    _check_fp4_ddp([r["fp4_ddp"] for r in ranks])
    # accumulate=False: DDP's own reduction, the ranks' float32 gradients averaged.
    off0, off1 = (r["ddp"]["off"]["grads"] for r in ranks)
    assert off0.dtype == torch.float32 and torch.equal(off0, off1)
    # MixedPrecisionPolicy() opts out: every parameter gathers at its own dtype (float32), and
    # the fp8 gathers send the same bytes as under the ctx's policy.
    for kind, got in ranks[0]["fsdp_plain"].items():
        per_element = EXPECTED[kind][0] if kind in FP8_GATHERS else 4.0
        assert got["bytes_per_element"] == pytest.approx(per_element, rel=1e-12), (kind, got)
        assert got["reduce_dtypes"] == ["torch.float32"], (kind, got)


def _check_fp4_ddp(ranks: list[dict[str, Any]]) -> None:
    # DDP around 4-bit linears (docs/fp4.md, "Ranks"): each rank quantizes its own rows with
    # its own per-tensor amaxes (no collective in the forward; the weight's amax is the
    # replicated weight's), so its gradient is bit for bit one process's on those rows with
    # the same counter, and DDP's average is the average of those.
    from .scenarios_mixed_precision import fp4_batch, fp4_model

    shards, sims = fp4_batch().chunk(2), [fp4_model(), fp4_model()]
    for model, shard in zip(sims, shards, strict=True):
        model(shard).float().square().sum().backward()
    grads = [[p.grad for p in m.parameters() if p.grad is not None] for m in sims]
    want = [(a + b) / 2 for a, b in zip(*grads, strict=True)]
    for r in ranks:
        assert all(torch.equal(g, w) for g, w in zip(r["grads"], want, strict=True))
        # Each layer's key word is its stream's (seed 0 on the stream of its name).
        words = [stream_word(0, stream_of(name)) for name in ("0", "2")]
        assert [k.tolist() for k in r["keys"]] == [
            [words[0], 32 * (20 + 32)],
            [words[1], 16 * (20 + 32)],
        ]
    # Against one process on the whole batch (one amax for all 40 rows, the sum halved as
    # DDP averages): apart by the 4-bit noise only.
    whole = fp4_model()
    whole(fp4_batch()).float().square().sum().backward()
    for g, p in zip(ranks[0]["grads"], whole.parameters(), strict=True):
        assert p.grad is not None
        ref = p.grad.double() / 2
        sqnr = 10 * torch.log10(ref.square().sum() / (g.double() - ref).square().sum())
        assert sqnr > 10, float(sqnr)


def _check_ddp(ddp: dict[str, Any]) -> None:
    # ctx.grad bf16 under DDP: the accumulator takes DDP's one comm hook (its own, no
    # compression hook) and reduces the bf16 sums once per step, in float32, after two
    # micro-batches: one all-reduce of a float32 bucket of every gradient element (and one
    # presence flag per parameter).
    acc = ddp["default"]
    assert acc["data_parallel_accumulator"], acc
    assert acc["comm_hooks"] == ["_comm_hook"], acc
    bucket = 4 * (acc["elements"] + acc["parameters"])
    assert acc["all_reduces"] == [("torch.float32", bucket)], acc
    # accumulate=False: no accumulator and no hook registered.
    off = ddp["off"]
    assert off["accumulator"] == "NoneType" and off["comm_hooks"] == [], off


def _rank_grads(result: dict[str, Any], world: int) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as this rank handed it to FSDP2's first reduce-scatter
    (FSDP2 lays each unit's gradients out as ``world`` rows, each parameter's chunk ``r`` in
    row ``r``; each unit here has a size no other has)."""
    by_unit: dict[str, list[str]] = {}
    for name in result["shapes"]:
        by_unit.setdefault(name.split(".")[0], []).append(name)
    sizes = {
        sum(torch.Size(result["shapes"][n]).numel() for n in names): names
        for names in by_unit.values()
    }
    assert len(sizes) == len(by_unit)  # no two units of one size
    out: dict[str, torch.Tensor] = {}
    for flat in result["reduced"]:
        names = sizes[flat.numel()]
        rows = flat.view(world, -1)
        offset = 0
        for name in names:
            shape = torch.Size(result["shapes"][name])
            width = shape.numel() // world
            out[name] = rows[:, offset : offset + width].reshape(shape).double()
            offset += width
    assert set(out) == set(result["shapes"]), sorted(out)
    return out


def test_a_bf16_gather_trains_as_one_process_computing_at_ctx_compute(run_ranks: RunRanks) -> None:
    common = {"flag": "fp8_hybrid", "steps": STEPS, "lr": LR}
    two = run_ranks(
        "scenarios_mixed_precision.py:train_lm",
        limit_s=LIMIT_S,
        runs=["fsdp", "fsdp_plain"],
        **common,
    )
    (alone,) = run_ranks(
        "scenarios_mixed_precision.py:train_lm",
        world_size=1,
        runs=["fsdp_one_rank", "one"],
        **common,
    )
    r0, r1 = (r["fsdp"] for r in two)
    same_mp = alone["fsdp_one_rank"]
    for name, w in r0["weights"].items():
        assert torch.equal(r1["weights"][name], w), name
    s0, s1 = _rank_grads(r0, 2), _rank_grads(r1, 2)
    for name, g in r0["first_grads"].items():
        g2, g1 = g.double(), same_mp["first_grads"][name].double()
        both = (s0[name].abs() + s1[name].abs()) / 2
        # Each rank made its gradients at ctx.compute (bf16) and FSDP2 averaged them at
        # ctx.grad (float32): one float32 rounding of the sum, no bf16 one.
        for s in (s0[name], s1[name]):
            assert torch.equal(s, s.to(torch.bfloat16).double()), name
        assert bool(((g2 - (s0[name] + s1[name]) / 2).abs() <= 2.0**-24 * both).all()), name
        # One process at the same precision: each gradient is made at bf16 from the same
        # terms, summed in another grouping (the ranks' halves; float32 GEMMs whose order
        # follows the row count, then rounded to bf16): within 4u of the largest element.
        err = float((g2 - g1).abs().max() / g1.abs().max())
        assert err <= 4 * U, (name, err)
    # The first forward is one process's, row for row: the losses differ by the float32
    # mean's order only. Later steps start from weights the gradient rounding moved.
    rel = (r0["losses"] - same_mp["losses"]).abs() / same_mp["losses"]
    assert float(rel[0]) <= 1e-6, rel
    assert float(rel.max()) <= 1e-3, rel
    # Against one process at float32 (parallelize without a group: no cast anywhere): the
    # price of computing at bf16, within bf16's precision.
    one = alone["one"]
    rel_one = (r0["losses"] - one["losses"]).abs() / one["losses"]
    assert float(rel_one.max()) <= 1e-2, rel_one
    # mp_policy=MixedPrecisionPolicy() gathers float32: one process, within 1e-5 (the bound
    # docs/distributed.md states for FSDP2 against one process).
    plain = two[0]["fsdp_plain"]
    rel_plain = (plain["losses"] - one["losses"]).abs() / one["losses"]
    assert float(rel_plain.max()) <= 1e-5, rel_plain


def test_mp_policy_is_checked_before_anything_changes() -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from computectx import ComputeCtx
    from computectx.distributed import parallelize

    ctx = ComputeCtx.from_flag("bf16", "cpu")
    model = torch.nn.Linear(4, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match=r"mp_policy must be a .*MixedPrecisionPolicy, got dict"):
        parallelize(model, ctx, strategy="fsdp", mp_policy={"param_dtype": torch.bfloat16})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy='ddp' does not shard"):
        parallelize(model, ctx, strategy="ddp", mp_policy=MixedPrecisionPolicy())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert type(model) is torch.nn.Linear
