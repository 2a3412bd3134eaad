"""The fine-grained fp8 linear (granularity row, block, mx): each GEMM's operands and axes,
its accuracy against float64, its ledgers, training, and what it refuses."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import bench_granularity as bench
import pytest
import torch
from torch import nn

from computectx import ComputeCtx, Fp8Format
from computectx.formats import (
    QuantizedLinear,
    QuantizedWeight,
    Recipe,
    convert_to_quantized,
    dequantize_tensor,
    quantize_tensor,
    scaling_stats,
)
from computectx.formats.backend import Backend
from computectx.formats.linear.function import fp8_linear
from computectx.formats.linear.plan import Fp8LinearPlan
from computectx.formats.numerics import blockwise, layouts, tensorwise
from computectx.formats.numerics.layouts import OPERAND_GRANULARITY
from computectx.formats.numerics.ledger import TALLY_ELEMENTS, ledger_history, ledger_step
from computectx.formats.ops.blockwise import block_scaled_mm

sqnr: Callable[[torch.Tensor, torch.Tensor], float] = bench.sqnr  # the bench's SQNR, in dB

POLICIES = {
    "fp8_rowwise": "e4m3/row/dynamic/0",
    "fp8_rowwise_gw_hp": "e4m3/row+gw_hp/dynamic/0",
    "fp8_block": "e4m3/block/dynamic/0",
    "fp8_mx": "e4m3/mx/dynamic/0",
    "block+pow2, hybrid": "hybrid/block+pow2/dynamic/0",
    "mx+floor, hybrid": "hybrid/mx+floor/dynamic/0",
}
K, N = 160, 96  # ragged for 1x128/128x128 (160 = 128 + 32, 96 < 128); whole mx blocks


def ctx_of(text: str) -> ComputeCtx:
    return ComputeCtx.from_flag("bf16", "cpu").replace(recipe=Recipe.parse(text))


def grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def quantize(x: torch.Tensor, fmt: Fp8Format, gran: str, policy: Recipe) -> tuple[Any, ...]:
    """``x`` quantized as the table says, through the public ``quantize_tensor``: ``(codes,
    scale, gran, x_padded)``; an mx contraction under 32 is zero-padded to one block."""
    if gran == "mx" and x.shape[-1] < layouts.MX_BLOCK:
        x = nn.functional.pad(x, (0, layouts.MX_BLOCK - x.shape[-1]))
    if gran == "mx":
        q, s = quantize_tensor(x, fmt, granularity="mx", mx_rounding=policy.mx_rounding)
    else:
        q, s = quantize_tensor(x, fmt, granularity=gran, power_of_two=policy.power_of_two)  # type: ignore[arg-type]
    return q, s, gran, x


def gemm_operands(
    policy: Recipe, x2: torch.Tensor, w: torch.Tensor, dy2: torch.Tensor
) -> dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """Each GEMM's ``(a, b)`` operands as docs/fp8.md's table gives them."""
    fwd, bwd = policy.format.forward, policy.format.backward
    act, wg = OPERAND_GRANULARITY[policy.granularity]
    wq = quantize(w, fwd, wg, policy)
    # block: the forward's 128x128 blocks transposed as they are; else again along N.
    square = wg == "128x128"
    wt = (wq[0].t(), wq[1].t(), wg, w.t()) if square else quantize(w.t(), fwd, act, policy)
    return {
        "forward": (quantize(x2, fwd, act, policy), wq),
        "dgrad": (quantize(dy2, bwd, act, policy), wt),
        "wgrad": (quantize(dy2.t(), bwd, act, policy), quantize(x2.t(), fwd, act, policy)),
    }


def run(text: str, m: int, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    """One layer's forward and backward on ``m`` rows with outlier input channels."""
    torch.manual_seed(0)
    layer = QuantizedLinear(K, N, ctx=ctx_of(text), dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, m // 2, K, generator=gen) * torch.logspace(-2, 2, K)
    dy = torch.randn(2, m // 2, N, generator=gen)
    xr = x.to(dtype).requires_grad_()
    y = layer(xr)
    y.backward(dy.to(dtype))
    return layer, x.reshape(m, K), dy.reshape(m, N), y.reshape(m, N), grad(xr).reshape(m, K)


# ----- the operands of each GEMM ------------------------------------------------------------


@pytest.mark.parametrize("m", [20, 136])  # wgrad contraction: under one mx block; ragged
@pytest.mark.parametrize("name", list(POLICIES))
def test_each_gemm_quantizes_its_operands_as_the_table_says(name: str, m: int) -> None:
    layer, x2, dy2, y, dx = run(POLICIES[name], m)
    policy = layer.policy
    w, bias = layer.weight.detach(), layer.bias.detach()
    ops = gemm_operands(policy, x2, w, dy2)

    def gemm(which: str, bias: torch.Tensor | None, out: torch.dtype) -> torch.Tensor:
        (aq, sa, ga, _), (bq, sb, gb, _) = ops[which]
        return block_scaled_mm(aq, bq, sa, ga, sb, gb, bias, out)

    # bf16 compute: the forward and dgrad GEMMs write bf16; the wgrad float32.
    assert torch.equal(y, gemm("forward", bias, torch.bfloat16).float())
    assert torch.equal(dx, gemm("dgrad", None, torch.bfloat16).float())
    want_dw = dy2.t() @ x2 if policy.gw_hp else gemm("wgrad", None, torch.float32)
    assert torch.equal(grad(layer.weight), want_dw)
    assert torch.equal(grad(layer.bias), dy2.sum(0))


def test_block_weight_blocks_transpose_as_they_are_and_the_weight_is_not_kept() -> None:
    w = torch.randn(N, K) * torch.logspace(-3, 3, K)
    wq, sw = quantize_tensor(w, "e4m3", granularity="128x128")
    wtq, swt = quantize_tensor(w.t(), "e4m3", granularity="128x128")
    # A square block holds the same elements either way: the same amax, step and codes.
    assert torch.equal(wtq.view(torch.uint8), wq.t().view(torch.uint8))
    assert torch.equal(swt, sw.t())
    # The layer keeps the weight's fp8 codes for the dgrad, not the weight (row and mx keep
    # the weight: they quantize it again along N).
    saved: dict[str, list[torch.dtype]] = {}
    for text in ("e4m3/block/dynamic/0", "e4m3/mx/dynamic/0"):
        kept = saved.setdefault(text, [])

        def pack(t: torch.Tensor, kept: list[torch.dtype] = kept) -> torch.Tensor:
            kept.append(t.dtype)
            return t

        layer = QuantizedLinear(K, N, ctx=ctx_of(text), dtype=torch.float32)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(torch.randn(8, K, requires_grad=True))
    assert saved["e4m3/block/dynamic/0"] == [torch.float32, torch.float8_e4m3fn, torch.float32]
    assert saved["e4m3/mx/dynamic/0"] == [torch.float32, torch.float32]


def test_an_mx_operand_under_one_block_padded_with_zeros_is_one_partial_block() -> None:
    # The wgrad of 20 rows contracts 20-wide dYᵀ and Xᵀ: zero-padded to one block of 32
    # (numerics.layouts.layout_of refuses K < 32), they quantize exactly as a partial block of the
    # 20 elements would (a zero changes no amax), and the padding adds nothing to the GEMM.
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(24, 20, generator=gen) * torch.logspace(-3, 3, 24).unsqueeze(1)
    padded, scale = quantize_tensor(nn.functional.pad(a, (0, 12)), "e4m3", granularity="mx")
    partial = layouts.BlockLayout("mx", 24, 20, 1, 32, (24, 1), (24, 1))
    codes, want = blockwise.quantize(a, Fp8Format.E4M3, partial, "mx_rceil")
    assert torch.equal(scale.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(padded[:, :20].view(torch.uint8), codes.view(torch.uint8))
    assert not padded[:, 20:].float().any()


# ----- accuracy against float64 -------------------------------------------------------------


def elementwise_steps(scale: torch.Tensor, gran: str, shape: torch.Size) -> torch.Tensor:
    layout = layouts.layout_of(gran, shape)  # type: ignore[arg-type]
    steps = blockwise.steps_of_scale(scale).reshape(layout.grid)
    return blockwise.expand_steps(steps, layout).double()


def gemm_bound(op_a: tuple[Any, ...], op_b: tuple[Any, ...], fa: Fp8Format, fb: Fp8Format,
               out_unit: float) -> torch.Tensor:  # fmt: skip
    """A-priori bound on ``|out - a @ bᵀ|`` (float64 ``a``, ``b``: the unquantized operands).

    Each element is quantized with ``|q*s - v| <= u|v| + s*min_subnormal/2`` (``u`` half an
    ulp; no step rule here saturates: each step is at least its block's amax / fmt.max);
    products of fp8 values are exact, the block-scaled sums add ``gamma_n`` of
    ``sum |â||b̂|`` with ``n = K + K/32 + 4`` (the block GEMM's bound, every block width
    >= 32), and the result is rounded once to the output (``out_unit``)."""
    (_, sa, ga, a), (_, sb, gb, b) = op_a, op_b
    a64, b64 = a.double().abs(), b.double().abs()
    ua, ub = 2.0 ** -(fa.mantissa_bits + 1), 2.0 ** -(fb.mantissa_bits + 1)
    ha = elementwise_steps(sa, ga, a.shape) * fa.min_subnormal / 2
    hb = elementwise_steps(sb, gb, b.shape) * fb.min_subnormal / 2
    ea, eb = ua * a64 + ha, ub * b64 + hb
    quant = ea @ (b64 + eb).t() + a64 @ eb.t()
    k = a.shape[1]
    n_terms = k + k / 32 + 4
    accum = n_terms * 2.0**-24 / (1 - n_terms * 2.0**-24) * ((a64 + ea) @ (b64 + eb).t())
    exact = (a.double() @ b.double().t()).abs()
    bound: torch.Tensor = quant + accum + out_unit * (exact + quant + accum) + 2.0**-126
    return bound


@pytest.mark.parametrize("name", [n for n in POLICIES if "floor" not in n])
def test_forward_dx_dw_within_the_a_priori_bound_of_float64(name: str) -> None:
    layer, x2, dy2, y, dx = run(POLICIES[name], 40)
    policy = layer.policy
    w = layer.weight.detach()
    ops = gemm_operands(policy, x2, w, dy2)
    fwd, bwd = policy.format.forward, policy.format.backward
    bf16, f32 = 2.0**-8, 2.0**-24
    bias64 = layer.bias.detach().double()
    w64, x64, dy64 = w.double(), x2.double(), dy2.double()
    checks = [
        (y.double() - bias64, x64 @ w64.t(), gemm_bound(*ops["forward"], fwd, fwd, bf16)),
        (dx.double(), dy64 @ w64, gemm_bound(*ops["dgrad"], bwd, fwd, bf16)),
    ]
    if policy.gw_hp:  # a float32 sum of float32 products: K + 1 roundings of 2**-24
        dw_bound = (len(x2) + 2) * f32 * (dy64.abs().t() @ x64.abs())
    else:
        dw_bound = gemm_bound(*ops["wgrad"], bwd, fwd, f32)
    checks.append((grad(layer.weight).double(), dy64.t() @ x64, dw_bound))
    for got, exact, bound in checks:
        # The forward adds the bias in float32 (one rounding) before the bf16 rounding,
        # whose share for the bias is at most |bias| * 2**-8: 2**-7 covers both.
        slack = bias64.abs() * 2.0**-7 if got is checks[0][0] else 0.0
        assert bool(((got - exact).abs() <= bound + slack).all())


# docs/fp8.md ("The fine-grained linear"): SQNR in dB against float64 of one 160 -> 96 layer,
# 40 rows whose input channels span 1e-2 to 1e2, bf16 activations and weights. Measured
# (forward, dX, dW): row 28.1 / 28.3 / 28.6 (gw_hp dW 55.7), block 29.5 / 28.9 / 29.4,
# mx 28.1 / 28.3 / 28.6; asserted 26 / 26 / 26 (gw_hp 45).
SQNR_FLOOR = 26.0


@pytest.mark.parametrize("flag", ["fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "fp8_mx"])
def test_forward_dx_dw_sqnr_against_float64(flag: str) -> None:
    layer, x2, dy2, y, dx = run(POLICIES[flag], 40, torch.bfloat16)
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    x64, dy64 = x2.bfloat16().double(), dy2.bfloat16().double()
    figures = (
        sqnr(y, x64 @ w.t() + b),
        sqnr(dx, dy64 @ w),
        sqnr(grad(layer.weight), dy64.t() @ x64),
    )
    wgrad = 45 if flag.endswith("gw_hp") else SQNR_FLOOR
    assert figures[0] > SQNR_FLOOR and figures[1] > SQNR_FLOOR and figures[2] > wgrad, figures


# ----- ledgers, training ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICIES))
def test_ledgers_record_the_amax_the_largest_block_step_and_the_elements(name: str) -> None:
    layer, x2, dy2, _, _ = run(POLICIES[name], 40)
    ops = gemm_operands(layer.policy, x2, layer.weight.detach(), dy2)
    recorded = {"input": (x2, ops["forward"][0]), "weight": (layer.weight, ops["forward"][1]),
                "grad": (dy2, ops["dgrad"][0])}  # fmt: skip
    for role, (t, (_, scale, _, _)) in recorded.items():
        op = layer.scaling.operands[role]
        assert torch.equal(ledger_history(op.ledger), t.detach().abs().amax().reshape(1)), role
        largest = blockwise.steps_of_scale(scale).amax().reshape(1)
        assert torch.equal(ledger_step(op.ledger).reshape(1), largest), role
        assert int(op.tally[TALLY_ELEMENTS]) == t.numel(), role


@pytest.mark.parametrize(
    ("text", "saturated"),
    [("e4m3/mx+floor/dynamic/0", 2), ("e4m3/mx/dynamic/0", 0), ("e4m3/block+pow2/dynamic/0", 0),
     ("e4m3/row/dynamic/0", 0), ("e4m3/block/dynamic/0", 0)],
)  # fmt: skip
def test_the_saturated_count_is_recorded_for_input_and_grad(text: str, saturated: int) -> None:
    # One 32-wide block of X's row 0 and of dY's row 1 holds 1.99, 1.85, 1.8 and 1.0. Under
    # mx+floor its step is 2**(floor(log2 1.99) - 8) = 2**-8, so x / step is 509.4, 473.6,
    # 460.8 and 256: the first two pass 464, E4M3's rounding midpoint above 448, and
    # saturate; 1.8 rounds to 448 anyway. Every other element is 0.5 (X) or 0.25 (dY), and
    # the weight a constant: no block of theirs saturates, and no step from a block's own
    # amax (amax, pow2, rceil) saturates anything.
    ctx = ctx_of(text)
    layer = QuantizedLinear(64, 32, ctx=ctx, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.fill_(0.01)
    block = torch.tensor([1.99, 1.85, 1.8, 1.0])
    x = torch.full((4, 64), 0.5)
    x[0, 3:7] = block
    dy = torch.full((4, 32), 0.25)
    dy[1, 10:14] = -block
    (layer(x) * dy).sum().backward()
    stats = scaling_stats(nn.Sequential(layer))["0"]
    assert stats.input.saturated_fraction == saturated / x.numel()
    assert stats.grad.saturated_fraction == saturated / dy.numel()
    assert stats.weight.saturated_fraction == 0.0
    assert stats.input.elements == x.numel() and stats.grad.elements == dy.numel()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_changes_no_gradient_and_records_once(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    def two_layers() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
        convert_to_quantized(model, ComputeCtx.from_flag("fp8_mx", "cpu"), lambda m, fqn: True)
        return model

    plain, checkpointed = two_layers(), two_layers()
    x = torch.randn(24, 64, requires_grad=True)  # the input needs grad for reentrant
    plain(x).square().sum().backward()
    out = checkpoint(checkpointed, x, use_reentrant=reentrant)
    out.square().sum().backward()
    for p, c in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(grad(p), grad(c))
    for name in ("0", "2"):
        for role in ("input", "weight", "grad"):
            want = getattr(plain, name).scaling.operands[role]
            got = getattr(checkpointed, name).scaling.operands[role]
            assert torch.equal(want.tally, got.tally), (name, role)
            assert torch.equal(want.ledger, got.ledger), (name, role)


# docs/fp8.md ("Accuracy"): a 3-layer MLP (two of its linears fp8) learns a noisy target,
# tanh(x0 + x1 + x2 + x3) + 0.1 N(0, 1), from 80 fresh batches of 256 (AdamW, lr 6e-3); its
# validation loss (2048 held-out samples, noise floor 0.01) under each flag is within 10% of
# float32's. Measured at seeds 0-3: fp32 0.020-0.024; rowwise +2.2..+6.5%, rowwise_gw_hp
# +1.6..+5.3%, block +0.4..+4.4%, mx +2.2..+6.7%. Seed 0 here. A broken step rule (every
# block step a quarter of the right one: saturated codes) ends 660-930% above float32 here,
# as it does after 150 batches at lr 3e-3.
TRAIN_TOLERANCE = 0.10
TRAIN_STEPS, TRAIN_LR = 80, 6e-3


def _noisy_target(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 32, generator=gen)
    y = x[:, :4].sum(1, keepdim=True).tanh() + 0.1 * torch.randn(n, 1, generator=gen)
    return x, y


def test_a_small_mlp_trains_under_every_fine_granularity_to_within_10_percent_of_fp32() -> None:
    def val_loss(flag: str) -> float:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 1)
        )
        ctx = ComputeCtx.from_flag(flag, "cpu")
        if ctx.recipe is not None:
            report = convert_to_quantized(
                model, ctx, module_filter=lambda m, fqn: fqn in ("0", "2")
            )
            assert report.converted == ("0", "2")
        opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
        gen = torch.Generator().manual_seed(2)
        for _ in range(TRAIN_STEPS):
            x, y = _noisy_target(gen, 256)
            loss = (model(x) - y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        xv, yv = _noisy_target(torch.Generator().manual_seed(99), 2048)
        with torch.no_grad():
            return float((model.eval()(xv) - yv).square().mean())

    fp32 = val_loss("fp32")
    assert fp32 < 0.03  # learned: the target's variance is about 0.6, its noise 0.01
    for flag in ("fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_block", "fp8_mx"):
        fine = val_loss(flag)
        assert abs(fine - fp32) <= TRAIN_TOLERANCE * fp32, (flag, fine, fp32)


def test_the_gw_hp_wgrad_is_an_ieee_float32_matmul_whatever_the_tf32_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # TF32 would round float32 activations to 10 significant bits on a GPU. The wgrad's
    # matmul runs with fp32_precision "ieee" and the setting is restored after it.
    seen: list[str] = []
    real_mm = torch.mm

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        return real_mm(a, b)

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        monkeypatch.setattr(torch, "mm", mm)
        layer = QuantizedLinear(64, 32, ctx=ComputeCtx.from_flag("fp8_rowwise_gw_hp", "cpu"),
                          dtype=torch.float32)  # fmt: skip
        x = torch.randn(8, 64)
        dy = torch.randn(8, 32)
        (layer(x) * dy).sum().backward()
        assert seen == ["ieee"]
        assert matmul.fp32_precision == "tf32"  # restored
    finally:
        matmul.fp32_precision = before
    assert layer.weight.grad is not None
    assert torch.equal(layer.weight.grad, real_mm(dy.t(), x))


# ----- what it refuses, empty inputs ---------------------------------------------------------


@pytest.mark.parametrize("flag", ["fp8_rowwise", "fp8_block", "fp8_mx"])
def test_serving_fsdp2_fp8_weights_and_amax_reduction_are_refused_clearly(flag: str) -> None:
    gran = ctx_of(POLICIES[flag]).fp8.granularity  # type: ignore[union-attr]
    needle = f"granularity '{gran}' in QuantizedLinear does not support"
    layer = QuantizedLinear(32, 32, ctx=ComputeCtx.from_flag(flag, "cpu"))
    x = torch.randn(4, 32)
    synced = QuantizedLinear(32, 32, ctx=layer.ctx)
    synced.amax_reduce = SimpleNamespace(armed=True, reduces=True, lockstep=False)
    with pytest.raises(ValueError, match=f"{needle} data-parallel amax reduction yet"):
        synced(x)
    plan = Fp8LinearPlan(layer.policy, layer.scaling, Backend.REFERENCE, torch.bfloat16)
    w8 = QuantizedWeight(
        layer.weight.detach().to(torch.float8_e4m3fn), torch.ones(1), torch.float32
    )
    with pytest.raises(ValueError, match=rf"{needle} an fp8 all-gathered weight \(FSDP2\)"):
        fp8_linear(x, w8, None, plan)
    # Every granularity freezes (linear/test_frozen.py); a frozen mx weight runs as it is.
    assert torch.equal(copy.deepcopy(layer).eval().freeze_for_serving()(x), layer.eval()(x))
    # A layer frozen per tensor refuses a fine-grained ctx when it is set (it holds per-tensor
    # codes), and keeps its own.
    frozen = QuantizedLinear(32, 32, ctx=layer.ctx.replace(recipe=Recipe())).freeze_for_serving()
    with pytest.raises(ValueError, match="frozen for serving, its weight held as per-tensor"):
        frozen.ctx = layer.ctx
    assert frozen.policy == Recipe()
    frozen(x)
    empty = QuantizedLinear(32, 64, ctx=ComputeCtx.from_flag(flag, "cpu"))
    assert empty(torch.randn(0, 32)).shape == (0, 64)


@pytest.mark.parametrize("flag", ["fp8_rowwise", "fp8_block", "fp8_mx"])
def test_every_gemm_and_quantize_runs_on_the_layers_backend(
    flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:

    seen: list[tuple[str, Backend]] = []

    def gemm(*args: Any, backend: Backend) -> torch.Tensor:
        seen.append(("gemm", backend))
        return block_scaled_mm(*args, backend=Backend.REFERENCE)

    from computectx.formats.linear import blockwise as blockwise_linear
    from computectx.formats.ops import blockwise as block_ops

    real_quantize = block_ops.quantize_blocks

    def quantize(*args: Any, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(("quantize", backend))
        return real_quantize(*args, backend=Backend.REFERENCE)

    monkeypatch.setattr(blockwise_linear, "block_scaled_mm", gemm)
    monkeypatch.setattr(block_ops, "quantize_blocks", quantize)
    layer = QuantizedLinear(64, 32, ctx=ComputeCtx.from_flag(flag, "cpu"), backend="cublas")
    layer(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert [what for what, _ in seen].count("gemm") == 3
    assert {backend for _, backend in seen} == {Backend.CUBLAS}


def test_the_row_gemm_is_the_reference_gemm_with_per_row_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    a, sa = quantize_tensor(torch.randn(24, 80, generator=gen) * 10, "e4m3", granularity="row")
    b, sb = quantize_tensor(torch.randn(40, 80, generator=gen), "e4m3", granularity="row")
    bias = torch.randn(40, generator=gen)
    for out in (torch.float32, torch.bfloat16):
        want = tensorwise.scaled_mm(tensorwise.GemmArgs(a, b, sa, sb, bias, out))
        assert torch.equal(block_scaled_mm(a, b, sa, "row", sb, "row", bias, out), want)


# ----- a block weight that arrives quantized (FSDP2's fp8 all-gather) -------------------------


def test_a_block_weight_given_as_its_128x128_codes_and_scales_is_used_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from computectx.formats.linear import blockwise
    from computectx.formats.linear.weights import QuantizedBlockWeight

    text = "e4m3/block/dynamic/0"
    layer = QuantizedLinear(K, N, ctx=ctx_of(text), dtype=torch.float32)
    w = layer.weight.detach()
    codes, scale = quantize_tensor(w, "e4m3", granularity="128x128")
    given = QuantizedBlockWeight(codes, scale, torch.float32).requires_grad_()
    plan = Fp8LinearPlan(layer.policy, layer.scaling, Backend.REFERENCE, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(24, K, generator=gen) * torch.logspace(-2, 2, K)
    dy = torch.randn(24, N, generator=gen)
    # The weight's quantize runs only for the high-precision weight; the given blocks are
    # the codes and scales that quantize gives, so everything else is the same, bit for bit.
    seen: list[tuple[int, ...]] = []
    quantize_all = blockwise._quantize_all  # every quantize of the linear goes through it

    def counting(operands: list[tuple[torch.Tensor, str]], *args: Any) -> Any:
        seen.extend(tuple(x.shape) for x, _ in operands)
        return quantize_all(operands, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(blockwise, "_quantize_all", counting)
    results = []
    for weight in (w.clone().requires_grad_(), given):
        seen.clear()
        xr = x.clone().requires_grad_()
        y = fp8_linear(xr, weight, None, plan)
        y.backward(dy)  # type: ignore[no-untyped-call]
        results.append((y, grad(xr), grad(weight), [*seen]))
    (y_hp, dx_hp, dw_hp, q_hp), (y_b, dx_b, dw_b, q_b) = results
    assert torch.equal(y_b, y_hp) and torch.equal(dx_b, dx_hp) and torch.equal(dw_b, dw_hp)
    assert (N, K) in q_hp and (N, K) not in q_b  # the forward quantizes X only
    assert type(dw_b) is torch.Tensor and dw_b.dtype == torch.float32
    # Under row or mx, or in another format, the blocks are refused, naming the weight.
    for other in ("e4m3/row/dynamic/0", "e4m3/mx/dynamic/0", "e5m2/block/dynamic/0"):
        bad = QuantizedLinear(K, N, ctx=ctx_of(other), dtype=torch.float32)
        p = Fp8LinearPlan(bad.policy, bad.scaling, Backend.REFERENCE, torch.bfloat16)
        with pytest.raises(ValueError, match=r"an fp8 all-gathered weight \(FSDP2\)"):
            fp8_linear(x, given, None, p)


def test_fp8_block_weight_checks_its_parts_and_dequantizes_its_blocks() -> None:
    from computectx.formats.linear.weights import QuantizedBlockWeight

    w = torch.randn(200, 160) * torch.logspace(-3, 3, 160)
    codes, scale = quantize_tensor(w, "e4m3", granularity="128x128")
    bw = QuantizedBlockWeight(codes, scale, torch.bfloat16)
    assert bw.shape == (200, 160) and bw.dtype == torch.bfloat16
    want = dequantize_tensor(codes, scale, torch.bfloat16)
    assert torch.equal(bw.dequantize(), want)
    assert torch.equal(bw + 0, want)  # any other op sees the dequantized value
    kept = torch.as_strided(bw, bw.shape, bw.stride())  # FSDP2's view of the gathered weight
    assert isinstance(kept, QuantizedBlockWeight) and kept.fp8_scale is scale
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        QuantizedBlockWeight(codes, scale[:1], torch.float32)
    with pytest.raises(TypeError, match="2-D float8"):
        QuantizedBlockWeight(w, scale, torch.float32)
