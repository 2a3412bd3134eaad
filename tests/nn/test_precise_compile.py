"""A module threading ctx through precise compiles whole (no graph breaks) and matches eager."""

from __future__ import annotations

import torch
import torch._dynamo.testing
from torch import nn

from computectx import ComputeCtx, DType


class NormSoftmax(nn.Module):
    """RMS norm and a softmax, both through ``ctx.precise``, around a projection."""

    def __init__(self, ctx: ComputeCtx, width: int) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.ones(width, dtype=ctx.compute.torch))
        self.proj = nn.Linear(width, width, dtype=ctx.compute.torch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ctx.to_compute(x)
        h = self.ctx.precise(x, lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))
        h = self.proj(h * self.weight)
        return self.ctx.precise(h, lambda t: torch.softmax(t, dim=-1))


def test_ctx_threaded_module_has_no_graph_breaks_and_matches_eager() -> None:
    torch.manual_seed(0)
    ctx = ComputeCtx.new(DType.BF16, "cpu")
    model = NormSoftmax(ctx, 32)
    x = torch.randn(4, 32)
    torch._dynamo.reset()
    # fullgraph=True raises on a graph break; the counter sees the one graph Inductor compiles
    # (one trace, where a torch._dynamo.explain trace before it traced the module once more).
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    eager = model(x)
    got = compiled(x)
    assert counter.frame_count == 1
    assert got.dtype == torch.bfloat16
    # Inductor may fuse the fp32 section differently; both round once to bf16 at the end.
    torch.testing.assert_close(got, eager, atol=2**-8, rtol=2**-7)
