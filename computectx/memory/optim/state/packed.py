"""A packed state tensor: its parts, their layout, and the tensor kernels that fill them.

``Packed`` is one optimizer state tensor in a compact format of ``ctx.optim_state``: named
parts (``codes`` with per-block ``absmax``, rank-1 ``rows``/``cols``, or bf16 ``values``).
``Spec`` is its static facts (format, signedness, block, rank-1) and ``part_layout`` the
dtypes and shapes of its parts. ``encode_tensors``/``decode_tensors`` are the kernels
between float32 and parts: no checks, no Python loop over blocks, so one traced graph serves
every size (``computectx.memory.optim.fused`` compiles them into the Adam update). The checked
codec, the formats' bounds and their proofs are ``codecs``'; the maps are ``maps``'.

``maps_for`` is cached per spec and device: a step reads the map, its midpoints and the
nearest-entry table without building anything.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch.nn import functional

from computectx.memory.optim.state.maps import (
    TABLE_MASK,
    TABLE_SHIFT,
    map_for,
    nearest_table,
    qmap,
    qmap_midpoints,
)
from computectx.optim_state import OptimState, StateFormat

__all__ = [
    "FP8_MAX",
    "KINDS",
    "PACKED_FORMATS",
    "Kind",
    "Maps",
    "Packed",
    "Spec",
    "check_format",
    "decode_tensors",
    "element_scale",
    "encode_tensors",
    "maps_for",
    "nearest_codes",
    "packed_nbytes",
    "part_layout",
    "part_names",
    "parts_of",
    "safe_scale",
    "scales_of",
    "spec_for",
    "spec_of",
    "unpack4",
]


Kind = Literal["signed", "unsigned"]
"""Signed state (first moments, momentum) or non-negative state (second moments, sums)."""
KINDS: tuple[Kind, ...] = ("signed", "unsigned")
PACKED_FORMATS: tuple[StateFormat, ...] = ("bf16", "int8", "fp8", "int4")
"""The formats ``encode`` stores (``f32`` state stays a plain tensor)."""

FP8_MAX = 448.0


@dataclasses.dataclass(eq=False)
class Packed:
    """One state tensor in a compact format: its parts and what they mean."""

    format: StateFormat
    kind: Kind
    shape: torch.Size
    """The tensor's (the parameter's local shard's) shape."""
    block: int
    """Elements per block; 0 for bf16 and for rank-1 normalized int4."""
    parts: dict[str, torch.Tensor]
    """``{"codes": uint8, "absmax": f32[nblocks]}``, ``{"codes", "rows", "cols"}`` for rank-1
    int4, ``{"values": bf16 of shape}`` for bf16."""

    def nbytes(self) -> int:
        """Bytes held by the parts."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# ----- layout ------------------------------------------------------------------------------


class Spec(NamedTuple):
    """What a packed tensor looks like: static facts, no tensors (the compiled update's key)."""

    format: str
    signed: bool
    block: int  # 0 for bf16 and rank-1
    rank1: bool


def check_format(state: OptimState, kind: str) -> None:
    """``ValueError`` unless ``state`` is a packed format and ``kind`` a state kind."""
    if state.format not in PACKED_FORMATS:
        raise ValueError(
            f"optimizer state format {state.format!r} is not packed (f32 state stays a plain "
            f"tensor); encode accepts: {', '.join(PACKED_FORMATS)}"
        )
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a state kind; accepted: 'signed', 'unsigned'")


def _uses_rank1(fmt: str, signed: bool, shape: Sequence[int], block: int) -> bool:
    if fmt != "int4" or signed or len(shape) < 2:
        return False
    numel = math.prod(shape)
    if numel == 0:
        return False
    return shape[0] + numel // shape[0] <= -(-numel // block)


def spec_for(state: OptimState, kind: str, shape: Sequence[int]) -> Spec:
    """The ``Spec`` a tensor of ``shape`` takes under ``state`` (``ValueError`` as
    ``check_format``)."""
    check_format(state, kind)
    signed = kind == "signed"
    block = state.block_size
    if state.format == "bf16":
        return Spec("bf16", signed, 0, False)
    rank1 = _uses_rank1(state.format, signed, shape, block)
    return Spec(state.format, signed, 0 if rank1 else block, rank1)


def part_layout(spec: Spec, shape: Sequence[int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Part name -> (dtype, shape) of a tensor of ``shape`` packed as ``spec``, in order."""
    numel = math.prod(shape)
    if spec.format == "bf16":
        return {"values": (torch.bfloat16, tuple(shape))}
    ncodes = (numel + 1) // 2 if spec.format == "int4" else numel
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {"codes": (torch.uint8, (ncodes,))}
    if spec.rank1:
        layout["rows"] = (torch.float32, (shape[0],))
        layout["cols"] = (torch.float32, (numel // shape[0],))
    else:
        layout["absmax"] = (torch.float32, (-(-numel // spec.block),))
    return layout


def part_names(state: OptimState, kind: Kind, shape: Sequence[int]) -> tuple[str, ...]:
    """The names of the parts ``encode`` makes for a tensor of ``shape``."""
    return tuple(part_layout(spec_for(state, kind, shape), shape))


def packed_nbytes(numel_or_shape: int | Sequence[int], state: OptimState, kind: Kind) -> int:
    """Bytes ``encode`` would hold for a tensor of this shape (an int is read as 1-D).

    ``f32`` is ``4 * numel``. ``min_size`` is not applied here (the caller keeps small tensors
    f32). Rank-1 int4 needs the shape: given only a count, blocks are assumed.
    """
    shape = (numel_or_shape,) if isinstance(numel_or_shape, int) else tuple(numel_or_shape)
    if state.format == "f32":
        return 4 * math.prod(shape)
    layout = part_layout(spec_for(state, kind, shape), shape)
    return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for d, s in layout.values())


# ----- the tensor kernels (traceable by torch.compile: no Python loop over blocks) ---------


class Maps(NamedTuple):
    """The map and its midpoints on the tensor's device (empty for bf16 and fp8), and the
    nearest-entry table (``maps.nearest_table``; ``None`` where the search falls back to
    bucketize)."""

    values: torch.Tensor
    mids: torch.Tensor
    table: torch.Tensor | None = None
    bounds: torch.Tensor | None = None


@functools.lru_cache(maxsize=64)
def maps_for(spec: Spec, device: torch.device) -> Maps:
    """The map of ``spec``, its midpoints and its nearest-entry table on ``device`` (cached:
    a step builds nothing; do not modify them)."""
    if spec.format not in ("int8", "int4"):
        empty = torch.empty(0, device=device)
        return Maps(empty, empty)
    name = map_for(spec.format, spec.signed)
    search = nearest_table(name, device)
    if search is None:
        return Maps(qmap(name, device), qmap_midpoints(name, device))
    return Maps(qmap(name, device), qmap_midpoints(name, device), *search)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-flat.numel()) % block
    return functional.pad(flat, (0, pad)).view(-1, block)


def _per_element(scale: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    return scale[:, None].expand(-1, block).reshape(-1)[:numel]


def safe_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with its zeros replaced by ones (a zero block divides by 1: it stays 0)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    pairs = functional.pad(codes, (0, codes.numel() % 2)).view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` 4-bit codes of ``packed`` (two per byte, low nibble first), as int64."""
    b = packed.to(torch.int64)
    return torch.stack((b & 15, b >> 4), dim=1).reshape(-1)[:numel]


def scales_of(x32: torch.Tensor, spec: Spec) -> tuple[torch.Tensor, ...]:
    """Per-block absmax ``(absmax,)`` or rank-1 ``(rows, cols)`` of ``x32``."""
    if spec.rank1:
        a2 = x32.reshape(x32.shape[0], -1).abs()
        return a2.amax(dim=1), a2.amax(dim=0)
    return (_blocks(x32.reshape(-1), spec.block).abs().amax(dim=1),)


def element_scale(scales: Sequence[torch.Tensor], spec: Spec, numel: int) -> torch.Tensor:
    """The scale of each element (flat), from ``scales_of``."""
    if spec.rank1:
        rows, cols = scales
        return torch.minimum(rows[:, None], cols[None, :]).reshape(-1)
    return _per_element(scales[0], spec.block, numel)


def encode_tensors(x32: torch.Tensor, spec: Spec, maps: Maps) -> tuple[torch.Tensor, ...]:
    """The parts of ``x32`` (float32) in ``part_names`` order; no checks. ±inf and values
    beyond the format's range saturate to its largest finite magnitude (NaN stays NaN)."""
    if spec.format == "bf16":
        bf16 = torch.finfo(torch.bfloat16)
        values = x32.clamp(bf16.min, bf16.max).to(torch.bfloat16)
        if not spec.signed:  # x > 0 stays > 0: bf16's smallest subnormal at least
            values = torch.where((x32 > 0) & (values == 0), 2.0**-133, values)
        return (values,)
    # An inf would make its block's scale inf (and every code of the block NaN or 0).
    # (torch.finfo inline: a module-level float makes dynamo compile a second frame.)
    x32 = x32.clamp(torch.finfo(torch.float32).min, torch.finfo(torch.float32).max)
    numel = x32.numel()
    if spec.rank1:
        a2 = x32.reshape(x32.shape[0], -1)
        scales: tuple[torch.Tensor, ...] = (a2.abs().amax(dim=1), a2.abs().amax(dim=0))
        n = (a2 / safe_scale(torch.minimum(scales[0][:, None], scales[1][None, :]))).reshape(-1)
    else:
        blocks = _blocks(x32.reshape(-1), spec.block)
        scales = (blocks.abs().amax(dim=1),)
        n = (blocks / safe_scale(scales[0])[:, None]).reshape(-1)[:numel]
    positive = None if spec.signed else x32.reshape(-1) > 0
    if spec.format == "fp8":
        codes = (n * FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        codes = codes if positive is None else torch.where(positive, codes.clamp_min(1), codes)
        return (codes, *scales)
    if maps.table is not None and maps.bounds is not None:
        idx = nearest_codes(n, maps.table, maps.bounds)  # = bucketize, by a table (maps.py)
    else:
        idx = torch.bucketize(n, maps.mids)
    if positive is not None and spec.format == "int8":  # int4's unsigned map has no zero
        idx = torch.where(positive, idx.clamp_min(1), idx)
    if spec.format == "int4":
        return (_pack4(idx), *scales)
    return (idx.to(torch.uint8), *scales)


def decode_tensors(
    parts: Sequence[torch.Tensor], spec: Spec, maps: Maps, numel: int
) -> torch.Tensor:
    """``parts`` (``part_names`` order) decoded to a flat float32 tensor of ``numel``."""
    if spec.format == "bf16":
        return parts[0].reshape(-1).float()
    codes, scales = parts[0], parts[1:]
    scale = element_scale(scales, spec, numel)
    if spec.format == "fp8":
        return codes.view(torch.float8_e4m3fn).float() / FP8_MAX * scale
    idx = unpack4(codes, numel) if spec.format == "int4" else codes.to(torch.int64)
    return maps.values[idx] * scale


def spec_of(p: Packed) -> Spec:
    """The static facts of ``p`` (format, signedness, block, rank-1)."""
    return Spec(p.format, p.kind == "signed", p.block, p.format == "int4" and "rows" in p.parts)


def parts_of(p: Packed) -> dict[str, torch.Tensor]:
    """The parts of ``p`` by name, for a ``state_dict`` (the tensors themselves, no copy)."""
    return dict(p.parts)


def nearest_codes(n: torch.Tensor, table: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """``torch.bucketize(n, mids)`` for float32 ``n``, as int32, by ``maps.nearest_table``'s
    parts (the search ``maps`` describes: a bucket's code, plus one above its midpoint)."""
    flat = n.reshape(-1)
    key = (flat.view(torch.int32) >> TABLE_SHIFT) & TABLE_MASK
    code = table.index_select(0, key)  # index_select: several times faster than table[key]
    return (code + (flat > bounds.index_select(0, code))).view(n.shape)
