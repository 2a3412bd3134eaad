"""The one rule by which an fp8 layer's scaling state is loaded.

``Fp8Linear.load_state_dict`` (through ``_load_from_state_dict``) and
``computectx.memory.load_weights`` (through ``Fp8Linear.plan_state_load``) both hand the
entries they were given for one layer to ``plan_scaling_load``, and do what it returns:

- every scaling tensor present (``fp8_{role}_ledger``, ``fp8_{role}_tally``, ``fp8_meta``):
  their dtypes are checked first (float32 ledgers, int64 tallies and meta: any other dtype
  raises naming the key, as a cast, torchtitan's ``export_dtype="bfloat16"`` say, has
  already rounded the amaxes, steps and counts), then the state is read against the layer's
  policy (``state.saved.read_saved_tensors``: another scheme, granularity, recipe, margin or
  algo raises naming both policies; another history length is converted) and installed;
- some of them present: ``ValueError`` (a scaling state loads whole);
- none present, the version 1/2 ``_extra_state`` dict present: read the same way;
- none present, the weight present (an ``nn.Linear`` checkpoint, the usual path: convert,
  then load the high-precision weights): the scaling state starts fresh, as the ledgers
  hold amaxes of the weight being replaced;
- nothing of the layer's present (a partial state dict): nothing changes.

Everything is read and checked before anything changes; the plan holds new tensors only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from computectx.fp8.state.saved import (
    SavedScaling,
    read_saved_dict,
    read_saved_tensors,
    tensor_names,
)
from computectx.recipes import Fp8Policy

__all__ = [
    "LEGACY_KEY",
    "ScalingLoad",
    "check_held_dtypes",
    "check_state_dtypes",
    "guard_whole_loads",
    "plan_scaling_load",
]

LEGACY_KEY = "_extra_state"
"""Where versions 1 and 2 kept the scaling state (a dict)."""


@dataclass(frozen=True)
class ScalingLoad:
    """What loading does to a layer's scaling state: ``install`` ``saved`` (read and fitted
    to the layer's policy), start ``fresh``, or ``keep`` it."""

    action: Literal["install", "fresh", "keep"]
    saved: SavedScaling | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_state_dtypes(tensors: Mapping[str, object], names: Sequence[str], prefix: str) -> None:
    """``ValueError`` naming the key and both dtypes when a scaling tensor among ``tensors``
    (``names``: the layer's local names, in ``tensor_names()`` order) is a tensor at another
    dtype than the one saved: float32 ledgers, int64 tallies and ``fp8_meta``."""
    for bare, name in zip(tensor_names(), names, strict=True):
        value = tensors.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        want = torch.float32 if bare.endswith("ledger") else torch.int64
        if value.dtype != want:
            raise ValueError(
                f"{prefix}{name} is {_dtype_name(value.dtype)}, but fp8 scaling state is "
                f"saved as {_dtype_name(want)} and loads only at that dtype: a cast (torchtitan's "
                f"export_dtype, a model-wide .to(), a checkpoint converted to another dtype) "
                f"has already rounded its amaxes, steps and counts, so loading it would change "
                f"the layer's scaling with no sign. Load the checkpoint saved before the cast, "
                f"or leave the layer's fp8_* entries out to start its scaling fresh"
            )


def check_held_dtypes(
    entries: Mapping[str, object], held: Mapping[str, torch.Tensor], prefix: str
) -> None:
    """``ValueError`` naming the key when an entry is a tensor at another dtype than the
    buffer ``held`` under its name (a frozen layer's ``weight_step``, float32, and
    ``weight_fp8``, its fp8 format): torch's ``load_state_dict`` would copy it in at the
    buffer's dtype, rounded or reinterpreted with no sign."""
    for name, own in held.items():
        value = entries.get(name)
        if isinstance(value, torch.Tensor) and value.dtype != own.dtype:
            raise ValueError(
                f"{prefix}{name} is {_dtype_name(value.dtype)}, but this frozen fp8 layer "
                f"holds it as {_dtype_name(own.dtype)} and loads it only at that dtype (a cast "
                f"has already rounded it)"
            )


def guard_whole_loads(model: nn.Module) -> None:
    """Make ``model.load_state_dict`` check every fp8 layer's entries before any module
    loads (once per model; ``convert_to_fp8`` and ``ByteLM`` call it).

    torch loads a state dict module by module, so a layer that refuses its entries would
    otherwise raise after the modules before it had loaded theirs. The check is each
    layer's own plan (``Fp8Linear.scaling_load``), and any module's ``check_load(entries,
    prefix)`` (``computectx.nn.Router``'s bias), run on the whole state dict first."""
    if getattr(model, _GUARDED, False):
        return
    model.register_load_state_dict_pre_hook(_check_every_layer)  # type: ignore[no-untyped-call]
    object.__setattr__(model, _GUARDED, True)


_GUARDED = "_fp8_whole_loads"


def _check_every_layer(
    module: nn.Module, state_dict: Mapping[str, object], prefix: str, *_: object
) -> None:
    for name, layer in module.named_modules():
        head = f"{prefix}{name}." if name else prefix
        for hook in ("scaling_load", "check_load"):  # check_load: any module's own check
            plan = getattr(layer, hook, None)
            if callable(plan):
                entries = {k[len(head) :]: v for k, v in state_dict.items() if k.startswith(head)}
                plan(entries, head)


def plan_scaling_load(
    entries: Mapping[str, object],
    *,
    names: Sequence[str],
    weights: Sequence[str],
    policy: Fp8Policy,
    device: torch.device | None,
    prefix: str,
) -> ScalingLoad:
    """The plan for one layer given ``entries`` (its local names -> values, as a state dict
    or a checkpoint holds them): ``names`` are its scaling tensors' local names (in
    ``tensor_names()`` order), ``weights`` the names whose presence means a new weight
    (``weight``; a frozen layer's ``weight_fp8``, ``weight_step``). ``prefix`` is the
    layer's key prefix (``"blocks.0.mlp.up."``), for messages. New tensors go on ``device``
    (``None``: where each saved one is). Raises ``ValueError`` naming the keys, dtypes or
    both policies; changes nothing."""
    given = [n for n in names if n in entries]
    layer = prefix[:-1] or "the layer"
    what = f"the fp8 scaling state of {layer!r}"
    if given and (len(given) < len(names) or LEGACY_KEY in entries):
        full = [prefix + n for n in names]
        present = [prefix + n for n in given]
        extra = sorted(set(full) - set(present)) or [prefix + LEGACY_KEY]
        raise ValueError(
            f"{what}: the state dict holds {present} and "
            f"{'not ' if len(given) < len(names) else ''}{extra}; a scaling state loads "
            f"whole, from the tensors {full} or from a version 1/2 {prefix + LEGACY_KEY!r}"
        )
    if given:
        check_state_dtypes(entries, names, prefix)
        found = {b: entries[n] for b, n in zip(tensor_names(), names, strict=True)}
        return ScalingLoad("install", read_saved_tensors(found, policy, device, what))
    if LEGACY_KEY in entries:
        return ScalingLoad("install", read_saved_dict(entries[LEGACY_KEY], policy, device, what))
    if any(w in entries for w in weights):
        return ScalingLoad("fresh")
    return ScalingLoad("keep")
