"""The GPU build of every kernel compiles for sm_89 and sm_90 (the block-scaled and grouped GEMMs
for sm_90 and sm_100; the quantize kernel for sm_90, whose PTX is sm_89's), and pipelines,
without a GPU.

The interpreter runs the kernels' semantics but never lowers them to PTX, so an op that
does not compile for a GPU would only surface on one. Triton compiles ahead of time for a
named target with the ``ptxas`` it ships, so a child process (without
``TRITON_INTERPRET``; one for every GPU-compile test of the session, ``compiles_for_gpu`` in
conftest.py) builds each kernel for Ada and Hopper here, with the alignment hints
Triton's JIT derives at run time for aligned shapes. It checks the code generation we rely
on for speed: 16-byte vector loads in the quantize kernel, Hopper ``wgmma`` (Blackwell
``tcgen05.mma``) and asynchronous multi-stage copies in the GEMMs' main loops for K-major
operands.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import compiles_for_gpu

pytestmark = pytest.mark.slow

_SCRIPT = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
import torch
from computectx.kernels import quantize as kq, scaled_mm as kg
from computectx.kernels.quantize_cast import fp8_constants
from computectx.formats.numerics.ledger import LEDGER_NONFINITE, LEDGER_SATURATED, LEDGER_STEP

out = {}
q_names = ["x_ptr", "q_ptr", "step_ptr", "n_elements", "scratch_ptr", "amax_out_ptr",
           "step_out_ptr", "ledger_ptr", "ledger_idx", "n_hist"]
# The quantize kernel at sm_90 only: Triton 3.9 emits the same PTX for sm_89, line for line
# but the .target and .version lines (checked for all four variants), so the facts are the same.
for cap in (90,):
    for xdt, cast, reduce in (("*i16", True, 3), ("*fp16", True, 1), ("*fp32", False, 2),
                              ("*fp32", True, 0)):
        sig = dict(zip(q_names, [xdt, "*u8", "*fp32", "i32", "*i32", "*fp32", "*fp32",
                                 "*fp32", "i32", "i32"]))
        consts = dict(FMT=fp8_constants(torch.float8_e4m3fn),
                      TARGET=kq._target(torch.float8_e4m3fn, 1), X_BF16=xdt == "*i16", CAST=cast,
                      REDUCE=reduce, ALGO_MAX=True, LEDGER_STEP=LEDGER_STEP,
                      LEDGER_NONFINITE=LEDGER_NONFINITE, LEDGER_SATURATED=LEDGER_SATURATED,
                      BLOCK=4096, RBLOCK=1024)
        sig.update({k: "constexpr" for k in consts})
        attrs = {(q_names.index(n),): [["tt.divisibility", 16]]
                 for n in ("x_ptr", "q_ptr", "n_elements")}
        k = compile(ASTSource(kq._quantize_kernel, sig, consts, attrs),
                    target=GPUTarget("cuda", cap, 32), options={"num_warps": 8})
        ptx = k.asm["ptx"]
        out[f"quantize/{cap}/{xdt}/{reduce}"] = {
            "v4_loads": ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4"),
            "ftz": ".ftz" in ptx,
        }

g_names = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "sa_ptr", "sb_ptr", "M", "N", "K",
           "stride_am", "stride_ak", "stride_bn", "stride_bk", "stride_cm", "stride_cn",
           "stride_sa_r", "stride_sa_k", "stride_sb_r", "stride_sb_k", "m_bucket", "layout"]
cfg = next(c for c in kg._configs() if c.kwargs["BLOCK_M"] == 128 and c.kwargs["BLOCK_N"] == 128
           and c.kwargs["BLOCK_K"] == 64 and c.num_warps == 4)
for cap in (89, 90):
    sig = dict(zip(g_names, ["*fp8e5", "*fp8e4nv", "*bf16", "*fp32", "*fp32", "*fp32"]
                   + ["i32"] * 15))
    # Per-tensor steps: the shared kernel's SCALE_K == 0 case, one step each.
    consts = dict(cfg.kwargs, SCALE_K=0, BLOCK_ROWS_A=1, BLOCK_ROWS_B=1, E8M0=False,
                  HAS_BIAS=True, OUT_BF16=True, stride_ak=1, stride_bk=1)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(g_names.index(n),): [["tt.divisibility", 16]]
             for n in ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "M", "N", "K", "stride_am",
                       "stride_bn", "stride_cm")}
    k = compile(ASTSource(kg._scaled_mm_kernel.fn, sig, consts, attrs),
                target=GPUTarget("cuda", cap, 32),
                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ttgir = k.asm["ttgir"]
    out[f"gemm/{cap}"] = {
        "async_copies": ttgir.count("async_copy_global_to_local"),
        "wgmma": "warp_group_dot" in ttgir,
        "stages": cfg.num_stages,
    }
json.dump(out, sys.stdout)
"""


@compiles_for_gpu(_SCRIPT)
def test_kernels_compile_for_ada_and_hopper(compile_report: dict[str, Any]) -> None:
    report = compile_report
    for name, facts in report.items():
        if name.startswith("quantize/"):
            # 16-byte vector loads, and no flush-to-zero arithmetic: subnormal inputs and
            # steps must round as they do in the twin.
            assert facts["v4_loads"] > 0, (name, facts)
            assert not facts["ftz"], (name, facts)
    for cap in (89, 90):
        gemm = report[f"gemm/{cap}"]
        # Both K-major operands are staged with asynchronous copies, one per stage each.
        assert gemm["async_copies"] >= 2 * (gemm["stages"] - 1), gemm
    assert report["gemm/90"]["wgmma"], "Hopper should use warp-group MMA for fp8"
    assert not report["gemm/89"]["wgmma"]


_BLOCKS_SCRIPT = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from computectx.kernels import scaled_mm_blocks as kb

names = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "sa_ptr", "sb_ptr", "M", "N", "K",
         "stride_am", "stride_ak", "stride_bn", "stride_bk", "stride_cm", "stride_cn",
         "stride_sa_r", "stride_sa_k", "stride_sb_r", "stride_sb_k", "m_bucket", "layout"]
out = {}
# (scale block along K, rows per block of b, BLOCK_K): 1x128 x 128x128 in one step per
# block; 1x128 x 1x128 in two 64-wide steps; MX in 32-wide steps; row-wise.
for cap in (90, 100):
    for scale_k, rows_b, bk in ((128, 128, 128), (128, 1, 64), (32, 1, 32), (0, 1, 128)):
        cfg = next(c for c in kb._configs() if c.kwargs["BLOCK_K"] == bk)
        e8 = scale_k == 32
        scale_t = "*u8" if e8 else "*fp32"
        sig = dict(zip(names, ["*fp8e4nv", "*fp8e5", "*bf16", "*fp32", scale_t, scale_t]
                       + ["i32"] * 15))
        consts = dict(cfg.kwargs, SCALE_K=scale_k, BLOCK_ROWS_A=1, BLOCK_ROWS_B=rows_b,
                      E8M0=e8, HAS_BIAS=True, OUT_BF16=True, stride_ak=1, stride_bk=1)
        sig.update({k: "constexpr" for k in consts})
        attrs = {(names.index(n),): [["tt.divisibility", 16]]
                 for n in ("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "M", "N", "K", "stride_am",
                           "stride_bn", "stride_cm")}
        k = compile(ASTSource(kb._scaled_mm_blocks_kernel.fn, sig, consts, attrs),
                    target=GPUTarget("cuda", cap, 32),
                    options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        out[f"blocks/{cap}/{scale_k}/{rows_b}/{bk}"] = {
            "async_copies": ttgir.count("async_copy_global_to_local"),
            "wgmma": "warp_group_dot" in ttgir,
            "tcgen05": "tcgen05.mma" in ptx,
            "ftz": ".ftz" in ptx,
            "stages": cfg.num_stages,
        }

# The grouped GEMMs (MoE), in this process too: the forward/dgrad with DeepSeek-V3's blocks
# on Hopper and with MX on Blackwell, the wgrad likewise.
from computectx.kernels import grouped_mm as kgm, grouped_wgrad as kgw

fwd = ["a_ptr", "b_ptr", "c_ptr", "sa_ptr", "sb_ptr", "offs_ptr", "M", "N", "K", "E",
       "stride_am", "stride_ak", "stride_be", "stride_bn", "stride_bk", "stride_cm",
       "stride_cn", "stride_sa_e", "stride_sa_r", "stride_sa_k", "stride_sb_e", "stride_sb_r",
       "stride_sb_k", "m_bucket", "layout"]
wg = ["a_ptr", "b_ptr", "c_ptr", "sa_ptr", "sb_ptr", "offs_ptr", "start_ptr", "N", "K",
      "stride_an", "stride_am", "stride_bk", "stride_bm", "stride_ce", "stride_cn", "stride_ck",
      "stride_sa_r", "stride_sa_c", "stride_sb_r", "stride_sb_c", "m_bucket", "layout"]
for kind, kernel, names, cap, scale_k, consts, aligned in (
    ("forward", kgm._grouped_mm_kernel, fwd, 90, 128,
     dict(BLOCK_ROWS_B=128, OUT_BF16=True, BLOCK_E=16, stride_ak=1, stride_bk=1),
     ("a_ptr", "b_ptr", "c_ptr", "K", "stride_am", "stride_be", "stride_bn", "stride_cm")),
    ("forward", kgm._grouped_mm_kernel, fwd, 100, 32,
     dict(BLOCK_ROWS_B=1, OUT_BF16=True, BLOCK_E=16, stride_ak=1, stride_bk=1),
     ("a_ptr", "b_ptr", "c_ptr", "K", "stride_am", "stride_be", "stride_bn", "stride_cm")),
    ("wgrad", kgw._grouped_wgrad_kernel, wg, 90, 128, dict(stride_am=1, stride_bm=1, stride_ck=1),
     ("a_ptr", "b_ptr", "c_ptr", "N", "K", "stride_an", "stride_bk", "stride_ce", "stride_cn")),
    ("wgrad", kgw._grouped_wgrad_kernel, wg, 100, 32, dict(stride_am=1, stride_bm=1, stride_ck=1),
     ("a_ptr", "b_ptr", "c_ptr", "N", "K", "stride_an", "stride_bk", "stride_ce", "stride_cn")),
):
    cfg = next(c for c in kgm.gemm_configs(16) if c.kwargs["BLOCK_K"] == min(scale_k, 128))
    e8 = scale_k == 32
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e5", "c_ptr": "*bf16" if kind == "forward" else
             "*fp32", "sa_ptr": "*u8" if e8 else "*fp32", "sb_ptr": "*u8" if e8 else "*fp32",
             "offs_ptr": "*i32", "start_ptr": "*i32"}
    sig = {n: types.get(n, "i32") for n in names}
    consts = dict(cfg.kwargs, SCALE_K=scale_k, E8M0=e8, **consts)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = compile(ASTSource(kernel.fn, sig, consts, attrs), target=GPUTarget("cuda", cap, 32),
                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    out[f"grouped/{kind}/{cap}/{scale_k}"] = {
        "async_copies": ttgir.count("async_copy_global_to_local"),
        "wgmma": "warp_group_dot" in ttgir,
        "tcgen05": "tcgen05.mma" in ptx,
        "ftz": ".ftz" in ptx,
        "stages": cfg.num_stages,
    }
json.dump(out, sys.stdout)
"""


@compiles_for_gpu(_BLOCKS_SCRIPT)
def test_block_scaled_gemm_compiles_for_hopper_and_blackwell(
    compile_report: dict[str, Any],
) -> None:
    report = compile_report
    assert len(report) == 12, sorted(report)
    for name, facts in report.items():
        cap = name.split("/")[2 if name.startswith("grouped/") else 1]
        # fp8 MMA on the tensor cores of each generation; no flush-to-zero (subnormal steps).
        assert facts["wgmma"] == (cap == "90"), (name, facts)
        assert facts["tcgen05"] == (cap == "100"), (name, facts)
        assert not facts["ftz"], (name, facts)
        if not name.startswith("grouped/wgrad/"):
            # Both K-major operands staged asynchronously, one copy per stage each. (The
            # wgrad's tiles start at a group's first row, any row: its loads along M are not
            # known to be aligned, so they are not asynchronous copies.)
            assert facts["async_copies"] >= 2 * (facts["stages"] - 1), (name, facts)
