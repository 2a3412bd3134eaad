"""The checked fp8 GEMMs: ``scaled_mm`` (per-tensor or per-row steps) and ``block_scaled_mm``
(every fine granularity; its twin and bound are ``numerics.blockwise_gemm``'s).

``block_scaled_mm(a, b, scale_a, granularity_a, scale_b, granularity_b, bias, out_dtype)``
computes ``(a * steps_a) @ (b * steps_b).T (+ bias)`` for fp8 codes ``a [M, K]`` and
``b [N, K]`` (K, the last dimension of both, is contracted), each scaled at a granularity of
``computectx.fp8.numerics.layouts``, with the scale ``fp8_quantize`` returns for the 2-D operand:

==========  ===========================================  =============================
name        scale of an operand of ``rows x K``          accepted with
==========  ===========================================  =============================
``row``     ``(rows, 1)`` float32                        ``row``
``1x128``   ``(rows, ceil(K/128))`` float32              ``1x128``, ``128x128``
``128x128`` ``(ceil(rows/128), ceil(K/128))`` float32    ``1x128``
``mx``      ``(rows, ceil(K/32))`` ``float8_e8m0fnu``    ``mx``
==========  ===========================================  =============================

The accepted ``(granularity_a, granularity_b)`` pairs are ``PAIRS``. Ragged K is a partial
last K block (as in ``numerics.blockwise``): its step came from the elements there are, and the GEMM
sums just those. Anything else (another pair, a scale of the wrong shape or dtype, K that
differs between the operands, a non-fp8 operand) is a ``ValueError`` naming the values and
what is accepted; nothing runs.

**Semantics (the twin, ``reference_scaled_mm``)**

- ``row`` x ``row``: exactly ``numerics.tensorwise.scaled_mm`` with per-row steps (the same
function,
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
``numerics.tensorwise.scaled_mm_error_bound``.

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
u_h))`` computes it, with ``numerics.tensorwise.accumulation_gamma`` (shared with the per-tensor
bound, ``numerics.tensorwise.scaled_mm_error_bound``).

**Backends** (``backend=``, an ``Fp8Backend``): ``REFERENCE`` runs the twin; ``TRITON`` the
kernel in ``computectx.kernels.scaled_mm_blocks`` (imported on first use); ``CUBLAS``
``torch._scaled_mm`` with row-wise scales for ``row`` x ``row`` and the block and MX recipes
of ``torch.nn.functional.scaled_mm`` where they run (``computectx.fp8.ops.cublas``
says which, and what runs instead). Every backend goes through one ``torch.library`` custom
operator, ``computectx::fp8_block_scaled_mm``, with a fake implementation, so
``torch.compile(fullgraph=True)`` traces it without a graph break and compiled output equals
eager bit for bit.
"""

from __future__ import annotations

from typing import cast

import torch

from computectx.dtypes import FLOAT_DTYPES, FP8_DTYPES
from computectx.fp8.backend import Fp8Backend, check_backend, parse_backend
from computectx.fp8.numerics import layouts
from computectx.fp8.numerics.layouts import BLOCK_GRANULARITIES, PAIRS, BlockGranularity
from computectx.fp8.ops import registry
from computectx.fp8.ops.quantize import scalar_arg

__all__ = ["block_scaled_mm", "check_args", "scaled_mm"]


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


def _check_operands(a: object, b: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``a [M, K]`` and ``b [N, K]``: 2-D fp8 tensors on one device with the same K."""
    ta, tb = _check_operand("a", a), _check_operand("b", b)
    if ta.shape[1] != tb.shape[1]:
        raise ValueError(
            f"a is [M, K] and b is [N, K] with the same K; got a {tuple(ta.shape)}, "
            f"b {tuple(tb.shape)}"
        )
    if tb.device != ta.device:
        raise ValueError(f"a is on {ta.device} but b is on {tb.device}")
    return ta, tb


def _check_bias_and_out(bias: object, out_dtype: object, a: torch.Tensor, b: torch.Tensor) -> None:
    """``bias`` None or ``[N]`` of a ``FLOAT_DTYPES`` dtype on ``a``'s device; ``out_dtype``
    one of ``FLOAT_DTYPES``."""
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
        if bias.dtype not in FLOAT_DTYPES or tuple(bias.shape) != (b.shape[0],):
            raise ValueError(
                f"bias must be a bf16/fp16/fp32 tensor of shape ({b.shape[0]},); got dtype "
                f"{bias.dtype}, shape {tuple(bias.shape)}"
            )
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"out_dtype {out_dtype!r} is not supported; accepted: "
            f"{', '.join(map(str, FLOAT_DTYPES))}"
        )


def _check_scale(
    name: str, scale: object, granularity: BlockGranularity, t: torch.Tensor
) -> torch.Tensor:
    layout = layouts.layout_of(granularity, t.shape)  # ValueError for mx with K < 32
    who = f"{name} for granularity {granularity!r} of an operand of shape {tuple(t.shape)}"
    return layouts.check_scale(scale, layout, t.device, who)


def check_args(
    a: object,
    b: object,
    scale_a: object,
    granularity_a: object,
    scale_b: object,
    granularity_b: object,
    bias: object,
    out_dtype: object,
) -> tuple[BlockGranularity, BlockGranularity]:
    """Check ``block_scaled_mm``'s arguments; the two granularities, typed.

    ``TypeError`` for a non-tensor where a tensor belongs, ``ValueError`` naming the bad
    value and what is accepted otherwise. Reads no tensor contents.
    """
    for g in (granularity_a, granularity_b):
        if g not in BLOCK_GRANULARITIES:
            raise ValueError(
                f"unknown GEMM granularity {g!r}; accepted pairs (granularity_a, "
                f"granularity_b): {_pairs_text()}"
            )
    ga, gb = cast(BlockGranularity, granularity_a), cast(BlockGranularity, granularity_b)
    if (ga, gb) not in PAIRS:
        raise ValueError(
            f"block_scaled_mm does not multiply granularity {ga!r} by {gb!r}; accepted "
            f"pairs (granularity_a, granularity_b): {_pairs_text()}"
        )
    ta, tb = _check_operands(a, b)
    _check_scale("scale_a", scale_a, ga, ta)
    _check_scale("scale_b", scale_b, gb, tb)
    _check_bias_and_out(bias, out_dtype, ta, tb)
    return ga, gb


def block_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    granularity_a: BlockGranularity,
    scale_b: torch.Tensor,
    granularity_b: BlockGranularity,
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
    out: torch.Tensor = registry.fp8_block_scaled_mm(
        a, b, scale_a, ga, scale_b, gb, bias, out_dtype, chosen.value
    )
    return out


# ---------------------------------------------------------------------------------------
# The twin.


# ---------------------------------------------------------------------------------------
# The operator.


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: Fp8Backend,
) -> torch.Tensor:
    """``(a * step_a) @ (b * step_b).T (+ bias)`` with float32 accumulation.

    ``a`` is ``[M, K]`` and ``b`` is ``[N, K]``, each E4M3 or E5M2 (they may differ), any
    strides (``.t()`` views work); ``bias`` is ``[N]`` (bf16/fp16/fp32) or None; the result
    is a new ``[M, N]`` tensor of ``out_dtype`` (bf16, fp16 or fp32).
    """
    _check_operands(a, b)
    sa = scalar_arg("step_a", step_a, a.device)
    sb = scalar_arg("step_b", step_b, a.device)
    _check_bias_and_out(bias, out_dtype, a, b)
    chosen = check_backend(backend, a)
    out: torch.Tensor = registry.fp8_scaled_mm(a, b, sa, sb, bias, out_dtype, chosen.value)
    return out
