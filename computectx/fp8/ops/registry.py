"""Every ``computectx::`` operator and its fake: the one registry of the package's operators.

Each operator is one opaque node in a compiled graph: dynamo does not trace into it,
AOTAutograd functionalizes it through its declared mutations (``mutates_args``), and its fake
implementation gives the output shapes without touching data. Eager calls run the same
Python function, on arguments the checked entry points (``computectx.fp8.ops.quantize``,
``computectx.fp8.ops.gemm``, ``computectx.fp8.serving.decode_attention``) have validated,
so bytes, bounds and the absence of host synchronisation are the same compiled or not.

Each function here is named as its operator: calling ``registry.fp8_scaled_mm`` calls
``torch.ops.computectx.fp8_scaled_mm``, and importing this module is what registers it (the
other modules call the functions here, never ``torch.ops.computectx`` by name). A new
operator (for MoE's grouped GEMMs, for the optimizer state) goes here, with its fake, and its
body calls an implementation in a sibling module (the twin in ``numerics``, a launcher in
``ops.triton`` or ``ops.cublas``).

======================================  =========================================================
operator                                semantics
======================================  =========================================================
``fp8_quantize_delayed``                quantize with the ledger's step, advance ledger and tally
``fp8_quantize_dynamic``                quantize with ``x``'s own step, record it in the ledger
``fp8_quantize_with_step``              quantize with a given step; also ``amax(x)``
``fp8_scaled_mm``                       ``(a * step_a) @ (b * step_b).T (+ bias)``
``fp8_dequantize``                      ``data * step`` rounded once to a dtype
``fp8_quantize_blocks``                 quantize in blocks: codes, scale, largest step, count
``fp8_block_scaled_mm``                 the block-scaled GEMM, every granularity pair
``wgrad_float32``                       ``dY^T X`` as an IEEE float32 matmul (``gw_hp``)
``fp8_decode_attention``                one decode step's attention over a (fp8) KV cache
``fp8_grouped_mm``                      each row group times its own matrix, in fp8
``fp8_grouped_wgrad``                   each group's ``dYᵀ X`` over its own rows, in fp8
======================================  =========================================================

The state the quantize operators advance lives in two device tensors per operand, both
declared mutated: the float32 ledger (``computectx.fp8.numerics.ledger``'s layout) and an
int64 *tally* ``[seeded, elements]``. Nothing is kept in Python attributes, so a compiled
step advances exactly what an eager step advances and no value is specialised into a guard.

None of these operators has an autograd formula of its own: gradients flow through the fp8
linear's ``autograd.Function`` (``computectx.fp8.linear.tensorwise``, ``linear.blockwise``),
which is written over them.
Calling one on a tensor that requires grad and then differentiating raises torch's
"no autograd formula" error rather than returning a wrong gradient.
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from torch.library import custom_op

from computectx.dtypes import Fp8Format
from computectx.fp8.backend import Fp8Backend, parse_backend
from computectx.fp8.numerics import blockwise, blockwise_gemm, layouts, tensorwise
from computectx.fp8.numerics.attention import decode_attention_reference
from computectx.fp8.numerics.layouts import E8M0, BlockGranularity, StepRule
from computectx.fp8.numerics.ledger import count, record
from computectx.fp8.ops import block_quantize, cublas, grouped, ledger_quantize, triton

__all__ = [
    "Quantized",
    "fp8_block_scaled_mm",
    "fp8_decode_attention",
    "fp8_dequantize",
    "fp8_grouped_mm",
    "fp8_grouped_wgrad",
    "fp8_quantize_blocks",
    "fp8_quantize_delayed",
    "fp8_quantize_dynamic",
    "fp8_quantize_with_step",
    "fp8_scaled_mm",
    "wgrad_float32",
]

Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(codes, scale, largest step, saturated count)``: what the block quantize operator returns."""


@custom_op("computectx::fp8_quantize_delayed", mutates_args=("ledger", "tally"))
def fp8_quantize_delayed(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    algo: str,
    margin: int,
    backend: str,
    may_seed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed scaling through one operand's ledger: ``delayed_call``'s ``(data_fp8,
    step_used)``. Arguments are checked by ``computectx.fp8.ops.quantize.quantize_operand``."""
    window: Literal["max", "most_recent"] = "max" if algo == "max" else "most_recent"
    return ledger_quantize.delayed_call(
        x, ledger, tally, Fp8Format.parse(fp8), window, margin, parse_backend(backend), may_seed
    )


@fp8_quantize_delayed.register_fake
def _quantize_delayed_fake(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    algo: str,
    margin: int,
    backend: str,
    may_seed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, dtype=fp8), ledger.new_empty(1)


@custom_op("computectx::fp8_quantize_dynamic", mutates_args=("ledger", "tally"))
def fp8_quantize_dynamic(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    margin: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic scaling through one operand's ledger: ``(data_fp8, step)``.

    The step comes from ``amax(x)``; the ledger records that amax in its last history slot
    (when finite; a non-finite one is counted instead) and the step; the tally counts ``x``.
    """
    q, step, a = ledger_quantize.quantize_dynamic_with(
        x, Fp8Format.parse(fp8), margin, parse_backend(backend)
    )
    record(ledger, a, step)
    count(tally, x)
    return q, step


@fp8_quantize_dynamic.register_fake
def _quantize_dynamic_fake(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    margin: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, dtype=fp8), ledger.new_empty(1)


@custom_op("computectx::fp8_quantize_with_step", mutates_args=())
def fp8_quantize_with_step(
    x: torch.Tensor, step: torch.Tensor, fp8: torch.dtype, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8(clamp(x / step)), amax(x))``: quantize with a given step (no state)."""
    b = parse_backend(backend)
    if triton.uses_kernels(b, x):
        return triton.quantize_with_step(x=x, fp8=fp8, step=step)
    return tensorwise.quantize_with_step(x, Fp8Format.parse(fp8), step)


@fp8_quantize_with_step.register_fake
def _quantize_with_step_fake(
    x: torch.Tensor, step: torch.Tensor, fp8: torch.dtype, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, dtype=fp8), step.new_empty(1)


@custom_op("computectx::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``(a * step_a) @ (b * step_b).T (+ bias)`` for fp8 ``a [M, K]``, ``b [N, K]``."""
    chosen = parse_backend(backend)
    if chosen is Fp8Backend.TRITON:
        return triton.scaled_mm(
            a=a, b=b, step_a=step_a, step_b=step_b, bias=bias, out_dtype=out_dtype
        )
    if chosen is Fp8Backend.CUBLAS:
        return cublas.tensorwise_scaled_mm(a, b, step_a, step_b, bias, out_dtype)
    return tensorwise.scaled_mm(a, b, step_a, step_b, bias, out_dtype)


@fp8_scaled_mm.register_fake
def _scaled_mm_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@custom_op("computectx::fp8_dequantize", mutates_args=())
def fp8_dequantize(data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * step`` formed in float32, rounded once to ``dtype``."""
    return tensorwise.dequantize(data, step, dtype)


@fp8_dequantize.register_fake
def _dequantize_fake(data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(data, dtype=dtype)


@custom_op("computectx::fp8_block_scaled_mm", mutates_args=())
def fp8_block_scaled_mm(
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
    ga, gb = cast(BlockGranularity, granularity_a), cast(BlockGranularity, granularity_b)
    chosen = parse_backend(backend)
    if chosen is Fp8Backend.REFERENCE:
        return blockwise_gemm.reference_scaled_mm(a, b, scale_a, ga, scale_b, gb, bias, out_dtype)
    return cublas.run(chosen, a, b, scale_a, ga, scale_b, gb, bias, out_dtype)


@fp8_block_scaled_mm.register_fake
def _block_scaled_mm_fake(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
    # The operator's arguments in its schema's order: the output is (M, N) at out_dtype, the
    # last but one; the scales, granularities, bias and backend do not shape it.
    out_dtype = cast(torch.dtype, rest[-2])
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@custom_op("computectx::fp8_quantize_blocks", mutates_args=())
def fp8_quantize_blocks(
    x: torch.Tensor,
    fp8: torch.dtype,
    granularity: str,
    rule: str,
    backend: str,
    count_saturated: bool,
) -> Quantized:
    """The linear's block quantize as one operator: ``block_quantize.quantize_blocks`` (the Triton
    kernel or the twin), the largest block step, float32 ``(1,)``, and, when
    ``count_saturated``, how many elements saturated
    (``numerics.blockwise.saturated_count``, float32
    ``(1,)``; 0 otherwise).

    Opaque to ``torch.compile``, as the per-tensor quantizes are: Inductor's CPU code
    generator has no ``float8_e8m0fnu``, so an mx scale must come out of an operator, and
    the only reader of it in the graph is ``block_scaled_mm``'s operator; the ledgers read
    the largest step and the count as float32.
    """
    fmt = Fp8Format.parse(fp8)
    g = cast(BlockGranularity, granularity)
    q, s = block_quantize.quantize_blocks(
        x, fmt, g, cast(StepRule, rule), None, backend=parse_backend(backend)
    )
    if count_saturated:
        layout = layouts.layout_of(g, x.shape)
        saturated = blockwise.saturated_count(x, fmt, s, layout)
    else:
        saturated = torch.zeros(1, dtype=torch.float32, device=x.device)
    return q, s, blockwise.steps_of_scale(s).amax().reshape(1), saturated


@fp8_quantize_blocks.register_fake
def _fp8_quantize_blocks_fake(
    x: torch.Tensor,
    fp8: torch.dtype,
    granularity: str,
    rule: str,
    backend: str,
    count_saturated: bool,
) -> Quantized:
    rows, k = x.shape  # 2-D here; layouts.layout_of's scale shape, symbolically
    grid = layouts.scale_grid(cast(BlockGranularity, granularity), rows, k)
    dtype = E8M0 if granularity == "mx" else torch.float32
    scale = x.new_empty(grid, dtype=dtype)
    one = x.new_empty(1, dtype=torch.float32)
    return x.new_empty(x.shape, dtype=fp8), scale, one, torch.empty_like(one)


@custom_op("computectx::wgrad_float32", mutates_args=())
def wgrad_float32(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``gw_hp``'s weight gradient ``dYᵀ X`` as an IEEE float32 matmul, whatever the process's
    TF32 setting: TF32 would round float32 activations to 10 significant bits, below the
    high precision the option promises (bf16 and fp16 values are exact in TF32 either way).

    cuBLAS reads the setting when the matmul is launched, and torch offers no per-call
    argument for it, so the operator sets ``torch.backends.cuda.matmul.fp32_precision`` to
    ``"ieee"`` around that one call and restores it: nothing leaks, but a float32 matmul
    another thread launches in that window also runs IEEE. An operator, so that
    ``torch.compile`` neither traces the setting (a graph break) nor drops it.
    """
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        return torch.mm(dy.to(torch.float32).t(), x.to(torch.float32))
    finally:
        matmul.fp32_precision = before


@wgrad_float32.register_fake
def _wgrad_float32_fake(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return dy.new_empty((dy.shape[1], x.shape[1]), dtype=torch.float32)


@custom_op("computectx::fp8_decode_attention", mutates_args=())
def fp8_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_step: torch.Tensor | None,
    v_step: torch.Tensor | None,
    length: torch.Tensor,
    sm_scale: float,
    block_t: int,
    backend: str,
) -> torch.Tensor:
    """``decode_attention`` on checked arguments (``length`` a ``(B,)`` tensor)."""
    chosen = parse_backend(backend)
    if triton.uses_kernels(chosen, q):
        return triton.decode_attention(
            q=q,
            k=k,
            v=v,
            k_step=k_step,
            v_step=v_step,
            length=length,
            sm_scale=sm_scale,
            block_t=block_t,
        )
    return decode_attention_reference(
        q, k, v, k_step, v_step, length, sm_scale=sm_scale, block_t=block_t
    )


@fp8_decode_attention.register_fake
def _decode_attention_fake(q: torch.Tensor, *_: object) -> torch.Tensor:
    # The operator's arguments in its schema's order; the output is shaped like q, at its
    # dtype, whatever the rest.
    return torch.empty_like(q)


@custom_op("computectx::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    granularity_a: str,
    granularity_b: str,
    fp8_a: torch.dtype,
    fp8_b: torch.dtype,
    rule: str,
    margin: int,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``ops.grouped.grouped_mm``: ``[M, N]``, group ``g``'s rows of ``a [M, K]`` times
    ``b[g]ᵀ`` (``b [E, N, K]``), each operand quantized dynamically at its granularity; the
    values of ``offs`` are checked here, so a compiled call checks them too."""
    return grouped.grouped_mm(
        a, b, offs,
        cast(layouts.Granularity, granularity_a), cast(layouts.Granularity, granularity_b),
        Fp8Format.parse(fp8_a), Fp8Format.parse(fp8_b), cast(StepRule, rule), margin,
        out_dtype, parse_backend(backend),
    )  # fmt: skip


@fp8_grouped_mm.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
    # The output is (M, N) at out_dtype, the last but one argument.
    return a.new_empty((a.shape[0], b.shape[1]), dtype=cast(torch.dtype, rest[-2]))


@custom_op("computectx::fp8_grouped_wgrad", mutates_args=())
def fp8_grouped_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    granularity: str,
    fp8_dy: torch.dtype,
    fp8_x: torch.dtype,
    rule: str,
    margin: int,
    high_precision: bool,
    backend: str,
) -> torch.Tensor:
    """``ops.grouped.grouped_wgrad``: float32 ``[E, N, K]``, ``dY[rows of g]ᵀ X[rows of g]``
    over each group's own rows (``high_precision``: ``gw_hp``'s float32 product)."""
    return grouped.grouped_wgrad(
        dy, x, offs, cast(layouts.Granularity, granularity), Fp8Format.parse(fp8_dy),
        Fp8Format.parse(fp8_x), cast(StepRule, rule), margin, high_precision,
        parse_backend(backend),
    )  # fmt: skip


@fp8_grouped_wgrad.register_fake
def _grouped_wgrad_fake(
    dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, *_: object
) -> torch.Tensor:
    return dy.new_empty((offs.shape[0], dy.shape[1], x.shape[1]), dtype=torch.float32)
