"""The scalars of a parameter's optimizer state: what its step count and other scalars must be.

Torch keeps ``step`` (the count of steps taken, which its update raises the betas to) and a
few other scalars (ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``) beside the tensors; a
NaN, inf, negative or fractional one is accepted by torch's ``load_state_dict`` and fails (or
turns the weights NaN) in the next step. ``check_scalars`` is the one check of them, run on a
checkpoint's entries before a load and on the optimizer's own before a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["check_scalars"]


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
