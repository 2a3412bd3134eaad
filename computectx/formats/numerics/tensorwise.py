"""Pure-torch twins of the fp8 kernels: the oracle in tests and the backend without Triton.

Every function here has the semantics of one kernel in ``computectx.kernels`` and the scale
convention of ``computectx.formats.policy``, with the margin as headroom (the amax lands on
``fmt.max / 2**margin``, so values may grow ``2**margin``-fold before they saturate):

    step  = amax / (fmt.max / 2**margin)   (1.0 when that is zero or amax is not finite)
    q     = fp8(clamp(x / step, -fmt.max, fmt.max))   round to nearest even; NaN -> 0x7F
    x_hat = q.float() * step

(with ``fmt.max`` lowered to ``code_bound(step)`` for the steps above about ``FLT_MAX /
fmt.max``, so that ``x_hat`` of a finite ``x`` is always finite).

All arithmetic is float32 in the order the kernels use, so quantized bytes agree bit for bit.
Scalars (steps, amaxes) are float32 tensors of shape ``(1,)`` on the data's device; nothing
here reads a tensor value on the host, so no function synchronises with the device.
Inputs are assumed validated (``computectx.formats.ops`` checks them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Final, Literal, NamedTuple

import torch

from computectx.dtypes import Fp8Format
from computectx.formats.numerics.ledger import LedgerParts, ledger_parts

__all__ = [
    "FORMATS",
    "FORMAT_OF",
    "UNIT_ROUNDOFF",
    "FormatConstants",
    "GemmArgs",
    "accumulation_gamma",
    "advance_ledger",
    "amax",
    "code_bound",
    "dequantize",
    "epilogue",
    "float32_matmuls",
    "fp8_codes",
    "output_bound",
    "quantize_delayed",
    "quantize_dynamic",
    "quantize_with_step",
    "saturated_count",
    "scaled_mm",
    "scaled_mm_error_bound",
    "seed_ledger",
    "step_from_amax",
]


class FormatConstants(NamedTuple):
    """The constants of one fp8 format the twins compute with (``computectx.dtypes``'s)."""

    dtype: torch.dtype
    max: float
    mantissa_bits: int


FORMATS: Final[dict[Fp8Format, FormatConstants]] = {
    f: FormatConstants(f.torch, f.max, f.mantissa_bits) for f in Fp8Format
}
"""Each format's constants, read once from ``computectx.dtypes`` at import: the per-operand
code looks them up here instead of asking the format for each one on every call."""

FORMAT_OF: Final[dict[torch.dtype, Fp8Format]] = {f.torch: f for f in Fp8Format}
"""The format of each torch fp8 dtype (what an operator's ``fp8`` argument names)."""


UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float32: 2.0**-24,
}
"""Half an ulp of 1.0 (the unit roundoff) of each dtype a GEMM or attention rounds its
output to: what the error bounds add for that last rounding."""


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a float32 ``(1,)`` tensor; NaN if any element is NaN, 0 when empty."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    # torch.amax propagates NaN, which is what lets a NaN input reach the non-finite count;
    # every NaN becomes the one canonical NaN (payloads carry no information).
    a = x.detach().abs().amax().to(torch.float32).reshape(1)
    return torch.where(torch.isnan(a), torch.full_like(a, math.nan), a)


def step_from_amax(a: torch.Tensor, fmt: Fp8Format, margin: int) -> torch.Tensor:
    """The quantization step for amax ``a``: ``a / (fmt.max / 2**margin)`` in float32.

    ``a / step = fmt.max / 2**margin``: the margin is headroom below the format's maximum.

    A zero or non-finite amax, or one whose step underflows to zero or overflows to inf,
    gives 1.0, so nothing divides by zero and no step is infinite. A step below float32's
    smallest normal number (an amax under about 5e-36 for E4M3) would keep too few bits to
    scale by: it is raised to that number, so such values quantize as the format's
    subnormals or zero, within the subnormal bound.
    """
    a32 = a.to(torch.float32)
    # fmt.max / 2**margin is exact (a power of two apart), so the step is one IEEE
    # round-to-nearest division, the same one the kernels perform. The divisor is a device
    # tensor: a Python scalar would let CUDA divide by multiplying with its rounded
    # reciprocal, and torch.tensor(value, device=...) would be a blocking host-to-device
    # copy on every call; full_like is a fill on the device.
    target = torch.full_like(a32, FORMATS[fmt].max / 2.0**margin)
    step = a32 / target
    # A non-finite amax gives a non-finite step; so does a finite one that overflows.
    good = torch.isfinite(step) & (step > 0)
    tiny = torch.full_like(step, torch.finfo(torch.float32).tiny)
    step = torch.where(step < tiny, tiny, step)
    return torch.where(good, step, torch.ones_like(step))


def _scaled(x: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    # x is bf16/fp16/fp32: widening to float32 is exact, and the division is IEEE float32.
    return x.to(torch.float32) / step.to(torch.float32).reshape(())


def code_bound(step: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The largest magnitude a code may take with ``step`` (elementwise, float32): ``fmt.max``,
    or, for a step above about ``FLT_MAX / fmt.max``, the largest value of the format's grid
    whose product with the step is finite in float32.

    Without it a value near float32's maximum could round up to a code whose dequantized
    value ``code * step`` is inf: 3.4e38 under a power-of-two step takes step ``2**120``
    and ``x / step = 255.8`` would round to the code 256, and ``256 * 2**120 = 2**128``.
    The bound is ``FLT_MAX / |step|`` (one IEEE division) truncated onto the grid (its
    float32 mantissa cut to the format's bits: toward zero), at most ``fmt.max``; that
    ``bound * step`` never rounds past ``FLT_MAX`` is checked exhaustively for every step
    whose bound is below ``fmt.max`` (tests/formats/numerics/test_extreme_finite.py). A NaN step
    gives
    ``fmt.max`` (its codes are NaN anyway).
    """
    c = FORMATS[fmt]
    s = step.to(torch.float32).abs()
    r = torch.full_like(s, torch.finfo(torch.float32).max) / s
    cut = (1 << (23 - c.mantissa_bits)) - 1
    v = (r.view(torch.int32) & ~cut).view(torch.float32)
    return torch.where(v < c.max, v, torch.full_like(v, c.max))


def fp8_codes(s: torch.Tensor, fmt: Fp8Format, bound: torch.Tensor) -> torch.Tensor:
    """The fp8 codes of the scaled values ``s = x / step`` (float32): ``fp8(clamp(s,
    ±bound))`` rounded to nearest even, NaN to the positive fp8 NaN (byte ``0x7F``);
    ``bound`` is ``code_bound(step)``, broadcast to ``s``."""
    # The sign of a NaN that arithmetic produces differs between CPUs and GPUs, so every NaN
    # becomes the one positive NaN (fp8 byte 0x7F) on every backend.
    s = torch.where(torch.isnan(s), torch.full_like(s, math.nan), s)
    # The comparisons are false for NaN, which passes through; ±inf becomes ±bound. bound is
    # a grid value, so the rounding that follows never carries past it. torch's float32 ->
    # fp8 conversion rounds to nearest even, handling subnormals.
    s = torch.where(s > bound, bound, torch.where(s < -bound, -bound, s))
    return s.to(FORMATS[fmt].dtype)


def quantize_with_step(
    x: torch.Tensor, fmt: Fp8Format, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with a given step; also return ``amax(x)`` (float32, shape ``(1,)``).

    Out-of-range values (including ±inf) saturate to ``±fmt.max`` (to ``±code_bound(step)``
    where ``fmt.max * step`` would overflow float32); NaN stays NaN, always the positive fp8
    NaN (byte ``0x7F``) whatever the sign or payload of the input NaN.
    """
    bound = code_bound(step.reshape(()), fmt)
    return fp8_codes(_scaled(x, step), fmt, bound), amax(x)


def dequantize(data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * step`` formed in float32 (exact: fp8 values widen exactly and the product
    is one rounding), then rounded once to ``dtype``."""
    return (data.to(torch.float32) * step.to(torch.float32).reshape(())).to(dtype)


def saturated_count(x: torch.Tensor, step: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """How many elements of ``x / step`` exceed ``fmt.max`` in magnitude, float32 ``(1,)``."""
    s = _scaled(x, step)
    return (s.abs() > FORMATS[fmt].max).sum().to(torch.float32).reshape(1)


def quantize_dynamic(
    x: torch.Tensor, fmt: Fp8Format, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize with the step from ``x``'s own amax: returns ``(q, step, amax)``."""
    a = amax(x)
    step = step_from_amax(a, fmt, margin)
    q, _ = quantize_with_step(x, fmt, step)
    return q, step, a


def quantize_delayed(
    x: torch.Tensor,
    fmt: Fp8Format,
    ledger: torch.Tensor,
    idx: int,
    algo: Literal["max", "most_recent"],
    margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with the ledger's current step, then advance the ledger in place.

    Returns ``(q, step_used)``. Afterwards history slot ``idx`` holds this amax and the
    ledger's step is the one from the window (``algo="max"``: max of the history;
    ``"most_recent"``: this amax). A non-finite amax leaves history and step alone and adds
    1 to the non-finite count; the number of saturated elements is added to the saturated
    count either way. (The layout is ``computectx.formats.numerics.ledger``'s.)
    """
    parts = ledger_parts(ledger)
    step_used = parts.step.clone()
    q, a = quantize_with_step(x, fmt, step_used)
    advance_ledger(parts, idx, a, saturated_count(x, step_used, fmt), fmt, algo, margin)
    return q, step_used


def advance_ledger(
    ledger: torch.Tensor | LedgerParts,
    idx: int,
    a: torch.Tensor,
    saturated: torch.Tensor,
    fmt: Fp8Format,
    algo: Literal["max", "most_recent"],
    margin: int,
) -> None:
    """Record a quantize that used the ledger's step: history slot ``idx`` takes the amax
    ``a`` and the step comes from the window (both only when ``a`` is finite; else the
    non-finite count grows), and ``saturated`` adds to the saturated count. Device ops.
    ``ledger`` may be its ``ledger_parts`` already taken."""
    parts = ledger if isinstance(ledger, LedgerParts) else ledger_parts(ledger)
    finite = torch.isfinite(a)
    slot = parts.history[idx : idx + 1]
    slot.copy_(torch.where(finite, a, slot))
    # The window includes the amax just written, as in the kernel's last program.
    window = parts.history.amax().reshape(1) if algo == "max" else a
    parts.step.copy_(torch.where(finite, step_from_amax(window, fmt, margin), parts.step))
    parts.nonfinite.add_((~finite).to(torch.float32))
    parts.saturated.add_(saturated)


def seed_ledger(
    ledger: torch.Tensor,
    x: torch.Tensor,
    fmt: Fp8Format,
    margin: int,
    when: torch.Tensor | None = None,
) -> None:
    """First use of an operand: fill the history with ``amax(x)`` and set the step from it.

    A non-finite amax leaves the ledger exactly as it was, counts included: seeding is the
    first half of a call whose quantize (``quantize_delayed``) measures the same amax and
    counts it, so a NaN in a first call is counted once. ``when`` (a bool device tensor of
    shape ``(1,)``) seeds only where it is true, without a host read; the ledger is left
    alone where it is false.
    """
    history, step = ledger_parts(ledger)[:2]
    a = amax(x)
    seed = torch.isfinite(a) if when is None else when & torch.isfinite(a)
    history.copy_(torch.where(seed, a.expand_as(history), history))
    step.copy_(torch.where(seed, step_from_amax(a, fmt, margin), step))


@dataclasses.dataclass(frozen=True)
class GemmArgs:
    """``computectx::fp8_scaled_mm``'s arguments but the backend, checked: what the twin
    (``scaled_mm``), its error bound and the kernels (as its keywords) take. The operator's
    schema and this class are the argument list's two spellings."""

    a: torch.Tensor
    b: torch.Tensor
    step_a: torch.Tensor
    step_b: torch.Tensor
    bias: torch.Tensor | None
    out_dtype: torch.dtype

    def scales(self, dtype: torch.dtype) -> torch.Tensor:
        """``step_a[i] * step_b[j]`` as ``[M, N]`` (``[1, 1]`` for per-tensor steps), formed
        in ``dtype``: one rounding in float32, exact in float64."""
        return self.step_a.to(dtype).reshape(-1, 1) * self.step_b.to(dtype).reshape(1, -1)


def float32_matmuls(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """A context in which matmuls on ``device`` stay float32: an enclosing ``torch.autocast``
    would run them in bf16/fp16 and round the sums before the epilogue, where the twins
    promise a float32 accumulation, as the kernels have."""
    dev = device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.autocast(dev, enabled=False)
    return contextlib.nullcontext()


def epilogue(acc: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMMs' epilogue on the scaled float32 accumulator: the bias added in float32, the
    sum rounded once to ``out_dtype``."""
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def scaled_mm(args: GemmArgs) -> torch.Tensor:
    """``(a * step_a) @ (b * step_b).T (+ bias)`` for fp8 ``a [M, K]``, ``b [N, K]``.

    The steps are per tensor (shape ``(1,)``) or per row (``step_a [M, 1]``, ``step_b
    [N, 1]``, the row-wise GEMM of ``computectx.formats.linear.blockwise``): element ``(i, j)`` is
    scaled by ``step_a[i] * step_b[j]``, which for ``(1,)`` steps is the one scalar product.

    fp8 values widen to float32 exactly and every product of two fp8 values is exact in
    float32 (at most 4 x 4 significant bits, exponents well inside float32's range), so the
    only rounding before the epilogue is float32 accumulation, as in the kernel. The steps
    multiply the accumulator once, ``acc * (step_a * step_b)``, then bias is added in float32
    and the sum rounded once to ``out_dtype``.
    """
    # Both operands widened into one layout: a CPU GEMM's summation order can follow the
    # operands' strides (oneDNN on an AMX/AVX-512 machine does), and the twin is a function
    # of the values alone, so a transposed view and its contiguous copy give the same bits.
    a = args.a.to(torch.float32).contiguous()
    b = args.b.to(torch.float32).contiguous()
    with float32_matmuls(args.a.device):
        acc = a @ b.t()
    return epilogue(acc * args.scales(torch.float32), args.bias, args.out_dtype)


def accumulation_gamma(
    roundings: int, width: int, accumulation: tuple[int, float] | None = None
) -> float:
    """The relative factor of the GEMM error bounds: ``gamma_n = n u / (1 - n u)`` for
    ``n = roundings`` float32 roundings on any path through the sum (``u = 2**-24``), widened
    for a narrower accumulator.

    ``accumulation=(w, u_h)``: the hardware sums up to ``w' = min(w, width)`` consecutive
    products (``width``: how many share one scale, all of K for per-tensor or per-row steps)
    in an accumulator whose every addition has relative error at most ``u_h``, then promotes
    that partial to float32 (``computectx.formats.numerics.blockwise.NARROW_ACCUMULATION``: the
    Triton kernels' fp8 dot on sm_90). Its ``w' - 1`` additions leave the partial within
    ``gamma_h * sum |a_ik||b_jk|`` of the exact one, ``gamma_h = (w'-1) u_h / (1 - (w'-1)
    u_h)``; the float32 computation after it sees magnitudes at most ``(1 + gamma_h)`` times
    the exact ones, so the factor is ``gamma_h + gamma_n * (1 + gamma_h)``. ``None``:
    ``gamma_n``.
    """
    u = 2.0**-24
    gamma = roundings * u / (1 - roundings * u)
    if accumulation is None:
        return gamma
    w, u_h = accumulation
    if not (isinstance(w, int) and w >= 1 and 0.0 <= u_h < 1.0 / max(1, w - 1)):
        raise ValueError(
            f"accumulation must be (w, u_h) with an int w >= 1 and 0 <= (w - 1) * u_h < 1, "
            f"got {accumulation!r}"
        )
    adds = max(0, min(w, width) - 1)  # additions inside one narrow partial
    gamma_h = adds * u_h / (1 - adds * u_h)
    return gamma_h + gamma * (1 + gamma_h)


def scaled_mm_error_bound(
    args: GemmArgs, *, accumulation: tuple[int, float] | None = None
) -> torch.Tensor:
    """An a-priori elementwise bound on ``|scaled_mm(args) - exact|`` (float64 ``[M, N]``).

    Products of fp8 values are exact in float32, so the error comes from: summing K terms in
    float32 in any order, at most ``gamma_K * sum_k |a_ik b_jk|`` with
    ``gamma_n = n u / (1 - n u)`` and ``u = 2**-24``; rounding ``step_a * step_b``, the
    epilogue product and the bias addition, one ``u`` each; and the final rounding to
    ``out_dtype``, half an ulp: ``u_out * |result|`` with ``u_out`` = 2**-8 (bf16), 2**-11
    (fp16), 2**-24 (fp32). Together::

        e = gamma_{K+3} * (|s| * sum_k |a_ik||b_jk| + |bias_j|)
        bound = e + u_out * (|exact| + e)

    where ``s = step_a * step_b``. Subnormal outputs would add an absolute term; the bound
    adds the smallest subnormal of ``out_dtype`` for them.

    ``accumulation=(w, u_h)`` bounds hardware that sums up to ``w`` consecutive products in
    a narrower accumulator before promoting each partial to float32 (the Triton kernel's fp8
    dot on sm_90: ``computectx.formats.numerics.blockwise.NARROW_ACCUMULATION``): ``gamma_{K+3}``
    becomes ``accumulation_gamma(K + 3, K, accumulation)``, the float32 sum of the partials being
    one of the orders the float32 bound allows.
    """
    k = args.a.shape[1]
    a64 = args.a.to(torch.float64)
    b64 = args.b.to(torch.float64)
    s = args.scales(torch.float64)
    exact = (a64 @ b64.t()) * s
    mag = (a64.abs() @ b64.abs().t()) * s.abs()
    gamma = accumulation_gamma(k + 3, k, accumulation)
    return output_bound(exact, mag, gamma, args.bias, args.out_dtype)


def output_bound(
    exact: torch.Tensor,
    mag: torch.Tensor,
    gamma: float,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    absolute: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GEMM bounds' last step, float64: with the bias added to the exact scaled sum and
    its magnitude to ``mag``, ``e = gamma * mag (+ absolute)`` bounds the float32 result and
    ``e + u_out * (|exact| + e) + tiny`` the result rounded to ``out_dtype`` (half an ulp,
    ``UNIT_ROUNDOFF``, and a subnormal's absolute error)."""
    if bias is not None:
        exact = exact + bias.to(torch.float64)
        mag = mag + bias.to(torch.float64).abs()
    e = gamma * mag
    if absolute is not None:
        e = e + absolute
    u_out = UNIT_ROUNDOFF[out_dtype]
    tiny = torch.finfo(out_dtype).smallest_normal * u_out * 2
    return e + u_out * (exact.abs() + e) + tiny
