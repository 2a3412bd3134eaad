"""``RMSNorm``: root-mean-square normalization computed at the accumulation dtype."""

from __future__ import annotations

import torch
from torch import nn

from computectx.activations import ActivationKind
from computectx.ctx import BuiltUnder, ComputeCtx
from computectx.nn.params import param_dtype
from computectx.nn.precise import rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(BuiltUnder, nn.Module):
    """``x / rms(x) * weight`` over the last dimension, through ``ctx.precise``.

    The output has ``x``'s dtype; the statistics are taken at ``x.dtype ⊔ ctx.accum``.
    The gain is stored at ``compute ⊔ master`` (``param_dtype``) and applied inside the
    lifted computation. ``kind="residual"``: the norm reads the residual stream, and its
    input is kept as ``ctx.activations.residual`` says when that is not ``keep``.
    """

    def __init__(
        self, ctx: ComputeCtx, dim: int, eps: float = 1e-6, kind: ActivationKind = "precise"
    ) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"RMSNorm dim must be positive, got {dim!r}")
        if not eps > 0:
            raise ValueError(f"RMSNorm eps must be positive, got {eps!r}")
        self.ctx = ctx
        self.eps = eps
        self.kind: ActivationKind = kind
        """``"residual"`` for a norm on the residual stream (``rms_norm``)."""
        self.weight = nn.Parameter(torch.ones(dim, device=ctx.device, dtype=param_dtype(ctx)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.ctx, x, self.weight, self.eps, self.kind)
