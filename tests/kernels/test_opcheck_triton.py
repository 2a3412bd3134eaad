"""``torch.library.opcheck`` on the fp8 operators with the Triton backend.

On an fp8 GPU the kernels are compiled; elsewhere they run in Triton's CPU interpreter (see
conftest), at small shapes. The reference and cublas backends are checked in
tests/formats/test_compile.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from computectx.formats.numerics.ledger import ledger_new, tally_new

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# torch's test_schema compares inputs with allclose, which has no fp8 kernel on the CPU.
WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _cases(device: torch.device) -> list[tuple[str, Any, tuple[object, ...]]]:
    ops = torch.ops.computectx
    torch.manual_seed(0)
    x = torch.randn(6, 32, dtype=torch.bfloat16, device=device)
    a = torch.randn(16, 32, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32, device=device).to(torch.float8_e5m2)
    s = torch.full((1,), 0.5, device=device)
    return [
        (
            "quantize_delayed",
            ops.fp8_quantize_delayed,
            (
                x,
                ledger_new(4, device),
                tally_new(device),
                torch.float8_e4m3fn,
                "max",
                0,
                "triton",
                True,
            ),
        ),
        (
            "quantize_dynamic",
            ops.fp8_quantize_dynamic,
            (
                x,
                ledger_new(1, device),
                tally_new(device),
                torch.float8_e5m2,
                0,
                "triton",
            ),
        ),
        (
            "quantize_with_step",
            ops.fp8_quantize_with_step,
            (x, torch.full((1,), 0.01, device=device), torch.float8_e4m3fn, "triton"),
        ),
        ("scaled_mm", ops.fp8_scaled_mm, (a, b, s, s, None, torch.bfloat16, "triton")),
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", range(4), ids=["delayed", "dynamic", "with_step", "scaled_mm"])
def test_opcheck_passes_on_the_triton_backend(device: torch.device, case: int) -> None:
    _, op, args = _cases(device)[case]
    tensors = [t for t in args if isinstance(t, torch.Tensor)]
    if any(t.dtype in FP8 for t in tensors):
        torch.library.opcheck(op, args, test_utils=WITHOUT_SCHEMA)
    else:
        torch.library.opcheck(op, args)
