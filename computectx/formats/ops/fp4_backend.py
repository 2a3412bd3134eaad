"""Which backend runs the 4-bit operators (``computectx.formats.ops.fp4``): the probe for FP4
tensor cores, ``select_fp4_backend`` (on a GPU with them where triton imports, ``"cublas"``
where torch's FP4 ``scaled_mm`` runs a 4-bit recipe there (``kernels.cublas_fp4.fp4_recipes``,
probed once per device), else ``"triton"``; ``"emulated"`` everywhere else, with the reason),
and the operators' check of their ``backend`` argument (a forced ``"cublas"`` where it cannot
run is a ``ValueError`` naming the device and why); and the checks of the entry points'
arguments (the recipe's values, a 2-D operand, the stochastic-rounding key). ``ops.fp4``
re-exports the public backend names.
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
    "CUBLAS",
    "EMULATED",
    "TRITON",
    "backend_of",
    "check_2d",
    "check_how",
    "cublas_refusal",
    "fp4_cublas_recipes",
    "fp4_tensor_cores",
    "rng_arg",
    "runs_triton",
    "select_fp4_backend",
]

EMULATED: Final[str] = "emulated"
"""The backend that runs the twins (``numerics.fp4_gemm``): any device."""
TRITON: Final[str] = "triton"
"""The backend that runs the Triton kernels on FP4 tensor cores (compute capability >= 10.0)."""
CUBLAS: Final[str] = "cublas"
"""The backend that runs the dense 4-bit GEMM on torch's FP4 ``scaled_mm`` (cuBLAS) where its
recipe runs (``kernels.cublas_fp4``), the Triton kernels otherwise and for every other
operator (compute capability >= 10.0, triton importable)."""
_BACKENDS: Final[tuple[str, ...]] = (EMULATED, TRITON, CUBLAS)
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


def fp4_cublas_recipes(device: torch.device | str) -> dict[str, tuple[bool, str]]:
    """Which 4-bit cuBLAS recipes run on ``device`` (``kernels.cublas_fp4.fp4_recipes``:
    ``"nvfp4"``/``"mxfp4"`` -> ``(runs, reason)``, probed once per device, bf16 result)."""
    from computectx.kernels import cublas_fp4

    return cublas_fp4.fp4_recipes(parse_device(device))


def _cublas_recipes(device: torch.device) -> str | None:
    # None where torch's FP4 scaled_mm runs a 4-bit recipe on `device`, else why not.
    found = fp4_cublas_recipes(device)
    if any(runs for runs, _ in found.values()):
        return None
    return (
        "torch's FP4 scaled_mm runs no 4-bit recipe there ("
        + "; ".join(why for _, why in found.values())
        + ")"
    )


def _no_kernels(dev: torch.device) -> str | None:
    # None where the Triton kernels run on `dev` (FP4 tensor cores, triton imports), else why.
    if dev.type != "cuda":
        return f"{dev} is not a GPU"
    cores = fp4_tensor_cores(dev)
    if not cores.ok:
        return f"{cores.reason} (an H100/H200 has none)"
    triton = capability.triton_available()
    return None if triton.ok else f"{cores.reason}, but {triton.reason}"


def select_fp4_backend(device: torch.device | str) -> tuple[str, str]:
    """The 4-bit backend for tensors on ``device`` and a one-line reason: on a GPU with FP4
    tensor cores where triton imports, ``"cublas"`` where torch's FP4 ``scaled_mm`` runs a
    recipe (probed once per device), else ``"triton"``; else ``"emulated"``, saying why
    (module docstring)."""
    dev = parse_device(device)
    where = _no_kernels(dev)
    if where is None:
        cores = fp4_tensor_cores(dev).reason
        refused = _cublas_recipes(dev)
        if refused is None:
            return CUBLAS, (
                f"cublas: {cores}; the dense 4-bit GEMM runs torch's FP4 scaled_mm where its "
                f"recipe runs (kernels.cublas_fp4.fp4_recipes), the Triton kernels otherwise"
            )
        return TRITON, f"triton: {cores}; the Triton kernels (tl.dot_scaled) run: {refused}"
    return EMULATED, (
        f"emulated: {where}; the 4-bit GEMMs run the pure-torch twin (numerics.fp4_gemm) in "
        f"float32 on {dev}, never an 8-bit fallback"
    )


def cublas_refusal(device: torch.device) -> str | None:
    """None where the ``"cublas"`` backend runs on ``device``, else why not (a sentence naming
    the device), once per device."""
    return _cublas_refusal(parse_device(device))


@functools.cache
def _cublas_refusal(dev: torch.device) -> str | None:
    why = _no_kernels(dev) or _cublas_recipes(dev)
    if why is None:
        return None
    return f"the 4-bit backend 'cublas' cannot run on {dev}: {why}"


def runs_triton(backend: str, like: torch.Tensor) -> bool:
    """Whether an operator's ``backend`` argument runs the Triton kernels (``"triton"``, and
    ``"cublas"`` for every operator but the dense GEMM's cuBLAS recipes) or the twins
    (``"emulated"``); another name is a ``ValueError`` naming it, and so is ``"cublas"``
    where it cannot run on ``like``'s device (``cublas_refusal``)."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown 4-bit backend {backend!r}; accepted: {', '.join(_BACKENDS)}")
    if backend == CUBLAS and (refused := cublas_refusal(like.device)) is not None:
        raise ValueError(refused)
    return backend != EMULATED


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
