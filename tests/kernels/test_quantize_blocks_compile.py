"""The block quantize kernels compile for sm_89, sm_90 and sm_100 without a GPU, with vector
loads.

As test_compile_for_gpu.py does for the older kernels: a child process (without
``TRITON_INTERPRET``) builds each kernel ahead of time with the ``ptxas`` Triton ships, for
row-major and transposed (column-wise) reads, every step rule, measured and given scales.
It checks 16-byte vector loads where K is contiguous, and no flush-to-zero arithmetic
(subnormal inputs and steps must round as they do in the twins).

sm_89 builds only the 128x128-block variants: for every other variant (and the row kernel)
Triton 3.9 emits the same PTX for sm_89 as for sm_90, line for line but the ``.target`` and
``.version`` lines, so the facts read from it are the same facts; the 128x128 variants are
where the two targets' code differs.
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
from computectx.kernels import quantize_blocks as kb
from computectx.kernels.quantize_cast import fp8_constants

out = {}
fmt = {"FMT": fp8_constants(torch.float8_e4m3fn)}


def build(kernel, names, types, consts, warps, aligned):
    sig = dict(zip(names, types))
    sig.update({k: "constexpr" for k in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = compile(ASTSource(kernel, sig, dict(consts), attrs), target=GPUTarget("cuda", cap, 32),
                options={"num_warps": warps})
    ptx = k.asm["ptx"]
    return {"v4": ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4"), "ftz": ".ftz" in ptx}


names = ["x_ptr", "q_ptr", "scale_ptr", "R", "C", "stride_r", "stride_c", "n_scale_cols"]
rnames = ["x_ptr", "q_ptr", "step_ptr", "R", "C", "stride_r", "stride_c"]
for cap in (89, 90, 100):
    for xdt, rule, block, given, colwise in (
        ("*i16", 0, (1, 128), False, False), ("*fp32", 3, (1, 32), False, False),
        ("*fp16", 1, (128, 128), False, False), ("*i16", 2, (1, 32), True, False),
        ("*fp32", 0, (1, 128), True, False), ("*i16", 0, (1, 128), False, True),
        ("*fp32", 3, (1, 32), False, True), ("*i16", 0, (128, 128), False, True),
    ):
        if cap == 89 and block != (128, 128):
            continue  # sm_90's PTX, but the target line: checked once, at sm_90
        mx = rule >= 2
        tile_r, groups, warps = kb._TILES[block]
        consts = dict(fmt, X_BF16=xdt == "*i16", RULE=rule, GIVEN=given, MX_SCALE=mx,
                      BLOCK_ROWS=block[0], BLOCK_C=block[1], GROUPS=groups, TILE_R=tile_r)
        consts["stride_r" if colwise else "stride_c"] = 1
        types = [xdt, "*u8", "*u8" if mx else "*fp32", "i32", "i32", "i32", "i32", "i32"]
        aligned = ("x_ptr", "q_ptr", "C", "stride_c" if colwise else "stride_r")
        key = f"blocks/{cap}/{xdt}/{rule}/{block}/given={given}/columnwise={colwise}"
        out[key] = build(kb._quantize_blocks_kernel, names, types, consts, warps, aligned)
    for xdt, given in () if cap == 89 else (("*i16", False), ("*fp32", True)):
        tile_r, chunk, warps = kb._ROW_TILE
        consts = dict(fmt, X_BF16=xdt == "*i16", RULE=1, GIVEN=given, TILE_R=tile_r,
                      CHUNK=chunk, stride_c=1)
        types = [xdt, "*u8", "*fp32", "i32", "i32", "i32", "i32"]
        out[f"rows/{cap}/{xdt}/given={given}/columnwise=False"] = build(
            kb._quantize_rows_kernel, rnames, types, consts, warps,
            ("x_ptr", "q_ptr", "C", "stride_r"))
json.dump(out, sys.stdout)
"""


@compiles_for_gpu(_SCRIPT)
def test_block_kernels_compile_for_ada_hopper_and_blackwell(compile_report: dict[str, Any]) -> None:
    report = compile_report
    assert len(report) == 2 + 2 * (8 + 2), sorted(report)
    assert {name.split("/")[1] for name in report} == {"89", "90", "100"}
    for name, facts in report.items():
        assert not facts["ftz"], (name, facts)
        if name.endswith("columnwise=False"):
            assert facts["v4"] > 0, (name, facts)
