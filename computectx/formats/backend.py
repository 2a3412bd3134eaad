"""Which implementation runs the fp8 operations, and why: ``Backend``, ``select_backend``.

Three backends compute the same function. ``TRITON`` runs the kernels in
``computectx.kernels`` (imported only when first used, so ``import computectx.formats`` works
without triton); ``REFERENCE`` runs the pure-torch twins in
``computectx.formats.numerics.tensorwise``;
``CUBLAS`` runs the GEMMs through ``torch._scaled_mm`` (cuBLASLt on a GPU, torch's own kernel
on the CPU) with tensor-wise scales, K and N zero-padded to the multiples of 16 CUDA wants and
a GEMM of two E5M2 operands (which cuBLAS refuses) on the twin; it quantizes with the same
operators and ledgers as the others (the kernels on a GPU, the twins elsewhere).
``select_backend`` picks one for a device and says why; ``default_backend`` caches that
choice per device; ``check_backend`` is the test every dispatched operation runs before it
hands tensors to a backend; ``uses_kernels`` says whether a backend runs a tensor on the
Triton kernels at all.

The argument checks every operator family's entry point shares live here too (a format, a
tensor to quantize, a float32 scalar, a margin, the fp8 operands of a GEMM, its bias and
result dtype): each raises ``TypeError``/``ValueError`` quoting the value and what is
accepted, and none reads a tensor's contents (that would wait for the device).
"""

from __future__ import annotations

import enum
import functools
import sys

import torch

from computectx import capability
from computectx.dtypes import FLOAT_DTYPES, FP8_DTYPES, Fp8Format
from computectx.residency import parse_device

__all__ = [
    "Backend",
    "check_backend",
    "check_bias_and_out",
    "check_gemm_operands",
    "check_linear_input",
    "default_backend",
    "fmt_arg",
    "input_arg",
    "margin_arg",
    "parse_backend",
    "quantizable_arg",
    "scalar_arg",
    "select_backend",
    "triton_imports",
    "uses_kernels",
]

_TRITON_NEEDS = "Triton fp8 needs CUDA compute capability >= 8.9"
_KERNEL_MODULES = (
    "computectx.kernels.fp8_codes",  # first: the others import its function
    "computectx.kernels.quantize_cast",  # then the quantize kernels' shared functions
    "computectx.kernels.quantize",
    "computectx.kernels.quantize_blocks",
    "computectx.kernels.scaled_mm",
    "computectx.kernels.scaled_mm_blocks",
    "computectx.kernels.grouped_mm",
    "computectx.kernels.grouped_wgrad",
    "computectx.kernels.decode_attention",
)


class Backend(enum.Enum):
    """Which implementation runs the fp8 operations."""

    TRITON = "triton"
    REFERENCE = "reference"
    CUBLAS = "cublas"

    def __str__(self) -> str:
        return self.value


def parse_backend(value: Backend | str) -> Backend:
    """An ``Backend`` from a member or its name (``"triton"``, ``"reference"``,
    ``"cublas"``)."""
    if isinstance(value, Backend):
        return value
    if isinstance(value, str):
        for b in Backend:
            if b.value == value.strip().lower():
                return b
    accepted = ", ".join(repr(b.value) for b in Backend)
    raise ValueError(f"unknown fp8 backend {value!r}; accepted: Backend members or {accepted}")


def select_backend(
    device: torch.device | str, force: Backend | str | None = None
) -> tuple[Backend, str]:
    """The backend for tensors on ``device`` and a one-line reason (``computectx info``).

    Without ``force`` (the rule, docs/fp8.md "Backends"): ``TRITON`` on a CUDA device with
    compute capability >= 8.9 when triton imports; ``CUBLAS`` on such a device without
    triton; ``REFERENCE`` elsewhere. ``force`` picks one; forcing ``TRITON`` where it
    cannot run raises ``ValueError`` saying why (a CPU device is accepted only when
    ``TRITON_INTERPRET=1`` runs the kernels in Triton's interpreter); ``CUBLAS`` runs on a
    CUDA device with fp8 tensor cores and on the CPU (torch's ``_scaled_mm`` CPU kernel).
    ``device`` is read by ``computectx.residency.parse_device``, whose ``ValueError`` lists the
    accepted spellings.
    """
    dev = parse_device(device)
    if force is not None:
        chosen = parse_backend(force)
        if chosen is Backend.REFERENCE:
            return chosen, "reference: forced"
        if chosen is Backend.CUBLAS:
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
        return Backend.REFERENCE, f"reference: {where}; {_TRITON_NEEDS}"
    cores = capability.fp8_tensor_cores(dev)
    if not cores.ok:
        return Backend.REFERENCE, f"reference: {cores.reason}; {_TRITON_NEEDS}"
    tri = capability.triton_available()
    if not tri.ok:
        return Backend.CUBLAS, (
            f"cublas: {cores.reason}; {tri.reason}, so the GEMMs run on torch._scaled_mm (K "
            f"and N zero-padded to multiples of 16; two E5M2 operands on the twin) and the "
            f"quantize on the pure-torch twins"
        )
    return Backend.TRITON, (
        f"triton: {cores.reason}; {tri.reason} (cublas is the alternative; which is faster "
        f"per shape is measured by bench/gpu_check.py)"
    )


@functools.cache
def default_backend(device: torch.device) -> Backend:
    """``select_backend(device)``'s choice, cached per device: a device's capabilities do
    not change while a process runs, and the probes are too slow for every linear call."""
    return select_backend(device)[0]


def check_backend(backend: object, *tensors: torch.Tensor) -> Backend:
    """``backend`` if it is a ``Backend`` that can run on every tensor's device.

    ``TypeError`` for anything but a member (names are for ``select_backend``), and
    ``ValueError`` saying why when ``TRITON`` cannot run on a tensor's device. Reads no
    tensor contents, so it never waits for the device.
    """
    if not isinstance(backend, Backend):
        raise TypeError(
            f"backend must be a Backend (from select_backend), got {backend!r}; "
            f"accepted: {', '.join(str(b) for b in Backend)}"
        )
    if backend is not Backend.REFERENCE:
        runs_on = _triton_runs_on if backend is Backend.TRITON else _cublas_runs_on
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


@functools.cache
def triton_imports() -> bool:
    """Whether triton imports here (``capability.triton_available``, probed once)."""
    return capability.triton_available().ok


def uses_kernels(backend: Backend, x: torch.Tensor) -> bool:
    """Whether ``backend`` runs ``x`` on the Triton kernels (else the pure-torch twins).

    TRITON runs every op on the kernels; CUBLAS quantizes with them on a GPU where triton
    imports (its GEMM is torch._scaled_mm) and with the twins elsewhere: ``select_backend``
    picks CUBLAS precisely when triton does not import.
    """
    return backend is Backend.TRITON or (
        backend is Backend.CUBLAS and x.device.type == "cuda" and triton_imports()
    )


# ---------------------------------------------------------------------------------------
# The argument checks every family's entry point shares.


def fmt_arg(fmt: object) -> Fp8Format:
    """``fmt`` as an ``Fp8Format`` (a member, its name or its torch dtype)."""
    if isinstance(fmt, Fp8Format):
        return fmt
    if isinstance(fmt, (str, torch.dtype)):
        return Fp8Format.parse(fmt)
    raise TypeError(f"fmt must be an Fp8Format or its name, got {fmt!r}; accepted: e4m3, e5m2")


def quantizable_arg(x: object) -> torch.Tensor:
    """``x`` when it is a bf16/fp16/fp32 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor to quantize, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        accepted = ", ".join(map(str, FLOAT_DTYPES))
        raise ValueError(f"cannot quantize a {x.dtype} tensor; accepted: {accepted}")
    return x


def input_arg(x: object) -> torch.Tensor:
    """``quantizable_arg(x)``, contiguous."""
    data = quantizable_arg(x)
    return data if data.is_contiguous() else data.contiguous()


def scalar_arg(name: str, s: object, device: torch.device) -> torch.Tensor:
    """``s`` as a float32 ``(1,)`` tensor on ``device`` (shape ``(1,)`` or ``()`` accepted)."""
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor of one element, got {type(s).__name__}")
    if s.dtype != torch.float32 or s.numel() != 1:
        raise ValueError(
            f"{name} must be a float32 tensor of one element (shape (1,) or ()); "
            f"got dtype {s.dtype}, shape {tuple(s.shape)}"
        )
    if s.device != device:
        raise ValueError(f"{name} is on {s.device} but the data is on {device}")
    return s.reshape(1)


def margin_arg(margin: object) -> int:
    """``margin`` when it is an int in ``[0, 64]``."""
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= 64:
        raise ValueError(f"margin must be an int in [0, 64], got {margin!r}")
    return margin


def _gemm_operand(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a 2-D fp8 tensor, got {type(t).__name__}")
    if t.dtype not in FP8_DTYPES or t.dim() != 2:
        raise ValueError(
            f"{name} must be a 2-D float8_e4m3fn or float8_e5m2 tensor; got dtype {t.dtype}, "
            f"shape {tuple(t.shape)}"
        )
    return t


def check_gemm_operands(a: object, b: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``a [M, K]`` and ``b [N, K]``: 2-D fp8 tensors on one device with the same K."""
    ta, tb = _gemm_operand("a", a), _gemm_operand("b", b)
    if ta.shape[1] != tb.shape[1]:
        raise ValueError(
            f"a is [M, K] and b is [N, K] with the same K; got a {tuple(ta.shape)}, "
            f"b {tuple(tb.shape)}"
        )
    if tb.device != ta.device:
        raise ValueError(f"a is on {ta.device} but b is on {tb.device}")
    return ta, tb


def check_bias_and_out(bias: object, out_dtype: object, a: torch.Tensor, b: torch.Tensor) -> None:
    """``bias`` None or ``[N]`` of a ``FLOAT_DTYPES`` dtype on ``a``'s device; ``out_dtype``
    one of ``FLOAT_DTYPES``."""
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
        if bias.dtype not in FLOAT_DTYPES or tuple(bias.shape) != (b.shape[0],):
            raise ValueError(
                f"bias must be a bf16/fp16/fp32 tensor of shape ({b.shape[0]},); got dtype "
                f"{bias.dtype}, shape {tuple(bias.shape)}"
            )
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"out_dtype {out_dtype!r} is not supported; accepted: "
            f"{', '.join(map(str, FLOAT_DTYPES))}"
        )


def check_linear_input(x: object, in_features: int, who: str) -> None:
    """``TypeError``/``ValueError`` naming ``who`` and the input's dtype and shape, never its
    values, unless ``x`` is a bf16, fp16 or fp32 tensor of shape ``(..., in_features)``: the
    input check of every quantized linear (``QuantizedLinear``, ``Fp4Linear``,
    ``FrozenFp4Linear``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who} takes a tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{who} takes bf16, fp16 or fp32 inputs, got {str(x.dtype).removeprefix('torch.')} "
            f"{tuple(x.shape)}; cast it first (e.g. ctx.to_compute(x); a float64 input to float32)"
        )
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(
            f"{who} expects inputs of shape (..., {in_features}), got {tuple(x.shape)}"
        )
