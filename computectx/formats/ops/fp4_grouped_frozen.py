"""Frozen 4-bit experts' operator: each expert's weight held as its 4-bit operand (the codes,
block scales and NVFP4 amax ``Fp4Experts``' forward quantizes it to), and its GEMM.

``computectx::fp4_dequantize_experts``: the values each held expert stands for, ``[E, N, K]``
at a float dtype (one ``dequantize_*`` per expert; the format read from the scales' dtype, as
``computectx::fp4_dequantize`` reads it). ``held_grouped_mm``: group ``g``'s rows of ``x``
quantized at this call (round to nearest) times the held expert ``g``, through the one
grouped GEMM against held per-expert operands, ``computectx::fp4_grouped_mm_gathered``
(``ops.fp4_grouped_gathered``; FSDP2's gathered experts take it too): ``per_row=False`` is
``fp4_grouped_mm``'s forward group for group with the weight's quantize already done (its
Triton grouped path where it runs), ``per_row`` (NVFP4) each row by its own amax.

The held operand of ``E`` experts: codes ``float4_e2m1fn_x2`` ``[E, N, K/2]``, scales NVFP4
``float8_e4m3fn`` ``[E, N, K/16]`` (1x16) or ``[E, N/16, K/16]`` (16x16 tiles), MXFP4
``float8_e8m0fnu`` ``[E, N, K/32]``, NVFP4's per-expert amax float32 ``(E,)``. Expert ``e``'s
slice is the 2-D operand ``ops.fp4`` takes. ``offs`` is read inside the operators (data, not a
guard: a compiled caller recompiles neither as the group sizes change); an empty group reads
nothing of its expert; rows past ``offs[-1]`` come out zero.
"""

from __future__ import annotations

from typing import cast

import torch
from torch.library import custom_op

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.numerics.fp4 import (
    Mxfp4Operand,
    MxRounding,
    Nvfp4Operand,
    Nvfp4Tile,
    dequantize_mxfp4,
    dequantize_nvfp4,
)
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant
from computectx.formats.ops.fp4_backend import backend_of, check_scale, runs_triton
from computectx.formats.ops.fp4_grouped_gathered import grouped_mm_gathered

__all__ = [
    "check_held",
    "dequantize_experts",
    "expert_operand",
    "fp4_dequantize_experts",
    "held_grouped_mm",
]


def expert_operand(
    codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, tile: str, e: int
) -> Fp4Operand:
    """Expert ``e``'s 2-D operand (views) of the held ``[E, ...]`` tensors (module docstring):
    the format by the scales' dtype, as ``computectx::fp4_dequantize`` reads it (E8M0: MXFP4,
    any ``amax`` unread; E4M3: NVFP4, which needs ``amax``)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return Mxfp4Operand(codes[e], scale[e])
    if amax is None:
        raise ValueError("an NVFP4 operand (an E4M3 scale) needs its per-tensor amax")
    return Nvfp4Operand(codes[e], scale[e], amax[e], cast(Nvfp4Tile, tile))


def check_held(
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    tile: str,
    out_dtype: torch.dtype,
    who: str,
    *,
    out_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    read: bool = True,
) -> int:
    """``E``, the experts' count, when the held operand of ``E >= 1`` experts (module
    docstring) is well formed: the codes ``float4_e2m1fn_x2 [E, N, K/2]``, the scales ``[E,
    ...]`` at ``tile`` (each expert's as ``check_scale`` takes it; the dtype names the format),
    NVFP4's amax float32 ``(E,)``, finite and >= 0 when ``read`` (one host read), everything on
    the codes' device, ``out_dtype`` among ``out_dtypes``; else ``ValueError`` naming the
    operand."""
    if out_dtype not in out_dtypes:
        raise ValueError(f"{who}: out_dtype must be one of {out_dtypes}, got {out_dtype!r}")
    if codes.dtype != torch.float4_e2m1fn_x2 or codes.dim() != 3 or not codes.shape[0]:
        raise ValueError(
            f"{who} takes the experts' codes as float4_e2m1fn_x2 [E, N, K/2] with E >= 1, got "
            f"{codes.dtype} {tuple(codes.shape)}"
        )
    e = codes.shape[0]
    if scale.dim() != 3 or scale.shape[0] != e:
        raise ValueError(
            f"{who}: the scales must be [E = {e}, ...] for codes {tuple(codes.shape)}, got "
            f"{tuple(scale.shape)}"
        )
    check_scale(codes[0], scale[0], tile, f"{who}: each expert's operand")
    if scale.dtype == torch.float8_e8m0fnu:
        return e
    if amax is None:
        raise ValueError(f"{who}: an NVFP4 operand (E4M3 scales) needs its per-expert amax")
    if amax.dtype != torch.float32 or tuple(amax.shape) != (e,) or amax.device != codes.device:
        raise ValueError(
            f"{who}: NVFP4 experts take one float32 amax each, ({e},) on {codes.device}, got "
            f"{amax.dtype} {tuple(amax.shape)} on {amax.device}"
        )
    if read and not bool(((amax >= 0) & amax.isfinite()).all()):  # a host read (data)
        raise ValueError(f"{who}: each expert's amax must be finite and >= 0")
    return e


@custom_op("computectx::fp4_dequantize_experts", mutates_args=())
def fp4_dequantize_experts(
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    tile: str,
    out_dtype: torch.dtype,
    backend: str,
    check_amax_values: bool = True,
) -> torch.Tensor:
    """``[E, N, K]`` at ``out_dtype``: expert ``e``'s values as ``dequantize_nvfp4`` /
    ``dequantize_mxfp4`` form them from its operand (in float32, rounded once).
    ``check_amax_values=False``: the amaxes' values were checked where they were made, not
    read here (``ops.fp4_grouped_gathered``'s docstring)."""
    runs_triton(backend, codes)  # checked; the twin runs on every backend
    dtypes = (*FLOAT_DTYPES, torch.float64)
    check_held(codes, scale, amax, tile, out_dtype, "computectx::fp4_dequantize_experts",
               out_dtypes=dtypes, read=check_amax_values)  # fmt: skip
    out = []
    for e in range(codes.shape[0]):
        q = expert_operand(codes, scale, amax, tile, e)
        if isinstance(q, Nvfp4Operand):
            out.append(dequantize_nvfp4(q, out_dtype))
        else:
            out.append(dequantize_mxfp4(q, out_dtype))
    return torch.stack(out)


@fp4_dequantize_experts.register_fake
def _dequantize_experts_fake(
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    tile: str,
    out_dtype: torch.dtype,
    backend: str,
    check_amax_values: bool = True,
) -> torch.Tensor:
    shape = (*codes.shape[:-1], 2 * codes.shape[-1])
    return codes.new_empty(shape, dtype=out_dtype)


def _amax(amax: torch.Tensor | None) -> torch.Tensor | None:
    return None if amax is None else amax.reshape(-1)


def held_grouped_mm(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    offs: torch.Tensor,
    *,
    tile: str,
    mx_rounding: MxRounding,
    per_row: bool,
    check_amax_values: bool = True,
) -> torch.Tensor:
    """``[M, N]`` at ``x``'s dtype: group ``g``'s rows of ``x`` times the held expert ``g``
    through ``computectx::fp4_grouped_mm_gathered`` (module docstring); the operator checks
    the operands again, the amaxes' values unless ``check_amax_values=False`` (the caller,
    ``FrozenFp4Experts``, checked them once, where they were made or loaded)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"held_grouped_mm takes a bf16, fp16 or fp32 x, got {x.dtype}")
    nv = scale.dtype != torch.float8_e8m0fnu
    how = Fp4Quant(
        format="nvfp4" if nv else "mxfp4",
        weight_tile=cast(Nvfp4Tile, tile if nv else "16x16"),
        mx_rounding=mx_rounding,
        hadamard=False,
    )
    a = _amax(amax)
    b = Nvfp4Operand(codes, scale, a, how.weight_tile) if nv and a is not None else None
    return grouped_mm_gathered(
        x, b or Mxfp4Operand(codes, scale), offs, how, per_row=per_row,
        check_amax_values=check_amax_values,
    )  # fmt: skip


def dequantize_experts(
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    tile: str,
    out_dtype: torch.dtype,
    *,
    check_amax_values: bool = True,
) -> torch.Tensor:
    """``[E, N, K]`` at ``out_dtype`` through ``computectx::fp4_dequantize_experts`` (its
    ``check_amax_values``)."""
    if out_dtype not in (*FLOAT_DTYPES, torch.float64):
        raise ValueError(f"out_dtype must be bf16, fp16, fp32 or fp64, got {out_dtype!r}")
    backend = backend_of(codes)
    args = (tile, out_dtype, backend, check_amax_values)
    out: torch.Tensor = fp4_dequantize_experts(codes, scale, _amax(amax), *args)
    return out
