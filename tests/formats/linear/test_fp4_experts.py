"""``Fp4Experts`` (``formats.linear.fp4_experts``): each group of the 4-bit grouped GEMM is the
dense ``Fp4Linear`` on its own rows, bit for bit (forward, dgrad, wgrad; with stochastic
rounding given the same bits), empty groups and rows past the last group are zero, the
counter advances on the device and is saved, checked and restored with the module's state,
a checkpoint's recomputation draws nothing, and one ``torch.compile(fullgraph=True)``
(``aot_eager``) trains as eager with no recompile as the group sizes change."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo.testing
from torch.utils.checkpoint import checkpoint

from computectx import ComputeCtx
from computectx.formats import (
    Fp4Experts,
    Fp4Linear,
    Fp4Recipe,
    QuantizedExperts,
    experts_draw_frame,
)
from computectx.formats.linear import fp4_experts
from computectx.formats.linear.fp4_counter import fp4_key, stream_word
from computectx.formats.linear.fp4_experts import ExpertsGemm
from computectx.nn import GroupedExperts

NV = ComputeCtx.from_flag("nvfp4", "cpu")
NV4 = Fp4Recipe()
RECIPES = {
    "nvfp4": Fp4Recipe(),
    "nvfp4+w1x16+no_sr": Fp4Recipe(weight_tile="1x16", stochastic=False),
    "mxfp4": Fp4Recipe(format="mxfp4"),
    "mxfp4+sr+rht": Fp4Recipe(format="mxfp4", stochastic=True, hadamard=True, seed=7),
}
SIZES = [5, 0, 21, 7]  # an empty group; 3 rows past the last group
E, N, K = 4, 64, 64


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def backward(y: torch.Tensor, dy: torch.Tensor | None = None) -> None:
    torch.autograd.backward(y, dy)  # Tensor.backward is untyped in torch


def fp4_of(experts: GroupedExperts) -> Fp4Experts:
    assert isinstance(experts.fp8, Fp4Experts)
    return experts.fp8


def _dense(ctx: ComputeCtx, w: torch.Tensor, counter: int, stream: int = 0) -> Fp4Linear:
    lin = Fp4Linear(K, N, bias=False, ctx=ctx, sr_stream=stream)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.sr_key = fp4_key(lin.recipe, counter, stream)
    return lin


STREAM = 2**62 + 7


@pytest.mark.parametrize(
    ("name", "stream"), [*((n, 0) for n in RECIPES), ("nvfp4", STREAM), ("mxfp4+sr+rht", STREAM)]
)
def test_each_group_is_the_dense_fp4_linear_on_its_own_rows_bit_for_bit(
    name: str, stream: int
) -> None:
    # On any stream: the experts' key word is the stream's, as the dense layer's on it.
    recipe = RECIPES[name]
    ctx = NV.replace(recipe=recipe)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(E, N, K, generator=gen).requires_grad_()
    m = sum(SIZES) + 3
    x = torch.randn(m, K, generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(m, N, generator=gen).bfloat16()
    experts = Fp4Experts(recipe, sr_stream=stream)
    c = 1000
    experts.sr_key = fp4_key(recipe, c, stream)
    word = stream_word(recipe.seed, stream)
    assert (word == recipe.seed) is (stream == 0)
    y = experts.mm(x, w, offsets(SIZES))
    backward(y, dy)
    multiple = 16 if recipe.format == "nvfp4" else 32  # the wgrad's rows, padded per group
    start = pads = 0
    for g, rows in enumerate(SIZES):
        if rows == 0:  # reads nothing of its expert: no rows, a zero weight gradient
            assert torch.equal(grad(w)[g], torch.zeros(N, K)), name
            continue
        sl = slice(start, start + rows)
        # dY_g drawn at C + start·N: an Fp4Linear whose counter is there.
        dense = _dense(ctx, w[g].detach(), c + start * N, stream)
        xg = x.detach()[sl].clone().requires_grad_()
        yg = dense(xg)
        backward(yg, dy[sl])
        assert torch.equal(yg, y[sl]) and torch.equal(grad(xg), grad(x)[sl]), (name, g)
        # dY_gᵀ drawn at C + M·N + N·Σ pad: an Fp4Linear draws it at its counter + rows·N.
        dense = _dense(ctx, w[g].detach(), c + m * N + pads * N - rows * N, stream)
        backward(dense(x.detach()[sl]), dy[sl])
        assert torch.equal(grad(dense.weight), grad(w)[g]), (name, g)
        start, pads = start + rows, pads + -(-rows // multiple) * multiple
    assert not y[start:].any() and not grad(x)[start:].any()  # rows past offs[-1]
    drawn = N * (m + pads) if recipe.stochastic else 0
    assert experts.sr_key.tolist() == [word, c + drawn]


def test_one_group_of_every_row_is_fp4_linear_counter_and_all() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1, N, K, generator=gen)
    x = torch.randn(40, K, generator=gen)
    experts, dense = Fp4Experts(NV4), _dense(NV, w[0], 0)
    wg = w.clone().requires_grad_()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    backward(experts.mm(xs[0], wg, offsets([40])).square().sum())
    backward(dense(xs[1]).square().sum())
    assert torch.equal(grad(xs[0]), grad(xs[1])) and torch.equal(grad(wg)[0], grad(dense.weight))
    assert torch.equal(experts.sr_key, dense.sr_key)


def test_what_the_backward_keeps_and_refuses() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(E, N, K, generator=gen)
    x = torch.randn(30, K, generator=gen).bfloat16()
    grads: list[torch.Tensor] = []
    for save in ("keep", "fp8", "offload"):  # x kept as it is: dW stays Fp4Linear's
        wg = w.clone().requires_grad_()
        backward(Fp4Experts(NV4).mm(x, wg, offsets([9, 0, 14, 7]), save).float().square().sum())
        grads.append(grad(wg))
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
    xg = x.clone().requires_grad_()
    y = Fp4Experts(NV4).mm(xg, w, offsets([9, 0, 14, 7]))
    with pytest.raises(RuntimeError, match=r"double backward .* 4-bit experts"):
        torch.autograd.grad(y.float().square().sum(), xg, create_graph=True)
    bad = Fp4Experts(NV4)
    with pytest.raises(ValueError, match=r"offs\[1\] = 3 is below offs\[0\] = 9"):
        bad.mm(x, w, torch.tensor([9, 3, 14, 30], dtype=torch.int32))
    assert bad.sr_key.tolist() == [0, 0]  # the counter unmoved by a refused call
    with pytest.raises(ValueError, match="multiples of 16"):
        bad.mm(x[:, :40], w[:, :, :40], offsets([9, 0, 14, 7]))
    none = x[:0].clone().requires_grad_()  # no rows: an empty output, zero gradients
    wg = w.clone().requires_grad_()
    y = bad.mm(none, wg, offsets([0, 0, 0, 0]))
    backward(y.float().sum())
    assert y.shape == (0, N) and not grad(wg).any() and bad.sr_key.tolist() == [0, 0]


def test_the_protocol_both_settings_satisfy() -> None:
    from computectx.formats import Backend
    from computectx.recipes import Recipe

    settings: list[ExpertsGemm] = [
        Fp4Experts(Fp4Recipe()),
        QuantizedExperts(Recipe.parse("e4m3/row/dynamic/0"), Backend.REFERENCE),
    ]
    x, w = torch.randn(8, K).bfloat16(), torch.randn(E, N, K)
    for s in settings:
        assert s.mm(x, w, offsets([2, 2, 2, 2])).shape == (8, N)
    with pytest.raises(TypeError, match="Fp4Experts takes an Fp4Recipe"):
        Fp4Experts(Recipe())  # type: ignore[arg-type]


def _experts(recipe: Fp4Recipe, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(NV, 32, 16, E)
    experts.fp8 = Fp4Experts(recipe)
    return experts


def test_the_counter_is_state_saved_checked_and_restored() -> None:
    recipe = Fp4Recipe(seed=3)
    experts = _experts(recipe)
    x, offs = torch.randn(20, 32).bfloat16(), offsets([6, 0, 9, 5])
    backward(experts(x, offs).float().square().sum())
    state = experts.state_dict()
    saved = state["fp8._extra_state"]
    assert saved.dtype == torch.int64 and saved.tolist()[2:4] == fp4_of(experts).sr_key.tolist()
    assert saved.tolist()[3] > 0 and saved.tolist()[4] == 0  # stream 0: the key word is the seed
    resumed = _experts(recipe, seed=1)
    resumed.load_state_dict(state)
    assert torch.equal(fp4_of(resumed).sr_key, fp4_of(experts).sr_key)
    for module in (experts, resumed):  # the next step draws the same bits
        module.zero_grad()
        backward(module(x, offs).float().square().sum())
    assert torch.equal(grad(experts.gate_up), grad(resumed.gate_up))
    other = _experts(Fp4Recipe(seed=4), seed=2)
    before = other.gate_up.detach().clone()
    with pytest.raises(ValueError, match=r"'nvfp4\+seed=3' but these experts run 'nvfp4\+seed=4'"):
        other.load_state_dict(state)
    assert torch.equal(other.gate_up, before)  # nothing loaded
    far = dict(state, **{"fp8._extra_state": torch.tensor([1, 24, 3, 2**61])})
    with pytest.raises(
        ValueError, match=r"counter 2305843009213693952; accepted: .* \[0, 2\*\*61\)"
    ):
        resumed.load_state_dict(far)
    high = {k: v for k, v in state.items() if not k.startswith("fp8.")}
    other.load_state_dict(high)  # a high-precision checkpoint: the counter as it is
    assert fp4_of(other).sr_key.tolist() == [4, 0]
    assert fp4_of(other.to("meta")).sr_key.device.type == "cpu"  # CPU state, not a buffer


def test_a_counter_entry_of_none_is_refused_before_anything_loads() -> None:
    # A present entry is checked, never read as absent: torch hands None to set_extra_state
    # after the weights have loaded, where it raised 'NoneType' object is not subscriptable.
    state = _experts(Fp4Recipe()).state_dict()
    target = _experts(Fp4Recipe(), seed=1)
    before = target.gate_up.detach().clone()
    with pytest.raises(ValueError, match=r"fp8\._extra_state of the 4-bit experts 'fp8' must be"):
        target.load_state_dict(dict(state, **{"fp8._extra_state": None}))
    assert torch.equal(target.gate_up, before)
    with pytest.raises(ValueError, match="must be an int64 tensor"):
        fp4_of(target).set_extra_state(None)
    assert fp4_of(target).sr_key.tolist() == [0, 0]


def test_a_checkpoints_recomputation_draws_nothing_and_gives_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain, ckpt = _experts(Fp4Recipe()), _experts(Fp4Recipe())
    x, offs = torch.randn(20, 32).bfloat16(), offsets([6, 0, 9, 5])
    backward(plain(x, offs).float().square().sum())
    out = checkpoint(ckpt, x, offs, use_reentrant=False)
    # The recomputation advances nothing, so it computes no advance either (on a GPU its
    # .cpu() read is a device sync): each call's advance is the padded group sizes' sum.
    advances: list[int] = []
    padded = fp4_experts._padded

    def counted(counts: torch.Tensor, multiple: int) -> torch.Tensor:
        advances.append(multiple)
        return padded(counts, multiple)

    monkeypatch.setattr(fp4_experts, "_padded", counted)
    backward(out.float().square().sum())
    assert advances == []
    assert torch.equal(grad(plain.gate_up), grad(ckpt.gate_up))
    assert torch.equal(grad(plain.down), grad(ckpt.down))
    assert torch.equal(fp4_of(plain).sr_key, fp4_of(ckpt).sr_key)


@pytest.fixture
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_converted_experts_train_compiled_whole_as_eager_with_no_recompile() -> None:
    eager = _experts(Fp4Recipe())
    twin = copy.deepcopy(eager)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin, backend=counter, fullgraph=True)  # a break would raise
    x = torch.randn(24, 32).bfloat16()
    for sizes in ([9, 0, 8, 7], [24, 0, 0, 0], [1, 2, 3, 18]):
        offs = offsets(sizes)
        for module, run in ((eager, eager), (twin, compiled)):
            module.zero_grad()
            backward(run(x, offs).float().square().sum())
        for a, b in zip(eager.parameters(), twin.parameters(), strict=True):
            assert torch.equal(grad(a), grad(b)), sizes
        assert torch.equal(fp4_of(eager).sr_key, fp4_of(twin).sr_key), sizes
    assert counter.frame_count == 1, counter.frame_count


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4+sr+rht"])
def test_slices_in_a_draw_frame_are_the_whole_call_bit_for_bit(name: str) -> None:
    # Expert parallelism's case: experts 0-1 and 2-3 run apart, each on its experts' rows,
    # inside experts_draw_frame with the whole call's counts: one call's bits and counter.
    recipe = RECIPES[name]
    gen = torch.Generator().manual_seed(3)
    sizes = [5, 0, 21, 7]
    w = torch.randn(E, N, K, generator=gen)
    x = torch.randn(sum(sizes), K, generator=gen)
    dy = torch.randn(sum(sizes), N, generator=gen)
    whole = Fp4Experts(recipe, sr_stream=9)
    wg, xg = w.clone().requires_grad_(), x.clone().requires_grad_()
    backward(whole.mm(xg, wg, offsets(sizes)), dy)
    counts = torch.tensor(sizes, dtype=torch.int64)
    for first, rows in ((0, slice(0, 5)), (2, slice(5, 33))):
        part = Fp4Experts(recipe, sr_stream=9)
        wp = w[first : first + 2].clone().requires_grad_()
        xp = x[rows].clone().requires_grad_()
        with experts_draw_frame(counts, first):
            y = part.mm(xp, wp, offsets(sizes[first : first + 2]))
        backward(y, dy[rows])
        assert torch.equal(grad(xp), grad(xg)[rows]), first
        assert torch.equal(grad(wp), grad(wg)[first : first + 2]), first
        assert torch.equal(part.sr_key, whole.sr_key), first
    # Outside the frame the slice draws at its own offsets: other bits (what EP did before).
    alone = Fp4Experts(recipe, sr_stream=9)
    xp = x[5:33].clone().requires_grad_()
    backward(alone.mm(xp, w[2:].clone(), offsets(sizes[2:])), dy[5:33])
    assert not torch.equal(grad(xp), grad(xg)[5:33])


def test_a_frame_that_is_not_the_calls_groups_is_refused_before_any_draw() -> None:
    experts = Fp4Experts(NV4)
    key = experts.sr_key
    x, w = torch.randn(12, K), torch.randn(2, N, K)
    frame = experts_draw_frame(torch.tensor([1, 2, 3, 4]), 2)
    with pytest.raises(ValueError, match=r"experts 2\.\.3 of 4 got groups that are not"), frame:
        experts.mm(x.requires_grad_(), w, offsets([3, 9]))
    assert experts.sr_key is key
    with pytest.raises(ValueError, match="int64 CPU counts of shape"):
        experts_draw_frame(torch.tensor([1.0, 2.0]), 0).__enter__()
    with pytest.raises(ValueError, match=r"first 2 outside \[0, 2\)"):
        experts_draw_frame(torch.tensor([1, 2]), 2).__enter__()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_a_compiled_call_in_a_frame_draws_the_frames_bits_or_refuses_fullgraph() -> None:
    # Expert parallelism with a compiled experts module: the frame is read eagerly (a graph
    # break), so the slice draws as eager in the frame; fullgraph=True refuses, naming why.
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(2, N, K, generator=gen), torch.randn(8, K, generator=gen)
    counts, offs = torch.tensor([4, 3, 5]), offsets([3, 5])
    grads, keys = [], []
    for compiled in (False, True):
        part = Fp4Experts(NV4)
        wp = w.clone().requires_grad_()
        run = torch.compile(part.mm, backend="aot_eager") if compiled else part.mm
        backward(run(x, wp, offs).square().sum())  # traced with no frame open first
        wp.grad = None
        with experts_draw_frame(counts, 1):
            y = run(x, wp, offs)
        backward(y.square().sum())
        grads.append(grad(wp))
        keys.append(part.sr_key)
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(keys[0], keys[1])
    torch._dynamo.reset()  # mm's code is cached with the graph break
    whole = torch.compile(Fp4Experts(NV4).mm, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="inside experts_draw_frame"), experts_draw_frame(counts, 1):
        whole(x, w.clone().requires_grad_(), offs)


@pytest.mark.parametrize(
    ("counts", "match"),
    [
        ([-100, 3, 5], "-100 rows for expert 0"),
        ([0, 3, 5, -1000], "-1000 rows for expert 3"),
        ([2**58, 3, 5, 2**61], f"{2**58 + 8 + 2**61} in all"),
    ],
)
def test_a_frame_of_negative_or_huge_counts_is_refused_at_entry(
    counts: list[int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        experts_draw_frame(torch.tensor(counts), 1).__enter__()


def test_a_frames_advance_past_the_counter_limit_is_refused_before_any_draw() -> None:
    experts = Fp4Experts(NV4)
    key = experts.sr_key
    x, w = torch.randn(8, K, requires_grad=True), torch.randn(2, N, K)
    with (
        pytest.raises(ValueError, match=r"would advance by \d+ to 2\*\*61"),
        experts_draw_frame(torch.tensor([2**58, 3, 5]), 1),
    ):
        experts.mm(x, w, offsets([3, 5]))
    assert experts.sr_key is key


@pytest.mark.parametrize(
    ("counts", "first", "error", "match"),
    [
        (torch.arange(6.0).view(2, 3), 0, ValueError, r"torch.float32 tensor of shape \(2, 3\)"),
        (torch.tensor([7, 8], dtype=torch.int32), 0, ValueError, "torch.int32 tensor of shape"),
        ([1, 2], 0, ValueError, "counts of shape .E,., got list"),
        (torch.tensor([1, 2]), True, TypeError, "must be an int, got bool True"),
        (torch.tensor([1, 2]), 1.0, TypeError, "must be an int, got float 1.0"),
        (torch.tensor([1, 2]), "1", TypeError, "must be an int, got str '1'"),
        (torch.tensor([1, 2]), torch.tensor(1), TypeError, "must be an int, got Tensor$"),
    ],
)
def test_frame_arguments_are_refused_naming_type_and_shape_never_contents(
    counts: object, first: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match) as refused:
        experts_draw_frame(counts, first).__enter__()  # type: ignore[arg-type]
    assert "tensor(" not in str(refused.value) and "7" not in str(refused.value)


def test_a_numpy_int_first_is_an_int() -> None:
    import numpy as np

    experts = Fp4Experts(NV4)
    x, w = torch.randn(8, K, requires_grad=True), torch.randn(2, N, K)
    with experts_draw_frame(torch.tensor([4, 3, 5]), np.int64(1)):  # type: ignore[arg-type]
        experts.mm(x, w, offsets([3, 5]))
    assert int(experts.sr_key[1]) == N * (12 + 48)
