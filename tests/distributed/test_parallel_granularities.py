"""Row, block and mx fp8 on 2 gloo ranks through ``parallelize``: DDP and FSDP2 against one
process on the whole batch (scenarios in scenarios_granular.py).

What differs between the two, and the tolerance that follows (docs/distributed.md, "Fine-
grained scaling on many ranks"):

- The forward and the dgrad quantize every operand in blocks along a row of ``X``, ``dY`` or
  ``W`` (or a 128x128 block of ``W``): each block lies within one rank's rows, and a rank's
  output gradient under a per-rank mean loss is exactly ``world`` (2) times one process's,
  which scales every block's step by 2 and leaves the codes alone. So outputs and input
  gradients are bit for bit one process's, at every step where the weights are.
- The wgrad ``dW = dYᵀ X`` contracts over the tokens, and its blocks run along them: a rank
  quantizes blocks of its own tokens. When each rank's tokens are exactly one block of one
  process's (128 rows per rank for ``block``'s 1x128, 32 for ``mx``), every block and its
  float32 partial sum are one process's, and one process's float32 sum of the two scaled
  partials is the reduction's sum (one rounding either way; the halving is exact): the
  training is bit for bit one process's, weights included.
- Otherwise (``row``: one block spans all the tokens; ``row+gw_hp``: a float32 GEMM whose sum
  runs in another order; ``block`` or ``mx`` with per-rank tokens that cut blocks) each rank's
  wgrad and one process's are each within the block GEMM's a-priori bound of the exact
  product, and so the gradients are within the sum of those bounds of each other:
  ``|g_ranks - g_one| <= B_one + (B_0 + B_1) / 2 + 2**-24 |g_ranks|`` (the last term: the
  float32 rounding of the reduction's sum). That is checked at every step against one
  process run from the same weights; across steps the weights drift apart by these
  amounts, and an fp8 code may then flip, so no a-priori bound covers later losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, Fp8Format
from computectx.formats import Recipe, quantize_tensor
from computectx.formats.numerics import blockwise, layouts
from computectx.formats.numerics.layouts import OPERAND_GRANULARITY

from .conftest import RunRanks

LIMIT_S = 120.0
STEPS = 3
LAYERS = 2
STRATEGIES = ["ddp", "fsdp"]


def _policy(flag: str) -> Recipe:
    policy = ComputeCtx.from_flag(flag, "cpu").fp8
    assert isinstance(policy, Recipe)
    return policy


def _steps_elementwise(x: torch.Tensor, fmt: Fp8Format, policy: Recipe) -> torch.Tensor:
    """Each element's step when ``x`` is quantized as the wgrad's operands are (blocks of
    the activation granularity along its last dimension), as float64."""
    gran = OPERAND_GRANULARITY[policy.granularity][0]
    width = x.shape[-1]
    if gran == "mx" and x.shape[-1] < layouts.MX_BLOCK:  # the linear pads it to one block
        x = torch.nn.functional.pad(x, (0, layouts.MX_BLOCK - x.shape[-1]))
    if gran == "mx":
        _, scale = quantize_tensor(x, fmt, granularity="mx", mx_rounding=policy.mx_rounding)
    else:
        _, scale = quantize_tensor(x, fmt, granularity=gran, power_of_two=policy.power_of_two)
    layout = layouts.layout_of(gran, x.shape)
    steps = blockwise.expand_steps(blockwise.steps_of_scale(scale).reshape(layout.grid), layout)
    return steps[:, :width].double()


def wgrad_bound(x: torch.Tensor, dy: torch.Tensor, policy: Recipe) -> torch.Tensor:
    """A-priori bound on ``|dW - dYᵀ X|`` for the fine-grained linear's wgrad of ``x``
    (M x K) and ``dy`` (M x N), ``dYᵀ X`` exact.

    ``gw_hp``: a float32 GEMM, ``(M + 2) 2**-24 |dY|ᵀ|X|``. Otherwise both operands are
    quantized along M, each element within ``u|v| + step * min_subnormal / 2`` (``u`` half
    an ulp of its format; the step rules here never saturate), fp8 products are exact, and
    the block GEMM's bound adds ``gamma_n`` of ``sum |â||b̂|`` (``n = M + M/32 + 4``) and
    one float32 rounding of the result."""
    f32 = 2.0**-24
    a, b = dy.t().double(), x.t().double()  # dYᵀ (N x M), Xᵀ (K x M)
    if policy.gw_hp:
        return (x.shape[0] + 2) * f32 * (a.abs() @ b.abs().t())
    fa, fb = policy.format.backward, policy.format.forward
    ua, ub = 2.0 ** -(fa.mantissa_bits + 1), 2.0 ** -(fb.mantissa_bits + 1)
    ea = ua * a.abs() + _steps_elementwise(dy.t(), fa, policy) * fa.min_subnormal / 2
    eb = ub * b.abs() + _steps_elementwise(x.t(), fb, policy) * fb.min_subnormal / 2
    quant = ea @ (b.abs() + eb).t() + a.abs() @ eb.t()
    m = max(x.shape[0], layouts.MX_BLOCK)
    n_terms = m + m / 32 + 4
    gamma = n_terms * f32 / (1 - n_terms * f32)
    accum = gamma * ((a.abs() + ea) @ (b.abs() + eb).t())
    exact = (a @ b.t()).abs()
    bound: torch.Tensor = quant + accum + f32 * (exact + quant + accum) + 2.0**-126
    return bound


def _check_common(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        # No amax history: no amax reduced, nothing warned. The statistics in the ledgers
        # are merged at the end of every backward: one all-gather per step, none in a
        # forward.
        steps = len(r["outs"])
        assert r["amax_collectives"] == {"all_gather": steps, "all_reduce": 0}, r[
            "amax_collectives"
        ]
        assert r["merged_operands"] == 3 * LAYERS
        assert r["seams"] == ["GroupAmax(reduces=False)"] * LAYERS
        assert r["warnings"] == [], r["warnings"]
    r0, r1 = ranks
    for name, w in r0["weights"].items():
        assert torch.equal(r1["weights"][name], w), name
    # Every rank holds the same fp8 state after the last step, with no explicit merge.
    for key, t in r0["ledgers"].items():
        assert torch.equal(r1["ledgers"][key], t), key


_ONE_PROCESS: dict[str, dict[str, Any]] = {}


def _one_process(run_ranks: RunRanks, common: dict[str, Any]) -> dict[str, Any]:
    """The one-process reference (world size 1, DDP's path) of a training ``common``
    describes: the DDP and the FSDP2 case of a test compare with the same run, so it runs once
    per test process and is reused (read only)."""
    key = repr(sorted(common.items()))
    if key not in _ONE_PROCESS:
        (_ONE_PROCESS[key],) = run_ranks(
            "scenarios_granular.py:train", world_size=1, strategy="ddp", **common
        )
    return _ONE_PROCESS[key]


def _each_strategy(
    run_ranks: RunRanks, limit_s: float = LIMIT_S, **params: Any
) -> dict[str, list[dict[str, Any]]]:
    """DDP's and FSDP2's runs of ``scenarios_granular.train``, both in one launch."""
    both = run_ranks(
        "scenarios_granular.py:train_each", limit_s=limit_s, strategies=STRATEGIES, **params
    )
    return {strategy: [r[strategy] for r in both] for strategy in STRATEGIES}


@pytest.mark.parametrize(("flag", "rows"), [("fp8_block", 256), ("fp8_mx", 64)])
def test_ddp_and_fsdp2_equal_one_process_bit_for_bit_where_token_blocks_align(
    run_ranks: RunRanks, flag: str, rows: int
) -> None:
    # 128 (block) or 32 (mx) tokens per rank: each rank's tokens are one wgrad block.
    common: dict[str, Any] = {"flag": flag, "rows": rows, "steps": STEPS}
    one = _one_process(run_ranks, common)
    for strategy, ranks in _each_strategy(run_ranks, **common).items():
        _check_common(ranks)
        r0, r1 = ranks
        for step in range(STEPS):
            whole = torch.cat([r0["outs"][step], r1["outs"][step]])
            assert torch.equal(whole, one["outs"][step]), (strategy, step)
        for name, w in one["weights"].items():
            assert torch.equal(r0["weights"][name], w), (strategy, name)
        for name in one["steps"][0]:
            if name.endswith(".grad"):
                assert torch.equal(r0["steps"][0][name], one["steps"][0][name]), (strategy, name)


@pytest.mark.parametrize(
    ("flag", "rows"),
    [("fp8_rowwise", 64), ("fp8_rowwise_gw_hp", 64), ("fp8_block", 64), ("fp8_mx", 48)],
)
def test_ddp_and_fsdp2_gradients_within_the_a_priori_bound_of_one_process(
    run_ranks: RunRanks, flag: str, rows: int
) -> None:
    # block: 32 tokens per rank cut one process's 64-token block; mx: 24 per rank, padded.
    common: dict[str, Any] = {"flag": flag, "rows": rows, "steps": STEPS}
    one = _one_process(run_ranks, common)
    for strategy, ranks in _each_strategy(run_ranks, reference=True, **common).items():
        _check_within_bound(ranks, one, _policy(flag), strategy)


def _check_within_bound(
    ranks: list[dict[str, Any]], one: dict[str, Any], policy: Recipe, strategy: str
) -> None:
    _check_common(ranks)
    r0, r1 = ranks
    # The in-rank reference is one process: at step 1 it is the world-of-one run, bit for bit.
    for key, value in one["steps"][0].items():
        assert torch.equal(r0["steps"][0][f"ref.{key}"], value), (strategy, key)
    exact_somewhere = False
    for step in range(STEPS):
        s0, s1 = r0["steps"][step], r1["steps"][step]
        whole = torch.cat([r0["outs"][step], r1["outs"][step]])
        ref_out_rows = s0["ref.1.x"].shape[0]
        assert whole.shape[0] == ref_out_rows
        for layer, name in enumerate(["0.weight", "2.weight"]):
            # The forward is row by row: the ranks' inputs are one process's rows.
            assert torch.equal(
                torch.cat([s0[f"{layer}.x"], s1[f"{layer}.x"]]), s0[f"ref.{layer}.x"]
            )
            # A rank's output gradient is world_size (2) x one process's: exact.
            dy = torch.cat([s0[f"{layer}.dy"], s1[f"{layer}.dy"]]) / 2
            assert torch.equal(dy, s0[f"ref.{layer}.dy"]), (strategy, step, layer)
            got, want = s0[f"{name}.grad"].double(), s0[f"ref.{name}.grad"].double()
            bound = (
                wgrad_bound(s0[f"ref.{layer}.x"], s0[f"ref.{layer}.dy"], policy)
                + (
                    wgrad_bound(s0[f"{layer}.x"], s0[f"{layer}.dy"], policy)
                    + wgrad_bound(s1[f"{layer}.x"], s1[f"{layer}.dy"], policy)
                )
                / 2
                + 2.0**-24 * got.abs()
            )
            err = (got - want).abs()
            assert bool((err <= bound).all()), (strategy, step, name, float((err / bound).max()))
            exact_somewhere = exact_somewhere or torch.equal(got, want)
    # The two runs are different computations (otherwise the bound is not what is tested).
    assert not exact_somewhere, strategy


def test_an_empty_micro_batch_takes_part_in_every_collective(run_ranks: RunRanks) -> None:
    # The last rank has no rows at step 1: DDP's and FSDP2's own collectives run on every
    # rank all the same (none of the sync's: nothing to reduce), so nothing hangs and the
    # ranks hold the same weights after it.
    each = _each_strategy(
        run_ranks, limit_s=60.0, flag="fp8_block", rows=64, steps=STEPS, empty_at=1
    )
    for strategy, ranks in each.items():
        _check_common(ranks)
        assert ranks[1]["outs"][1].shape == (0, 256), strategy
        assert ranks[0]["outs"][1].shape == (32, 256), strategy


def test_a_dcp_checkpoint_of_a_granular_policy_round_trips_and_reshards(
    run_ranks: RunRanks, tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    common = {"flag": "fp8_block", "path": path}
    saved = run_ranks(
        "scenarios_granular.py:checkpoint_round_trip", limit_s=60.0, strategy="fsdp", **common
    )
    loaded = run_ranks(
        "scenarios_granular.py:checkpoint_round_trip",
        limit_s=60.0,
        strategy="fsdp",
        load=True,
        **common,
    )
    (alone,) = run_ranks(
        "scenarios_granular.py:checkpoint_round_trip",
        world_size=1,
        strategy="ddp",
        load=True,
        **common,
    )
    # Saved on 2 FSDP2 ranks; loaded on 2 ranks and in one process: the same model.
    for r in (*loaded, alone):
        assert torch.equal(r["probe"], saved[0]["probe"])
    assert saved[0]["keys"] == alone["keys"]


def test_fsdp2_gathers_block_weights_as_their_fp8_blocks_and_scales(run_ranks: RunRanks) -> None:
    # 256-row weights on 2 ranks: shards of 128 rows, whole 128x128 blocks.
    r0, r1 = run_ranks(
        "scenarios_granular.py:train",
        limit_s=LIMIT_S,
        flag="fp8_block",
        strategy="fsdp",
        rows=64,
        steps=STEPS,
    )
    _check_common([r0, r1])
    # What the layers multiply with: the whole weight's own 128x128 codes and scales, bit
    # for bit (each shard's blocks quantized alone are the whole weight's blocks).
    assert [g["type"] for g in r0["gathered"]] == ["QuantizedBlockWeight"] * LAYERS
    for gathered, name in zip(r0["gathered"], ["0.weight", "2.weight"], strict=True):
        codes, scale = quantize_tensor(r0["initial"][name], "e4m3", granularity="128x128")
        assert torch.equal(gathered["codes"], codes.view(torch.uint8)), name
        assert torch.equal(gathered["scale"], scale), name
    # On the wire, from the gathered tensors' sizes: per gather and rank, each weight's
    # codes (1 byte per element of its shard) and its shard's float32 block scales, a
    # forward and a backward gather per step; nothing else (no bias).
    shapes = [r0["initial"][n].shape for n in ("0.weight", "2.weight")]
    elements = sum(rows * k for rows, k in shapes) // 2
    scales = sum((rows // 2 // 128) * -(-k // 128) for rows, k in shapes)
    sent = sum(nbytes for _, nbytes in r0["wire"])
    assert {dtype for dtype, _ in r0["wire"]} == {torch.uint8}
    assert sent == 2 * STEPS * (elements + 4 * scales), (sent, elements, scales)
    per_element = sent / (2 * STEPS * elements)
    assert per_element <= 1.05, per_element


def test_block_weights_whose_shards_cut_blocks_gather_high_precision_with_one_warning_each(
    run_ranks: RunRanks,
) -> None:
    # 128- and 64-row weights on 2 ranks: shards of 64 and 32 rows cut the 128-row blocks.
    # Every weight that falls back is named, each in its own warning (once per process).
    common = {"flag": "fp8_block", "rows": 256, "steps": 2, "widths": [64, 128, 64]}
    ranks = run_ranks("scenarios_granular.py:train", limit_s=LIMIT_S, strategy="fsdp", **common)
    (one,) = run_ranks("scenarios_granular.py:train", world_size=1, strategy="ddp", **common)
    for r in ranks:
        assert len(r["warnings"]) == LAYERS, r["warnings"]
        assert all(w.startswith("GatherFallbackWarning") for w in r["warnings"])
        named = sorted(w.split("'")[1] for w in r["warnings"])
        assert named == ["0.weight", "2.weight"], r["warnings"]
        assert "(128, 64)" in " ".join(r["warnings"]) and "(64, 128)" in " ".join(r["warnings"])
        assert [g["type"] for g in r["gathered"]] == ["Parameter"] * LAYERS
        assert {dtype for dtype, _ in r["wire"]} == {torch.float32}
    # The layer quantizes the gathered weight itself: one process's training, bit for bit.
    for name, w in one["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], w), name
