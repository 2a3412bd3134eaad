"""The 4-bit operator family (``formats.ops.fp4``): ``torch.library.opcheck`` on each operator,
the checked entry points equal to the twins bit for bit, the emulated backend named (never an
8-bit fallback), and one ``torch.compile(fullgraph=True)`` over the four operators: no graph
break and no recompile as the group sizes (``offs``' values) change. The compile uses
``backend="aot_eager"`` (dynamo and AOTAutograd, no code generation), as the fp8 grouped
compile tests do.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo.testing

from computectx.formats.numerics import fp4_gemm
from computectx.formats.numerics.e2m1 import WGRAD_SIGNS, Stochastic
from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Quant
from computectx.formats.ops import fp4 as fp4_ops

NV, MX = Fp4Quant(), Fp4Quant(format="mxfp4", hadamard=False)
E, K, N = 4, 64, 32
SIGNS = list(WGRAD_SIGNS)
RNG = torch.tensor([5, 1000], dtype=torch.int64)
# fp4/fp8 tensors crossing an operator: torch's schema check cannot copy them.
WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


@pytest.fixture
def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, K, generator=gen).bfloat16()
    w = torch.randn(E, N, K, generator=gen).bfloat16()
    dy = torch.randn(40, N, generator=gen).bfloat16()
    return x, w, dy


def test_opcheck(data: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    # Small operands (opcheck traces and runs each operator several times).
    x, w, dy = data[0][:24, :32], data[1][:3, :16, :32], data[2][:24, :16]
    ops = torch.ops.computectx
    offs = offsets([5, 0, 16])  # an empty group; rows 21-23 past the last
    em, bf16 = fp4_ops.EMULATED, torch.bfloat16
    quantize_cases = [
        (w[0], "nvfp4", "16x16", "rceil", False, False, SIGNS, RNG, em),
        (x[:23], "nvfp4", "1x16", "rceil", True, True, SIGNS, RNG, em),  # wgrad: 23 -> 32 rows
        (x, "mxfp4", "1x16", "floor", False, False, SIGNS, None, em),
        (x[:23], "mxfp4", "1x16", "rceil", True, True, SIGNS, None, em),  # 23 -> 32 rows
    ]
    for args in quantize_cases:
        torch.library.opcheck(ops.fp4_quantize, args)
    for how in (NV, MX):
        a = fp4_ops.quantize(x, how)
        b = fp4_ops.quantize(w[1], how, weight=True)
        amax_a = a.amax.reshape(1) if isinstance(a, Nvfp4Operand) else None
        amax_b = b.amax.reshape(1) if isinstance(b, Nvfp4Operand) else None
        tile_b = how.weight_tile
        mm = (a.codes, a.scale, amax_a, "1x16", b.codes, b.scale, amax_b, tile_b, None, bf16, em)
        torch.library.opcheck(ops.fp4_scaled_mm, mm, test_utils=WITHOUT_SCHEMA)
    how = NV
    g = (x, w, offs, how.format, how.weight_tile, how.mx_rounding, RNG, bf16, em)
    torch.library.opcheck(ops.fp4_grouped_mm, g)
    wg = (dy, x, offs, how.format, how.mx_rounding, how.hadamard, SIGNS, RNG, em)
    torch.library.opcheck(ops.fp4_grouped_wgrad, wg)
    for name in ("fp4_quantize", "fp4_scaled_mm", "fp4_grouped_mm", "fp4_grouped_wgrad"):
        schema = getattr(ops, name).default._schema
        assert not any(a.alias_info is not None for a in schema.arguments), name


def test_the_entry_points_are_the_twins(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    x, w, dy = data
    offs, bounds = offsets([5, 0, 25, 7]), [(0, 5), (5, 5), (5, 30), (30, 37)]
    key = Stochastic(2**64 - 1, 12)  # a seed above int64's range crosses the operator intact
    bias = torch.randn(N)
    for how in (NV, MX):
        a = fp4_ops.quantize(x, how, stochastic=key)
        b = fp4_ops.quantize(w[0], how, weight=True)
        ta = fp4_gemm.quantize_rows(x, how, stochastic=key)
        tb = fp4_gemm.quantize_rows(w[0], how, weight=True)
        assert torch.equal(a.codes.view(torch.uint8), ta.codes.view(torch.uint8))
        want = fp4_gemm.reference_fp4_mm(ta, tb, torch.float32, bias)
        assert torch.equal(fp4_ops.scaled_mm(a, b, torch.float32, bias), want)
        got = fp4_ops.grouped_mm(x, w, offs, how, stochastic=key)
        twin = fp4_gemm.reference_fp4_grouped_mm(x, w, bounds, how, torch.bfloat16, key)
        assert torch.equal(got, twin)
        got = fp4_ops.grouped_wgrad(dy, x, offs, how, stochastic=key)
        assert torch.equal(got, fp4_gemm.reference_fp4_grouped_wgrad(dy, x, bounds, how, key))
        col = fp4_ops.quantize(x[:23], how, columnwise=True)
        assert col.codes.shape == (K, 16)


def test_the_backend_is_the_named_emulation_and_nothing_else(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    x, _, _ = data
    backend, why = fp4_ops.select_fp4_backend("cpu")
    assert backend == "emulated" and "twin" in why and "never an 8-bit fallback" in why
    args = (x, "nvfp4", "1x16", "rceil", False, False, SIGNS, None, "cublas")
    with pytest.raises(ValueError, match="unknown 4-bit backend 'cublas'; accepted: emulated"):
        torch.ops.computectx.fp4_quantize(*args)


def test_bad_arguments_are_refused(data: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    x, w, dy = data
    with pytest.raises(ValueError, match="multiple of 32"):
        fp4_ops.quantize(x[:, :48], MX)
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        fp4_ops.quantize(w[0, :8], NV, weight=True)
    with pytest.raises(TypeError, match="Fp4Quant"):
        fp4_ops.quantize(x, "nvfp4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two NVFP4 or two MXFP4"):
        fp4_ops.scaled_mm(fp4_ops.quantize(x, NV), fp4_ops.quantize(x, MX), torch.float32)
    with pytest.raises(ValueError, match=r"offs\[2\] = 3 is below offs\[1\] = 8"):
        fp4_ops.grouped_mm(x, w, torch.tensor([4, 8, 3, 16], dtype=torch.int32), NV)
    with pytest.raises(ValueError, match="same M"):
        fp4_ops.grouped_wgrad(dy[:8], x, offsets([8]), NV)
    with pytest.raises(TypeError, match=r"1-D int32 .*, got 'torch.int64 \(2,\)'"):
        fp4_ops.grouped_wgrad(dy, x, torch.tensor([8, 40]), NV)  # named, never printed
    # A key on the meta device dispatched the operators to their fakes on real operands:
    # uninitialized memory came back as the result, silently.
    meta = torch.zeros(2, dtype=torch.int64, device="meta")
    on_meta = "key tensor lies on the CPU or on the operands' device .cpu., got one on meta"
    with pytest.raises(ValueError, match=on_meta):
        fp4_ops.grouped_mm(x, w, offsets([4, 4, 8, 16]), NV, stochastic=meta)
    with pytest.raises(ValueError, match=on_meta):
        fp4_ops.grouped_wgrad(dy, x, offsets([16]), NV, stochastic=meta)
    with pytest.raises(ValueError, match=on_meta):
        fp4_ops.quantize(x, NV, stochastic=meta)


# ----- torch.compile --------------------------------------------------------------------------


@pytest.fixture
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def step(
    x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, rng: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The three GEMMs of a grouped 4-bit layer and a dense one, straight on the operators.
    em, bf16 = fp4_ops.EMULATED, torch.bfloat16
    ops = torch.ops.computectx
    y = ops.fp4_grouped_mm(x, w, offs, "nvfp4", "16x16", "rceil", None, bf16, em)
    dx = ops.fp4_grouped_mm(dy, w.transpose(1, 2), offs, "nvfp4", "16x16", "rceil", rng, bf16, em)
    dw = ops.fp4_grouped_wgrad(dy, x, offs, "nvfp4", "rceil", True, SIGNS, rng, em)
    ca, sa, aa = ops.fp4_quantize(x, "nvfp4", "1x16", "rceil", False, False, SIGNS, None, em)
    cb, sb, ab = ops.fp4_quantize(w[0], "nvfp4", "16x16", "rceil", False, False, SIGNS, None, em)
    dense = ops.fp4_scaled_mm(ca, sa, aa, "1x16", cb, sb, ab, "16x16", None, bf16, em)
    return y + dense, dx * 2, dw


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiles_whole_and_does_not_recompile_as_the_groups_or_the_counter_change(
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    x, w, dy = data[0][:24, :32], data[1][:, :16, :32], data[2][:24, :16]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)  # a break would raise
    for i, sizes in enumerate(([9, 0, 8, 7], [24, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 18])):
        offs, rng = offsets(sizes), torch.tensor([5, 4096 * i], dtype=torch.int64)
        for got, want in zip(compiled(x, w, dy, offs, rng), step(x, w, dy, offs, rng), strict=True):
            assert torch.equal(got, want), sizes
    assert counter.frame_count == 1, counter.frame_count
