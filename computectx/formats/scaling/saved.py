"""The fp8 scaling state as checkpoint tensors: names, the ``meta`` record, reading it back.

A ``QuantizedLinear`` keeps its scaling state in persistent buffers, so its ``state_dict`` holds
tensors only and any tensor format takes it as it is (safetensors, DCP,
``torch.load(weights_only=True)``)::

    fp8_{role}_ledger   float32  the ledger (computectx.formats.numerics.ledger), for role in ROLES
    fp8_{role}_tally    int64    [seeded, elements]
    fp8_meta            int64    [version, world_size, scheme, recipe, history_len, margin, algo,
                                  granularity, power_of_two, mx_rounding, gw_hp]

``fp8_meta`` records what the ledgers were measured under: the state version (from version 5
on as ``STATE_CODE``, ``2**24`` plus the version: an integer no float type holds, so a meta
cast to a floating dtype and back reads as another number, and loading names the cast), the
data-parallel world size and the policy fields that give the
numbers their meaning, as the integer codes below. A saved state is read back *checked
against the loading layer's policy*: another format scheme, recipe, margin, window
reduction (``algo``), granularity or granularity option raises ``ValueError`` naming both
policies (a step measured for E5M2 saturates E4M3 inputs; a step with another margin leaves
the wrong headroom), and the one field with an exact conversion, the history length, is
converted (``resize_ledger``).

Versions 1 and 2 saved the state as a dict in ``_extra_state``; ``read_saved_dict`` reads
them into the same form, with the same checks (``read_saved_tensors`` reads versions 3 to 5).
Version 4 had version 5's fields, its version written plainly. Version 3 had the first seven
fields only, all per-tensor: it reads as granularity ``tensor``. A ``row``, ``block`` or
``mx`` state saved with a nonzero margin (accepted, and ignored, before such policies were
refused) reads as margin 0, which it exactly is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
from pydantic import ValidationError

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.numerics.ledger import (
    LEDGER_SHAPE,
    TALLY_LEN,
    is_ledger,
    ledger_history,
    ledger_history_len,
    ledger_with_history,
    read_ledger,
)
from computectx.recipes import (
    POLICY_GRANULARITIES,
    DelayedScaling,
    DynamicScaling,
    Fp8Scheme,
    PolicyGranularity,
    Recipe,
)

__all__ = [
    "CAST_TAG",
    "META_LEN",
    "META_WORLD",
    "ROLES",
    "STATE_CODE",
    "STATE_VERSION",
    "Role",
    "SavedScaling",
    "check_same_recipe",
    "history_len_of",
    "meta_new",
    "read_meta",
    "read_saved_dict",
    "read_saved_tensors",
    "resize_ledger",
    "same_recipe",
    "tensor_names",
]

Role = Literal["input", "weight", "grad"]
"""The three operands of an fp8 linear, each with its own scaling state."""
ROLES: tuple[Role, ...] = ("input", "weight", "grad")
"""The operand roles of an fp8 linear, in checkpoint order."""

STATE_VERSION = 5
"""The version ``fp8_meta`` records (as ``STATE_CODE``). Versions 1 and 2 were dicts in
``_extra_state`` (``read_saved_dict``); version 3 had no granularity fields
(``META_LEN_V3``), read as per-tensor; version 4 had these fields and its version plainly."""
CAST_TAG = 1 << 24
"""Added to the version in ``fp8_meta``'s first slot (``STATE_CODE``): ``2**24 + 5`` needs 25
significant bits, more than float32 (24), bfloat16 (8) or float16 (11) hold, so a state dict
cast to a floating dtype and back (torchtitan's ``export_dtype`` casts every tensor, and
``torch.distributed.checkpoint``'s ``load`` casts a saved tensor into the model's own int64
meta) reads as another number, and the cast is refused by name."""
STATE_CODE = CAST_TAG + STATE_VERSION
"""What ``fp8_meta[0]`` holds in version 5."""
_LEDGER_KEY_V1 = "ring"  # rename.py: keep (the key version-1 checkpoints use)

META_VERSION, META_WORLD, META_SCHEME, META_RECIPE, META_HISTORY, META_MARGIN, META_ALGO = range(7)
META_GRANULARITY, META_POW2, META_MX_ROUNDING, META_GW_HP = range(7, 11)
META_LEN = 11
"""Length of ``fp8_meta``; ``META_WORLD`` is the slot of the world size."""
META_LEN_V3 = 7
"""Length of a version-3 ``fp8_meta`` (no granularity fields: per-tensor)."""
_SCHEMES = {Fp8Scheme.HYBRID: 1, Fp8Scheme.E4M3: 2, Fp8Scheme.E5M2: 3}
_RECIPES = {"delayed": 1, "dynamic": 2}
_ALGOS: dict[Literal["max", "most_recent"], int] = {"max": 1, "most_recent": 2}
_GRANULARITIES: dict[PolicyGranularity, int] = {
    g: i + 1 for i, g in enumerate(POLICY_GRANULARITIES)
}
_MX_ROUNDINGS: dict[Literal["floor", "rceil"] | None, int] = {None: 0, "rceil": 1, "floor": 2}
_FLAGS: dict[bool, int] = {False: 0, True: 1}
_K = TypeVar("_K")


def history_len_of(policy: Recipe) -> int:
    """Ledger history length a policy needs: ``history_len`` for delayed scaling, 1 for
    dynamic (which keeps only the last amax, for statistics)."""
    s = policy.scaling
    return s.history_len if isinstance(s, DelayedScaling) else 1


def tensor_names(prefix: str = "") -> tuple[str, ...]:
    """The names of the scaling tensors (``prefix`` + ``{role}_ledger``, ``{role}_tally``
    per role, then ``meta``), in the order they are registered and saved."""
    per_role = [f"{prefix}{role}_{part}" for role in ROLES for part in ("ledger", "tally")]
    return (*per_role, f"{prefix}meta")


def meta_new(policy: Recipe, world_size: int, device: torch.device | str) -> torch.Tensor:
    """A fresh ``fp8_meta`` for ``policy`` recorded at ``world_size`` ranks (int64; never an
    inference tensor)."""
    s = policy.scaling
    values = [0] * META_LEN
    values[META_VERSION] = STATE_CODE
    values[META_WORLD] = world_size
    values[META_SCHEME] = _SCHEMES[policy.format]
    values[META_RECIPE] = _RECIPES[s.kind]
    values[META_HISTORY] = s.history_len if isinstance(s, DelayedScaling) else 0
    values[META_MARGIN] = s.margin
    values[META_ALGO] = _ALGOS[s.algo] if isinstance(s, DelayedScaling) else 0
    values[META_GRANULARITY] = _GRANULARITIES[policy.granularity]
    values[META_POW2] = _FLAGS[policy.power_of_two]
    values[META_MX_ROUNDING] = _MX_ROUNDINGS[policy.mx_rounding]
    values[META_GW_HP] = _FLAGS[policy.gw_hp]
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=torch.int64, device=device)


def _decode(what: str, field: str, value: int, codes: Mapping[_K, int]) -> _K:
    for name, code in codes.items():
        if code == value:
            return name
    accepted = ", ".join(f"{code} ({name})" for name, code in codes.items())
    raise ValueError(f"{what}: fp8_meta {field} code {value} is unknown; accepted: {accepted}")


def read_meta(meta: object, what: str) -> tuple[Recipe, int]:
    """The policy and world size ``meta`` records (one host read); ``ValueError`` naming the
    bad field and what is accepted."""
    lengths = {STATE_CODE: META_LEN, 4: META_LEN, 3: META_LEN_V3}
    if not (
        isinstance(meta, torch.Tensor)
        and meta.dtype == torch.int64
        and meta.dim() == 1
        and meta.shape[0] in lengths.values()
    ):
        desc = f"{meta.dtype} {tuple(meta.shape)}" if isinstance(meta, torch.Tensor) else meta
        raise ValueError(
            f"{what}: fp8_meta must be an int64 tensor of shape ({META_LEN},) (version "
            f"{STATE_VERSION} or 4) or ({META_LEN_V3},) (version 3), got {desc!r}"
        )
    v = [int(x) for x in meta.detach().tolist()]
    code = v[META_VERSION]
    if code not in lengths and not -CAST_TAG // 2 < code < CAST_TAG // 2:
        raise ValueError(
            f"{what}: fp8_meta holds {code} in its version slot, where version "
            f"{STATE_VERSION} saves {STATE_CODE}: the state was cast to {_cast_dtype(code)} and "
            f"back (torchtitan's export_dtype, a model-wide .to(), DCP's load into the int64 "
            f"meta), which rounded its ledgers and tallies too. Load the checkpoint saved "
            f"before the cast, or leave the layer's fp8_* entries out to start its scaling fresh"
        )
    if lengths.get(code) != len(v):
        shown = STATE_VERSION if code == STATE_CODE else code
        raise ValueError(
            f"{what} has version {shown} in {len(v)} fields; this computectx reads versions "
            f"{STATE_VERSION} ({STATE_CODE} in the version slot) and 4 ({META_LEN} fields) and "
            f"3 ({META_LEN_V3}) as tensors and versions 1, 2 as an _extra_state dict"
        )
    if len(v) == META_LEN_V3:  # version 3: per-tensor, as every policy was then
        v += [_GRANULARITIES["tensor"], 0, 0, 0]
    if v[META_WORLD] < 1:
        raise ValueError(f"{what}: world_size must be an int >= 1, got {v[META_WORLD]}")
    scheme = _decode(what, "scheme", v[META_SCHEME], _SCHEMES)
    recipe = _decode(what, "recipe", v[META_RECIPE], _RECIPES)
    try:
        scaling: DelayedScaling | DynamicScaling
        if recipe == "delayed":
            algo = _decode(what, "algo", v[META_ALGO], _ALGOS)
            scaling = DelayedScaling(history_len=v[META_HISTORY], margin=v[META_MARGIN], algo=algo)
        else:
            if v[META_HISTORY] != 0 or v[META_ALGO] != 0:
                raise ValueError(
                    f"{what}: dynamic scaling records history_len 0 and algo 0 in fp8_meta, "
                    f"got {v[META_HISTORY]} and {v[META_ALGO]}"
                )
            scaling = DynamicScaling(margin=v[META_MARGIN])
    except ValidationError as e:
        bad = "; ".join(f"{err['loc'][0]}={err['input']!r}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{what}: fp8_meta holds a bad {recipe} recipe: {bad}") from None
    granularity = _decode(what, "granularity", v[META_GRANULARITY], _GRANULARITIES)
    if granularity != "tensor" and isinstance(scaling, DynamicScaling) and scaling.margin:
        # Saved before a margin was refused for row/block/mx: it was never applied there (the
        # block quantizes ignored it), so the state is exactly a margin-0 state.
        scaling = DynamicScaling(margin=0)
    pow2 = _decode(what, "power_of_two", v[META_POW2], _FLAGS)
    rounding = _decode(what, "mx_rounding", v[META_MX_ROUNDING], _MX_ROUNDINGS)
    gw_hp = _decode(what, "gw_hp", v[META_GW_HP], _FLAGS)
    try:
        policy = Recipe(
            format=scheme,
            scaling=scaling,
            granularity=granularity,
            power_of_two=pow2,
            mx_rounding=rounding,
            gw_hp=gw_hp,
        )
    except ValidationError as e:
        bad = "; ".join(str(err["msg"]) for err in e.errors())
        raise ValueError(f"{what}: fp8_meta holds a bad fp8 policy: {bad}") from None
    return policy, v[META_WORLD]


def _cast_dtype(code: int) -> str:
    # What STATE_CODE reads as after a cast to each floating dtype and back to int64.
    for dtype in FLOAT_DTYPES:
        if torch.tensor(STATE_CODE).to(dtype).to(torch.int64).item() == code:
            return str(dtype).removeprefix("torch.")
    return "a floating dtype"


def same_recipe(a: Recipe, b: Recipe) -> bool:
    """Whether state recorded under ``a`` serves ``b``: they differ at most in the history
    length (the one field converted)."""
    x, y = a.scaling, b.scaling
    same = a.format == b.format and x.kind == y.kind and x.margin == y.margin
    same = same and (a.granularity, a.power_of_two, a.mx_rounding, a.gw_hp) == (
        b.granularity,
        b.power_of_two,
        b.mx_rounding,
        b.gw_hp,
    )
    if same and isinstance(x, DelayedScaling) and isinstance(y, DelayedScaling):
        same = x.algo == y.algo
    return same


def check_same_recipe(saved: Recipe, target: Recipe, what: str) -> None:
    """``ValueError`` naming both policies unless ``saved`` and ``target`` differ at most in
    the history length (the one field converted on loading)."""
    if not same_recipe(saved, target):
        raise ValueError(
            f"{what} was recorded under the fp8 policy {saved}, but this layer runs {target}: "
            f"the scheme, granularity and its options, recipe, margin and algo must match "
            f"(only the history length is converted). Load it into a layer under {saved}, or "
            f"leave this layer's fp8_* entries out of the state dict to start its scaling fresh"
        )


def resize_ledger(ledger: torch.Tensor, history_len: int) -> torch.Tensor:
    """``ledger`` with another history length (a new tensor), keeping the newest entries.

    The history is oldest to newest: a shorter one keeps its newest ``history_len``
    entries, a longer one repeats the oldest entry in front (so the window max and the
    newest entry are unchanged). The step and the counts are kept.
    """
    n = ledger_history_len(ledger)
    chron = ledger_history(ledger)
    if history_len <= n:
        chron = chron[n - history_len :]
    else:
        chron = torch.cat([chron[:1].expand(history_len - n), chron])
    return ledger_with_history(ledger, chron)


@dataclass(frozen=True)
class SavedScaling:
    """A saved scaling state, checked and fitted to the loading layer: what it was recorded
    under, and per role a new ledger (oldest to newest, the layer's history length), a new
    tally on the layer's device, and whether it is seeded (read on the host)."""

    policy: Recipe
    world_size: int
    ledgers: dict[Role, torch.Tensor]
    tallies: dict[Role, torch.Tensor]
    seeded: dict[Role, bool]


def read_saved_tensors(
    tensors: Mapping[str, object], target: Recipe, device: torch.device | None, what: str
) -> SavedScaling:
    """Read version 3 (``tensor_names()`` without prefix -> value), checked against
    ``target``, into new tensors on ``device`` (``None``: where each saved one is);
    everything is checked before anything is built."""
    policy, world = read_meta(tensors["meta"], what)
    check_same_recipe(policy, target, what)
    n = history_len_of(policy)
    entries: dict[Role, tuple[torch.Tensor, bool, int]] = {}
    for role in ROLES:
        ledger = tensors[f"{role}_ledger"]
        if is_ledger(ledger) and ledger_history_len(ledger) != n:
            raise ValueError(
                f"{what}: fp8_{role}_ledger holds {ledger_history_len(ledger)} amaxes, but "
                f"fp8_meta records {policy}, whose ledgers hold {n}"
            )
        ledger = _checked_ledger(what, role, f"fp8_{role}_ledger", ledger)
        seeded, elements = _checked_tally(what, role, tensors[f"{role}_tally"])
        entries[role] = (ledger, seeded, elements)
    return _fitted(policy, world, entries, target, device)


def read_saved_dict(
    saved: object, target: Recipe, device: torch.device | None, what: str
) -> SavedScaling:
    """Read the ``_extra_state`` dict of versions 1 and 2, checked against ``target``.

    ``{"version", "policy", "world_size" (optional, default 1), "operands": {role:
    {"ledger" (version 1: "ring"), "idx", "seeded", "elements"}}}``; a version-1 history
    written circularly at slot ``idx`` is read from its oldest entry, at ``idx``.
    """
    if not isinstance(saved, Mapping):
        raise ValueError(
            f"{what} must be a dict (the _extra_state of versions 1, 2), got {saved!r}"
        )
    version = saved.get("version")
    if version not in (1, 2):
        raise ValueError(
            f"{what} has version {version!r}; this computectx reads versions 1, 2 as an "
            f"_extra_state dict and version {STATE_VERSION} as tensors"
        )
    text = saved.get("policy")
    try:
        policy = Recipe.parse(text) if isinstance(text, str) else None
    except ValueError as e:
        raise ValueError(f"{what}: bad policy {text!r}: {e}") from None
    if policy is None:
        raise ValueError(f"{what}: policy must be the policy's text form, got {text!r}")
    check_same_recipe(policy, target, what)
    world = saved.get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{what}: world_size must be an int >= 1, got {world!r}")
    operands = saved.get("operands")
    if not isinstance(operands, Mapping) or set(operands) != set(ROLES):
        got = sorted(operands) if isinstance(operands, Mapping) else operands
        raise ValueError(f"{what} must have operands {list(ROLES)}, got {got!r}")
    key = _LEDGER_KEY_V1 if version == 1 else "ledger"
    entries: dict[Role, tuple[torch.Tensor, bool, int]] = {}
    for role in ROLES:
        entry = operands[role]
        if not isinstance(entry, Mapping):
            raise ValueError(f"{what}: operand {role!r} must be a dict, got {entry!r}")
        ledger = _checked_ledger(what, role, f"ledger ({key!r})", entry.get(key))
        n = ledger_history_len(ledger)
        idx, seeded, elements = entry.get("idx"), entry.get("seeded"), entry.get("elements")
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
            raise ValueError(
                f"{what}: operand {role!r} idx must be an int in [0, {n}), got {idx!r}"
            )
        if not isinstance(seeded, bool):
            raise ValueError(f"{what}: operand {role!r} seeded must be a bool, got {seeded!r}")
        if isinstance(elements, bool) or not isinstance(elements, int) or elements < 0:
            raise ValueError(
                f"{what}: operand {role!r} elements must be an int >= 0, got {elements!r}"
            )
        hist = ledger_history(ledger)
        ledger = ledger_with_history(ledger, torch.cat([hist[idx:], hist[:idx]]))
        entries[role] = (ledger, seeded, elements)
    return _fitted(policy, world, entries, target, device)


def _fitted(
    policy: Recipe,
    world: int,
    entries: Mapping[Role, tuple[torch.Tensor, bool, int]],
    target: Recipe,
    device: torch.device | None,
) -> SavedScaling:
    n = history_len_of(target)
    ledgers: dict[Role, torch.Tensor] = {}
    tallies: dict[Role, torch.Tensor] = {}
    seeded_by_role: dict[Role, bool] = {}
    with torch.inference_mode(False):
        for role, (ledger, seeded, elements) in entries.items():
            on = ledger.device if device is None else device
            own = ledger.detach().to(device=on, copy=True).contiguous()
            ledgers[role] = own if ledger_history_len(own) == n else resize_ledger(own, n)
            tally = torch.tensor([int(seeded), elements], dtype=torch.int64)
            tallies[role] = tally.to(on)
            seeded_by_role[role] = seeded
    return SavedScaling(policy, world, ledgers, tallies, seeded_by_role)


def _checked_ledger(what: str, role: str, name: str, ledger: object) -> torch.Tensor:
    if not is_ledger(ledger):
        desc = (
            f"{ledger.dtype} {tuple(ledger.shape)}" if isinstance(ledger, torch.Tensor) else ledger
        )
        raise ValueError(f"{what}: operand {role!r} {name} must be {LEDGER_SHAPE}, got {desc!r}")
    # Loading reads the values once (a checkpoint is not on the training path): a NaN or
    # non-positive step would quietly turn every later output into NaN or garbage, and a
    # NaN amax in the history would poison every window max that includes it.
    values = read_ledger(ledger)
    for i, a in enumerate(values.history):
        if not (math.isfinite(a) and a >= 0):
            raise ValueError(
                f"{what}: operand {role!r} amax history must be finite and >= 0, "
                f"got {a!r} at slot {i}"
            )
    step = values.step
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"{what}: operand {role!r} step must be finite and > 0, got {step!r}")
    counts = [values.nonfinite, values.saturated]
    if not all(math.isfinite(c) and c >= 0 for c in counts):
        raise ValueError(
            f"{what}: operand {role!r} non-finite and saturated counts must be finite and "
            f">= 0, got {counts!r}"
        )
    return ledger


def _checked_tally(what: str, role: str, tally: object) -> tuple[bool, int]:
    shape = (TALLY_LEN,)
    if not (
        isinstance(tally, torch.Tensor)
        and tally.dtype == torch.int64
        and tuple(tally.shape) == shape
    ):
        desc = f"{tally.dtype} {tuple(tally.shape)}" if isinstance(tally, torch.Tensor) else tally
        raise ValueError(
            f"{what}: fp8_{role}_tally must be an int64 tensor of shape {shape} "
            f"([seeded, elements]), got {desc!r}"
        )
    seeded, elements = (int(v) for v in tally.detach().tolist())
    if seeded not in (0, 1) or elements < 0:
        raise ValueError(
            f"{what}: fp8_{role}_tally must hold seeded 0 or 1 and elements >= 0, got "
            f"[{seeded}, {elements}]"
        )
    return bool(seeded), elements
