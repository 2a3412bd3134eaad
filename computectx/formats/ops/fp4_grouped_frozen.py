"""Frozen 4-bit experts' operators: each expert's weight held as its 4-bit operand (the codes,
block scales and NVFP4 amax ``Fp4Experts``' forward quantizes it to), multiplied as it is.

======================================  =========================================================
operator                                semantics
======================================  =========================================================
``fp4_held_grouped_mm``                 group ``g``'s rows of ``a`` quantized at this call (round
                                        to nearest), times the held expert ``g``'s operand
``fp4_dequantize_experts``              the values each held expert stands for, ``[E, N, K]``
                                        at a float dtype (one ``dequantize_*`` per expert)
======================================  =========================================================

The held operand of ``E`` experts: codes ``float4_e2m1fn_x2`` ``[E, N, K/2]``, scales NVFP4
``float8_e4m3fn`` ``[E, N, K/16]`` (1x16) or ``[E, N/16, K/16]`` (16x16 tiles), MXFP4
``float8_e8m0fnu`` ``[E, N, K/32]``, NVFP4's per-expert amax float32 ``(E,)``. Expert ``e``'s
slice is the 2-D operand ``ops.fp4`` takes.

``fp4_held_grouped_mm`` is, group for group, what ``fp4_grouped_mm`` computes in the forward
(``reference_fp4_grouped_mm``: the group's rows quantized with their own amax, then
``fp4_scaled_mm`` with the expert's operand) with the weight's quantize already done; with
``per_row`` (NVFP4) each row is quantized by its own amax instead, and the row's epilogue
factor is its own (``linear.fp4_serving``'s ``"per_row"``: a row's bits are those of the
group of that row alone). ``offs`` is read inside the operator (data, not a guard: a compiled
caller recompiles neither as the group sizes change); an empty group reads nothing of its
expert; rows past ``offs[-1]`` come out zero. Each group runs the dense entry points of
``ops.fp4`` (their backend, picked by the device); the per-row quantize and the dequantize
run their twins on every backend.
"""

from __future__ import annotations

from typing import cast

import torch
from torch.library import custom_op

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.e2m1 import E2M1_MAX
from computectx.formats.numerics.fp4 import (
    E4M3_MAX,
    Mxfp4Operand,
    MxRounding,
    Nvfp4Operand,
    Nvfp4Tile,
    dequantize_mxfp4,
    dequantize_nvfp4,
)
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant, tensor_scale_alpha
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.ops.fp4_backend import backend_of, check_scale, runs_triton
from computectx.formats.ops.grouped import checked_bounds

__all__ = [
    "check_held",
    "dequantize_experts",
    "expert_operand",
    "fp4_dequantize_experts",
    "fp4_held_grouped_mm",
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
) -> int:
    """``E``, the experts' count, when the held operand of ``E >= 1`` experts (module
    docstring) is well formed: the codes ``float4_e2m1fn_x2 [E, N, K/2]``, the scales ``[E,
    ...]`` at ``tile`` (each expert's as ``check_scale`` takes it; the dtype names the format),
    NVFP4's amax float32 ``(E,)``, finite and >= 0 (one host read), everything on the codes'
    device, ``out_dtype`` among ``out_dtypes``; else ``ValueError`` naming the operand."""
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
    if not bool(((amax >= 0) & amax.isfinite()).all()):  # a host read (data, not a guard)
        raise ValueError(f"{who}: each expert's amax must be finite and >= 0")
    return e


def _group(
    a: torch.Tensor, w: Fp4Operand, how: Fp4Quant, per_row: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    if not (per_row and isinstance(w, Nvfp4Operand)):
        return fp4_ops.scaled_mm(fp4_ops.quantize(a, how), w, out_dtype)
    # Each row by its own amax: both operands at S_enc = 1 (alpha exactly 1: the float32
    # accumulator), then each row's own TE epilogue factor, in TE's order.
    codes, scale, amax = fp4_ops.quantize_rows(a)
    unit = torch.full((), E4M3_MAX * E2M1_MAX, dtype=torch.float32, device=a.device)
    acc = fp4_ops.scaled_mm(
        Nvfp4Operand(codes, scale, unit, "1x16"),
        Nvfp4Operand(w.codes, w.scale, unit, w.tile),
        torch.float32,
    )
    alpha = tensor_scale_alpha(amax, w.amax.float().reshape(()))
    return tensorwise.epilogue(acc * alpha[:, None], None, out_dtype)


@custom_op("computectx::fp4_held_grouped_mm", mutates_args=())
def fp4_held_grouped_mm(
    a: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    offs: torch.Tensor,
    tile: str,
    mx_rounding: str,
    per_row: bool,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows of ``a [M, K]`` quantized at this call times the held
    expert ``g`` (module docstring)."""
    runs_triton(backend, a)  # checked; each group takes ops.fp4's backend for its device
    who = "computectx::fp4_held_grouped_mm"
    e = check_held(codes, scale, amax, tile, out_dtype, who)
    if a.dtype not in FLOAT_DTYPES or a.dim() != 2 or a.shape[1] != 2 * codes.shape[2]:
        raise ValueError(
            f"{who} takes a bf16, fp16 or fp32 a [M, K] for codes {tuple(codes.shape)}, got "
            f"{a.dtype} {tuple(a.shape)}"
        )
    if not (a.device == offs.device == codes.device):
        raise ValueError(f"{who}: a, offs and the experts' operand on one device")
    bounds = checked_bounds(offs, a.shape[0], e)
    how = Fp4Quant(
        format="mxfp4" if scale.dtype == torch.float8_e8m0fnu else "nvfp4",
        mx_rounding=cast(MxRounding, mx_rounding),
        hadamard=False,
    )
    out = a.new_zeros((a.shape[0], codes.shape[1]), dtype=out_dtype)
    for g, (start, end) in enumerate(bounds):
        if end > start:
            w = expert_operand(codes, scale, amax, tile, g)
            out[start:end] = _group(a[start:end], w, how, per_row, out_dtype)
    return out


@fp4_held_grouped_mm.register_fake
def _held_grouped_mm_fake(a: torch.Tensor, codes: torch.Tensor, *rest: object) -> torch.Tensor:
    return a.new_empty((a.shape[0], codes.shape[1]), dtype=cast(torch.dtype, rest[-2]))


@custom_op("computectx::fp4_dequantize_experts", mutates_args=())
def fp4_dequantize_experts(
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    tile: str,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``[E, N, K]`` at ``out_dtype``: expert ``e``'s values as ``dequantize_nvfp4`` /
    ``dequantize_mxfp4`` form them from its operand (in float32, rounded once)."""
    runs_triton(backend, codes)  # checked; the twin runs on every backend
    dtypes = (*FLOAT_DTYPES, torch.float64)
    check_held(codes, scale, amax, tile, out_dtype, "computectx::fp4_dequantize_experts",
               out_dtypes=dtypes)  # fmt: skip
    out = []
    for e in range(codes.shape[0]):
        q = expert_operand(codes, scale, amax, tile, e)
        if isinstance(q, Nvfp4Operand):
            out.append(dequantize_nvfp4(q, out_dtype))
        else:
            out.append(dequantize_mxfp4(q, out_dtype))
    return torch.stack(out)


@fp4_dequantize_experts.register_fake
def _dequantize_experts_fake(codes: torch.Tensor, *rest: object) -> torch.Tensor:
    shape = (*codes.shape[:-1], 2 * codes.shape[-1])
    return codes.new_empty(shape, dtype=cast(torch.dtype, rest[-2]))


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
) -> torch.Tensor:
    """``[M, N]`` at ``x``'s dtype through ``computectx::fp4_held_grouped_mm`` (module
    docstring); the caller (``FrozenFp4Experts``) has checked the operands."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"held_grouped_mm takes a bf16, fp16 or fp32 x, got {x.dtype}")
    args = (tile, mx_rounding, per_row, x.dtype, backend_of(x))
    y: torch.Tensor = fp4_held_grouped_mm(x, codes, scale, _amax(amax), offs, *args)
    return y


def dequantize_experts(
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    tile: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[E, N, K]`` at ``out_dtype`` through ``computectx::fp4_dequantize_experts``."""
    if out_dtype not in (*FLOAT_DTYPES, torch.float64):
        raise ValueError(f"out_dtype must be bf16, fp16, fp32 or fp64, got {out_dtype!r}")
    backend = backend_of(codes)
    out: torch.Tensor = fp4_dequantize_experts(codes, scale, _amax(amax), tile, out_dtype, backend)
    return out
