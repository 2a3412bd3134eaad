"""Which backend runs the 4-bit operators (``computectx.formats.ops.fp4``): the probe for FP4
tensor cores, ``select_fp4_backend`` (``"triton"`` on a GPU with them where triton imports,
``"emulated"`` everywhere else, with the reason), and the operators' check of their
``backend`` argument; and the checks of the entry points' arguments (the recipe's values, a
2-D operand, the stochastic-rounding key). ``ops.fp4`` re-exports the public backend names.
"""

from __future__ import annotations

import functools
from typing import Final

import torch

from computectx import capability
from computectx.formats.backend import quantizable_arg
from computectx.formats.numerics.e2m1 import Stochastic
from computectx.formats.numerics.fp4_gemm import Fp4Quant
from computectx.residency import parse_device

__all__ = [
    "EMULATED",
    "TRITON",
    "backend_of",
    "check_2d",
    "check_how",
    "fp4_tensor_cores",
    "rng_arg",
    "runs_triton",
    "select_fp4_backend",
]

EMULATED: Final[str] = "emulated"
"""The backend that runs the twins (``numerics.fp4_gemm``): any device."""
TRITON: Final[str] = "triton"
"""The backend that runs the Triton kernels on FP4 tensor cores (compute capability >= 10.0)."""
_BACKENDS: Final[tuple[str, ...]] = (EMULATED, TRITON)
_U64: Final[int] = 2**64


def fp4_tensor_cores(device: torch.device | str) -> capability.Probe:
    """Whether ``device`` has FP4 tensor cores (a CUDA device of compute capability >= 10.0:
    Blackwell's sm_100/sm_103/sm_120)."""
    base = capability.cuda(device)
    if not base.ok:
        return capability.Probe(False, f"no FP4 tensor cores: {base.reason}")
    dev = torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    name = torch.cuda.get_device_name(dev)
    if major >= 10:
        return capability.Probe(True, f"{name} has compute capability {major}.{minor} >= 10.0")
    return capability.Probe(
        False, f"{name} has compute capability {major}.{minor} < 10.0: no FP4 tensor cores"
    )


def select_fp4_backend(device: torch.device | str) -> tuple[str, str]:
    """The 4-bit backend for tensors on ``device`` and a one-line reason: ``"triton"`` on a
    GPU with FP4 tensor cores where triton imports, else ``"emulated"``, saying why (module
    docstring)."""
    dev = parse_device(device)
    cores = fp4_tensor_cores(dev) if dev.type == "cuda" else None
    if cores is None:
        where = f"{dev} is not a GPU"
    elif not cores.ok:
        where = f"{cores.reason} (an H100/H200 has none)"
    elif (triton := capability.triton_available()).ok:
        return TRITON, f"triton: {cores.reason}; the Triton kernels (tl.dot_scaled) run"
    else:
        where = f"{cores.reason}, but {triton.reason}"
    return EMULATED, (
        f"emulated: {where}; the 4-bit GEMMs run the pure-torch twin (numerics.fp4_gemm) in "
        f"float32 on {dev}, never an 8-bit fallback"
    )


def runs_triton(backend: str) -> bool:
    """Whether an operator's ``backend`` argument runs the Triton kernels (``"triton"``) or
    the twins (``"emulated"``); another name is a ``ValueError`` naming it."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown 4-bit backend {backend!r}; accepted: {', '.join(_BACKENDS)}")
    return backend == TRITON


def backend_of(t: torch.Tensor) -> str:
    """The entry points' backend for ``t``, by its device (a CPU tensor never probes CUDA; a
    CUDA device is probed once, as ``formats.backend.default_backend`` is)."""
    return EMULATED if t.device.type != "cuda" else _cuda_backend(t.device)


@functools.cache
def _cuda_backend(device: torch.device) -> str:
    return select_fp4_backend(device)[0]


def rng_arg(
    stochastic: Stochastic | torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor | None:
    """The stochastic-rounding key an operator takes: ``None``, or int64 ``(2,)`` [seed,
    counter] (the seed in two's complement)."""
    # A key tensor (int64 (2,): seed, counter) passes as it is: a layer's counter, read
    # inside the operator, never a guard of a compiled caller. On the CPU or the operands'
    # device only: a custom op dispatches on every tensor argument, so a key on the meta
    # device would run the fake kernel on real operands (uninitialized memory back).
    if stochastic is None:
        return None
    if isinstance(stochastic, torch.Tensor):
        if stochastic.dtype != torch.int64 or tuple(stochastic.shape) != (2,):
            raise ValueError(
                f"a stochastic-rounding key tensor is int64 (2,) [seed, counter], got "
                f"{stochastic.dtype} {tuple(stochastic.shape)}"
            )
        if stochastic.device.type != "cpu" and stochastic.device != like.device:
            raise ValueError(
                f"a stochastic-rounding key tensor lies on the CPU or on the operands' device "
                f"({like.device}), got one on {stochastic.device}"
            )
        return stochastic
    if not isinstance(stochastic, Stochastic):
        raise TypeError(f"stochastic must be a Stochastic key or None, got {stochastic!r}")
    seed = stochastic.seed if stochastic.seed < 2**63 else stochastic.seed - _U64
    return torch.tensor([seed, stochastic.offset], dtype=torch.int64)


def check_how(how: object) -> Fp4Quant:
    """``how`` if it is an ``Fp4Quant``, else a ``TypeError`` naming it."""
    if not isinstance(how, Fp4Quant):
        raise TypeError(f"how must be an Fp4Quant (the recipe's 4-bit values), got {how!r}")
    return how


def check_2d(x: object, multiple: int, rows_multiple: int, who: str) -> torch.Tensor:
    """``x`` if it is a quantizable 2-D tensor with K a multiple of ``multiple`` and rows of
    ``rows_multiple``, else a ``ValueError`` naming its shape."""
    t = quantizable_arg(x)
    if t.dim() != 2 or t.shape[1] % multiple or t.shape[0] % rows_multiple:
        rows = f", rows a multiple of {rows_multiple}" if rows_multiple > 1 else ""
        raise ValueError(
            f"{who} takes a 2-D tensor with the last dimension a multiple of {multiple}{rows}, "
            f"got shape {tuple(t.shape)}"
        )
    return t
