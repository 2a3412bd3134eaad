"""``freeze_fp4_for_serving``: every ``Fp4Linear`` of a converted model replaced by its
``FrozenFp4Linear`` (``linear.fp4_frozen``) and every 4-bit experts module's ``Fp4Experts`` by
its ``FrozenFp4Experts`` (``linear.fp4_frozen_experts``), in place, for serving."""

from __future__ import annotations

import sys

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from computectx.formats.linear.fp4 import Fp4Linear
from computectx.formats.linear.fp4_experts import Fp4Experts
from computectx.formats.linear.fp4_frozen import FrozenFp4Linear
from computectx.formats.linear.fp4_frozen_experts import FrozenFp4Experts, install_frozen_experts
from computectx.formats.linear.fp4_serving import ActivationAmax, ServeMode, check_serving
from computectx.formats.linear.frozen_ddp import exclude_frozen_from_ddp
from computectx.formats.policy import describe, refuse_sharded

__all__ = ["freeze_fp4_for_serving"]


def freeze_fp4_for_serving(
    model: nn.Module,
    mode: ServeMode = "weight_only",
    *,
    activation_amax: ActivationAmax = "per_row",
) -> tuple[str, ...]:
    """Replace every ``Fp4Linear`` inside ``model`` by ``FrozenFp4Linear.from_fp4_linear(layer,
    mode, activation_amax=...)`` and every 4-bit experts module's ``Fp4Experts`` (an MoE's
    ``GroupedExperts``) by ``FrozenFp4Experts.from_fp4_experts`` (its high-precision expert
    weights dropped), in place; return the names frozen (linears, then experts modules), in
    module order.

    ``mode``: ``"weight_only"`` (the 4-bit weight dequantized to the input's dtype, torch's
    GEMM: any device) or ``"w4a4"`` (the inputs quantized to nearest at every call, the 4-bit
    GEMM); ``activation_amax``: NVFP4 W4A4's rule, ``"per_row"`` (batch-invariant: each row's
    output is the ``Fp4Linear``'s on that row alone) or ``"per_tensor"`` (the ``Fp4Linear``'s
    forward on the whole batch, bit for bit) or ``"static"`` (one amax per layer, calibrated
    next by ``calibrate_fp4_activations``; linears only: 4-bit experts refuse it). The
    high-precision weights go with the layers they leave (each bias stays, shared); a layer held
    under several names is replaced by one frozen layer under all of them. Every layer and
    experts module is frozen before any is put in place: an error leaves the model as it was.
    A layer or experts module frozen already the same way is left as it is (not named: a second
    call on a frozen model returns ``()``); frozen another way, ``ValueError`` naming it.
    ``ValueError`` for a bad ``mode`` or ``activation_amax``, for a model holding neither an
    ``Fp4Linear`` nor 4-bit experts and for a layer that cannot be frozen (a NaN in its weight:
    named); ``TypeError`` for a model that is one (freeze it with
    ``FrozenFp4Linear.from_fp4_linear`` and put that in its place) and for a model wrapped in
    ``DistributedDataParallel`` (freeze ``model.module`` before wrapping, or serve without DDP:
    its reducer would keep the dropped weights); ``ValueError`` for a layer or experts module
    whose weights FSDP2 sharded (DTensors, ``parallelize(strategy="fsdp")``: freeze before
    sharding, or gather into an unsharded model first).

    The frozen layers' and experts' buffers (codes, scales, amaxes) are added to ``model``'s
    list of what ``DistributedDataParallel`` leaves out (``exclude_frozen_from_ddp``), on
    every call that returns, a second one included: ``DistributedDataParallel(model)``
    wraps the frozen model (data-parallel evaluation or inference) instead of failing in its
    first broadcast (gloo and NCCL send no ``float4_e2m1fn_x2``, gloo no float8), and no
    forward of it broadcasts them (wrap ``model`` itself: DDP reads the list of the module it
    wraps only). DDP's wrap does not send them: freeze the same trained weights on every rank,
    or call ``computectx.distributed.broadcast_frozen(ddp)`` on every rank after wrapping.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"freeze_fp4_for_serving takes an nn.Module, got {describe(model)}")
    check_serving(mode, activation_amax, "freeze_fp4_for_serving", static=True)
    wrapped = [fqn for fqn, m in model.named_modules() if isinstance(m, DistributedDataParallel)]
    if wrapped:
        raise TypeError(
            f"freeze_fp4_for_serving: {wrapped[0] or '<root>'!r} is a DistributedDataParallel; "
            f"freeze the model inside it (its .module) before wrapping: DDP's reducer holds "
            f"the high-precision weights a freeze drops (their memory stays, and a backward "
            f"waits for their gradients); serving needs no DDP"
        )
    if isinstance(model, Fp4Linear):
        raise TypeError(
            "freeze_fp4_for_serving replaces the Fp4Linear layers inside a model; the model is "
            "one itself: use FrozenFp4Linear.from_fp4_linear(layer, mode) in its place"
        )
    found = [(fqn, m) for fqn, m in model.named_modules(remove_duplicate=False)]
    _refuse_sharded(found)
    layers = [(fqn, m) for fqn, m in found if isinstance(m, Fp4Linear)]
    experts = _frozen_experts(found, mode, activation_amax)
    if not layers and not experts and _frozen_already(found, mode, activation_amax):
        exclude_frozen_from_ddp(model)
        return ()
    if not layers and not experts:
        raise ValueError(
            f"freeze_fp4_for_serving: {type(model).__name__} holds no Fp4Linear or 4-bit "
            f"experts; convert it "
            f"under a 4-bit recipe first (convert_to_quantized with ComputeCtx.from_flag("
            f"'nvfp4', device), or a model built under such a ctx)"
        )
    frozen: dict[int, FrozenFp4Linear] = {}
    for fqn, layer in layers:
        if id(layer) not in frozen:
            try:
                frozen[id(layer)] = FrozenFp4Linear.from_fp4_linear(
                    layer, mode, activation_amax=activation_amax
                )
            except ValueError as err:  # a NaN in the weight: which layer, of many
                raise ValueError(
                    f"freeze_fp4_for_serving: {fqn!r} cannot be frozen ({err}); the model was "
                    f"left unchanged"
                ) from err
    for fqn, layer in layers:
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent), name, frozen[id(layer)])
    for module, frozen_experts in experts.values():
        install_frozen_experts(module, frozen_experts)
    exclude_frozen_from_ddp(model)
    return tuple(fqn for fqn, _ in layers) + tuple(experts)


def _frozen_experts(
    found: list[tuple[str, nn.Module]],
    mode: ServeMode,
    activation_amax: ActivationAmax,
) -> dict[str, tuple[nn.Module, FrozenFp4Experts]]:
    """Each 4-bit experts module among ``found`` (one holding an ``Fp4Experts`` child, by its
    first name) with its frozen twin, built and not yet put in place. Such a module names its
    expert weights by ``expert_weights()`` (``GroupedExperts``': only converters that run 4
    bits, ``computectx.nn``'s, register an ``Fp4Experts``)."""
    out: dict[str, tuple[nn.Module, FrozenFp4Experts]] = {}
    seen: set[int] = set()
    for fqn, module in found:
        setting = next((c for c in module.children() if isinstance(c, Fp4Experts)), None)
        if setting is None or id(module) in seen:
            continue
        seen.add(id(module))
        named = getattr(module, "expert_weights", None)
        weights = named() if callable(named) else None
        if not isinstance(weights, dict):
            raise ValueError(
                f"freeze_fp4_for_serving: {fqn!r} ({type(module).__name__}) holds an "
                f"Fp4Experts but names no expert weights (expert_weights(), as GroupedExperts "
                f"does); the model was left unchanged"
            )
        try:
            out[fqn] = (
                module,
                FrozenFp4Experts.from_fp4_experts(
                    setting, weights, mode, activation_amax=activation_amax
                ),
            )
        except ValueError as err:  # a NaN in an expert: which module, of many
            raise ValueError(
                f"freeze_fp4_for_serving: {fqn!r} cannot be frozen ({err}); the model was "
                f"left unchanged"
            ) from err
    return out


def _frozen_already(
    found: list[tuple[str, nn.Module]], mode: ServeMode, activation_amax: ActivationAmax
) -> bool:
    """Whether ``found`` holds frozen 4-bit layers or experts, every one frozen under ``mode``
    and ``activation_amax`` (a second ``freeze_fp4_for_serving``: nothing to do, as a second
    ``GroupedExperts.freeze_for_serving``); ``ValueError`` naming the first frozen otherwise."""
    frozen = [(f, m) for f, m in found if isinstance(m, FrozenFp4Linear | FrozenFp4Experts)]
    for fqn, m in frozen:
        if (m.mode, m.activation_amax) != (mode, activation_amax):
            raise ValueError(
                f"freeze_fp4_for_serving: {fqn or '<root>'!r} is frozen already (mode="
                f"{m.mode!r}, activation_amax={m.activation_amax!r}), not as asked ({mode!r}, "
                f"{activation_amax!r}); freeze a copy made before freezing. Nothing was changed"
            )
    return bool(frozen)


def _refuse_sharded(found: list[tuple[str, nn.Module]]) -> None:
    """``refuse_sharded`` for each ``Fp4Linear`` or 4-bit experts module among ``found``, each
    one under an FSDP2 module (``fully_shard``) managed by it whatever its weights are now."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module is sharded
    roots = [fqn for fqn, m in found if fsdp is not None and isinstance(m, fsdp.FSDPModule)]
    for fqn, m in found:
        if isinstance(m, Fp4Linear) or any(isinstance(c, Fp4Experts) for c in m.children()):
            managed = any(not r or fqn == r or fqn.startswith(f"{r}.") for r in roots)
            refuse_sharded(f"freeze_fp4_for_serving: {fqn or '<root>'!r}", m, managed)
