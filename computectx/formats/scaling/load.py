"""The one rule by which an fp8 layer's scaling state is loaded.

``QuantizedLinear.load_state_dict`` (through ``_load_from_state_dict``) and
``computectx.memory.load_weights`` (through ``QuantizedLinear.plan_state_load``) both hand the
entries they were given for one layer to ``plan_scaling_load``, and do what it returns:

- every scaling tensor present (``fp8_{role}_ledger``, ``fp8_{role}_tally``, ``fp8_meta``):
  their dtypes are checked first (float32 ledgers, int64 tallies and meta: any other dtype
  raises naming the key, as a cast, torchtitan's ``export_dtype="bfloat16"`` say, has
  already rounded the amaxes, steps and counts), then the state is read against the layer's
  policy (``scaling.saved.read_saved_tensors``: another scheme, granularity, recipe, margin or
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

import contextlib
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

import torch
from torch import nn

from computectx.formats.scaling.saved import (
    SavedScaling,
    read_saved_dict,
    read_saved_tensors,
    tensor_names,
)
from computectx.recipes import Recipe

__all__ = [
    "LEGACY_KEY",
    "LoadRefusals",
    "ScalingLoad",
    "check_held_dtypes",
    "check_layer_entries",
    "check_state_dtypes",
    "copied_on_save",
    "guard_whole_loads",
    "load_refusals",
    "outer_strict",
    "plan_scaling_load",
    "refuse_whole",
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


def copied_on_save(
    destination: dict[str, Any], prefix: str, keep_vars: bool, names: Iterable[str]
) -> None:
    """In a module's ``_save_to_state_dict``, after torch's: the entries ``names`` (local)
    become copies, not views of the live buffers (unless ``keep_vars``). A saved state then
    stays as it was, and a checkpoint read into a state dict (DCP's ``load`` writes into its
    tensors) reaches the module only through ``load_state_dict``, checked: the scaling
    tensors, and the frozen weights' steps and amaxes, whose values are checked there once
    and not on each call."""
    if keep_vars:
        return
    for name in names:
        if prefix + name in destination:
            destination[prefix + name] = destination[prefix + name].clone()


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
    loads (once per model; ``convert_to_quantized`` and ``ByteLM`` call it).

    torch loads a state dict module by module, so a layer that refuses its entries would
    otherwise raise after the modules before it had loaded theirs. The check is each
    layer's own plan (``QuantizedLinear.scaling_load``), and any module's ``check_load(entries,
    prefix)`` (``computectx.nn.Router``'s bias), run on the whole state dict first; then
    what torch itself would refuse after loading the rest (``load_refusals``: a size
    mismatch, a value that is not a tensor, and under ``strict`` a missing or unexpected
    key) raises torch's ``RuntimeError`` before anything loads.

    The guard climbs: every module that holds a guarded one is guarded too, whatever the
    root a user calls ``load_state_dict`` on (an ``nn.Sequential`` around an ``MoE``, a
    wrapper around a converted model), since torch loads the root's other children first.
    Each module registered under another (attribute assignment, ``add_module``,
    ``register_module``, the containers: torch's module registration hook) is remembered
    with its parents (weakly), so a module guarded after it was placed guards the modules
    above it then, and a guarded module placed under a parent guards that parent and the
    modules above it. A module put into ``parent._modules`` directly, around torch's
    registration, is not seen."""
    if _guarded(model):
        return
    model.register_load_state_dict_pre_hook(_check_every_layer)  # type: ignore[no-untyped-call]
    object.__setattr__(model, _GUARDED, True)
    for parent in list(_PARENTS.get(model, ())):
        guard_whole_loads(parent)


_GUARDED = "_fp8_whole_loads"

_PARENTS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[nn.Module]] = (
    weakref.WeakKeyDictionary()
)
"""Each registered module's parents (weakly: neither is kept alive by this)."""


def _on_registration(parent: nn.Module, name: str, child: object) -> None:
    # torch's global module registration hook: remember the parent, and pass a guard up.
    # Not while dynamo traces (a module set as an attribute inside a compiled forward): the
    # weak maps would become guards of the graph, whose size changes as modules are freed.
    if torch.compiler.is_compiling() or not isinstance(child, nn.Module) or child is parent:
        return
    with contextlib.suppress(TypeError):  # a module made unhashable is not remembered
        _PARENTS.setdefault(child, weakref.WeakSet()).add(parent)
    if _guarded(child):
        guard_whole_loads(parent)


def _guarded(module: nn.Module) -> bool:
    # Read from the instance itself: a parent is registering its children, maybe inside its
    # own __init__, and its __getattr__ (torch.compile's wrapper forwards to _orig_mod) may
    # not answer yet.
    return bool(vars(module).get(_GUARDED, False))


torch.nn.modules.module.register_module_module_registration_hook(_on_registration)


def check_layer_entries(
    module: nn.Module, state_dict: Mapping[str, object], prefix: str = ""
) -> None:
    """Each layer's own check of its entries in ``state_dict`` (an fp8 layer's
    ``scaling_load``, any module's ``check_load``: a 4-bit layer's recipe, seed and counter, a
    router's bias), each handed its local keys and its prefix, changing nothing: what the
    whole-load guard (``guard_whole_loads``) runs before a load, and
    ``Parallel.load_state_dict`` inside its agreement.

    A module under ``module`` with a ``load_view(state_dict, prefix)`` attribute of its own
    (expert-parallel experts: ``distributed.ExpertShards``) rewrites the entries as its load
    pre-hook will (each rank's slice of sharded experts) for its own check and its
    children's; ``module``'s own view is not applied (its load pre-hooks ran already when its
    guard runs)."""
    state = state_dict
    for name, layer in module.named_modules():
        head = f"{prefix}{name}." if name else prefix
        view = vars(layer).get("load_view")
        if name and callable(view):
            state = view(state, head)
        for hook in ("scaling_load", "check_load"):  # check_load: any module's own check
            plan = getattr(layer, hook, None)
            if callable(plan):
                entries = {k[len(head) :]: v for k, v in state.items() if k.startswith(head)}
                plan(entries, head)


def _check_every_layer(
    module: nn.Module, state_dict: Mapping[str, object], prefix: str, *_: object
) -> None:
    check_layer_entries(module, state_dict, prefix)
    # A pre-hook registered after this one runs after it and may still rewrite the state
    # dict (rename old keys, say): torch's verdict cannot be foreseen from here then.
    hooks = [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()]
    if _check_every_layer in hooks and hooks[-1] is not _check_every_layer:
        return
    refusals = load_refusals(module, state_dict, prefix, strict=outer_strict())
    if refusals.refused:
        raise RuntimeError(refusals.message(module))


@dataclass(frozen=True)
class LoadRefusals:
    """What torch's ``load_state_dict`` would report for a module tree, found without
    loading: ``errors`` (raised whatever ``strict``), ``missing`` and ``unexpected`` keys
    (raised under ``strict``; listed only then)."""

    errors: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]

    @property
    def refused(self) -> bool:
        """Whether torch would raise (after loading what it could)."""
        return bool(self.errors or self.missing or self.unexpected)

    def message(self, module: nn.Module) -> str:
        """torch's message for these, and that nothing was loaded."""
        msgs = list(self.errors)
        for what, keys in (("Unexpected", self.unexpected), ("Missing", self.missing)):
            if keys:
                msgs.insert(0, f"{what} key(s) in state_dict: {', '.join(map(repr, keys))}. ")
        return (
            f"Error(s) in loading state_dict for {type(module).__name__}:\n\t"
            + "\n\t".join(msgs)
            + "\n\tNothing was loaded (checked before any module loads)"
        )


def outer_strict() -> bool:
    """The ``strict`` of the ``nn.Module.load_state_dict`` call that is running.

    torch hands ``strict=True`` to every module's ``_load_from_state_dict`` and load hook
    whatever the caller passed (the caller's flag only decides, at the end, whether missing
    and unexpected keys raise), so a check that must not be stricter than the call reads the
    flag from the call's frame. Outside such a call: ``False`` (never stricter than torch)."""
    frame: FrameType | None = sys._getframe(1)
    code = nn.Module.load_state_dict.__code__
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return False


def _own_load_keys(module: nn.Module) -> frozenset[str] | None:
    # The local names a module loads by a rule of its own (an fp8 layer's scaling tensors
    # and its version 1/2 dict: QuantizedLinear.state_load_keys), or None when its loading cannot
    # be foreseen: a _load_from_state_dict of its own that does not say which keys it takes.
    keys = getattr(module, "state_load_keys", None)
    if callable(keys):
        return frozenset((*keys(), LEGACY_KEY))
    overridden = type(module)._load_from_state_dict is not nn.Module._load_from_state_dict
    return None if overridden else frozenset()


def _foreign_pre_hooks(module: nn.Module) -> bool:
    # A load pre-hook other than this module's check may rewrite the state dict (rename,
    # drop or add keys) before the modules under it load: what they get is not foreseeable.
    return any(
        getattr(h, "hook", h) is not _check_every_layer
        for h in module._load_state_dict_pre_hooks.values()
    )


def load_refusals(
    module: nn.Module, state_dict: Mapping[str, object], prefix: str, *, strict: bool
) -> LoadRefusals:
    """What torch's ``load_state_dict`` of ``state_dict`` would refuse in ``module``'s tree
    (torch's own rules, ``nn.Module._load_from_state_dict``), without loading anything.

    Modules whose loading cannot be foreseen are left out: one with a
    ``_load_from_state_dict`` of its own (other than an fp8 layer's, which names the keys it
    loads itself), and everything under a foreign load pre-hook (it may rewrite the state
    dict); a load post-hook anywhere (it may forgive keys) leaves the key lists out. So this
    never refuses what torch would load."""
    modules = list(module.named_modules(remove_duplicate=False))
    keyed = strict and not any(m._load_state_dict_post_hooks for _, m in modules)
    errors: list[str] = []
    missing: list[str] = []
    blocked: list[str] = []
    # head -> (module, the local names it takes), or None where its keys are not judged.
    judged: dict[str, tuple[nn.Module, frozenset[str]] | None] = {}
    for name, m in modules:
        head = f"{prefix}{name}." if name else prefix
        if name and _foreign_pre_hooks(m):
            blocked.append(head)
        own = _own_load_keys(m)
        if own is None or any(head.startswith(b) for b in blocked):
            judged[head] = None
            continue
        buffers = {k: v for k, v in m._buffers.items() if k not in m._non_persistent_buffers_set}
        local = {k: v for k, v in (*m._parameters.items(), *buffers.items()) if v is not None}
        local = {k: v for k, v in local.items() if k not in own}
        judged[head] = (m, frozenset(local) | own)
        for k, param in local.items():
            key = head + k
            if key in state_dict:
                error = _entry_error(key, param, state_dict[key])
                if error is not None:
                    errors.append(error)
            elif keyed:
                missing.append(key)
        # A layer that loads its _extra_state by its own rule (Fp4Linear) may lack it.
        extra_own = LEGACY_KEY in own
        if keyed and _has_extra_state(m) and not extra_own and head + LEGACY_KEY not in state_dict:
            missing.append(head + "_extra_state")
    unexpected = [
        k for k in state_dict if keyed and k.startswith(prefix) and _unexpected(k, prefix, judged)
    ]
    return LoadRefusals(tuple(errors), tuple(missing), tuple(unexpected))


def refuse_whole(
    module: nn.Module,
    state_dict: Mapping[str, object],
    prefix: str,
    error_msgs: list[str],
    missing_keys: list[str],
    unexpected_keys: list[str],
) -> bool:
    """For a module's own ``_load_from_state_dict``: when torch would refuse its entries
    after copying the rest (``load_refusals``), record them in torch's lists (torch raises
    at the end) and return ``True``: the module loads nothing."""
    refusals = load_refusals(module, state_dict, prefix, strict=outer_strict())
    if refusals.refused:
        error_msgs.extend(refusals.errors)
        missing_keys.extend(refusals.missing)
        unexpected_keys.extend(refusals.unexpected)
    return refusals.refused


def _has_extra_state(m: nn.Module) -> bool:
    return type(m).set_extra_state is not nn.Module.set_extra_state


def _unexpected(
    key: str, head: str, judged: Mapping[str, tuple[nn.Module, frozenset[str]] | None]
) -> bool:
    # torch's rule, applied where the key ends up: down the key's path through the modules,
    # a name that is not a child with more to come, or not a local name at the end, is
    # unexpected (an _extra_state key only where the module keeps none).
    rest = key[len(head) :]
    while True:
        info = judged.get(head)
        if info is None:
            return False
        m, names = info
        first, _, more = rest.partition(".")
        if not more and "." not in rest:
            if first == "_extra_state":
                return not _has_extra_state(m) and first not in names
            return first not in names
        if first not in m._modules:
            return True
        if m._modules[first] is None:
            return False
        head, rest = f"{head}{first}.", more


def _entry_error(key: str, param: torch.Tensor, value: object) -> str | None:
    # torch's own two refusals of one entry, in its words.
    if not torch.overrides.is_tensor_like(value):  # type: ignore[no-untyped-call]
        return (
            f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
            f"object from checkpoint but received {type(value)}"
        )
    assert isinstance(value, torch.Tensor)
    if torch.nn.parameter.is_lazy(param):
        return None
    shape = value.shape
    if param.dim() == 0 and value.dim() == 1 and shape[0] == 1:
        shape = value[0].shape  # torch's allowance for checkpoints of torch 0.3
    if shape != param.shape:
        return (
            f"size mismatch for {key}: copying a param with shape {value.shape} from "
            f"checkpoint, the shape in current model is {param.shape}."
        )
    return None


def plan_scaling_load(
    entries: Mapping[str, object],
    *,
    names: Sequence[str],
    weights: Sequence[str],
    policy: Recipe,
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
    if isinstance(entries.get(LEGACY_KEY), torch.Tensor):
        raise ValueError(
            f"{what}: {prefix + LEGACY_KEY!r} is a tensor, the state of a 4-bit Fp4Linear "
            f"(an NVFP4/MXFP4 checkpoint), which does not load into an fp8 layer; convert "
            f"under the 4-bit recipe it was saved with"
        )
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
