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

**4-bit recipes** (``Fp4Recipe``): the same rules (the block widths of the recipe: 16, MXFP4
32), and the recipe's own (``hp`` patterns, ``hp_last`` of the block list,
``linear.fp4_rules``) skip with rule ``kept_high``. A converter that declares ``runs_fp4 =
True`` (``Fp4ExpertsConverter``: ``computectx.nn``'s) is handed an ``Fp4Experts``, an
``nn.Module`` that holds the stochastic-rounding counter, to register on the experts module
(its state dict then saves the counter); any other framework's experts raise
``NotImplementedError`` when they would convert, fp8 never running in 4 bits' place. Experts
already converted under another recipe, fp8 or 4-bit, raise ``ValueError`` naming both.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.backend import Backend, default_backend, parse_backend
from computectx.formats.convert_report import SkippedLinear, SkipRule
from computectx.formats.linear.fp4_experts import Fp4Experts
from computectx.formats.linear.fp4_rules import model_blocks
from computectx.formats.ops.grouped import QuantizedExperts
from computectx.formats.policy import (
    check_fp8_widths,
    check_granularity_widths,
    describe,
    filtered_out,
)
from computectx.fp4_recipe import Fp4Recipe
from computectx.recipes import Recipe

__all__ = [
    "ExpertsConverter",
    "ExpertsPlan",
    "ExpertsSetting",
    "Fp4ExpertsConverter",
    "experts_converters",
    "fp4_setting",
    "plan_experts",
    "register_experts_converter",
]

ExpertsSetting = QuantizedExperts | Fp4Experts
"""What converted experts run their GEMMs with: fp8's ``QuantizedExperts`` or ``Fp4Experts``
(both ``mm(x, w, offs, save)``: ``linear.fp4_experts.ExpertsGemm``)."""


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


class Fp4ExpertsConverter(ExpertsConverter, Protocol):
    """An ``ExpertsConverter`` whose experts also run in 4 bits: ``runs_fp4`` is ``True`` and
    ``convert`` takes an ``Fp4Experts`` too, which it registers on the module (a child
    module: the counter is saved with the module's state) and its GEMMs call."""

    runs_fp4: bool

    def convert(self, module: nn.Module, fp8: ExpertsSetting | None) -> None:
        """Make ``module``'s expert GEMMs run through ``fp8.mm`` (``None``: back to high
        precision), in place, keeping its parameters."""
        ...


def fp4_setting(module: nn.Module) -> Fp4Experts | None:
    """The ``Fp4Experts`` registered on ``module`` (its 4-bit setting), if any."""
    return next((c for c in module.children() if isinstance(c, Fp4Experts)), None)


def _fp4_converter(conv: ExpertsConverter) -> Fp4ExpertsConverter | None:
    return cast(Fp4ExpertsConverter, conv) if getattr(conv, "runs_fp4", False) is True else None


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
        self, policy: Recipe | Fp4Recipe, backend: Backend | str | None
    ) -> tuple[ExpertsSetting, ...]:
        """What each planned module will run with (the fp8 backend checked; a 4-bit
        setting's counter at 0); changes nothing."""
        out: list[ExpertsSetting] = []
        for _, module, conv in self.convert:
            weights = conv.weights(module) or {}
            device = next(iter(weights.values())).device if weights else torch.device("cpu")
            if isinstance(policy, Fp4Recipe):  # its counter on the CPU, as Fp4Linear's
                out.append(Fp4Experts(policy))
                continue
            chosen = default_backend(device) if backend is None else parse_backend(backend)
            out.append(QuantizedExperts(policy, chosen))
        return tuple(out)

    def apply(self, settings: tuple[ExpertsSetting, ...]) -> tuple[str, ...]:
        """Convert the planned modules with ``settings`` (``self.settings``); their names.
        A converter that raises midway has the modules converted before it put back to high
        precision (``convert(module, None)``), and the error goes on."""
        done: list[tuple[nn.Module, ExpertsConverter]] = []
        try:
            for (_, module, conv), fp8 in zip(self.convert, settings, strict=True):
                if isinstance(fp8, Fp4Experts):
                    four = _fp4_converter(conv)
                    assert four is not None  # plan_experts refused the others
                    four.convert(module, fp8)
                else:
                    conv.convert(module, fp8)
                done.append((module, conv))
        except BaseException:
            for module, conv in reversed(done):
                conv.convert(module, None)
            raise
        return tuple(fqn for fqn, _, _ in self.convert)


def plan_experts(
    model: nn.Module,
    policy: Recipe | Fp4Recipe,
    module_filter: Callable[[nn.Module, str], bool] | None,
    min_features: int,
) -> ExpertsPlan:
    """Decide, before anything changes, what ``convert_to_quantized`` does to the experts:
    ``ValueError`` for experts converted under another recipe, ``NotImplementedError`` for
    experts that would convert under a 4-bit recipe through a converter that cannot run it."""
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
    four = policy if isinstance(policy, Fp4Recipe) else None
    blocks = model_blocks(model) if four is not None and four.hp_last else {}
    convert: list[tuple[str, nn.Module, ExpertsConverter]] = []
    skipped: list[SkippedLinear] = []
    for fqn, module, conv, weights in found:
        if _converted(fqn, module, conv, policy):
            width = "fp8" if four is None else four.format
            skipped.append(SkippedLinear(fqn, f"already {width} under this policy", "already_fp8"))
            continue
        block = blocks.get(id(module), (None, 0))
        why = _skip(module, fqn, weights, policy, module_filter, min_features, block)
        if why is not None:
            skipped.append(SkippedLinear(fqn, why[1], why[0]))
            continue
        if four is not None and _fp4_converter(conv) is None:
            raise NotImplementedError(
                f"convert_to_quantized: {fqn!r} holds grouped experts ({type(module).__name__}) "
                f"whose framework's converter ({type(conv).__name__}) runs fp8 only; the 4-bit "
                f"grouped GEMM runs computectx.nn's GroupedExperts (a converter with runs_fp4), "
                f"and fp8 never runs in its place. Keep them out with a module_filter, or "
                f"convert under an fp8 recipe; the model was left unchanged"
            )
        convert.append((fqn, module, conv))
    return ExpertsPlan(tuple(convert), tuple(skipped), _routers(model, found))


def _converted(
    fqn: str, module: nn.Module, conv: ExpertsConverter, policy: Recipe | Fp4Recipe
) -> bool:
    """Whether the experts already run under ``policy``; ``ValueError`` naming both when
    they run under another recipe, fp8 or 4-bit."""
    fp8, fp4 = conv.current(module), fp4_setting(module)
    now: Recipe | Fp4Recipe | None = fp8.policy if fp8 is not None else None
    now = fp4.recipe if fp4 is not None else now
    if now is None:
        return False
    if now != policy:
        width = "fp8" if isinstance(now, Recipe) else "4 bits"
        raise ValueError(
            f"convert_to_quantized: the experts {fqn!r} already run in {width} under {now}, "
            f"but this call asks for {policy}; converted experts keep their policy. The model "
            f"was left unchanged"
        )
    return True


def _skip(
    module: nn.Module,
    fqn: str,
    weights: dict[str, torch.Tensor],
    policy: Recipe | Fp4Recipe,
    module_filter: Callable[[nn.Module, str], bool] | None,
    min_features: int,
    block: tuple[int | None, int],
) -> tuple[SkipRule, str] | None:
    # The linears' order: the filter, the 4-bit recipe's own rules, then what cannot run.
    if module_filter is not None and filtered_out(module_filter, module, fqn):
        return "module_filter", "module_filter returned False"
    if isinstance(policy, Fp4Recipe) and policy.keeps_high(fqn, *block):
        return "kept_high", f"kept in high precision by the 4-bit recipe {policy}"
    for name, w in weights.items():
        if w.dtype == torch.float4_e2m1fn_x2:  # FrozenFp4Experts' codes: no weight to convert
            return "dtype", (
                f"expert weight {name} is held as 4-bit codes: the experts are frozen for "
                f"serving (FrozenFp4Experts); convert a copy made before freezing"
            )
        e, n, k = w.shape
        try:
            check_fp8_widths(k, n)
        except ValueError as err:
            return "feature_multiple", f"expert weight {name} [{e}, {n}, {k}]: {err}"
        try:
            if isinstance(policy, Recipe):
                check_granularity_widths(policy.granularity, k, n)
            elif k % policy.block or n % policy.block:
                raise ValueError(f"{policy.format} needs multiples of {policy.block}")
        except ValueError as err:
            return "granularity", f"expert weight {name} [{e}, {n}, {k}]: {err}"
        if module_filter is None and min(n, k) < min_features:
            return "min_features", (
                f"expert weight {name} [{e}, {n}, {k}]: min(N, K)={min(n, k)} < "
                f"min_features={min_features}: the quantize passes cost more than they save"
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
