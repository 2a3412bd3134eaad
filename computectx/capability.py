"""Capability probes: each answers (yes/no, why) so callers can report the reason."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

__all__ = [
    "Probe",
    "cuda",
    "default_device",
    "fp8_tensor_cores",
    "triton_available",
    "triton_interpreter",
]


@dataclass(frozen=True)
class Probe:
    """A capability answer: ``ok`` and a one-line human reason."""

    ok: bool
    reason: str

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
