"""The Triton grouped GEMMs against a per-group loop over the dense twins.

Forward/dgrad (``computectx.kernels.grouped_mm``): group ``g``'s rows are the dense
``block_scaled_mm`` (reference backend) of those rows with expert ``g`` (the per-tensor twin
``numerics.tensorwise.scaled_mm`` for ``tensor``), rows past ``offs[-1]`` zero. Wgrad
(``computectx.kernels.grouped_wgrad``): expert ``g``'s ``[N, K]`` is the dense GEMM of the
group's columns of ``dY.T`` and ``X.T`` with the group's own scale columns, zero for a group
without rows. The standards are the dense kernel's (tests/kernels/test_scaled_mm_blocks.py):
bit for bit when every partial sum is exact (small-integer codes, power-of-two steps), else
within the dense twin's a-priori bound (``numerics.blockwise.scaled_mm_error_bound``, the
narrow-accumulator one on a GPU). The groups include an empty one and sizes that are not
multiples of 16, 32 or 128, with rows past the last group.
"""

from __future__ import annotations

from typing import Literal, cast

import pytest
import torch

from computectx.formats.backend import Backend
from computectx.formats.numerics import blockwise, tensorwise
from computectx.formats.numerics.layouts import BlockGranularity, Granularity, block_width
from computectx.formats.ops.blockwise import block_scaled_mm
from computectx.kernels import grouped_mm, grouped_wgrad

pytestmark = pytest.mark.interpreter

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
F32, BF16 = torch.float32, torch.bfloat16
WgradGranularity = Literal["tensor", "row", "1x128", "mx"]

# Forward: 45 rows in groups of 7, 0, 23 and 10 rows (5 rows past the last; 16-row tiles
# under the interpreter), N 20, K 40 (a partial 128-wide block, a whole MX block and a
# partial one).
FWD_SIZES, FWD_M, FWD_N, FWD_K = (7, 0, 23, 10), 45, 20, 40
# Wgrad: groups of 5, 0, 40 and 140 rows of M = 190 (two 128-wide blocks, the second
# partial, each in 64-row steps; an MX group shorter than one block), N 40 (two 32-row
# tiles), K 24.
WG_SIZES, WG_M, WG_N, WG_K = (5, 0, 40, 140), 190, 40, 24

# Every pair and granularity with exact sums (the sharp test); random data for a few, one
# per bound (the per-tensor/row one and the block one), the interpreter being slow.
FWD_CASES: list[tuple[Granularity, Granularity, torch.dtype, bool, bool]] = [
    # (granularity_a, granularity_b, out dtype, b a transposed view as dgrad hands in, exact)
    ("row", "row", BF16, False, True),
    ("1x128", "1x128", F32, True, True),
    ("1x128", "128x128", BF16, False, True),
    ("mx", "mx", F32, True, True),
    ("tensor", "tensor", BF16, True, True),
    ("1x128", "128x128", F32, True, False),
    ("tensor", "tensor", BF16, False, False),
]
WG_CASES: list[tuple[WgradGranularity, bool]] = [
    ("row", True),
    ("1x128", True),
    ("mx", True),
    ("tensor", True),
    ("mx", False),
    ("row", False),
]


def offsets(sizes: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def codes(
    shape: tuple[int, ...], fp8: torch.dtype, exact: bool, gen: torch.Generator
) -> torch.Tensor:
    # Small integers (every partial sum exact in float32), or Gaussian codes spread over
    # 2**+-3 (rounded to fp8 by torch).
    if exact:
        return torch.randint(-8, 9, shape, generator=gen).float().to(fp8)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-3, 4, shape, generator=gen))
    return x.to(fp8)


def steps(
    shape: tuple[int, ...], gran: Granularity, exact: bool, gen: torch.Generator
) -> torch.Tensor:
    # Powers of two (times 3 for row and tensor steps: their product is still exact), or
    # arbitrary float32 steps; E8M0 bytes 2**-6 .. 2**6 for MX (always exact).
    e = torch.randint(-6, 7, shape, generator=gen)
    if gran == "mx":
        return (e + 127).to(torch.uint8).view(E8M0)
    if not exact:
        return torch.exp2(e.float()) * (1 + torch.rand(shape, generator=gen))
    return torch.exp2(e.float()) * (3 if gran in ("row", "tensor") else 1)


def deq(t: torch.Tensor, s: torch.Tensor, gran: Granularity) -> torch.Tensor:
    # float64 values of one operand of a dense GEMM (K its last dimension).
    t64 = t.double()
    if gran == "tensor":
        return t64 * s.double()
    rows, k = t.shape
    st = blockwise.row_steps(s, gran, rows).double()
    return t64 * st.repeat_interleave(block_width(gran, k), dim=1)[:, :k]


def check_group(
    what: str,
    out: torch.Tensor,
    a: torch.Tensor,
    sa: torch.Tensor,
    ga: Granularity,
    b: torch.Tensor,
    sb: torch.Tensor,
    gb: Granularity,
    exact: bool,
    narrow: bool,
) -> None:
    """``out`` (the kernel's result for one group, on the CPU) is its dense twin's bits
    (``exact``: every partial sum exact), else within the twin's bound of the float64 value
    (the bound for the tensor cores' narrower accumulation when ``narrow``)."""
    bg = cast(BlockGranularity, gb)  # where ga is a block granularity, gb is one too
    if exact:
        if ga == "tensor":
            twin = tensorwise.scaled_mm(tensorwise.GemmArgs(a, b, sa, sb, None, out.dtype))
        elif ga == "mx" and a.shape[1] < 32:
            # block_scaled_mm's checks refuse an MX contraction shorter than one block
            # (dense layers never have one; a wgrad group may): the twin it runs, unchecked.
            twin = blockwise.reference_scaled_mm(
                blockwise.BlockGemmArgs(a, b, sa, ga, sb, bg, None, out.dtype)
            )
        else:
            ref = Backend.REFERENCE
            twin = block_scaled_mm(a, b, sa, ga, sb, bg, None, out.dtype, backend=ref)
        assert torch.equal(out, twin), f"{what}: {(out.float() - twin.float()).abs().max()}"
        return
    acc = blockwise.NARROW_ACCUMULATION if narrow else None
    if ga == "tensor":
        bound = tensorwise.scaled_mm_error_bound(
            tensorwise.GemmArgs(a, b, sa, sb, None, out.dtype), accumulation=acc
        )
    else:
        bound = blockwise.scaled_mm_error_bound(
            blockwise.BlockGemmArgs(a, b, sa, ga, sb, bg, None, out.dtype), accumulation=acc
        )
    err = (out.double() - deq(a, sa, ga) @ deq(b, sb, gb).t()).abs()
    assert bool((err <= bound).all()), f"{what}: worst excess {(err - bound).max()}"


@pytest.mark.parametrize(
    ("ga", "gb", "out_dtype", "b_view", "exact"),
    FWD_CASES,
    ids=[f"{c[0]}-{c[1]}-{'exact' if c[4] else 'random'}" for c in FWD_CASES],
)
def test_forward_is_the_dense_twin_per_group(
    ga: Granularity,
    gb: Granularity,
    out_dtype: torch.dtype,
    b_view: bool,
    exact: bool,
    device: torch.device,
) -> None:
    gen = torch.Generator().manual_seed(len(ga) + 7 * int(exact))
    m, n, k, e = FWD_M, FWD_N, FWD_K, len(FWD_SIZES)
    offs = offsets(FWD_SIZES)
    fb = E4M3 if exact or ga in ("1x128",) else E5M2
    a = codes((m, k), E4M3, exact, gen)
    a = a.t().contiguous().t() if b_view else a  # column-major a alongside the b view
    b = (
        codes((e, k, n), fb, exact, gen).transpose(1, 2)
        if b_view
        else codes((e, n, k), fb, exact, gen)
    )
    nkb = 1 if ga in ("row", "tensor") else -(-k // block_width(cast(BlockGranularity, ga), k))
    sa = steps((e,) if ga == "tensor" else (m, nkb), ga, exact, gen)
    sb_rows = -(-n // 128) if gb == "128x128" else n
    sb = steps((e,) if gb == "tensor" else (e, sb_rows, nkb), gb, exact, gen)

    got = grouped_mm.grouped_scaled_mm(
        a=a.to(device), sa=sa.to(device), b=b.to(device), sb=sb.to(device),
        offs=offs.to(device), granularity_a=ga, granularity_b=gb, out_dtype=out_dtype,
    ).cpu()  # fmt: skip

    assert got.shape == (m, n) and got.dtype == out_dtype
    narrow = device.type == "cuda"
    for g, (end, size) in enumerate(zip(offs.tolist(), FWD_SIZES, strict=True)):
        rows = slice(end - size, end)
        sa_g = sa[g : g + 1] if ga == "tensor" else sa[rows]
        sb_g = sb[g : g + 1] if gb == "tensor" else sb[g]
        check_group(f"group {g}", got[rows], a[rows], sa_g, ga, b[g], sb_g, gb, exact, narrow)
    assert not got[offs[-1] :].any(), "rows past offs[-1] are zero"


def wgrad_scales(
    gran: WgradGranularity, sizes: tuple[int, ...], exact: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # sa (N, C), sb (K, C) and block_start (the exclusive cumsum of each group's blocks,
    # formed with torch ops as the integrator does on the device).
    e = len(sizes)
    if gran == "tensor":
        return (
            steps((e,), gran, exact, gen),
            steps((e,), gran, exact, gen),
            torch.zeros(e, dtype=torch.int32),
        )
    width = 2**30 if gran == "row" else block_width(gran, 1)
    size = torch.tensor(sizes)
    blocks = torch.ones(e, dtype=torch.int64) if gran == "row" else (size + width - 1) // width
    start = (blocks.cumsum(0) - blocks).to(torch.int32)
    c = int(blocks.sum())
    return steps((WG_N, c), gran, exact, gen), steps((WG_K, c), gran, exact, gen), start


@pytest.mark.parametrize(
    ("gran", "exact"), WG_CASES, ids=[f"{g}-{'exact' if x else 'random'}" for g, x in WG_CASES]
)
def test_wgrad_is_the_dense_twin_per_group(
    gran: WgradGranularity, exact: bool, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(len(gran) + 11 * int(exact))
    offs = offsets(WG_SIZES)
    dy = codes((WG_M, WG_N), E5M2 if not exact and gran != "1x128" else E4M3, exact, gen)
    x = codes((WG_M, WG_K), E4M3, exact, gen)
    # dY.T and X.T as the backward hands them in (.t() views), or M-major copies.
    a, b = (dy.t(), x.t()) if exact else (dy.t().contiguous(), x.t().contiguous())
    sa, sb, block_start = wgrad_scales(gran, WG_SIZES, exact, gen)

    got = grouped_wgrad.grouped_scaled_wgrad(
        a=a.to(device), sa=sa.to(device), b=b.to(device), sb=sb.to(device),
        offs=offs.to(device), block_start=block_start.to(device), granularity=gran,
    ).cpu()  # fmt: skip

    assert got.shape == (len(WG_SIZES), WG_N, WG_K) and got.dtype == F32
    narrow = device.type == "cuda"
    for g, (end, size) in enumerate(zip(offs.tolist(), WG_SIZES, strict=True)):
        if size == 0:
            assert not got[g].any(), "a group without rows gives zeros"
            continue
        rows = slice(end - size, end)
        if gran == "tensor":
            sa_g, sb_g = sa[g : g + 1], sb[g : g + 1]
        else:
            cols = slice(
                int(block_start[g]),
                int(block_start[g]) + (1 if gran == "row" else -(-size // block_width(gran, 1))),
            )
            sa_g, sb_g = sa[:, cols], sb[:, cols]
        check_group(
            f"expert {g}", got[g], a[:, rows], sa_g, gran, b[:, rows], sb_g, gran, exact, narrow
        )


def test_no_rows_no_groups_and_no_k(device: torch.device) -> None:
    z8 = torch.zeros(5, 64, device=device).to(E4M3)
    ones = torch.ones(5, 1, device=device)

    def fwd(m: int, k: int, e: int, offs: list[int]) -> torch.Tensor:
        return grouped_mm.grouped_scaled_mm(
            a=z8[:m, :k], sa=ones[:m], b=z8[:e, :k].reshape(e, 1, k).expand(e, 3, k),
            sb=torch.ones(e, 3, 1, device=device),
            offs=torch.tensor(offs, dtype=torch.int32, device=device),
            granularity_a="row", granularity_b="row", out_dtype=F32,
        )  # fmt: skip

    assert fwd(0, 64, 2, [0, 0]).shape == (0, 3)
    assert torch.equal(fwd(5, 64, 0, []).cpu(), torch.zeros(5, 3))  # no groups
    assert torch.equal(fwd(5, 0, 2, [2, 5]).cpu(), torch.zeros(5, 3))  # an empty sum
    # Launched: every row past offs[-1] (the tail's programs alone store).
    ones8 = torch.ones(5, 64, device=device).to(E4M3)
    got = grouped_mm.grouped_scaled_mm(
        a=ones8, sa=ones, b=ones8[:2].reshape(2, 1, 64).expand(2, 5, 64),
        sb=torch.ones(2, 5, 1, device=device),
        offs=torch.zeros(2, dtype=torch.int32, device=device),
        granularity_a="row", granularity_b="row", out_dtype=F32,
    )  # fmt: skip
    assert torch.equal(got.cpu(), torch.zeros(5, 5))

    def wgrad(m: int, offs: list[int], gran: WgradGranularity, cols: int) -> torch.Tensor:
        e = len(offs)
        scale = torch.ones(3, cols, device=device)
        return grouped_wgrad.grouped_scaled_wgrad(
            a=ones8[:3, :m], sa=scale, b=ones8[:3, :m], sb=scale,
            offs=torch.tensor(offs, dtype=torch.int32, device=device),
            block_start=torch.zeros(e, dtype=torch.int32, device=device), granularity=gran,
        )  # fmt: skip

    assert torch.equal(wgrad(0, [0, 0], "row", 2).cpu(), torch.zeros(2, 3, 3))
    assert torch.equal(wgrad(64, [0, 0], "1x128", 0).cpu(), torch.zeros(2, 3, 3))
    assert torch.equal(wgrad(64, [0, 0], "row", 2).cpu(), torch.zeros(2, 3, 3))  # launched
    assert wgrad(64, [], "row", 0).shape == (0, 3, 3)


def test_launchers_reject_bad_arguments(device: torch.device) -> None:
    a = torch.zeros(6, 64, device=device).to(E4M3)
    b = torch.zeros(2, 4, 64, device=device).to(E4M3)
    offs = torch.tensor([2, 6], dtype=torch.int32, device=device)
    sa, sb = torch.ones(6, 1, device=device), torch.ones(2, 4, 1, device=device)
    fwd = {
        "a": a, "sa": sa, "b": b, "sb": sb, "offs": offs,
        "granularity_a": "row", "granularity_b": "row", "out_dtype": F32,
    }  # fmt: skip
    bad: list[tuple[dict[str, object], str]] = [
        ({"granularity_b": "mx"}, "multiplies the pairs"),
        ({"offs": offs.long()}, r"offs must be an int32 tensor of shape \(2,\)"),
        ({"offs": offs[:1]}, r"offs must be an int32 tensor of shape \(2,\)"),
        ({"b": b[:, :, :32]}, "share K"),
        ({"a": a.float()}, "fp8"),
        ({"sa": sa[:5]}, r"sa must be a torch.float32 tensor of shape \(6, 1\)"),
        ({"sb": sb[:, :, :1].expand(2, 4, 2)}, r"sb must be .* \(2, 4, 1\)"),
        ({"granularity_a": "mx", "granularity_b": "mx"}, "sa must be a torch.float8_e8m0fnu"),
        ({"out_dtype": torch.int32}, "out_dtype"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            grouped_mm.grouped_scaled_mm(**{**fwd, **change})  # type: ignore[arg-type]
    at, bt = a.t(), a[:, :5].t()  # dY.T (64, 6) and X.T (5, 6)
    wg = {
        "a": at, "sa": torch.ones(64, 2, device=device), "b": bt,
        "sb": torch.ones(5, 2, device=device), "offs": offs, "block_start": offs * 0,
        "granularity": "row",
    }  # fmt: skip
    bad = [
        ({"granularity": "128x128"}, "takes granularity"),
        ({"block_start": offs[:1]}, r"block_start must be an int32 tensor of shape \(2,\)"),
        ({"offs": offs.reshape(1, 2)}, r"offs must be an int32 tensor of shape \(E,\)"),
        ({"b": a[:5].t()}, "share M"),
        ({"sb": torch.ones(5, 3, device=device)}, r"sb must be .* \(5, 2\)"),
        ({"granularity": "tensor"}, r"sa must be a torch.float32 tensor of shape \(2,\)"),
        ({"granularity": "mx"}, "sa must be a torch.float8_e8m0fnu"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            grouped_wgrad.grouped_scaled_wgrad(**{**wg, **change})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "flag", ["e4m3/row/dynamic/0", "e4m3/block+pow2/dynamic/0", "e4m3/mx/dynamic/0"]
)
def test_fp8_grouped_mm_on_triton_is_the_twin_through_autograd(flag: str) -> None:
    # End to end through the operators (quantize, group-local wgrad scales, kernels) with an
    # empty group first: small-integer operands and power-of-two steps make every code and
    # every partial sum exact, so the two backends must agree bit for bit. K = N = 32: one
    # whole MX block in the forward and the dgrad (a partial 128-wide block for block+pow2);
    # the wgrad's groups of 5, 40 and 19 rows span a partial MX block and two. Several K
    # blocks and tiles: the forward and wgrad tests above (K = 40, M = 190), not this one
    # (the interpreter quantizes each operand here, which is most of its time).
    from computectx.formats import Recipe, quantized_grouped_mm

    gen = torch.Generator().manual_seed(7)
    sizes = [0, 5, 40, 0, 19]
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    m, k, n = sum(sizes), 32, 32
    x = torch.randint(-8, 9, (m, k), generator=gen).float()
    w = torch.randint(-8, 9, (len(sizes), n, k), generator=gen).float()
    dy = torch.randint(-8, 9, (m, n), generator=gen).float()
    policy = Recipe.parse(flag)
    got: list[torch.Tensor] = []
    want: list[torch.Tensor] = []
    for backend, out in ((Backend.TRITON, got), (Backend.REFERENCE, want)):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_grouped_mm(xg, wg, offs, policy, backend=backend)
        y.backward(dy)  # type: ignore[no-untyped-call]
        assert xg.grad is not None and wg.grad is not None
        out += [y.detach(), xg.grad, wg.grad]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), flag


def test_mx_contraction_under_one_block_is_the_twin() -> None:
    # Under mx a contraction shorter than one block of 32 (K = 8 forward, N = 8 in the dgrad,
    # a group of 4 rows in the wgrad) is zero-padded to one block by the twin; the Triton path
    # pads it too (forward and dgrad used to refuse: "granularity 'mx' needs K >= 32").
    # Exact data: the same bits. One expert with rows (and an empty one): few launches.
    from computectx.formats import Recipe, quantized_grouped_mm

    gen = torch.Generator().manual_seed(3)
    offs = torch.tensor([0, 4], dtype=torch.int32)
    x = torch.randint(-8, 9, (4, 8), generator=gen).float()
    w = torch.randint(-8, 9, (2, 8, 8), generator=gen).float()
    dy = torch.randint(-8, 9, (4, 8), generator=gen).float()
    results = []
    for backend in (Backend.TRITON, Backend.REFERENCE):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = quantized_grouped_mm(xg, wg, offs, Recipe.parse("e4m3/mx/dynamic/0"), backend=backend)
        y.backward(dy)  # type: ignore[no-untyped-call]
        assert xg.grad is not None and wg.grad is not None
        results.append((y.detach(), xg.grad, wg.grad))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
