"""The ``linear`` kind of ``ctx.activations``: what linears and grouped GEMMs keep of their input.

Under ``linear: fp8`` the fine-grained fp8 linears keep ``Xᵀ`` quantized in the forward as the
backward would quantize it (the gradients bit for bit those of ``keep``), plain and grouped
GEMMs their input as E4M3 with a float32 scale per row (the weight gradient within the SQNR
bound docs/activations.md states); bytes counted with ``SavedActivations`` under the kind
``"linear"``. ``keep`` is today's behaviour: the rest of the suite runs it unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from computectx import ComputeCtx, DType
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.memory import SavedActivations
from computectx.nn import Gemm, GemmPath
from computectx.nn.experts import GroupedExperts

M, K, N = 64, 128, 128  # rows (tokens), in and out features
ROW_DW_SQNR = 28.0  # dB: a weight gradient from an input kept as E4M3 rows (docs)
GROUPED_FP8_DW_SQNR = 25.0  # dB: such rows quantized again by the fp8 grouped wgrad


def _sqnr(approx: torch.Tensor, exact: torch.Tensor) -> float:
    err = float((approx.double() - exact.double()).pow(2).sum())
    return math.inf if err == 0 else 10 * math.log10(float(exact.double().pow(2).sum()) / err)


def _x(outliers: bool = False) -> torch.Tensor:
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    if outliers:  # a few channels 100x the rest, as LLM activations have
        x[:, :4] *= 100
    return x.to(torch.bfloat16)


def _dy() -> torch.Tensor:
    return torch.randn(M, N, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)


Step = tuple[SavedActivations, torch.Tensor, torch.Tensor]


def _step(
    layer: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor
) -> Step:
    """What one forward of ``run`` kept, and ``(dX, dW)`` of its backward."""
    x = x0.clone().requires_grad_()
    params = list(layer.parameters())
    with SavedActivations(exclude=params) as saved:
        y = run(x)
    torch.autograd.backward(y, _dy() if y.shape == (M, N) else torch.ones_like(y))
    w = params[0]
    assert x.grad is not None and w.grad is not None
    return saved, x.grad, w.grad


def _quantized(flag: str, mode: str) -> QuantizedLinear:
    torch.manual_seed(0)
    ctx = ComputeCtx.from_flag(flag, "cpu").with_activations(f"linear:{mode}")
    return QuantizedLinear.from_linear(torch.nn.Linear(K, N, bias=False), ctx)


# What the fine-grained linears keep of X, in bytes: keep X in bf16; fp8 Xᵀ's codes and
# scales (row: one float32 per column of X; block: per 1x128 of M; mx: an E8M0 per 1x32).
_X_KEPT = {
    "fp8_rowwise": (2 * M * K, M * K + 4 * K),
    "fp8_block": (2 * M * K, M * K + 4 * K * math.ceil(M / 128)),
    "fp8_mx": (2 * M * K, M * K + K * math.ceil(M / 32)),
}


@pytest.mark.parametrize("flag", list(_X_KEPT))
def test_fine_grained_linears_keep_the_quantized_xt_and_the_same_gradients(flag: str) -> None:
    runs = {}
    for mode in ("keep", "fp8"):
        q = _quantized(flag, mode)
        runs[mode] = _step(q, q, _x())
    (keep, dx, dw), (fp8, dx8, dw8) = runs["keep"], runs["fp8"]
    # block also keeps the weight's 128x128 codes and scales (its dgrad's), under both modes.
    weight_codes = N * K + 4 if flag == "fp8_block" else 0
    assert keep.bytes() == keep.bytes("linear") == _X_KEPT[flag][0] + weight_codes
    assert fp8.bytes() == fp8.bytes("linear") == _X_KEPT[flag][1] + weight_codes
    # Xᵀ quantized in the forward is what the backward would quantize: dW bit for bit.
    assert torch.equal(dx8, dx) and torch.equal(dw8, dw)


def test_gw_hp_keeps_the_forward_codes_and_an_untrained_weight_keeps_no_input() -> None:
    keep = _quantized("fp8_rowwise_gw_hp", "keep")
    fp8 = _quantized("fp8_rowwise_gw_hp", "fp8")
    (_, dx, dw), (saved, dx8, dw8) = _step(keep, keep, _x()), _step(fp8, fp8, _x())
    assert saved.bytes("linear") == M * K + 4 * M  # X's row-wise codes: one step per row
    assert torch.equal(dx8, dx) and _sqnr(dw8, dw) >= ROW_DW_SQNR
    # No weight gradient, nothing of X is needed: none kept (the per-tensor linear keeps its
    # weight's codes and the two steps for the input gradient).
    for flag, kept in (("fp8_rowwise", 0), ("fp8_hybrid", N * K + 8)):
        frozen = _quantized(flag, "fp8").requires_grad_(False)
        x = _x().requires_grad_()
        with SavedActivations(exclude=frozen.parameters()) as saved:
            frozen(x).sum().backward()
        assert saved.bytes() == kept


def test_the_per_tensor_fp8_linear_keeps_its_codes_under_either_mode() -> None:
    keep, fp8 = (_quantized("fp8_hybrid", mode) for mode in ("keep", "fp8"))
    (a, dx, dw), (b, dx8, dw8) = _step(keep, keep, _x()), _step(fp8, fp8, _x())
    assert a.bytes("linear") == b.bytes("linear") == M * K + N * K + 8  # xq, wq, two steps
    assert torch.equal(dx8, dx) and torch.equal(dw8, dw)


@pytest.mark.parametrize("path", [GemmPath.UPCAST, GemmPath.NATIVE])
@pytest.mark.parametrize("outliers", [False, True])
def test_plain_linears_keep_their_input_as_e4m3_rows(path: GemmPath, outliers: bool) -> None:
    weight = torch.nn.Linear(K, N, bias=False)  # float32: the bf16 GEMM reads its copy
    runs = {}
    for save in ("keep", "fp8"):
        gemm = Gemm(path, torch.bfloat16, save)
        weight.zero_grad()
        run = functools.partial(gemm.linear, weight=weight.weight)
        runs[save] = _step(weight, run, _x(outliers))
    (keep, dx, dw), (fp8, dx8, dw8) = runs["keep"], runs["fp8"]
    assert keep.bytes() == keep.bytes("linear") == 2 * M * K + 2 * N * K  # X, W at bf16
    # The codes and a float32 scale per row; the weight as the parameter (cast again after).
    assert fp8.bytes() == fp8.bytes("linear") == M * K + 4 * M
    assert torch.equal(dx8, dx)
    assert _sqnr(dw8, dw) >= ROW_DW_SQNR


def _squares(experts: GroupedExperts, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor = experts(x, offs)
    return y.float().pow(2)


@pytest.mark.parametrize("flag", ["bf16", "fp8_rowwise"])
def test_grouped_experts_keep_their_input_as_e4m3_rows(flag: str) -> None:
    offs = torch.tensor([20, 20, 50, M], dtype=torch.int32)  # one empty group
    runs = {}
    for mode in ("keep", "fp8"):
        ctx = ComputeCtx.from_flag(flag, "cpu").with_activations(f"linear:{mode}")
        torch.manual_seed(0)
        experts = GroupedExperts(ctx, K, 64, 4)
        if ctx.recipe is not None:
            convert_to_quantized(experts, ctx, min_features=16)
            assert experts.fp8 is not None
        runs[mode] = _step(experts, functools.partial(_squares, experts, offs=offs), _x())
    (keep, dx, dw), (fp8, dx8, dw8) = runs["keep"], runs["fp8"]
    # Both GEMMs' inputs (x [M, K] and the SwiGLU's [M, 64]) at bf16, and offs; in high
    # precision the experts' bf16 copies too (their parameters are float32).
    copies = 2 * 4 * (2 * 64 * K + K * 64) if ctx.recipe is None else 0
    assert keep.bytes("linear") == 2 * M * K + 2 * M * 64 + 16 + copies
    # Under fp8 each input as codes and a float32 scale per row; the parameters as they are.
    assert fp8.bytes("linear") == M * K + M * 64 + 2 * 4 * M + 16
    assert torch.equal(dx8, dx)
    bound = ROW_DW_SQNR if ctx.recipe is None else GROUPED_FP8_DW_SQNR
    assert _sqnr(dw8, dw) >= bound


def test_checkpointing_stays_exact_under_linear_fp8() -> None:
    q = _quantized("fp8_block", "fp8")
    gemm, weight = Gemm(GemmPath.UPCAST, torch.bfloat16, "fp8"), torch.nn.Linear(N, N, bias=False)

    def run(x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(q(x), weight.weight)

    plain = _step(q, run, _x())
    q.zero_grad()
    again = _step(q, lambda x: checkpoint(run, x, use_reentrant=False), _x())
    assert torch.equal(plain[1], again[1]) and torch.equal(plain[2], again[2])


def test_offload_on_a_cpu_keeps_each_linears_input_as_it_is() -> None:
    # No streams on a CPU (tests/test_offload.py runs the stand-in): the input at bf16 and
    # the weight as the parameter, nothing else; under no_grad nothing is kept.
    ctx = ComputeCtx.from_flag("bf16", "cpu").with_activations("linear:offload")
    linear = torch.nn.Linear(K, N, bias=False)
    gemm = functools.partial(Gemm.for_ctx(ctx).linear, weight=linear.weight)
    assert _step(linear, gemm, _x())[0].bytes("linear") == 2 * M * K
    q = _quantized("fp8_rowwise", "offload")
    assert _step(q, q, _x())[0].bytes("linear") == 2 * M * K
    experts = GroupedExperts(ctx, K, 64, 2)
    offs = torch.tensor([M // 2, M], dtype=torch.int32)
    run = functools.partial(_squares, experts, offs=offs)
    assert _step(experts, run, _x())[0].bytes("linear") == 2 * M * K + 2 * M * 64 + 8
    with torch.no_grad():
        assert gemm(_x().requires_grad_()).shape == (M, N)


def _penalty(layer: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A gradient penalty's gradient: ``d ||dL/dW||² / dX`` (a double backward through ``run``)."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    weight = next(layer.parameters())
    (gw,) = torch.autograd.grad(torch.nn.functional.silu(run(x)).sum(), weight, create_graph=True)
    (gx,) = torch.autograd.grad(gw.pow(2).sum(), x)
    return gx


def _grouped(flag: str, mode: str) -> tuple[GroupedExperts, Callable[[torch.Tensor], torch.Tensor]]:
    ctx = ComputeCtx.from_flag(flag, "cpu").with_activations(f"linear:{mode}")
    torch.manual_seed(0)
    experts = GroupedExperts(ctx, 32, 32, 2)
    if ctx.recipe is not None:
        convert_to_quantized(experts, ctx, min_features=16)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    return experts, functools.partial(experts, offs=offs)


def _double_backward_layers(
    mode: str,
) -> dict[str, tuple[torch.nn.Module, Callable[..., torch.Tensor]]]:
    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 16, bias=False)
    gemm = Gemm(GemmPath.WIDE, torch.float32, mode)  # type: ignore[arg-type]
    layers: dict[str, tuple[torch.nn.Module, Callable[..., torch.Tensor]]] = {
        "gemm": (plain, functools.partial(gemm.linear, weight=plain.weight))
    }
    for flag in ("fp8_rowwise", "fp8_hybrid"):  # the fine-grained and the per-tensor linear
        ctx = ComputeCtx.from_flag(flag, "cpu").with_activations(f"linear:{mode}")
        q = QuantizedLinear.from_linear(torch.nn.Linear(32, 16, bias=False), ctx)
        layers[flag] = (q, q)
    for flag in ("fp32", "fp8_rowwise"):  # torch's grouped_mm and the fp8 grouped GEMM
        layers[f"experts {flag}"] = _grouped(flag, mode)
    return layers


@pytest.mark.parametrize("mode", ["fp8", "offload"])
def test_a_double_backward_through_a_linear_not_kept_is_refused_naming_keep(mode: str) -> None:
    # The input comes back as codes or a host copy, outside the graph: the second-order term
    # through it would be lost (silently, before). Offload on a CPU (kept as it is) alike.
    for layer, run in _double_backward_layers(mode).values():
        with pytest.raises(RuntimeError, match=r"create_graph=True.*'linear:keep'"):
            _penalty(layer, run)


def test_an_fp8_gemm_refuses_a_double_backward_under_keep_too() -> None:
    # Its fp8 operands carry no graph: the second-order term was lost silently under keep.
    layers = _double_backward_layers("keep")
    for name in ("fp8_rowwise", "fp8_hybrid", "experts fp8_rowwise"):
        layer, run = layers[name]
        with pytest.raises(RuntimeError, match=r"create_graph=True\) through a quantized GEMM"):
            _penalty(layer, run)


def test_keep_still_takes_a_double_backward_where_it_did() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(32, 16, bias=False)
    gemm = Gemm(GemmPath.WIDE, torch.float32, "keep")
    linear = functools.partial(gemm.linear, weight=plain.weight)
    assert torch.equal(_penalty(plain, linear), _penalty(plain, plain))
    # torch's grouped_mm (float32) against the float64 experts' dense twin (plain torch ops).
    experts, run = _grouped("fp32", "keep")
    wide = GroupedExperts(ComputeCtx.new(DType.F64, "cpu"), 32, 32, 2)
    wide.load_state_dict(experts.state_dict())
    offs = torch.tensor([3, 8], dtype=torch.int32)
    dense = _penalty(wide, lambda x: wide(x.double(), offs)).double()
    assert torch.allclose(_penalty(experts, run).double(), dense, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path", [GemmPath.UPCAST, GemmPath.NATIVE])
@pytest.mark.parametrize("save", ["keep", "fp8", "offload"])
def test_a_linear_with_no_input_features_has_keeps_gradients(path: GemmPath, save: str) -> None:
    weight = torch.nn.Parameter(torch.randn(5, 0))
    x = torch.randn(4, 0, dtype=torch.bfloat16, requires_grad=True)
    y = Gemm(path, torch.bfloat16, save).linear(x, weight)  # type: ignore[arg-type]
    torch.autograd.backward(y.sum())
    assert x.grad is not None and x.grad.shape == (4, 0)
    assert weight.grad is not None and weight.grad.shape == (5, 0)
