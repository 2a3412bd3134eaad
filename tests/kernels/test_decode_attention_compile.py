"""The decode-attention kernels compile for sm_90 and sm_100 without a GPU.

As test_compile_for_gpu.py does for the older kernels: a child process (without
``TRITON_INTERPRET``) builds the decode kernel ahead of time with the ``ptxas`` Triton ships
(an fp8 cache with per-token steps, one with a per-head step split across programs, a bf16
cache) and the split-K merge kernel, for Hopper and Blackwell, at the serving shape D = 128
and block_t = 64, with the alignment hints Triton's JIT derives for aligned tensors. It
checks what the kernel's speed and its bound rest on: 16-byte vector loads of the cache
rows, the hardware widening of E4M3 codes, no register spills (``ptxas -v``), no
flush-to-zero arithmetic (subnormal steps and weights must round as in the twin), and the
exponential the bound allows for (``ex2.approx.f32``, within 8 ulp).
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import compiles_for_gpu

pytestmark = pytest.mark.slow

_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, compile
from computectx.kernels import decode_attention as kd

names = ["q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "len_ptr", "out_ptr", "part_ptr", "H",
         "T_max", "D", "sm_scale", "split_len", "stride_qb", "stride_qh", "stride_kb",
         "stride_kh", "stride_kt", "stride_vb", "stride_vh", "stride_vt", "stride_ksb",
         "stride_ksh", "stride_kst", "stride_vsb", "stride_vsh", "stride_vst", "stride_ob",
         "stride_oh"]
aligned = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_ptr", "stride_qb", "stride_qh",
           "stride_kb", "stride_kh", "stride_kt", "stride_vb", "stride_vh", "stride_vt")
m_names = ["part_ptr", "out_ptr", "H", "D", "S", "stride_ob", "stride_oh"]


def facts(kernel, sig, consts, attrs, cap):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    k = compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", cap, 32),
                options={"num_warps": kd._NUM_WARPS})
    ptx = k.asm["ptx"]
    # Triton's own ptxas, verbose, for the register and spill report of this PTX.
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(cap).path, f"-arch=sm_{cap}a", "-v", src, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True,
                             check=True).stderr
    return {
        "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)),
        "registers": [int(n) for n in re.findall(r"Used (\d+) registers", log)],
        "v4": ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4"),
        "ftz": ".ftz" in ptx,
        "e4m3_cvt": "e4m3x2" in ptx,
        "ex2": sorted({w for w in ptx.split() if w.startswith("ex2.")}),
    }


out = {}
for cap in (90, 100):
    for kv, per_token, split in (("*fp8e4nv", True, False), ("*fp8e5", False, True),
                                 ("*bf16", False, False)):
        types = ["*bf16", kv, kv, "*fp32", "*fp32", "*i64", "*bf16", "*fp32", "i32", "i32",
                 "i32", "fp32", "i32"] + ["i32"] * 16
        consts = dict(HAS_STEP=kv != "*bf16", K_PER_TOKEN=per_token, V_PER_TOKEN=per_token,
                      SPLIT=split, OUT_BF16=True, BLOCK_T=64, BLOCK_D=128, D=128,
                      stride_kst=1, stride_vst=1)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        out[f"decode/{cap}/{kv}/per_token={per_token}/split={split}"] = facts(
            kd._decode_kernel, dict(zip(names, types)), consts, attrs, cap)
    types = ["*fp32", "*bf16", "i32", "i32", "i32", "i32", "i32"]
    consts = dict(OUT_BF16=True, BLOCK_S=4, BLOCK_D=128, D=128)
    out[f"merge/{cap}"] = facts(kd._merge_kernel, dict(zip(m_names, types)), consts, {}, cap)
json.dump(out, sys.stdout)
"""


@compiles_for_gpu(_SCRIPT)
def test_decode_kernels_compile_for_hopper_and_blackwell(compile_report: dict[str, Any]) -> None:
    report = compile_report
    assert len(report) == 2 * (3 + 1), sorted(report)
    for name, facts in report.items():
        assert not facts["ftz"], (name, facts)
        assert facts["registers"] and facts["spill_bytes"] == 0, (name, facts)
        # The only exponential is the non-flushing approximate one the bound allows for.
        assert facts["ex2"] == ["ex2.approx.f32"], (name, facts)
        if name.startswith("decode/"):
            # Each row of 128 fp8 codes (or 64 bf16 values) is read 16 bytes at a time.
            assert facts["v4"] > 0, (name, facts)
            assert facts["e4m3_cvt"] == ("fp8e4nv" in name), (name, facts)
