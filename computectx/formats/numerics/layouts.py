"""The one granularity vocabulary, and block layouts: which elements share one fp8 step.

Three words name a granularity, each for its own reader:

- ``PolicyGranularity`` (``computectx.recipes``, in the core): what a user chooses for a
  layer, ``"tensor"``, ``"row"``, ``"block"`` or ``"mx"``;
- ``Granularity``: what one *operand* is scaled at, ``"tensor"`` or a ``BlockGranularity``;
- ``BlockGranularity``: the operand granularities that carry a scale tensor, ``"row"``,
  ``"1x128"``, ``"128x128"``, ``"mx"`` (what ``block_scaled_mm`` and the block quantize take).

``OPERAND_GRANULARITY`` maps a policy's choice to its ``(activation, weight)`` operands
(``"block"`` is DeepSeek-V3's ``1x128`` activations with ``128x128`` weights); ``PAIRS`` lists
the operand pairs the block GEMM multiplies. ``layout_of`` gives an operand's block grid and
scale shape (``numerics.blockwise``'s docstring tabulates them); ``StepRule`` says how a block's
amax becomes its step. Nothing here touches data: these are the shapes every room agrees on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal, get_args

import torch

from computectx.recipes import PolicyGranularity, Recipe

__all__ = [
    "BLOCK_GRANULARITIES",
    "E8M0",
    "GRANULARITIES",
    "MX_BLOCK",
    "OPERAND_GRANULARITY",
    "PAIRS",
    "TILE",
    "BlockGranularity",
    "BlockLayout",
    "Granularity",
    "MxRounding",
    "StepRule",
    "block_shape",
    "block_width",
    "check_granularity_widths",
    "check_scale",
    "granularity_arg",
    "layout_of",
    "scale_grid",
    "step_rule",
    "step_rule_of",
]

BlockGranularity = Literal["row", "1x128", "128x128", "mx"]
"""An operand granularity with a scale tensor: what ``block_scaled_mm`` and the block quantize
take."""
BLOCK_GRANULARITIES: Final[tuple[BlockGranularity, ...]] = get_args(BlockGranularity)
"""Every ``BlockGranularity``, in order."""
Granularity = Literal["tensor", BlockGranularity]
"""Which elements of one operand share one step: the whole tensor, or blocks."""
GRANULARITIES: Final[tuple[Granularity, ...]] = get_args(Granularity)
"""Every ``Granularity``, in order: ``"tensor"`` first."""


MxRounding = Literal["floor", "rceil"]
"""How an MX block's E8M0 exponent is chosen: ``"rceil"`` (default) or ``"floor"`` (OCP)."""


StepRule = Literal["amax", "pow2", "mx_floor", "mx_rceil"]
"""How a block's amax becomes its step; see the module docstring."""


TILE: Final[int] = 128
"""The side of the ``1x128`` and ``128x128`` blocks."""


MX_BLOCK: Final[int] = 32
"""Elements per MX block (along K)."""


E8M0: Final[torch.dtype] = torch.float8_e8m0fnu
"""The dtype of MX scales: an unsigned 8-bit exponent, ``2**(byte - 127)``, 255 is NaN."""


@dataclass(frozen=True)
class BlockLayout:
    """How a block granularity tiles a tensor: its 2-D view, the block, and the scale."""

    granularity: Granularity
    rows: int
    """Rows of the 2-D view: the product of every dimension but the last."""
    cols: int
    """K, the last dimension."""
    block_rows: int
    block_cols: int
    """Block width along K (``row``: the whole row, at least 1)."""
    grid: tuple[int, int]
    """The scale as a 2-D grid: ``(ceil(rows / block_rows), ceil(cols / block_cols))``, one
    column for ``row`` (even when ``K == 0``)."""
    scale_shape: tuple[int, ...]
    """The shape of the scale tensor ``quantize_tensor`` returns (the leading dims kept)."""

    @property
    def scale_dtype(self) -> torch.dtype:
        """``float8_e8m0fnu`` for ``mx``, else float32."""
        return E8M0 if self.granularity == "mx" else torch.float32


def layout_of(granularity: Granularity, shape: tuple[int, ...] | torch.Size) -> BlockLayout:
    """The layout of a block ``granularity`` (not ``"tensor"``) over a tensor of ``shape``.

    Raises ``ValueError`` naming the shape and the granularity when it cannot serve the
    shape: fewer than 2 dimensions, ``128x128`` on more than 2, ``mx`` with ``K < 32``.
    """
    dims = tuple(int(d) for d in shape)
    if granularity == "tensor" or granularity not in GRANULARITIES:
        raise ValueError(f"no block layout for granularity {granularity!r}")
    if len(dims) < 2:
        raise ValueError(
            f"granularity {granularity!r} scales the rows of a tensor of at least 2 dimensions "
            f"(..., K); got shape {dims}. Use granularity='tensor', or reshape to (rows, K)"
        )
    if granularity == "128x128" and len(dims) != 2:
        raise ValueError(
            f"granularity '128x128' blocks a 2-D (rows, K) tensor (a weight); got shape {dims}"
        )
    k = dims[-1]
    if granularity == "mx" and k < MX_BLOCK:
        raise ValueError(
            f"granularity 'mx' needs K (the last dimension) >= {MX_BLOCK}, one MX block; got "
            f"shape {dims}"
        )
    rows = math.prod(dims[:-1])
    block_rows, block_cols = block_shape(granularity, k)
    grid = scale_grid(granularity, rows, k)
    scale_shape = grid if block_rows == TILE else (*dims[:-1], grid[1])
    return BlockLayout(granularity, rows, k, block_rows, block_cols, grid, scale_shape)


# The fixed blocks, (rows, K columns); a row's block is the whole row.
_BLOCKS: Final[dict[str, tuple[int, int]]] = {
    "1x128": (1, TILE),
    "128x128": (TILE, TILE),
    "mx": (1, MX_BLOCK),
}


def block_shape(granularity: Granularity, k: int) -> tuple[int, int]:
    """``(block rows, block width along K)`` of a block granularity over a K-wide tensor:
    ``row`` ``(1, max(K, 1))``, ``1x128`` ``(1, 128)``, ``128x128`` ``(128, 128)``, ``mx``
    ``(1, 32)``. The one table of block shapes (``layout_of`` and the block GEMM read it)."""
    return (1, max(k, 1)) if granularity == "row" else _BLOCKS[granularity]


def scale_grid(granularity: Granularity, rows: int, k: int) -> tuple[int, int]:
    """The scale of a 2-D ``rows x K`` operand as a grid: ``(ceil(rows / block rows),
    ceil(K / block width))``, one column for ``row``. Integer arithmetic only, so a fake
    implementation can call it with symbolic sizes; unchecked (``layout_of`` checks)."""
    if granularity == "row":
        return (rows, 1)
    block_rows, block_cols = _BLOCKS[granularity]
    return (-(-rows // block_rows), -(-k // block_cols))


def check_granularity_widths(
    granularity: PolicyGranularity, in_features: int, out_features: int
) -> None:
    """Raise ``ValueError`` unless a layer of these widths can run ``granularity``'s blocks.

    ``mx`` needs both widths to be multiples of ``MX_BLOCK`` (32): each is the contraction
    of one GEMM (``in_features`` the forward's, ``out_features`` the dgrad's), and an MX
    element block is 32 wide. This is computectx's rule, as torchao's (``MXTensor.to_mx``
    asserts a last dimension divisible by 32), not a backend limit: the GEMMs would run a
    ragged contraction as they run the wgrad's (the token count M, any value), as a partial
    last block zero-padded to whole blocks where cuBLAS needs them, which is exact. Keeping
    the weight's own widths whole keeps every weight block a full MX block. ``tensor``,
    ``row`` and ``block`` run every width ``check_fp8_widths`` accepts (``block`` has
    partial 128-wide blocks at ragged edges). ``QuantizedLinear`` raises this error,
    ``convert_to_quantized`` records its message as the reason it skipped a layer, and an
    ``autocast`` region runs such a linear unchanged (in high precision).
    """
    if granularity == "mx" and (in_features % MX_BLOCK or out_features % MX_BLOCK):
        raise ValueError(
            f"in_features={in_features}, out_features={out_features}: granularity 'mx' needs "
            f"both to be multiples of {MX_BLOCK} (whole 1x{MX_BLOCK} blocks along each GEMM's "
            f"contraction); use granularity 'block' or 'row' for this layer"
        )


def check_scale(scale: object, layout: BlockLayout, device: torch.device, who: str) -> torch.Tensor:
    """``scale`` itself when it is ``layout``'s scale (dtype, shape) on ``device``; else
    ``TypeError`` (not a tensor) or ``ValueError`` naming ``who``, what it got and what is
    accepted."""
    want = f"a {layout.scale_dtype} tensor of shape {layout.scale_shape} on {device}"
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{who} is {want}, got {type(scale).__name__}")
    if (
        scale.dtype != layout.scale_dtype
        or tuple(scale.shape) != layout.scale_shape
        or scale.device != device
    ):
        raise ValueError(
            f"{who} is {want}; got {scale.dtype}, shape {tuple(scale.shape)} on {scale.device}"
        )
    return scale


PAIRS: Final[tuple[tuple[BlockGranularity, BlockGranularity], ...]] = (
    ("row", "row"),
    ("1x128", "1x128"),
    ("1x128", "128x128"),
    ("128x128", "1x128"),
    ("mx", "mx"),
)
"""The ``(granularity_a, granularity_b)`` pairs ``block_scaled_mm`` accepts."""


def block_width(granularity: BlockGranularity, k: int) -> int:
    """The width along K of one scale block: 128, or 32 for ``mx``, or K for ``row``
    (``block_shape``)."""
    return block_shape(granularity, k)[1]


OPERAND_GRANULARITY: dict[PolicyGranularity, tuple[BlockGranularity, BlockGranularity]] = {
    "row": ("row", "row"),
    "block": ("1x128", "128x128"),
    "mx": ("mx", "mx"),
}
"""A policy granularity's blocks: ``(activation, weight)``. Activations, output gradients
and every transposed operand take the first; the forward's weight the second."""


def step_rule_of(policy: Recipe) -> StepRule:
    """How ``policy``'s blocks turn their amax into a step (``StepRule``)."""
    if policy.granularity == "mx":
        return "mx_floor" if policy.mx_rounding == "floor" else "mx_rceil"
    return "pow2" if policy.power_of_two else "amax"


def granularity_arg(granularity: object) -> Granularity:
    """``granularity`` if it is one of ``GRANULARITIES``; else ``ValueError`` listing them."""
    if isinstance(granularity, str) and granularity in GRANULARITIES:
        return granularity
    accepted = ", ".join(repr(g) for g in GRANULARITIES)
    raise ValueError(f"unknown granularity {granularity!r}; accepted: {accepted}")


def step_rule(
    granularity: Granularity, power_of_two: object, mx_rounding: object, *, given: bool
) -> StepRule:
    """The step rule the options ask for (``numerics.layouts.StepRule``), or ``ValueError``
    saying which option does not apply.

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
