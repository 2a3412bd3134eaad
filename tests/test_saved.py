"""What an op keeps for its backward (``computectx.saved``), as ``ctx.activations`` says: the
bytes autograd keeps (counted, not timed), the fp8 group codec's bound, gradients against
``keep`` (exact for ``recompute``, within the codec's bound for ``fp8``), and composition with
checkpointing, saved-tensor hooks and ``torch.compile``."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from computectx import ComputeCtx, DType
from computectx.nn.gemm import Gemm, GemmPath
from computectx.nn.mlp import swiglu
from computectx.nn.precise import apply_rope, rms_norm, rope_tables, softmax
from computectx.saved import E4M3_MAX, decode_groups, encode_groups, saved_call

ROWS, WIDTH = 64, 256
N = ROWS * WIDTH


def _ctx(spec: str) -> ComputeCtx:
    return ComputeCtx.new(DType.BF16, "cpu").with_activations(spec)


def _saved_bytes(run: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """The bytes of every storage autograd keeps for the backward while ``run`` runs (each
    storage once, parameters' not at all), as the demo's ``saved MiB`` counts them."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in skip and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


def _inputs(outlier: float = 200.0) -> tuple[torch.Tensor, torch.nn.Parameter, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, WIDTH, generator=g) * 3
    x[3, 5] = outlier  # one outlier: its group's scale is 200 / 448
    w = torch.nn.Parameter(torch.rand(WIDTH, generator=g) + 0.5)
    dy = torch.randn(ROWS, WIDTH, generator=g)
    return x.to(torch.bfloat16), w, dy.to(torch.bfloat16)


def _norm_grads(spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    x0, w, dy = _inputs()
    x = x0.clone().requires_grad_()
    torch.autograd.backward(rms_norm(_ctx(spec), x, w), dy)
    assert x.grad is not None and w.grad is not None
    return x.grad.float(), w.grad


def _sqnr(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float(10 * torch.log10(exact.pow(2).sum() / (approx - exact).pow(2).sum()))


# ----- bytes kept ----------------------------------------------------------------------------


def test_rms_norm_keeps_its_input_only_as_fp8_groups() -> None:
    x0, w, _ = _inputs()
    kept: dict[str, int] = {}
    for mode in ("keep", "recompute", "fp8"):
        ctx, x = _ctx(f"precise:{mode}"), x0.clone().requires_grad_()
        kept[mode] = _saved_bytes(functools.partial(rms_norm, ctx, x, w), exclude=[w])
    # keep: two float32 copies of x (x lifted, x * inv) and the per-row inverse rms.
    assert kept["keep"] == 2 * 4 * N + 4 * ROWS
    # recompute: x as it arrived (bf16); fp8: one byte per element, a float32 scale per 128.
    assert kept["recompute"] == 2 * N
    assert kept["fp8"] == N + 4 * N // 128
    assert kept["keep"] / kept["fp8"] > 7.7


def test_swiglu_keeps_both_inputs_as_fp8_groups() -> None:
    x0, _, _ = _inputs()
    kept: dict[str, int] = {}
    for mode in ("keep", "recompute", "fp8"):
        ctx = _ctx(f"act_fn:{mode}/group=32")
        gate, up = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        kept[mode] = _saved_bytes(functools.partial(swiglu, ctx, gate, up))
    assert kept["keep"] == 3 * 2 * N  # silu's input, silu(gate) and up, in bf16
    assert kept["recompute"] == 2 * 2 * N
    assert kept["fp8"] == 2 * (N + 4 * N // 32)


def test_the_default_keeps_what_the_ops_save() -> None:
    # precise:keep is the ctx.precise of before: f's own saves, nothing wrapped.
    x0, w, _ = _inputs()
    ctx = ComputeCtx.new(DType.BF16, "cpu")
    x = x0.clone().requires_grad_()
    y = rms_norm(ctx, x, w)
    assert type(y.grad_fn).__name__ == "ToCopyBackward0"
    assert _saved_bytes(lambda: rms_norm(ctx, x, w), exclude=[w]) == 2 * 4 * N + 4 * ROWS


def test_softmax_keeps_only_the_probabilities_the_next_gemm_keeps() -> None:
    # Attention's softmax and its PV GEMM: keep holds the float32 probabilities (softmax's
    # own save) and the bf16 ones (the GEMM's); recompute and fp8 hold the bf16 ones only.
    g = torch.Generator().manual_seed(0)
    scores0 = torch.randn(4, 64, 64, generator=g).bfloat16()
    v = torch.randn(4, 64, 32, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(4, 64, 32, generator=g).bfloat16()
    kept, grads = {}, {}
    for mode in ("keep", "recompute", "fp8"):
        ctx, scores = _ctx(f"attention:{mode}"), scores0.clone().requires_grad_()

        def run(ctx: ComputeCtx = ctx, scores: torch.Tensor = scores) -> torch.Tensor:
            return softmax(ctx, scores, kind="attention") @ v

        kept[mode] = _saved_bytes(run)
        torch.autograd.backward(run(), dy)
        assert scores.grad is not None
        grads[mode] = scores.grad.float()
    n, v_bytes = scores0.numel(), 2 * v.numel()  # the GEMM keeps v too, for dprobs
    assert kept["keep"] == 4 * n + 2 * n + v_bytes
    assert kept["recompute"] == kept["fp8"] == 2 * n + v_bytes
    assert torch.equal(grads["recompute"], grads["fp8"])
    # From the bf16 probabilities (2**-9 relative) instead of the float32 ones.
    assert _sqnr(grads["fp8"], grads["keep"]) > 40


# ----- gradients -----------------------------------------------------------------------------


def test_recompute_gives_keeps_gradients_bit_for_bit() -> None:
    for a, b in zip(_norm_grads("precise:recompute"), _norm_grads("keep"), strict=True):
        assert torch.equal(a, b)


def test_fp8_gradients_are_within_the_codecs_bound_of_keep() -> None:
    # E4M3 keeps 3 mantissa bits: each element within 2**-4 of itself (relative), so about
    # 30 dB per element; the norm's input gradient sees less of it (the row's rms averages).
    (dx, dw), (dx_keep, dw_keep) = _norm_grads("precise:fp8"), _norm_grads("keep")
    assert _sqnr(dx, dx_keep) > 40
    assert _sqnr(dw, dw_keep) > 28


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 300),
    group=st.sampled_from([16, 32, 64, 128]),
    log_scale=st.integers(-30, 30),
    data=st.data(),
)
def test_codec_rounds_each_element_within_half_an_e4m3_step(
    rows: int, width: int, group: int, log_scale: int, data: st.DataObject
) -> None:
    seed = data.draw(st.integers(0, 2**31 - 1))
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    if data.draw(st.booleans()):
        x[0, data.draw(st.integers(0, width - 1))] *= 1000  # an outlier
    codes, scale = encode_groups(x, group)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    # Groups along each row, never across rows: the short ones are one group per row.
    g = min(group, width)
    per_row = -(-width // g)
    assert scale.shape == (rows * per_row,) and codes.shape == (*scale.shape, g)
    back = decode_groups(codes, scale, x.shape, torch.float32)
    # Normal E4M3 codes (|c| >= 2**-6) round within 2**-4 relative; below, within half the
    # smallest subnormal step, 2**-10, of the group's scale.
    steps = scale.reshape(rows, per_row).repeat_interleave(g, dim=1)[:, :width]
    bound = torch.maximum(x.abs() * 2.0**-4, steps * 2.0**-10)
    assert bool(((back - x).abs() <= bound).all())
    # Each group's largest element codes to +-448 exactly: nothing saturates.
    assert float(codes.float().abs().amax()) == E4M3_MAX


def test_codec_codes_each_row_alone() -> None:
    # A row decodes the same whatever rows share its tensor: a batch split over ranks or
    # micro-batches, or an MoE's token permutation, codes each token as the whole batch does.
    gen = torch.Generator().manual_seed(0)
    for width in (4, 32, 128, 200):
        x = torch.randn(6, width, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)
        whole = decode_groups(*encode_groups(x, 128), x.shape, torch.float32)
        for rows in ([0], [5, 1], [2, 3, 4]):
            part = x[rows]
            alone = decode_groups(*encode_groups(part, 128), part.shape, torch.float32)
            assert torch.equal(alone, whole[rows]), (width, rows)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 5), (2, 3, 130)])
def test_codec_round_trips_any_shape(shape: tuple[int, ...]) -> None:
    x = torch.full(shape, 0.75)
    codes, scale = encode_groups(x, 64)
    assert torch.equal(decode_groups(codes, scale, x.shape, torch.bfloat16), x.bfloat16())


def test_codec_decodes_a_groups_largest_element_as_its_docstring_says() -> None:
    # Exactly for bf16 and f16; within a float32 ulp for float32 (the scale absmax / 448 is
    # rounded); under 448 * 2**-126 (the scale raised to the smallest normal) as any element.
    g = torch.Generator().manual_seed(0)
    top = torch.exp(torch.empty(4096, 1, dtype=torch.float64).uniform_(-80, 80, generator=g))
    x = torch.cat([top, -top], 0) * torch.tensor([1.0, 0.5, -0.25], dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xs = x.to(dtype)
        xs = xs[(xs[:, 0].double().abs() >= 448 * 2**-126) & xs[:, 0].isfinite()]
        back = decode_groups(*encode_groups(xs, 16), xs.shape, dtype)[:, 0].double()
        error = ((back - xs[:, 0].double()) / xs[:, 0].double()).abs().max()
        assert error <= (0 if dtype != torch.float32 else 2**-23), dtype
    tiny = torch.tensor([[1e-37, 0.0]])
    assert decode_groups(*encode_groups(tiny, 16), tiny.shape, torch.float32)[0, 0] != 1e-37


def test_codec_keeps_zeros_and_infinities() -> None:
    # An attention mask's -inf must come back -inf (a finite 448 would unmask the key).
    x = torch.zeros(2, 256)
    x[1, 128:131] = torch.tensor([-math.inf, math.inf, 3.0])
    codes, scale = encode_groups(x, 128)
    back = decode_groups(codes, scale, x.shape, torch.bfloat16)
    assert torch.equal(scale, torch.tensor([1.0, 1.0, 1.0, 3.0 / 448]))
    assert torch.equal(back, x.bfloat16())
    nan = encode_groups(torch.tensor([math.nan, 1.0]), 16)
    assert bool(decode_groups(*nan, torch.Size([2]), torch.float32)[0].isinf())


def test_fp8_keeps_a_masked_softmax_finite() -> None:
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    x = torch.randn(8, 8).masked_fill(~mask, -math.inf).requires_grad_()
    ctx = _ctx("attention:fp8")
    y = softmax(ctx, x, kind="attention")
    torch.autograd.backward(y, torch.randn(8, 8))
    assert x.grad is not None and bool(x.grad.isfinite().all())
    assert bool((x.grad[~mask] == 0).all())


# ----- composition ---------------------------------------------------------------------------


def _block(ctx: ComputeCtx, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    cos, sin = rope_tables(WIDTH, ROWS)

    def run(x: torch.Tensor) -> torch.Tensor:
        h = apply_rope(ctx, rms_norm(ctx, x, w), cos, sin)
        return softmax(ctx, swiglu(ctx, h, 2 * h)).float().pow(2).sum()

    return run


def _grads_of(
    run: Callable[[torch.Tensor], torch.Tensor], w: torch.nn.Parameter
) -> list[torch.Tensor]:
    x0, _, _ = _inputs()
    x = x0.clone().requires_grad_()
    w.grad = None
    torch.autograd.backward(run(x))
    assert x.grad is not None and w.grad is not None
    return [x.grad, w.grad]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_stays_exact(reentrant: bool) -> None:
    _, w, _ = _inputs()
    run = _block(_ctx("precise:fp8/act_fn:fp8"), w)
    plain = _grads_of(run, w)
    checkpointed = _grads_of(lambda x: checkpoint(run, x, use_reentrant=reentrant), w)
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)


def test_hooks_around_forward_and_backward_see_only_what_the_forward_kept() -> None:
    # The demo's counter (and save_on_cpu) span the backward too: the backward's run of f
    # again is hidden from them (torch.func.vjp would refuse to run under them at all).
    _, w, _ = _inputs()
    run = _block(_ctx("precise:fp8/act_fn:fp8"), w)
    plain = _grads_of(run, w)
    with torch.autograd.graph.save_on_cpu():
        offloaded = _grads_of(run, w)
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a, b)
    x0, _, _ = _inputs()
    x = x0.clone().requires_grad_()
    assert _saved_bytes(lambda: torch.autograd.backward(run(x)), exclude=[w]) == _saved_bytes(
        lambda: run(x0.clone().requires_grad_()), exclude=[w]
    )


def test_compiles_whole_with_no_graph_break_and_the_eager_gradients() -> None:
    _, w, _ = _inputs()
    run = _block(_ctx("precise:fp8/act_fn:recompute"), w)
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    for a, b in zip(_grads_of(run, w), _grads_of(compiled, w), strict=True):
        assert torch.equal(a, b)


def test_an_integer_operand_compiles_as_in_eager_mode() -> None:
    def run(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return saved_call(lambda t, j: t[j] * 2, x, i, mode="recompute")

    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    grads = []
    for g in [run, compiled]:
        x = torch.randn(6, 16, requires_grad=True)
        torch.autograd.backward(g(x, torch.tensor([0, 2])).sum())
        grads.append(x.grad)
    assert grads[0] is not None and grads[1] is not None and torch.equal(grads[0], grads[1])


def test_a_custom_autograd_function_in_f_compiles_to_the_eager_gradients() -> None:
    # Compiled, the backward differentiates f with torch.func.vjp; dynamo (torch 2.13) read
    # needs_input_grad False for every input of a custom autograd.Function that f handed
    # straight from its arguments, and the Function returned no gradient for them (Gemm's
    # upcast matmul: q's and v's gradients were zero, the fp8 linear's weight's too).
    gemm = Gemm(GemmPath.UPCAST, torch.bfloat16)
    fp8 = Gemm(GemmPath.UPCAST, torch.bfloat16, "fp8")

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fp8.linear(gemm.matmul(gemm.matmul(q, k.mT), v), w)

    def run(*ts: torch.Tensor) -> torch.Tensor:
        return saved_call(f, *ts, mode="recompute", inputs=3)

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(8, 16, generator=g, dtype=torch.bfloat16) for _ in range(4)]
    torch._dynamo.reset()
    grads = []
    for call in (run, torch.compile(run, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in tensors]
        torch.autograd.backward(call(*leaves).float().pow(2).sum())
        grads.append([t.grad for t in leaves])
    torch._dynamo.reset()
    for a, b in zip(*grads, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)


# ----- refusals ------------------------------------------------------------------------------


def test_a_closure_over_a_trainable_tensor_is_refused() -> None:
    x0, w, _ = _inputs()
    x = x0.clone().requires_grad_()
    ctx = _ctx("precise:fp8")
    with pytest.raises(ValueError, match=r"closes over the variable 'w'.*Pass it as an operand"):
        ctx.precise(x, lambda t: t * w)
    torch.autograd.backward(ctx.precise(x, lambda t, v: t * v, w).sum())  # an operand: fine
    assert w.grad is not None
    # Under keep nothing runs twice, so a closure is as fine as ever.
    torch.autograd.backward(_ctx("keep").precise(x, lambda t: t * w).sum())


class _Scale:  # a callable holding a weight that is no Module
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.w


_GLOBAL_WEIGHTS: list[torch.Tensor] = []


@pytest.mark.parametrize("mode", ["recompute", "fp8"])
def test_a_weight_reached_any_other_way_is_refused_by_the_first_backward(mode: str) -> None:
    w = torch.nn.Parameter(torch.rand(16) + 0.5)
    _GLOBAL_WEIGHTS[:] = [w]
    ws = [w]
    routes: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda t, w=w: t * w,  # type: ignore[misc]
        functools.partial(torch.nn.functional.rms_norm, normalized_shape=(16,), weight=w),
        lambda t: t * ws[0],
        _Scale(w),
        lambda t: t * _GLOBAL_WEIGHTS[0],
        lambda t: t * (w * 2),  # a tensor computed from one
    ]
    ctx = ComputeCtx.new(DType.F32, "cpu").with_activations(f"precise:{mode}")
    for f in routes:
        x = torch.randn(4, 16, requires_grad=True)
        with pytest.raises(ValueError, match="Pass it as an operand"):
            torch.autograd.backward(ctx.precise(x, f).sum())

    class Norm(torch.nn.Module):  # reads self.eps, passes its weight as an operand: fine
        def __init__(self) -> None:
            super().__init__()
            self.eps, self.weight = 1e-6, torch.nn.Parameter(torch.ones(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def f(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.rms_norm(t, (16,), v, self.eps)

            return ctx.precise(x, f, self.weight)

    norm = Norm()
    torch.autograd.backward(norm(torch.randn(4, 16, requires_grad=True)).sum())
    assert norm.weight.grad is not None


def test_fp8_keeps_an_input_it_does_not_code_as_it_is() -> None:
    # Integer ids, complex values, float64 beyond float32's range: exact, as recompute.
    w0 = torch.randn(1100, 4)
    ids = torch.tensor([1000, 1001, 1003, 1017])
    z = torch.randn(8, dtype=torch.complex64)
    big = torch.tensor([1e300, -3e-300, 2.0], dtype=torch.float64)
    cases: list[tuple[Callable[..., torch.Tensor], torch.Tensor]] = [
        (lambda i, w: torch.nn.functional.embedding(i, w), ids),
        (lambda t, w: (t * t).abs().sum() * w.sum(), z),
        (lambda t, w: (t * 1e-10).sum() * w.sum(), big),
    ]
    for f, x in cases:
        grads = []
        for mode in ["recompute", "fp8"]:
            w = w0.clone().requires_grad_()
            xs = x.clone().requires_grad_(x.is_floating_point() or x.is_complex())
            torch.autograd.backward(saved_call(f, xs, w, mode=mode).sum())  # type: ignore[arg-type]
            grads += [w.grad, xs.grad]
        for a, b in zip(grads[:2], grads[2:], strict=True):
            assert (a is None and b is None) or (a is not None and b is not None and a.equal(b))


@pytest.mark.parametrize("mode", ["recompute", "fp8", "offload"])
def test_a_double_backward_is_refused_naming_keep(mode: str) -> None:
    ctx = ComputeCtx.new(DType.F32, "cpu").with_activations(f"precise:{mode}")
    x, w = torch.randn(4, 32, requires_grad=True), torch.rand(32, requires_grad=True)
    loss = rms_norm(ctx, x, w).sum()
    with pytest.raises(RuntimeError, match=r"create_graph=True.*'precise:keep'"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.parametrize("mode", ["recompute", "fp8"])
def test_a_dropout_in_f_draws_the_forwards_mask_again(mode: str) -> None:
    ctx = ComputeCtx.new(DType.F32, "cpu").with_activations(f"precise:{mode}")
    x = torch.randn(4, 32, requires_grad=True)
    y = ctx.precise(x, lambda t: torch.nn.functional.dropout(t, 0.5, training=True))
    torch.manual_seed(7)  # the backward restores the forward's state, whatever came since
    torch.autograd.backward(y, torch.ones_like(y))
    assert x.grad is not None and torch.equal(x.grad != 0, y != 0)
    after = torch.rand(4)  # and gives the state it found back
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))


_BAD_ARGUMENTS: list[tuple[dict[str, object], str]] = [
    ({"mode": "bogus"}, "unknown save mode 'bogus'; accepted: keep, fp8, off"),
    ({"mode": "FP8"}, "unknown save mode 'FP8'.*as spelled"),  # the SaveMode values, exactly
    ({"mode": "keep", "group": 7}, "group=7 is not one of 16, 32, 64, 128"),
    ({"mode": "fp8", "group": -1}, "group=-1 is not one of"),
    ({"mode": "fp8", "group": 10**8}, "group=100000000 is not one of"),
    ({"mode": "fp8", "group": 2.5}, "group=2.5 is not one of"),
    ({"mode": "recompute", "group": True}, "group=True is not one of"),
    ({"mode": "fp8", "inputs": 0}, "inputs=0 of 2 tensors"),
    ({"mode": "keep", "inputs": 3}, "inputs=3 of 2 tensors"),
    ({"mode": "fp8", "kind": "nonsense"}, "unknown activation kind 'nonsense'"),
]


@pytest.mark.parametrize("path", ["grad", "no_grad", "frozen"])
def test_bad_arguments_are_refused_on_every_path_before_f_runs(path: str) -> None:
    # Checked whether or not a graph is built (before: only with one), before f runs.
    ran = []

    def f(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ran.append(1)
        return t * w

    w = torch.ones(4, requires_grad=path != "frozen")
    with torch.set_grad_enabled(path != "no_grad"):
        for kwargs, message in _BAD_ARGUMENTS:
            with pytest.raises(ValueError, match=message):
                saved_call(f, torch.randn(4), w, **kwargs)  # type: ignore[arg-type]
    assert not ran


def test_offload_on_a_cpu_keeps_the_input_as_it_is_and_gives_keeps_gradients() -> None:
    # A CPU tensor already lives in host memory: offload keeps it as recompute does
    # (tests/test_offload.py: the device path through a stand-in for CUDA's streams).
    x0, w, _ = _inputs()
    kept = _saved_bytes(
        lambda: rms_norm(_ctx("precise:offload"), x0.clone().requires_grad_(), w), [w]
    )
    assert kept == N * 2  # x in bf16
    assert all(
        torch.equal(a, b)
        for a, b in zip(_norm_grads("precise:offload"), _norm_grads("keep"), strict=True)
    )
    for spec in ("softmax", "swiglu"):
        x = x0.clone().requires_grad_()
        ctx = _ctx("precise:offload/act_fn:offload")
        y = softmax(ctx, x) if spec == "softmax" else swiglu(ctx, x, x)
        torch.autograd.backward(y, torch.ones_like(y))
        assert x.grad is not None and bool(x.grad.isfinite().all())
