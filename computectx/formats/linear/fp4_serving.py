"""The arithmetic of a frozen 4-bit linear (``FrozenFp4Linear``), and the check of 4-bit weights
given from outside.

The weight is held as it is quantized (``numerics.fp4``): packed E2M1 codes
(``torch.float4_e2m1fn_x2``, two a byte), E4M3 block scales and a float32 per-tensor amax for
NVFP4 (1x16 blocks or 16x16 tiles), E8M0 scales of 1x32 blocks for MXFP4. Two modes serve it:

- ``"weight_only"``: ``y = F.linear(x, W.to(x.dtype), bias.to(x.dtype))`` with ``W`` the
  dequantized weight (``dequantize_nvfp4``/``dequantize_mxfp4`` through the operator
  ``computectx::fp4_dequantize``: each value formed in float32, rounded once to the input's
  dtype); the GEMM is torch's at that dtype (bf16 under the serving ctx), on any device.
- ``"w4a4"``: the input quantized at every call, round to nearest (never stochastic), 1x16
  blocks (NVFP4) or 1x32 (MXFP4), then the 4-bit GEMM ``computectx::fp4_scaled_mm``.

**The activation's per-tensor amax** (NVFP4 ``"w4a4"`` only; ``activation_amax``). TE's recipe,
and ``Fp4Linear``'s forward, take one amax over the whole input: it sets ``S_enc``, so every
block scale's E4M3 rounding, and the epilogue's ``alpha``. A row's codes and output then depend
on the other rows of the call, and a request's answer on the batch it was served in.

- ``"per_row"`` (default): each row has its own amax. Row ``i``'s output is bit for bit
  ``Fp4Linear``'s forward on row ``i`` alone, whatever else is in the batch. The rows are
  quantized by TE's chain with each row's ``S_enc`` (``quantize_nvfp4`` of the row, vectorized:
  ``nvfp4_rows``, the operator ``computectx::fp4_quantize_rows``); the GEMM runs through
  ``fp4_scaled_mm`` with both operands' amax given as ``UNIT_AMAX = 448 * 6`` (``S_enc = 1``),
  for which TE's epilogue factor ``(2688 * 2688) * f32(1 / (6 * 6 * 448 * 448))`` is exactly
  1, so the operator returns its float32 accumulator as it is; each row's ``alpha = (amax_row
  * amax_W) * f32(1 / (6 * 6 * 448 * 448))``, in TE's order, the bias and one rounding follow
  (``reference_fp4_mm``'s epilogue, per row).
- ``"per_tensor"``: ``Fp4Linear``'s forward on the same batch, bit for bit; not batch-invariant.
- ``"static"``: one amax calibrated ahead of serving (``calibrate_fp4_activations``), every
  row's: the per-row chain above with each row's amax the calibrated ``A`` (``S_enc = 2688 /
  A``), so bit for bit ``reference_fp4_mm(quantize_nvfp4(x, amax=A), W)`` on any batch, and
  batch-invariant. An element above ``A`` saturates: its block's scale clamps at E4M3's 448 and
  its code at E2M1's ±6, so it dequantizes to at most ``6 * 448 / S_enc`` (``A``, to float32's
  rounding); NaN and ±inf follow the dynamic rule (``numerics.fp4``: a NaN's block is NaN,
  ±inf codes ±6 at the saturated scale). NVFP4 only, and ``FrozenFp4Linear``'s only.

MXFP4 has no per-tensor scale: both rules are ``Fp4Linear``'s forward, and each row's codes are
its own. The emulated GEMM adds each output's K blocks in K order whatever the rows
(``numerics.fp4_gemm``), so under ``"per_row"`` and MXFP4 a row's bits never depend on the
batch. ``"weight_only"`` is as batch-invariant as torch's GEMM on the device (measured on the
development CPU: bf16 was at every shape tried, float32 was not: one row takes another kernel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

import torch
import torch.nn.functional as F  # noqa: N812

from computectx._checks import fault
from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.numerics import tensorwise
from computectx.formats.numerics.e2m1 import E2M1_MAX
from computectx.formats.numerics.fp4 import (
    E4M3_MAX,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Mxfp4Operand,
    Nvfp4Operand,
)
from computectx.formats.numerics.fp4_gemm import (
    Fp4Operand,
    Fp4Quant,
    tensor_scale_alpha,
)
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.policy import describe

__all__ = [
    "ACTIVATION_AMAX",
    "SERVE_MODES",
    "UNIT_AMAX",
    "ActivationAmax",
    "ServeMode",
    "check_bias",
    "check_input_amax",
    "check_serving",
    "check_weight",
    "check_weights",
    "dequantized",
    "nvfp4_rows",
    "w4a4_mm",
    "weight_only_mm",
]

ServeMode = Literal["weight_only", "w4a4"]
"""How a frozen 4-bit linear multiplies: a dequantized weight, or 4-bit activations too."""
SERVE_MODES: Final[tuple[ServeMode, ...]] = ("weight_only", "w4a4")
ActivationAmax = Literal["per_row", "per_tensor", "static"]
"""Whose amax sets an NVFP4 activation's ``S_enc`` under ``"w4a4"``: each row's, the call's, or
one calibrated ahead (``"static"``: ``FrozenFp4Linear`` only)."""
ACTIVATION_AMAX: Final[tuple[ActivationAmax, ...]] = ("per_row", "per_tensor", "static")

UNIT_AMAX: Final[float] = E4M3_MAX * E2M1_MAX
"""2688: the amax whose ``S_enc`` is 1; two such operands have TE's ``alpha`` exactly 1."""

if float(tensor_scale_alpha(torch.tensor(UNIT_AMAX), torch.tensor(UNIT_AMAX))) != 1.0:
    raise RuntimeError("NVFP4's epilogue factor of two unit amaxes is not 1: per_row is unsound")


def check_serving(mode: object, activation_amax: object, who: str, *, static: bool = False) -> None:
    """``ValueError`` naming the value unless ``mode`` is one of ``SERVE_MODES`` and
    ``activation_amax`` one of ``ACTIVATION_AMAX`` (``"static"`` only where ``static``)."""
    if not isinstance(mode, str) or mode not in SERVE_MODES:
        raise ValueError(f"{who}: mode must be one of {SERVE_MODES}, got {describe(mode)}")
    rules = ACTIVATION_AMAX if static else ACTIVATION_AMAX[:2]
    if not isinstance(activation_amax, str) or activation_amax not in rules:
        extra = "" if static else " ('static', a calibrated amax, is FrozenFp4Linear's only)"
        raise ValueError(
            f"{who}: activation_amax must be one of {rules}{extra}, got {describe(activation_amax)}"
        )


def check_input_amax(value: object, who: str, *, uncalibrated: bool = False) -> torch.Tensor:
    """``value`` if it is a static activation amax: a float32 tensor ``(1,)``, finite and
    ``> 0`` (one host read); with ``uncalibrated`` (a load) NaN passes too, the mark of a layer
    saved before it was calibrated. ``ValueError`` naming what it is otherwise: an amax of 0
    (``-0.0`` too) would quantize every input with ``alpha = 0``, the layer serving its bias
    alone, so it is refused as a calibration that saw no finite non-zero input."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.shape != (1,):
        raise ValueError(f"{who}: input_amax must be a float32 tensor (1,), got {_shown(value)}")
    if value.is_meta:
        raise ValueError(f"{who}: input_amax is on the meta device: it holds no calibration")
    finite, positive, nan = torch.stack(
        (torch.isfinite(value).all(), (value > 0).all(), value.isnan().all())
    ).tolist()
    if uncalibrated and nan:
        return value
    marker = " (or NaN: not calibrated)" if uncalibrated else ""
    if not finite:
        raise ValueError(
            f"{who}: input_amax must be finite and > 0 (a calibrated max |x|){marker}, got "
            f"{fault(value)}"
        )
    if not positive:
        raise ValueError(
            f"{who}: input_amax must be finite and > 0 (a calibrated max |x|){marker}, got "
            f"{fault(value)}: an amax of 0 or below would serve the bias alone (alpha = 0); "
            f"calibrate with batches holding finite non-zero inputs"
        )
    return value


def _shown(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} on {t.device}"
    return describe(t)


def _expect(value: object, name: str, dtype: torch.dtype, shape: tuple[int, ...], who: str) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != shape:
        want = f"{str(dtype).removeprefix('torch.')} {shape}"
        raise ValueError(f"{who}: {name} must be {want}, got {_shown(value)}")


def check_weight(weight: object, who: str, *, check_values: bool = True) -> Fp4Operand:
    """``weight`` if a frozen layer can serve with it: an ``Nvfp4Operand`` or ``Mxfp4Operand``
    of 2-D codes ``[N, K / 2]`` (``torch.float4_e2m1fn_x2``; ``N >= 1``, ``K`` a multiple of the
    block), its scales at the layout its block says (NVFP4 ``float8_e4m3fn`` ``[N, K/16]`` for
    ``"1x16"``, ``[N/16, K/16]`` for ``"16x16"``; MXFP4 ``float8_e8m0fnu`` ``[N, K/32]``), no
    block scale NaN (a block that held a NaN) or negative, NVFP4's amax a finite float32 >= 0
    of one element (0 only with every scale 0: an all-zero weight), everything on one device.
    ``TypeError``/``ValueError`` naming the value and what is accepted; reads ``weight`` only
    (one host read of the scales and amax; none with ``check_values=False``, for a caller that
    reads many operands' values at once: ``check_weights``)."""
    if not isinstance(weight, (Nvfp4Operand, Mxfp4Operand)):
        raise TypeError(
            f"{who} takes an Nvfp4Operand or Mxfp4Operand (computectx.formats.numerics.fp4: "
            f"codes, block scales and NVFP4's amax), got {describe(weight)}"
        )
    codes = weight.codes
    if (
        not isinstance(codes, torch.Tensor)
        or codes.dtype != torch.float4_e2m1fn_x2
        or codes.dim() != 2
        or 0 in codes.shape
    ):
        raise ValueError(
            f"{who}: codes must be a non-empty 2-D float4_e2m1fn_x2 tensor [out_features, "
            f"in_features / 2] (two values a byte), got {_shown(codes)}"
        )
    n, k = codes.shape[0], 2 * codes.shape[1]
    nv = isinstance(weight, Nvfp4Operand)
    block, fmt = (NVFP4_BLOCK, "nvfp4") if nv else (MXFP4_BLOCK, "mxfp4")
    if k % block:
        raise ValueError(
            f"{who}: in_features = {k} (codes {tuple(codes.shape)}, two a byte) is not a "
            f"multiple of the {fmt} block, {block}"
        )
    if isinstance(weight, Nvfp4Operand):
        if weight.tile not in ("1x16", "16x16"):
            raise ValueError(f"{who}: tile must be '1x16' or '16x16', got {weight.tile!r}")
        tiled = weight.tile == "16x16"
        if tiled and n % NVFP4_BLOCK:
            raise ValueError(
                f"{who}: 16x16 tiles need out_features a multiple of 16, got codes of "
                f"{tuple(codes.shape)}"
            )
        rows = n // NVFP4_BLOCK if tiled else n
        _expect(weight.scale, "scale", torch.float8_e4m3fn, (rows, k // block), who)
        amax = weight.amax
        if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or amax.numel() != 1:
            raise ValueError(
                f"{who}: amax must be a float32 tensor of one element, got {_shown(amax)}"
            )
    else:
        _expect(weight.scale, "scale", torch.float8_e8m0fnu, (n, k // block), who)
    parts = [codes, weight.scale, *([weight.amax] if nv else [])]  # type: ignore[union-attr]
    if any(t.device != codes.device for t in parts):
        raise ValueError(
            f"{who}: codes, scale and amax must be on one device, got "
            f"{', '.join(str(t.device) for t in parts)}"
        )
    if check_values and not codes.is_meta:  # a meta skeleton holds no values yet
        _check_values(weight, who, _flags(weight).tolist())
    return weight


def check_weights(weights: Sequence[tuple[Fp4Operand, str]]) -> None:
    """Each ``(weight, who)`` checked as ``check_weight`` checks it, the values of all in one
    host read (a frozen experts module's ``E`` operands a weight: one read, not ``E``); the
    error of the first that fails, named by its ``who``."""
    for q, who in weights:
        check_weight(q, who, check_values=False)
    held = [(q, who) for q, who in weights if not q.codes.is_meta]
    if not held:
        return
    devices = {q.codes.device for q, _ in held}
    flags = [_flags(q).to(torch.device("cpu")) if len(devices) > 1 else _flags(q) for q, _ in held]
    for (q, who), bad in zip(held, torch.stack(flags).tolist(), strict=True):
        _check_values(q, who, bad)


def _flags(weight: Fp4Operand) -> torch.Tensor:
    # bool (3,) on the weight's device, nothing read: a scale NaN or negative; NVFP4's amax
    # not finite or negative; its amax 0 beside a scale that is not.
    scale = weight.scale.float()
    bad_scale = scale.isnan().any() | (scale < 0).any()
    if not isinstance(weight, Nvfp4Operand):
        return torch.stack((bad_scale, torch.zeros_like(bad_scale), torch.zeros_like(bad_scale)))
    amax = weight.amax.float()
    bad_amax = ~torch.isfinite(amax).all() | (amax < 0).any()
    # The quantizers give an amax of 0 to an all-zero weight only (every scale 0); with a
    # scale that is not, dequantizing (S_enc = 1 at amax 0) and W4A4's epilogue (alpha =
    # amax_x * 0) would serve two different weights.
    zero_amax = (amax == 0).any() & (scale != 0).any()
    return torch.stack((bad_scale, bad_amax, zero_amax))


def _check_values(weight: Fp4Operand, who: str, bad: list[bool]) -> None:
    if isinstance(weight, Nvfp4Operand):
        if bad[1]:
            raise ValueError(f"{who}: amax must be finite and >= 0, got {_amax_fault(weight)}")
        if bad[2]:
            raise ValueError(
                f"{who}: amax is 0 but some block scales are not: an amax of 0 stands for an "
                f"all-zero weight (every scale 0); give the weight's own amax"
            )
    if bad[0]:
        raise ValueError(
            f"{who}: block scales must be finite and >= 0 (a NaN scale stands for a block "
            f"that held a NaN: such a weight serves NaN)"
        )


def _amax_fault(weight: Nvfp4Operand) -> str:
    # What is wrong with an amax refused (an error path: one host read), named, not shown.
    amax = weight.amax.float()
    faults = ((amax.isnan(), "NaN"), (amax == float("inf"), "inf"), (amax < 0, "a negative value"))
    found = torch.stack([bad.any() for bad, _ in faults]).tolist()
    return " and ".join(name for (_, name), hit in zip(faults, found, strict=True) if hit)


def check_bias(bias: object, n: int, device: torch.device, who: str) -> torch.Tensor | None:
    """``bias`` if it is ``None`` or a bf16/fp16/fp32 tensor ``(n,)`` on ``device``."""
    if bias is None:
        return None
    if (
        not isinstance(bias, torch.Tensor)
        or bias.dtype not in FLOAT_DTYPES
        or tuple(bias.shape) != (n,)
        or bias.device != device
    ):
        raise ValueError(
            f"{who}: bias must be None or a bf16, fp16 or fp32 tensor ({n},) on {device}, got "
            f"{_shown(bias)}"
        )
    return bias


def dequantized(weight: Fp4Operand, dtype: torch.dtype) -> torch.Tensor:
    """The values ``weight`` stands for at ``dtype``: formed in float32, rounded once
    (``computectx::fp4_dequantize``: one operator in a compiled graph)."""
    return fp4_ops.dequantize(weight, dtype)


def weight_only_mm(x2: torch.Tensor, weight: Fp4Operand, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x2, dequantized(weight, x2.dtype), bias.to(x2.dtype))``: torch's GEMM at
    ``x2``'s dtype."""
    b = None if bias is None else bias.to(x2.dtype)
    return F.linear(x2, dequantized(weight, x2.dtype), b)


def nvfp4_rows(
    x2: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[Nvfp4Operand, torch.Tensor]:
    """Each row of the 2-D ``x2`` quantized as ``quantize_nvfp4`` quantizes it alone (1x16
    blocks, round to nearest, the row's finite amax), and the rows' amaxes (float32
    ``(rows,)``), through ``computectx::fp4_quantize_rows`` (one operator in a compiled
    graph). The operand's amax is ``UNIT_AMAX`` (``S_enc = 1``): ``w4a4_mm`` applies each
    row's own. ``amax`` (float32 ``(1,)``): every row's, a static one."""
    # A static amax was checked when it was installed (check_input_amax): no host read here.
    codes, scale, amax = fp4_ops.quantize_rows(x2.detach(), amax, check_values=False)
    unit = torch.full((), UNIT_AMAX, dtype=torch.float32, device=x2.device)
    return Nvfp4Operand(codes, scale, unit, "1x16"), amax


def w4a4_mm(
    x2: torch.Tensor,
    weight: Fp4Operand,
    how: Fp4Quant,
    rule: ActivationAmax,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    input_amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x2 @ Wᵀ (+ bias)`` at ``out_dtype`` with ``x2`` quantized to nearest at this call
    (module docstring: ``rule`` for NVFP4's activation amax; ``"static"`` takes
    ``input_amax``, float32 ``(1,)``), through ``fp4_scaled_mm``."""
    if isinstance(weight, Mxfp4Operand) or rule == "per_tensor":
        qx = fp4_ops.quantize(x2, how)
        return fp4_ops.scaled_mm(qx, weight, out_dtype, bias)
    if (rule == "static") != (input_amax is not None):
        raise ValueError(f"w4a4_mm: input_amax goes with 'static' and only it (rule {rule!r})")
    qx, amax = nvfp4_rows(x2, input_amax)
    unit_w = Nvfp4Operand(weight.codes, weight.scale, qx.amax, weight.tile)
    acc = fp4_ops.scaled_mm(qx, unit_w, torch.float32)  # alpha == 1: the accumulator
    alpha = tensor_scale_alpha(amax, weight.amax.float().reshape(()))  # per row
    return tensorwise.epilogue(acc * alpha[:, None], bias, out_dtype)
