"""``MLP``: the SwiGLU feed-forward block, computing in ``ctx.compute``."""

from __future__ import annotations

import torch
from torch import nn

from computectx.ctx import ComputeCtx
from computectx.nn.gemm import Gemm
from computectx.nn.params import apply_recipe, param_dtype

__all__ = ["MLP"]


class MLP(nn.Module):
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
            h = nn.functional.silu(g.project(self.gate, x)) * g.project(self.up, x)
            return self.ctx.to_compute(g.project(self.down, h))
