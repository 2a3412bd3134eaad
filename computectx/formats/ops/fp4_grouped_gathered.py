"""The 4-bit grouped GEMM whose experts are held quantized (FSDP2 gathered them so, or a
frozen ``FrozenFp4Experts`` holds them): ``computectx::fp4_grouped_mm_gathered``.

``fp4_grouped_mm`` (``ops.fp4``) quantizes each expert ``b[g]`` at the weight's block at every
call. Here each expert's operand is given as it was quantized elsewhere (FSDP2's 4-bit gather
of grouped experts, ``linear.fp4_gathered.Fp4GatheredExperts``): codes ``[E, N, K/2]``
(``float4_e2m1fn_x2``), block scales ``[E, N, K/16]`` (NVFP4 1x16), ``[E, N/16, K/16]``
(16x16 tiles) or ``[E, N, K/32]`` (MXFP4, E8M0), and NVFP4's per-expert amax, float32
``(E,)``. Group ``g``'s rows of ``a`` are quantized as ``fp4_grouped_mm`` quantizes them (their
own amax, 1x16 or 1x32 blocks, ``rng`` rounding them at ``counter + start_g·K``) and multiplied
with expert ``g``'s operand (``numerics.fp4_gemm.reference_fp4_grouped_mm_gathered``; the Triton
grouped GEMM on its backends). Given each expert's operand as ``quantize_rows(b[g],
weight=True)`` makes it, the result is ``fp4_grouped_mm``'s bit for bit: the forward with
``W``'s operands, the dgrad with ``Wᵀ``'s.

``per_row`` (NVFP4, round to nearest: no ``rng``): each row quantized by its own amax, both
operands at ``S_enc = 1`` (alpha exactly 1: the float32 accumulator), then each row's own TE
epilogue factor, in TE's order (``linear.fp4_serving``'s ``"per_row"``: a row's bits are those
of the group of that row alone; the frozen W4A4 experts' batch-invariant rule); each group
runs ``ops.fp4``'s row quantize twin and ``fp4_scaled_mm``. MXFP4 has no per-tensor scale:
``per_row`` is the group rule there.

``offs`` and ``rng`` are data read inside the operator, as for the other grouped operators
(``ops.fp4``): a compiled caller recompiles neither as the group sizes nor as the counter
change; the fake gives the ``[M, N]`` result's shape and dtype.

**The amaxes' values.** Called directly, the operator refuses NVFP4 amaxes that are NaN, ±inf
or negative (``check_operands(read=True)``): one host read, a device sync on an accelerator,
at every call. The modules that made the operands themselves pass ``check_amax_values=False``
(an argument of the schema, default ``True``) and are not read again: ``Fp4Experts`` on
FSDP2's gathered experts (each amax ``tensor_amax`` of its expert, finite and ``>= 0`` by
construction) and ``FrozenFp4Experts`` (its amaxes checked once, where they are made, given or
loaded: ``fp4_serving.check_weight``, ``check_load``). Shapes, dtypes and devices are checked on
every call either way (no read). As ``quantize_rows(check_values=False)`` for an amax its
caller made.
"""

from __future__ import annotations

from typing import Final, cast

import torch
from torch.library import custom_op

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.backend import quantizable_arg
from computectx.formats.numerics import fp4_gemm, tensorwise
from computectx.formats.numerics.e2m1 import E2M1_MAX, HADAMARD_SIZE, Stochastic
from computectx.formats.numerics.fp4 import (
    E4M3_MAX,
    NVFP4_BLOCK,
    Mxfp4Operand,
    MxRounding,
    Nvfp4Operand,
    Nvfp4Tile,
)
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant, tensor_scale_alpha
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.ops.fp4_backend import backend_of, check_how, rng_arg, runs_triton
from computectx.formats.ops.grouped import checked_bounds

__all__ = ["check_operands", "fp4_grouped_mm_gathered", "grouped_mm_gathered"]

_U64: Final[int] = 2**64
_OP: Final[str] = "computectx::fp4_grouped_mm_gathered"
_SCALE_DTYPES: Final[dict[str, torch.dtype]] = {
    "nvfp4": torch.float8_e4m3fn,
    "mxfp4": torch.float8_e8m0fnu,
}
_TILES: Final[tuple[str, ...]] = ("1x16", "16x16")


@custom_op("computectx::fp4_grouped_mm_gathered", mutates_args=())
def fp4_grouped_mm_gathered(
    a: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    offs: torch.Tensor,
    format: str,
    weight_tile: str,
    mx_rounding: str,
    rng: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
    per_row: bool = False,
    check_amax_values: bool = True,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows of ``a [M, K]``, quantized on their own (``per_row``:
    each row on its own), times expert ``g``'s operand (``codes[g]``, ``scale[g]``, NVFP4's
    ``amax[g]``), as it came. ``check_amax_values=False``: the amaxes' values were checked
    where they were made (module docstring), not read here."""
    e = check_operands(
        a, codes, scale, amax, offs, format, weight_tile, rng, read=check_amax_values
    )
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{_OP}: out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")
    if per_row and rng is not None:
        raise ValueError(f"{_OP}: per_row rounds to nearest; rng must be None")
    if not e:
        raise ValueError(f"{_OP} takes E >= 1 experts, got codes {tuple(codes.shape)}")
    bounds = checked_bounds(offs, a.shape[0], e)
    if per_row and amax is not None:
        runs_triton(backend, a)  # checked; each group takes ops.fp4's backend for its device
        return _per_row(a, Nvfp4Operand(codes, scale, amax, cast(Nvfp4Tile, weight_tile)),
                        bounds, out_dtype)  # fmt: skip
    if runs_triton(backend, a):
        from computectx.kernels.fp4_grouped_values import grouped_mm_gathered_values

        args = (format, weight_tile, mx_rounding, rng, out_dtype)
        return grouped_mm_gathered_values(a, codes, scale, amax, bounds, offs, *args)
    how = Fp4Quant(
        format=cast(fp4_gemm.Fp4Format, format),
        weight_tile=cast(Nvfp4Tile, weight_tile),
        mx_rounding=cast(MxRounding, mx_rounding),
        hadamard=False,
        signs=(1,) * HADAMARD_SIZE,
    )
    b: Fp4Operand = Mxfp4Operand(codes, scale)
    if amax is not None:
        b = Nvfp4Operand(codes, scale, amax, how.weight_tile)
    key = None
    if rng is not None:  # a host read of the two int64s (inside the operator: data)
        seed, offset = (int(v) for v in rng.tolist())
        key = Stochastic(seed % _U64, offset)
    return fp4_gemm.reference_fp4_grouped_mm_gathered(a, b, bounds, how, out_dtype, key)


@fp4_grouped_mm_gathered.register_fake
def _grouped_mm_gathered_fake(
    a: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    offs: torch.Tensor,
    format: str,
    weight_tile: str,
    mx_rounding: str,
    rng: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
    per_row: bool = False,
    check_amax_values: bool = True,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], codes.shape[1]), dtype=out_dtype)


def _per_row(
    a: torch.Tensor, b: Nvfp4Operand, bounds: list[tuple[int, int]], out_dtype: torch.dtype
) -> torch.Tensor:
    # Each group's rows by their own amaxes at S_enc = 1 against expert g at S_enc = 1, then
    # each row's TE epilogue factor (module docstring); an empty group reads nothing.
    out = a.new_zeros((a.shape[0], b.codes.shape[1]), dtype=out_dtype)
    unit = torch.full((), E4M3_MAX * E2M1_MAX, dtype=torch.float32, device=a.device)
    for g, (start, end) in enumerate(bounds):
        if end > start:
            codes, scale, amax = fp4_ops.quantize_rows(a[start:end])
            acc = fp4_ops.scaled_mm(
                Nvfp4Operand(codes, scale, unit, "1x16"),
                Nvfp4Operand(b.codes[g], b.scale[g], unit, b.tile),
                torch.float32,
            )
            alpha = tensor_scale_alpha(amax, b.amax[g].float().reshape(()))
            out[start:end] = tensorwise.epilogue(acc * alpha[:, None], None, out_dtype)
    return out


def _scale_shape(fmt: str, tile: str, e: int, n: int, k: int) -> tuple[int, int, int]:
    if fmt == "mxfp4":
        return (e, n, k // 32)
    return (e, n // NVFP4_BLOCK, k // NVFP4_BLOCK) if tile == "16x16" else (e, n, k // 16)


def _check_kinds(a: torch.Tensor, codes: torch.Tensor, fmt: str, tile: str) -> tuple[int, ...]:
    if fmt not in _SCALE_DTYPES:
        raise ValueError(f"{_OP}: format must be one of {tuple(_SCALE_DTYPES)}, got {fmt!r}")
    if tile not in _TILES:
        raise ValueError(f"{_OP}: weight_tile must be one of {_TILES}, got {tile!r}")
    if a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{_OP} takes a of dtype {FLOAT_DTYPES}, got {a.dtype}")
    if codes.dtype != torch.float4_e2m1fn_x2 or codes.dim() != 3:
        raise ValueError(
            f"grouped_mm_gathered takes the experts' codes as float4_e2m1fn_x2 [E, N, K/2], got "
            f"{codes.dtype} {tuple(codes.shape)}"
        )
    e, n, k = codes.shape[0], codes.shape[1], 2 * codes.shape[2]
    block, rows = (32, 1) if fmt == "mxfp4" else (16, 16 if tile == "16x16" else 1)
    if not k or k % block or n % rows:
        need = f", N a multiple of {rows}" if rows > 1 else ""
        raise ValueError(
            f"{_OP} ({fmt} {tile}) takes codes [E, N, K/2] with K > 0 a multiple of {block}"
            f"{need}, got {tuple(codes.shape)} (two values a byte)"
        )
    return e, n, k


def check_operands(
    a: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor | None,
    offs: torch.Tensor,
    fmt: str,
    tile: str,
    rng: torch.Tensor | None,
    *,
    read: bool,
) -> int:
    """``E``, the experts' count, when the operator's arguments are well formed: ``a [M, K]``
    (bf16, fp16, fp32), codes ``float4_e2m1fn_x2 [E, N, K/2]``, scales of ``fmt``'s dtype (E4M3
    for NVFP4, E8M0 for MXFP4: ``check_scale``'s rule) and shape at ``tile``, NVFP4's amax float32
    ``(E,)`` (finite and >= 0 when ``read``: one host read; MXFP4 takes none), ``offs [E]``,
    ``rng`` ``None`` or int64 ``(2,)``, all on ``a``'s device (``rng`` on the CPU or there);
    else ``ValueError`` naming the shapes and dtypes, never the values."""
    e, n, k = _check_kinds(a, codes, fmt, tile)
    if a.dim() != 2 or a.shape[1] != k or offs.dim() != 1 or e != offs.shape[0]:
        raise ValueError(
            f"grouped_mm_gathered takes a [M, K] and offs [E] for codes [E, N, K/2] = "
            f"{tuple(codes.shape)}, got a {tuple(a.shape)} and offs {tuple(offs.shape)}"
        )
    shape, tiled = _scale_shape(fmt, tile, e, n, k), "1x32" if fmt == "mxfp4" else tile
    if tuple(scale.shape) != shape or scale.dtype != _SCALE_DTYPES[fmt]:
        raise ValueError(
            f"grouped_mm_gathered: the experts' scales are {scale.dtype} {tuple(scale.shape)}, "
            f"expected {_SCALE_DTYPES[fmt]} {shape} ({fmt} {tiled}) for codes {tuple(codes.shape)}"
        )
    if (amax is None) != (fmt == "mxfp4"):
        raise ValueError(f"{_OP}: NVFP4 experts take their amaxes, MXFP4 experts none ({fmt})")
    if amax is not None and (amax.dtype != torch.float32 or tuple(amax.shape) != (e,)):
        raise ValueError(
            f"grouped_mm_gathered: NVFP4 experts take one float32 amax each, ({e},), got "
            f"{amax.dtype} {tuple(amax.shape)}"
        )
    held = (codes, scale, offs) + ((amax,) if amax is not None else ())
    if any(t.device != a.device for t in held):
        raise ValueError(f"grouped_mm_gathered: a, the experts' operands and offs on {a.device}")
    if rng is not None and (
        rng.dtype != torch.int64
        or tuple(rng.shape) != (2,)
        or rng.device not in (torch.device("cpu"), a.device)
    ):
        raise ValueError(
            f"{_OP}: rng is None or an int64 (2,) [seed, counter] on the CPU or {a.device}, got "
            f"{rng.dtype} {tuple(rng.shape)} on {rng.device}"
        )
    if read and amax is not None and not bool(((amax >= 0) & amax.isfinite()).all()):
        raise ValueError("grouped_mm_gathered: each expert's amax must be finite and >= 0")
    return e


def _check_gathered(a: torch.Tensor, b: object, offs: object, how: Fp4Quant) -> Fp4Operand:
    """``b`` as the experts' stacked operands of ``how``'s format for ``a``, or
    ``TypeError``/``ValueError`` naming what is wrong (shapes and dtypes, never values; the
    amaxes' values are the operator's to read)."""
    want = Nvfp4Operand if how.format == "nvfp4" else Mxfp4Operand
    if not isinstance(b, want):
        raise TypeError(
            f"grouped_mm_gathered under {how.format} takes a {want.__name__}, got "
            f"{type(b).__name__}"
        )
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        got = f"{offs.dtype} {tuple(offs.shape)}" if isinstance(offs, torch.Tensor) else offs
        raise TypeError(f"offs must be a 1-D int32 tensor of each group's end row, got {got!r}")
    tile = b.tile if isinstance(b, Nvfp4Operand) else "1x16"
    amax = b.amax if isinstance(b, Nvfp4Operand) else None
    check_operands(a, b.codes, b.scale, amax, offs, how.format, tile, None, read=False)
    return b


def grouped_mm_gathered(
    a: torch.Tensor,
    b: Fp4Operand,
    offs: torch.Tensor,
    how: Fp4Quant,
    *,
    out_dtype: torch.dtype | None = None,
    stochastic: Stochastic | torch.Tensor | None = None,
    per_row: bool = False,
    check_amax_values: bool = True,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows of ``a`` in 4 bits times expert ``g``'s operand in
    ``b`` (the experts' operands stacked: codes ``[E, N, K/2]``, scales ``[E, ...]``, NVFP4's
    amaxes ``(E,)``), at ``out_dtype`` (default ``a``'s), through
    ``computectx::fp4_grouped_mm_gathered`` (module docstring). ``stochastic`` rounds ``a``'s
    codes (the dgrad's dY), as ``ops.fp4.grouped_mm``'s; ``per_row`` (NVFP4, no
    ``stochastic``): each row of ``a`` by its own amax (module docstring);
    ``check_amax_values=False`` for amaxes their caller made or checked (module docstring)."""
    h = check_how(how)
    t = quantizable_arg(a)
    q = _check_gathered(t, b, offs, h)
    out = t.dtype if out_dtype is None else out_dtype
    if out not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype!r}")
    tile = q.tile if isinstance(q, Nvfp4Operand) else "1x16"
    amax = q.amax if isinstance(q, Nvfp4Operand) else None
    rng = rng_arg(stochastic, t)
    args = (h.format, tile, h.mx_rounding, rng, out, backend_of(t), per_row, check_amax_values)
    y: torch.Tensor = fp4_grouped_mm_gathered(t, q.codes, q.scale, amax, offs, *args)
    return y
