"""fp8 under torch.compile: the operators, whole-graph compiles, state, regions, bad input.

Compiles are slow on the CPU (Inductor generates C++), so every test here but three compiles
with ``backend="aot_eager"``: dynamo + AOTAutograd (functionalization of the ledger mutations,
the backward graph) without code generation, which is what these tests are about. Three tests
run Inductor end to end (the per-tensor operators, mx, and the inline quantize). Where a test
steps several batch sizes through one layer, the first call marks the batch dimension dynamic:
one compile, of the graph that automatic-dynamic shapes would trace at the second size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from computectx import ComputeCtx
from computectx.demo.settings import POLICY_FLAGS
from computectx.dtypes import Fp8Format
from computectx.formats import QuantizedLinear, autocast, convert_to_quantized, scaling_stats
from computectx.formats.linear.fp4 import Fp4Linear
from computectx.formats.numerics.ledger import ledger_new, tally_new
from computectx.fp4_recipe import Fp4Recipe
from computectx.nn import ByteLM, LMConfig
from computectx.recipes import DelayedScaling, DynamicScaling, Recipe

E4M3, E5M2 = Fp8Format.E4M3, Fp8Format.E5M2
SCALINGS = [DelayedScaling(history_len=4), DynamicScaling()]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OPCHECK_WITHOUT_SCHEMA = (
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype in FP8 else t


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def ctx_with(scaling: DelayedScaling | DynamicScaling) -> ComputeCtx:
    return ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(recipe=Recipe(scaling=scaling))


def mlp(ctx: ComputeCtx) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    report = convert_to_quantized(m, ctx, min_features=16, include_head=True)
    assert len(report.converted) == 3
    return m


def states(m: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, mod in m.named_modules():
        if isinstance(mod, QuantizedLinear):
            for role, op in mod.scaling.operands.items():
                out[f"{name}.{role}.ledger"] = op.ledger.clone()
                out[f"{name}.{role}.tally"] = op.tally.clone()
    return out


# ----- the operators ------------------------------------------------------------------------


def test_opcheck_passes_for_every_operator_on_the_reference_and_cublas_backends() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    ops = torch.ops.computectx
    for backend in ("reference", "cublas"):
        cases: list[tuple[Any, tuple[object, ...]]] = [
            (
                ops.fp8_quantize_delayed,
                (
                    x,
                    ledger_new(4, "cpu"),
                    tally_new(torch.device("cpu")),
                    torch.float8_e4m3fn,
                    "max",
                    0,
                    backend,
                    True,
                ),
            ),
            (
                ops.fp8_quantize_dynamic,
                (
                    x,
                    ledger_new(1, "cpu"),
                    tally_new(torch.device("cpu")),
                    torch.float8_e5m2,
                    1,
                    backend,
                ),
            ),
            (
                ops.fp8_quantize_with_step,
                (x, torch.full((1,), 0.01), torch.float8_e4m3fn, backend),
            ),
        ]
        a = torch.randn(6, 32).to(torch.float8_e4m3fn)
        b = torch.randn(16, 32).to(torch.float8_e5m2)
        s = torch.full((1,), 0.5)
        for bias, out in ((None, torch.bfloat16), (torch.randn(16), torch.float32)):
            cases.append((ops.fp8_scaled_mm, (a, b, s, s, bias, out, backend)))
        cases.append(
            (ops.fp8_scaled_mm, (a, b.t().contiguous().t(), s, s, None, torch.float16, backend))
        )
        cases.append((ops.fp8_dequantize, (a, s, torch.bfloat16)))
        for op, args in cases:
            tensors = [t for t in args if isinstance(t, torch.Tensor)]
            if not any(t.dtype in FP8 for t in tensors):
                torch.library.opcheck(op, args)
                continue
            # torch's test_schema compares inputs with allclose, which has no fp8 kernel on
            # the CPU; the other three checks run, and the schema's promise (these inputs
            # are not mutated, the output aliases none of them) is checked on the bytes.
            torch.library.opcheck(op, args, test_utils=OPCHECK_WITHOUT_SCHEMA)
            before = [t.clone() for t in tensors]
            out = op(*args)
            for t, b0 in zip(tensors, before, strict=True):
                assert torch.equal(_bytes(t), _bytes(b0))
                assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_the_quantize_operators_declare_the_ledgers_they_mutate() -> None:
    for name in ("fp8_quantize_delayed", "fp8_quantize_dynamic"):
        schema = getattr(torch.ops.computectx, name).default._schema
        mutated = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert mutated == ["ledger", "tally"], (name, mutated)
    for name in ("fp8_quantize_with_step", "fp8_scaled_mm", "fp8_dequantize"):
        schema = getattr(torch.ops.computectx, name).default._schema
        assert not any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


def test_cublas_backend_matches_the_reference_within_the_gemm_bound() -> None:
    from computectx.formats.backend import Backend, select_backend
    from computectx.formats.numerics import tensorwise
    from computectx.formats.ops import tensorwise as tensor_ops

    assert select_backend("cpu", force="cublas")[0] is Backend.CUBLAS
    torch.manual_seed(1)
    a = torch.randn(24, 48).to(torch.float8_e4m3fn)
    b = torch.randn(32, 48).to(torch.float8_e5m2)
    sa, sb = torch.full((1,), 0.125), torch.full((1,), 3.0)
    for bias, out in ((None, torch.bfloat16), (torch.randn(32), torch.float32)):
        for bb in (b, b.t().contiguous().t()):  # row-major and a transposed view
            got = tensor_ops.scaled_mm(a, bb, sa, sb, bias, out, backend=Backend.CUBLAS)
            want = tensor_ops.scaled_mm(a, bb, sa, sb, bias, out, backend=Backend.REFERENCE)
            bound = tensorwise.scaled_mm_error_bound(tensorwise.GemmArgs(a, bb, sa, sb, bias, out))
            # Both are within the bound of the exact result, so within twice it of each other.
            assert ((got.double() - want.double()).abs() <= 2 * bound).all()


# ----- whole-model compiles -----------------------------------------------------------------


@pytest.mark.parametrize("scaling", SCALINGS, ids=["delayed", "dynamic"])
def test_converted_model_compiles_whole_and_matches_eager_state_for_state(
    scaling: DelayedScaling | DynamicScaling,
) -> None:
    ctx = ctx_with(scaling)
    eager, compiled_model = mlp(ctx), mlp(ctx)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(compiled_model, fullgraph=True, backend=counter)
    sizes = (8, 16, 24, 32, 40, 48, 64)
    for step, batch in enumerate(sizes):
        torch.manual_seed(100 + step)
        x = torch.randn(batch, 32) * (1.0 + step)  # growing inputs move the steps
        eager.zero_grad()
        compiled_model.zero_grad()
        ye = eager(x)
        yc = compiled(x)
        ye.float().square().mean().backward()
        yc.float().square().mean().backward()
        # The same operators on the same data: identical results, not merely close.
        assert torch.equal(ye, yc), batch
        for pe, pc in zip(eager.parameters(), compiled_model.parameters(), strict=True):
            assert pe.grad is not None and pc.grad is not None
            assert torch.equal(pe.grad, pc.grad)
        se, sc = states(eager), states(compiled_model)
        for key in se:
            assert torch.equal(se[key], sc[key]), (batch, key)
    assert counter.frame_count <= 3, counter.frame_count  # not one graph per batch size
    stats = scaling_stats(compiled_model)["0"]
    assert stats.input.elements == sum(sizes) * 32
    assert stats.grad.elements == sum(sizes) * 64


@pytest.mark.parametrize("flag", POLICY_FLAGS)
def test_bytelm_loss_compiles_without_graph_breaks_under_every_dtype_flag(flag: str) -> None:
    ctx = ComputeCtx.from_flag(flag, "cpu")
    torch.manual_seed(0)
    model = ByteLM(ctx, LMConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_len=16))
    ids = torch.randint(0, 256, (2, 8))
    explanation = torch._dynamo.explain(model.loss)(ids, ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    if isinstance(ctx.recipe, Fp4Recipe):  # the 4-bit flags put Fp4Linear layers in the graph
        assert any(isinstance(m, Fp4Linear) for m in model.modules())
    elif ctx.recipe is not None:
        assert model.fp8_layers()  # the fp8 flags do put QuantizedLinear layers in the graph


FINE_FLAGS = ("fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "fp8_mx")


def _fine_layers(flag: str) -> tuple[QuantizedLinear, QuantizedLinear]:
    # A --dtype flag, or a policy's text form.
    if "/" in flag:
        ctx = ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse(flag))
    else:
        ctx = ComputeCtx.from_flag(flag, "cpu")
    torch.manual_seed(0)
    eager = QuantizedLinear(64, 32, ctx=ctx, dtype=torch.float32)
    twin = QuantizedLinear(64, 32, ctx=ctx, dtype=torch.float32)
    twin.load_state_dict(eager.state_dict())
    return eager, twin


def _step_both(
    eager: QuantizedLinear,
    twin: QuantizedLinear,
    compiled: Callable[..., Any],
    batch: int,
    *,
    dynamic_batch: bool = False,
) -> None:
    """One forward and backward of each; outputs, gradients and states equal bit for bit.
    ``dynamic_batch``: the compiled call's batch dimension is marked dynamic (its first call)."""
    x = torch.randn(batch, 64) * torch.logspace(-2, 2, 64)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    if dynamic_batch:
        torch._dynamo.mark_dynamic(xc, 0)
    ye, yc = eager(xe), compiled(xc)
    ye.float().square().sum().backward()
    yc.float().square().sum().backward()
    assert torch.equal(ye, yc), batch
    assert xe.grad is not None and xc.grad is not None
    assert torch.equal(xe.grad, xc.grad), batch
    for pe, pc in zip(eager.parameters(), twin.parameters(), strict=True):
        assert pe.grad is not None and pc.grad is not None
        assert torch.equal(pe.grad, pc.grad), batch
    se, sc = states(nn.Sequential(eager)), states(nn.Sequential(twin))
    for key in se:
        assert torch.equal(se[key], sc[key]), (batch, key)


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd is returning a function")
@pytest.mark.parametrize("flag", FINE_FLAGS)
def test_fine_grained_linear_compiles_whole_forward_and_backward_equal_to_eager(flag: str) -> None:
    eager, twin = _fine_layers(flag)
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    compiled = torch.compile(twin, fullgraph=True, backend=recorder)  # a break would raise
    # One compile serves both batches: the batch dimension is marked dynamic on the first
    # call, the graph automatic-dynamic shapes would trace at the second batch size (the
    # static graphs are traced by the bytelm test above and by Inductor for mx below). mx
    # guards on the batch (8 rows pad its wgrad's contraction, 40 do not): its first call
    # stays static and 40 compiles the dynamic graph, as by default.
    mx = flag == "fp8_mx"
    for batch in (8, 40):  # 8 rows: the mx wgrad pads its contraction to one block
        _step_both(eager, twin, compiled, batch, dynamic_batch=batch == 8 and not mx)
    # Each forward graph has its backward graph: the backward traced whole as well.
    assert len(recorder.fw_graphs) == len(recorder.bw_graphs) == (2 if mx else 1)
    ops = _graph_ops(recorder.fw_graphs + recorder.bw_graphs)
    assert "computectx.fp8_quantize_blocks.default" in ops, sorted(ops)
    assert "computectx.fp8_block_scaled_mm.default" in ops, sorted(ops)


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd is returning a function")
def test_the_saturated_count_under_mx_floor_compiles_equal_to_eager() -> None:
    # mx+floor is the fine policy that saturates: the count, written in the backward too,
    # comes out of the quantize operator and lands in the ledgers as in eager.
    eager, twin = _fine_layers("e4m3/mx+floor/dynamic/0")
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")  # a break would raise
    for batch in (8, 40):
        _step_both(eager, twin, compiled, batch)
    stats = scaling_stats(nn.Sequential(twin))["0"]
    assert stats.input.saturated_fraction > 0 and stats.grad.saturated_fraction > 0


def test_inductor_compiles_the_mx_linear_bit_for_bit() -> None:
    # mx scales are float8_e8m0fnu, which Inductor's CPU code generator has no type for:
    # they pass only between the quantize and GEMM operators, never through generated code.
    eager, twin = _fine_layers("fp8_mx")
    _step_both(eager, twin, torch.compile(twin, fullgraph=True), 8)


def test_opcheck_passes_for_the_block_quantize_and_wgrad_operators() -> None:
    x = torch.randn(40, 160, dtype=torch.bfloat16)
    for granularity, rule in (("row", "pow2"), ("1x128", "amax"), ("128x128", "pow2"),
                              ("mx", "mx_rceil"), ("mx", "mx_floor")):  # fmt: skip
        for t, count in ((x, True), (x.t(), True), (x, False)):
            args = (t, torch.float8_e4m3fn, granularity, rule, "reference", count)
            op = torch.ops.computectx.fp8_quantize_blocks
            torch.library.opcheck(op, args, test_utils=OPCHECK_WITHOUT_SCHEMA)
    # gw_hp's IEEE float32 wgrad (dY [M, N], X [M, K] -> [N, K]).
    wgrad = torch.ops.computectx.wgrad_float32
    for dy, xx in ((torch.randn(40, 24, dtype=torch.bfloat16), x), (x.float(), x.float())):
        torch.library.opcheck(wgrad, (dy, xx), test_utils=OPCHECK_WITHOUT_SCHEMA)


def test_inductor_compiles_fp8_linear_forward_and_backward_within_the_fp8_bound() -> None:
    ctx = ctx_with(DelayedScaling(history_len=4))
    torch.manual_seed(0)
    eager = QuantizedLinear(32, 48, ctx=ctx)
    compiled_layer = QuantizedLinear(32, 48, ctx=ctx)
    compiled_layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_layer, fullgraph=True)  # Inductor
    for step in range(2):  # the second step runs the same generated code on the new state
        x = torch.randn(8, 32, requires_grad=True)
        xc = x.detach().clone().requires_grad_(True)
        ye = eager(x)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            yc = compiled(xc)
        ye.float().sum().backward()
        yc.float().sum().backward()
        # Inductor may fuse the float32 epilogue differently: one bf16 rounding apart.
        torch.testing.assert_close(yc, ye, atol=2**-7, rtol=2**-7)
        assert x.grad is not None and xc.grad is not None
        torch.testing.assert_close(xc.grad, x.grad, atol=2**-7, rtol=2**-7)
    se, sc = states(nn.Sequential(eager)), states(nn.Sequential(compiled_layer))
    for key in se:
        # Quantized bytes are computed by the same operators: the ledgers agree exactly,
        # except that the grad ledger sees the bf16 output's rounding (none here: dY = 1).
        assert torch.equal(se[key], sc[key]), key


# ----- the inline quantize (quantize="inline") ------------------------------------------------


def _graph_ops(graphs: list[torch.fx.GraphModule]) -> set[str]:
    return {
        str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"
    }


# torch's own graph-recording test backend (AotEagerAndRecordGraphs) trips this warning.
@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd is returning a function")
@pytest.mark.parametrize("scaling", SCALINGS, ids=["delayed", "dynamic"])
def test_inline_quantize_compiles_whole_to_plain_ops_and_advances_state_as_eager_operators(
    scaling: DelayedScaling | DynamicScaling,
) -> None:
    ctx = ctx_with(scaling)
    eager = mlp(ctx)  # the operators, eager: the specification
    inline_model = mlp(ctx)
    for layer in inline_model.modules():
        if isinstance(layer, QuantizedLinear):
            layer.quantize = "inline"
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    compiled = torch.compile(inline_model, fullgraph=True, backend=recorder)  # 0 breaks
    for step, batch in enumerate((8, 16, 24, 8)):
        torch.manual_seed(200 + step)
        x = torch.randn(batch, 32) * (1.0 + 3 * step)
        if step == 0:
            # One compile serves every batch size: the batch dimension dynamic from the first
            # call (the graph automatic-dynamic shapes would trace at the second size; the
            # static inline graph is Inductor's in the test below).
            torch._dynamo.mark_dynamic(x, 0)
        if step == 2:
            x[1, 2] = math.nan  # counted and skipped alike
        eager.zero_grad()
        inline_model.zero_grad()
        ye, yc = eager(x), compiled(x)
        ye.nan_to_num().float().square().mean().backward()
        yc.nan_to_num().float().square().mean().backward()
        assert torch.equal(torch.nan_to_num(ye), torch.nan_to_num(yc)), step
        for pe, pc in zip(eager.parameters(), inline_model.parameters(), strict=True):
            assert pe.grad is not None and pc.grad is not None
            assert torch.equal(torch.nan_to_num(pe.grad), torch.nan_to_num(pc.grad)), step
        # Functionalization kept every in-place ledger and tally update, forward and backward.
        se, sc = states(eager), states(inline_model)
        for key in se:
            assert torch.equal(se[key], sc[key]), (step, key)
    # The compiled graphs quantize with plain ops: no quantize operator is left in them,
    # while the GEMMs stay operators (the eager-vs-"op" comparison is the test above).
    assert len(recorder.fw_graphs) == len(recorder.bw_graphs) == 1
    ops = _graph_ops(recorder.fw_graphs + recorder.bw_graphs)
    assert not any("fp8_quantize" in op for op in ops), sorted(ops)
    assert any("fp8_scaled_mm" in op for op in ops)
    # The saturation is a select against the code bound (fp8_codes), not a clamp.
    assert "aten.amax.default" in ops and "aten.where.self" in ops
    # An eager step after the compiled ones continues from the same state.
    x = torch.randn(8, 32)
    assert torch.equal(eager(x), inline_model(x))
    se, sc = states(eager), states(inline_model)
    assert all(torch.equal(se[k], sc[k]) for k in se)


def test_inductor_fuses_the_inline_quantize_with_the_same_bytes_as_the_operators() -> None:
    from torch._inductor.utils import run_and_get_code

    ctx = ctx_with(DelayedScaling(history_len=4))
    torch.manual_seed(0)
    eager = QuantizedLinear(32, 16, ctx=ctx)
    layer = QuantizedLinear(32, 16, ctx=ctx, quantize="inline")
    layer.load_state_dict(eager.state_dict())

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = m(torch.relu(x))  # an exact activation the quantize fuses into
        return out

    compiled = torch.compile(step, fullgraph=True)  # Inductor
    for i in range(2):
        torch.manual_seed(i)
        x = torch.randn(8, 32) * (1 + 5 * i)
        want = step(eager, x)
        if i == 0:
            got, code = run_and_get_code(compiled, layer, x)  # resets dynamo, compiles
            assert code
            assert "fp8_quantize" not in "\n".join(code)
        else:  # the same generated code, on the state the first step left (one compile)
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = compiled(layer, x)
        assert torch.equal(got, want), i
        se, sc = states(nn.Sequential(eager)), states(nn.Sequential(layer))
        for key in se:
            assert torch.equal(se[key], sc[key]), (i, key)


# ----- regions ------------------------------------------------------------------------------


def test_a_plain_linear_compiled_inside_a_region_refuses_with_what_to_do() -> None:
    ctx = ctx_with(DelayedScaling())
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    compiled = torch.compile(plain, fullgraph=True, backend="aot_eager")
    with autocast(ctx), pytest.raises(Exception, match="convert_to_quantized") as info:
        compiled(torch.randn(4, 32))
    assert "autocast" in str(info.value)
    # Eager inside the region routes to fp8 as before (the ledger records the call).
    with autocast(ctx):
        plain(torch.randn(4, 32))
    assert scaling_stats(plain)["0"].input.elements == 4 * 32


def test_fp8_linear_compiled_inside_regions_runs_as_eager_or_refuses() -> None:
    ctx = ctx_with(DelayedScaling())
    torch.manual_seed(0)
    layer = QuantizedLinear(32, 16, ctx=ctx)
    twin = QuantizedLinear(32, 16, ctx=ctx)
    twin.load_state_dict(layer.state_dict())
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 32)
    # An enabled region does not change a QuantizedLinear: compiled inside it equals eager.
    with autocast(ctx):
        assert torch.equal(compiled(x), twin(x))
    # A disabled region would run it in high precision in eager; compiled code cannot see
    # the region, so it refuses rather than run fp8 where eager would not.
    with autocast(enabled=False), pytest.raises(Exception, match="QuantizedLinear"):
        compiled(x)
    with autocast(enabled=False):
        plain = twin(x)  # eager: high precision
    assert torch.equal(plain, nn.functional.linear(x, twin.weight, twin.bias))
    assert torch.equal(compiled(x), twin(x))  # outside every region again: fp8, recompiled


# ----- bad input and non-finite input --------------------------------------------------------


def _compiled_layer() -> tuple[QuantizedLinear, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    layer = QuantizedLinear(32, 16, ctx=ctx_with(DelayedScaling()))
    return layer, torch.compile(layer, backend="aot_eager")


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (
            torch.ones(4, 32, dtype=torch.int32),
            TypeError,
            "bf16, fp16 or fp32 inputs, got int32 \\(4, 32\\)",
        ),
        (torch.ones(4, 31), ValueError, r"shape \(\.\.\., 32\), got \(4, 31\)"),
        (torch.ones(4, 32, dtype=torch.float64), TypeError, "got float64 \\(4, 32\\)"),
    ],
)
def test_bad_input_raises_the_eager_error_under_compile(
    bad: torch.Tensor, error: type[Exception], match: str
) -> None:
    layer, compiled = _compiled_layer()
    with pytest.raises(error, match=match):
        layer(bad)
    with pytest.raises(error, match=match):
        compiled(bad)
    # fullgraph=True turns every exception raised while tracing into dynamo's Unsupported;
    # the message still carries the eager error.
    strict = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=match):
        strict(bad)


def test_bad_operator_arguments_raise_the_eager_error_under_compile() -> None:
    from computectx.formats.backend import Backend
    from computectx.formats.ops.tensorwise import scaled_mm

    def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        s = torch.ones(1)
        return scaled_mm(a, b, s, s, None, torch.bfloat16, backend=Backend.REFERENCE)

    a = torch.ones(4, 32).to(torch.float8_e4m3fn)
    compiled = torch.compile(gemm, backend="aot_eager")
    for b, match in ((torch.ones(8, 16).to(torch.float8_e4m3fn), "same K"),
                     (torch.ones(8, 32), "must be a 2-D float8")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            gemm(a, b)
        with pytest.raises(ValueError, match=match):
            compiled(a, b)


def test_a_nan_input_in_a_compiled_step_is_counted_and_skipped_as_in_eager() -> None:
    ctx = ctx_with(DelayedScaling(history_len=4))
    eager, compiled_model = mlp(ctx), mlp(ctx)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(8, 32)
        if step == 1:
            x[3, 5] = math.nan
        ye, yc = eager(x), compiled(x)
        assert torch.equal(ye.isnan(), yc.isnan())
        assert torch.equal(torch.nan_to_num(ye), torch.nan_to_num(yc))
        se, sc = states(eager), states(compiled_model)
        for key in se:
            assert torch.equal(se[key], sc[key]), (step, key)
    stats = scaling_stats(compiled_model)["0"].input
    assert stats.nonfinite_count == 1  # counted once; the history skipped that amax
    assert math.isfinite(stats.step) and math.isfinite(stats.window_amax)


def test_fp4_linear_trains_compiled_whole_as_eager_bit_for_bit() -> None:
    # Forward and backward under fullgraph (aot_eager): the same output and gradients as
    # eager, the stochastic-rounding counter advanced alike, no recompile as it advances.
    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    torch.manual_seed(0)
    eager = Fp4Linear(32, 16, ctx=ctx)
    twin = Fp4Linear(32, 16, ctx=ctx)
    twin.load_state_dict(eager.state_dict())
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin, backend=counter, fullgraph=True)
    for step in range(2):
        x = torch.randn(12, 32, dtype=torch.bfloat16)
        for model, run in ((eager, eager), (twin, compiled)):
            model.zero_grad()
            run(x).float().square().sum().backward()
        for a, b in zip(eager.parameters(), twin.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
        assert torch.equal(eager.sr_key, twin.sr_key) and int(eager.sr_key[1]) > 0, step
    assert counter.frame_count == 1
