"""FSDP2 all-gathers fp8 weights: each shard quantized once, one byte per element on the wire.

``fully_shard`` keeps each rank's shard of a weight and all-gathers the whole weight before
the layer runs. For a ``QuantizedLinear`` that gather would ship float32 (4 bytes per element) only
for the layer to quantize it to fp8 straight after. ``enable_quantized_all_gather(model)`` turns
each ``QuantizedLinear`` weight into a ``WeightGatheredQuantized``, a tensor subclass that
implements
FSDP2's extension points:

- ``fsdp_pre_all_gather``: the rank quantizes its own shard in the policy's forward format
  with the group-wide step and hands FSDP2 the codes as ``uint8`` (gloo refuses float8
  dtypes). The step is the one the weight's ledger holds, which the amax sync keeps identical
  on every rank (delayed scaling), or the step of the whole weight's amax, one MAX
  all-reduce of a single float over the shard group (dynamic scaling). Either way the
  weight's ledger advances exactly as in one process quantizing the whole weight: the shard
  amax goes into the history and the amax sync's max over ranks makes it the weight's;
- ``fsdp_post_all_gather``: the gathered bytes become an ``computectx.formats.QuantizedWeight`` (the
  codes and the step), which ``QuantizedLinear`` uses as its quantized weight without quantizing
  again. The gradient is an ordinary tensor of the weight's dtype, reduce-scattered by
  FSDP2 as before.

Under a ``MixedPrecisionPolicy`` (``parallelize`` passes ``fsdp_mixed_precision(ctx)``: gather
at ``ctx.compute``) FSDP2 casts only what it gathers itself: the codes returned here are those
of the high-precision shard, whatever ``param_dtype`` is, so the bytes and the steps do not
change; ``param_dtype`` becomes the gathered weight's nominal dtype, the dtype of its gradient
(FSDP2 reduce-scatters one dtype per unit, a bias's included), and a ``block`` weight that
falls back gathers its high-precision shard at ``param_dtype``, as any other parameter.

When FSDP2 gathers again for the backward (``reshard_after_forward=True``), the shard is
quantized with the step the forward used and nothing is recorded: the backward sees the very
bytes the forward multiplied with, and the ledger advances once per forward, as in one process.
The first forward of a delayed-scaling weight seeds its ledger from the whole weight's amax
(one MAX all-reduce, once), so even step 1 quantizes with the one-process scale.

Fine-grained policies (``FP8_GATHER_GRANULARITIES``). A ``block`` weight is quantized in
128x128 blocks, whose steps need no other rank: when FSDP2's shards are whole 128-row blocks
(``blocks_align``), each rank quantizes its shard's blocks with no collective and hands FSDP2
the codes (``uint8``) and the float32 block scales together; the gathered pair is a
``computectx.formats.linear.weights.QuantizedBlockWeight``, exactly the whole weight's blocks,
which the block
linear uses for its forward and, transposed as its blocks are, for its dgrad, quantizing
nothing again. On the wire: 1 byte per element and 4 bytes per 16384 (1.0002). Shards that
cut blocks gather high precision, with one ``GatherFallbackWarning`` per such weight (once
per process). ``row``
and ``mx`` weights gather high precision (docs/distributed.md says why).

Everywhere else a ``WeightGatheredQuantized`` is its high-precision tensor: optimizers update it,
``state_dict`` saves plain tensors (DTensors of plain tensors under FSDP2), and loading copies
into it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import Self

from computectx.distributed._fp8_gather import (
    GatheredAsFp8,
    GatherMeta,
    check_row_shard,
    hp_gathered,
    hp_inputs,
    in_backward,
    padded,
    parameter_holders,
    shard_group,
    shard_world,
    warn_fallback,
    wrap_linear_weights,
)
from computectx.distributed.collectives import GroupAmax
from computectx.formats import QuantizedLinear, QuantizedWeight
from computectx.formats.seam import quantize_with_step
from computectx.recipes import DelayedScaling, PolicyGranularity, Recipe

__all__ = [
    "BLOCK_ROWS",
    "FP8_GATHER_GRANULARITIES",
    "GatherFallbackWarning",
    "WeightGatheredQuantized",
    "blocks_align",
    "enable_quantized_all_gather",
    "gathers_quantized",
    "parameter_holders",
    "sharded_weight_of",
]

FP8_GATHER_GRANULARITIES: tuple[PolicyGranularity, ...] = ("tensor", "block")
"""The policy granularities whose weights FSDP2 all-gathers as fp8: ``tensor`` (codes and
one step) and ``block`` (codes and 128x128 block scales, where shards are whole blocks:
``blocks_align``). ``row`` and ``mx``
weights gather high precision, as torchtitan's row-wise recipe does (docs/distributed.md,
"Fine-grained scaling on many ranks", has the bytes): their blocks of one row do not
transpose, so the dgrad needs ``W`` quantized along its other axis too, and an fp8 gather
would have to carry codes for each axis (the forward's and the dgrad's)."""


def gathers_quantized(policy: Recipe) -> bool:
    """Whether a layer under ``policy`` all-gathers its weight as fp8
    (``FP8_GATHER_GRANULARITIES``)."""
    return policy.granularity in FP8_GATHER_GRANULARITIES


class _Gather(GatherMeta):
    """What a weight's shards share (``GatherMeta``) and the step of the last forward (a
    copy of the model quantizes through its own layers' ledgers)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.forward_step: torch.Tensor | None = None

    def layer(self, module: nn.Module) -> QuantizedLinear:
        module = self.module_as(module, QuantizedLinear, "as fp8", "a QuantizedLinear")
        if module.frozen:
            raise RuntimeError(
                f"{self.name!r} was frozen for serving after enable_quantized_all_gather; freeze "
                f"an unsharded copy instead"
            )
        return module


class WeightGatheredQuantized(GatheredAsFp8):
    """A ``QuantizedLinear`` weight that FSDP2 all-gathers as fp8 (see the module docstring).

    Wraps the high-precision tensor ``hp``; every op other than FSDP2's two extension points
    runs on ``hp`` (ops that take a piece of the weight return a ``WeightGatheredQuantized`` over
    the piece). Built by ``enable_quantized_all_gather``.
    """

    _meta: _Gather

    def __new__(cls, hp: torch.Tensor, gather: _Gather) -> Self:
        return super().__new__(cls, hp, gather)

    def __init__(self, hp: torch.Tensor, gather: _Gather) -> None:
        super().__init__(hp, gather)

    # ----- FSDP2's extension points --------------------------------------------------------

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Quantize this shard with the group-wide step; hand FSDP2 its codes as uint8.
        A ``block`` layer's shard: its 128x128 blocks' codes and scales (``_block_inputs``)."""
        g = self._meta
        layer = g.layer(module)
        check_row_shard(g.name, self._hp, outer_size, "in fp8")
        if layer.policy.granularity == "block":
            return self._block_inputs(layer, mesh, outer_size, mp_policy)
        fmt = layer.policy.format.forward
        scaling = layer.policy.scaling
        op = layer.scaling.weight
        hp = self._hp.detach()
        group = GroupAmax(shard_group(mesh), always_armed=True)
        seam = layer.amax_reduce
        # Whether this is a training forward in which the layer records (the rule of
        # QuantizedLinear.forward): eval and no_grad gathers quantize from the state as it is.
        # FSDP2 gathers under no_grad, so the grad mode of the forward is what the sync's
        # pre-forward hook saw when it armed the seam.
        record = layer.training and (seam is None or seam.armed)
        if in_backward() and g.forward_step is not None:
            # The re-gather for the backward: the bytes the forward used, nothing recorded.
            data, _ = quantize_with_step(hp, fmt, g.forward_step, backend=layer.backend)
            step = g.forward_step
        elif not record:
            data, step = op.quantize_unrecorded(hp, fmt, scaling, layer.backend, reduce=group)
        else:
            if (
                isinstance(scaling, DelayedScaling)
                and not isinstance(seam, GroupAmax)
                and mesh.size(mesh.ndim - 1) > 1
            ):
                # Each shard would be quantized with its own rank's step and the gathered
                # codes labelled with this rank's: a silent mis-scale.
                raise RuntimeError(
                    f"{g.name!r} all-gathers as fp8 under delayed scaling, but nothing keeps "
                    f"the ranks' weight steps identical: call "
                    f"computectx.distributed.sync_scaling(model) after fully_shard (and "
                    f"keep it attached), or set up with computectx.distributed.parallelize"
                )
            # The quantize an unsharded layer runs, with the shard group's amax wherever it
            # needs the current one (every dynamic call; the seed of a delayed ledger), so
            # every rank's step is the whole weight's.
            data, step = op.quantize(hp, fmt, scaling, layer.backend, reduce=group)
        g.forward_step = step
        padded_data = padded(data, outer_size, shard_world(mesh))
        return (padded_data.view(torch.uint8),), (step, data.dtype)

    def _block_inputs(
        self, layer: QuantizedLinear, mesh: DeviceMesh, outer_size: torch.Size, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        # Shards of whole 128-row blocks (blocks_align): each rank quantizes its own blocks,
        # exactly the whole weight's blocks, with no collective; the codes (uint8) and the
        # float32 block scales travel together. Dynamic scaling and no history: the
        # backward's re-gather quantizes the same shard again to the same bytes.
        hp = self._hp.detach()
        world = shard_world(mesh)
        if not blocks_align(outer_size[0], world):
            why = (
                "128x128 fp8 blocks (a block weight gathers as fp8 when its rows are a multiple "
                "of 128 x the shard count). The layer quantizes the gathered weight itself: the "
                "same result, more bytes."
            )
            warn_fallback(GatherFallbackWarning, self._meta.name, outer_size, world, why)
            return hp_inputs(hp, outer_size, world, mp_policy)
        from computectx.formats.seam import quantize_blocks, step_rule_of

        codes, scale = quantize_blocks(
            hp,
            layer.policy.format.forward,
            "128x128",
            step_rule_of(layer.policy),
            None,
            backend=layer.backend,
        )
        return (codes.view(torch.uint8), scale), ("block", codes.dtype)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered codes and the step as a ``QuantizedWeight`` of the weight's dtype (a
        ``block`` layer's: the codes and block scales as a ``QuantizedBlockWeight``, or the
        high-precision weight where its shards cut 128-row blocks)."""
        if metadata[0] == "hp":
            return hp_gathered(all_gather_outputs, out)
        if metadata[0] == "block":
            from computectx.formats import QuantizedBlockWeight

            codes, scale = all_gather_outputs
            if out is not None:  # gathered into the same buffers again: out views them
                return None
            return QuantizedBlockWeight(codes.view(metadata[1]), scale, param_dtype), (codes, scale)
        (gathered,) = all_gather_outputs
        step, fp8 = metadata
        if out is not None:
            # FSDP2 gathered into the same buffer again: ``out`` already views it.
            if not isinstance(out, QuantizedWeight):
                raise TypeError(f"expected the QuantizedWeight gathered before, got {type(out)}")
            if out.fp8_step is not step:
                with torch.no_grad():
                    out.fp8_step.copy_(step)
            return None
        return QuantizedWeight(gathered.view(fp8), step, param_dtype), (gathered,)


BLOCK_ROWS = 128
"""The rows of a ``block`` weight's 128x128 scale block."""


def blocks_align(rows: int, world: int) -> bool:
    """Whether FSDP2's shards of a weight of ``rows`` rows over ``world`` ranks are each
    whole 128-row blocks: every shard the same size (``rows`` a multiple of ``world``) and
    a multiple of 128. Then each shard's 128x128 blocks are the whole weight's."""
    return rows % world == 0 and (rows // world) % BLOCK_ROWS == 0


class GatherFallbackWarning(UserWarning):
    """A weight that would all-gather as fp8 gathers high precision instead."""


def sharded_weight_of(value: torch.Tensor) -> torch.Tensor:
    """The tensor under FSDP2's DTensor wrapping (``value`` itself when not a DTensor)."""
    return value.to_local() if isinstance(value, DTensor) else value


def enable_quantized_all_gather(
    model: nn.Module, *, module_filter: Callable[[nn.Module, str], bool] | None = None
) -> int:
    """Make FSDP2 all-gather the ``QuantizedLinear`` weights of ``model`` as fp8; returns how many.

    Call it after ``convert_to_quantized`` and before ``fully_shard`` and before building the
    optimizer (the weights become new ``Parameter`` objects). Then ``fully_shard`` as usual
    and ``sync_scaling`` (which keeps the step every rank quantizes its shard with
    identical). ``module_filter(module, fqn)`` (torchao's order, as ``convert_to_quantized``'s) may
    leave some layers gathering high precision. Frozen layers (``freeze_for_serving``) have
    no weight to gather and are skipped, and so are layers whose granularity gathers high
    precision (``gathers_quantized``: ``row`` and ``mx``).

    A weight shared with another module (an output head tied to the input embedding) would
    reach that module as fp8 codes and its tie would break: it is refused with a
    ``ValueError`` that names every holder (leave it out with ``module_filter``;
    ``parallelize`` does that by itself). ``RuntimeError`` if a weight is already sharded
    (a DTensor). Everything is checked before any weight changes.
    """
    layers = [
        (name, layer)
        for name, layer in model.named_modules()
        if isinstance(layer, QuantizedLinear)
        and not layer.frozen
        and (module_filter is None or module_filter(layer, name))
        and gathers_quantized(layer.policy)
    ]
    return wrap_linear_weights(
        model,
        layers,
        WeightGatheredQuantized,
        _Gather,
        enable="enable_quantized_all_gather",
        how="as fp8",
        codes="fp8 codes",
    )
