"""The non-finite check of the step (``_grad_health.all_applicable``): true exactly when every
gradient element is finite with a finite float32 square (``|g| < 2**64``), whichever bound
clears a tensor first (a float32 dot product, or a 2-norm); and that the optimizers take it
at the step, over the gradients as they are then, whatever wrote them after the backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.dlpack import from_dlpack

from computectx import ComputeCtx, DType
from computectx.kernels import host_adam
from computectx.memory import CompactOptimizer, LowPrecGradAccumulator, OffloadedOptimizer
from computectx.memory.optim import _grad_health
from computectx.memory.optim._grad_health import SQUARE_OVERFLOW, all_applicable

BELOW = SQUARE_OVERFLOW * (1 - 2.0**-24)  # the largest float32 below 2**64


def with_value(value: float, dtype: torch.dtype, layout: str) -> torch.Tensor:
    t = torch.randn(64, 48).to(dtype)
    t[5, 7] = value
    if layout == "non-contiguous":
        return t.t()
    if layout == "sparse":
        return t.to_sparse()
    return t


@pytest.mark.parametrize("layout", ["contiguous", "non-contiguous", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    ("value", "applicable"),
    [
        (1.0, True),
        (float("nan"), False),
        (float("inf"), False),
        (float("-inf"), False),
        (SQUARE_OVERFLOW, False),
        (-SQUARE_OVERFLOW, False),
        (3.0e38, False),
        (BELOW, True),
        (-BELOW, True),
    ],
)
def test_the_verdict_is_exact_for_each_element(
    value: float, applicable: bool, dtype: torch.dtype, layout: str
) -> None:
    t = with_value(value, dtype, layout)
    stored = t.coalesce().values() if t.is_sparse else t
    # bf16 rounds the value; the verdict follows the stored element.
    expected = bool((stored.double().abs() < SQUARE_OVERFLOW).all())
    if dtype != torch.bfloat16:
        assert expected == applicable
    assert all_applicable([torch.ones(3), t]) is expected
    assert all_applicable([t, torch.ones(3)]) is expected


def test_many_large_applicable_elements_whose_sum_overflows_are_applied() -> None:
    big = torch.full((4096,), BELOW)  # each square finite, their sum not
    assert torch.isinf(torch.dot(big, big))
    assert all_applicable([big]) is True
    big[-1] = float("nan")
    assert all_applicable([big]) is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [1.0, 1e4, 1e19, -1e19, 2.0**64, float("nan"), float("-inf")])
def test_a_half_precision_gradient_is_cleared_exactly_by_its_extremes(
    value: float, dtype: torch.dtype
) -> None:
    # A contiguous bf16/f16 gradient's first check is its least and largest elements: no
    # false alarm (many large applicable elements, whose 2-norm would pass 2**64, clear).
    t = torch.full((64, 48), 6e4 if dtype == torch.float16 else 1e19).to(dtype)
    t[5, 7] = value
    expected = bool((t.double().abs() < SQUARE_OVERFLOW).all())
    assert bool(_grad_health._cleared(t)) is expected
    assert all_applicable([t]) is expected


def test_no_tensors_and_empty_tensors_are_applicable() -> None:
    assert all_applicable([]) is True
    assert all_applicable([torch.zeros(0), torch.zeros(0, 3).t()]) is True


# ----- the check is taken at the step -------------------------------------------------------
#
# Not in the backward's hooks: a verdict taken there and reused at the step would miss every
# write after it that bumps no version counter (``.data``, numpy and DLPack aliases, c10d
# collectives on ``param.grad``, another library's hook), and apply NaN.

CTX = ComputeCtx.parity("cpu")


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(dtype)


def _backward(m: torch.nn.Module, scale: float = 1.0) -> None:
    x = torch.randn(4, 6, dtype=next(m.parameters()).dtype)
    (m(x).square().sum() * scale).backward()


class Reads:
    """Counts the checks (``_cleared``) taken."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = _grad_health._cleared

        def counted(v: torch.Tensor, native: bool = True) -> bool | torch.Tensor:
            self.count += 1
            return real(v, native)

        monkeypatch.setattr(_grad_health, "_cleared", counted)

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


OPTIMIZERS: dict[str, Callable[[torch.nn.Module], OffloadedOptimizer | CompactOptimizer]] = {
    "offloaded": lambda m: OffloadedOptimizer(m.parameters(), CTX),
    "compact": lambda m: CompactOptimizer(m.parameters(), CTX),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_step_checks_each_gradient_once_and_the_backward_none(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _model()
    opt = OPTIMIZERS[kind](m)
    assert not any(p._post_accumulate_grad_hooks for p in m.parameters())
    reads = Reads(monkeypatch)
    _backward(m)
    assert reads.take() == 0
    opt.step()
    assert reads.take() == 4 and not opt.last_step_skipped


def _write_nan(w: torch.Tensor, how: str) -> None:
    """Write a NaN into ``w.grad`` after the backward, ``how`` (most bump no version)."""
    g = w.grad
    assert g is not None
    if how == "data mul_":
        g.data.mul_(float("nan"))
    elif how == "data copy_":
        g.data.copy_(torch.full_like(g, float("nan")))
    elif how == "data item":
        g.data[0, 0] = float("nan")
    elif how == "numpy alias":
        g.numpy()[0, 0] = np.nan
    elif how == "dlpack alias":
        from_dlpack(g)[0, 0] = float("nan")  # an alias through DLPack
    elif how == "in place":
        g[0, 0] = float("inf")
    elif how == "assigned":
        w.grad = torch.full_like(g, float("nan"))
    elif how == "data swapped":
        g.data = torch.full_like(g, float("nan"))
    else:  # measured by torch's clip, then written: the step must see the write
        g[0, 0] = SQUARE_OVERFLOW
        torch.nn.utils.clip_grad_norm_([w], float("inf"), norm_type=1.0)
        g.data[0, 0] = float("inf")


WRITES = [
    "data mul_",
    "data copy_",
    "data item",
    "numpy alias",
    "dlpack alias",
    "in place",
    "assigned",
    "data swapped",
    "torch clip",
]


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", WRITES)
def test_a_nan_written_after_the_backward_skips_the_step(kind: str, how: str) -> None:
    m = _model()
    opt = OPTIMIZERS[kind](m)
    before = [p.detach().clone() for p in m.parameters()]
    _backward(m)
    _write_nan(next(m.parameters()), how)
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    for p, b in zip(m.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_hook_registered_after_the_optimizer_writing_data_skips_the_step(kind: str) -> None:
    m = _model()
    opt = OPTIMIZERS[kind](m)
    before = [p.detach().clone() for p in m.parameters()]
    w = next(m.parameters())

    def poison(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad.data.mul_(float("nan"))  # another library's hook: no version bump

    w.register_post_accumulate_grad_hook(poison)  # type: ignore[no-untyped-call]
    _backward(m)
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    for p, b in zip(m.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_accumulated_gradients_are_checked_as_the_step_finds_them(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _model()
    opt = OPTIMIZERS[kind](m)
    reads = Reads(monkeypatch)
    for _ in range(3):
        _backward(m)
    assert reads.take() == 0
    opt.step()
    assert reads.take() == 4 and not opt.last_step_skipped
    opt.zero_grad()
    for _ in range(3):
        _backward(m)
    _write_nan(next(m.parameters()), "data item")
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()


def test_a_widened_master_gradient_changed_after_ingest_skips_the_step() -> None:
    m = _model(torch.bfloat16)  # f32 masters: each gradient is copied, widened
    opt = OffloadedOptimizer(m.parameters(), CTX)
    _backward(m)
    opt.step()
    assert not opt.last_step_skipped
    opt.zero_grad()
    _backward(m)
    opt.ingest_grads()
    opt.master_params[0].grad.data[0, 0] = float("inf")  # type: ignore[union-attr]
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()


def test_an_accumulator_s_sums_are_checked_at_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model()
    opt = OffloadedOptimizer(m.parameters(), CTX)
    acc = LowPrecGradAccumulator(m.parameters(), CTX.replace(grad=DType.F32))
    reads = Reads(monkeypatch)
    for _ in range(2):
        _backward(m)
    assert reads.take() == 0
    opt.ingest_grads(acc)
    opt.step()
    assert reads.take() == 4 and not opt.last_step_skipped
    acc.close()


# ----- the native check (host_adam.cleared) ----------------------------------------------
#
# Where the native kernel builds, a contiguous float32, bfloat16 or float16 gradient on the
# CPU is cleared by it (the largest magnitude of its bit patterns), exactly the condition
# above: its twin is the torch condition, over crafted bit patterns.

needs_kernel = pytest.mark.skipif(
    host_adam.quiet_library() is None, reason="the native kernel did not build here"
)

PATTERNS = {
    # bits: +-0, the least and largest subnormals, 1, the largest below 2**64, 2**64 and
    # beyond, the largest finite, inf, NaNs (quiet and signalling, either sign, payloads).
    torch.float32: (
        torch.int32,
        [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x3F800000, 0x5F7FFFFF, 0xDF7FFFFF,
         0x5F800000, 0xDF800000, 0x5F800001, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7F800001,
         0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFBFFFFF],
    ),
    torch.bfloat16: (
        torch.int16,
        [0x0000, 0x8000, 0x0001, 0x807F, 0x3F80, 0x5F7F, 0xDF7F, 0x5F80, 0xDF80, 0x5F81,
         0x7F7F, 0x7F80, 0xFF80, 0x7F81, 0x7FC0, 0xFFC0, 0x7FFF, 0xFFBF],
    ),
    torch.float16: (
        torch.int16,
        [0x0000, 0x8000, 0x0001, 0x83FF, 0x3C00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7C01,
         0x7E00, 0xFE00, 0x7FFF, 0xFDFF],
    ),
}  # fmt: skip


def crafted(dtype: torch.dtype, numel: int, bits: int, where: int) -> torch.Tensor:
    """``numel`` ordinary values of ``dtype`` with the pattern ``bits`` at ``where``."""
    t = torch.linspace(-3, 3, numel).to(dtype)
    as_int = PATTERNS[dtype][0]
    signed = bits - (1 << (8 * t.element_size())) if bits >> (8 * t.element_size() - 1) else bits
    t.view(as_int)[where] = signed
    return t


def torch_condition(t: torch.Tensor) -> bool:
    return bool((t.double().abs() < SQUARE_OVERFLOW).all())


@needs_kernel
@pytest.mark.parametrize("dtype", sorted(PATTERNS, key=str))
def test_the_native_check_is_the_torch_condition_on_every_pattern(dtype: torch.dtype) -> None:
    # Lengths around the vector width and a chunk of 64K elements (several threads), each
    # pattern first, last, and in a tail or a later chunk; the portable build agrees.
    native, portable = host_adam.quiet_library(), host_adam._library(True)
    assert native is not None and portable is not None
    for numel in (1, 17, 100, (1 << 16) + 33):
        for bits in PATTERNS[dtype][1]:
            for where in {0, numel - 1, numel // 2, max(numel - 20, 0)}:
                t = crafted(dtype, numel, bits, where)
                expected = torch_condition(t)
                for lib in (native, portable):
                    for threads in (1, 2, 3):
                        assert host_adam.cleared(lib, t, threads) is expected, (bits, where)
                assert all_applicable([t]) is expected


@needs_kernel
def test_the_native_check_refuses_what_it_does_not_read() -> None:
    lib = host_adam.quiet_library()
    assert lib is not None
    for t in (torch.zeros(4, dtype=torch.float64), torch.zeros(4, 3).t()):
        with pytest.raises(ValueError, match="cleared takes a contiguous CPU tensor"):
            host_adam.cleared(lib, t, 1)
    assert host_adam.cleared(lib, torch.zeros(0), 2) is True


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_contiguous_cpu_gradient_is_checked_natively_without_a_torch_op(
    dtype: torch.dtype,
) -> None:
    grads = [torch.randn(300, 7).to(dtype), torch.randn(5).to(dtype)]
    with OpCount() as ops:
        assert all_applicable(grads) is True
    grads[1][2] = float("nan")
    with ops:
        assert all_applicable(grads) is False
    assert ops.names == []


class OpCount(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Records the names of the torch ops run under it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.names: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class Wrapped(torch.Tensor):
    """A tensor subclass (as a wrapper subclass, whose data_ptr need not be its elements')."""


@needs_kernel
def test_a_tensor_subclass_takes_the_torch_ops_not_the_native_check() -> None:
    t = torch.ones(64).as_subclass(Wrapped)
    t[3] = float("inf")
    with OpCount() as ops:
        assert all_applicable([t]) is False
    assert ops.names  # the torch ops ran


@pytest.mark.parametrize("make", [OffloadedOptimizer, CompactOptimizer])
def test_compile_false_never_loads_the_native_kernel_for_its_check(
    make: Callable[..., OffloadedOptimizer | CompactOptimizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile=False`` is the way to step without the compiler: its non-finite check takes
    the torch ops (before: the first step built the kernel's library for the check); with the
    default it reads the gradient natively; the verdicts agree (a NaN skips the step)."""
    loads: list[int] = []
    real = host_adam.quiet_library

    def counted() -> Any:
        loads.append(1)
        return real()

    monkeypatch.setattr(host_adam, "quiet_library", counted)
    for compile, want in ((False, 0), (None, 1)):
        loads.clear()
        m = torch.nn.Linear(8, 8)
        opt = make(m.parameters(), CTX, compile=compile)
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert not opt.last_step_skipped and (len(loads) > 0) == bool(want), compile
        m.weight.grad = torch.full_like(m.weight, float("nan"))
        before = m.weight.detach().clone()
        opt.step()
        assert opt.last_step_skipped and torch.equal(m.weight, before), compile


# ----- under torch.amp.GradScaler -------------------------------------------------------------


SCALED: dict[str, Callable[..., OffloadedOptimizer | CompactOptimizer]] = {
    "offloaded": OffloadedOptimizer,
    "offloaded-overlap": lambda params, ctx, **kw: OffloadedOptimizer(
        params, ctx, overlap=True, **kw
    ),
    "compact": CompactOptimizer,
}


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", list(SCALED))
def test_a_grad_scaler_loop_equals_torch_s_and_its_skips_change_nothing(
    kind: str, set_to_none: bool
) -> None:
    """docs/memory.md, "With torch.amp.GradScaler": the scaler's loop over ours (Offloaded:
    ``ingest_grads`` before ``unscale_``, which unscales the master gradients; overlapped, the
    gradients the hooks sent down land there first) gives torch fused AdamW's weights and
    scales bit for bit; a step whose scaled loss overflows is skipped by the scaler (ours'
    ``step`` not called), the weights and moments unchanged. (Overlapped, before: the
    gradients stayed in flight, the scaler found none, and ``scaler.step`` raised, or with
    ``zero_grad(set_to_none=False)`` applied them 1024 times too large.)"""
    ref, ours = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = SCALED[kind](ours.parameters(), CTX, lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(4, 6, generator=gen)
        overflow = step == 2
        before = [p.detach().clone() for p in ours.parameters()]
        for m, o, scaler in ((ref, ref_opt, scalers[0]), (ours, opt, scalers[1])):
            loss = m(x).square().sum() * (float("inf") if overflow else 1.0)
            scaler.scale(loss).backward()
            if isinstance(o, OffloadedOptimizer):
                o.ingest_grads()
            scaler.unscale_(o)
            scaler.step(o)
            scaler.update()
            o.zero_grad(set_to_none=set_to_none)
        assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** (9 if step >= 2 else 10)
        for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
            assert torch.equal(a, b), step
        if overflow:
            assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters(), strict=True))
    assert opt.skipped_steps == 0  # the scaler skipped it: ours' step was never called


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_scaler_loop_that_forgets_ingest_grads_raises_instead_of_applying_scaled_ones(
    set_to_none: bool,
) -> None:
    """Without ``ingest_grads`` the masters hold no gradient when the scaler unscales, and
    ``scaler.step`` raises torch's error for it, whatever ``zero_grad``'s ``set_to_none``.
    (Before, ``zero_grad(set_to_none=False)`` left zeros on the masters: the scaler unscaled
    and checked those, and the step applied the scaled gradients, 1024 times too large.)"""
    m = _model()
    opt = OffloadedOptimizer(m.parameters(), CTX, torch.optim.SGD, lr=1e-2)
    _backward(m)
    opt.step()  # a first step, so that the masters have had gradients
    opt.zero_grad(set_to_none=set_to_none)
    assert all(mp.grad is None for mp in opt.master_params)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(m(torch.randn(4, 6)).square().sum()).backward()
    before = [p.detach().clone() for p in m.parameters()]
    scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
