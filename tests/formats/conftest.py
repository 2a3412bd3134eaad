"""Shared fp8 fixtures: contexts with fp8 policies, the expected step, a small model.

The contexts are immutable values, so the fixtures are session-scoped, which also lets
hypothesis tests take them. Everything here runs on the CPU (the reference backend);
the Triton kernels have their own conftest in ``tests/kernels``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from computectx import ComputeCtx, Fp8Format
from computectx.recipes import DelayedScaling, DynamicScaling, Fp8Scheme, Recipe

CtxFor = Callable[..., ComputeCtx]
"""``ctx_for(scaling=DelayedScaling(), scheme=Fp8Scheme.HYBRID)``."""
StepOf = Callable[..., float]
"""``step_of(amax, fmt, margin=0)``."""


@pytest.fixture(scope="session")
def fp8_ctx() -> ComputeCtx:
    """bf16 compute on the CPU under the default fp8 policy (HYBRID, delayed scaling)."""
    return ComputeCtx.from_flag("fp8_hybrid", "cpu")


@pytest.fixture(scope="session")
def dynamic_ctx(fp8_ctx: ComputeCtx) -> ComputeCtx:
    """``fp8_ctx`` with dynamic scaling: every step comes from the tensor's own amax."""
    return fp8_ctx.replace(recipe=Recipe(scaling=DynamicScaling()))


@pytest.fixture(scope="session")
def ctx_for(fp8_ctx: ComputeCtx) -> CtxFor:
    """A builder of ``fp8_ctx`` variants with another scaling recipe or format scheme."""

    def build(
        scaling: DelayedScaling | DynamicScaling | None = None,
        scheme: Fp8Scheme = Fp8Scheme.HYBRID,
    ) -> ComputeCtx:
        policy = Recipe(format=scheme, scaling=scaling or DelayedScaling())
        return fp8_ctx.replace(recipe=policy)

    return build


@pytest.fixture(scope="session")
def step_of() -> StepOf:
    """The step the scale convention gives an amax, as the ledgers hold it.

    ``amax / (fmt.max / 2**margin)`` as one float32 division (the divisor is exact: fmt.max
    and 2**margin are a power of two apart), with ``amax`` rounded to float32 first.
    """

    def step(amax: float, fmt: Fp8Format, margin: int = 0) -> float:
        a = torch.tensor(amax, dtype=torch.float32)
        return float(a / torch.tensor(fmt.max / 2.0**margin, dtype=torch.float32))

    return step


@pytest.fixture
def small_mlp() -> nn.Sequential:
    """A fresh 32 -> 32 -> 32 MLP (seeded): two convertible linears, the second the head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
