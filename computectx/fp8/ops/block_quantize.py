"""Block-wise fp8 quantize behind ``fp8_quantize(..., granularity=)``: checks and dispatch.

``computectx.fp8.ops.quantize`` checks the tensor and the format and calls here for the
block granularities (``row``, ``1x128``, ``128x128``, ``mx``). This module checks the options
(``power_of_two``, ``mx_rounding``, a given scale's shape), reads the tensor as its 2-D view,
and runs the Triton kernels (``computectx.fp8.ops.triton``) or their pure-torch twins
(``computectx.fp8.numerics.blockwise``), which give the same bytes. ``dequantize_blocks``
finds the granularity from the scale's shape and dtype. The layouts and the step rules are
documented in ``computectx.fp8.numerics.layouts`` and ``numerics.blockwise``.
"""

from __future__ import annotations

from typing import TypeGuard, cast

import torch

from computectx.dtypes import Fp8Format
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.numerics import blockwise, layouts
from computectx.fp8.numerics.layouts import (
    BLOCK_GRANULARITIES,
    E8M0,
    BlockLayout,
    Granularity,
    StepRule,
)
from computectx.fp8.ops import triton

__all__ = ["dequantize_blocks", "is_block_scale", "quantize_blocks", "step_rule"]


def step_rule(
    granularity: Granularity, power_of_two: object, mx_rounding: object, *, given: bool
) -> StepRule:
    """The step rule the options ask for (``numerics.layouts.StepRule``), or ``ValueError`` saying
    which option does not apply.

    ``power_of_two=None`` is the granularity's default: on for ``row`` (as torchao's
    row-wise recipe), off for ``tensor``, ``1x128`` and ``128x128``; ``mx`` steps are
    always powers of two, so ``False`` is refused there. ``mx_rounding`` (``"rceil"`` by
    default, or ``"floor"``) applies to ``mx`` only. Neither applies to a given scale
    (``given``), which is used as is.
    """
    if power_of_two is not None and not isinstance(power_of_two, bool):
        raise TypeError(f"power_of_two must be a bool or None, got {power_of_two!r}")
    if mx_rounding not in (None, "floor", "rceil"):
        raise ValueError(f"unknown mx_rounding {mx_rounding!r}; accepted: 'rceil', 'floor'")
    if given and (power_of_two is not None or mx_rounding is not None):
        raise ValueError(
            "power_of_two and mx_rounding choose how a measured step is rounded; a given "
            "scale is used as is, so pass scale=None or neither option"
        )
    if granularity == "mx":
        if power_of_two is False:
            raise ValueError(
                "granularity 'mx' has E8M0 scales, always powers of two; power_of_two=False "
                "cannot apply (choose the exponent's rounding with mx_rounding)"
            )
        return "mx_floor" if mx_rounding == "floor" else "mx_rceil"
    if mx_rounding is not None:
        raise ValueError(
            f"mx_rounding applies to granularity 'mx' only, not {granularity!r}; for a "
            f"power-of-two step pass power_of_two=True"
        )
    default = granularity == "row"
    return "pow2" if (default if power_of_two is None else power_of_two) else "amax"


def _scale_arg(scale: object, layout: BlockLayout, device: torch.device) -> torch.Tensor:
    who = f"the scale of granularity {layout.granularity!r} (one step per block)"
    scale = layouts.check_scale(scale, layout, device, who)
    # Contiguous: the kernels index the grid row-major (a transposed view of a valid scale
    # is the same values in another layout).
    return scale.reshape(layout.grid).contiguous()


def quantize_blocks(
    x: torch.Tensor,
    fmt: Fp8Format,
    granularity: Granularity,
    rule: StepRule,
    scale: object,
    *,
    backend: Fp8Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` for a block ``granularity``: ``data`` has ``x``'s shape (contiguous),
    ``scale`` the layout's ``scale_shape`` (the given one when ``scale`` is not None).

    ``x`` is a checked bf16/fp16/fp32 tensor of any strides: the kernels read a transposed
    view (``x.t()``, the column-wise quantize the backward needs) without a copy.
    """
    layout = layouts.layout_of(granularity, x.shape)
    given = None if scale is None else _scale_arg(scale, layout, x.device)
    x2 = x.reshape(layout.rows, layout.cols)  # a 2-D x (or its .t()) is used as it is
    if triton.uses_kernels(backend, x):
        q, s = triton.quantize_blocks(
            x=x2,
            fp8=fmt.torch,
            block_rows=layout.block_rows,
            block_cols=None if granularity == "row" else layout.block_cols,
            rule=rule,
            scale=given,
        )
    else:
        q, s = blockwise.quantize(x2, fmt, layout, rule, given)
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
    """Whether ``fp8_dequantize`` reads ``scale`` as per-block (an E8M0 tensor, or a tensor
    of more than one element) rather than as the one per-tensor step."""
    return isinstance(scale, torch.Tensor) and (scale.dtype == E8M0 or scale.numel() != 1)
