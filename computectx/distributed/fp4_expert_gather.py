"""FSDP2 all-gathers 4-bit experts' weights in 4 bits: each rank quantizes its own experts.

FSDP2 shards a parameter along its first dimension; for the experts' ``gate_up`` ``(E, 2H,
D)`` and ``down`` ``(E, D, H)`` that is the expert dimension, so each rank's shard is whole
experts when ``E`` is a multiple of the shard count. The 4-bit grouped GEMM quantizes each
expert on its own, with its own amax (``Fp4Experts``): a rank makes its experts' operands
alone, with no collective (NVFP4 included: no expert's amax spans ranks).
``enable_fp4_expert_gather(model)`` turns the weights of every ``GroupedExperts`` that runs
through an ``Fp4Experts`` into an ``ExpertsGatheredFp4``, whose FSDP2 extension points hand
over, per expert, ``W[e]``'s codes and block scales (``uint8``: gloo refuses float4 and
float8), NVFP4's float32 amax, and where blocks do not transpose (NVFP4 1x16, MXFP4) ``W[e]ᵀ``'s
codes and scales, the dgrad's operand; once gathered they are an ``Fp4GatheredExperts``, every
expert's forward and dgrad operands bit for bit those ``Fp4Experts`` makes of it, which its
grouped GEMM and dgrad multiply with as they are (``computectx::fp4_grouped_mm_gathered``). The
gradient is an ordinary tensor, reduce-scattered by FSDP2 as before.

On the wire, per weight element: NVFP4 16x16 tiles 0.5039 bytes (plus 4 an expert), NVFP4
1x16 1.125 (plus 4 an expert) and MXFP4 1.0625, against 2 (bf16) or 4 (float32) bytes. Experts
whose shards would cut an expert (``E`` not a multiple of the shard count; FSDP2 pads the last
shard) or that FSDP2 shards along another dimension (a ``shard_placement_fn`` giving
``Shard(1)`` or ``Shard(2)``) gather high precision instead, with one ``GatherFallbackWarning``
per weight and process; the experts then quantize the gathered weight themselves, as without
this module.

Each shard is quantized from its high-precision values, whatever FSDP2's ``param_dtype``;
everywhere else an ``ExpertsGatheredFp4`` is its high-precision tensor: optimizers update it,
``state_dict`` saves plain tensors (DTensors of plain tensors under FSDP2).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import Self

from computectx.distributed._fp8_gather import (
    GatheredAsFp8,
    GatherMeta,
    check_untied_experts,
    expert_skip,
    hp_gathered,
    hp_inputs,
    parameter_holders,
    plain_state_dict_hook,
    shard_world,
    warn_fallback,
)
from computectx.distributed.fp8_all_gather import GatherFallbackWarning
from computectx.formats import Fp4Experts
from computectx.nn.experts import GroupedExperts

__all__ = ["ExpertsGatheredFp4", "enable_fp4_expert_gather"]

_WEIGHTS = GroupedExperts.NAMES
_SAVE_PLAIN = plain_state_dict_hook(_WEIGHTS)


def _fp4_of(name: str, module: nn.Module) -> Fp4Experts:
    fp4 = getattr(module, "fp8", None)
    if not isinstance(module, GroupedExperts) or not isinstance(fp4, Fp4Experts):
        raise TypeError(
            f"{name!r} gathers in 4 bits for GroupedExperts running through Fp4Experts, but "
            f"FSDP2 gathered it for a {type(module).__name__} without them"
        )
    return fp4


class ExpertsGatheredFp4(GatheredAsFp8):
    """A 3-D expert weight that FSDP2 all-gathers as each expert's 4-bit operands (module
    docstring). Wraps the high-precision tensor ``hp``; every other op runs on it. Built by
    ``enable_fp4_expert_gather``."""

    _meta: GatherMeta

    def __new__(cls, hp: torch.Tensor, meta: GatherMeta) -> Self:
        return super().__new__(cls, hp, meta)

    def __init__(self, hp: torch.Tensor, meta: GatherMeta) -> None:
        super().__init__(hp, meta)

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This shard's experts quantized, each with its own amax: their operands as uint8
        (and NVFP4's float32 amaxes); the high-precision shard where shards cut experts."""
        name = self._meta.name
        spec = _fp4_of(name, module).experts_gather
        hp = self._hp.detach()
        world = shard_world(mesh)
        if tuple(hp.shape[1:]) != tuple(outer_size[1:]):
            # Shard(1) or Shard(2): FSDP2 puts the pieces back along that dim itself, from
            # inputs of the shard's own shape (even shards: FSDP2 refuses others there).
            why = (
                "experts' rows (FSDP2 shards it along another dim than the experts; a 4-bit "
                "experts weight gathers in 4 bits in shards of whole experts, Shard(0)). The "
                "experts quantize the gathered weight themselves."
            )
            warn_fallback(GatherFallbackWarning, name, outer_size, world, why)
            dtype = getattr(mp_policy, "param_dtype", None) or hp.dtype
            return (hp.to(dtype),), ("hp",)
        if not spec.aligns_experts(outer_size, world):
            # The same on every rank (the shape and the shard count).
            why = (
                f"experts (a 4-bit experts weight gathers in 4 bits when its expert count is "
                f"a multiple of the shard count, and its N and K of {spec.rows} and "
                f"{spec.how.block}). The experts quantize the gathered weight themselves."
            )
            warn_fallback(GatherFallbackWarning, name, outer_size, world, why)
            return hp_inputs(hp, outer_size, world, mp_policy)
        return spec.expert_inputs(hp), ("fp4", spec)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered operands as an ``Fp4GatheredExperts`` of the weight's dtype (or the
        high-precision weight, where shards cut experts)."""
        if metadata[0] == "hp":
            return hp_gathered(all_gather_outputs, out)
        if out is not None:
            # Gathered again into the same buffers (amaxes included): out views them.
            return None
        outputs = tuple(all_gather_outputs)
        return metadata[1].experts(outputs, param_dtype), outputs


def enable_fp4_expert_gather(model: nn.Module, *, skip: frozenset[int] = frozenset()) -> int:
    """Make FSDP2 all-gather the expert weights of every ``GroupedExperts`` of ``model`` that
    runs through an ``Fp4Experts`` in 4 bits; returns how many modules.

    Call it after ``convert_to_quantized`` and before ``fully_shard`` and the optimizer (the
    weights become new ``Parameter`` objects); ``parallelize`` does this under
    ``strategy="fsdp"`` (``fp8_all_gather=False`` leaves it out). A module either of whose
    weights has its ``id`` in ``skip`` (a ``frozenset`` of ints: expert-parallel weights,
    which FSDP2 does not shard, or tied ones) is left alone, and so are weights already
    wrapped. A weight tied to another holder (the same Parameter in two modules) is refused
    with a ``ValueError`` naming every holder (wrapping each holder apart would untie them;
    ``parallelize`` skips tied weights: they gather high precision). ``RuntimeError`` if a
    weight is already sharded (a DTensor); ``TypeError`` for a ``model`` that is no module or
    a ``skip`` that is no ``frozenset`` of ints. Checked before any weight changes."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"enable_fp4_expert_gather takes the converted nn.Module, got {type(model).__name__}"
        )
    skip = expert_skip(skip, "enable_fp4_expert_gather")
    owners = parameter_holders(model)
    chosen: list[tuple[str, GroupedExperts]] = []
    for fqn, m in model.named_modules():
        if not isinstance(m, GroupedExperts) or not isinstance(m.fp8, Fp4Experts):
            continue
        if any(id(getattr(m, a)) in skip for a in _WEIGHTS):
            continue
        if isinstance(m.gate_up, ExpertsGatheredFp4):
            continue
        check_untied_experts(owners, fqn, m, _WEIGHTS, "in 4 bits", "enable_fp4_expert_gather")
        for attr in _WEIGHTS:
            if isinstance(getattr(m, attr), DTensor):
                where = f"{fqn}.{attr}" if fqn else attr
                raise RuntimeError(
                    f"{where} is already sharded (a DTensor): call enable_fp4_expert_gather "
                    f"before fully_shard"
                )
        chosen.append((fqn, m))
    for fqn, m in chosen:
        for attr in _WEIGHTS:
            w = getattr(m, attr)
            name = f"{fqn}.{attr}" if fqn else attr
            wrapped = ExpertsGatheredFp4(w.detach(), GatherMeta(name))
            setattr(m, attr, nn.Parameter(wrapped, requires_grad=w.requires_grad))
        m.register_state_dict_post_hook(_SAVE_PLAIN)  # type: ignore[no-untyped-call]
    return len(chosen)
