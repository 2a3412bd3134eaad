"""bench/bench_moe.py's byte accounting and router, and gpu_check's MoE section (CPU smoke)."""

from __future__ import annotations

import bench_moe as BM  # noqa: N812
import gpu_check_moe as GM  # noqa: N812
import pytest
import torch

from computectx.formats import quantize_tensor


def test_scale_bytes_are_what_fp8_quantize_returns() -> None:
    # Ragged N and K (not multiples of 32 or 128): partial blocks count as whole ones.
    w = torch.randn(3, 40, 200)
    BM.check_bytes(w)  # stops the bench unless every granularity's formula holds
    _, steps = quantize_tensor(w[0], "e4m3", granularity="128x128")
    assert steps.numel() == 1 * 2 and BM.scale_bytes("block", 40, 200) == 8
    assert BM.scale_bytes("mx", 40, 200) == 40 * 7  # ceil(200 / 32) one-byte steps per row
    assert BM.scale_bytes("row+gw_hp", 40, 200) == BM.scale_bytes("row", 40, 200) == 160
    with pytest.raises(ValueError, match="unknown granularity"):
        BM.scale_bytes("col", 1, 1)


def test_expert_weight_bytes_add_the_transposed_copy_only_where_it_is_requantized() -> None:
    e, d, h = 4, 64, 96
    codes = e * 3 * d * h  # gate_up [E, 2H, D] and down [E, D, H], one byte each
    assert BM.expert_weight_bytes("tensor", e, d, h) == codes + e * 2 * 4
    for g in ("tensor", "block"):  # Wᵀ reuses the forward's codes (one step, square blocks)
        assert BM.expert_weight_bytes(g, e, d, h, training=True) == BM.expert_weight_bytes(
            g, e, d, h
        )
    # row: the forward's per-row steps (2H + D rows), then Wᵀ's codes and per-row steps
    # (D + H rows).
    row = BM.expert_weight_bytes("row", e, d, h, training=True)
    assert row == 2 * codes + e * 4 * ((2 * h + d) + (d + h))
    # DeepSeek-V3's experts in bf16 are 21 GiB per layer; per-tensor fp8 halves them.
    bf16 = 2 * 3 * 256 * 7168 * 2048
    assert bf16 == 21 * 2**30
    assert BM.expert_weight_bytes("tensor", 256, 7168, 2048) / bf16 == pytest.approx(0.5)


def test_group_sizes_are_skewed_with_one_empty_group() -> None:
    sizes = BM.group_sizes(500, 8, 2, seed=0)
    assert sum(sizes) == 1000 and sizes[-1] == 0 and len(sizes) == 8
    assert max(sizes) > 2 * (1000 / 8)  # skewed
    offs = BM.offs_of(sizes)
    assert offs.dtype == torch.int32 and offs.tolist()[-1] == 1000


def test_gpu_offs_cover_every_row() -> None:
    offs = GM.group_offs(128000, 8, torch.device("cpu"))
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert offs.dtype == torch.int32 and int(offs[-1]) == 128000
    assert bool((sizes > 0).all()) and set(sizes.tolist()) != {16000}  # ragged, none empty
    assert GM.group_offs(70, 1, torch.device("cpu")).tolist() == [70]


def test_the_anchors_are_torchaos_b200_mxfp8_figures() -> None:
    # The README's microbenchmark tables: 1.64-1.81x (Llama 4), 1.19-1.60x (DeepSeek-V3).
    llama = [GM.ANCHORS["Llama 4 17B-16E", g] for g in (1, 2, 4, 8)]
    dsv3 = [GM.ANCHORS["DeepSeek-V3", g] for g in (1, 2, 4, 8)]
    assert min(llama) == 1.637 and max(llama) == 1.808
    assert min(dsv3) == 1.188 and max(dsv3) == 1.595
    assert {(model, g) for model, _, _, _, g in GM.GPU_SHAPES} <= set(GM.ANCHORS)
    assert GM.anchor("DeepSeek-V3", 8, "mx").endswith("1.440x (G=8)")
    assert GM.anchor("DeepSeek-V3", 8, "row") == "" == GM.anchor("DeepSeek-V3", 3, "mx")


def test_moe_section_skips_without_cuda_and_runs_its_cpu_smoke() -> None:
    skipped = GM.section_moe_gemm(torch.device("cpu"), False, 1)
    assert isinstance(skipped, dict) and "no CUDA device" in skipped["skipped"]
    rows = GM.section_moe_gemm(torch.device("cpu"), True, 1)
    assert isinstance(rows, list)
    ops = [r["op"] for r in rows]
    assert ops == ["bf16 F.grouped_mm"] + [f"fp8 {g} (reference)" for g, _ in GM.RECIPES]
    for r in rows:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] > 0, r
        assert r["fwd_bwd_tflops"] == pytest.approx(
            3 * 2 * r["m"] * r["n"] * r["k"] / (r["fwd_bwd_ms"] * 1e-3) / 1e12
        )
    base = rows[0]["fwd_bwd_ms"]
    assert [r["vs_bf16"] for r in rows] == pytest.approx([base / r["fwd_bwd_ms"] for r in rows])
    assert [bool(r["anchor"]) for r in rows] == [op.startswith("fp8 mx") for op in ops]
