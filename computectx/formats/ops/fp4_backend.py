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
from computectx.formats.backend import check_bias_and_out, quantizable_arg
from computectx.formats.numerics.e2m1 import Stochastic
from computectx.formats.numerics.fp4 import Mxfp4Operand, Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant
from computectx.residency import parse_device

__all__ = [
    "CUBLAS",
    "EMULATED",
    "TRITON",
    "backend_of",
    "check_2d",
    "check_gemm",
    "check_how",
    "check_scale",
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
_TILES: Final[dict[str, tuple[str, int, int, torch.dtype]]] = {
    "1x16": ("nvfp4", 16, 1, torch.float8_e4m3fn),
    "16x16": ("nvfp4", 16, 16, torch.float8_e4m3fn),
    "1x32": ("mxfp4", 32, 1, torch.float8_e8m0fnu),
}  # a tile: its format, K block, rows a scale covers and scale dtype


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


def _device(device: torch.device | str) -> torch.device:
    # The device, a bare "cuda" as the current CUDA device (kernels.cublas_fp4.indexed).
    dev = parse_device(device)
    if dev.type != "cuda" or dev.index is not None:
        return dev
    from computectx.kernels.cublas_fp4 import indexed

    return indexed(dev)


def fp4_cublas_recipes(device: torch.device | str) -> dict[str, tuple[bool, str]]:
    """Which 4-bit cuBLAS recipes run on ``device`` (``kernels.cublas_fp4.fp4_recipes``:
    ``"nvfp4"``/``"mxfp4"`` -> ``(runs, reason)``, probed once per device, bf16 result; a
    device torch cannot run on is ``(False, reason)`` too)."""
    from computectx.kernels import cublas_fp4

    return cublas_fp4.fp4_recipes(_device(device))


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


@functools.cache
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
    dev = _device(device)
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


_CUBLAS_RUNS: set[torch.device] = set()
"""The indexed devices where ``"cublas"`` runs: a yes lasts (its kernel check is kept, and so
is a recipe's passed probe), so it is answered without reading the probes again."""


def cublas_refusal(device: torch.device) -> str | None:
    """None where the ``"cublas"`` backend runs on ``device``, else why not (a sentence naming
    the device): the device's kernels checked once, the recipes' probes kept as
    ``kernels.cublas_fp4`` keeps them (an out-of-memory verdict is probed again); a yes is
    kept per device, so an operator call on ``"cublas"`` reads no probe after the first."""
    if device in _CUBLAS_RUNS:  # a bare "cuda" is never in it: the current device may change
        return None
    dev = _device(device)
    why = _no_kernels(dev) or _cublas_recipes(dev)
    if why is None:
        _CUBLAS_RUNS.add(dev)
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


def _cuda_backend(dev: torch.device) -> str:
    # select_fp4_backend's choice, from the kept kernel check and probes (no reason built).
    if _no_kernels(dev) is not None:
        return EMULATED
    return CUBLAS if _cublas_recipes(dev) is None else TRITON


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


def check_2d(
    x: object, multiple: int, rows_multiple: int, who: str, *, k_dim: int = 1
) -> torch.Tensor:
    """``x`` if it is a quantizable 2-D tensor with K a multiple of ``multiple`` and rows of
    ``rows_multiple``, and the operand's K (dimension ``k_dim``: 0 for a column-wise operand)
    not 0 (0 rows are taken), else a ``ValueError`` naming its shape."""
    t = quantizable_arg(x)
    if t.dim() != 2 or t.shape[1] % multiple or t.shape[0] % rows_multiple or not t.shape[k_dim]:
        rows = f", rows a multiple of {rows_multiple}" if rows_multiple > 1 else ""
        raise ValueError(
            f"{who} takes a 2-D tensor with K (dimension {k_dim}) > 0 and the last dimension a "
            f"multiple of {multiple}{rows}, got shape {tuple(t.shape)}"
        )
    return t


def check_scale(codes: torch.Tensor, scale: torch.Tensor, tile: str, who: str) -> None:
    """A ``ValueError`` naming both shapes unless ``scale`` is the block scale of 2-D ``codes
    [rows, K/2]`` at ``tile`` (``"1x16"``, ``"16x16"``: NVFP4's E4M3; ``"1x32"``: MXFP4's
    E8M0), one per row (16 rows) and K block, on the codes' device, and K > 0. The scale's
    dtype names the format, as the operators read it (an MXFP4 operand's tile is 1x32)."""
    if scale.dtype not in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        raise ValueError(
            f"{who}'s scale is float8_e4m3fn (NVFP4) or float8_e8m0fnu (MXFP4), got {scale.dtype}"
        )
    tile = "1x32" if scale.dtype == torch.float8_e8m0fnu else tile
    fmt, block, tile_rows, dtype = _TILES.get(tile, ("", 0, 0, None))
    if dtype is None:
        raise ValueError(f"{who}'s NVFP4 tile is 1x16 or 16x16, got {tile!r}")
    if codes.dim() != 2:
        raise ValueError(f"{who} must be 2-D, got codes of shape {tuple(codes.shape)}")
    rows, k = codes.shape[0], 2 * codes.shape[1]
    if not k or k % block or rows % tile_rows:
        rows_ok = f", rows a multiple of {tile_rows}" if tile_rows > 1 else ""
        raise ValueError(
            f"{who} ({fmt} {tile}) needs codes [rows, K/2] with K > 0 a multiple of {block}"
            f"{rows_ok}, got codes of shape {tuple(codes.shape)} (two values a byte)"
        )
    want = (rows // tile_rows, k // block)
    if scale.dtype != dtype or tuple(scale.shape) != want or scale.device != codes.device:
        raise ValueError(
            f"{who}'s scale ({fmt} {tile}) for codes of shape {tuple(codes.shape)} is {dtype} "
            f"{want} on {codes.device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}"
        )


def check_gemm(a: Fp4Operand, b: Fp4Operand, bias: object, out_dtype: object) -> tuple[str, str]:
    """The tiles of a dense 4-bit GEMM's operands (``Nvfp4Operand``/``Mxfp4Operand``, both of
    one format, ``[M, K]`` and ``[N, K]`` on one device), its bias and result dtype checked,
    else a ``TypeError``/``ValueError`` quoting them. Each scale is checked against its codes
    (``check_scale``) once, by the operator ``computectx::fp4_scaled_mm``, on every backend."""
    tiles = []
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, (Nvfp4Operand, Mxfp4Operand)):
            raise TypeError(f"{name} must be an Nvfp4Operand or Mxfp4Operand, got {q!r}")
        tiles.append(q.tile if isinstance(q, Nvfp4Operand) else "1x32")
    if isinstance(a, Nvfp4Operand) != isinstance(b, Nvfp4Operand):
        raise ValueError(f"a 4-bit GEMM multiplies two NVFP4 or two MXFP4 operands, got {a!r}")
    if a.codes.dim() != 2 or b.codes.dim() != 2:
        return tiles[0], tiles[1]  # the operator's check_scale names them, first of all
    if a.codes.shape[1] != b.codes.shape[1] or a.codes.device != b.codes.device:
        raise ValueError(
            f"a [M, K] and b [N, K] need the same K and device, got {tuple(a.codes.shape)} on "
            f"{a.codes.device} and {tuple(b.codes.shape)} on {b.codes.device} (two values a byte)"
        )
    check_bias_and_out(bias, out_dtype, a.codes, b.codes)
    return tiles[0], tiles[1]
