"""The Triton 4-bit grouped GEMMs (``computectx.kernels.fp4_grouped``): each group is the dense
twin ``numerics.fp4_gemm.reference_fp4_mm`` on its own operands, bit for bit on exact data
(empty groups, a first group with no rows, rows past the last group, an empty group's NaN
amax). Their composition with the quantize, against the grouped twins, is
test_fp4_gemm_grouped_values.py. Interpreted on the CPU, compiled on sm_100+ (as
test_fp4_gemm.py).
"""

from __future__ import annotations

import pytest
import torch

from computectx.formats.numerics import fp4_gemm as twin
from computectx.formats.numerics.fp4 import Mxfp4Operand, Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Operand

from .test_fp4_gemm import (
    DEVICE,
    assert_same,
    exact_operand,
    fp4_kernel_module,
    needs_fp4,
)

pytestmark = [pytest.mark.interpreter, needs_fp4]

kg = fp4_kernel_module("computectx.kernels.fp4_grouped")


def empty_operand(rows: int, k: int, nvfp4: bool) -> Fp4Operand:
    """An operand with no elements along one side (an empty group's); its amax NaN: what an
    empty group's amax holds must not matter."""
    codes = torch.zeros(rows, k // 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    if nvfp4:
        scale = torch.zeros(rows, k // 16).to(torch.float8_e4m3fn)
        return Nvfp4Operand(codes, scale, torch.tensor(float("nan")), "1x16")
    scale8 = torch.zeros(rows, k // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return Mxfp4Operand(codes, scale8)


def joined(
    ops: list[Fp4Operand], dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The operands' codes and scales side by side along ``dim`` (0: rows, 1: columns), and
    their amaxes (E,) when NVFP4, on the test device."""
    codes = torch.cat([q.codes.view(torch.uint8) for q in ops], dim).view(torch.float4_e2m1fn_x2)
    dtype = ops[0].scale.dtype
    scale = torch.cat([q.scale.view(torch.uint8) for q in ops], dim).view(dtype)
    amax = None
    if isinstance(ops[0], Nvfp4Operand):
        amax = torch.stack([q.amax.reshape(()) for q in ops if isinstance(q, Nvfp4Operand)]).to(
            DEVICE
        )
    return codes.to(DEVICE), scale.to(DEVICE), amax


def expert_stack(ops: list[Fp4Operand]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    codes = torch.stack([q.codes for q in ops]).to(DEVICE)
    scale = torch.stack([q.scale for q in ops]).to(DEVICE)
    amax = None
    if isinstance(ops[0], Nvfp4Operand):
        amax = torch.stack([q.amax.reshape(()) for q in ops if isinstance(q, Nvfp4Operand)]).to(
            DEVICE
        )
    return codes, scale, amax


def ends(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEVICE)


def forward(
    qa: list[Fp4Operand], qb: list[Fp4Operand], tail: int, out_dtype: torch.dtype
) -> torch.Tensor:
    k = qb[0].codes.shape[1] * 2
    tail_op = empty_operand(tail, k, isinstance(qa[0], Nvfp4Operand)) if tail else None
    a, sa, ma = joined([*qa, *([tail_op] if tail_op is not None else [])], 0)
    if ma is not None and tail_op is not None:
        ma = ma[:-1]  # the tail's rows belong to no group
    b, sb, mb = expert_stack(qb)
    tile = qb[0].tile if isinstance(qb[0], Nvfp4Operand) else "1x32"
    sizes = [q.codes.shape[0] for q in qa]
    out: torch.Tensor = kg.fp4_grouped_scaled_mm(
        a=a, scale_a=sa, amax_a=ma, b=b, scale_b=sb, amax_b=mb, tile_b=tile, offs=ends(sizes),
        out_dtype=out_dtype,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("tile_a", "tile_b", "sizes", "tail", "out_dtype"),
    [
        ("1x16", "16x16", [0, 21, 3, 17], 5, torch.bfloat16),
        ("1x16", "1x16", [9, 20, 0], 4, torch.float32),  # the tail after an empty group
        ("1x32", "1x32", [18, 0, 7, 16], 3, torch.float16),
    ],
)
def test_grouped_mm_is_each_groups_dense_twin_on_exact_data(
    tile_a: str, tile_b: str, sizes: list[int], tail: int, out_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(sum(sizes))
    n, k, nv = 32, 96 if tile_a == "1x16" else 64, tile_a == "1x16"
    qa = [exact_operand(s, k, tile_a, gen) if s else empty_operand(0, k, nv) for s in sizes]
    qb = [exact_operand(n, k, tile_b, gen) for _ in sizes]
    out = forward(qa, qb, tail, out_dtype)
    assert out.shape == (sum(sizes) + tail, n) and out.dtype == out_dtype
    start = 0
    for a_g, b_g, size in zip(qa, qb, sizes, strict=True):
        if size:
            assert_same(out[start : start + size], twin.reference_fp4_mm(a_g, b_g, out_dtype))
        start += size
    assert not bool(out[start:].cpu().float().any()), "rows past the last group are zero"


def wgrad(qd: list[Fp4Operand], qx: list[Fp4Operand]) -> torch.Tensor:
    a, sa, ma = joined(qd, 1)
    b, sb, mb = joined(qx, 1)
    tile = "1x16" if isinstance(qd[0], Nvfp4Operand) else "1x32"
    cols = [q.codes.shape[1] * 2 for q in qd]
    out: torch.Tensor = kg.fp4_grouped_scaled_wgrad(
        a=a, scale_a=sa, amax_a=ma, b=b, scale_b=sb, amax_b=mb, tile=tile, offs=ends(cols)
    )
    return out


@pytest.mark.parametrize(("tile", "cols"), [("1x16", [16, 0, 48, 32]), ("1x32", [0, 64, 32])])
def test_grouped_wgrad_is_each_groups_dense_twin_on_exact_data(tile: str, cols: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(cols))
    n, k, nv = 20, 35, tile == "1x16"
    qd = [exact_operand(n, c, tile, gen) if c else empty_operand(n, 0, nv) for c in cols]
    qx = [exact_operand(k, c, tile, gen) if c else empty_operand(k, 0, nv) for c in cols]
    out = wgrad(qd, qx)
    assert out.shape == (len(cols), n, k) and out.dtype == torch.float32
    for g, (d_g, x_g) in enumerate(zip(qd, qx, strict=True)):
        ref = twin.reference_fp4_mm(d_g, x_g, torch.float32) if cols[g] else torch.zeros(n, k)
        assert_same(out[g], ref)


def test_bad_grouped_arguments_are_refused_by_name() -> None:
    gen = torch.Generator().manual_seed(4)
    qa, qb = exact_operand(8, 32, "1x16", gen), exact_operand(16, 32, "16x16", gen)
    assert isinstance(qa, Nvfp4Operand) and isinstance(qb, Nvfp4Operand)
    base = dict(
        a=qa.codes, scale_a=qa.scale, amax_a=qa.amax.reshape(1), b=qb.codes.unsqueeze(0),
        scale_b=qb.scale.unsqueeze(0), amax_b=qb.amax.reshape(1), tile_b="16x16",
        offs=torch.tensor([8], dtype=torch.int32), out_dtype=torch.bfloat16,
    )  # fmt: skip
    for change, match in (
        ({"b": qb.codes}, "3-D"),
        ({"scale_b": qb.scale}, r"\(1, 1, 2\)"),
        ({"amax_b": torch.ones(2)}, "1 element"),
        ({"offs": torch.tensor([8])}, "int32"),
        ({"tile_b": "1x32"}, "float8_e8m0fnu"),
    ):
        with pytest.raises(ValueError, match=match):
            kg.fp4_grouped_scaled_mm(**{**base, **change})
    with pytest.raises(ValueError, match="tile must be"):
        kg.fp4_grouped_scaled_wgrad(
            a=qa.codes, scale_a=qa.scale, amax_a=None, b=qa.codes, scale_b=qa.scale,
            amax_b=None, tile="16x16", offs=torch.tensor([32], dtype=torch.int32),
        )  # fmt: skip
