"""FSDP2 all-gathers 3-D expert weights of a ``block`` fp8 policy as fp8: one byte per element
and one float32 step per 128x128 block of each expert.

FSDP2 shards a parameter along its first dimension; for the experts' ``gate_up`` ``(E, 2H, D)``
and ``down`` ``(E, D, H)`` that is the expert dimension, so each rank's shard is whole experts
when ``E`` is a multiple of the shard count. Each expert's 128x128 blocks then lie in one
rank's shard, and the rank quantizes them itself with no collective, exactly as the grouped GEMM
quantizes that expert (``computectx.formats.quantized_grouped_mm``: ``quantize_blocks`` of ``w[g]``,
``128x128``, the policy's step rule). ``enable_quantized_expert_gather`` turns such weights into an
``ExpertsGatheredQuantized``, whose FSDP2 extension points hand over the codes (``uint8``: gloo
refuses float8) and the block steps, and, once gathered, rebuild the weight as the codes times
their steps at the gathered dtype. The grouped GEMM quantizes that weight again, per expert;
its blocks' amaxes are the dequantized ones, so the codes come out the same (with
power-of-two steps, the steps too; with the ``amax`` rule a step may move by a float32 ulp).
On the wire: ``1 + 4/16384`` bytes per element against 4 (float32) or 2 (bf16).

Experts whose count is not a multiple of the shard count (their shards would cut experts) and
experts under other granularities gather high precision, as FSDP2 does by itself (one
``GatherFallbackWarning`` per layer for the first kind). Everywhere else the weight is its
high-precision tensor: optimizers update it and ``state_dict`` saves plain tensors.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import Self

from computectx.distributed._fp8_gather import (
    GatheredAsFp8,
    check_untied_experts,
    expert_skip,
    parameter_holders,
    plain_state_dict_hook,
)
from computectx.distributed.fp8_all_gather import BLOCK_ROWS, GatherFallbackWarning
from computectx.formats import QuantizedExperts
from computectx.formats.seam import quantize_blocks, step_rule_of
from computectx.nn.experts import GroupedExperts

__all__ = ["ExpertsGatheredQuantized", "dequantize_expert_blocks", "enable_quantized_expert_gather"]

_WEIGHTS = ("gate_up", "down")
_SAVE_PLAIN = plain_state_dict_hook(_WEIGHTS)


def dequantize_expert_blocks(
    codes: torch.Tensor, steps: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``codes`` ``(E, N, K)`` (float8) times the steps of their 128x128 blocks ``steps``
    ``(E, ceil(N/128), ceil(K/128))``, as ``dtype``."""
    _, n, k = codes.shape
    with torch.autocast(codes.device.type, enabled=False):
        whole = steps.repeat_interleave(BLOCK_ROWS, 1)[:, :n].repeat_interleave(BLOCK_ROWS, 2)
        return (codes.float() * whole[:, :, :k]).to(dtype)


class ExpertsGatheredQuantized(GatheredAsFp8):
    """A 3-D expert weight that FSDP2 all-gathers as fp8 codes and 128x128 block steps
    (module docstring). Wraps the high-precision tensor ``hp``; every other op runs on it."""

    _meta: str  # the weight's name

    def __new__(cls, hp: torch.Tensor, name: str) -> Self:
        return super().__new__(cls, hp, name)

    def __init__(self, hp: torch.Tensor, name: str) -> None:
        super().__init__(hp, name)

    # ----- FSDP2's extension points --------------------------------------------------------

    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This shard's experts quantized in 128x128 blocks: codes (uint8) and steps."""
        fp8 = getattr(module, "fp8", None)
        if not isinstance(module, GroupedExperts) or fp8 is None:
            raise TypeError(
                f"{self._meta!r} gathers as fp8 for fp8 GroupedExperts, but FSDP2 gathered it "
                f"for a {type(module).__name__} without an fp8 policy"
            )
        hp = self._hp.detach()
        fmt, rule = fp8.policy.format.forward, step_rule_of(fp8.policy)
        pieces = [
            quantize_blocks(hp[e], fmt, "128x128", rule, None, backend=fp8.backend)
            for e in range(hp.shape[0])
        ]
        grid = (-(-hp.shape[1] // BLOCK_ROWS), -(-hp.shape[2] // BLOCK_ROWS))
        codes = torch.empty(hp.shape, dtype=torch.uint8, device=hp.device)
        steps = torch.empty((hp.shape[0], *grid), dtype=torch.float32, device=hp.device)
        for e, (c, step) in enumerate(pieces):  # copies: no op here sees a float8 dtype
            codes[e].copy_(c.view(torch.uint8))
            steps[e].copy_(step)
        return (codes, steps), fmt.torch

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered experts: codes times their block steps, at ``param_dtype``."""
        codes, steps = all_gather_outputs
        with torch.no_grad():
            whole = dequantize_expert_blocks(codes.view(metadata), steps, param_dtype)
            if out is not None:
                # Gathered again (the backward's re-gather): the same shards quantized again,
                # so the same values into the weight FSDP2 kept, which the forward's GEMMs
                # saved for their backward: its version must not move.
                with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
                    out.copy_(whole)
                return None
        return whole, (whole,)


def gathers_experts_as_fp8(experts: GroupedExperts, world: int) -> bool:
    """Whether FSDP2 on ``world`` ranks gathers ``experts``' weights as fp8: a ``block``
    policy and whole experts in every shard."""
    fp8 = experts.fp8
    if not isinstance(fp8, QuantizedExperts) or fp8.policy.granularity != "block":
        return False
    return int(experts.gate_up.shape[0]) % world == 0


def enable_quantized_expert_gather(
    model: nn.Module, world: int, *, skip: frozenset[int] = frozenset()
) -> int:
    """Make FSDP2 (``world`` shards) all-gather the expert weights of every fp8 ``block``
    ``GroupedExperts`` of ``model`` as fp8; returns how many modules. Call it after
    ``convert_to_quantized`` and before ``fully_shard`` and the optimizer (the weights become new
    ``Parameter`` objects). A module either of whose weights has its ``id`` in ``skip`` (a
    ``frozenset`` of ints: expert-parallel weights, which FSDP2 does not shard, or tied ones)
    is left alone; experts whose count ``world`` does not divide gather high precision, with
    one ``GatherFallbackWarning`` each. A weight tied to another holder is refused with a
    ``ValueError`` naming every holder (wrapping each holder apart would untie them;
    ``parallelize`` skips tied weights), before any weight changes; ``TypeError`` for a
    ``skip`` that is no ``frozenset`` of ints."""
    skip = expert_skip(skip, "enable_quantized_expert_gather")
    owners = parameter_holders(model)
    chosen: list[tuple[str, GroupedExperts]] = []
    for fqn, m in model.named_modules():
        if not isinstance(m, GroupedExperts) or not isinstance(m.fp8, QuantizedExperts):
            continue
        if m.fp8.policy.granularity != "block" or any(id(getattr(m, a)) in skip for a in _WEIGHTS):
            continue
        if isinstance(m.gate_up, ExpertsGatheredQuantized | DTensor):
            continue
        check_untied_experts(owners, fqn, m, _WEIGHTS, "as fp8", "enable_quantized_expert_gather")
        chosen.append((fqn, m))
    count = 0
    for fqn, m in chosen:
        if not gathers_experts_as_fp8(m, world):
            warnings.warn(
                GatherFallbackWarning(
                    f"{fqn or 'the model'} has {m.gate_up.shape[0]} experts, which {world} "
                    f"FSDP2 shards would cut: its expert weights all-gather high precision "
                    f"(an fp8 gather needs the expert count to be a multiple of the shard "
                    f"count). The same result, more bytes."
                ),
                stacklevel=2,
            )
            continue
        for attr in _WEIGHTS:
            w = getattr(m, attr)
            name = f"{fqn}.{attr}" if fqn else attr
            wrapped = ExpertsGatheredQuantized(w.detach(), name)
            setattr(m, attr, nn.Parameter(wrapped, requires_grad=w.requires_grad))
        m.register_state_dict_post_hook(_SAVE_PLAIN)  # type: ignore[no-untyped-call]
        count += 1
    return count
