"""``RotaryEmbedding``: rotary position embedding applied through ``ctx.precise``."""

from __future__ import annotations

import torch
from torch import nn

from computectx.ctx import BuiltUnder, ComputeCtx
from computectx.nn.precise import apply_rope, rope_tables

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(BuiltUnder, nn.Module):
    """Rotates query/key features by position; tables cover positions ``0 .. max_len-1``.

    ``forward(x, start)`` takes ``x`` of shape ``(..., T, head_dim)`` holding the
    consecutive positions ``start .. start+T-1`` (a KV-cached step passes the cached
    length as ``start``). Positions are plain ints, so the range check and the table slice
    need no device-to-host read. ``at(x, pos)`` takes the position as a tensor instead (the
    static-shape decode step).
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

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        end = start + x.shape[-2]
        if start < 0 or end > self.max_len:
            raise ValueError(
                f"positions {start}..{end - 1} are outside the RoPE table "
                f"(max_len={self.max_len}); accepted positions: 0..{self.max_len - 1}"
            )
        return apply_rope(self.ctx, x, self.cos[start:end], self.sin[start:end])

    def at(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``forward`` for one position held in a tensor: ``x`` is ``(..., 1, head_dim)`` at
        position ``pos`` (a 0-d int64 tensor). The table row is gathered on the device, so
        a compiled decode step reads no host value and does not recompile as ``pos`` moves;
        a ``pos`` outside the table raises in eager mode (an index error) and is not checked
        otherwise."""
        row = pos.reshape(1)
        return apply_rope(self.ctx, x, self.cos.index_select(0, row), self.sin.index_select(0, row))
