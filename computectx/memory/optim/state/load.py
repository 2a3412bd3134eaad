"""Loading an optimizer state dict saved under any format, or in the decoded form.

``load_plan`` checks a state dict and brings its per-parameter entries into our stored form
(``store``), changing nothing: packed parts are checked by the codec and kept bit for bit
under the same ``optim_state``, converted (decoded, encoded as ours, with a ``UserWarning``
naming both formats and the bound) under another, and a plain float tensor of the
parameter's shape (the decoded form) is encoded. ``LoadPlan.finish`` installs the result.

**The decoded form** (``computectx.distributed.optimizer_state_dict``). An optimizer whose
state is packed (``int8``, ``fp8``, ``int4`` codes with their scales, or ``bf16`` values)
keeps each packed state tensor in ``optimizer.state_dict()["state"][i]`` as parts,
``"exp_avg.codes"``, ``"exp_avg.absmax"``, ..., laid out by this rank's blocks. Parts cannot
be resharded: a block of one world size is not a block of another, and a rank-1 scale
(``int4`` second moments) is a per-row and per-column maximum of the rank's own rows. So the
form ``optimizer_state_dict`` gives holds every packed entry *decoded*: a float32 tensor of
the (local) master's shape under the plain state name (``"exp_avg"``), which
``torch.distributed.checkpoint`` wraps, reshards and reassembles as it does float32 state;
loading encodes it again with the loading ranks' blocks
(``OffloadedOptimizer.load_state_dict`` accepts a plain float tensor where parts would be).

What that costs and what it keeps:

- While the form exists (between ``optimizer_state_dict`` and ``save``, or ``load`` and
  ``set_optimizer_state_dict``) this rank holds its state at float32: what ``f32`` state
  would hold. The optimizer's own state stays packed.
- Decoding is exact (``decode`` gives the values the codes stand for). Encoding the decoded
  values again re-forms the same codes and scales wherever the loading rank's blocks are the
  saving rank's blocks: the same world size, or shards whose boundaries fall on block
  boundaries (and, for ``int4`` second moments, the same rows). Elsewhere a loaded value
  differs from the saved one by at most ``round_trip_bound(saved, optim_state, kind)``
  (``computectx.memory.optim.state.codecs``): one more quantization, no more.
- ``"optim_state"`` (the text form of the saving optimizer's ``ctx.optim_state``) is carried
  at the top level when it is not ``f32``, so a state loaded under another format is
  converted with the warning naming both (``OffloadedOptimizer.load_state_dict``); an ``f32``
  checkpoint has no such key, as before.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from computectx.memory.optim.state.codecs import decode, round_trip_bound
from computectx.memory.optim.state.packed import parts_of
from computectx.memory.optim.state.store import (
    MASTER_ROUNDING_KEY,
    OPTIM_STATE_KEY,
    PARAM_SHAPES_KEY,
    PART_SEP,
    encode_entry,
    kind_of,
    packed_of,
    packs,
    split_entry,
    state_name,
)
from computectx.optim_state import OptimState, parse_optim_state

__all__ = [
    "LoadPlan",
    "check_plain_shapes",
    "convert_entries",
    "entry_param",
    "load_plan",
    "param_index_map",
    "saved_format",
]


def param_index_map(
    saved_groups: object, groups: Sequence[Mapping[str, Any]], who: str
) -> dict[int, torch.Tensor]:
    """Saved parameter index -> this optimizer's parameter, as torch's ``load_state_dict``
    pairs them (groups in order, parameters in order); its errors when the groups differ."""
    if not isinstance(saved_groups, (list, tuple)):
        raise ValueError(
            f"{who}: state_dict['param_groups'] must be a list of groups, got "
            f"{type(saved_groups).__name__}"
        )
    if len(saved_groups) != len(groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    out: dict[int, torch.Tensor] = {}
    for j, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        ids = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(group["params"]):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of "
                f"optimizer's group (param_groups[{j}])"
            )
        out.update({int(i): p for i, p in zip(ids, group["params"], strict=True)})
    return out


def convert_entries(
    saved_state: Mapping[Any, Any],
    params: Mapping[int, torch.Tensor],
    saved_format: OptimState,
    ours: OptimState,
    *,
    f32_state: bool,
    saved_shapes: Mapping[int, torch.Size] | None = None,
) -> tuple[dict[int, dict[str, Any]], float]:
    """Every saved per-parameter entry in our stored form, checked; nothing changes here.

    Packed parts are checked by the codec (``ValueError`` naming the key); kept bit for bit
    when ``saved_format == ours``, else decoded with the saved format and stored as ours. A
    plain tensor of the parameter's shape (the decoded form: a DCP or plain torch
    checkpoint) is encoded when ours packs it, else kept (as float32 when ``f32_state``:
    the stepper's state is float32). Another shape is refused. Values land on the
    parameter's device as copies. Packed parts saved for a parameter of another shape
    (``saved_shapes``, the checkpoint's ``"param_shapes"``) are refused naming both shapes.
    Returns the entries and the largest round-trip bound of the values that went through
    our encoder after a format change (0.0 when none did).
    """
    out: dict[int, dict[str, Any]] = {}
    worst = 0.0
    same = saved_format == ours
    for index, entry in saved_state.items():
        where = f"state_dict['state'][{index!r}]"
        param = entry_param(where, index, entry, params)
        plain, packed = split_entry(entry)
        if packed and not saved_format.compact:
            raise ValueError(
                f"{where} holds packed parts {sorted(f'{n}{PART_SEP}*' for n in packed)} but the "
                f"state dict says optim_state={saved_format} (absent means f32); accepted: the "
                f"'optim_state' entry the parts were saved under"
            )
        shape = param.shape
        saved_shape = None if saved_shapes is None else saved_shapes.get(index)
        if packed and saved_shapes is not None and saved_shape != shape:
            saved_as = "no shape" if saved_shape is None else f"shape {list(saved_shape)}"
            raise ValueError(
                f"{where} holds packed state {sorted(packed)} saved for a parameter of "
                f"{saved_as} (state_dict[{PARAM_SHAPES_KEY!r}]), but parameter {index} of this "
                f"optimizer has shape {list(shape)}; accepted: the state of a parameter of the "
                f"same shape (the parameters in the order they were saved)"
            )
        decoded: dict[str, Any] = {}
        new: dict[str, Any] = {}
        for name, value in plain.items():
            if name in packed:
                raise ValueError(
                    f"{where} holds both {name!r} and its packed parts; accepted: one of the two"
                )
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                # Scalars (step) stay where they were saved, as torch keeps them.
                new[name] = value.clone() if isinstance(value, torch.Tensor) else value
            elif value.shape != shape:
                raise ValueError(
                    f"{where}[{name!r}] has shape {list(value.shape)}, but the parameter is "
                    f"{list(shape)}; accepted: a scalar or a tensor of the parameter's shape"
                )
            elif not value.is_floating_point():
                raise ValueError(f"{where}[{name!r}] is {value.dtype}; accepted: a floating tensor")
            else:
                decoded[name] = value
        for name, parts in packed.items():
            pk = packed_of(parts, name, shape, saved_format, f"{where}[{name!r}]")
            if same:
                for part, t in parts_of(pk).items():
                    new[f"{name}{PART_SEP}{part}"] = _to(t, param.device, None)
            else:
                decoded[name] = decode(pk)
        for name, value in decoded.items():
            value = value.to(device=param.device)
            if packs(value, shape, ours):
                _check_finite(value, f"{where}[{name!r}]", index, ours)
                if not same:
                    worst = max(worst, _bound(value, ours, name))
                new.update(encode_entry({name: value}, shape, ours))
            else:
                new[name] = _to(value, param.device, torch.float32 if f32_state else None)
        # Keep torch's key order where it can be told (step first).
        out[index] = {k: new[k] for k in sorted(new, key=lambda k: _order(entry, k))}
    return out, worst


def _check_finite(value: torch.Tensor, where: str, index: object, ours: OptimState) -> None:
    """``ValueError`` naming ``where`` (the key), the parameter and the first element, when
    a plain state tensor about to be encoded holds an inf or NaN. Our own state saturates an
    inf that torch's arithmetic made; a checkpoint's inf is refused, as NaN is: it would
    become its block's scale, and the block's other values would decode to (about) zero."""
    bad = ~torch.isfinite(value)
    if not bool(bad.any()):
        return
    count = int(bad.sum())
    first = [int(i) for i in bad.nonzero()[0]]
    raise ValueError(
        f"{where} (the state of parameter {index!r}, shape {list(value.shape)}) holds {count} "
        f"inf or NaN value(s), the first at index {first} ({float(value[tuple(first)])}); "
        f"accepted: finite state, to be stored as {ours}"
    )


def entry_param(
    where: str, index: object, entry: object, params: Mapping[int, torch.Tensor]
) -> torch.Tensor:
    # The parameter a saved state entry belongs to; the entry must be a dict.
    param = params.get(index) if isinstance(index, int) else None
    if param is None:
        raise ValueError(
            f"{where}: no parameter has index {index!r} in the saved param_groups "
            f"(indices {sorted(params)})"
        )
    if not isinstance(entry, Mapping):
        raise TypeError(f"{where} must be a dict of state values, got {type(entry).__name__}")
    return param


def check_plain_shapes(state: Mapping[Any, Any], params: Mapping[int, torch.Tensor]) -> None:
    """``ValueError`` for a saved state tensor with its parameter's element count but
    another shape (state of another parameter: a transposed one, or the parameters in
    another order), or an entry of no parameter. Tensors of other counts are a class's own
    layout (Adafactor's factored moments) and are left to it."""
    for index, entry in state.items():
        where = f"state_dict['state'][{index!r}]"
        param = entry_param(where, index, entry, params)
        for name, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() > 0
                and value.numel() == param.numel()
                and value.shape != param.shape
            ):
                raise ValueError(
                    f"{where}[{name!r}] has shape {list(value.shape)}, but the parameter is "
                    f"{list(param.shape)}; accepted: a scalar or a tensor of the parameter's shape"
                )


def _saved_shapes(value: object, who: str) -> dict[int, torch.Size] | None:
    """``state_dict[PARAM_SHAPES_KEY]`` checked (``None`` when absent: a checkpoint made
    before shapes were saved, whose packed parts are checked by size only)."""
    if value is None:
        return None
    where = f"{who}: state_dict[{PARAM_SHAPES_KEY!r}]"
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a dict index -> shape, got {type(value).__name__}")
    out: dict[int, torch.Size] = {}
    for index, shape in value.items():
        ok = (
            isinstance(index, int)
            and not isinstance(index, bool)
            and isinstance(shape, (list, tuple))
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        )
        if not ok:
            raise ValueError(
                f"{where} has entry {index!r}: {shape!r}; accepted: an int index -> a list of "
                f"ints >= 0 (the parameter's shape)"
            )
        out[index] = torch.Size(shape)
    return out


def _order(entry: Mapping[str, Any], key: str) -> int:
    names = [state_name(k) for k in entry]
    name = state_name(key)
    return names.index(name) if name in names else len(names)


def _bound(value: torch.Tensor, ours: OptimState, name: str) -> float:
    return float(round_trip_bound(value.float(), ours, kind_of(name)).max())


def _to(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """``value`` as a copy on ``device`` (at ``dtype`` when given); non-tensors as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device=device, dtype=dtype or value.dtype, copy=True)


@dataclasses.dataclass
class LoadPlan:
    """A state dict checked and converted for loading (``load_plan``); nothing changed yet."""

    torch_sd: dict[str, Any]
    """What torch's ``Optimizer.load_state_dict`` gets (groups; state unless ``install``)."""
    install: dict[int, dict[str, Any]] | None
    """Entries to put into ``optimizer.state`` after torch's load (stepped optimizers:
    torch's load would cast packed parts and float32 state to the parameter's dtype)."""
    params: dict[int, torch.Tensor]
    """Saved index -> parameter."""
    rounding: object
    """``state_dict["master_rounding"]`` (``None`` when absent)."""
    warning: str | None
    """The conversion warning to give once everything loaded."""

    def finish(self, state: dict[Any, Any], *, stacklevel: int = 3) -> None:
        """Install the entries into ``state`` (the optimizer's) and give the warning
        (``stacklevel`` as ``warnings.warn`` counts it from here: 3 is the caller's caller)."""
        if self.install is not None:
            for index, entry in self.install.items():
                state[self.params[index]] = entry
        if self.warning is not None:
            warnings.warn(self.warning, UserWarning, stacklevel=stacklevel)


def load_plan(
    state_dict: Mapping[str, Any],
    groups: Sequence[Mapping[str, Any]],
    ours: OptimState,
    *,
    stepped: bool,
    who: str,
) -> LoadPlan:
    """Check ``state_dict`` and bring its state into our stored form (nothing changes).

    ``"optim_state"`` (absent: f32) names the format the entries were saved under; when it
    differs from ``ours`` the state is converted (decoded, encoded as ours) and a
    ``UserWarning`` names both formats and the bound. An optimizer that is not ``stepped``
    (torch's own f32 state) whose state dict holds nothing packed gets it as it was.
    """
    sd = dict(state_dict)
    saved_text = sd.pop(OPTIM_STATE_KEY, None)
    rounding = sd.pop(MASTER_ROUNDING_KEY, None)
    shapes = _saved_shapes(sd.pop(PARAM_SHAPES_KEY, None), who)
    try:
        saved = OptimState() if saved_text is None else parse_optim_state(saved_text)
    except ValueError as e:
        raise ValueError(f"{who}: state_dict[{OPTIM_STATE_KEY!r}] is not a format: {e}") from e
    for key in ("state", "param_groups"):
        if key not in sd:
            raise ValueError(f"state_dict has no {key!r} entry; got keys {sorted(sd)}")
    state = sd["state"]
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict['state'] must be a dict, got {type(state).__name__}")
    has_parts = any(
        isinstance(e, Mapping) and any(PART_SEP in str(k) for k in e) for e in state.values()
    )
    params = param_index_map(sd["param_groups"], groups, who)
    if not stepped and not saved.compact and not has_parts:
        # Torch's own load: its state is loaded as saved, after the same shape check (torch
        # itself checks none, and its next step would fail midway, or broadcast).
        check_plain_shapes(state, params)
        return LoadPlan(sd, None, {}, rounding, None)
    entries, worst = convert_entries(
        state, params, saved, ours, f32_state=stepped, saved_shapes=shapes
    )
    warning = None
    if saved != ours and entries:
        how = (
            f"each value re-encoded moved by at most {worst:.3g} (the round-trip bound of "
            f"{ours}), on top of the rounding the saved format already had"
            if ours.compact
            else "the values are decoded exactly; they keep the rounding of the saved format"
        )
        warning = (
            f"{who}: the optimizer state was saved with optim_state={saved} and is converted "
            f"to this optimizer's optim_state={ours}: {how}"
        )
    if stepped:
        return LoadPlan({**sd, "state": {}}, entries, params, rounding, warning)
    return LoadPlan({**sd, "state": entries}, None, params, rounding, warning)


def saved_format(value: object, where: str) -> OptimState:
    """The ``"optim_state"`` entry of a checkpoint, checked: its text (or JSON) form."""
    if not isinstance(value, (str, Mapping, OptimState)):
        raise TypeError(
            f"{where} must be the text form of an optim_state (e.g. 'int8'), got "
            f"{type(value).__name__}"
        )
    try:
        return parse_optim_state(value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
