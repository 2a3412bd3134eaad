"""The block-scaled fp8 GEMM: one entry point for every fine granularity, and its twin.

``block_scaled_mm(a, b, scale_a, granularity_a, scale_b, granularity_b, bias, out_dtype)``
computes ``(a * steps_a) @ (b * steps_b).T (+ bias)`` for fp8 codes ``a [M, K]`` and
``b [N, K]`` (K, the last dimension of both, is contracted), each scaled at a granularity of
``computectx.fp8.granular``, with the scale ``fp8_quantize`` returns for the 2-D operand:

==========  ===========================================  =============================
name        scale of an operand of ``rows x K``          accepted with
==========  ===========================================  =============================
``row``     ``(rows, 1)`` float32                        ``row``
``1x128``   ``(rows, ceil(K/128))`` float32              ``1x128``, ``128x128``
``128x128`` ``(ceil(rows/128), ceil(K/128))`` float32    ``1x128``
``mx``      ``(rows, ceil(K/32))`` ``float8_e8m0fnu``    ``mx``
==========  ===========================================  =============================

The accepted ``(granularity_a, granularity_b)`` pairs are ``PAIRS``. Ragged K is a partial
last K block (as in ``granular``): its step came from the elements there are, and the GEMM
sums just those. Anything else (another pair, a scale of the wrong shape or dtype, K that
differs between the operands, a non-fp8 operand) is a ``ValueError`` naming the values and
what is accepted; nothing runs.

**Semantics (the twin, ``reference_scaled_mm``)**

- ``row`` x ``row``: exactly ``reference.scaled_mm`` with per-row steps (the same function,
  called): a float32 sum over all of K, ``acc * (step_a[i] * step_b[j])`` once, then bias.
- The block pairs: K is cut into blocks of the scale's width ``W`` (128 for ``1x128`` and
  ``128x128``, 32 for ``mx``). For each block ``kb``, in order, the partial sum of the exact
  fp8 products over the block is formed in float32, multiplied by the block's scale
  ``s = step_a[i, kb] * step_b[j, kb]`` (one float32 product), and added to a float32
  accumulator: ``acc = acc + partial_kb * s``. This is DeepSeek-V3's recipe on Hopper: each
  128-wide partial sum is promoted to float32 with its scales. A ``128x128`` operand's step
  is its block's, the same for the 128 rows in the block. E8M0 scales are the exact powers
  of two ``2**(byte - 127)``. Then the bias is added in float32 and the sum rounded once to
  ``out_dtype``.

**The bound** (``scaled_mm_error_bound``): fp8 products are exact in float32, so the error
of any implementation that sums each block (or any split of it into sub-blocks, as a kernel
with a narrower K step does) in float32 in any order, scales each partial sum in float32 and
sums the scaled partials in float32 in any order is at most::

    e = gamma_n * (sum_kb |s_kb| * sum_{k in kb} |a_ik| |b_jk| + |bias_j|)
        + 2**-148 * (sum_k |a_ik| |b_jk| + n_kb)
    bound = e + u_out * (|exact| + e) + tiny(out_dtype)

with ``gamma_n = n u / (1 - n u)``, ``u = 2**-24``, ``n = K + n_kb + 4`` (a sub-block of
width ``w`` costs ``w - 1`` additions and the ``ceil(K / w)`` scaled partials ``ceil(K / w)``
more; at most ``K + n_kb + 2`` for ``1 <= w <= W``, plus the two roundings of the scaling);
the absolute term covers a scale product ``s`` or a scaled partial that falls below
float32's normal range; ``u_out`` is half an ulp of ``out_dtype`` (``2**-8`` bf16,
``2**-11`` fp16, ``2**-24`` fp32). A scale product that overflows float32 is outside the
bound (the result is then inf). For ``row`` x ``row`` the bound is
``reference.scaled_mm_error_bound``.

**A narrower accumulator** (the Triton kernel on a GPU; ``NARROW_ACCUMULATION``). Hopper's
fp8 tensor cores sum the products of one ``BLOCK_K`` step (``max_num_imprecise_acc=
BLOCK_K``, at most ``w = 128`` products, never more than one scale block) in an accumulator
of about 14 significant bits before the kernel promotes the step's partial to float32. With
each of that step's ``w' - 1`` additions (``w' = min(w, block width)``; the whole of K for
``row``) of relative error at most ``u_h = 2**-13``, the step's partial ``P^`` is within
``gamma_h * sum |a_ik||b_jk|`` of its exact ``P``, ``gamma_h = (w'-1) u_h / (1 - (w'-1)
u_h)``. Everything after is the float32 computation above applied to ``P^``, whose
magnitudes are at most ``(1 + gamma_h)`` times the exact ones, so ``gamma_n`` becomes::

    gamma = gamma_h + gamma_n * (1 + gamma_h)

(``gamma_h`` is about 0.0157 for ``w' = 128``, against ``gamma_n`` about 1.8e-5 for
``K = 300``), for every pair, ``row`` included; ``scaled_mm_error_bound(accumulation=(w,
u_h))`` computes it, with ``reference.accumulation_gamma`` (shared with the per-tensor
bound, ``reference.scaled_mm_error_bound``).

**Backends** (``backend=``, an ``Fp8Backend``): ``REFERENCE`` runs the twin; ``TRITON`` the
kernel in ``computectx.kernels.scaled_mm_blocks`` (imported on first use); ``CUBLAS``
``torch._scaled_mm`` with row-wise scales for ``row`` x ``row`` and the block and MX recipes
of ``torch.nn.functional.scaled_mm`` where they run (``computectx.fp8.block_gemm_ops``
says which, and what runs instead). Every backend goes through one ``torch.library`` custom
operator, ``computectx::fp8_block_scaled_mm``, with a fake implementation, so
``torch.compile(fullgraph=True)`` traces it without a graph break and compiled output equals
eager bit for bit.
"""

from __future__ import annotations

from typing import Final, Literal, cast, get_args

import torch
from torch.library import custom_op

from computectx.fp8 import granular, reference
from computectx.fp8.backend import Fp8Backend, check_backend, parse_backend
from computectx.fp8.quantized import FP8_DTYPES

__all__ = [
    "NARROW_ACCUMULATION",
    "OUT_DTYPES",
    "PAIRS",
    "GemmGranularity",
    "block_scaled_mm",
    "block_width",
    "check_args",
    "reference_scaled_mm",
    "row_steps",
    "scaled_mm_error_bound",
]

GemmGranularity = Literal["row", "1x128", "128x128", "mx"]
"""The granularity of one operand of ``block_scaled_mm``."""
PAIRS: Final[tuple[tuple[GemmGranularity, GemmGranularity], ...]] = (
    ("row", "row"),
    ("1x128", "1x128"),
    ("1x128", "128x128"),
    ("128x128", "1x128"),
    ("mx", "mx"),
)
"""The ``(granularity_a, granularity_b)`` pairs ``block_scaled_mm`` accepts."""
OUT_DTYPES: Final = (torch.bfloat16, torch.float16, torch.float32)
"""The dtypes of the result, and of a bias."""
NARROW_ACCUMULATION: Final[tuple[int, float]] = (128, 2.0**-13)
"""How the Triton kernels (the block-scaled one and the per-tensor one) sum on a GPU, for
``scaled_mm_error_bound(accumulation=)`` here and in ``reference``: at most 128 products
(one ``BLOCK_K`` step, ``max_num_imprecise_acc=BLOCK_K``) in the fp8 tensor cores'
accumulator, each addition with relative error at most ``2**-13`` (14 significant bits,
truncated: the "around 14 bits" DeepSeek-V3 measured on H800), then promoted to float32."""
_NAMES: Final = get_args(GemmGranularity)


def block_width(granularity: GemmGranularity, k: int) -> int:
    """The width along K of one scale block: 128, or 32 for ``mx``, or K for ``row``
    (``granular.block_shape``)."""
    return granular.block_shape(granularity, k)[1]


def _pairs_text() -> str:
    return ", ".join(f"({a!r}, {b!r})" for a, b in PAIRS)


def _check_operand(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a 2-D fp8 tensor, got {type(t).__name__}")
    if t.dtype not in FP8_DTYPES or t.dim() != 2:
        raise ValueError(
            f"{name} must be a 2-D float8_e4m3fn or float8_e5m2 tensor; got dtype {t.dtype}, "
            f"shape {tuple(t.shape)}"
        )
    return t


def _check_scale(
    name: str, scale: object, granularity: GemmGranularity, t: torch.Tensor
) -> torch.Tensor:
    layout = granular.layout_of(granularity, t.shape)  # ValueError for mx with K < 32
    who = f"{name} for granularity {granularity!r} of an operand of shape {tuple(t.shape)}"
    return granular.check_scale(scale, layout, t.device, who)


def check_args(
    a: object,
    b: object,
    scale_a: object,
    granularity_a: object,
    scale_b: object,
    granularity_b: object,
    bias: object,
    out_dtype: object,
) -> tuple[GemmGranularity, GemmGranularity]:
    """Check ``block_scaled_mm``'s arguments; the two granularities, typed.

    ``TypeError`` for a non-tensor where a tensor belongs, ``ValueError`` naming the bad
    value and what is accepted otherwise. Reads no tensor contents.
    """
    for g in (granularity_a, granularity_b):
        if g not in _NAMES:
            raise ValueError(
                f"unknown GEMM granularity {g!r}; accepted pairs (granularity_a, "
                f"granularity_b): {_pairs_text()}"
            )
    ga, gb = cast(GemmGranularity, granularity_a), cast(GemmGranularity, granularity_b)
    if (ga, gb) not in PAIRS:
        raise ValueError(
            f"block_scaled_mm does not multiply granularity {ga!r} by {gb!r}; accepted "
            f"pairs (granularity_a, granularity_b): {_pairs_text()}"
        )
    ta, tb = _check_operand("a", a), _check_operand("b", b)
    if ta.shape[1] != tb.shape[1]:
        raise ValueError(
            f"a is [M, K] and b is [N, K] with the same K; got a {tuple(ta.shape)}, "
            f"b {tuple(tb.shape)}"
        )
    if tb.device != ta.device:
        raise ValueError(f"a is on {ta.device} but b is on {tb.device}")
    _check_scale("scale_a", scale_a, ga, ta)
    _check_scale("scale_b", scale_b, gb, tb)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
        if bias.dtype not in OUT_DTYPES or tuple(bias.shape) != (tb.shape[0],):
            raise ValueError(
                f"bias must be a bf16/fp16/fp32 tensor of shape ({tb.shape[0]},); got dtype "
                f"{bias.dtype}, shape {tuple(bias.shape)}"
            )
        if bias.device != ta.device:
            raise ValueError(f"bias is on {bias.device} but a is on {ta.device}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(
            f"out_dtype {out_dtype!r} is not supported; accepted: {', '.join(map(str, OUT_DTYPES))}"
        )
    return ga, gb


def block_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    granularity_a: GemmGranularity,
    scale_b: torch.Tensor,
    granularity_b: GemmGranularity,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    backend: Fp8Backend | str = Fp8Backend.REFERENCE,
) -> torch.Tensor:
    """``(a * steps_a) @ (b * steps_b).T (+ bias)`` as a new ``[M, N]`` ``out_dtype`` tensor.

    ``a [M, K]`` and ``b [N, K]`` are fp8 codes (E4M3 or E5M2, any strides) with the scales
    ``fp8_quantize(..., granularity=)`` returned for them (the module docstring's table);
    ``bias`` is ``[N]`` (bf16/fp16/fp32) or None; ``out_dtype`` is bf16, fp16 or fp32. The
    pair of granularities must be one of ``PAIRS``; the semantics and the error bound are
    the module docstring's. ``backend`` (an ``Fp8Backend`` or its name, ``"triton"``) runs
    it; ``ValueError`` saying why (the capability probe's reason: no CUDA device and no
    ``TRITON_INTERPRET=1``, triton not installed, no fp8 tensor cores) when it cannot run on
    the tensors' device.
    """
    ga, gb = check_args(a, b, scale_a, granularity_a, scale_b, granularity_b, bias, out_dtype)
    chosen = check_backend(parse_backend(backend) if isinstance(backend, str) else backend, a)
    out: torch.Tensor = torch.ops.computectx.fp8_block_scaled_mm(
        a, b, scale_a, ga, scale_b, gb, bias, out_dtype, chosen.value
    )
    return out


# ---------------------------------------------------------------------------------------
# The twin.


def row_steps(scale: torch.Tensor, granularity: GemmGranularity, rows: int) -> torch.Tensor:
    """float32 steps of one operand, one per row and K block: ``(rows, n_kb)`` (a
    ``128x128`` block's step repeated over its rows; E8M0 widened exactly)."""
    steps = granular.steps_of_scale(scale)
    if granularity == "128x128":
        steps = steps.repeat_interleave(granular.TILE, dim=0)[:rows]
    return steps


def _block_partials(
    a: torch.Tensor, b: torch.Tensor, width: int, first: int, last: int
) -> torch.Tensor:
    # The float32 partial sums of K blocks first..last-1: (blocks, M, N). fp8 values widen
    # exactly and their products are exact in float32 (TF32 too: 4 significant bits).
    k = a.shape[1]
    lo, hi = first * width, min(k, last * width)
    pad = (last - first) * width - (hi - lo)
    a3 = torch.nn.functional.pad(a[:, lo:hi].to(torch.float32), (0, pad))
    b3 = torch.nn.functional.pad(b[:, lo:hi].to(torch.float32), (0, pad))
    a3 = a3.reshape(a.shape[0], last - first, width).transpose(0, 1)
    b3 = b3.reshape(b.shape[0], last - first, width).permute(1, 2, 0)
    return torch.bmm(a3, b3)


def _twin_blocks(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    ga: GemmGranularity,
    scale_b: torch.Tensor,
    gb: GemmGranularity,
) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    width = block_width(ga, k)
    sa = row_steps(scale_a, ga, m)
    sb = row_steps(scale_b, gb, n)
    n_kb = sa.shape[1]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    # Blocks in groups, so the (group, M, N) partials stay near 2**24 elements.
    group = max(1, 2**24 // max(1, m * n))
    for first in range(0, n_kb, group):
        last = min(n_kb, first + group)
        partials = _block_partials(a, b, width, first, last)
        # Each block's scale step_a[i, kb] * step_b[j, kb] (one float32 product), then
        # partial * scale (one rounding), then the in-order float32 sum.
        scales = sa[:, first:last].t().unsqueeze(2) * sb[:, first:last].t().unsqueeze(1)
        partials.mul_(scales)
        for i in range(last - first):
            acc.add_(partials[i])
    return acc


def reference_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    granularity_a: GemmGranularity,
    scale_b: torch.Tensor,
    granularity_b: GemmGranularity,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The twin: ``block_scaled_mm``'s semantics (module docstring) in plain torch, on the
    operands' device. Arguments are assumed checked (``check_args``)."""
    if granularity_a == "row":
        return reference.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)
    dev = a.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        # An enclosing autocast would run the partial sums in 16 bits.
        with torch.autocast(dev, enabled=False):
            acc = _twin_blocks(a, b, scale_a, granularity_a, scale_b, granularity_b)
    else:
        acc = _twin_blocks(a, b, scale_a, granularity_a, scale_b, granularity_b)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def scaled_mm_error_bound(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    granularity_a: GemmGranularity,
    scale_b: torch.Tensor,
    granularity_b: GemmGranularity,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    accumulation: tuple[int, float] | None = None,
) -> torch.Tensor:
    """The a-priori elementwise bound on ``|block_scaled_mm(...) - exact|`` of the module
    docstring, float64 ``[M, N]`` on the CPU, for checked arguments on any device.

    ``accumulation=(w, u_h)`` widens it for hardware that sums up to ``w`` consecutive
    products of a block in a narrower accumulator, each addition with relative error at most
    ``u_h``, before promoting that partial to float32 (``NARROW_ACCUMULATION``: the Triton
    kernel on a GPU; the module docstring derives the bound)."""
    a, b = a.cpu(), b.cpu()
    scale_a, scale_b = scale_a.cpu(), scale_b.cpu()
    bias = None if bias is None else bias.cpu()
    if granularity_a == "row" and accumulation is None:
        return reference.scaled_mm_error_bound(a, b, scale_a, scale_b, bias, out_dtype)
    m, k = a.shape
    n = b.shape[0]
    width = block_width(granularity_a, k)
    sa = row_steps(scale_a, granularity_a, m).to(torch.float64)
    sb = row_steps(scale_b, granularity_b, n).to(torch.float64)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    n_kb = sa.shape[1]
    exact = torch.zeros((m, n), dtype=torch.float64)
    mag = torch.zeros((m, n), dtype=torch.float64)
    for kb in range(n_kb):
        sl = slice(kb * width, min(k, (kb + 1) * width))
        s = sa[:, kb : kb + 1] * sb[:, kb].reshape(1, n)  # exact in float64
        exact += (a64[:, sl] @ b64[:, sl].t()) * s
        mag += (a64[:, sl].abs() @ b64[:, sl].abs().t()) * s.abs()
    if bias is not None:
        exact = exact + bias.to(torch.float64)
        mag = mag + bias.to(torch.float64).abs()
    gamma = reference.accumulation_gamma(k + n_kb + 4, width, accumulation)
    unscaled = a64.abs() @ b64.abs().t()
    e = gamma * mag + 2.0**-148 * (unscaled + n_kb)
    u_out = reference.UNIT_ROUNDOFF[out_dtype]
    tiny = torch.finfo(out_dtype).smallest_normal * u_out * 2
    return e + u_out * (exact.abs() + e) + tiny


# ---------------------------------------------------------------------------------------
# The operator.


@custom_op("computectx::fp8_block_scaled_mm", mutates_args=())
def _block_scaled_mm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    granularity_a: str,
    scale_b: torch.Tensor,
    granularity_b: str,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``block_scaled_mm`` on a checked call: the twin, the kernel or cuBLAS."""
    ga, gb = cast(GemmGranularity, granularity_a), cast(GemmGranularity, granularity_b)
    chosen = parse_backend(backend)
    if chosen is Fp8Backend.REFERENCE:
        return reference_scaled_mm(a, b, scale_a, ga, scale_b, gb, bias, out_dtype)
    # Imported on first use: the Triton path imports triton, and the cuBLAS paths probe.
    from computectx.fp8 import block_gemm_ops

    return block_gemm_ops.run(chosen, a, b, scale_a, ga, scale_b, gb, bias, out_dtype)


@_block_scaled_mm_op.register_fake
def _block_scaled_mm_fake(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
    # The operator's arguments in its schema's order: the output is (M, N) at out_dtype, the
    # last but one; the scales, granularities, bias and backend do not shape it.
    out_dtype = cast(torch.dtype, rest[-2])
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
