"""The 4-bit grouped GEMMs from high-precision values (``computectx.kernels.fp4_grouped_values``:
the Triton quantize per group, then one grouped launch) against the grouped twins,
``numerics.fp4_gemm.reference_fp4_grouped_mm`` and ``reference_fp4_grouped_wgrad``.

The quantize is the twins' bit for bit (test_fp4_gemm_quantize.py), so both sides multiply the
same operands (each group's own amax, the stochastic counters of the whole tensor, the wgrad's
per-group padding and Hadamard transform of bf16 runs within 12 binades); the sums differ in
order only: each group within twice the widened bound of its operands (test_fp4_gemm.py's
``widened_bound``, both results within it of the same exact product). Empty groups are zero.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from computectx.formats.numerics import fp4_gemm as twin
from computectx.formats.numerics.e2m1 import WGRAD_SIGNS, Stochastic
from computectx.formats.numerics.fp4_gemm import Fp4Format, Fp4Quant

from .test_fp4_gemm import DEVICE, fp4_kernel_module, needs_fp4, widened_bound

pytestmark = [
    pytest.mark.interpreter,
    needs_fp4,
    # The interpreter's numpy warns on 1 / 0 (a padded block's zero scale, as the twin's).
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

kv = fp4_kernel_module("computectx.kernels.fp4_grouped_values")


def values(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """bf16 magnitudes in [0.5, 8) with random signs: any 16 within 12 binades."""
    x = torch.rand(shape, generator=gen) * 7.5 + 0.5
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return (x * sign).to(torch.bfloat16)


def bounds_of(sizes: list[int]) -> list[tuple[int, int]]:
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(end - size, end) for end, size in zip(ends, sizes, strict=True)]


def offs_of(bounds: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([end for _, end in bounds], dtype=torch.int32, device=DEVICE)


def rng_of(key: Stochastic) -> torch.Tensor:
    return torch.tensor([key.seed, key.offset], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize(
    ("fmt", "tile", "rounding", "sizes", "tail"),
    [("nvfp4", "16x16", "rceil", [13, 0, 20], 3), ("mxfp4", "1x16", "floor", [0, 9, 17], 0)],
)
def test_grouped_mm_values_are_the_grouped_twin(
    fmt: Fp4Format, tile: str, rounding: str, sizes: list[int], tail: int
) -> None:
    gen = torch.Generator().manual_seed(len(sizes) + tail)
    how = Fp4Quant(
        format=fmt,
        weight_tile="16x16" if tile == "16x16" else "1x16",
        mx_rounding="floor" if rounding == "floor" else "rceil",
    )
    n, k, key = 32, 64, Stochastic(5, 100)
    a, b = values((sum(sizes) + tail, k), gen), values((len(sizes), n, k), gen)
    bounds = bounds_of(sizes)
    offs = offs_of(bounds)
    out = kv.grouped_mm_values(
        a.to(DEVICE), b.to(DEVICE), bounds, offs, fmt, tile, rounding, rng_of(key), torch.float32
    ).cpu()
    ref = twin.reference_fp4_grouped_mm(a, b, bounds, how, torch.float32, key)
    for g, (lo, hi) in enumerate(bounds):
        if hi > lo:
            qa = twin.quantize_rows(a[lo:hi], how, stochastic=Stochastic(5, 100 + lo * k))
            qb = twin.quantize_rows(b[g], how, weight=True)
            err = (out[lo:hi].double() - ref[lo:hi].double()).abs()
            assert bool((err <= 2 * widened_bound(qa, qb, torch.float32, None)).all()), g
    assert not bool(out[sum(sizes) :].any()), "rows past the last group are zero"


@pytest.mark.parametrize(("fmt", "tile"), [("nvfp4", "16x16"), ("mxfp4", "1x16")])
def test_given_the_twins_expert_operands_the_product_is_grouped_mm_values(
    fmt: Fp4Format, tile: str
) -> None:
    # FSDP2's gathered experts (ops.fp4_grouped_gathered): each expert's operand as the twin
    # quantizes it, stacked, is what the launch quantizes from the values (the kernel quantize
    # is the twin's bit for bit), so the product is the same.
    gen = torch.Generator().manual_seed(11)
    how = Fp4Quant(format=fmt, weight_tile="16x16" if tile == "16x16" else "1x16")
    sizes, n, k, key = [3, 0, 4], 32, 32, Stochastic(3, 40)
    a, b = values((sum(sizes) + 2, k), gen), values((len(sizes), n, k), gen)
    bounds = bounds_of(sizes)
    qs = [twin.quantize_rows(b[g], how, weight=True) for g in range(len(sizes))]
    amaxes = [q.amax.reshape(()) for q in qs if hasattr(q, "amax")]
    held = (
        torch.stack([q.codes for q in qs]).to(DEVICE),
        torch.stack([q.scale for q in qs]).to(DEVICE),
        torch.stack(amaxes).to(DEVICE) if amaxes else None,
    )
    args = (fmt, tile, "rceil", rng_of(key), torch.float32)
    offs = offs_of(bounds)
    got = kv.grouped_mm_gathered_values(a.to(DEVICE), *held, bounds, offs, *args)
    want = kv.grouped_mm_values(a.to(DEVICE), b.to(DEVICE), bounds, offs, *args)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("fmt", "hadamard"), [("nvfp4", True), ("mxfp4", False)])
def test_grouped_wgrad_values_are_the_grouped_twin(fmt: Fp4Format, hadamard: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    how = Fp4Quant(format=fmt, hadamard=hadamard)
    sizes, n, k = [7, 0, 19], 24, 40
    dy, x = values((sum(sizes), n), gen), values((sum(sizes), k), gen)
    bounds, key = bounds_of(sizes), Stochastic(9, 0)
    out = kv.grouped_wgrad_values(
        dy.to(DEVICE), x.to(DEVICE), bounds, offs_of(bounds), fmt, "rceil", hadamard,
        list(WGRAD_SIGNS), rng_of(key),
    ).cpu()  # fmt: skip
    ref = twin.reference_fp4_grouped_wgrad(dy, x, bounds, how, key)
    assert out.shape == (3, n, k) and not bool(out[1].any())
    consumed = 0
    for g, (lo, hi) in enumerate(bounds):
        if hi > lo:
            qd = twin.wgrad_operand(dy[lo:hi], how, stochastic=Stochastic(9, consumed))
            qx = twin.wgrad_operand(x[lo:hi], how)
            consumed += qd.codes.shape[1] * 2 * n
            err = (out[g].double() - ref[g].double()).abs()
            assert bool((err <= 2 * widened_bound(qd, qx, torch.float32, None)).all()), g


_LAUNCHERS = ("kernels/fp4_grouped_values.py", "kernels/fp4_quantize.py")


class _HostData(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Counts the tensors the launchers build from host data (``torch.tensor(...)``:
    ``aten.lift_fresh``), each a copy to the device on a GPU; the interpreter's own (and its
    ``tl.dot_scaled`` stand-in's, in ``kernels/fp4_gemm.py``) are not theirs."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.lift_fresh.default:
            ours = [f for f in traceback.extract_stack() if "/computectx/" in f.filename]
            if ours and ours[-1].filename.endswith(_LAUNCHERS):
                self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_grouped_launches_copy_no_host_data_to_the_device() -> None:
    # The wgrad's padded group ends come from offs on its device, each group's key from the
    # key by an integer added on its device: no host list becomes a device tensor per call.
    gen = torch.Generator().manual_seed(4)
    sizes, n, k = [7, 0, 19], 16, 32
    dy, x = values((sum(sizes), n), gen), values((sum(sizes), k), gen)
    bounds, rng = bounds_of(sizes), rng_of(Stochastic(9, 5))
    signs = list(WGRAD_SIGNS)
    dy, x, offs, w = dy.to(DEVICE), x.to(DEVICE), offs_of(bounds), values((3, n, k), gen)
    with _HostData() as made:
        kv.grouped_wgrad_values(dy, x, bounds, offs, "nvfp4", "rceil", True, signs, rng)
        kv.grouped_mm_values(
            x, w.to(DEVICE), bounds, offs, "nvfp4", "1x16", "rceil", rng, torch.float32
        )
    assert made.count == 0
