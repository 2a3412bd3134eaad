"""The checks of ``FrozenFp4Experts`` (``linear.fp4_frozen_experts``): the input, the
per-expert operands it is built from, the freeze's widths and a loaded ``_extra_state``;
each a ``TypeError``/``ValueError`` naming the value and what is accepted."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.linear.fp4_experts import Fp4Experts
from computectx.formats.linear.fp4_frozen import (
    FROZEN_FP4_VERSION,
    FROZEN_WEIGHT_CODES,
    frozen_weight_name,
)
from computectx.formats.linear.fp4_serving import check_weights
from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.formats.policy import describe

__all__ = ["check_experts", "check_input", "check_state", "check_width"]


def check_width(name: str, w: torch.Tensor, experts: Fp4Experts) -> None:
    """``ValueError`` naming ``name``, the expert and the block unless ``w [E, N, K]`` can be
    quantized at ``experts``' weight block (K a multiple of it, N of 16 for 16x16 tiles)."""
    how = experts.how
    tile = how.weight_tile if how.format == "nvfp4" else "1x32"
    rows = 16 if tile == "16x16" else 1
    e, n, k = w.shape
    if not k or k % how.block or n % rows:
        lines = f" and N a multiple of {rows}" if rows > 1 else ""
        raise ValueError(
            f"from_fp4_experts: {name!r} [E, N, K] = {(e, n, k)}: expert 0 (each of the {e}) "
            f"needs K > 0 a multiple of {how.block}{lines} ({how.format} {tile} blocks)"
        )


def check_input(x: object, offs: object, e: int, k: int, device: torch.device) -> None:
    """``x [M, k]`` (bf16, fp16, fp32) and int32 ``offs (e,)`` on ``device``, else
    ``TypeError``/``ValueError`` naming them (``offs``' values: ``checked_bounds``)."""
    who = "frozen 4-bit experts"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != k:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else describe(x)
        raise ValueError(f"{who} take x [M, {k}], got {got}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{who} take a bf16, fp16 or fp32 x, got {x.dtype}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.shape != (e,):
        what = (
            f"{offs.dtype} {tuple(offs.shape)}"
            if isinstance(offs, torch.Tensor)
            else describe(offs)
        )
        raise ValueError(f"{who}: offs must be int32 ({e},), one end row per expert, got {what}")
    if not (x.device == offs.device == device):
        raise ValueError(
            f"{who}: x, offs and the held weights must be on one device, got {x.device}, "
            f"{offs.device}, {device}"
        )


def check_experts(name: str, ops: object, who: str) -> tuple[str, str]:
    """The ``(operand type, tile)`` of ``name``'s per-expert operands, each checked
    (``check_weight``; their values in one host read, ``check_weights``), all of one format,
    tile, shape and device."""
    if not isinstance(ops, Sequence) or not ops:
        raise TypeError(
            f"{who}: {name!r} must be a non-empty sequence of per-expert operands, got "
            f"{describe(ops)}"
        )
    check_weights([(q, f"{who}: {name!r} expert {e}") for e, q in enumerate(ops)])
    kinds = {(type(q).__name__, q.tile if isinstance(q, Nvfp4Operand) else "1x32") for q in ops}
    shapes = {(q.codes.shape, q.scale.shape, q.codes.device) for q in ops}
    if len(kinds) != 1 or len(shapes) != 1:
        raise ValueError(f"{who}: {name!r}'s experts must share one format, tile, shape and device")
    return kinds.pop()


def check_state(state: object, code: int, where: str, prefix: str) -> None:
    """``ValueError`` unless ``state`` is a frozen ``_extra_state`` ``[version, code]``."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.int64 or state.dim() != 1:
        raise ValueError(f"{where}: {prefix}_extra_state must be int64 [version, weight code]")
    if state.numel() == 5:
        raise ValueError(
            f"{where}: {prefix}_extra_state holds a 4-bit training state (Fp4Experts' "
            f"[version, recipe, seed, counter, stream]): load that checkpoint into the unfrozen "
            f"model, then freeze (freeze_fp4_for_serving)"
        )
    if state.numel() != 2 or state.is_meta:
        raise ValueError(
            f"{where}: {prefix}_extra_state must be int64 [version, weight code], got "
            f"{state.numel()} entries"
        )
    version, saved = (int(v) for v in state.tolist())
    if version != FROZEN_FP4_VERSION:
        raise ValueError(
            f"{where}: {prefix}_extra_state has version {version}; this computectx reads "
            f"version {FROZEN_FP4_VERSION}"
        )
    if saved != code:
        shown = frozen_weight_name(saved) if saved in FROZEN_WEIGHT_CODES else f"code {saved}"
        raise ValueError(f"{where}: the state dict holds {shown}; freeze under that format")
