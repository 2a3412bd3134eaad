"""``Gemm``: the upcast path is exactly "float32 GEMM of the rounded operands, rounded once",
within an ulp of torch's own bf16 kernel; the paths are chosen by the probe, forceable, and
compile without graph breaks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn import functional
from torch.utils._python_dispatch import TorchDispatchMode

from computectx import ComputeCtx, DType, capability
from computectx.nn import ByteLM, Gemm, GemmPath, LMConfig, forced_gemm_path

CPU = torch.device("cpu")
BF16 = ComputeCtx.new(DType.BF16, CPU)
TINY = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=16)
HALF = [torch.bfloat16, torch.float16]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _wide(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` and widened back: the exact operand a half GEMM reads."""
    return t.to(dtype).float()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_linear_is_the_f32_gemm_of_rounded_operands_rounded_once(
    dtype: torch.dtype, bias: bool
) -> None:
    x = _randn(3, 5, 48, seed=0).requires_grad_()
    w = _randn(40, 48, seed=1).requires_grad_()
    b = _randn(40, seed=2).requires_grad_() if bias else None
    g = _randn(3, 5, 40, seed=3).to(dtype)

    y = Gemm(GemmPath.UPCAST, dtype).linear(x, w, b)
    torch.autograd.backward(y, g)

    wb = None if b is None else _wide(b, dtype)
    expected = functional.linear(_wide(x, dtype), _wide(w, dtype), wb).to(dtype)
    assert y.dtype == dtype
    assert torch.equal(y, expected)
    # Both backward GEMMs: float32 products of the half-precision operands, rounded once to
    # the half dtype (then widened into the float32 leaves' .grad, exactly).
    g32 = g.float()
    assert x.grad is not None and w.grad is not None
    assert torch.equal(x.grad, (g32 @ _wide(w, dtype)).to(dtype).float())
    dw = g32.reshape(-1, 40).mT @ _wide(x, dtype).reshape(-1, 48)
    assert torch.equal(w.grad, dw.to(dtype).float())
    if b is not None:
        assert b.grad is not None
        assert torch.equal(b.grad, g32.reshape(-1, 40).sum(0).to(dtype).float())


def test_upcast_matmul_is_the_f32_matmul_rounded_once_and_handles_broadcasting() -> None:
    q = _randn(2, 3, 7, 16, seed=4).bfloat16().requires_grad_()
    k = _randn(2, 3, 16, 7, seed=5).bfloat16().requires_grad_()
    g = _randn(2, 3, 7, 7, seed=6).bfloat16()
    s = Gemm(GemmPath.UPCAST, torch.bfloat16).matmul(q, k)
    torch.autograd.backward(s, g)
    assert torch.equal(s, (q.float() @ k.float()).bfloat16())
    assert q.grad is not None and k.grad is not None
    assert torch.equal(q.grad, (g.float() @ k.float().mT).bfloat16())
    assert torch.equal(k.grad, (q.float().mT @ g.float()).bfloat16())

    # A 2-D right operand broadcast over the batch: its gradient sums over the batch in
    # float32 before the single rounding, so it lies within an ulp of the exact sum.
    a = _randn(4, 5, 16, seed=7).bfloat16().requires_grad_()
    m = _randn(16, 8, seed=8).bfloat16().requires_grad_()
    out = Gemm(GemmPath.UPCAST, torch.bfloat16).matmul(a, m)
    torch.autograd.backward(out, g.new_ones(4, 5, 8))
    assert m.grad is not None and m.grad.shape == m.shape
    exact = a.double().reshape(-1, 16).mT @ torch.ones(20, 8, dtype=torch.float64)
    _assert_within_an_ulp(m.grad, exact, torch.bfloat16)


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` values at ``|t|`` (as float64)."""
    info = torch.finfo(dtype)
    mag = t.double().abs().clamp_min(info.smallest_normal)
    # frexp: mag = f * 2**e with f in [0.5, 1), so the binade starts at 2**(e - 1).
    return torch.ldexp(torch.full_like(mag, info.eps), torch.frexp(mag).exponent - 1)


def _assert_within_an_ulp(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.double() - ref.double()).abs()
    bound = _ulp(torch.maximum(got.double().abs(), ref.double().abs()), dtype)
    assert bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.parametrize(("m", "k", "n"), [(64, 96, 80), (128, 384, 256)])
def test_upcast_is_within_an_ulp_of_torch_native_bf16_kernel(m: int, k: int, n: int) -> None:
    x = _randn(m, k, seed=9)
    w = _randn(n, k, seed=10)
    native = Gemm(GemmPath.NATIVE, torch.bfloat16).linear(x, w)
    upcast = Gemm(GemmPath.UPCAST, torch.bfloat16).linear(x, w)
    assert torch.equal(native, functional.linear(x.bfloat16(), w.bfloat16()))  # torch's own kernel
    # Both accumulate in float32 and round once; only the order of the float32 additions
    # differs, so they agree to one bf16 ulp, plus what reordering a float32 sum of k
    # products can move (k * 2**-24 of the sum of magnitudes) where the sum cancels.
    reorder = (x.bfloat16().double().abs() @ w.bfloat16().double().abs().T) * k * 2.0**-24
    err = (upcast.double() - native.double()).abs()
    bound = _ulp(torch.maximum(upcast.abs(), native.abs()), torch.bfloat16) + reorder
    assert bool((err <= bound).all())
    assert float((upcast != native).double().mean()) < 0.01


class _GemmDtypes(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Records the operand dtypes of every matrix multiply torch runs."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            for a in args:
                if isinstance(a, torch.Tensor):
                    self.seen.add((func.overloadpacket.__name__, a.dtype))
        return func(*args, **(kwargs or {}))


def _train_step_gemm_dtypes(path: GemmPath) -> tuple[set[torch.dtype], torch.Tensor]:
    torch.manual_seed(0)
    with forced_gemm_path(path):
        model = ByteLM(BF16, TINY)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with _GemmDtypes() as log:
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        torch.autograd.backward(loss)
    return {dt for _, dt in log.seen}, loss.detach()


def test_forced_paths_run_the_kernels_they_name() -> None:
    upcast_dtypes, upcast_loss = _train_step_gemm_dtypes(GemmPath.UPCAST)
    native_dtypes, native_loss = _train_step_gemm_dtypes(GemmPath.NATIVE)
    # Forward and backward, every GEMM of a bf16 model: float32 operands when upcast,
    # bf16 operands in torch's kernel when native.
    assert upcast_dtypes == {torch.float32}
    assert native_dtypes == {torch.bfloat16}
    assert float(upcast_loss) == pytest.approx(float(native_loss), abs=1e-2)


def test_path_choice_follows_the_probe_and_forcing() -> None:
    probe = capability.native_half_gemm(torch.bfloat16)
    assert Gemm.for_ctx(BF16).path is (GemmPath.NATIVE if probe.ok else GemmPath.UPCAST)
    assert Gemm.for_ctx(ComputeCtx.parity(CPU)) == Gemm(GemmPath.WIDE, torch.float32)
    with forced_gemm_path(GemmPath.NATIVE):
        assert Gemm.for_ctx(BF16).path is GemmPath.NATIVE
        model = ByteLM(BF16, TINY)
        # A float32 policy has nothing to force.
        assert Gemm.for_ctx(ComputeCtx.parity(CPU)).path is GemmPath.WIDE
    # Restored on exit.
    assert Gemm.for_ctx(BF16).path is (GemmPath.NATIVE if probe.ok else GemmPath.UPCAST)
    paths = {g.path for m in model.modules() if isinstance(g := getattr(m, "gemm", None), Gemm)}
    assert paths == {GemmPath.NATIVE}
    with pytest.raises(ValueError, match=r"GemmPath\.NATIVE or GemmPath\.UPCAST"):
        forced_gemm_path(GemmPath.WIDE).__enter__()


def test_float32_policy_gemms_are_exactly_torch_ops() -> None:
    g = Gemm(GemmPath.WIDE, torch.float32)
    x, w = _randn(4, 8, seed=11), _randn(6, 8, seed=12)
    assert torch.equal(g.linear(x, w), functional.linear(x, w))
    assert torch.equal(g.matmul(x, w.T), x @ w.T)


@pytest.mark.parametrize(
    ("path", "activations"),
    [(GemmPath.UPCAST, "keep"), (GemmPath.NATIVE, "keep"), (GemmPath.UPCAST, "linear:fp8")],
)
def test_bytelm_compiles_whole_and_matches_eager(path: GemmPath, activations: str) -> None:
    # linear:fp8: the linears keep their inputs as per-tensor E4M3 (Gemm.save), compiled too.
    torch.manual_seed(0)
    with forced_gemm_path(path):
        model = ByteLM(BF16.with_activations(activations), TINY)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))

    def loss_of(i: torch.Tensor) -> torch.Tensor:
        return model.loss(i[:, :-1], i[:, 1:])

    torch._dynamo.reset()
    # aot_eager traces forward and backward (through the custom autograd functions) without
    # generating code, so it checks the graphs in seconds on a CPU; fullgraph=True raises on
    # a graph break (what a torch._dynamo.explain trace before it would count, once more).
    compiled: Callable[[torch.Tensor], torch.Tensor] = torch.compile(
        loss_of, backend="aot_eager", fullgraph=True
    )
    got = compiled(ids)
    torch.autograd.backward(got)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    eager = loss_of(ids)
    torch.autograd.backward(eager)
    torch._dynamo.reset()
    assert torch.equal(got.detach(), eager.detach())
    for a, p in zip(grads, model.parameters(), strict=True):
        assert p.grad is not None and torch.equal(a, p.grad)
