"""``MLP``: the SwiGLU feed-forward block, computing in ``ctx.compute``."""

from __future__ import annotations

import torch
from torch import nn

from computectx.ctx import BuiltUnder, ComputeCtx
from computectx.nn.gemm import Gemm
from computectx.nn.params import apply_recipe, param_dtype
from computectx.saved import saved_call

__all__ = ["MLP", "swiglu"]


def swiglu(ctx: ComputeCtx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, its backward keeping both inputs as ``ctx.activations.act_fn``
    says (``computectx.saved``: ``fp8`` keeps them as E4M3 groups, ``recompute`` as they are,
    and neither keeps ``silu(gate)``)."""
    policy = ctx.activations
    return saved_call(
        _swiglu, gate, up, mode=policy.act_fn, group=policy.group, inputs=2, kind="act_fn"
    )


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


class MLP(BuiltUnder, nn.Module):
    """``down(silu(gate(x)) * up(x))``, bias-free.

    The linears are ``QuantizedLinear`` when ``ctx.recipe`` is set and ``nn.Linear`` otherwise; the
    forward runs under ``ctx.autocast()``, and the ``nn.Linear`` GEMMs run at ``ctx.compute``
    through ``Gemm`` (float32 accumulation, one rounding).
    """

    def __init__(self, ctx: ComputeCtx, dim: int, hidden: int) -> None:
        super().__init__()
        if dim <= 0 or hidden <= 0:
            raise ValueError(f"MLP sizes must be positive, got dim={dim!r}, hidden={hidden!r}")
        self.ctx = ctx
        dt = param_dtype(ctx)
        self.gate = nn.Linear(dim, hidden, bias=False, device=ctx.device, dtype=dt)
        self.up = nn.Linear(dim, hidden, bias=False, device=ctx.device, dtype=dt)
        self.down = nn.Linear(hidden, dim, bias=False, device=ctx.device, dtype=dt)
        apply_recipe(self, ctx)
        self.gemm = Gemm.for_ctx(ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx.autocast():
            g = self.gemm
            h = swiglu(self.ctx, g.project(self.gate, x), g.project(self.up, x))
            return self.ctx.to_compute(g.project(self.down, h))
