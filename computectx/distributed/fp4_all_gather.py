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

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import Self

from computectx.distributed._fp8_gather import GatheredAsFp8, plain_state_dict_hook
from computectx.distributed.collectives import GroupAmax
from computectx.distributed.fp8_all_gather import GatherFallbackWarning, parameter_holders
from computectx.formats import Fp4Linear

__all__ = ["WeightGatheredFp4", "enable_fp4_all_gather"]


class _Gather:
    """What a weight's shards share (its ``GatheredAsFp8`` meta): its name and the whole
    weight's amax of the last forward gather (NVFP4), which the backward's re-gather reuses.

    The layer is not kept here: FSDP2 hands the owning module to each gather, so a copy of
    the model (``copy.deepcopy``) quantizes through its own layers.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.forward_amax: torch.Tensor | None = None

    def layer(self, module: nn.Module) -> Fp4Linear:
        if not isinstance(module, Fp4Linear):
            raise TypeError(
                f"{self.name!r} gathers in 4 bits for an Fp4Linear, but FSDP2 gathered it for "
                f"a {type(module).__name__}"
            )
        return module


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

    def _label(self) -> str:
        return self._meta.name

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
        spec = g.layer(module).weight_gather
        hp = self._hp.detach()
        world = mesh.size(mesh.ndim - 1)
        if not spec.aligns(outer_size[0], world):
            # The same on every rank (the shape and the shard count): no rank reduces.
            _warn_fallback(g.name, outer_size, world, spec.rows)
            dtype = getattr(mp_policy, "param_dtype", None) or hp.dtype
            return (_padded(hp.to(dtype), outer_size, world),), ("hp",)
        amax = None
        if spec.needs_amax:
            if _in_backward() and g.forward_amax is not None:
                amax = g.forward_amax  # the forward's: the weight has not changed since
            else:
                # Every rank of the shard group gathers this unit together: one MAX of one
                # float, the whole weight's amax (its finite elements'), on every rank.
                group = mesh.get_group(mesh.ndim - 1)
                amax = GroupAmax(group)(spec.shard_amax(hp))
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
            (whole,) = all_gather_outputs
            return None if out is not None else (whole, (whole,))
        _, spec, amax = metadata
        if out is not None:  # gathered into the same buffers again: out views them
            spec.refresh(out, amax)
            return None
        outputs = tuple(all_gather_outputs)
        return spec.weight(outputs, amax, param_dtype), outputs


_SAVE_PLAIN = plain_state_dict_hook(("weight",))

_fallback_warned: set[tuple[str, tuple[int, ...], int]] = set()
"""The weights (name, shape, shard count) already warned about in this process."""


def _warn_fallback(name: str, outer_size: torch.Size, world: int, rows: int) -> None:
    key = (name, tuple(outer_size), world)
    if key in _fallback_warned:
        return
    _fallback_warned.add(key)
    warnings.warn(
        GatherFallbackWarning(
            f"{name!r} ({tuple(outer_size)}) all-gathers high precision: its {world} FSDP2 "
            f"shards of {-(-outer_size[0] // world)} rows cut its 4-bit blocks (a 4-bit "
            f"weight gathers in 4 bits when its rows are a multiple of {rows} x the shard "
            f"count). The layer quantizes the gathered weight itself. Warned once per weight "
            f"and process; every weight that falls back gets its own warning."
        ),
        stacklevel=2,
    )


def _in_backward() -> bool:
    # The autograd engine runs FSDP2's pre-backward re-gather inside a graph task.
    task: int = torch._C._current_graph_task_id()
    return task != -1


def _padded(data: torch.Tensor, outer_size: torch.Size, world: int) -> torch.Tensor:
    # FSDP2 pads uneven shards along dim 0 to ceil(rows / world) and expects inputs that size.
    rows = -(-outer_size[0] // world)
    if data.shape[0] == rows:
        return data
    out = data.new_zeros((rows, *data.shape[1:]))
    out[: data.shape[0]].copy_(data)
    return out


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
    weight is already sharded (a DTensor). Everything is checked before any weight changes.
    """
    chosen: list[tuple[str, Fp4Linear]] = []
    owners = parameter_holders(model)
    for name, layer in model.named_modules():
        if not isinstance(layer, Fp4Linear):
            continue
        if module_filter is not None and not module_filter(layer, name):
            continue
        w = layer.weight
        if isinstance(w, WeightGatheredFp4):
            continue
        where = f"{name}.weight" if name else "weight"
        if isinstance(w, DTensor):
            raise RuntimeError(
                f"{where} is already sharded (a DTensor): call enable_fp4_all_gather before "
                f"fully_shard"
            )
        holders = owners.get(id(w), [])
        if len(holders) > 1:
            raise ValueError(
                f"{where} is tied: the same Parameter is {' and '.join(holders)}. Gathering it "
                f"in 4 bits would hand 4-bit codes to every holder and make it a new "
                f"Parameter, breaking the tie; leave the layer out (module_filter=lambda "
                f"module, fqn: fqn != {name!r}) or untie the weights"
            )
        chosen.append((where, layer))
    for where, layer in chosen:
        w = layer.weight
        layer.weight = nn.Parameter(
            WeightGatheredFp4(w.detach(), _Gather(where)), requires_grad=w.requires_grad
        )
        layer.register_state_dict_post_hook(_SAVE_PLAIN)  # type: ignore[no-untyped-call]
    return len(chosen)
