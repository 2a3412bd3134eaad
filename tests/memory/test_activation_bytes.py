"""``SavedActivations``: the bytes autograd keeps, by kind, as the ops tag them (counted)."""

from __future__ import annotations

import torch

from computectx import ComputeCtx, DType
from computectx.memory.activation_bytes import SavedActivations
from computectx.nn import rms_norm, swiglu

ROWS, WIDTH = 64, 256
N = ROWS * WIDTH


def proj_bytes() -> int:
    return 2 * WIDTH * 2 * WIDTH  # bf16: the matmul's weight needs no gradient, x's does


def _step(spec: str) -> SavedActivations:
    ctx = ComputeCtx.new(DType.BF16, "cpu").with_activations(spec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, WIDTH, generator=g).bfloat16().requires_grad_()
    w = torch.nn.Parameter(torch.ones(WIDTH))
    proj = torch.randn(WIDTH, 2 * WIDTH, generator=g).bfloat16()
    with SavedActivations(exclude=[w]) as saved:
        h = rms_norm(ctx, x, w) @ proj  # the matmul keeps proj (untagged: "other")
        out = swiglu(ctx, h[:, :WIDTH], h[:, WIDTH:])
        torch.autograd.backward(out.float().sum())
    return saved


def test_each_kind_is_counted_apart_and_other_holds_the_rest() -> None:
    keep = _step("keep")
    assert keep.bytes("precise") == 2 * 4 * N + 4 * ROWS  # two float32 copies and 1/rms
    # gate and up are views of h: its whole storage (2N bf16 elements), and silu(gate).
    assert keep.bytes("act_fn") == 2 * 2 * N + 2 * N
    assert keep.bytes("other") == proj_bytes()
    assert keep.bytes() == sum(keep.counts.values())
    assert keep.bytes(device="cpu") == keep.bytes() and keep.bytes(device="cuda") == 0
    fp8 = _step("precise:fp8/act_fn:fp8")
    assert fp8.bytes("precise") == N + 4 * N // 128
    assert fp8.bytes("act_fn") == 2 * (N + 4 * N // 128)
    assert fp8.bytes("other") == keep.bytes("other")
    assert fp8.bytes("attention") == 0
