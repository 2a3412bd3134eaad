"""The 4-bit grouped GEMMs from high-precision values, as the operators
``computectx::fp4_grouped_mm`` and ``fp4_grouped_wgrad`` take them: each group quantized on its
own (``computectx.kernels.fp4_quantize``) and the groups multiplied in one launch
(``computectx.kernels.fp4_grouped``); the twins are ``numerics.fp4_gemm.reference_fp4_grouped_mm``
and ``reference_fp4_grouped_wgrad``.

The groups' row bounds are host integers (the operators read ``offs`` once, checked, as
``ops.grouped.checked_bounds`` does): one quantize launch per non-empty group and operand, then
one GEMM launch. Stochastic rounding keeps the twins' counters: the forward's group ``g`` draws
from ``counter + start_g * K`` (the row-major counters of the whole tensor), the wgrad's groups
consecutive ranges of their padded operands' sizes; the key's counter is offset where the key
lies (an integer added there: no tensor built from host data), never read on the host when it
lies on the device. The wgrad launch reads its groups' padded column ends as ``offs`` padded on
the device (no host list copied there per call).
"""

from __future__ import annotations

import torch

from computectx.kernels.fp4_grouped import fp4_grouped_scaled_mm, fp4_grouped_scaled_wgrad
from computectx.kernels.fp4_quantize import HADAMARD_SIZE, fp4_quantize, wgrad_row_multiple

__all__ = ["grouped_mm_gathered_values", "grouped_mm_values", "grouped_wgrad_values"]

_NO_SIGNS = [1] * HADAMARD_SIZE  # the row-wise quantize reads no signs


def _shifted(rng: torch.Tensor | None, counters: int) -> torch.Tensor | None:
    # The key whose counter is ``counters`` further on, formed on rng's device: the integer
    # added there (no tensor built from host data, so no copy to a device; the key not read).
    if rng is None:
        return None
    return torch.cat((rng[:1], rng[1:] + counters))


def _padded_ends(offs: torch.Tensor, multiple: int) -> torch.Tensor:
    # int32 (E,): each group's end column in the joined wgrad operands, its rows padded to
    # ``multiple`` (fp4_quantize's column-wise padding), from the operator's offs on its
    # device: no host list copied there per call.
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return ((sizes + (multiple - 1)) // multiple * multiple).cumsum(0).to(torch.int32)


def _joined(parts: list[torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
    # The parts' bytes side by side along dim, viewed as dtype.
    return torch.cat([p.view(torch.uint8) for p in parts], dim).view(dtype)


def _row_operands(
    a: torch.Tensor,
    bounds: list[tuple[int, int]],
    e: int,
    format: str,
    mx_rounding: str,
    rng: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Each group's rows of a quantized on their own (codes, scales joined along the rows,
    # the groups' amaxes), rows past the last group zero.
    m, k = a.shape
    nvfp4 = format == "nvfp4"
    scale_dtype = torch.float8_e4m3fn if nvfp4 else torch.float8_e8m0fnu
    codes, scales = [], []
    amax_a = torch.zeros(e, dtype=torch.float32, device=a.device)
    for g, (start, end) in enumerate(bounds):
        if end > start:
            key = _shifted(rng, start * k)
            q = fp4_quantize(
                a[start:end], format, "1x16", mx_rounding, False, False, _NO_SIGNS, key
            )
            codes.append(q[0])
            scales.append(q[1])
            amax_a[g : g + 1] = q[2]
    # Rows past the last group: never read (their programs sum nothing), zeros.
    tail = m - bounds[-1][1]
    codes.append(torch.zeros((tail, k // 2), dtype=torch.uint8, device=a.device))
    scales.append(
        torch.zeros((tail, k // (16 if nvfp4 else 32)), dtype=torch.uint8, device=a.device)
    )
    return (
        _joined(codes, 0, torch.float4_e2m1fn_x2),
        _joined(scales, 0, scale_dtype),
        amax_a,
    )


def grouped_mm_values(
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: list[tuple[int, int]],
    offs: torch.Tensor,
    format: str,
    weight_tile: str,
    mx_rounding: str,
    rng: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows ``bounds[g]`` of ``a [M, K]`` (``offs``'s values, read)
    quantized row-wise with their own amax (``rng`` rounds them) times expert ``b[g]``
    (``[E, N, K]``) quantized at ``weight_tile``; rows past the last group zero. ``offs`` is
    the operator's int32 ``(E,)`` (the launch reads it on the device)."""
    e, n = b.shape[0], b.shape[1]
    if e == 0:
        return torch.zeros((a.shape[0], n), dtype=out_dtype, device=a.device)
    qb = [
        fp4_quantize(b[g], format, weight_tile, mx_rounding, False, False, _NO_SIGNS, None)
        for g in range(e)
    ]
    codes = torch.stack([q[0] for q in qb])
    scales = torch.stack([q[1] for q in qb])
    amax = torch.cat([q[2] for q in qb]) if format == "nvfp4" else None
    return grouped_mm_gathered_values(
        a, codes, scales, amax, bounds, offs, format, weight_tile, mx_rounding, rng, out_dtype
    )


def grouped_mm_gathered_values(
    a: torch.Tensor,
    b_codes: torch.Tensor,
    b_scale: torch.Tensor,
    b_amax: torch.Tensor | None,
    bounds: list[tuple[int, int]],
    offs: torch.Tensor,
    format: str,
    weight_tile: str,
    mx_rounding: str,
    rng: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``grouped_mm_values`` with each expert's operand given, quantized: codes ``[E, N,
    K/2]``, scales at ``weight_tile`` (MXFP4 1x32), NVFP4's amaxes ``(E,)``."""
    e, n = b_codes.shape[0], b_codes.shape[1]
    if e == 0:
        return torch.zeros((a.shape[0], n), dtype=out_dtype, device=a.device)
    nvfp4 = format == "nvfp4"
    codes, scale, amax_a = _row_operands(a, bounds, e, format, mx_rounding, rng)
    return fp4_grouped_scaled_mm(
        a=codes,
        scale_a=scale,
        amax_a=amax_a if nvfp4 else None,
        b=b_codes.contiguous(),
        scale_b=b_scale.contiguous(),
        amax_b=b_amax if nvfp4 else None,
        tile_b=weight_tile if nvfp4 else "1x32",
        offs=offs,
        out_dtype=out_dtype,
    )


def grouped_wgrad_values(
    dy: torch.Tensor,
    x: torch.Tensor,
    bounds: list[tuple[int, int]],
    offs: torch.Tensor,
    format: str,
    mx_rounding: str,
    hadamard: bool,
    signs: list[int],
    rng: torch.Tensor | None,
) -> torch.Tensor:
    """float32 ``[E, N, K]``: ``dW[g] = dY[rows of g]ᵀ X[rows of g]`` from the two column-wise
    operands of each group's own rows ``bounds[g]`` (``offs``'s values, read; ``offs`` the
    operator's int32 ``(E,)``, whose padded ends the launch reads on the device), padded,
    transformed with ``signs`` under ``hadamard`` and amax'd per group; ``rng`` rounds dY's,
    the groups drawing consecutive counters."""
    n, k, e = dy.shape[1], x.shape[1], len(bounds)
    nvfp4 = format == "nvfp4"
    scale_dtype = torch.float8_e4m3fn if nvfp4 else torch.float8_e8m0fnu
    dev = dy.device
    d_codes = [torch.zeros((n, 0), dtype=torch.uint8, device=dev)]
    x_codes = [torch.zeros((k, 0), dtype=torch.uint8, device=dev)]
    d_scales = [torch.zeros((n, 0), dtype=torch.uint8, device=dev)]
    x_scales = [torch.zeros((k, 0), dtype=torch.uint8, device=dev)]
    amax_d = torch.zeros(e, dtype=torch.float32, device=dev)
    amax_x = torch.zeros(e, dtype=torch.float32, device=dev)
    consumed = 0
    for g, (start, end) in enumerate(bounds):
        if end > start:
            args = (format, "1x16", mx_rounding, True, hadamard, signs)
            qd = fp4_quantize(dy[start:end], *args, _shifted(rng, consumed))
            qx = fp4_quantize(x[start:end], *args, None)
            consumed += qd[0].shape[1] * 2 * n
            for out, q in (
                (d_codes, qd[0]),
                (d_scales, qd[1]),
                (x_codes, qx[0]),
                (x_scales, qx[1]),
            ):
                out.append(q)
            amax_d[g : g + 1], amax_x[g : g + 1] = qd[2], qx[2]
    vec = 16 if nvfp4 else 32
    return fp4_grouped_scaled_wgrad(
        a=_joined(d_codes, 1, torch.float4_e2m1fn_x2),
        scale_a=_joined(d_scales, 1, scale_dtype),
        amax_a=amax_d if nvfp4 else None,
        b=_joined(x_codes, 1, torch.float4_e2m1fn_x2),
        scale_b=_joined(x_scales, 1, scale_dtype),
        amax_b=amax_x if nvfp4 else None,
        tile="1x16" if nvfp4 else "1x32",
        offs=_padded_ends(offs, wgrad_row_multiple(vec, hadamard)),
    )
