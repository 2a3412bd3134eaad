"""A reader follows a call through a handful of modules, each entered once (docs/design.md).

For four reference calls on the CPU this counts the ``computectx`` modules the call enters and how
often it comes back to one it had left: the count of ``../shared/tools/trace_depth.py``, written
out here so the suite needs nothing outside the repository. Every Python function call whose code
lives in the package records its module; consecutive calls in one module count once; ``modules``
is the number of distinct modules and ``reentries`` the number of returns to a module already left.
The first call of a layer (setup, lazy imports) is warmed up and not counted.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch

import computectx
from computectx import ComputeCtx

ROOT = os.path.dirname(computectx.__file__ or "")


def modules_entered(fn: Callable[[], Any]) -> tuple[int, int, list[str]]:
    """``(modules, reentries, path)`` of one call of ``fn``; path: the modules in order."""
    seq: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            module = os.path.relpath(frame.f_code.co_filename, ROOT)
            if not seq or seq[-1] != module:
                seq.append(module)

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(old)
    distinct = list(dict.fromkeys(seq))
    return len(distinct), len(seq) - len(distinct), distinct


def test_the_counter_counts_modules_and_returns() -> None:
    from computectx import dtypes, residency

    def call() -> None:
        dtypes.DType.parse("bf16")
        residency.Residency.parse("auto")
        dtypes.DType.parse("f32")

    modules, reentries, path = modules_entered(call)
    assert path[:2] == ["dtypes.py", "residency.py"]
    assert modules == 2 and reentries == 1


def fp8_linear_call(flag: str) -> Callable[[], Any]:
    from computectx.formats import convert_to_quantized

    ctx = ComputeCtx.from_flag(flag, "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    model = model.to(ctx.compute.torch)
    convert_to_quantized(
        model, ctx, min_features=16
    )  # the last linear is the head and stays as it is
    x = torch.randn(32, 256, dtype=ctx.compute.torch)
    model[0](x)  # warm-up
    return lambda: model[0](x)


def moe_call() -> Callable[[], Any]:
    from computectx.nn import MoE

    ctx = ComputeCtx.from_flag("fp8_rowwise", "cpu")
    moe = MoE(ctx, 64, 32, 4, 2)
    x = torch.randn(16, 64, dtype=ctx.compute.torch)
    moe(x)
    return lambda: moe(x)


def optimizer_call() -> Callable[[], Any]:
    from computectx.memory import CompactOptimizer

    p = torch.nn.Parameter(torch.randn(256, 256))
    ctx = ComputeCtx.from_flag("fp32", "cpu").with_optim_state("int8")
    opt = CompactOptimizer([p], ctx, lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    p.grad = torch.randn_like(p)
    return opt.step


# (call, most modules, most re-entries); the targets of issue 33 (torchao's Float8Linear forward,
# counted the same way, enters 6 modules with 14 re-entries).
CALLS: dict[str, tuple[Callable[[], Callable[[], Any]], int, int | None]] = {
    "fp8 linear forward (fp8_hybrid)": (lambda: fp8_linear_call("fp8_hybrid"), 10, 25),
    "fp8 linear forward (fp8_rowwise)": (lambda: fp8_linear_call("fp8_rowwise"), 10, 25),
    "MoE forward (fp8_rowwise)": (moe_call, 10, None),
    "compact optimizer step (int8)": (optimizer_call, 6, None),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_reference_call_enters_few_modules(name: str) -> None:
    setup, most_modules, most_reentries = CALLS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call = setup()
        modules, reentries, path = modules_entered(call)
    assert modules <= most_modules, f"{name} enters {modules} modules: {path}"
    if most_reentries is not None:
        assert reentries <= most_reentries, f"{name} comes back {reentries} times: {path}"
