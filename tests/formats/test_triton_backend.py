"""The fp8 autograd path on the Triton backend agrees with the reference backend.

Runs in a child interpreter with ``TRITON_INTERPRET=1`` (Triton decides at import time
whether kernels are interpreted, so the setting must not leak into this process): an
``QuantizedLinear`` (48 -> 80: fp8 widths are multiples of 16, yet neither fills the interpreter's
32-wide tiles) and a region-routed ``nn.Linear`` (80 -> 8) on 10 rows, three training steps,
with transposed-view backward GEMMs. Quantization is bit-exact between the backends, so the
ledgers must be identical; the GEMMs differ at most by float32 summation order.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.interpreter, pytest.mark.slow]

CHILD = textwrap.dedent(
    """
    import torch
    from computectx import ComputeCtx
    from computectx.formats import DelayedScaling, QuantizedLinear, Recipe, autocast
    from computectx.formats.linear.autocast import region_scaling_state

    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(
        fp8=Recipe(scaling=DelayedScaling(history_len=3))
    )
    torch.manual_seed(0)
    ref = QuantizedLinear(48, 80, ctx=ctx, backend="reference")
    tri = QuantizedLinear(48, 80, ctx=ctx, backend="triton")
    tri.load_state_dict(ref.state_dict())
    plain_r, plain_t = torch.nn.Linear(80, 8), torch.nn.Linear(80, 8)
    plain_t.load_state_dict(plain_r.state_dict())
    assert str(tri.backend) == "triton" and str(ref.backend) == "reference"

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    for step in range(3):
        x = torch.randn(2, 5, 48) * (1 + step)
        xr, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        with autocast(ctx, backend="reference"):
            yr = plain_r(ref(xr))
        with autocast(ctx, backend="triton"):
            yt = plain_t(tri(xt))
        g = torch.randn_like(yr)
        yr.backward(g)
        yt.backward(g)
        assert close(yr, yt), (yr - yt).abs().max()
        assert close(xr.grad, xt.grad)
        assert close(ref.weight.grad, tri.weight.grad)
        assert close(plain_r.weight.grad, plain_t.weight.grad)
        for role in ("input", "weight", "grad"):
            assert torch.equal(ref.scaling.operands[role].ledger, tri.scaling.operands[role].ledger)
            sr = region_scaling_state(plain_r.weight).operands[role].ledger
            st = region_scaling_state(plain_t.weight).operands[role].ledger
            assert torch.equal(sr, st), role
    print("agree")
    """
)


def test_triton_backend_matches_reference_through_autograd() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("agree")
