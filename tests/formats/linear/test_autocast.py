"""autocast: routing of plain linears, nesting, decorators, thread and asyncio isolation,
backward after the region, and no interception outside every region."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

from computectx import ComputeCtx, DType
from computectx.formats import (
    DelayedScaling,
    QuantizedLinear,
    autocast,
    scaling_stats,
)
from computectx.formats.linear.autocast import region_scaling_state
from computectx.formats.numerics.ledger import ledger_history

from ..conftest import CtxFor


def fixture_linear(seed: int = 0) -> tuple[nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(32, 16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(16, 32, generator=g) * 0.2)
        lin.bias.copy_(torch.randn(16, generator=g))
    x = torch.randn(5, 32, generator=g)
    return lin, x


def is_fp8_result(y: torch.Tensor, lin: nn.Linear, x: torch.Tensor) -> bool:
    """Whether ``y`` is the linear computed in fp8: not the float32 result, yet within fp8
    rounding of it. E4M3 operands each carry relative error up to 2**-4, so in norm the
    output is off by less than 2 * 2**-4; a mis-routed GEMM (transposed, mis-scaled) is off
    by far more.

    The reference is an addmm, which regions never intercept, so it can run inside one.
    """
    ref = torch.addmm(lin.bias, x, lin.weight.t()).detach()
    y = y.detach()
    rel = float((y - ref).norm() / ref.norm())
    return not torch.allclose(y, ref, atol=1e-5) and rel < 2 * 2.0**-4


def mode_depth() -> int:
    return int(torch._C._len_torch_function_stack())


def test_region_routes_plain_linear_to_fp8_and_only_inside(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()
    plain = lin(x)
    with autocast(fp8_ctx):
        y = lin(x)
        y_f = functional.linear(x, lin.weight, lin.bias)
        y_kw = functional.linear(input=x, weight=lin.weight, bias=lin.bias)
    assert is_fp8_result(y, lin, x)
    assert is_fp8_result(y_f, lin, x)
    assert is_fp8_result(y_kw, lin, x)
    assert torch.equal(lin(x), plain)  # unchanged after the region
    # Output keeps the input's dtype and stays within E4M3's rounding of the fp32 result.
    assert y.dtype == x.dtype
    rel = (y - plain).detach().norm() / plain.detach().norm()
    assert float(rel) < 2 * 2.0**-4
    assert region_scaling_state(lin.weight) is not None


def test_no_mode_is_installed_outside_regions(fp8_ctx: ComputeCtx) -> None:
    base = mode_depth()
    with autocast(fp8_ctx):
        assert mode_depth() == base + 1
        with autocast(fp8_ctx), autocast(enabled=False):
            assert mode_depth() == base + 1  # one mode per thread, however deep
    assert mode_depth() == base


def test_nesting_inner_disabled_region_turns_fp8_off(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()
    plain = lin(x)
    with autocast(fp8_ctx):
        with autocast(enabled=False):
            assert torch.equal(lin(x), plain)
            with autocast(fp8_ctx):
                assert is_fp8_result(lin(x), lin, x)
            assert torch.equal(lin(x), plain)
        assert is_fp8_result(lin(x), lin, x)


def test_same_instance_reenters(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()
    region = autocast(fp8_ctx)
    with region:
        with region:
            assert is_fp8_result(lin(x), lin, x)
        assert is_fp8_result(lin(x), lin, x)
    assert torch.equal(lin(x), functional.linear(x, lin.weight, lin.bias))


def test_out_of_order_exit_is_an_error(fp8_ctx: ComputeCtx) -> None:
    a, b = autocast(fp8_ctx), autocast(enabled=False)
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="out of order"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    assert mode_depth() == 0


def test_decorator_on_functions_and_coroutines(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()

    @autocast(fp8_ctx)
    def run() -> torch.Tensor:
        y: torch.Tensor = lin(x)
        return y

    @autocast(fp8_ctx)
    async def run_async() -> torch.Tensor:
        await asyncio.sleep(0)
        y: torch.Tensor = lin(x)
        return y

    assert is_fp8_result(run(), lin, x)
    assert is_fp8_result(asyncio.run(run_async()), lin, x)
    assert not is_fp8_result(lin(x), lin, x)
    assert run.__name__ == "run"


def test_backward_after_the_region_closed(dynamic_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()
    x.requires_grad_(True)
    with autocast(dynamic_ctx):
        y = lin(x)
    assert mode_depth() == 0
    y.square().sum().backward()
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    # Compare with the float32 gradients: E5M2 gradients and E4M3 operands, so a few
    # percent in norm (a transposed or mis-scaled GEMM would be off by orders).
    xr = x.detach().clone().requires_grad_(True)
    w = lin.weight.detach().clone().requires_grad_(True)
    torch.autograd.backward(functional.linear(xr, w, lin.bias.detach()).square().sum())
    assert xr.grad is not None and w.grad is not None
    for got, ref in ((x.grad, xr.grad), (lin.weight.grad, w.grad)):
        assert float((got - ref).norm() / ref.norm()) < 0.15
    s = scaling_stats(nn.Sequential(lin))["0"]
    assert s.grad.elements == y.numel()


def test_thread_isolation(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()
    plain = lin(x).detach()
    inside = threading.Event()
    checked = threading.Event()
    results: dict[str, object] = {}

    def fp8_thread() -> None:
        with autocast(fp8_ctx):
            inside.set()
            checked.wait(10)
            results["fp8"] = lin(x).detach()

    def plain_thread() -> None:
        inside.wait(10)
        results["plain"] = lin(x).detach()
        results["depth"] = mode_depth()
        checked.set()

    ts = [threading.Thread(target=fp8_thread), threading.Thread(target=plain_thread)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert torch.equal(results["plain"], plain)  # type: ignore[arg-type]
    assert results["depth"] == 0
    assert is_fp8_result(results["fp8"], lin, x)  # type: ignore[arg-type]
    assert mode_depth() == 0


def test_asyncio_task_isolation(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()
    plain = lin(x).detach()

    async def main() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        opened = asyncio.Event()
        release = asyncio.Event()

        async def in_region() -> torch.Tensor:
            with autocast(fp8_ctx):
                opened.set()
                await release.wait()  # the region stays open across the await
                y: torch.Tensor = lin(x).detach()
                return y

        async def outside() -> tuple[torch.Tensor, torch.Tensor]:
            await opened.wait()
            y = lin(x).detach()  # runs on the thread that has the mode installed
            with autocast(enabled=False):
                z = lin(x).detach()
            release.set()
            return y, z

        a, (b, c) = await asyncio.gather(in_region(), outside())
        return a, b, c

    a, b, c = asyncio.run(main())
    assert is_fp8_result(a, lin, x)
    assert torch.equal(b, plain)
    assert torch.equal(c, plain)
    assert mode_depth() == 0


def test_disabled_region_needs_no_ctx_and_turns_off_fp8_linear_modules(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()
    m = QuantizedLinear.from_linear(lin, fp8_ctx)
    with autocast(enabled=False):
        assert torch.equal(m(x), functional.linear(x, lin.weight, lin.bias))
    assert is_fp8_result(m(x), lin, x)


def test_bad_arguments_are_clear_errors(fp8_ctx: ComputeCtx) -> None:
    with pytest.raises(ValueError, match="needs a ComputeCtx"):
        autocast()
    with pytest.raises(ValueError, match="recipe=None"):
        autocast(ComputeCtx.new(DType.BF16, "cpu"))
    with pytest.raises(TypeError, match="ComputeCtx"):
        autocast("fp8_hybrid")  # type: ignore[arg-type]
    # An object that merely has a ctx's attributes is refused, enabled or not.
    lookalike: Any = SimpleNamespace(
        recipe=fp8_ctx.recipe, compute=fp8_ctx.compute, device=fp8_ctx.device
    )
    with pytest.raises(TypeError, match=r"autocast needs a computectx\.ComputeCtx"):
        autocast(lookalike)
    with pytest.raises(TypeError, match=r"ComputeCtx or None, got SimpleNamespace"):
        autocast(lookalike, enabled=False)
    with pytest.raises(TypeError, match="bool"):
        autocast(fp8_ctx, enabled=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot force the triton"):
        autocast(fp8_ctx, backend="triton")
    with pytest.raises(ValueError, match="unknown fp8 backend"):
        autocast(fp8_ctx, backend="cuda")


def test_unsuitable_operands_run_unchanged(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear()
    x64, w64 = x.double(), lin.weight.double()
    with autocast(fp8_ctx):
        assert torch.equal(functional.linear(x64, w64), x64 @ w64.t())
        w3 = lin.weight.unsqueeze(0)
        with pytest.raises(RuntimeError):
            functional.linear(x, w3)  # torch's own error, not ours


def test_weight_state_is_keyed_by_the_tensor_not_its_address(ctx_for: CtxFor) -> None:
    ctx = ctx_for(DelayedScaling(history_len=4))
    x = torch.randn(4, 32)
    w1 = torch.randn(16, 32)
    with autocast(ctx):
        functional.linear(x, w1)
    first = region_scaling_state(w1)
    assert first is not None and first.weight.seeded
    del w1, first
    gc.collect()
    # A new, smaller weight (often at the freed address) starts with fresh state: a
    # history inherited from w1 would keep w1's larger amax in the window.
    w2 = torch.empty(16, 32)
    w2.copy_(torch.randn(16, 32) * 0.01)
    assert region_scaling_state(w2) is None
    with autocast(ctx):
        functional.linear(x, w2)
    s = region_scaling_state(w2)
    assert s is not None
    assert float(ledger_history(s.weight.ledger).max()) == float(w2.abs().max())


def test_region_policy_change_reshapes_the_weight_state(ctx_for: CtxFor) -> None:
    lin, x = fixture_linear()
    with autocast(ctx_for(DelayedScaling(history_len=8))):
        lin(x)
    with autocast(ctx_for(DelayedScaling(history_len=2))):
        lin(x)
    s = region_scaling_state(lin.weight)
    assert s is not None and s.input.history_len == 2


def test_inference_mode_inside_a_region(fp8_ctx: ComputeCtx) -> None:
    lin, x = fixture_linear(3)
    with torch.inference_mode(), autocast(fp8_ctx):
        y = lin(x)
    assert is_fp8_result(y, lin, x)
    # State created under inference mode can still be updated outside it.
    with autocast(fp8_ctx):
        lin(x).sum().backward()


class _Passthrough(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*args, **(kwargs or {}))


def test_a_foreign_mode_closing_out_of_order_leaves_dispatch_inert_then_reused(
    fp8_ctx: ComputeCtx,
) -> None:
    # Interleaved tasks can close a region while another mode sits above ours.
    lin, x = fixture_linear()
    plain = lin(x)
    region, user = autocast(fp8_ctx), _Passthrough()
    region.__enter__()
    user.__enter__()  # type: ignore[no-untyped-call]
    region.__exit__(None, None, None)
    assert mode_depth() == 2  # ours could not be popped from under the other mode
    assert torch.equal(lin(x), plain)  # but it is inert: no region is open
    user.__exit__(None, None, None)  # type: ignore[no-untyped-call]
    with autocast(fp8_ctx):
        assert mode_depth() == 1  # reused, not pushed twice
        assert is_fp8_result(lin(x), lin, x)
    assert mode_depth() == 0


@pytest.mark.parametrize(("n_in", "n_out"), [(48, 32), (32, 48), (40, 24)])
def test_a_region_runs_mx_only_on_the_widths_conversion_converts(n_in: int, n_out: int) -> None:
    # convert_to_quantized skips an mx layer whose widths are not multiples of 32
    # (check_granularity_widths); a region runs the same linear in high precision, unchanged.
    from computectx.formats import convert_to_quantized, scaling_stats

    ctx = ComputeCtx.from_flag("fp8_mx", "cpu")
    lin = nn.Linear(n_in, n_out)
    with pytest.warns(UserWarning, match="converted none"):
        report = convert_to_quantized(nn.Sequential(nn.Linear(n_in, n_out)), ctx, lambda m, f: True)
    assert report.converted == ()
    x = torch.randn(10, n_in, requires_grad=True)
    with autocast(ctx):
        y = lin(x)
    y.sum().backward()
    assert torch.equal(y, lin(x))  # the plain linear's own result
    assert region_scaling_state(lin.weight) is None  # never quantized
    # A width that converts runs in fp8 inside the region too, and records.
    ok = nn.Sequential(nn.Linear(64, 32))
    with autocast(ctx):
        y8 = ok(torch.randn(10, 64))
    assert scaling_stats(ok)["0"].input.elements == 10 * 64
    assert not torch.equal(y8, ok(torch.randn(10, 64)))
