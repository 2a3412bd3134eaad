"""Optimizer state in its stored form: one parameter's entry, its kinds and its scalars.

Between steps ``optimizer.state[p]`` is one flat dict per parameter, exactly what
``state_dict()["state"][i]`` holds: a packed tensor ``name`` is stored as its parts under
``"name.part"`` (``"exp_avg.codes"``, ``"exp_avg.absmax"``); a scalar (``step``), a tensor
with fewer than ``min_size`` elements, and every tensor under ``optim_state="f32"`` stay
under their own name as torch made them. Torch's state names hold no ``"."``, so the first
``"."`` splits a key into state name and part.

**Kinds.** Which quantization map each state tensor takes, by its torch.optim name: signed
state (first moments, momentum, averages of gradients or weights) takes the signed map;
state that is never negative (second moments, sums of squares, maxima of magnitudes, step
sizes) takes the unsigned one, which spends every code on magnitudes. A name no torch.optim
class uses is read as signed: the signed map holds any value, the unsigned one would lose
the sign.

**Scalars.** Torch keeps ``step`` (the count of steps taken, which its update raises the
betas to) and a few other scalars (ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``) beside
the tensors; a NaN, inf, negative or fractional one is accepted by torch's
``load_state_dict`` and fails (or turns the weights NaN) in the next step.
``check_scalars`` is the one check of them, run on a checkpoint's entries before a load and
on the optimizer's own before a step.

``Scratch`` is the one reused float32 buffer per device that a step decodes into: one
parameter's working weight, gradient and decoded state at a time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from computectx.memory.optim.state.codecs import decode, encode, from_parts
from computectx.memory.optim.state.packed import Kind, Packed, parts_of
from computectx.optim_state import OptimState

__all__ = [
    "MASTER_ROUNDING_KEY",
    "OPTIM_STATE_KEY",
    "PARAM_SHAPES_KEY",
    "PART_SEP",
    "SIGNED_STATE",
    "UNSIGNED_STATE",
    "Scratch",
    "check_scalars",
    "decode_entry",
    "encode_entry",
    "kind_of",
    "packed_keys",
    "packed_of",
    "packs",
    "param_shapes",
    "split_entry",
    "state_name",
]

PART_SEP = "."
"""Separates the state name from the part name in a stored key (``"exp_avg.codes"``)."""
OPTIM_STATE_KEY = "optim_state"
"""The key of ``str(optim_state)`` in a state dict (absent: ``"f32"``)."""
MASTER_ROUNDING_KEY = "master_rounding"
"""The key of the stochastic rounding generators' state in a state dict."""
PARAM_SHAPES_KEY = "param_shapes"
"""The key of the parameters' shapes (index -> list of ints) in a state dict of a quantized
format: codes and block scales have the same sizes for every shape of one element count,
so a load checks the saved shape against the parameter's (f32 and bf16 state tensors carry
their shape themselves)."""

SIGNED_STATE = frozenset({"exp_avg", "momentum_buffer", "grad_avg", "ax", "prev"})
"""Names of signed state: Adam's first moment, SGD's momentum, centered RMSprop's mean
gradient, ASGD's average, Rprop's previous gradient."""

UNSIGNED_STATE = frozenset(
    {"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf", "acc_delta", "step_size"}
)
"""Names of non-negative state: second moments (Adam, RMSprop, Adadelta), AMSGrad's maximum,
Adagrad's sum of squares, Adamax's infinity norm, Adadelta's accumulated updates, Rprop's
step sizes."""


def kind_of(name: str) -> Kind:
    """``"unsigned"`` for the names of ``UNSIGNED_STATE``, ``"signed"`` for any other."""
    return "unsigned" if name in UNSIGNED_STATE else "signed"


def state_name(key: object) -> str:
    """The state name of a stored key: ``"exp_avg"`` for ``"exp_avg.codes"`` and ``"exp_avg"``."""
    return str(key).partition(PART_SEP)[0]


def split_entry(entry: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``entry`` split into plain values (by name) and packed parts (name -> part -> value)."""
    plain: dict[str, Any] = {}
    packed: dict[str, dict[str, Any]] = {}
    for key, value in entry.items():
        name, sep, part = str(key).partition(PART_SEP)
        if sep:
            packed.setdefault(name, {})[part] = value
        else:
            plain[name] = value
    return plain, packed


def packs(value: object, shape: torch.Size, optim_state: OptimState) -> bool:
    """Whether ``value`` is stored packed under ``optim_state``: a floating tensor of the
    parameter's ``shape`` (not a scalar) with at least ``min_size`` (and at least one)
    elements, under a compact format."""
    return (
        optim_state.compact
        and isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dim() > 0
        and value.shape == shape
        and value.numel() >= max(optim_state.min_size, 1)
    )


def encode_entry(
    state: Mapping[str, Any],
    shape: torch.Size,
    optim_state: OptimState,
    *,
    check_finite: bool = True,
    packed_out: dict[str, Packed] | None = None,
) -> dict[str, Any]:
    """A parameter's decoded state (name -> value) in its stored form (see the module doc).

    ``check_finite`` is the codec's check (a device sync per tensor): NaN is refused, ±inf
    (float32 state after torch's arithmetic overflowed) saturates to the format's largest
    finite magnitude. ``packed_out``, when given, receives the ``Packed`` values by name.
    """
    out: dict[str, Any] = {}
    for name, value in state.items():
        if packs(value, shape, optim_state):
            packed = encode(
                value, optim_state, kind_of(name), check_finite=check_finite, saturate=True
            )
            if packed_out is not None:
                packed_out[name] = packed
            for part, t in parts_of(packed).items():
                out[f"{name}{PART_SEP}{part}"] = t
        else:
            out[name] = value
    return out


def packed_of(
    parts: Mapping[str, Any], name: str, shape: torch.Size, optim_state: OptimState, where: str
) -> Packed:
    """The ``Packed`` value of state ``name`` from its stored ``parts`` (checked by the codec:
    ``ValueError`` naming ``where``)."""
    return from_parts(parts, shape, optim_state, kind_of(name), where)


def decode_entry(
    entry: Mapping[str, Any], shape: torch.Size, optim_state: OptimState, where: str
) -> dict[str, Any]:
    """A stored entry decoded: every packed state as a new float32 tensor of ``shape`` under
    its name, plain values as they are. The form of a DCP checkpoint and of a plain torch
    optimizer's state."""
    plain, packed = split_entry(entry)
    out = dict(plain)
    for name, parts in packed.items():
        if name in plain:
            raise ValueError(
                f"{where} holds both {name!r} and its packed parts "
                f"{sorted(f'{name}{PART_SEP}{p}' for p in parts)}; accepted: one of the two"
            )
        out[name] = decode(packed_of(parts, name, shape, optim_state, f"{where}[{name!r}]"))
    return out


def packed_keys(per_param: Mapping[Any, Any]) -> list[str]:
    """The keys of packed parts (``"exp_avg.codes"``) in one parameter's state."""
    return [str(k) for k in per_param if PART_SEP in str(k)]


def param_shapes(groups: Sequence[Mapping[str, Any]]) -> dict[int, list[int]]:
    """``state_dict()[PARAM_SHAPES_KEY]``: each parameter's shape by torch's state-dict index
    (groups in order, parameters in order)."""
    params = [p for group in groups for p in group["params"]]
    return {i: list(p.shape) for i, p in enumerate(params)}


def check_scalars(entries: Sequence[tuple[str, Mapping[Any, Any]]]) -> None:
    """``ValueError`` naming the first bad scalar of the per-parameter ``entries`` (``(where,
    entry)`` pairs): every scalar (a number or a 0-dim tensor) must be finite, and ``step``
    a whole number >= 0 (torch's count of steps taken, which its update raises powers of
    the betas to). Reads every scalar tensor once: one host read per device."""
    items: list[tuple[str, str, int | float | torch.Tensor]] = []
    for where, entry in entries:
        for key, value in entry.items():
            if isinstance(value, bool):
                continue
            if isinstance(value, torch.Tensor):
                if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
                    continue
            elif not isinstance(value, (int, float)):
                continue
            items.append((where, str(key), value))
    read: dict[int, float] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, _, value) in enumerate(items):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(i)
    for positions in by_device.values():
        stacked = torch.stack([_as_tensor(items[i][2]).detach().double() for i in positions])
        read.update(zip(positions, stacked.cpu().tolist(), strict=True))
    for i, (where, key, value) in enumerate(items):
        if isinstance(value, int):  # a Python int: exact, any size
            if key == "step" and value < 0:
                raise ValueError(_bad_scalar(where, key, value))
            continue
        number = read[i] if isinstance(value, torch.Tensor) else float(value)
        if not math.isfinite(number) or (
            key == "step" and (number < 0 or number != math.floor(number))
        ):
            raise ValueError(_bad_scalar(where, key, number))


def _as_tensor(value: object) -> torch.Tensor:
    assert isinstance(value, torch.Tensor)
    return value


def _bad_scalar(where: str, key: str, value: float) -> str:
    accepted = (
        "a whole number >= 0 (the count of steps taken)" if key == "step" else "a finite number"
    )
    return f"{where}[{key!r}] is {value!r}; accepted: {accepted}"


class Scratch:
    """One reused float32 buffer per device, cut into views of one parameter's shape.

    It grows to the largest request (``numel * count``) and is never shrunk, so its size is
    the peak extra memory of a step: one parameter's working weight, gradient and decoded
    state. ``memory_report`` counts it under the role ``"scratch"``.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def views(self, device: torch.device, shape: torch.Size, count: int) -> list[torch.Tensor]:
        """``count`` disjoint float32 views of ``shape`` on ``device`` (contents undefined)."""
        n = math.prod(shape)
        need = n * count
        buf = self._buffers.get(device)
        if need and (buf is None or buf.numel() < need):
            self._buffers.pop(device, None)  # free the smaller one before allocating
            buf = torch.empty(need, dtype=torch.float32, device=device)
            self._buffers[device] = buf
        if buf is None:
            return [torch.empty(shape, dtype=torch.float32, device=device) for _ in range(count)]
        return [buf[i * n : (i + 1) * n].view(shape) for i in range(count)]

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views one of the scratch buffers."""
        buf = self._buffers.get(t.device)
        return buf is not None and (
            t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        )

    def buffers(self) -> list[torch.Tensor]:
        """The buffers allocated so far (for ``memory_report``)."""
        return list(self._buffers.values())
