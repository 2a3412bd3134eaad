"""Grouped experts in ``convert_to_quantized``: the ``ExpertsConverter`` extension point.

A mixture-of-experts layer keeps its experts as 3-D weights ``[E, N, K]`` inside one module
(``computectx.nn.GroupedExperts``, transformers 5's ``*Experts``, torchtitan's
``GroupedExperts``), and runs them as grouped GEMMs. fp8 cannot swap such a module for a
class of its own (its forward is the framework's: routing, activation, combine); instead each
framework's *converter* says which modules are its experts, what their expert weights are,
and how to make their GEMMs run through ``QuantizedExperts.mm`` (``quantized_grouped_mm``) in place:

- ``computectx.nn`` registers one for ``GroupedExperts`` when it is imported;
- ``computectx.integrations.transformers_moe`` registers one for transformers' experts
  (through transformers' own ``ExpertsInterface``), imported by ``convert_to_quantized`` when the
  model holds a module of a ``transformers`` class;
- ``computectx.integrations.torchtitan_moe`` registers one for torchtitan's, imported the
  same way for a model holding a ``torchtitan`` class.

The rules are the linears' (``convert_to_quantized``): a ``module_filter`` alone decides when
given; else ``min_features`` applies to ``min(N, K)`` of every expert weight; widths must be
multiples of 16 (32 under ``mx``) and weights bf16/fp16/fp32. An experts module already
converted under the same policy is reported ``already_fp8``; under another, the call raises.
The router is never converted: a linear named ``*router*`` or ``*gate*`` (its name or its
parent's) whose ``out_features`` is the expert count of an experts module beside it (same
parent, or the parent's parent) is skipped with rule ``router``: routing decisions are made
from its scores, where fp8's error would move tokens between experts.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.backend import Backend, default_backend, parse_backend
from computectx.formats.convert_report import SkippedLinear, SkipRule
from computectx.formats.ops.grouped import QuantizedExperts
from computectx.formats.policy import (
    check_fp8_widths,
    check_granularity_widths,
    describe,
    filtered_out,
)
from computectx.recipes import Recipe

__all__ = [
    "ExpertsConverter",
    "ExpertsPlan",
    "experts_converters",
    "plan_experts",
    "register_experts_converter",
]


class ExpertsConverter(Protocol):
    """How ``convert_to_quantized`` converts one framework's grouped experts (module docstring)."""

    def weights(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """``module``'s expert weights ``[E, N, K]`` by parameter name, or ``None`` when
        ``module`` is not one of this converter's experts."""
        ...

    def current(self, module: nn.Module) -> QuantizedExperts | None:
        """The ``QuantizedExperts`` ``module`` runs with now (``None``: high precision)."""
        ...

    def convert(self, module: nn.Module, fp8: QuantizedExperts | None) -> None:
        """Make ``module``'s expert GEMMs run through ``fp8.mm`` (``None``: back to high
        precision), in place, keeping its parameters."""
        ...


_CONVERTERS: list[ExpertsConverter] = []

_PROVIDERS = {
    "transformers": "computectx.integrations.transformers_moe",
    "torchtitan": "computectx.integrations.torchtitan_moe",
}
"""Top-level package of a model's module class -> the module registering its converter."""


def register_experts_converter(converter: ExpertsConverter) -> None:
    """Add ``converter`` to those ``convert_to_quantized`` asks (once; the first match wins)."""
    for name in ("weights", "current", "convert"):
        if not callable(getattr(converter, name, None)):
            raise TypeError(
                f"an ExpertsConverter needs weights(), current() and convert() methods; "
                f"{describe(converter)} has no {name}()"
            )
    if converter not in _CONVERTERS:
        _CONVERTERS.append(converter)


def experts_converters(model: nn.Module) -> list[ExpertsConverter]:
    """The registered converters, after importing the providers of ``model``'s frameworks
    (a ``transformers`` module class imports ``computectx.integrations.transformers_moe``)."""
    packages = {type(m).__module__.partition(".")[0] for m in model.modules()}
    for package, provider in _PROVIDERS.items():
        if package in packages and provider not in sys.modules:
            importlib.import_module(provider)
    return list(_CONVERTERS)


@dataclass(frozen=True)
class ExpertsPlan:
    """What ``convert_to_quantized`` does to a model's experts: which convert (module, converter),
    which are skipped and why, and the router linears it must leave alone (id -> fqn)."""

    convert: tuple[tuple[str, nn.Module, ExpertsConverter], ...]
    skipped: tuple[SkippedLinear, ...]
    routers: dict[int, str]

    def settings(
        self, policy: Recipe, backend: Backend | str | None
    ) -> tuple[QuantizedExperts, ...]:
        """What each planned module will run with (the backend checked); changes nothing."""
        out = []
        for _, module, conv in self.convert:
            weights = conv.weights(module) or {}
            device = next(iter(weights.values())).device if weights else torch.device("cpu")
            chosen = default_backend(device) if backend is None else parse_backend(backend)
            out.append(QuantizedExperts(policy, chosen))
        return tuple(out)

    def apply(self, settings: tuple[QuantizedExperts, ...]) -> tuple[str, ...]:
        """Convert the planned modules with ``settings`` (``self.settings``); their names.
        A converter that raises midway has the modules converted before it put back to high
        precision (``convert(module, None)``), and the error goes on."""
        done: list[tuple[nn.Module, ExpertsConverter]] = []
        try:
            for (_, module, conv), fp8 in zip(self.convert, settings, strict=True):
                conv.convert(module, fp8)
                done.append((module, conv))
        except BaseException:
            for module, conv in reversed(done):
                conv.convert(module, None)
            raise
        return tuple(fqn for fqn, _, _ in self.convert)


def plan_experts(
    model: nn.Module,
    policy: Recipe,
    module_filter: Callable[[nn.Module, str], bool] | None,
    min_features: int,
) -> ExpertsPlan:
    """Decide, before anything changes, what ``convert_to_quantized`` does to the experts."""
    converters = experts_converters(model)
    found: list[tuple[str, nn.Module, ExpertsConverter, dict[str, torch.Tensor]]] = []
    seen: set[int] = set()
    for fqn, module in model.named_modules():
        if id(module) in seen:
            continue
        for conv in converters:
            weights = conv.weights(module)
            if weights is not None:
                found.append((fqn or "<root>", module, conv, weights))
                seen.add(id(module))
                break
    convert: list[tuple[str, nn.Module, ExpertsConverter]] = []
    skipped: list[SkippedLinear] = []
    for fqn, module, conv, weights in found:
        current = conv.current(module)
        if current is not None:
            if current.policy != policy:
                raise ValueError(
                    f"convert_to_quantized: the experts {fqn!r} already run in fp8 under "
                    f"{current.policy}, but this call asks for {policy}; converted experts "
                    f"keep their policy. The model was left unchanged"
                )
            skipped.append(SkippedLinear(fqn, "already fp8 under this policy", "already_fp8"))
            continue
        why = _skip(module, fqn, weights, policy, module_filter, min_features)
        if why is None:
            convert.append((fqn, module, conv))
        else:
            skipped.append(SkippedLinear(fqn, why[1], why[0]))
    return ExpertsPlan(tuple(convert), tuple(skipped), _routers(model, found))


def _skip(
    module: nn.Module,
    fqn: str,
    weights: dict[str, torch.Tensor],
    policy: Recipe,
    module_filter: Callable[[nn.Module, str], bool] | None,
    min_features: int,
) -> tuple[SkipRule, str] | None:
    if module_filter is not None and filtered_out(module_filter, module, fqn):
        return "module_filter", "module_filter returned False"
    for name, w in weights.items():
        e, n, k = w.shape
        try:
            check_fp8_widths(k, n)
        except ValueError as err:
            return "feature_multiple", f"expert weight {name} [{e}, {n}, {k}]: {err}"
        try:
            check_granularity_widths(policy.granularity, k, n)
        except ValueError as err:
            return "granularity", f"expert weight {name} [{e}, {n}, {k}]: {err}"
        if module_filter is None and min(n, k) < min_features:
            return "min_features", (
                f"expert weight {name} [{e}, {n}, {k}]: min(N, K)={min(n, k)} < "
                f"min_features={min_features}: the quantize passes cost more than fp8 saves"
            )
        if w.dtype not in FLOAT_DTYPES:
            return "dtype", f"expert weight {name} dtype {w.dtype} is not bf16, fp16 or fp32"
    return None


def _routers(
    model: nn.Module, found: list[tuple[str, nn.Module, ExpertsConverter, dict[str, torch.Tensor]]]
) -> dict[int, str]:
    # A linear scoring E experts beside an experts module of E experts (same parent, or the
    # parent's parent: torchtitan's moe.router.gate next to moe.experts).
    experts_at: dict[str, set[int]] = {}
    for fqn, _, _, weights in found:
        parent = fqn.rpartition(".")[0] if fqn != "<root>" else ""
        counts = {w.shape[0] for w in weights.values()}
        # torchtitan nests them: moe.routed_experts.inner_experts beside moe.router.gate.
        for place in {parent, parent.rpartition(".")[0]}:
            experts_at.setdefault(place, set()).update(counts)
    routers: dict[int, str] = {}
    for fqn, m in model.named_modules():
        named = ".".join(fqn.split(".")[-2:]).lower()
        if not isinstance(m, nn.Linear) or not ("router" in named or "gate" in named):
            continue
        up = fqn.rpartition(".")[0]
        places = (up, up.rpartition(".")[0]) if up else ("",)
        if any(m.out_features in experts_at.get(place, set()) for place in places):
            routers[id(m)] = fqn
    return routers
