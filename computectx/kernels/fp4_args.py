"""The argument checks of the 4-bit kernels' launchers (``fp4_gemm``, ``fp4_grouped``): each
turns a tensor of the right kind into what a launch reads (its bytes) or raises a
``ValueError`` naming the argument, what it must be and what it got.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = ["FP4_TILES", "amax_arg", "check_scale_devices", "codes_arg", "codes_pair", "scale_arg"]

FP4_TILES: Final[dict[str, tuple[int, int]]] = {"1x16": (1, 16), "16x16": (16, 16), "1x32": (1, 32)}
"""Each operand tile the kernels take: (rows a scale serves, elements along K it serves).
``"1x16"``/``"16x16"``: NVFP4 (E4M3 scales); ``"1x32"``: MXFP4 (E8M0)."""


def codes_arg(name: str, t: object, dims: int = 2) -> torch.Tensor:
    """``t`` viewed as its bytes when it is ``dims``-D ``torch.float4_e2m1fn_x2`` codes (two
    elements a byte, packed along the last dimension); else ``ValueError`` naming it."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float4_e2m1fn_x2 or t.dim() != dims:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
        raise ValueError(
            f"{name} must be {dims}-D torch.float4_e2m1fn_x2 codes packed along K, got {got}"
        )
    return t.view(torch.uint8)


def codes_pair(
    a: torch.Tensor, b: torch.Tensor, shapes: tuple[str, str, str], b_dims: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of codes ``a`` (2-D) and ``b`` (``b_dims``-D) that contract over their last
    dimension on one device; else ``ValueError`` naming them by ``shapes`` (``a``'s, ``b``'s,
    the contraction's: ``("[M, K / 2]", "[N, K / 2]", "K")``)."""
    a8, b8 = codes_arg("a", a), codes_arg("b", b, dims=b_dims)
    if a.shape[1] != b.shape[-1] or a.device != b.device:
        raise ValueError(
            f"a {shapes[0]} and b {shapes[1]} need the same {shapes[2]} and device, got "
            f"{tuple(a.shape)} on {a.device} and {tuple(b.shape)} on {b.device}"
        )
    return a8, b8


def scale_arg(
    name: str, s: object, rows: int, k: int, tile: str, groups: int | None = None
) -> torch.Tensor:
    """The bytes of ``s``, the scales of a ``tile`` operand of ``rows`` by ``k`` elements
    (``(rows / tile rows, k / tile width)``, after ``(groups,)`` when given), E4M3 for NVFP4 and
    E8M0 for MXFP4; else ``ValueError`` naming it (or the operand's shape, if the tile does
    not divide it)."""
    per_rows, per_k = FP4_TILES[tile]
    dtype = torch.float8_e8m0fnu if per_k == 32 else torch.float8_e4m3fn
    if k % per_k or rows % per_rows:
        raise ValueError(
            f"a {tile} operand needs K a multiple of {per_k} and rows of {per_rows}, got "
            f"{rows} rows, K = {k}"
        )
    grid = (rows // per_rows, k // per_k)
    shape: tuple[int, ...] = grid if groups is None else (groups, *grid)
    if not isinstance(s, torch.Tensor) or s.dtype != dtype or tuple(s.shape) != shape:
        got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else repr(s)
        raise ValueError(f"{name} of a {tile} operand must be {dtype} {shape}, got {got}")
    return s.view(torch.uint8)


def amax_arg(
    name: str, amax: object, nvfp4: bool, device: torch.device, count: int = 1
) -> torch.Tensor | None:
    """NVFP4: ``amax`` as float32 ``(count,)`` when it is a float32 tensor of ``count``
    elements on ``device``; MXFP4: ``None``, which it must be. Else ``ValueError``."""
    if not nvfp4:
        if amax is not None:
            raise ValueError(f"an MXFP4 operand has no per-tensor amax: {name} must be None")
        return None
    if (
        not isinstance(amax, torch.Tensor)
        or amax.dtype != torch.float32
        or amax.numel() != count
        or amax.device != device
    ):
        raise ValueError(
            f"{name} of an NVFP4 operand must be a float32 tensor of {count} element(s) on "
            f"{device}, got {amax!r}"
        )
    return amax.reshape(count)


def check_scale_devices(sa: torch.Tensor, sb: torch.Tensor, device: torch.device) -> None:
    """``ValueError`` unless both operands' scales ``sa`` and ``sb`` are on ``device``."""
    if sa.device != device or sb.device != device:
        raise ValueError(f"scale_a and scale_b must be on {device}, got {sa.device}, {sb.device}")
