"""Which implementation runs the fp8 operations, and why: ``Fp8Backend``, ``select_backend``.

Three backends compute the same function. ``TRITON`` runs the kernels in
``computectx.kernels`` (imported only when first used, so ``import computectx.fp8`` works
without triton); ``REFERENCE`` runs the pure-torch twins in ``computectx.fp8.numerics.tensorwise``;
``CUBLAS`` runs the GEMMs through ``torch._scaled_mm`` (cuBLASLt on a GPU, torch's own kernel
on the CPU) with tensor-wise scales, K and N zero-padded to the multiples of 16 CUDA wants and
a GEMM of two E5M2 operands (which cuBLAS refuses) on the twin; it quantizes with the same
operators and ledgers as the others (the kernels on a GPU, the twins elsewhere).
``select_backend`` picks one for a device and says why; ``default_backend`` caches that
choice per device; ``check_backend`` is the test every dispatched operation runs before it
hands tensors to a backend.
"""

from __future__ import annotations

import enum
import functools
import sys

import torch

from computectx import capability
from computectx.ctx import parse_device

__all__ = ["Fp8Backend", "check_backend", "default_backend", "parse_backend", "select_backend"]

_TRITON_NEEDS = "Triton fp8 needs CUDA compute capability >= 8.9"
_KERNEL_MODULES = (
    "computectx.kernels.fp8_codes",  # first: the others import its function
    "computectx.kernels.quantize",
    "computectx.kernels.quantize_blocks",
    "computectx.kernels.scaled_mm",
    "computectx.kernels.scaled_mm_blocks",
    "computectx.kernels.grouped_mm",
    "computectx.kernels.grouped_wgrad",
    "computectx.kernels.decode_attention",
)


class Fp8Backend(enum.Enum):
    """Which implementation runs the fp8 operations."""

    TRITON = "triton"
    REFERENCE = "reference"
    CUBLAS = "cublas"

    def __str__(self) -> str:
        return self.value


def parse_backend(value: Fp8Backend | str) -> Fp8Backend:
    """An ``Fp8Backend`` from a member or its name (``"triton"``, ``"reference"``,
    ``"cublas"``)."""
    if isinstance(value, Fp8Backend):
        return value
    if isinstance(value, str):
        for b in Fp8Backend:
            if b.value == value.strip().lower():
                return b
    accepted = ", ".join(repr(b.value) for b in Fp8Backend)
    raise ValueError(f"unknown fp8 backend {value!r}; accepted: Fp8Backend members or {accepted}")


def select_backend(
    device: torch.device | str, force: Fp8Backend | str | None = None
) -> tuple[Fp8Backend, str]:
    """The backend for tensors on ``device`` and a one-line reason (``computectx info``).

    Without ``force`` (the rule, docs/fp8.md "Backends"): ``TRITON`` on a CUDA device with
    compute capability >= 8.9 when triton imports; ``CUBLAS`` on such a device without
    triton; ``REFERENCE`` elsewhere. ``force`` picks one; forcing ``TRITON`` where it
    cannot run raises ``ValueError`` saying why (a CPU device is accepted only when
    ``TRITON_INTERPRET=1`` runs the kernels in Triton's interpreter); ``CUBLAS`` runs on a
    CUDA device with fp8 tensor cores and on the CPU (torch's ``_scaled_mm`` CPU kernel).
    ``device`` is read by ``computectx.ctx.parse_device``, whose ``ValueError`` lists the
    accepted spellings.
    """
    dev = parse_device(device)
    if force is not None:
        chosen = parse_backend(force)
        if chosen is Fp8Backend.REFERENCE:
            return chosen, "reference: forced"
        if chosen is Fp8Backend.CUBLAS:
            ok, why = _cublas_runs_on(dev)
            if not ok:
                raise ValueError(f"cannot force the cublas fp8 backend on {dev}: {why}")
            return chosen, f"cublas: forced; {why}"
        ok, why = _triton_runs_on(dev)
        if not ok:
            raise ValueError(f"cannot force the triton fp8 backend on {dev}: {why}")
        return chosen, f"triton: forced; {why}"
    if dev.type != "cuda":
        cuda = capability.cuda(dev)
        where = f"no CUDA device ({cuda.reason})" if not cuda.ok else f"{dev} is not a GPU"
        return Fp8Backend.REFERENCE, f"reference: {where}; {_TRITON_NEEDS}"
    cores = capability.fp8_tensor_cores(dev)
    if not cores.ok:
        return Fp8Backend.REFERENCE, f"reference: {cores.reason}; {_TRITON_NEEDS}"
    tri = capability.triton_available()
    if not tri.ok:
        return Fp8Backend.CUBLAS, (
            f"cublas: {cores.reason}; {tri.reason}, so the GEMMs run on torch._scaled_mm (K "
            f"and N zero-padded to multiples of 16; two E5M2 operands on the twin) and the "
            f"quantize on the pure-torch twins"
        )
    return Fp8Backend.TRITON, (
        f"triton: {cores.reason}; {tri.reason} (cublas is the alternative; which is faster "
        f"per shape is measured by bench/gpu_check.py)"
    )


@functools.cache
def default_backend(device: torch.device) -> Fp8Backend:
    """``select_backend(device)``'s choice, cached per device: a device's capabilities do
    not change while a process runs, and the probes are too slow for every linear call."""
    return select_backend(device)[0]


def check_backend(backend: object, *tensors: torch.Tensor) -> Fp8Backend:
    """``backend`` if it is an ``Fp8Backend`` that can run on every tensor's device.

    ``TypeError`` for anything but a member (names are for ``select_backend``), and
    ``ValueError`` saying why when ``TRITON`` cannot run on a tensor's device. Reads no
    tensor contents, so it never waits for the device.
    """
    if not isinstance(backend, Fp8Backend):
        raise TypeError(
            f"backend must be an Fp8Backend (from select_backend), got {backend!r}; "
            f"accepted: {', '.join(str(b) for b in Fp8Backend)}"
        )
    if backend is not Fp8Backend.REFERENCE:
        runs_on = _triton_runs_on if backend is Fp8Backend.TRITON else _cublas_runs_on
        for t in tensors:
            ok, why = runs_on(t.device)
            if not ok:
                raise ValueError(f"the {backend} fp8 backend cannot run on {t.device}: {why}")
    return backend


@functools.cache  # on every quantize and GEMM call: probe each device once
def _cublas_runs_on(dev: torch.device) -> tuple[bool, str]:
    if dev.type == "cpu":
        return True, "torch._scaled_mm's CPU kernel"
    if dev.type == "cuda":
        cores = capability.fp8_tensor_cores(dev)
        return cores.ok, f"{cores.reason}; torch._scaled_mm (cuBLASLt)"
    return False, f"{dev} tensors need a CUDA device with fp8 tensor cores or the CPU"


def _triton_runs_on(dev: torch.device) -> tuple[bool, str]:
    if dev.type == "cuda":
        return _triton_runs_on_cuda(dev)
    tri = capability.triton_available()
    if not tri.ok:
        return False, tri.reason
    interp = capability.triton_interpreter()
    if dev.type == "cpu" and interp.ok:
        stale = [
            name
            for name in _KERNEL_MODULES
            if name in sys.modules and not getattr(sys.modules[name], "INTERPRETED", True)
        ]
        if stale:
            return False, (
                f"{', '.join(stale)} was imported before TRITON_INTERPRET=1 was set, so its "
                f"kernels were compiled for a GPU; set the variable before the first import"
            )
        return True, f"{interp.reason}; {tri.reason}"
    return False, f"{dev} tensors need a CUDA device or TRITON_INTERPRET=1 ({interp.reason})"


@functools.cache
def _triton_runs_on_cuda(dev: torch.device) -> tuple[bool, str]:
    # Cached: a device's compute capability and the triton install do not change while a
    # process runs, and this check sits on every call of the Triton backend.
    tri = capability.triton_available()
    if not tri.ok:
        return False, tri.reason
    cores = capability.fp8_tensor_cores(dev)
    return cores.ok, f"{cores.reason}; {tri.reason}"
