"""The 4-bit operators (``computectx.formats.ops.fp4``) on their ``"triton"`` backend: each
operator hands its arguments to the Triton kernels as they are and returns what the emulated
backend returns (the quantize bit for bit; the GEMM bit for bit on exact data), and the entry
points pick the backend by the operands' device (a CPU tensor: emulated, never a probe).

Interpreted on the CPU (the kernels' own tests hold them to the twins; this holds the wiring).
"""

from __future__ import annotations

import pytest
import torch

from computectx.formats.numerics.e2m1 import WGRAD_SIGNS
from computectx.formats.ops import fp4 as ops

from .test_fp4_gemm import DEVICE, assert_same, exact_operand, fp4_kernel_module, needs_fp4

pytestmark = [
    pytest.mark.interpreter,
    needs_fp4,
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter's 1 / 0 of a zero block
]

for _name in ("fp4_gemm", "fp4_quantize", "fp4_grouped_values"):
    fp4_kernel_module(f"computectx.kernels.{_name}")


@pytest.mark.parametrize(
    ("fmt", "tile", "columnwise", "keyed"),
    [
        ("nvfp4", "16x16", False, False),
        ("nvfp4", "1x16", True, True),
        ("mxfp4", "1x16", False, True),
    ],
)
def test_quantize_on_triton_is_the_emulated_operator(
    fmt: str, tile: str, columnwise: bool, keyed: bool
) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(32, 64, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    rng = torch.tensor([7, 1000], dtype=torch.int64) if keyed else None
    args = (fmt, tile, "rceil", columnwise, columnwise, list(WGRAD_SIGNS), rng)
    got = ops.fp4_quantize(x, *args, ops.TRITON)
    want = ops.fp4_quantize(x.cpu(), *args, ops.EMULATED)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize(("ta", "tb"), [("1x16", "16x16"), ("1x32", "1x32")])
def test_scaled_mm_on_triton_is_the_emulated_operator_on_exact_data(ta: str, tb: str) -> None:
    gen = torch.Generator().manual_seed(5)
    qa, qb = exact_operand(17, 64, ta, gen), exact_operand(32, 64, tb, gen)

    def run(backend: str, device: torch.device) -> torch.Tensor:
        args: list[object] = []
        for q, tile in ((qa, ta), (qb, tb)):
            amax = getattr(q, "amax", None)  # NVFP4's per-tensor amax; MXFP4 has none
            amax = None if amax is None else amax.reshape(1).to(device)
            args += [q.codes.to(device), q.scale.to(device), amax, tile]
        out: torch.Tensor = ops.fp4_scaled_mm(*args, None, torch.float32, backend)
        return out

    assert_same(run(ops.TRITON, DEVICE), run(ops.EMULATED, torch.device("cpu")))


def test_an_unknown_backend_is_refused_and_a_cpu_operand_runs_emulated() -> None:
    x = torch.randn(16, 32)
    with pytest.raises(
        ValueError, match=r"unknown 4-bit backend 'fp8'; accepted: emulated, triton"
    ):
        ops.fp4_quantize(x, "nvfp4", "1x16", "rceil", False, False, list(WGRAD_SIGNS), None, "fp8")
    assert ops.select_fp4_backend("cpu")[0] == ops.EMULATED
