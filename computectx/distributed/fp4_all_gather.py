"""FSDP2 all-gathers 4-bit weights: each shard quantized by its rank, 4-bit codes on the wire.

``fully_shard`` keeps each rank's shard of a weight and all-gathers the whole weight before
the layer runs. For an ``Fp4Linear`` that gather would ship the high-precision weight (4 bytes
an element in float32, 2 in bf16) only for the layer to quantize it to 4 bits straight after.
``enable_fp4_all_gather(model)`` turns each ``Fp4Linear`` weight into a ``WeightGatheredFp4``,
a tensor subclass over the high-precision shard that implements FSDP2's extension points:

- ``fsdp_pre_all_gather``: the rank quantizes its own shard (``Fp4Linear.weight_gather``,
  ``computectx.formats.linear.fp4_gathered``) and hands FSDP2 the codes and block scales as
  ``uint8`` (gloo refuses float4 and float8 dtypes). NVFP4's per-tensor scale is the whole
  weight's amax: one MAX all-reduce of one float over the shard group, issued by every rank
  at every forward gather alike (FSDP2 gathers a unit on every rank together); the re-gather
  for the backward (``reshard_after_forward=True``) reuses the forward's amax, since the
  weight has not changed. MXFP4 has no per-tensor scale and issues no collective;
- ``fsdp_post_all_gather``: the gathered bytes become an ``Fp4GatheredWeight``, the whole
  weight's 4-bit operands, bit for bit those one process quantizing the whole weight makes,
  which the layer multiplies with in its forward and its dgrad without quantizing again.
  The gradient is an ordinary tensor of the weight's dtype, reduce-scattered by FSDP2 as
  before.

On the wire, per weight element: NVFP4 with 16x16 tiles (TE's default, the recipe's) 0.5039
bytes (codes and tile scales; ``Wᵀ``'s operand is the same codes transposed); NVFP4 with 1x16
blocks (``w1x16``) 1.125 and MXFP4 1.0625: their blocks do not transpose, so each shard sends
``W``'s operand and ``Wᵀ``'s (the dgrad's), still against 2 (bf16) or 4 (float32) bytes.
A weight whose FSDP2 shards cut its blocks (rows not a multiple of 16, or 32 for MXFP4, times
the shard count, or uneven shards) gathers high precision instead, with one
``GatherFallbackWarning`` per such weight and process; the layer then quantizes the gathered
weight itself.

The shard is quantized from its high-precision values, whatever FSDP2's ``param_dtype``
(``parallelize`` gathers at ``ctx.compute``): the operands are those of the master weight,
as one process makes them, and ``param_dtype`` is the gathered weight's nominal dtype, the
dtype of its gradient. Everywhere else a ``WeightGatheredFp4`` is its high-precision tensor:
optimizers update it, ``state_dict`` saves plain tensors (DTensors of plain tensors under
FSDP2), and loading copies into it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import Self

from computectx.distributed._fp8_gather import (
    GatheredAsFp8,
    GatherMeta,
    check_row_shard,
    hp_gathered,
    hp_inputs,
    in_backward,
    shard_group,
    shard_world,
    warn_fallback,
    wrap_linear_weights,
)
from computectx.distributed.collectives import GroupAmax
from computectx.distributed.fp8_all_gather import GatherFallbackWarning
from computectx.formats import Fp4Linear

__all__ = ["WeightGatheredFp4", "enable_fp4_all_gather"]


class _Gather(GatherMeta):
    """What a weight's shards share (``GatherMeta``) and the whole weight's amax of the last
    forward gather (NVFP4), which the backward's re-gather reuses."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.forward_amax: torch.Tensor | None = None


class WeightGatheredFp4(GatheredAsFp8):
    """An ``Fp4Linear`` weight that FSDP2 all-gathers in 4 bits (module docstring).

    Wraps the high-precision tensor ``hp``; every op other than FSDP2's two extension points
    runs on ``hp`` (ops that take a piece of the weight return a ``WeightGatheredFp4`` over
    the piece). Built by ``enable_fp4_all_gather``.
    """

    _meta: _Gather

    def __new__(cls, hp: torch.Tensor, gather: _Gather) -> Self:
        return super().__new__(cls, hp, gather)

    def __init__(self, hp: torch.Tensor, gather: _Gather) -> None:
        super().__init__(hp, gather)

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Quantize this shard (with the whole weight's amax, NVFP4) and hand FSDP2 its codes
        and scales as uint8; the high-precision shard where shards cut the blocks."""
        g = self._meta
        spec = g.module_as(module, Fp4Linear, "in 4 bits", "an Fp4Linear").weight_gather
        hp = self._hp.detach()
        check_row_shard(g.name, hp, outer_size, "in 4 bits")
        world = shard_world(mesh)
        if not spec.aligns(outer_size[0], world):
            # The same on every rank (the shape and the shard count): no rank reduces.
            why = (
                f"4-bit blocks (a 4-bit weight gathers in 4 bits when its rows are a multiple "
                f"of {spec.rows} x the shard count). The layer quantizes the gathered weight "
                f"itself."
            )
            warn_fallback(GatherFallbackWarning, g.name, outer_size, world, why)
            return hp_inputs(hp, outer_size, world, mp_policy)
        amax = None
        if spec.needs_amax:
            if in_backward() and g.forward_amax is not None:
                amax = g.forward_amax  # the forward's: the weight has not changed since
            else:
                # Every rank of the shard group gathers this unit together: one MAX of one
                # float, the whole weight's amax (its finite elements'), on every rank.
                amax = GroupAmax(shard_group(mesh))(spec.shard_amax(hp))
                g.forward_amax = amax
        return spec.inputs(hp, amax), ("fp4", spec, amax)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered codes and scales as an ``Fp4GatheredWeight`` of the weight's dtype
        (or the high-precision weight, where its shards cut the blocks)."""
        if metadata[0] == "hp":
            return hp_gathered(all_gather_outputs, out)
        _, spec, amax = metadata
        if out is not None:  # gathered into the same buffers again: out views them
            spec.refresh(out, amax)
            return None
        outputs = tuple(all_gather_outputs)
        return spec.weight(outputs, amax, param_dtype), outputs


def enable_fp4_all_gather(
    model: nn.Module, *, module_filter: Callable[[nn.Module, str], bool] | None = None
) -> int:
    """Make FSDP2 all-gather the ``Fp4Linear`` weights of ``model`` in 4 bits; returns how
    many weights it converted.

    Call it after ``convert_to_quantized`` and before ``fully_shard`` and before building the
    optimizer (the weights become new ``Parameter`` objects); ``parallelize`` does this under
    ``strategy="fsdp"``. ``module_filter(module, fqn)`` may leave some layers gathering high
    precision. A weight shared with another module (a head tied to the embedding) would reach
    that module as 4-bit codes: it is refused with a ``ValueError`` naming every holder (leave
    it out with ``module_filter``; ``parallelize`` does that by itself). ``RuntimeError`` if a
    weight is already sharded (a DTensor); ``TypeError`` for a ``model`` that is no module or
    a ``module_filter`` that is not callable. Everything is checked before any weight changes.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"enable_fp4_all_gather takes the converted nn.Module, got {type(model).__name__}"
        )
    if module_filter is not None and not callable(module_filter):
        raise TypeError(
            f"enable_fp4_all_gather's module_filter is a callable (module, fqn) -> bool or "
            f"None, got {module_filter!r}"
        )
    layers = [
        (name, layer)
        for name, layer in model.named_modules()
        if isinstance(layer, Fp4Linear) and (module_filter is None or module_filter(layer, name))
    ]
    return wrap_linear_weights(
        model,
        layers,
        WeightGatheredFp4,
        _Gather,
        enable="enable_fp4_all_gather",
        how="in 4 bits",
        codes="4-bit codes",
    )
