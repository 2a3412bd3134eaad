"""The Triton 4-bit GEMM compiles for Blackwell's block-scaled tensor cores without a GPU, and
what it would be on Hopper.

As test_compile_for_gpu.py does for the fp8 kernels: a child process (without
``TRITON_INTERPRET``; ``compiles_for_gpu`` in conftest.py) builds ``computectx.kernels.fp4_gemm``'s
kernel ahead of time with the launcher's build options for each operand format and target:

- sm_100 (B200): ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`` for NVFP4 (E4M3 scales
  per 16; at every autotune tile) and ``kind::mxf4.block_scale.block32`` for MXFP4 (E8M0 per
  32): ``tl.dot_scaled`` takes both natively, nothing dequantized;
- sm_120 (consumer Blackwell): the warp-level ``mma.sync ... block_scale`` with ``ue4m3`` and
  ``ue8m0`` scales;
- sm_90 (H100/H200; NVFP4 only): no FP4 tensor cores; Triton lowers ``tl.dot_scaled`` to a
  bf16 ``wgmma`` of the codes upcast with their scales. The launcher refuses such a device
  (tests/kernels/test_fp4_gemm.py), so this build is never run: it is here to show why.

The grouped kernels (``computectx.kernels.fp4_grouped``: the forward at NVFP4, the wgrad at
MXFP4) compile to the same block-scaled ``tcgen05.mma`` on sm_100.

Everywhere: no floating-point contraction (NVFP4's ``acc * alpha + bias`` stays two roundings,
as in the twin: ``fma.rn.f32`` would fuse them) and no flush-to-zero; the dense kernel stages both
code operands with asynchronous copies in its K loop.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import compiles_for_gpu

pytestmark = pytest.mark.slow

_SCRIPT = r"""
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from computectx.kernels import fp4_gemm as kf

names = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "sa_ptr", "sb_ptr", "amax_a_ptr", "amax_b_ptr",
         "M", "N", "K_BYTES", "stride_am", "stride_ak", "stride_bn", "stride_bk", "stride_cm",
         "stride_cn", "stride_sa_r", "stride_sa_k", "stride_sb_r", "stride_sb_k", "m_bucket",
         "layout"]
types = {"a_ptr": "*u8", "b_ptr": "*u8", "c_ptr": "*bf16", "bias_ptr": "*bf16", "sa_ptr": "*u8",
         "sb_ptr": "*u8", "amax_a_ptr": "*fp32", "amax_b_ptr": "*fp32"}
aligned = ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K_BYTES", "stride_am", "stride_bn", "stride_cm")
configs = kf.fp4_configs(interpreted_block_m=32)
cfg = next(c for c in configs if c.kwargs["BLOCK_N"] == 128 and c.kwargs["BLOCK_K"] == 256)
out = {}
# NVFP4 1x16 activations by 16x16 weight tiles at every autotune tile on sm_100; MXFP4 1x32 by
# 1x32 at one; sm_120 both; Hopper NVFP4 only.
builds = [(100, 16, 16, i, c) for i, c in enumerate(configs)]
builds += [(cap, vec, rows, "", cfg) for cap, vec, rows in ((100, 32, 1), (120, 16, 16),
                                                            (120, 32, 1), (90, 16, 16))]
for cap, vec, rows_b, tag, c in builds:
    sig = {n: types.get(n, "i32") for n in names}
    consts = dict(c.kwargs, VEC=vec, ROWS_A=1, ROWS_B=rows_b,
                  ALPHA_INV=kf.ALPHA_FACTOR_INV, HAS_BIAS=True, OUT_BF16=True, stride_ak=1,
                  stride_bk=1, stride_sa_k=1, stride_sb_k=1)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = compile(ASTSource(kf._fp4_mm_kernel.fn, sig, consts, attrs),
                target=GPUTarget("cuda", cap, 32),
                options={"num_warps": c.num_warps, "num_stages": c.num_stages,
                         **kf.BUILD_OPTIONS})
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    mma = r"(?:tcgen05\.mma|wgmma\.mma_async|mma\.sync)[\w.:]*"
    out[f"{cap}/{vec}" + (f"/{tag}" if tag != "" else "")] = {
        "mma": sorted(set(re.findall(mma, ptx))),
        "fma": ptx.count("fma.rn.f32"),
        "ftz": ".ftz" in ptx,
        "async_copies": ttgir.count("async_copy_global_to_local"),
        "stages": c.num_stages,
    }
json.dump(out, sys.stdout)
"""


@compiles_for_gpu(_SCRIPT)
def test_fp4_gemm_compiles_to_block_scaled_mma(compile_report: dict[str, Any]) -> None:
    report = compile_report
    tiles = [name for name in report if name.startswith("100/16/")]
    assert len(tiles) >= 4 and len(report) == len(tiles) + 4, sorted(report)
    # Every autotune tile reaches the FP4 tensor cores (a 64-row tile would compile to a
    # 16-bit kind::f16 MMA of upcast operands).
    for name in tiles:
        assert report[name]["mma"] == [
            "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"
        ], (name, report[name])
    assert report["100/32"]["mma"] == ["tcgen05.mma.cta_group::1.kind::mxf4.block_scale.block32"]
    for vec, scale in (("16", "ue4m3"), ("32", "ue8m0")):
        (mma,) = report[f"120/{vec}"]["mma"]
        assert mma.startswith("mma.sync.aligned.m16n8k64") and "block_scale" in mma, mma
        assert mma.endswith(f".e2m1.e2m1.f32.{scale}"), mma
    # Hopper: the 16-bit emulation the launcher refuses to run.
    assert report["90/16"]["mma"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"]
    for name, facts in report.items():
        assert facts["fma"] == 0, (name, facts)
        assert not facts["ftz"], (name, facts)
        # Both code operands staged asynchronously, at least one copy per stage each.
        assert facts["async_copies"] >= 2 * (facts["stages"] - 1), (name, facts)


_GROUPED_SCRIPT = r"""
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from computectx.kernels import fp4_gemm as kf, fp4_grouped as kg

fwd = ["a_ptr", "b_ptr", "c_ptr", "sa_ptr", "sb_ptr", "amax_a_ptr", "amax_b_ptr", "offs_ptr",
       "M", "N", "K_BYTES", "E", "stride_am", "stride_ak", "stride_be", "stride_bn",
       "stride_bk", "stride_cm", "stride_cn", "stride_sa_r", "stride_sa_k", "stride_sb_e",
       "stride_sb_r", "stride_sb_k", "m_bucket", "layout"]
wg = ["a_ptr", "b_ptr", "c_ptr", "sa_ptr", "sb_ptr", "amax_a_ptr", "amax_b_ptr", "offs_ptr", "N",
      "K", "stride_an", "stride_ap", "stride_bk", "stride_bp", "stride_ce", "stride_cn",
      "stride_ck", "stride_sa_r", "stride_sa_c", "stride_sb_r", "stride_sb_c", "m_bucket",
      "layout"]
types = {"a_ptr": "*u8", "b_ptr": "*u8", "sa_ptr": "*u8", "sb_ptr": "*u8", "amax_a_ptr": "*fp32",
         "amax_b_ptr": "*fp32", "offs_ptr": "*i32"}
cfg = next(c for c in kg._CONFIGS if c.kwargs["BLOCK_N"] == 128 and c.kwargs["BLOCK_K"] == 256)
out = {}
# The forward at NVFP4 (1x16 by 16x16 tiles), the wgrad at MXFP4 (1x32 along the tokens).
for kind, kernel, names, vec, consts, aligned in (
    ("forward", kg._fp4_grouped_mm_kernel, fwd, 16,
     dict(ROWS_B=16, OUT_BF16=True, BLOCK_E=16, stride_ak=1, stride_bk=1, stride_sa_k=1,
          stride_sb_k=1),
     ("a_ptr", "b_ptr", "c_ptr", "K_BYTES", "stride_am", "stride_be", "stride_bn", "stride_cm")),
    ("wgrad", kg._fp4_grouped_wgrad_kernel, wg, 32,
     dict(stride_ap=1, stride_bp=1, stride_ck=1, stride_sa_c=1, stride_sb_c=1),
     ("a_ptr", "b_ptr", "c_ptr", "N", "K", "stride_an", "stride_bk", "stride_ce", "stride_cn")),
):
    sig = {n: types.get(n, "*bf16" if n == "c_ptr" and kind == "forward" else
                        "*fp32" if n == "c_ptr" else "i32") for n in names}
    consts = dict(cfg.kwargs, VEC=vec, ALPHA_INV=kf.ALPHA_FACTOR_INV, **consts)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = compile(ASTSource(kernel.fn, sig, consts, attrs), target=GPUTarget("cuda", 100, 32),
                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                         **kf.BUILD_OPTIONS})
    ptx = k.asm["ptx"]
    out[kind] = {
        "mma": sorted(set(re.findall(r"tcgen05\.mma[\w.:]*", ptx))),
        "fma": ptx.count("fma.rn.f32"),
        "ftz": ".ftz" in ptx,
    }
json.dump(out, sys.stdout)
"""


@compiles_for_gpu(_GROUPED_SCRIPT)
def test_fp4_grouped_gemms_compile_to_block_scaled_mma(compile_report: dict[str, Any]) -> None:
    report = compile_report
    assert report["forward"]["mma"] == [
        "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"
    ]
    assert report["wgrad"]["mma"] == ["tcgen05.mma.cta_group::1.kind::mxf4.block_scale.block32"]
    for name, facts in report.items():
        assert facts["fma"] == 0 and not facts["ftz"], (name, facts)


_QUANTIZE_SCRIPT = r"""
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from computectx.kernels import fp4_gemm as kf, fp4_quantize as kq
from computectx.kernels.quantize_cast import fp8_constants

target = GPUTarget("cuda", 100, 32)


def build(kernel, names, types, consts, aligned):
    sig = dict(zip(names, types))
    sig.update({k: "constexpr" for k in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = compile(ASTSource(kernel, sig, consts, attrs), target=target,
                options={"num_warps": 4, **kf.BUILD_OPTIONS})
    ptx = k.asm["ptx"]
    return {"v4": ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4"),
            "fma": ptx.count("fma.rn.f32"), "ftz": ".ftz" in ptx,
            "approx": ptx.count("div.full") + ptx.count("div.approx") + ptx.count("rcp.approx")}


out = {}
names = ["x_ptr", "codes_ptr", "scale_ptr", "amax_ptr", "rng_ptr", "seed", "counter", "R", "C",
         "C_VALID", "stride_r", "stride_c", "stride_qr", "stride_sr"]
# NVFP4 16x16 tiles of bf16 with stochastic rounding, the key by value (an int64 seed, an int32
# counter) or in device memory; MXFP4 rceil of float32 to nearest.
for name, xdt, nvfp4, rows, sr, in_memory in (("nvfp4", "*i16", True, 16, True, False),
                                              ("nvfp4-key", "*i16", True, 16, True, True),
                                              ("mxfp4", "*fp32", False, 1, False, False)):
    consts = dict(X_BF16=xdt == "*i16", NVFP4=nvfp4, ROWS=rows, VEC=16 if nvfp4 else 32,
                  FLOOR=False, SR=sr, KEY_IN_MEMORY=in_memory,
                  FMT=fp8_constants(torch.float8_e4m3fn), TILE_R=32, GROUPS=8, stride_c=1)
    types = [xdt, "*u8", "*u8", "*fp32", "*i64", "i64"] + ["i32"] * 8
    out[f"quantize/{name}"] = build(kq._quantize_kernel, names, types, consts,
                                    ("x_ptr", "codes_ptr", "C", "C_VALID", "stride_r",
                                     "stride_qr"))
out["hadamard"] = build(kq._hadamard_kernel,
                        ["x_ptr", "y_ptr", "amax_ptr", "M", "K", "M_PAD", "stride_m", "stride_k"],
                        ["*i16", "*i16", "*i32"] + ["i32"] * 5,
                        dict(SIGNS=0x1234, X_BF16=True, BLOCK_K=64, stride_k=1),
                        ("x_ptr", "y_ptr", "K", "M_PAD", "stride_m"))
json.dump(out, sys.stdout)
"""


@compiles_for_gpu(_QUANTIZE_SCRIPT)
def test_fp4_quantize_compiles_without_contraction(compile_report: dict[str, Any]) -> None:
    report = compile_report
    assert sorted(report) == ["hadamard", "quantize/mxfp4", "quantize/nvfp4", "quantize/nvfp4-key"]
    for name, facts in report.items():
        # Every rounding the twin's: no fused multiply-add, no flush-to-zero, IEEE division.
        assert facts["fma"] == 0 and not facts["ftz"] and facts["approx"] == 0, (name, facts)
    for name in ("quantize/mxfp4", "quantize/nvfp4", "quantize/nvfp4-key"):
        # The tile is read along its unit stride with 16-byte vector loads.
        assert report[name]["v4"] > 0, (name, report[name])
