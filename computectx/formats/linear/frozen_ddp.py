"""Frozen weights left out of ``DistributedDataParallel``'s broadcasts.

A model frozen for serving holds its weights as buffers of codes and scales: a frozen fp8
``QuantizedLinear``'s ``weight_fp8`` and ``weight_step``, frozen fp8 experts' ``{name}_fp8``
and ``{name}_step`` (``ops.grouped_frozen``), and every buffer of a ``FrozenFp4Linear`` and a
``FrozenFp4Experts`` (codes, scales, amaxes, ``input_amax``). torch's
``DistributedDataParallel`` broadcasts rank 0's parameters and buffers when it wraps (and, by
default, the buffers before each forward), and gloo sends no float8 and neither gloo nor NCCL
``float4_e2m1fn_x2``: the wrap failed deep in torch (``RuntimeError: Invalid scalar type``).
DDP leaves out the names in its root module's ``_ddp_params_and_buffers_to_ignore``, read
once, when it wraps, and only the root's: so a layer frozen alone cannot record itself there.

A frozen fp8 ``QuantizedLinear`` serves with its scaling state too (its ledgers, tallies and
``fp8_meta``: under delayed scaling its input step comes from its input ledger): those are
left out as well, so that no forward of a frozen model is a collective (DDP's broadcast
before a forward would make one rank's lone forward wait for the others); the frozen
weights' broadcast sends them with the codes.

``frozen_buffer_names(model)`` names those buffers; ``exclude_frozen_from_ddp(model)`` adds
them to ``model``'s list (the names already there stay). The model-level freezes call it
(``freeze_fp4_for_serving``; ``load_serving_weights(mode="serve")``); after freezing layer by
layer (``QuantizedLinear.freeze_for_serving``, ``GroupedExperts.freeze_for_serving``,
``FrozenFp4Linear.from_fp4_linear``), call it on the model before wrapping it: on the very
module handed to DDP (an outer wrapper's list is its own), after the last freeze. Nothing of
this package runs inside ``DistributedDataParallel(...)``: a list on a child, or one made
before a later freeze, leaves the wrap failing in torch. DDP's wrap does not send the frozen
buffers either: ``computectx.distributed.broadcast_frozen`` sends rank 0's after it
(``parallelize`` does both itself).
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from computectx.formats.linear.fp4_frozen import FrozenFp4Linear, frozen_weight_name
from computectx.formats.linear.fp4_frozen_experts import FrozenFp4Experts
from computectx.formats.linear.frozen import FROZEN_BUFFERS
from computectx.formats.linear.module import QuantizedLinear
from computectx.formats.ops.grouped_frozen import frozen_expert_buffers
from computectx.formats.policy import describe

__all__ = [
    "adopt_frozen_written",
    "check_unwrapped",
    "exclude_frozen_from_ddp",
    "frozen_buffer_names",
    "frozen_recipes",
]


def frozen_buffer_names(model: nn.Module) -> list[str]:
    """The names of the frozen weights' buffers inside ``model`` (module docstring: their
    codes and scales, and a frozen fp8 linear's scaling state; each name of a module held
    under several), as ``model.named_buffers()`` gives them: what ``DistributedDataParallel``
    must leave out of its broadcasts."""
    return [
        f"{fqn}.{name}" if fqn else name
        for fqn, m in model.named_modules(remove_duplicate=False)
        for name in _frozen_here(m)
    ]


def _frozen_here(m: nn.Module) -> tuple[str, ...]:
    if isinstance(m, FrozenFp4Linear | FrozenFp4Experts):
        return tuple(name for name, _ in m.named_buffers(recurse=False))
    if isinstance(m, QuantizedLinear) and m.frozen:
        return (*FROZEN_BUFFERS, *m.scaling.tensor_names())
    return frozen_expert_buffers(m)


def frozen_recipes(model: nn.Module) -> dict[str, str]:
    """What each frozen layer inside ``model`` serves with beyond its buffers' shapes and
    dtypes, keyed by its first frozen buffer's name: a frozen fp8 linear's policy (scheme,
    recipe, margin, algo...), a frozen 4-bit layer's weight format, ``mode`` and
    ``activation_amax`` (and whether it is calibrating). Ranks that are to serve one model
    hold the same."""
    out = {}
    for fqn, m in model.named_modules(remove_duplicate=False):
        names = _frozen_here(m)
        if not names:
            continue
        if isinstance(m, QuantizedLinear):
            what = f"the fp8 policy {m.scaling.policy}"
        elif isinstance(m, FrozenFp4Linear | FrozenFp4Experts):
            what = f"{frozen_weight_name(m._code)}, mode={m.mode}, "
            what += f"activation_amax={m.activation_amax}"
            if isinstance(m, FrozenFp4Linear) and m.calibrating is not None:
                what += ", calibrating"
        else:
            continue
        out[f"{fqn}.{names[0]}" if fqn else names[0]] = what
    return out


def adopt_frozen_written(model: nn.Module) -> None:
    """Make every frozen layer inside ``model`` take its buffers as they are after a write in
    place from outside (another rank's bytes: ``computectx.distributed.broadcast_frozen``):
    a frozen fp8 linear re-reads its scaling state's host copies (``adopt_written``), a
    static 4-bit layer whether its ``input_amax`` is calibrated (finite)."""
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.frozen:
            m.scaling.adopt_written()
        elif isinstance(m, FrozenFp4Linear):
            m.adopt_written()


def exclude_frozen_from_ddp(model: nn.Module) -> tuple[str, ...]:
    """Add the frozen weights' buffers inside ``model`` (``frozen_buffer_names``) to its list
    of what ``DistributedDataParallel`` leaves out (``_ddp_params_and_buffers_to_ignore``,
    the names already there kept, each name once) and return them: ``DistributedDataParallel(
    model)`` then wraps the frozen model instead of failing in its first broadcast, and no
    forward of it broadcasts them. DDP reads the list of the module it wraps, when it wraps:
    call this on that module (not on a child, nor on a model then put under another), after
    the last freeze; then ``computectx.distributed.broadcast_frozen(ddp)`` on every rank, which
    sends rank 0's frozen buffers (DDP's wrap sends the rest of its state, not these).
    ``TypeError`` for a model that is or holds a ``DistributedDataParallel`` (DDP read its
    list when it wrapped: call this before wrapping), nothing changed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"exclude_frozen_from_ddp takes an nn.Module, got {describe(model)}")
    check_unwrapped(
        model,
        "exclude_frozen_from_ddp",
        "call this on the frozen model (its .module) before wrapping it: DDP read what it "
        "leaves out when it wrapped",
    )
    names = frozen_buffer_names(model)
    held = [*getattr(model, "_ddp_params_and_buffers_to_ignore", [])]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # type: ignore[no-untyped-call]
        model, [*held, *(n for n in names if n not in held)]
    )
    return tuple(names)


def check_unwrapped(model: nn.Module, who: str, advice: str) -> None:
    """``TypeError`` naming the first ``DistributedDataParallel`` that ``model`` is or holds,
    ``who`` refusing it and ``advice`` saying what to do instead; nothing read otherwise."""
    wrapped = [fqn for fqn, m in model.named_modules() if isinstance(m, DistributedDataParallel)]
    if wrapped:
        raise TypeError(
            f"{who}: {wrapped[0] or '<root>'!r} is a DistributedDataParallel; {advice}. "
            f"Nothing was changed"
        )
