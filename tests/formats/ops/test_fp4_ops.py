"""The 4-bit operator family (``formats.ops.fp4``): ``torch.library.opcheck`` on each operator,
the checked entry points equal to the twins bit for bit (serving's per-row quantize and
dequantize too, each one node of a traced graph), the emulated backend named (never an
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
from torch.fx.experimental.proxy_tensor import make_fx

from computectx.formats.numerics import fp4_gemm
from computectx.formats.numerics.e2m1 import WGRAD_SIGNS, Stochastic
from computectx.formats.numerics.fp4 import (
    Mxfp4Operand,
    Nvfp4Operand,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)
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
    with pytest.raises(ValueError, match="backend 'cublas' cannot run on cpu: cpu is not a GPU"):
        torch.ops.computectx.fp4_quantize(*args)
    with pytest.raises(ValueError, match="unknown 4-bit backend 'fp8'; accepted: emulated"):
        torch.ops.computectx.fp4_quantize(*args[:-1], "fp8")


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


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def serving_rows() -> torch.Tensor:
    # Rows of very different magnitudes (each row's own S_enc matters), a zero row, a row with
    # an inf (no NaN: opcheck compares outputs with equality).
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, K, generator=gen) * torch.tensor([1e-6, 1.0, 300.0, 0.0, 5.0, 1e4])[:, None]
    x[4, 7] = float("inf")
    return x.bfloat16()


def tiled() -> Nvfp4Operand:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(4)).bfloat16()
    return quantize_nvfp4(w, tile="16x16")


def operands() -> list[Nvfp4Operand | Mxfp4Operand]:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(4)).bfloat16()
    return [quantize_nvfp4(w), tiled(), quantize_mxfp4(w)]


def dequantize_args(q: Nvfp4Operand | Mxfp4Operand, dtype: torch.dtype) -> tuple[object, ...]:
    if isinstance(q, Nvfp4Operand):
        return (q.codes, q.scale, q.amax.reshape(1), q.tile, dtype, fp4_ops.EMULATED)
    return (q.codes, q.scale, None, "1x32", dtype, fp4_ops.EMULATED)


def test_the_serving_operators_pass_opcheck() -> None:
    ops = torch.ops.computectx
    torch.library.opcheck(ops.fp4_quantize_rows, (serving_rows(), fp4_ops.EMULATED))
    for q in operands():
        args = dequantize_args(q, torch.bfloat16)
        torch.library.opcheck(ops.fp4_dequantize, args, test_utils=WITHOUT_SCHEMA)
    for name in ("fp4_quantize_rows", "fp4_dequantize"):
        schema = getattr(ops, name).default._schema
        assert not any(a.alias_info is not None for a in schema.arguments), name


def test_quantize_rows_is_quantize_nvfp4_of_each_row_alone() -> None:
    x = serving_rows()
    x[1, 2] = float("nan")  # a NaN block: NaN scale, codes 0x7, the row's amax finite
    codes, scale, amax = fp4_ops.quantize_rows(x)
    assert amax.dtype == torch.float32 and amax.shape == (6,)
    for i in range(x.shape[0]):
        row = quantize_nvfp4(x[i : i + 1])
        assert torch.equal(u8(codes[i : i + 1]), u8(row.codes)), i
        assert torch.equal(u8(scale[i : i + 1]), u8(row.scale)), i
        assert torch.equal(amax[i], row.amax), i


def test_dequantize_is_the_twin_at_every_dtype() -> None:
    for q in operands():
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            if isinstance(q, Nvfp4Operand):
                want = dequantize_nvfp4(q, dtype)
            else:
                want = dequantize_mxfp4(q, dtype)
            got = fp4_ops.dequantize(q, dtype)
            assert got.dtype == dtype and torch.equal(u8(got), u8(want)), (q.scale.dtype, dtype)


def test_the_serving_operators_run_their_twin_on_either_backend() -> None:
    # No Triton kernel quantizes per row or dequantizes: the backend name is checked, the twin
    # runs (on the CPU here: the same function on any device).
    ops, x, q = torch.ops.computectx, serving_rows(), tiled()
    for got, want in zip(
        ops.fp4_quantize_rows(x, fp4_ops.TRITON), fp4_ops.quantize_rows(x), strict=True
    ):
        assert torch.equal(u8(got), u8(want))
    args = dequantize_args(q, torch.float32)
    assert torch.equal(ops.fp4_dequantize(*args[:-1], fp4_ops.TRITON), dequantize_nvfp4(q))
    with pytest.raises(ValueError, match="unknown 4-bit backend 'fp8'"):
        ops.fp4_quantize_rows(x, "fp8")
    with pytest.raises(ValueError, match="unknown 4-bit backend 'fp8'"):
        ops.fp4_dequantize(*args[:-1], "fp8")


def test_the_serving_entry_points_refuse_bad_arguments() -> None:
    x, q = serving_rows(), tiled()
    with pytest.raises(ValueError, match=r"multiple of 16, got shape \(6, 40\)"):
        fp4_ops.quantize_rows(x[:, :40])
    with pytest.raises(ValueError, match="2-D tensor"):
        fp4_ops.quantize_rows(x.reshape(2, 3, K))
    with pytest.raises(TypeError, match="Nvfp4Operand or Mxfp4Operand, got 'codes'"):
        fp4_ops.dequantize("codes", torch.float32)  # type: ignore[arg-type]
    flat = Nvfp4Operand(q.codes.reshape(-1), q.scale, q.amax, q.tile)
    with pytest.raises(ValueError, match="2-D operand"):
        fp4_ops.dequantize(flat, torch.float32)
    with pytest.raises(ValueError, match="out_dtype must be bf16, fp16, fp32 or fp64"):
        fp4_ops.dequantize(q, torch.int32)


def test_each_serving_operator_is_one_node_of_a_traced_graph() -> None:
    # Traced as plain ops, the codes' packing (bitwise ops, a view to float4_e2m1fn_x2) sat in
    # the graph, and Inductor's CPU backend fused it into a float4 kernel it cannot generate.
    x, q = serving_rows(), tiled()

    def targets(fn: object, *args: object) -> list[str]:
        graph = make_fx(fn)(*args).graph  # type: ignore[arg-type]
        return [str(n.target) for n in graph.nodes if n.op == "call_function"]

    rows = targets(lambda t: fp4_ops.quantize_rows(t), x)
    assert [t for t in rows if "computectx" in t] == ["computectx.fp4_quantize_rows.default"]
    assert not any("bitwise" in t or "view.dtype" in t for t in rows), rows

    def dequantized(c: torch.Tensor, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return fp4_ops.dequantize(Nvfp4Operand(c, s, a, "16x16"), torch.bfloat16)

    deq = targets(dequantized, q.codes, q.scale, q.amax)
    assert [t for t in deq if "computectx" in t] == ["computectx.fp4_dequantize.default"]
    assert not any("bitwise" in t or "view.dtype" in t for t in deq), deq


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


def test_quantize_rows_checks_a_given_amax() -> None:
    """A static amax is a max |x|: float32 (1,) on x's device, finite, >= 0 (0 an all-zero
    input's); a negative one made negative block scales, a NaN one NaN operands."""
    x = serving_rows()
    for bad, what in ((-2.0, "negative"), (float("nan"), "NaN"), (float("inf"), "inf")):
        with pytest.raises(ValueError, match=rf"quantize_rows: amax must be .*, got {what}$"):
            fp4_ops.quantize_rows(x, torch.tensor([bad]))
    with pytest.raises(ValueError, match=r"amax must be float32 \(1,\)"):
        fp4_ops.quantize_rows(x, torch.tensor([2.0], dtype=torch.float64))
    _, _, amax = fp4_ops.quantize_rows(x, torch.tensor([0.0]))
    assert amax.tolist() == [0.0] * x.shape[0]
    _, _, amax = fp4_ops.quantize_rows(x, torch.tensor([-1.0]), check_values=False)  # unread
    assert amax.tolist() == [-1.0] * x.shape[0]
