"""Capability probes: each answers (yes/no, why) so callers can report the reason."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import time
from dataclasses import dataclass

import torch

__all__ = [
    "Probe",
    "cuda",
    "default_device",
    "fp8_tensor_cores",
    "native_half_gemm",
    "triton_available",
    "triton_interpreter",
]


@dataclass(frozen=True)
class Probe:
    """A capability answer: ``ok`` and a one-line human reason.

    ``measured`` is the number the answer rests on when a probe measures rather than asks
    (``native_half_gemm``: the half-precision / float32 time ratio), else ``None``.
    """

    ok: bool
    reason: str
    measured: float | None = None

    def __bool__(self) -> bool:
        return self.ok


def cuda(device: torch.device | str | None = None) -> Probe:
    """Whether CUDA can run here (and, given a device, whether that device exists)."""
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = "torch is a CPU-only build" if built is None else "no CUDA device is visible"
        return Probe(False, why)
    n = torch.cuda.device_count()
    if device is not None:
        dev = torch.device(device)
        if dev.type != "cuda":
            return Probe(False, f"device {dev} is not a CUDA device")
        if dev.index is not None and dev.index >= n:
            return Probe(False, f"device {dev} does not exist ({n} CUDA device(s) visible)")
    return Probe(True, f"{n} CUDA device(s), CUDA {torch.version.cuda}")


def default_device() -> torch.device:
    """CUDA when the ``cuda`` probe says it can run here, else the CPU."""
    return torch.device("cuda") if cuda().ok else torch.device("cpu")


def fp8_tensor_cores(device: torch.device | str | None = None) -> Probe:
    """Whether the CUDA device has fp8 tensor cores (compute capability >= 8.9: Ada, Hopper,
    Blackwell)."""
    base = cuda(device)
    if not base.ok:
        return Probe(False, f"no fp8 tensor cores: {base.reason}")
    dev = torch.device(device) if device is not None else torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(dev)
    name = torch.cuda.get_device_name(dev)
    if (major, minor) >= (8, 9):
        return Probe(True, f"{name} has compute capability {major}.{minor} >= 8.9")
    return Probe(False, f"{name} has compute capability {major}.{minor} < 8.9")


def triton_available() -> Probe:
    """Whether the ``triton`` package can be imported."""
    if importlib.util.find_spec("triton") is None:
        return Probe(False, "the triton package is not installed")
    try:
        import triton
    except Exception as e:  # a broken install is an answer, not a crash
        return Probe(False, f"triton failed to import: {e}")
    return Probe(True, f"triton {triton.__version__}")


def triton_interpreter() -> Probe:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    value = os.environ.get("TRITON_INTERPRET", "")
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return Probe(True, f"TRITON_INTERPRET={value}: kernels run on the CPU, slowly")
    return Probe(False, "TRITON_INTERPRET is not set: kernels compile for the GPU")


HALF_GEMM_MAX_RATIO = 2.0
"""``native_half_gemm`` says yes when a half-precision matmul takes at most this many times
the float32 time. Hardware with bf16/f16 dot products (AVX512-BF16, AMX, AVX512-FP16, Arm
BF16) is at or below 1; without it torch converts inside the kernel and measures 10-80x."""

_PROBE_SHAPE = (128, 256, 128)
"""``native_half_gemm`` times ``(M, K) @ (K, N)`` for this ``(M, K, N)``: ~0.1 ms in float32
on one AVX2 core, ~9 ms where the half-precision path converts in the kernel."""


def native_half_gemm(dtype: torch.dtype = torch.bfloat16) -> Probe:
    """Whether this CPU runs ``dtype`` (``torch.bfloat16`` or ``torch.float16``) matrix
    multiplies at native speed, measured: at most ``HALF_GEMM_MAX_RATIO`` times the float32
    time of the same multiply.

    The first call per dtype times one small matmul in each dtype on one thread (the thread
    count is restored; more threads would time the machine's other load) and caches the
    answer for the process: best of 3 after a warm-up, or a single timing when the half path
    is already far over the limit (~20 ms then). ``measured`` holds the ratio. No numbers are
    drawn from torch's global generator. Only the CPU is measured: CUDA half-precision GEMMs
    run on tensor cores.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"native_half_gemm measures torch.bfloat16 or torch.float16, got {dtype!r}"
        )
    return _half_gemm_probe(dtype)


@functools.cache
def _half_gemm_probe(dtype: torch.dtype) -> Probe:
    m, k, n = _PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            wide = _best_time(a, b, repeats=3)
            ah, bh = a.to(dtype), b.to(dtype)
            half = _best_time(ah, bh, repeats=1)
            if half <= 2 * HALF_GEMM_MAX_RATIO * wide:
                half = min(half, _best_time(ah, bh, repeats=2, warm=False))
    finally:
        torch.set_num_threads(threads)
    ratio = half / wide if wide > 0 else math.inf
    name = str(dtype).removeprefix("torch.")
    timing = (
        f"a {name} matmul takes {ratio:.1f}x the float32 time ({half * 1e3:.2f} vs "
        f"{wide * 1e3:.2f} ms for {m}x{k} @ {k}x{n} on 1 thread; torch cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()})"
    )
    if ratio <= HALF_GEMM_MAX_RATIO:
        return Probe(True, timing, ratio)
    return Probe(False, f"{timing}: no native {name} GEMM", ratio)


def _best_time(a: torch.Tensor, b: torch.Tensor, repeats: int, warm: bool = True) -> float:
    if warm:
        torch.mm(a, b)  # the first call allocates and picks a kernel
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best
