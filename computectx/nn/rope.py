"""``RotaryEmbedding``: rotary position embedding applied through ``ctx.precise``."""

from __future__ import annotations

import torch
from torch import nn

from computectx.ctx import ComputeCtx
from computectx.nn.ops import apply_rope, rope_tables

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotates query/key features by position; tables cover positions ``0 .. max_len-1``.

    ``forward(x, positions)`` takes ``x`` of shape ``(..., T, head_dim)`` and ``positions``
    of shape ``(T,)`` (absolute positions, so a KV-cached step passes its offset).
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, ctx: ComputeCtx, head_dim: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        self.ctx = ctx
        self.max_len = max_len
        cos, sin = rope_tables(head_dim, max_len, base, ctx.device)
        # Derived from the config, so not part of the state dict.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(
                f"position {int(positions.max())} is beyond the RoPE table "
                f"(max_len={self.max_len}); accepted positions: 0..{self.max_len - 1}"
            )
        return apply_rope(self.ctx, x, self.cos[positions], self.sin[positions])
