"""The seam ``load_weights`` offers modules whose tensors follow rules of their own; the
memory layer knows no such module, they plug in by defining any of these methods:

- ``check_state_tensors(local name -> tensor[, prefix=...])``: a check of the module's
  tensors before anything is replaced (an ``Attention``'s calibrated ``kv_amax``);
- ``state_load_keys()`` and ``plan_state_load(local name -> tensor, prefix=...)``: keys the
  module loads by its own rule (a ``QuantizedLinear``'s scaling state), planned before anything
  is replaced and installed after the weights;
- ``default_state_tensors()``: what a checkpoint that lacks some buffers loads instead.
"""

from __future__ import annotations

import inspect
import pathlib
from collections.abc import Callable

import torch

__all__ = ["Owner", "check_module_state", "plan_module_state", "state_defaults", "state_owners"]


def check_module_state(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], file: pathlib.Path
) -> None:
    # A module whose buffers carry state with rules of their own (a QuantizedLinear's scaling
    # state must match its policy) defines check_state_tensors(local_name -> tensor); it is
    # asked before anything is replaced, so a checkpoint it refuses leaves the model as it
    # was. A check that takes a `prefix` keyword gets the module's key prefix
    # ("blocks.1.attn.") to name its tensors by their full keys; a ValueError it raises is
    # raised again naming the file.
    for prefix, module in model.named_modules():
        check = getattr(module, "check_state_tensors", None)
        if not callable(check):
            continue
        head = f"{prefix}." if prefix else ""
        local = {k[len(head) :]: t for k, t in tensors.items() if k.startswith(head)}
        try:
            if "prefix" in inspect.signature(check).parameters:
                check(local, prefix=head)
            else:
                check(local)
        except ValueError as err:
            raise ValueError(f"checkpoint {str(file)!r}: {err}") from err


Owner = tuple[str, Callable[..., Callable[[], None]], set[str]]


def state_owners(model: torch.nn.Module) -> list[Owner]:
    # Modules that load some of their tensors by a rule of their own (a QuantizedLinear's scaling
    # state: another history length is converted, an absent state starts fresh) define
    # state_load_keys() -> local names and plan_state_load(local name -> tensor, prefix=...)
    # -> a callable that installs the result. Their keys skip the generic checks.
    out: list[Owner] = []
    for prefix, module in model.named_modules():
        keys, plan = (
            getattr(module, "state_load_keys", None),
            getattr(module, "plan_state_load", None),
        )
        if callable(keys) and callable(plan):
            head = f"{prefix}." if prefix else ""
            out.append((head, plan, {head + k for k in keys()}))
    return out


def plan_module_state(
    owners: list[Owner],
    tensors: dict[str, torch.Tensor],
    file: pathlib.Path,
) -> list[Callable[[], None]]:
    # Every owner plans (reads and checks) before anything is replaced: a refused entry in
    # any layer leaves the whole model as it was.
    finish = []
    for head, plan, _ in owners:
        local = {k[len(head) :]: t for k, t in tensors.items() if k.startswith(head)}
        try:
            finish.append(plan(local, prefix=head))
        except ValueError as err:
            raise ValueError(f"checkpoint {str(file)!r}: {err}") from err
    return finish


def state_defaults(
    model: torch.nn.Module, targets: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    # A module whose state grew after checkpoints were written defines
    # default_state_tensors() -> {local name: value}: what such a checkpoint loads instead.
    # Only buffers may default (a missing weight is always an error), at their own shape and
    # dtype.
    out: dict[str, torch.Tensor] = {}
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for prefix, module in model.named_modules():
        fn = getattr(module, "default_state_tensors", None)
        if not callable(fn):
            continue
        head = f"{prefix}." if prefix else ""
        for local, value in fn().items():
            name = head + local
            target = targets.get(name)
            if name in params or target is None or not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{type(module).__name__}.default_state_tensors: {local!r} must name a "
                    f"buffer of the module and give a tensor"
                )
            if value.shape != target.shape or value.dtype != target.dtype:
                raise TypeError(
                    f"{type(module).__name__}.default_state_tensors: {local!r} defaults to "
                    f"{value.dtype}{list(value.shape)}, the buffer is "
                    f"{target.dtype}{list(target.shape)}"
                )
            out[name] = value
    return out
