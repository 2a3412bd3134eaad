"""MoE: routing, grouped experts and the combine equal a naive per-token loop over experts;
load balancing (auxiliary-loss-free bias, auxiliary loss) by its formulas; ByteLM with
experts trains; fp8 experts; one fullgraph compile."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from torch.nn import functional

from computectx import ComputeCtx, DType
from computectx.formats import Backend, QuantizedExperts, Recipe, convert_to_quantized
from computectx.nn import (
    MLP,
    ByteLM,
    GemmPath,
    GroupedExperts,
    LMConfig,
    MoE,
    Router,
    grouped_linear,
)
from computectx.nn.moe import update_biases

CPU = torch.device("cpu")
F32 = ComputeCtx.parity(CPU)
F64 = ComputeCtx.new(DType.F64, CPU)
BF16 = ComputeCtx.new(DType.BF16, CPU)
DIM, HIDDEN, E, K = 16, 8, 4, 2


def _moe(ctx: ComputeCtx = F32, seed: int = 0, **kw: object) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(ctx, DIM, HIDDEN, E, K, **kw)  # type: ignore[arg-type]
    return moe


def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The block token by token, expert by expert, in plain torch."""
    r = moe.router
    out = []
    for t in x.reshape(-1, moe.dim):
        logits = r.weight.to(t.dtype) @ t
        scores = torch.sigmoid(logits) if r.score == "sigmoid" else torch.softmax(logits, -1)
        chosen = torch.topk(scores + r.bias.to(t.dtype), moe.top_k).indices
        picked = scores[chosen]
        if r.renormalize:
            picked = picked / picked.sum()
        picked = picked * r.route_scale
        y = torch.zeros_like(t)
        for w, e in zip(picked, chosen.tolist(), strict=True):
            h = moe.experts.gate_up[e].to(t.dtype) @ t
            act = functional.silu(h[: moe.hidden]) * h[moe.hidden :]
            y = y + w * (moe.experts.down[e].to(t.dtype) @ act)
        if moe.shared is not None:
            y = y + moe.shared(t[None])[0]
        out.append(y)
    return torch.stack(out).reshape(x.shape)


def _grads(moe: MoE, x: torch.Tensor, y: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    params = [x, *(p for p in moe.parameters())]
    return list(torch.autograd.grad(y, params, g))


@pytest.mark.parametrize(
    ("ctx", "tol"),
    [(F32, 2e-6), (F64, 1e-13)],  # F64: the dense twin (grouped_mm has no float64)
    ids=["f32", "f64"],
)
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("n_shared", [0, 2])
def test_moe_equals_a_naive_loop_over_tokens_and_experts(
    ctx: ComputeCtx, tol: float, score: str, n_shared: int
) -> None:
    moe = _moe(ctx, score=score, n_shared=n_shared, route_scale=1.5)
    dt = ctx.compute.torch
    with torch.no_grad():  # a bias that changes the selection, not the weights
        moe.router.bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    x = torch.randn(3, 5, DIM, dtype=dt, requires_grad=True)
    y, ref = moe(x), _naive(moe, x)
    assert y.dtype == dt and y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    g = torch.randn_like(y)
    for got, want in zip(_grads(moe, x, y, g), _grads(moe, x, ref, g), strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert int(moe.last_load.sum()) == 15 * K


def test_experts_without_tokens_get_zero_gradients_and_zero_load() -> None:
    moe = _moe()
    with torch.no_grad():  # every token picks experts 1 and 3
        moe.router.bias.copy_(torch.tensor([0.0, 10.0, 0.0, 10.0]))
    x = torch.randn(7, DIM, requires_grad=True)
    y = moe(x)
    torch.testing.assert_close(y, _naive(moe, x), rtol=2e-6, atol=2e-6)
    assert moe.last_load.tolist() == [0, 7, 0, 7]
    y.square().sum().backward()
    for grad in (moe.experts.gate_up.grad, moe.experts.down.grad):
        assert grad is not None
        assert grad[[0, 2]].eq(0).all() and grad[[1, 3]].ne(0).any()


def test_no_tokens_at_all() -> None:
    moe = _moe()
    y = moe(torch.randn(0, DIM))
    assert y.shape == (0, DIM) and moe.last_load.tolist() == [0] * E


@pytest.mark.parametrize("route_scale", [1.0, 2.5])
def test_sigmoid_weights_are_the_picked_scores_normalized(route_scale: float) -> None:
    moe = _moe(score="sigmoid", route_scale=route_scale)
    with torch.no_grad():
        moe.router.bias.copy_(torch.tensor([0.0, 5.0, 0.0, 0.0]))
    x = torch.randn(9, DIM)
    weights, chosen, probs = moe.router(x)
    assert weights.dtype == torch.float32 and chosen.dtype == torch.int64
    torch.testing.assert_close(weights.sum(-1), torch.full((9,), route_scale))
    assert (chosen[:, 0] == 1).all()  # the bias selects ...
    sig = torch.sigmoid(x @ moe.router.weight.T)
    picked = sig.gather(-1, chosen)  # ... but the unbiased scores weigh
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True) * route_scale)
    torch.testing.assert_close(probs, sig / sig.sum(-1, keepdim=True))


def test_the_router_is_precise_under_bf16_and_never_a_linear() -> None:
    moe = _moe(BF16)
    assert not isinstance(moe.router, torch.nn.Linear)
    x = torch.randn(6, DIM).bfloat16()
    weights, _, probs = moe.router(x)
    assert weights.dtype == probs.dtype == torch.float32
    assert moe(x).dtype == torch.bfloat16


def test_bf16_moe_is_the_f32_moe_within_bf16_rounding() -> None:
    wide, narrow = _moe(F32, n_shared=1), _moe(BF16, n_shared=1)
    assert narrow.experts.path in (GemmPath.NATIVE, GemmPath.UPCAST)
    x = torch.randn(10, DIM)
    # The routing at f32 from bf16 inputs: the same experts as the f32 block's almost surely.
    y = narrow(x.bfloat16())
    assert narrow.last_load.sum() == 10 * K
    torch.testing.assert_close(y.float(), wide(x.bfloat16().float()), rtol=2**-6, atol=2e-3)


def test_aux_free_bias_moves_against_the_load_and_only_between_steps() -> None:
    moe = _moe(bias_rate=0.01)
    with torch.no_grad():
        moe.router.bias.copy_(torch.tensor([1.0, 1.0, 0.0, 0.0]))  # experts 0, 1 take all
    moe.train()
    moe(torch.randn(5, DIM))
    moe(torch.randn(3, DIM))
    assert moe.tokens_per_expert.tolist() == [8, 8, 0, 0]
    assert moe.last_load.tolist() == [3, 3, 0, 0]
    assert moe.router.bias.tolist() == [1.0, 1.0, 0.0, 0.0]  # the forward never moves it
    moe.update_bias()
    torch.testing.assert_close(moe.router.bias, torch.tensor([0.99, 0.99, 0.01, 0.01]))
    assert moe.tokens_per_expert.tolist() == [0] * E
    moe.eval()
    moe(torch.randn(5, DIM))
    assert moe.tokens_per_expert.tolist() == [0] * E  # eval forwards are not counted
    moe.update_bias()  # nothing counted: no step
    torch.testing.assert_close(moe.router.bias, torch.tensor([0.99, 0.99, 0.01, 0.01]))
    # A load given (all-reduced elsewhere) instead of the local count; a tie stays put.
    moe.update_bias(torch.tensor([4, 2, 3, 3]))
    torch.testing.assert_close(moe.router.bias, torch.tensor([0.98, 1.0, 0.01, 0.01]))


def test_aux_free_balancing_evens_out_a_skewed_router() -> None:
    moe = _moe(bias_rate=0.02)
    gen = torch.Generator().manual_seed(0)
    skew = torch.randn(DIM, generator=gen)
    with torch.no_grad():  # expert 0 scores high on tokens near `skew`
        moe.router.weight[0].add_(0.1 * skew)
    moe.train()
    spread = []
    for _ in range(40):
        moe(torch.randn(64, DIM, generator=gen) + skew)
        spread.append(int(moe.last_load.max() - moe.last_load.min()))
        moe.update_bias()
    assert sum(spread[-10:]) / 10 < spread[0] / 2, spread
    assert moe.router.bias[0] < 0


def test_bias_and_balance_only_for_aux_free() -> None:
    moe = _moe(balance="none")
    moe.train()
    moe(torch.randn(5, DIM))
    moe.update_bias()
    assert moe.router.bias.eq(0).all() and moe.aux_loss is None


def test_aux_loss_is_the_switch_formula_and_trains_the_router() -> None:
    moe = _moe(balance="aux_loss", aux_coef=0.1)
    moe.train()
    x = torch.randn(10, DIM)
    moe(x)
    assert moe.aux_loss is not None
    probs = torch.softmax(x @ moe.router.weight.T, -1)
    chosen = torch.topk(probs, K).indices
    f = torch.bincount(chosen.reshape(-1), minlength=E).float() / (10 * K)
    torch.testing.assert_close(moe.aux_loss, 0.1 * E * (f * probs.mean(0)).sum())
    (grad,) = torch.autograd.grad(moe.aux_loss, moe.router.weight)
    assert grad.abs().sum() > 0
    moe.eval()
    moe(x)
    assert moe.aux_loss is None


def test_shared_experts_add_one_mlp_of_their_width() -> None:
    moe = _moe(n_shared=3)
    assert isinstance(moe.shared, MLP) and moe.shared.up.out_features == 3 * HIDDEN
    x = torch.randn(4, DIM)
    with_shared, shared = moe(x), moe.shared(x)
    moe.shared = None
    torch.testing.assert_close(with_shared - moe(x), shared, rtol=1e-5, atol=1e-6)


def test_dispatch_hook_replaces_the_expert_call() -> None:
    moe = _moe()
    x = torch.randn(6, DIM)
    want = moe(x)
    seen: list[torch.Tensor] = []

    def dispatch(xs: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        seen.append(counts)
        out: torch.Tensor = experts(xs, torch.cumsum(counts, 0, dtype=torch.int32))
        return out

    moe.dispatch = dispatch
    torch.testing.assert_close(moe(x), want, rtol=0, atol=0)
    assert seen[0].dtype == torch.int64 and seen[0].tolist() == moe.last_load.tolist()


def _offs(*ends: int) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def _per_group(x: torch.Tensor, w: torch.Tensor, ends: list[int]) -> torch.Tensor:
    out, start = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype), 0
    for g, end in enumerate(ends):
        out[start:end] = x[start:end] @ w[g].T
        start = end
    return out


@pytest.mark.parametrize(("k", "n"), [(16, 8), (6, 5)])  # 6, 5: padded to 16 bytes
def test_grouped_linear_groups_of_any_size_and_rows_past_the_end(k: int, n: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(11, k, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(4, n, k).requires_grad_()
    ends = [3, 3, 7, 9]  # an empty group; rows 9, 10 belong to none
    y = grouped_linear(x, w, _offs(*ends), GemmPath.WIDE)
    ref = _per_group(x, w, ends)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    assert y[9:].eq(0).all()
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(gx, rx, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-6, atol=1e-6)
    assert gx[9:].eq(0).all() and gw[1].eq(0).all()


def test_upcast_is_a_float32_grouped_gemm_rounded_once() -> None:
    torch.manual_seed(0)
    x = torch.randn(12, 32).bfloat16().requires_grad_()
    w = torch.randn(3, 16, 32).bfloat16().requires_grad_()
    offs = _offs(5, 5, 12)
    y = grouped_linear(x, w, offs, GemmPath.UPCAST)
    want = functional.grouped_mm(x.float(), w.float().transpose(-2, -1), offs=offs).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    torch.autograd.backward(y, torch.ones_like(y))
    assert x.grad is not None and w.grad is not None
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    ref = _per_group(x.detach().float(), w.detach().float(), [5, 5, 12])
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-2)


BAD_OFFS: list[tuple[object, type[Exception], str]] = [
    (torch.tensor([1, 2, 3, 5]), TypeError, "int32"),
    (torch.tensor([1, 2, 3, 5], dtype=torch.float32), TypeError, "int32"),
    ([1, 2, 3, 5], TypeError, "int32 tensor"),
    (torch.tensor([[1, 2, 3, 5]], dtype=torch.int32), ValueError, "1-D"),
    (_offs(2, 5), ValueError, r"E = 4 groups"),
    (_offs(3, 1, 4, 5), ValueError, r"offs\[1\] = 1 is below offs\[0\] = 3"),
    (_offs(-1, 2, 3, 5), ValueError, r"offs\[0\] = -1 is negative"),
    (_offs(1, 2, 3, 9), ValueError, r"offs\[3\] = 9 is past the 5 rows"),
]


@pytest.mark.parametrize("fp8", [False, True], ids=["high_precision", "fp8"])
def test_grouped_experts_one_check_for_both_paths(fp8: bool) -> None:
    # Before: the high-precision path took decreasing/negative offs (wrong rows) and clamped
    # ends past M; the fp8 path refused them. Now one checker, one message, both paths.
    experts = GroupedExperts(F32, DIM, HIDDEN, E)
    if fp8:
        experts.fp8 = QuantizedExperts(Recipe.parse("e4m3/row/dynamic/0"), Backend.REFERENCE)
    x = torch.randn(5, DIM)
    for offs, error, match in BAD_OFFS:
        with pytest.raises(error, match=match):
            experts(x, offs)
    with pytest.raises(ValueError, match=r"x is \[M, K\] = \(5, 8\)"):
        experts(torch.randn(5, 8), _offs(1, 2, 3, 5))
    with pytest.raises(TypeError, match="x must be one of"):
        experts(torch.ones(5, DIM, dtype=torch.int64), _offs(1, 2, 3, 5))
    with pytest.raises(ValueError, match="2-D"):
        experts(torch.randn(5), _offs(1, 2, 3, 5))
    for offs, error, match in BAD_OFFS[3:]:  # grouped_linear, the bare function, too
        with pytest.raises(error, match=match):
            grouped_linear(x, experts.gate_up, offs, GemmPath.UPCAST)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"top_k": 5}, r"top_k must lie in \[1, n_experts=4\]"),
        ({"balance": "switch"}, "balance must be one of 'aux_free', 'aux_loss', 'none'"),
        ({"score": "relu"}, "score must be one of 'softmax', 'sigmoid'"),
        ({"bias_rate": -1.0}, "bias_rate must be a finite number >= 0"),
    ],
)
def test_moe_rejects_bad_settings(kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"top_k": K, **kw}
    top_k = args.pop("top_k")
    with pytest.raises(ValueError, match=match):
        MoE(F32, DIM, HIDDEN, E, top_k, **args)  # type: ignore[arg-type]


def _tiny_moe_lm(**kw: object) -> LMConfig:
    fields: dict[str, object] = {
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "d_ff": 32,
        "max_len": 32,
        "n_experts": 4,
        "top_k": 2,
        **kw,
    }
    return LMConfig(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("balance", ["aux_free", "aux_loss"])
def test_byte_lm_with_experts_trains(balance: str) -> None:
    torch.manual_seed(0)
    cfg = _tiny_moe_lm(moe_balance=balance, n_shared_experts=1, moe_score="sigmoid")
    model = ByteLM(F32, cfg)
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (4, 17))
    losses = []
    for _ in range(8):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        losses.append(loss.item())
        aux = model.aux_loss()
        assert (aux.item() > 0) == (balance == "aux_loss")
        opt.zero_grad()
        torch.autograd.backward(loss + aux)
        opt.step()
        model.update_expert_bias()
    assert losses[-1] < losses[0] - 0.5, losses
    load = model.expert_load()
    assert load.shape == (2, 4) and load.sum(1).tolist() == [4 * 16 * 2] * 2
    moved = any(m.router.bias.ne(0).any() for m in model.moe_layers())
    assert moved == (balance == "aux_free")


def test_dense_byte_lm_has_no_expert_load() -> None:
    model = ByteLM(F32, LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=32, max_len=8))
    assert model.moe_layers() == [] and model.expert_load().shape == (0, 0)
    assert float(model.aux_loss()) == 0.0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n_experts": 0, "top_k": 4}, r"top_k=4 configure experts, but n_experts=0"),
        ({"n_experts": 0, "moe_score": "sigmoid"}, "moe_score='sigmoid' configure experts"),
        ({"n_experts": 2, "top_k": 3}, "top_k=3 exceeds n_experts=2"),
        ({"moe_score": "tanh"}, "moe_score"),
        ({"moe_balance": "switch"}, "moe_balance"),
        ({"moe_hidden": 24}, "multiple of 16"),
    ],
)
def test_lm_config_rejects_inconsistent_experts(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match) as caught:
        _tiny_moe_lm(**kw)
    assert not isinstance(caught.value, ValidationError) and "pydantic" not in str(caught.value)


def test_lm_config_moe_hidden_defaults_to_d_ff() -> None:
    model = ByteLM(F32, _tiny_moe_lm(d_ff=48, n_layers=1))
    assert model.moe_layers()[0].hidden == 48
    assert ByteLM(F32, _tiny_moe_lm(moe_hidden=16, n_layers=1)).moe_layers()[0].hidden == 16


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.detach().double(), got.detach().double()
    return 10 * math.log10(ref.square().sum() / (ref - got).square().sum())


def test_fp8_ctx_runs_the_experts_in_fp8_and_never_the_router() -> None:
    fp8 = ComputeCtx.from_flag("fp8_e4m3_dynamic", CPU)
    torch.manual_seed(0)
    moe = MoE(fp8, 32, 16, E, K, n_shared=1)  # fp8 GEMM tiles: widths of 16
    hp = MoE(BF16, 32, 16, E, K, n_shared=1)
    loaded = hp.load_state_dict(moe.state_dict(), strict=False)
    assert loaded.missing_keys == [] and all("fp8_" in k for k in loaded.unexpected_keys)
    assert isinstance(moe.experts.fp8, QuantizedExperts) and moe.experts.fp8.policy == fp8.fp8
    assert type(moe.router) is Router and hp.experts.fp8 is None
    x = torch.randn(24, 32).bfloat16()
    assert _sqnr(hp(x), moe(x)) > 20
    model = ByteLM(fp8, _tiny_moe_lm(n_layers=1))
    assert "blocks.0.mlp.experts" in model.fp8_layers()
    assert not any("router" in name for name in model.fp8_layers())


def test_convert_to_fp8_converts_grouped_experts() -> None:
    model = ByteLM(BF16, _tiny_moe_lm(n_layers=1))
    fp8 = ComputeCtx.from_flag("fp8_e4m3_dynamic", CPU)
    report = convert_to_quantized(model, fp8, min_features=16)
    assert "blocks.0.mlp.experts" in report.experts
    assert not any("router" in name for name in report.converted)
    assert model.moe_layers()[0].experts.fp8 is not None
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.isfinite().all()


def test_moe_compiles_fullgraph() -> None:
    moe = _moe(BF16, n_shared=1)
    moe.train()
    x = torch.randn(2, 6, DIM).bfloat16().requires_grad_()
    eager = moe(x)
    (eager_grad,) = torch.autograd.grad(eager.float().square().sum(), x)
    moe.tokens_per_expert.zero_()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got.float().square().sum(), x)
    # Compiled, the bf16 grouped GEMMs are grouped_mm's own (torch's fake kernel takes only
    # bf16): float32 accumulation too, in another order, so a bf16 ulp here and there.
    torch.testing.assert_close(got, eager, rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(got_grad, eager_grad, rtol=2**-6, atol=1e-2)
    assert int(moe.tokens_per_expert.sum()) == 12 * K  # the buffer update ran
    assert moe.last_load.tolist() == moe.tokens_per_expert.tolist()


def test_no_rows_give_empty_outputs_and_zero_expert_gradients() -> None:
    ctx = ComputeCtx.new(DType.BF16, "cpu")
    experts = GroupedExperts(ctx, 32, 16, 4)
    x = torch.zeros(0, 32, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.zeros(4, dtype=torch.int32)
    y = experts(x, offs)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert experts.gate_up.grad is not None and experts.down.grad is not None
    assert not experts.gate_up.grad.any() and not experts.down.grad.any()


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"top_k": 2.0}, TypeError, "top_k must be an int.*float 2.0"),
        ({"top_k": True}, TypeError, "top_k must be an int.*bool True"),
        ({"top_k": "2"}, TypeError, "top_k must be an int.*str '2'"),
        ({"top_k": 5}, ValueError, r"top_k must lie in \[1, n_experts=4\], got 5"),
        ({"n_shared": 1.5}, TypeError, "n_shared must be an int.*1.5"),
        ({"n_shared": -1}, ValueError, r"n_shared must be an int in \[0, "),
        ({"n_experts": 0}, ValueError, r"n_experts must be an int in \[1, "),
        ({"dim": 2**40}, ValueError, r"dim must be an int in \[1, 2147483647\]"),
        ({"hidden": None}, TypeError, "hidden must be an int.*NoneType"),
        ({"bias_rate": True}, TypeError, "bias_rate must be a real number.*bool True"),
        ({"bias_rate": "1e-3"}, TypeError, "bias_rate must be a real number.*str"),
        ({"bias_rate": -1e-3}, ValueError, "bias_rate must be a finite number >= 0"),
        ({"aux_coef": math.inf}, ValueError, "aux_coef must be a finite number >= 0"),
        ({"route_scale": math.nan}, ValueError, "route_scale must be a finite number"),
        ({"renormalize": 1}, TypeError, "renormalize must be True or False, got int 1"),
        ({"score": ["softmax"]}, ValueError, "router score must be one of"),
        ({"balance": None}, ValueError, "MoE balance must be one of"),
    ],
)
def test_moe_checks_every_argument_at_construction(
    kw: dict[str, object], error: type[Exception], match: str
) -> None:
    # Before: top_k=2.0/True/"2", n_shared=1.5, bias_rate=True were accepted and failed at
    # the first forward with torch's messages (or silently ran top_k=True as 1).
    args: dict[str, object] = {"dim": DIM, "hidden": HIDDEN, "n_experts": E, "top_k": K}
    args.update(kw)
    with pytest.raises(error, match=match):
        MoE(F32, **args)  # type: ignore[arg-type]


def test_numpy_integers_and_reals_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    moe = MoE(F32, np.int64(DIM), np.int32(HIDDEN), np.int64(E), np.int64(K), n_shared=np.int8(1),
              bias_rate=np.float32(1e-3))  # fmt: skip
    assert type(moe.top_k) is int and type(moe.bias_rate) is float and moe.shared is not None
    with pytest.raises(TypeError, match="dim must be an int"):
        GroupedExperts(F32, 2.0, HIDDEN, E)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="top_k must be an int"):
        Router(F32, DIM, E, np.float64(2.0))


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}


def _unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = module.state_dict(keep_vars=True)
    return now.keys() == before.keys() and all(
        torch.equal(now[k].detach(), v) for k, v in before.items()
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_router_bias_is_refused_by_load_state_dict(bad: float) -> None:
    # Before: a NaN bias loaded silently and sent every token to one expert.
    moe = _moe(n_shared=1)
    sd = {k: v.clone() for k, v in _moe(seed=1, n_shared=1).state_dict().items()}
    sd["router.bias"][2] = bad
    before = _tensors(moe)
    named = {math.nan: "NaN", math.inf: "inf", -math.inf: "-inf"}[bad]  # never the value
    match = rf"router.bias must be finite; that of experts \[2\] is not \(expert 2's is {named};"
    with pytest.raises(ValueError, match=match):
        moe.load_state_dict(sd)
    assert _unchanged(moe, before)  # the experts (loaded before the router) too
    cfg = LMConfig(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, moe_hidden=16,
                   max_len=8)  # fmt: skip
    lm = ByteLM(F32, cfg)
    sd = {k: v.clone() for k, v in lm.state_dict().items()}
    sd["blocks.0.mlp.router.bias"][0] = bad
    before = _tensors(lm)
    with pytest.raises(ValueError, match=r"blocks.0.mlp.router.bias must be finite"):
        lm.load_state_dict(sd)
    assert _unchanged(lm, before)


def test_update_bias_refuses_a_non_finite_load_or_bias() -> None:
    moe = _moe()
    moe.train()
    moe(torch.randn(6, DIM))
    before, counts = moe.router.bias.clone(), moe.tokens_per_expert.clone()
    for load, match in [
        (torch.tensor([1.0, math.nan, 2.0, 3.0]), r"experts \[1\] is not \(expert 1's is NaN\)$"),
        (torch.tensor([1.0, 2.0, -math.inf, 3.0]), r"experts \[2\] is not \(expert 2's is -inf\)$"),
        (torch.tensor([1, 2, -3, 3]), r"non-negative load .*\(expert 2's is negative\)$"),
        ([1, 2, 3, 4], "as a tensor"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            moe.update_bias(load)  # type: ignore[arg-type]
        assert torch.equal(moe.router.bias, before)
        assert torch.equal(moe.tokens_per_expert, counts)
    with torch.no_grad():
        moe.router.bias[3] = math.nan  # written around load_state_dict
    with pytest.raises(
        ValueError, match=r"bias must be finite; that of experts \[3\] is not \(expert 3's is NaN;"
    ):
        moe.update_bias()
    assert torch.equal(moe.tokens_per_expert, counts)
    with torch.no_grad():
        moe.router.bias[3] = 0.0
    moe.update_bias()
    assert torch.isfinite(moe.router.bias).all() and int(moe.tokens_per_expert.sum()) == 0


def _two_layer_lm() -> ByteLM:
    torch.manual_seed(0)
    cfg = LMConfig(d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, moe_hidden=16,
                   max_len=16)  # fmt: skip
    model = ByteLM(F32, cfg)
    ids = torch.randint(0, 256, (2, 9))
    torch.autograd.backward(model.loss(ids[:, :-1], ids[:, 1:]))
    return model


def _moe_state(layers: list[MoE]) -> list[torch.Tensor]:
    return [t.clone() for m in layers for t in (m.router.bias, m.tokens_per_expert)]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_update_expert_bias_checks_every_layer_before_any_moves(bad: float) -> None:
    # Before: layer 1's bad bias raised after layer 0's bias had moved and its count was reset.
    model = _two_layer_lm()
    layers = model.moe_layers()
    with torch.no_grad():
        layers[1].router.bias[2] = bad  # written around load_state_dict
    before = _moe_state(layers)
    with pytest.raises(ValueError, match=r"MoE layer 1 of 2: the router bias must be finite"):
        model.update_expert_bias()
    torch.testing.assert_close(_moe_state(layers), before, rtol=0, atol=0, equal_nan=True)
    with torch.no_grad():
        layers[1].router.bias[2] = 0.0
    model.update_expert_bias()
    assert all(int(m.tokens_per_expert.sum()) == 0 for m in layers)
    assert all(bool(m.router.bias.ne(0).any()) for m in layers)


def test_update_biases_refuses_a_step_that_overflows_before_any_layer_moves() -> None:
    first, second = _moe(), _moe(seed=1, bias_rate=3e38)
    with torch.no_grad():
        second.router.bias.fill_(3e38)  # + 3e38 for an underloaded expert: inf
    first.tokens_per_expert.copy_(torch.tensor([3, 1, 2, 2]))
    before = _moe_state([first, second])
    with pytest.raises(ValueError, match=r"MoE layer 1 of 2: .*after update_bias must be finite"):
        update_biases([first, second], [None, torch.tensor([0, 4, 4, 4])])
    torch.testing.assert_close(_moe_state([first, second]), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one load per layer"):
        update_biases([first, second], [None])
    update_biases([first, second], [None, torch.tensor([4, 4, 4, 4])])  # balanced: no step
    assert first.router.bias.tolist() != [0.0] * E and int(first.tokens_per_expert.sum()) == 0


def test_a_refused_load_changes_nothing_under_any_root() -> None:
    # Before: the check ran in the MoE's own hook, after the modules before it had loaded.
    ctx = BF16
    nested = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), MoE(ctx, DIM, HIDDEN, E, K))

    class TopDown(torch.nn.Module):  # containers placed first, then filled
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(DIM, DIM)
            self.blocks = torch.nn.ModuleList()
            self.blocks.append(torch.nn.ModuleDict({"mlp": MoE(ctx, DIM, HIDDEN, E, K)}))

    for model, key in [(nested, "1.router.bias"), (TopDown(), "blocks.0.mlp.router.bias")]:
        sd = {k: v.clone() + 1 for k, v in model.state_dict().items()}
        sd[key] = torch.tensor([0.0, math.nan, 0.0, 0.0])
        before = _tensors(model)
        with pytest.raises(ValueError, match=f"{key} must be finite"):
            model.load_state_dict(sd)
        assert _unchanged(model, before)
        sd[key] = torch.zeros(E)
        model.load_state_dict(sd)
        assert not _unchanged(model, before)


def test_aux_loss_does_not_overflow_where_its_value_fits() -> None:
    # Before: aux_coef * E (4e38) was formed first and overflowed float32: inf.
    huge, unit = _moe(balance="aux_loss", aux_coef=1e38), _moe(balance="aux_loss", aux_coef=1.0)
    x = torch.randn(8, DIM)
    huge.train()(x), unit.train()(x)
    assert huge.aux_loss is not None and unit.aux_loss is not None
    assert bool(torch.isfinite(huge.aux_loss))
    torch.testing.assert_close(
        huge.aux_loss.double(), unit.aux_loss.double() * 1e38, rtol=1e-6, atol=0
    )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"n_experts": True, "top_k": 1}, "n_experts=True: must be an int"),
        ({"top_k": "2"}, "top_k='2': must be an int"),
        ({"top_k": 2.0}, "top_k=2.0: must be an int"),
        ({"n_shared_experts": 1.0}, "n_shared_experts=1.0: must be an int"),
        ({"moe_hidden": "32"}, "moe_hidden='32': must be an int"),
        ({"moe_bias_rate": "1e-3"}, "moe_bias_rate='1e-3': must be a real number"),
        ({"moe_aux_coef": True}, "moe_aux_coef=True: must be a real number"),
        ({"moe_aux_coef": math.nan}, "moe_aux_coef=nan: must be a finite number"),
    ],
)
def test_lm_config_takes_the_moe_fields_as_moe_does(kw: dict[str, object], match: str) -> None:
    # Before: pydantic's lax mode read True as 1, "2" and 2.0 as 2, "1e-3" as 0.001.
    with pytest.raises(ValueError, match=match) as caught:
        _tiny_moe_lm(**kw)
    assert not isinstance(caught.value, ValidationError) and "pydantic" not in str(caught.value)
    with pytest.raises(ValueError, match=match):
        LMConfig.model_validate(_tiny_moe_lm().model_dump() | kw)


def test_lm_config_moe_fields_take_numpy_numbers() -> None:
    np = pytest.importorskip("numpy")
    cfg = _tiny_moe_lm(top_k=np.int64(2), moe_hidden=np.int32(32), moe_bias_rate=np.float32(0.5))
    assert (type(cfg.top_k), cfg.moe_hidden, cfg.moe_bias_rate) == (int, 32, 0.5)
    assert LMConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_compiled_high_precision_experts_refuse_bad_offs_on_the_device() -> None:
    # Before: compiled, the high-precision path did not read offs and computed wrong rows.
    torch.manual_seed(0)
    experts = GroupedExperts(BF16, DIM, HIDDEN, E)
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, DIM, dtype=torch.bfloat16)
    torch.testing.assert_close(compiled(x, _offs(1, 3, 3, 6)), experts(x, _offs(1, 3, 3, 6)))
    for bad in [_offs(3, 2, 6, 6), _offs(-1, 2, 3, 6), _offs(1, 2, 3, 7)]:
        with pytest.raises(RuntimeError, match="offs must be non-decreasing end rows"):
            compiled(x, bad)


def test_compiled_fp8_experts_refuse_bad_offs_as_in_eager_mode() -> None:
    # The fp8 operator reads offs on the host under compile too: its ValueError names the
    # entry, as eagerly (the high-precision device check had fired first, a RuntimeError
    # that on CUDA would be a device-side assertion).
    fp8 = ComputeCtx.from_flag("fp8_e4m3_dynamic", CPU)
    torch.manual_seed(0)
    experts = MoE(fp8, 32, 16, E, K).experts
    assert isinstance(experts, GroupedExperts) and experts.fp8 is not None
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    bad = _offs(3, 2, 6, 6)
    named = r"offs\[1\] = 2 is below offs\[0\] = 3"
    with pytest.raises(ValueError, match=named):
        experts(x, bad)
    with pytest.raises(ValueError, match=named):
        compiled(x, bad)


@pytest.mark.parametrize(("reentrant", "times"), [(False, 1), (True, 2)])
def test_checkpoint_recompute_counts_tokens_as_the_docstring_says(
    reentrant: bool, times: int
) -> None:
    from torch.utils.checkpoint import checkpoint

    moe = _moe().train()
    x = torch.randn(8, DIM, requires_grad=True)
    moe(x)
    once = moe.tokens_per_expert.clone()
    moe.tokens_per_expert.zero_()
    checkpoint(moe, x, use_reentrant=reentrant).sum().backward()
    assert torch.equal(moe.tokens_per_expert, once * times)


@pytest.mark.parametrize(
    "recipe", ["e4m3/tensor/dynamic/0", "e4m3/row/dynamic/0", "e4m3/block/dynamic/0"]
)
def test_frozen_experts_serve_the_unfrozen_output_bit_for_bit(recipe: str) -> None:
    torch.manual_seed(0)
    moe = MoE(BF16, 32, 16, E, K).eval()
    moe.experts.fp8 = QuantizedExperts(Recipe.parse(recipe), Backend.REFERENCE)
    x = torch.randn(24, 32).bfloat16()
    want = moe(x)
    from computectx.formats import serving_weights

    given = {n.removeprefix("experts."): w for n, w in serving_weights(moe).items()}
    assert moe.experts.freeze_for_serving() is moe.experts and moe.experts.frozen
    # The parameters are gone (serving memory), the codes and steps are buffers.
    assert moe.experts.gate_up is None and moe.experts.down is None
    keys = [k for k in moe.state_dict() if k.startswith("experts.")]
    assert keys == [f"experts.{n}_{s}" for n in ("gate_up", "down") for s in ("fp8", "step")]
    assert moe.experts.gate_up_fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(moe(x), want)
    moe.experts.half()  # frozen codes and steps follow the device, never the dtype
    assert moe.experts.gate_up_step.dtype == torch.float32
    assert moe.experts.gate_up_fp8.dtype == torch.float8_e4m3fn and torch.equal(moe(x), want)
    xg = x.clone().requires_grad_()
    moe(xg).float().sum().backward()  # the input gradient still flows
    assert xg.grad is not None and xg.grad.isfinite().all()

    # A state dict round trip into other frozen experts gives the same output.
    torch.manual_seed(1)
    other = MoE(BF16, 32, 16, E, K).eval()
    other.experts.fp8 = moe.experts.fp8
    other.experts.freeze_for_serving()
    other.load_state_dict(moe.state_dict())
    assert torch.equal(other(x), want)
    # And the frozen codes given to fresh experts are held bit for bit.
    torch.manual_seed(2)
    fresh = MoE(BF16, 32, 16, E, K).eval()
    fresh.router.load_state_dict(moe.router.state_dict())
    fresh.experts.fp8 = moe.experts.fp8
    fresh.experts.freeze_for_serving(given)  # the codes serving_weights gave before freezing
    assert torch.equal(fresh(x), want)
    for name, w in given.items():
        assert torch.equal(
            getattr(fresh.experts, name + "_fp8").view(torch.uint8), w.codes.view(torch.uint8)
        )


def test_freezing_experts_is_refused_without_fp8_or_with_codes_that_do_not_fit() -> None:
    experts = GroupedExperts(BF16, 32, 16, E)
    with pytest.raises(ValueError, match="run in high precision"):
        experts.freeze_for_serving()
    experts.fp8 = QuantizedExperts(Recipe.parse("e4m3/row/dynamic/0"), Backend.REFERENCE)
    before = {k: v.clone() for k, v in experts.state_dict().items()}
    donor = GroupedExperts(BF16, 32, 16, E)
    donor.fp8 = QuantizedExperts(Recipe.parse("e4m3/block/dynamic/0"), Backend.REFERENCE)
    from computectx.formats.seam import held_experts

    donor.freeze_for_serving()
    blocks = {n: held_experts(donor, n, donor.fp8) for n in ("gate_up", "down")}
    with pytest.raises(ValueError, match=r"laid out 'row'.*laid out '128x128'"):
        experts.freeze_for_serving(blocks)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"not given: \['down'\]"):
        experts.freeze_for_serving({"gate_up": blocks["gate_up"]})  # type: ignore[dict-item]
    assert not experts.frozen and experts.gate_up is not None
    assert all(torch.equal(v, before[k]) for k, v in experts.state_dict().items())
    # Frozen experts hold no weights to go back to high precision with.
    from computectx.formats.convert_experts import experts_converters

    conv = next(c for c in experts_converters(donor) if c.weights(donor) is not None)
    with pytest.raises(ValueError, match="frozen for serving"):
        conv.convert(donor, None)


def _frozen_moe(recipe: str, seed: int, dim: int = 64, hidden: int = 32) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(BF16, dim, hidden, E, K).eval()
    moe.experts.fp8 = QuantizedExperts(Recipe.parse(recipe), Backend.REFERENCE)
    moe.experts.freeze_for_serving()
    return moe


def _bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: (v.view(torch.uint8) if v.element_size() == 1 else v).clone() for k, v in state.items()
    }


@pytest.mark.parametrize(
    "recipe",
    ["e4m3/tensor/dynamic/0", "e4m3/row/dynamic/0", "e4m3/block/dynamic/0", "e4m3/mx/dynamic/0"],
)
def test_frozen_experts_refuse_a_state_dict_of_bad_codes_or_steps_and_change_nothing(
    recipe: str,
) -> None:
    source = _frozen_moe(recipe, 1).state_dict()
    cases: dict[str, tuple[dict[str, torch.Tensor], str]] = {}
    values = [float("nan"), float("inf"), 0.0, -1.0] + ([3.0] if "mx" in recipe else [])
    for value in values:
        steps = source["experts.down_step"].clone()
        steps.view(-1)[0] = value
        cases[f"step {value}"] = ({**source, "experts.down_step": steps}, r"step\(s\) that are not")
    for dtype in (torch.float8_e5m2, torch.bfloat16):
        codes = source["experts.down_fp8"].to(dtype)
        cases[str(dtype)] = ({**source, "experts.down_fp8": codes}, "loads only at that dtype")
    for dtype in (torch.float64, torch.bfloat16):
        steps = source["experts.gate_up_step"].to(dtype)
        cases[f"steps {dtype}"] = ({**source, "experts.gate_up_step": steps}, "at that dtype")
    for moe in (_frozen_moe(recipe, 0), _frozen_moe(recipe, 0).experts):
        before = _bits(moe.state_dict())
        for what, (state, match) in cases.items():
            if isinstance(moe, GroupedExperts):
                state = {k.removeprefix("experts."): v for k, v in state.items() if "experts" in k}
            with pytest.raises(ValueError, match=match):
                moe.load_state_dict(state)
            after = _bits(moe.state_dict())
            assert all(torch.equal(after[k], v) for k, v in before.items()), what


def test_frozen_experts_refuse_a_state_dict_frozen_under_another_layout_of_the_same_shapes() -> (
    None
):
    # At K = 32 a row's steps (E, N, 1) have the shape of mx's (E, N, K/32): row+no_pow2's
    # are not powers of two, which no MX step is.
    row = _frozen_moe("e4m3/row+no_pow2/dynamic/0", 1, dim=32, hidden=32)
    mx = _frozen_moe("e4m3/mx/dynamic/0", 0, dim=32, hidden=32)
    before = _bits(mx.state_dict())
    with pytest.raises(ValueError, match=r"'mx' step\(s\) that are not powers of two"):
        mx.load_state_dict(row.state_dict())
    after = _bits(mx.state_dict())
    assert all(torch.equal(after[k], v) for k, v in before.items())
