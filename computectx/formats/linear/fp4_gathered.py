"""A 4-bit weight that arrives quantized: ``Fp4GatheredWeight``, and ``Fp4ShardGather``, how a
row shard of it is quantized so that the pieces, put back together, are the whole weight's
operands bit for bit (FSDP2's 4-bit all-gather, ``computectx.distributed.enable_fp4_all_gather``).

An ``Fp4Linear`` multiplies with two operands of its weight ``W`` (``N x K``): ``W`` for the
forward and ``Wᵀ`` for the dgrad, each quantized at the weight's block (docs/fp4.md). A shard
of whole rows ``W[r0:r1]`` gives the whole weight's codes and block scales for those rows when
no block crosses a shard boundary (``aligns``: every shard the same number of rows, a multiple
of 16 for NVFP4, of 32 for MXFP4) and, NVFP4, when it is quantized with the whole weight's
per-tensor amax (the shard group's MAX of each shard's ``shard_amax``):

- **NVFP4, 16x16 tiles** (TE's default): a tile's scale is the same read across or down, so
  ``Wᵀ``'s codes are ``W``'s transposed (``transposed_tiles``). A shard sends its codes and
  tile scales: 0.5 + 1/256 bytes an element (0.5039), the amax travelling as metadata.
- **NVFP4 1x16 and MXFP4 1x32**: a block runs along ``K``, so ``Wᵀ``'s blocks (along ``N``)
  hold other values and other scales; a shard sends both operands: its rows' codes and scales
  and its columns of ``Wᵀ``'s (laid out rows first, so that FSDP2's gather along dim 0 puts
  them in place): 2 x (0.5 + 1/16) = 1.125 bytes an element for NVFP4 1x16, 2 x (0.5 + 1/32) =
  1.0625 for MXFP4, against 2 (bf16) or 4 (float32) for the high-precision weight.

Grouped experts (``Fp4ExpertsGather``, ``Fp4GatheredExperts``): FSDP2 shards ``w [E, N, K]``
along the experts; a shard of whole experts quantizes each expert with its own amax (the
grouped GEMM's), with no collective, and sends per expert what a dense shard sends plus NVFP4's
amax; the gathered parts are every expert's operands.

The shard is quantized by the quantize's twin (``numerics.fp4``), the function the
``computectx::fp4_quantize`` operator runs, with the whole weight's amax given: so the
gathered operands are those ``Fp4Linear.quantized_weight()`` (and the dgrad's quantize of
``Wᵀ``) make in one process, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map
from typing_extensions import Self

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.numerics.e2m1 import pack_codes, unpack_codes
from computectx.formats.numerics.fp4 import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    Mxfp4Operand,
    Nvfp4Operand,
    Nvfp4Tile,
    quantize_mxfp4,
    quantize_nvfp4,
    tensor_amax,
)
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant, dequantize_operand

__all__ = [
    "Fp4ExpertsGather",
    "Fp4GatheredExperts",
    "Fp4GatheredWeight",
    "Fp4ShardGather",
    "transposed_tiles",
]

_aten = torch.ops.aten
_ALIASING = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._unsafe_view.default,
}


def transposed_tiles(q: Nvfp4Operand) -> Nvfp4Operand:
    """The 16x16-tiled NVFP4 operand of ``Wᵀ`` from ``W``'s: the codes and tile scales
    transposed (a tile's scale is its amax's, read across or down; each element's code is
    ``e2m1(x * encode)`` of its tile's factor either way)."""
    if q.tile != "16x16":
        raise ValueError(f"only 16x16 tiles transpose, got an operand of {q.tile} blocks")
    codes = pack_codes(unpack_codes(q.codes).t())
    return Nvfp4Operand(codes, q.scale.t().contiguous(), q.amax, "16x16")


def _scale_dtype(how: Fp4Quant) -> torch.dtype:
    return torch.float8_e4m3fn if how.format == "nvfp4" else torch.float8_e8m0fnu


@dataclass(frozen=True)
class Fp4ShardGather:
    """How a 4-bit layer's weight shard is quantized for a gather and rebuilt after it
    (module docstring); ``how`` is the layer's (``Fp4Linear.weight_gather``)."""

    how: Fp4Quant

    @property
    def transposes(self) -> bool:
        """Whether ``Wᵀ``'s operand is ``W``'s transposed (NVFP4 16x16 tiles): one operand
        travels; else both do."""
        return self.how.format == "nvfp4" and self.how.weight_tile == "16x16"

    @property
    def rows(self) -> int:
        """The rows a shard is a multiple of: 16 (NVFP4: its tiles, or ``Wᵀ``'s 1x16 blocks
        along ``N``), 32 (MXFP4: ``Wᵀ``'s 1x32 blocks)."""
        return NVFP4_BLOCK if self.how.format == "nvfp4" else MXFP4_BLOCK

    @property
    def needs_amax(self) -> bool:
        """Whether the shard is quantized with the whole weight's amax (NVFP4)."""
        return self.how.format == "nvfp4"

    def aligns(self, rows: int, world: int) -> bool:
        """Whether a weight of ``rows`` rows cut into ``world`` equal shards leaves no block
        across a shard boundary (every shard the same size and a multiple of ``self.rows``)."""
        return rows % world == 0 and (rows // world) % self.rows == 0

    def shard_amax(self, shard: torch.Tensor) -> torch.Tensor:
        """float32 ``(1,)``: the shard's per-tensor amax (over its finite elements); the
        shard group's MAX of these is the whole weight's."""
        return tensor_amax(shard).reshape(1)

    def inputs(self, shard: torch.Tensor, amax: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """What the shard sends, as ``uint8`` tensors whose first dimension is its rows' (a
        gather along dim 0 concatenates them): its codes and scales, then, where blocks do
        not transpose, ``Wᵀ``'s codes and scales of its columns, transposed. ``amax`` is the
        whole weight's (NVFP4; ``None`` for MXFP4)."""
        rows = self._operand(shard, amax, self.how.weight_tile)
        sent = [rows.codes.view(torch.uint8), rows.scale.view(torch.uint8)]
        if not self.transposes:
            cols = self._operand(shard.t(), amax, "1x16")
            sent += [cols.codes.view(torch.uint8).t().contiguous()]
            sent += [cols.scale.view(torch.uint8).t().contiguous()]
        return tuple(sent)

    def _operand(self, x: torch.Tensor, amax: torch.Tensor | None, tile: Nvfp4Tile) -> Fp4Operand:
        if self.how.format == "mxfp4":
            return quantize_mxfp4(x, rounding=self.how.mx_rounding)
        if amax is None:
            raise ValueError("an NVFP4 weight shard is quantized with the whole weight's amax")
        return quantize_nvfp4(x, tile=tile, amax=amax, check_amax_values=False)  # a max |x|

    def weight(
        self, outputs: Sequence[torch.Tensor], amax: torch.Tensor | None, dtype: torch.dtype
    ) -> Fp4GatheredWeight:
        """The gathered ``outputs`` (``inputs`` of every shard, concatenated along dim 0) as
        the whole weight's operands, a weight of nominal ``dtype``."""
        return Fp4GatheredWeight(tuple(outputs), amax, self.how, dtype)

    def refresh(self, out: torch.Tensor, amax: torch.Tensor | None) -> None:
        """A weight gathered again into the same buffers (``out`` views them): its amax set
        to ``amax``'s value, in place."""
        if not isinstance(out, Fp4GatheredWeight):
            raise TypeError(f"expected the Fp4GatheredWeight gathered before, got {type(out)}")
        held = out.per_tensor_amax
        if amax is not None and held is not None and held is not amax:
            with torch.no_grad():
                held.copy_(amax)


class Fp4GatheredWeight(torch.Tensor):
    """A weight held as its 4-bit operands (module docstring), at a nominal float dtype and
    the weight's ``N x K`` shape, which ``Fp4Linear`` multiplies with as they are: the
    forward's ``operand()`` and the dgrad's ``dgrad_operand()``.

    ``parts``: the gathered ``uint8`` tensors (codes, scales, and where blocks do not
    transpose ``Wᵀ``'s codes and scales, rows first); ``amax`` the float32 ``(1,)`` per-tensor
    amax (NVFP4). Shape-keeping aliasing ops (``detach``, ``alias``, ``view`` or
    ``as_strided`` to the same shape) keep it one over the same bytes; every other op sees
    ``dequantize()``: the forward operand's values at the nominal dtype.
    """

    _parts: tuple[torch.Tensor, ...]
    _amax: torch.Tensor | None
    _how: Fp4Quant

    @staticmethod
    def __new__(
        cls,
        parts: tuple[torch.Tensor, ...],
        amax: torch.Tensor | None,
        how: Fp4Quant,
        dtype: torch.dtype,
    ) -> Self:
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"Fp4GatheredWeight stands for a float weight, got {dtype}")
        codes = parts[0]
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            (*codes.shape[:-1], codes.shape[-1] * 2),
            dtype=dtype,
            device=codes.device,
            requires_grad=False,
        )
        for i, part in enumerate(parts):
            setattr(out, f"_part{i}", part)  # each an inner tensor (__tensor_flatten__)
        out._parts = parts
        out._amax = amax
        out._how = how
        return out

    def __init__(self, *args: object) -> None:
        super().__init__()

    @property
    def per_tensor_amax(self) -> torch.Tensor | None:
        """The per-tensor amax, float32 ``(1,)`` (NVFP4), or ``None`` (MXFP4)."""
        return self._amax

    def _pair(self, codes: torch.Tensor, scale: torch.Tensor, tile: str) -> Fp4Operand:
        c = codes.view(torch.float4_e2m1fn_x2)
        s = scale.view(_scale_dtype(self._how))
        if self._amax is None:
            return Mxfp4Operand(c, s)
        return Nvfp4Operand(c, s, self._amax.reshape(()), "16x16" if tile == "16x16" else "1x16")

    def operand(self) -> Fp4Operand:
        """``W``'s operand, as ``Fp4Linear.quantized_weight()`` makes it."""
        return self._pair(self._parts[0], self._parts[1], self._how.weight_tile)

    def dgrad_operand(self) -> Fp4Operand:
        """``Wᵀ``'s operand at the weight's block, as the dgrad quantizes it (a new tensor,
        made on the call: nothing of it is held beyond the dgrad)."""
        q = self.operand()
        if isinstance(q, Nvfp4Operand) and q.tile == "16x16":
            return transposed_tiles(q)
        codes, scale = (p.t().contiguous() for p in self._parts[2:4])
        return self._pair(codes, scale, "1x16")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The forward operand's values, formed in float32 and rounded once to ``dtype``
        (default: the nominal dtype)."""
        return dequantize_operand(self.operand()).to(dtype or self.dtype)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        names = [f"_part{i}" for i in range(len(self._parts))]
        if self._amax is not None:
            names.append("_amax")
        return names, (len(self._parts), self._how, self.dtype)

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], meta: Any, outer_size: Any, outer_stride: Any
    ) -> Self:
        count, how, dtype = meta
        parts = tuple(inner[f"_part{i}"] for i in range(count))
        return cls(parts, inner.get("_amax"), how, dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _ALIASING and isinstance(args[0], cls):
            w = args[0]
            plain = torch.empty(w.shape, device="meta")
            seen = func(plain, *args[1:], **kwargs)
            same = seen.shape == w.shape and seen.stride() == plain.stride()
            if same and seen.storage_offset() == 0:
                # The same elements in the same places: the operands stay as they are (a
                # normal tensor's alias a normal tensor under inference_mode too: it shares
                # the version counter, which an inference tensor has none of).
                with torch.inference_mode(w.is_inference()):
                    return cls(w._parts, w._amax, w._how, w.dtype)

        def values(x: Any) -> Any:
            return x.dequantize() if isinstance(x, cls) else x

        return func(*tree_map(values, args), **tree_map(values, kwargs))

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        tile = self._how.weight_tile if self._how.format == "nvfp4" else "1x32"
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, {self._how.format} {tile} as "
            f"{self.dtype}, device={self.device})"
        )


# ----- Grouped experts: shards of whole experts ------------------------------------------------


@dataclass(frozen=True)
class Fp4ExpertsGather(Fp4ShardGather):
    """How a shard of whole experts of a 4-bit experts weight (``w [E, N, K]``, FSDP2's row
    shards along the experts) is quantized for a gather and rebuilt after it; ``how`` is the
    experts module's (``Fp4Experts.experts_gather``).

    The grouped GEMM quantizes each expert on its own, with its own amax (``ops.fp4``'s
    ``fp4_grouped_mm``): a rank holding whole experts makes their operands alone, with no
    collective. Each shard sends, per expert, ``W[e]``'s codes and scales at the weight's
    block, NVFP4's amax (float32, one per expert), and, where blocks do not transpose (NVFP4
    1x16, MXFP4), ``W[e]ᵀ``'s codes and scales (the dgrad's operand, its 1x16 or 1x32 blocks
    along ``N``). The gathered parts are an ``Fp4GatheredExperts``."""

    def aligns_experts(self, shape: torch.Size, world: int) -> bool:
        """Whether ``world`` equal shards of ``shape`` (``[E, N, K]``) hold whole experts
        whose operands the grouped GEMM can take: ``E`` a multiple of ``world``, ``N`` and
        ``K`` multiples of the block (16, MXFP4 32)."""
        e, n, k = shape
        return e % world == 0 and n % self.rows == 0 and k % self.how.block == 0

    def expert_inputs(self, shard: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the shard ``[E_local, N, K]`` sends, each part with the experts first (a
        gather along dim 0 concatenates them): codes and scales as ``uint8``, NVFP4's amaxes
        float32 ``(E_local,)``, then where blocks do not transpose ``Wᵀ``'s codes ``[E_local,
        K, N/2]`` and scales."""
        parts: list[list[torch.Tensor]] = []
        for e in range(shard.shape[0]):
            w = shard[e]
            amax = tensor_amax(w) if self.needs_amax else None  # the expert's own
            q = self._operand(w, amax, self.how.weight_tile)
            mine = [q.codes.view(torch.uint8), q.scale.view(torch.uint8)]
            if isinstance(q, Nvfp4Operand):
                mine.append(q.amax.reshape(1).float())
            if not self.transposes:
                qt = self._operand(w.t(), amax, "1x16")
                mine += [qt.codes.view(torch.uint8), qt.scale.view(torch.uint8)]
            parts.append(mine)
        return tuple(torch.stack(p) for p in zip(*parts, strict=True))

    def experts(self, outputs: Sequence[torch.Tensor], dtype: torch.dtype) -> Fp4GatheredExperts:
        """The gathered ``outputs`` (``expert_inputs`` of every shard, concatenated along the
        experts) as the whole weight's operands, a weight of nominal ``dtype``."""
        parts = tuple(outputs)
        if self.needs_amax:
            amax: torch.Tensor | None = parts[2].reshape(-1)
            parts = parts[:2] + parts[3:]
        else:
            amax = None
        return Fp4GatheredExperts(parts, amax, self.how, dtype)


class Fp4GatheredExperts(Fp4GatheredWeight):
    """A 4-bit experts weight ``[E, N, K]`` held as each expert's operands (the gathered
    ``uint8`` parts, experts first, and NVFP4's float32 amaxes ``(E,)``), which
    ``Fp4Experts`` multiplies with as they are: ``operand()`` for the forward,
    ``dgrad_operand()`` for the dgrad (``ops.fp4_grouped_gathered``). Each expert's operands are
    those ``Fp4Experts``' grouped GEMM makes of it, bit for bit. Every other op sees
    ``dequantize()``, as for ``Fp4GatheredWeight``."""

    def _stacked(self, codes: torch.Tensor, scale: torch.Tensor, tile: str) -> Fp4Operand:
        c = codes.view(torch.float4_e2m1fn_x2)
        s = scale.view(_scale_dtype(self._how))
        if self._amax is None:
            return Mxfp4Operand(c, s)
        return Nvfp4Operand(c, s, self._amax.reshape(-1), "16x16" if tile == "16x16" else "1x16")

    def operand(self) -> Fp4Operand:
        """Every expert's ``W[e]`` operand, stacked: codes ``[E, N, K/2]``, scales ``[E,
        ...]``, NVFP4's amaxes ``(E,)``."""
        return self._stacked(self._parts[0], self._parts[1], self._how.weight_tile)

    def dgrad_operand(self) -> Fp4Operand:
        """Every expert's ``W[e]ᵀ`` operand at the weight's block, stacked (16x16 tiles: the
        codes and tile scales of each expert transposed, made on the call)."""
        q = self.operand()
        if isinstance(q, Nvfp4Operand) and q.tile == "16x16":
            codes = pack_codes(unpack_codes(q.codes).transpose(1, 2))
            return Nvfp4Operand(codes, q.scale.transpose(1, 2).contiguous(), q.amax, "16x16")
        return self._stacked(self._parts[2], self._parts[3], "1x16")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Each expert's forward operand's values, formed in float32 and rounded once to
        ``dtype`` (default: the nominal dtype)."""
        q = self.operand()
        experts = []
        for e in range(q.codes.shape[0]):
            if isinstance(q, Nvfp4Operand):
                one: Fp4Operand = Nvfp4Operand(q.codes[e], q.scale[e], q.amax[e], q.tile)
            else:
                one = Mxfp4Operand(q.codes[e], q.scale[e])
            experts.append(dequantize_operand(one))
        if not experts:  # no expert: nothing to form, on the operands' device all the same
            return torch.zeros(self.shape, dtype=dtype or self.dtype, device=q.codes.device)
        return torch.stack(experts).to(dtype or self.dtype)
