"""The block-wise fp8 operators: one step per block (``row``, ``1x128``, ``128x128``, ``mx``).

======================================  =========================================================
operator                                semantics
======================================  =========================================================
``fp8_quantize_blocks``                 quantize in blocks: codes, scale, largest step, count
``fp8_block_scaled_mm``                 the block-scaled GEMM, every granularity pair
======================================  =========================================================

Each is a ``torch.library`` custom op with a fake (one opaque node in a compiled graph; a
``128x128``/``mx`` scale never meets Inductor's CPU code generator, which has no
``float8_e8m0fnu``). The operator's signature is its argument list's one spelling: the
Triton kernels (``computectx.kernels.quantize_blocks``, ``kernels.scaled_mm_blocks``) and
cuBLAS's recipes (``computectx.kernels.cublas``; ``cublas_recipes`` says which run here) are
called with its keywords, the twins (``computectx.formats.numerics.blockwise``) with its
values; the GEMM's twin and its error bound take the one ``BlockGemmArgs`` the operator
builds.

The checked entry points: ``quantize_blocks``/``dequantize_blocks`` (the layouts and step
rules of ``numerics.layouts``), ``block_scaled_mm`` (its table of accepted pairs, semantics
and error bound are ``numerics.blockwise``'s), and the standalone API over every
granularity, ``quantize_tensor``/``quantize_granular``/``dequantize_tensor`` (``"tensor"`` is
``ops.tensorwise``'s). Anything not accepted is a ``ValueError`` naming the value and what
is accepted; nothing runs.

Backends: ``REFERENCE`` runs the twins; ``TRITON`` the kernels; ``CUBLAS`` quantizes as
``TRITON`` on a GPU where triton imports, as ``REFERENCE`` elsewhere, and runs the GEMM on
``torch._scaled_mm``/``F.scaled_mm`` where cuBLAS serves the pair, else on the kernel (a GPU
with triton) or the twin, on the same device; it never raises for a valid call.
"""

from __future__ import annotations

from typing import TypeGuard, cast

import torch
from torch.library import custom_op

from computectx.dtypes import FP8_DTYPES, DType, Fp8Format
from computectx.formats.backend import (
    Backend,
    check_backend,
    check_bias_and_out,
    check_gemm_operands,
    default_backend,
    fmt_arg,
    parse_backend,
    quantizable_arg,
    scalar_arg,
    uses_kernels,
)
from computectx.formats.numerics import blockwise, layouts, tensorwise
from computectx.formats.numerics.layouts import (
    BLOCK_GRANULARITIES,
    E8M0,
    PAIRS,
    BlockGranularity,
    BlockLayout,
    Granularity,
    MxRounding,
    StepRule,
)
from computectx.formats.numerics.tensorwise import FORMAT_OF, FORMATS
from computectx.formats.ops import tensorwise as tensor_ops

__all__ = [
    "Quantized",
    "block_scaled_mm",
    "check_args",
    "cublas_recipes",
    "dequantize_blocks",
    "dequantize_tensor",
    "fp8_block_scaled_mm",
    "fp8_quantize_blocks",
    "is_block_scale",
    "quantize_blocks",
    "quantize_granular",
    "quantize_tensor",
]

Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(codes, scale, largest step, saturated count)``: what the block quantize operator returns."""

_BACKENDS = {b.value: b for b in Backend}
# An operator's backend argument is a member's value (the checked entry points pass
# `b.value`): looked up here, with parse_backend for any other spelling and its error.


# ---------------------------------------------------------------------------------------
# The operators.


def _quantize_kernel(
    x: torch.Tensor,
    fmt: Fp8Format,
    layout: BlockLayout,
    rule: StepRule,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The 2-D view `x` of a layout on the kernel: the twin's bytes (blockwise.quantize).
    # Its callers run the twin on REFERENCE without asking uses_kernels (the call then
    # goes from the layout to the twin and never into backend.py).
    from computectx.kernels import quantize_blocks as kernel

    cols = None if layout.granularity == "row" else layout.block_cols
    return kernel.quantize_blocks(
        x=x,
        fp8=FORMATS[fmt].dtype,
        block_rows=layout.block_rows,
        block_cols=cols,
        rule=rule,
        scale=scale,
    )


@custom_op("computectx::fp8_quantize_blocks", mutates_args=())
def fp8_quantize_blocks(
    x: torch.Tensor,
    fp8: torch.dtype,
    granularity: str,
    rule: str,
    backend: str,
    count_saturated: bool,
) -> Quantized:
    """The linear's block quantize of a 2-D ``x`` as one operator: the codes and scale, the
    largest block step (float32 ``(1,)``) and, when ``count_saturated``, how many elements
    saturated (``numerics.blockwise.saturated_count``, float32 ``(1,)``; 0 otherwise)."""
    fmt = FORMAT_OF.get(fp8) or Fp8Format.parse(fp8)
    chosen = _BACKENDS.get(backend) or parse_backend(backend)
    # x is 2-D: its layout's 2-D view is x itself, and the scale is shaped as its grid.
    layout = layouts.layout_of(cast(BlockGranularity, granularity), x.shape)
    r = cast(StepRule, rule)
    if chosen is Backend.REFERENCE or not uses_kernels(chosen, x):
        q, s = blockwise.quantize(x, fmt, layout, r, None)
    else:
        q, s = _quantize_kernel(x, fmt, layout, r, None)
    if count_saturated:
        saturated = blockwise.saturated_count(x, fmt, s, layout)
    else:
        saturated = torch.zeros(1, dtype=torch.float32, device=x.device)
    return q, s, blockwise.steps_of_scale(s).amax().reshape(1), saturated


@fp8_quantize_blocks.register_fake
def _quantize_blocks_fake(
    x: torch.Tensor, fp8: torch.dtype, granularity: str, *_: object
) -> Quantized:
    rows, k = x.shape  # 2-D here; layouts.layout_of's scale shape, symbolically
    grid = layouts.scale_grid(cast(BlockGranularity, granularity), rows, k)
    scale = x.new_empty(grid, dtype=E8M0 if granularity == "mx" else torch.float32)
    one = x.new_empty(1, dtype=torch.float32)
    return x.new_empty(x.shape, dtype=fp8), scale, one, torch.empty_like(one)


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
    """``block_scaled_mm`` on a checked call: the twin, cuBLAS or the kernel."""
    chosen = _BACKENDS.get(backend) or parse_backend(backend)
    ga, gb = cast(BlockGranularity, granularity_a), cast(BlockGranularity, granularity_b)
    args = blockwise.BlockGemmArgs(a, b, scale_a, ga, scale_b, gb, bias, out_dtype)
    if chosen is Backend.CUBLAS:
        from computectx.kernels import cublas

        if cublas.serves(ga, gb, a, b, bias, out_dtype):
            return cublas.scaled_mm(**vars(args))
    if chosen is Backend.REFERENCE or not uses_kernels(chosen, a):
        return blockwise.reference_scaled_mm(args)
    from computectx.kernels import scaled_mm_blocks as kernel

    # The kernel takes the same keywords with the granularities as block shapes.
    kept = {k: v for k, v in vars(args).items() if k not in ("granularity_a", "granularity_b")}
    return kernel.scaled_mm_blocks(
        **kept,
        block_rows_a=layouts.TILE if ga == "128x128" else 1,
        block_rows_b=layouts.TILE if gb == "128x128" else 1,
        block_k=layouts.block_width(ga, a.shape[1]) if ga != "row" else 0,
    )


@fp8_block_scaled_mm.register_fake
def _block_scaled_mm_fake(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
    # The output is (M, N) at out_dtype, the last but one argument.
    return a.new_empty((a.shape[0], b.shape[0]), dtype=cast(torch.dtype, rest[-2]))


def cublas_recipes(device: torch.device) -> dict[str, tuple[bool, str]]:
    """Which cuBLAS recipes run on ``device`` (``computectx.kernels.cublas.cublas_recipes``:
    name -> ``(runs, reason)``, probed once per device)."""
    from computectx.kernels import cublas

    return cublas.cublas_recipes(device)


# ---------------------------------------------------------------------------------------
# The checked entry points.


def quantize_blocks(
    x: torch.Tensor,
    fmt: Fp8Format,
    granularity: Granularity,
    rule: StepRule,
    scale: object,
    *,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` for a block ``granularity``: ``data`` has ``x``'s shape (contiguous),
    ``scale`` the layout's ``scale_shape`` (the given one when ``scale`` is not None).

    ``x`` is a checked bf16/fp16/fp32 tensor of any strides: the kernels read a transposed
    view (``x.t()``, the column-wise quantize the backward needs) without a copy.
    """
    layout = layouts.layout_of(granularity, x.shape)
    given = None
    if scale is not None:
        who = f"the scale of granularity {layout.granularity!r} (one step per block)"
        # Contiguous: the kernels index the grid row-major (a transposed view of a valid
        # scale is the same values in another layout).
        given = layouts.check_scale(scale, layout, x.device, who).reshape(layout.grid)
        given = given.contiguous()
    x2 = x.reshape(layout.rows, layout.cols)  # a 2-D x (or its .t()) is used as it is
    if backend is Backend.REFERENCE or not uses_kernels(backend, x2):
        q, s = blockwise.quantize(x2, fmt, layout, rule, given)
    else:
        q, s = _quantize_kernel(x2, fmt, layout, rule, given)
    if given is not None:
        return q.reshape(x.shape), cast(torch.Tensor, scale)  # checked: the given tensor
    return q.reshape(x.shape), s.reshape(layout.scale_shape)


def _layout_of_scale(data: torch.Tensor, scale: torch.Tensor) -> BlockLayout:
    shape = tuple(data.shape)
    served = []
    for g in BLOCK_GRANULARITIES:
        try:
            layout = layouts.layout_of(g, shape)
        except ValueError:
            continue
        served.append(f"{g}: {layout.scale_dtype} {layout.scale_shape}")
        if layout.scale_dtype == scale.dtype and layout.scale_shape == tuple(scale.shape):
            return layout
    accepted = "; ".join(["tensor: torch.float32 (1,)", *served])
    raise ValueError(
        f"a {scale.dtype} scale of shape {tuple(scale.shape)} matches no granularity of data "
        f"of shape {shape}; accepted: {accepted}"
    )


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * step`` of each element's block, rounded once to ``dtype``.

    The granularity is the one whose scale has ``scale``'s shape and dtype for ``data``'s
    shape (``row`` and ``1x128`` coincide when ``K <= 128``, as their steps do).
    """
    if scale.device != data.device:
        raise ValueError(f"scale is on {scale.device} but the data is on {data.device}")
    layout = _layout_of_scale(data, scale)
    d2 = data.reshape(layout.rows, layout.cols)
    return blockwise.dequantize(d2, scale, layout, dtype).reshape(data.shape)


def is_block_scale(scale: object) -> TypeGuard[torch.Tensor]:
    """Whether ``dequantize_tensor`` reads ``scale`` as per-block (an E8M0 tensor, or a tensor
    of more than one element) rather than as the one per-tensor step."""
    return isinstance(scale, torch.Tensor) and (scale.dtype == E8M0 or scale.numel() != 1)


def _pairs_text() -> str:
    return ", ".join(f"({a!r}, {b!r})" for a, b in PAIRS)


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
    ta, tb = check_gemm_operands(a, b)
    check_bias_and_out(bias, out_dtype, ta, tb)
    for name, scale, g, t in (("scale_a", scale_a, ga, ta), ("scale_b", scale_b, gb, tb)):
        layout = layouts.layout_of(g, t.shape)  # ValueError for mx with K < 32
        who = f"{name} for granularity {g!r} of an operand of shape {tuple(t.shape)}"
        layouts.check_scale(scale, layout, t.device, who)
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
    backend: Backend | str = Backend.REFERENCE,
) -> torch.Tensor:
    """``(a * steps_a) @ (b * steps_b).T (+ bias)`` as a new ``[M, N]`` ``out_dtype`` tensor.

    ``a [M, K]`` and ``b [N, K]`` are fp8 codes (E4M3 or E5M2, any strides) with the scales
    ``quantize_tensor(..., granularity=)`` returned for them (``numerics.blockwise``'s table);
    ``bias`` is ``[N]`` (bf16/fp16/fp32) or None; ``out_dtype`` is bf16, fp16 or fp32. The
    pair of granularities must be one of ``PAIRS``; the semantics and the error bound are
    ``numerics.blockwise``'s. ``backend`` (a ``Backend`` or its name, ``"triton"``) runs
    it; ``ValueError`` saying why (the capability probe's reason: no CUDA device and no
    ``TRITON_INTERPRET=1``, triton not installed, no fp8 tensor cores) when it cannot run on
    the tensors' device.
    """
    ga, gb = check_args(a, b, scale_a, granularity_a, scale_b, granularity_b, bias, out_dtype)
    chosen = check_backend(parse_backend(backend) if isinstance(backend, str) else backend, a)
    out: torch.Tensor = fp8_block_scaled_mm(
        a, b, scale_a, ga, scale_b, gb, bias, out_dtype, chosen.value
    )
    return out


# ---------------------------------------------------------------------------------------
# The standalone API, every granularity ("tensor" is ops.tensorwise's).


def _scale_arg(scale: object, device: torch.device) -> torch.Tensor:
    if isinstance(scale, bool):
        raise TypeError(f"scale must be a positive float or a float32 tensor, got {scale!r}")
    if isinstance(scale, (int, float)):
        value = float(scale)
        if not (value > 0.0 and value != float("inf")):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        # A fill on the device, not torch.tensor(..., device=...): no blocking host copy.
        return torch.full((1,), value, dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        return scalar_arg("scale", scale, device)
    raise TypeError(
        f"scale must be a positive float, a float32 tensor of one element or None, "
        f"got {type(scale).__name__}"
    )


def quantize_tensor(
    x: torch.Tensor,
    fmt: Fp8Format | str,
    scale: torch.Tensor | float | None = None,
    *,
    granularity: Granularity = "tensor",
    power_of_two: bool | None = None,
    mx_rounding: MxRounding | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to fp8: returns ``(data, scale)`` with ``x ≈ data.float() * scale``.

    ``scale`` is the dequantize step: ``data = fp8(clamp(x / scale))`` and
    ``x ≈ data * scale``, the factor ``torch._scaled_mm`` takes as ``scale_a``/``scale_b``.
    torchao's and TransformerEngine's ``scale`` is its reciprocal (``data = x * scale``):
    pass ``scale=1 / their_scale`` (docs/migrating.md).

    ``fmt`` is an ``Fp8Format`` or its name (``"e4m3"``, ``"fp8_e5m2"``, ...). ``scale=None``
    measures ``amax(x)`` and uses ``scale = amax / fmt.max`` (dynamic scaling, margin 0; 1.0
    for an all-zero or non-finite input); a given scale (positive float, or float32 tensor
    of one element on ``x``'s device, whose value is not inspected) is used as is and
    returned as a tensor. Values beyond ``fmt.max * scale`` saturate; NaN stays NaN.
    The backend is ``select_backend(x.device)``'s choice.

    ``granularity`` (``"tensor"``, ``"row"``, ``"1x128"``, ``"128x128"``, ``"mx"``) gives
    each block of ``x`` its own step; ``scale`` then has one step per block (documented
    shape, float32; ``float8_e8m0fnu`` for ``"mx"``), measured or given. ``power_of_two``
    rounds measured steps up to powers of two (default: on for ``"row"`` only);
    ``mx_rounding`` picks the MX exponent rule (``"rceil"``, the default, or ``"floor"``).
    See ``computectx.formats.numerics.blockwise`` and docs/fp8.md, "Fine-grained scaling".
    """
    data = quantizable_arg(x)
    return quantize_granular(
        data,
        fmt,
        granularity,
        scale,
        power_of_two=power_of_two,
        mx_rounding=mx_rounding,
        backend=default_backend(data.device),
    )


def quantize_granular(
    x: torch.Tensor,
    fmt: Fp8Format | str,
    granularity: Granularity = "tensor",
    scale: torch.Tensor | float | None = None,
    *,
    power_of_two: bool | None = None,
    mx_rounding: MxRounding | None = None,
    columnwise: bool = False,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tensor`` on a given backend: ``(data, scale)``.

    ``columnwise=True`` quantizes ``x.t()`` of a 2-D ``x`` (``data`` is ``[K, rows]``,
    contiguous, its blocks run along ``x``'s columns): the operand a backward GEMM that
    contracts over ``x``'s rows needs. The kernels read the transpose in place.
    """
    data = quantizable_arg(x)
    f = fmt_arg(fmt)
    g = layouts.granularity_arg(granularity)
    rule = layouts.step_rule(g, power_of_two, mx_rounding, given=scale is not None)
    if not isinstance(columnwise, bool):
        raise TypeError(f"columnwise must be a bool, got {columnwise!r}")
    if columnwise:
        if data.dim() != 2:
            raise ValueError(
                f"columnwise quantizes the transpose of a 2-D tensor; got shape {tuple(data.shape)}"
            )
        data = data.t()
    b = check_backend(backend, data)
    if g != "tensor":
        return quantize_blocks(data, f, g, rule, scale, backend=b)
    data = data.contiguous()
    if scale is not None:
        step = _scale_arg(scale, data.device)
    elif rule == "pow2":
        step = blockwise.power_of_two_steps(tensorwise.step_from_amax(tensorwise.amax(data), f, 0))
    else:
        q, step, _ = tensor_ops.quantize_dynamic(data, f, 0, backend=b)
        return q, step
    q, _ = tensor_ops.quantize_with_step(data, f, step, backend=b)
    return q, step


def dequantize_tensor(
    data: torch.Tensor, scale: torch.Tensor | float, dtype: DType | torch.dtype | str
) -> torch.Tensor:
    """``data.float() * scale`` rounded once to ``dtype`` (a ``DType``, name or torch dtype).

    ``data`` must be an fp8 tensor; the product is formed in float32 (the precision the
    kernels dequantize in) and then rounded to ``dtype``. A per-block ``scale`` (from
    ``quantize_tensor(..., granularity=)``: more than one element, or E8M0) is broadcast
    back over its blocks; its shape and dtype say which granularity it is.
    """
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data must be an fp8 tensor, got {type(data).__name__}")
    if data.dtype not in FP8_DTYPES:
        raise ValueError(
            f"data must be float8_e4m3fn or float8_e5m2 (from quantize_tensor), got {data.dtype}"
        )
    target = DType.parse(dtype).torch
    if is_block_scale(scale):
        return dequantize_blocks(data, scale, target)
    out: torch.Tensor = tensor_ops.fp8_dequantize(data, _scale_arg(scale, data.device), target)
    return out
