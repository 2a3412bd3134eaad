"""``convert_to_quantized``: swap a model's ``nn.Linear`` layers for ``QuantizedLinear``; report."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from computectx.ctx import ComputeCtx
from computectx.dtypes import FLOAT_DTYPES
from computectx.formats.backend import Backend
from computectx.formats.convert_experts import ExpertsPlan, ExpertsSetting, plan_experts
from computectx.formats.convert_report import (
    HEAD_NAMES,
    ConversionReport,
    SkippedLinear,
    SkipRule,
    head_dtype_notes,
    nothing_converted,
    output_heads,
    refuse_another_policy,
    unconvertible_behaviour,
)
from computectx.formats.linear.fp4 import Fp4Linear
from computectx.formats.linear.fp4_rules import model_blocks, unheeded_rules
from computectx.formats.linear.fp4_streams import assign_streams_to
from computectx.formats.linear.module import QuantizedLinear
from computectx.formats.numerics.inline import QuantizeImpl, parse_quantize
from computectx.formats.policy import (
    FEATURE_MULTIPLE,
    check_fp8_widths,
    check_granularity_widths,
    describe,
    filtered_out,
    recipe_of,
)
from computectx.formats.scaling.load import guard_whole_loads
from computectx.fp4_recipe import Fp4Recipe
from computectx.recipes import Recipe

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FEATURE_MULTIPLE",
    "HEAD_NAMES",
    "ConversionReport",
    "Converter",
    "SkipRule",
    "SkippedLinear",
    "check_convertible",
    "convert_to_quantized",
]

DEFAULT_MIN_FEATURES = 1024
"""Narrowest ``min(in_features, out_features)`` that ``convert_to_quantized`` converts by default.

Per training step an fp8 linear with ``M`` rows saves about half of its three GEMMs'
``6·M·N·K`` flops (fp8 tensor cores run at twice the bf16 rate) and pays three quantize
passes that read 2 and write 1 byte per element of ``X [M, K]``, ``W [N, K]`` and
``dY [M, N]``. It wins when ``3·M·N·K / P > 3·(M·K + N·K + M·N) / B``, i.e. when
``1 / (1/M + 1/N + 1/K) > P / B``, with ``P`` the bf16 peak and ``B`` the memory bandwidth.
On an H100 (989 TFLOP/s, 3.35 TB/s) ``P / B ≈ 300``: with many rows, ``N = K ≈ 600`` only
breaks even, and at 1024 the saving is still well under half the ideal. Pass
``min_features`` (or a ``module_filter``) to ``convert_to_quantized`` to choose otherwise."""


class Converter(Protocol):
    """Builds the fp8 replacement of one linear (``convert_to_quantized``'s ``converters``).

    Called as ``converter(linear, ctx, backend=..., quantize=...)`` with the arguments of the
    ``convert_to_quantized`` call; ``QuantizedLinear.from_linear`` is one.
    """

    def __call__(
        self,
        linear: nn.Linear,
        ctx: ComputeCtx,
        *,
        backend: Backend | str | None,
        quantize: QuantizeImpl,
    ) -> nn.Module: ...


def convert_to_quantized(
    model: nn.Module,
    ctx: ComputeCtx,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    *,
    include_head: bool | None = None,
    min_features: int | None = None,
    backend: Backend | str | None = None,
    quantize: QuantizeImpl = "op",
    converters: Mapping[type[nn.Linear], Converter] | None = None,
) -> ConversionReport:
    """Swap ``model``'s ``nn.Linear`` layers for ``QuantizedLinear`` in place; report what happened.

    Which layers convert is decided one of two ways:

    - **Without** ``module_filter``, by the built-in rules. The output head is skipped
      unless ``include_head=True`` (logits feed a softmax over the whole vocabulary, where
      fp8's 2**-4 relative error is most visible). The head is found by what it is, in this
      order: every linear whose weight is tied to an ``nn.Embedding``'s and every linear
      named in ``HEAD_NAMES`` (``lm_head``, ``output``, ``head``: the last part of its
      name, any case); if there is none, every linear whose ``out_features`` is the
      vocabulary (``num_embeddings`` of the model's largest ``nn.Embedding``); if there is
      none either, the last ``nn.Linear`` in registration order (a ``Sequential``'s last
      layer). A linear with ``min(in_features, out_features) < min_features`` (default
      ``DEFAULT_MIN_FEATURES``, 1024, whose docstring derives the break-even) is skipped
      because fp8 would make it slower.
    - **With** ``module_filter(module, fqn) -> bool``, the filter alone decides, as torchao's
      ``module_filter_fn`` does: it is called for every convertible linear and converts
      exactly the ones it returns ``True`` for, head and narrow layers included. Passing
      ``include_head`` or ``min_features`` as well raises ``ValueError`` (they would be
      ignored); fold them into the filter.

    **Subclasses of** ``nn.Linear`` convert like ``nn.Linear`` when they add nothing an
    ``QuantizedLinear`` would drop: no ``forward`` (nor ``__call__``, ``weight`` or ``bias``) of
    their own, and no parameters, buffers or submodules beyond ``weight`` and ``bias``
    (torchtitan's ``class Linear(nn.Linear, Module)``, for instance). The new layer is an
    ``QuantizedLinear``, not an instance of the subclass. A subclass that does override
    ``forward`` converts only through ``converters``, the extension point for framework
    linears: ``{MyLinear: converter}`` maps a class (and its subclasses) to an
    ``Converter`` that builds the replacement, called as ``converter(linear, ctx,
    backend=backend, quantize=quantize)``. ``{MyLinear: QuantizedLinear.from_linear}`` vouches
    that ``MyLinear.forward`` computes ``x Wᵀ + b``; a framework whose linear does more
    passes a function that builds its own fp8 module (one that is not a ``MyLinear``, or a
    second conversion converts it again). The rules above apply to these layers too.

    Either way, what fp8 cannot run is skipped, with the reason recorded: any other subclass
    (``nn.MultiheadAttention``'s ``out_proj``, which it never calls, and parametrized
    linears among them; the filter is not asked about these); ``in_features`` or
    ``out_features`` not a multiple of ``FEATURE_MULTIPLE`` (16, the fp8 GEMM tile step:
    ``check_fp8_widths``, the check ``QuantizedLinear`` raises) or, under ``mx``, of 32 (rule
    ``granularity``: ``check_granularity_widths``); a weight that is not bf16/fp16/fp32;
    ``model`` itself (no parent to swap it into; use ``QuantizedLinear.from_linear``).

    **Converting again.** A layer that is already a ``QuantizedLinear`` under the same policy
    (``ctx.recipe`` and ``ctx.compute``, what it reads) is left as it is and reported in
    ``already_fp8``, so a second call with the same ctx changes nothing. Under a different
    policy the call raises ``ValueError`` naming both: a converted layer keeps the policy it
    was built with.

    When nothing converts and the model holds no ``QuantizedLinear`` afterwards, a
    ``UserWarning`` says why, grouped by rule, and which knob would change it. When a
    skipped head keeps weights of a dtype other than ``ctx.compute``, the report's
    ``notes`` say how to run it (a ``ctx.compute`` activation from the fp8 layers would
    not match its weight).

    **Grouped experts** convert in place through their framework's ``ExpertsConverter``
    (``convert_experts``) to run ``quantized_grouped_mm``, by the same rules (the filter, or
    ``min_features`` and every expert weight's widths), listed in ``experts``; routers stay
    high (rule ``router``). **4-bit recipes**: ``Fp4Linear``, and ``Fp4Experts`` for
    ``computectx.nn``'s experts (others raise ``NotImplementedError``: fp8 never stands in);
    ``hp`` and ``hp_last`` skip linears and experts alike (``kept_high``), a rule that can keep
    nothing high is a ``UserWarning``, and ``backend`` or ``quantize`` a ``ValueError``. Each
    4-bit module built gets the stream of its name in ``model`` (``assign_fp4_streams``).

    ``backend`` and ``quantize`` go to every new ``QuantizedLinear`` (``"inline"`` lets Inductor
    fuse the quantize of a compiled model; same bytes as the default ``"op"``).

    Converted layers keep their ``weight``/``bias`` Parameter objects (optimizers keep working),
    and ``model.load_state_dict`` then checks every fp8 layer's entries before any module loads
    (``computectx.formats.scaling.load.guard_whole_loads``). A linear reachable under several
    names is converted once and replaced everywhere. All decisions are made before the model
    changes, so an exception from ``module_filter`` or a converter (or a filter result that is
    not a bool, a ``TypeError``) leaves it untouched; an experts converter that raises in
    ``convert`` has what was swapped put back before the error goes on."""
    given = (include_head, min_features, backend, quantize)
    policy, how, rules, places, order, experts = _planned(
        model, ctx, module_filter, given, converters
    )
    converted, skipped = _decide(order, experts, rules, output_heads(model, order))
    # Build every replacement (which validates ctx and backend) before swapping any.
    replacements = [(lin, rules.build(fqn, lin, backend, how)) for fqn, lin in converted]
    _warn_unheeded(rules, places, experts)
    expert_names = _swap(model, replacements, places, experts, experts.settings(policy, backend))
    if replacements or expert_names:
        guard_whole_loads(model)  # load_state_dict checks every layer's state before any loads
    return _reported(rules, order, places, converted, skipped, expert_names)


def check_convertible(
    model: nn.Module,
    ctx: ComputeCtx,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
) -> None:
    """Raise now what ``convert_to_quantized(model, ctx, module_filter)`` would raise before
    it changes anything (its arguments, layers or experts converted under another policy,
    experts whose converter cannot run the recipe, a filter that raises or returns no bool);
    nothing changes. ``parallelize`` runs it inside the ranks' agreement, so a rank whose
    model cannot convert fails every rank (the filter is called once more there). With no
    ``ctx.recipe`` (nothing converts): a layer converted already, under its own policy."""
    if isinstance(ctx, ComputeCtx) and ctx.recipe is None:
        refuse_another_policy(model, ctx, "parallelize")
        return
    _, _, rules, _, order, experts = _planned(
        model, ctx, module_filter, (None, None, None, "op"), None
    )
    _decide(order, experts, rules, output_heads(model, order))


def _planned(
    model: nn.Module,
    ctx: ComputeCtx,
    module_filter: Callable[[nn.Module, str], bool] | None,
    given: tuple[bool | None, int | None, Backend | str | None, QuantizeImpl],
    converters: Mapping[type[nn.Linear], Converter] | None,
) -> tuple[
    Recipe | Fp4Recipe, QuantizeImpl, _Rules, Places, list[tuple[str, nn.Linear]], ExpertsPlan
]:
    """``convert_to_quantized``'s checks and plan, nothing changed (``given``: ``include_head``,
    ``min_features``, ``backend``, ``quantize``): the policy, the quantize, the rules, where each
    linear sits, the linears in order, the experts' plan."""
    policy, how = _checked_args(model, ctx, module_filter, *given)
    least = DEFAULT_MIN_FEATURES if given[1] is None else given[1]  # an int: _checked_args
    checked = _checked_converters(converters)
    rules = _Rules(model, ctx, module_filter, bool(given[0]), least, checked)
    places, order = _linear_places(model)
    refuse_another_policy(model, ctx)
    return policy, how, rules, places, order, plan_experts(model, policy, module_filter, least)


Places = dict[int, list[tuple[str, nn.Module, str]]]
"""``id(linear) -> [(fqn, parent, attribute)]``: every place a linear sits (one shared: each)."""


def _warn_unheeded(rules: _Rules, places: Places, experts: ExpertsPlan) -> None:
    """A ``UserWarning`` (at ``convert_to_quantized``'s caller) for each rule of a 4-bit
    recipe that keeps nothing high: an ``hp`` pattern naming no linear or experts module,
    ``hp_last`` on a model without a block list (``linear.fp4_rules.unheeded_rules``)."""
    if rules.fp4 is None:
        return
    names = [alias for at in places.values() for alias, _, _ in at]
    names += [s.fqn for s in experts.skipped] + [fqn for fqn, _, _ in experts.convert]
    for message in unheeded_rules(rules.fp4, names, bool(rules.blocks)):
        warnings.warn(message, UserWarning, stacklevel=3)


def _reported(
    rules: _Rules,
    order: list[tuple[str, nn.Linear]],
    places: Places,
    converted: list[tuple[str, nn.Linear]],
    skipped: list[SkippedLinear],
    experts: tuple[str, ...],
) -> ConversionReport:
    """The call's report (every name a converted linear sits under, then the experts), with
    a ``UserWarning`` when nothing converted (``nothing_converted`` says why, by rule)."""
    names = tuple(alias for _, lin in converted for alias, _, _ in places[id(lin)])
    notes = head_dtype_notes(rules.ctx, order, skipped)
    fmt = "fp8" if rules.fp4 is None else rules.fp4.format
    report = ConversionReport(
        converted=names + experts, skipped=tuple(skipped), notes=notes, experts=experts, target=fmt
    )
    if not report.converted and not any(s.rule == "already_fp8" for s in skipped):
        warnings.warn(
            nothing_converted(rules.model, rules.min_features, report, fmt),
            UserWarning,
            stacklevel=3,
        )
    return report


def _checked_args(
    model: object,
    ctx: object,
    module_filter: object,
    include_head: object,
    min_features: object,
    backend: object,
    quantize: object,
) -> tuple[Recipe | Fp4Recipe, QuantizeImpl]:
    """``convert_to_quantized``'s arguments checked in order: ``(policy, quantize)``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_quantized takes an nn.Module, got {describe(model)}")
    policy = recipe_of(ctx, "convert_to_quantized")
    how = parse_quantize(quantize)
    if module_filter is not None:
        if not callable(module_filter):
            raise TypeError(
                f"module_filter must be callable(module, fqn) -> bool, "
                f"got {describe(module_filter)}"
            )
        given = [
            f"{name}={value!r}"
            for name, value in (("include_head", include_head), ("min_features", min_features))
            if value is not None
        ]
        if given:
            raise ValueError(
                f"convert_to_quantized: a module_filter decides alone which linears convert, so "
                f"{' and '.join(given)} would be ignored; drop it, or fold it into the filter "
                f"(e.g. lambda m, fqn: min(m.in_features, m.out_features) >= 64)"
            )
    if include_head is not None and not isinstance(include_head, bool):
        raise TypeError(f"include_head must be a bool, got {describe(include_head)}")
    if min_features is not None and (
        isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 1
    ):
        raise ValueError(f"min_features must be an int >= 1, got {min_features!r}")
    _refuse_fp8_options(policy, backend, how)
    return policy, how


def _refuse_fp8_options(policy: Recipe | Fp4Recipe, backend: object, how: QuantizeImpl) -> None:
    """``ValueError`` for an fp8-only option under a 4-bit recipe: it would be ignored."""
    given = [f"backend={backend!r}"] * (backend is not None) + [f"quantize={how!r}"] * (how != "op")
    if isinstance(policy, Fp4Recipe) and given:
        raise ValueError(
            f"convert_to_quantized: {' and '.join(given)} set the fp8 GEMMs; under the 4-bit "
            f"recipe {policy} the operators pick their backend by device (ops.fp4."
            f"select_fp4_backend), so drop it. The model was left unchanged"
        )


def _linear_places(model: nn.Module) -> tuple[Places, list[tuple[str, nn.Linear]]]:
    """Where each linear of ``model`` sits, and the linears in registration order (``model``
    itself first when it is one)."""
    places: Places = {}
    order: list[tuple[str, nn.Linear]] = []
    for fqn, child in model.named_modules(remove_duplicate=False):
        if isinstance(child, nn.Linear) and fqn:
            parent_fqn, _, name = fqn.rpartition(".")
            parent = model.get_submodule(parent_fqn)
            if id(child) not in places:
                places[id(child)] = []
                order.append((fqn, child))
            places[id(child)].append((fqn, parent, name))
    if isinstance(model, nn.Linear):
        order.insert(0, ("", model))
    return places, order


def _decide(
    order: list[tuple[str, nn.Linear]],
    experts: ExpertsPlan,
    rules: _Rules,
    heads: dict[int, str],
) -> tuple[list[tuple[str, nn.Linear]], list[SkippedLinear]]:
    """``(converted, skipped)``: each linear in order converts or is skipped with its rule
    (routers of mixtures of experts stay in high precision)."""
    converted: list[tuple[str, nn.Linear]] = []
    skipped: list[SkippedLinear] = list(experts.skipped)
    for fqn, lin in order:
        if id(lin) in experts.routers and not isinstance(lin, QuantizedLinear):
            skipped.append(SkippedLinear(fqn, "the router of a mixture of experts", "router"))
            continue
        found = rules.skip(fqn, lin, heads)
        if found is None:
            converted.append((fqn, lin))
        else:
            skipped.append(SkippedLinear(fqn or "<root>", found[1], found[0]))
    return converted, skipped


def _swap(
    model: nn.Module,
    replacements: list[tuple[nn.Linear, nn.Module]],
    places: Places,
    experts: ExpertsPlan,
    settings: tuple[ExpertsSetting, ...],
) -> tuple[str, ...]:
    """Put every replacement in each of its linear's places, convert the experts, and give the
    new 4-bit modules their names' streams in ``model``; the converted experts' names. Only an
    experts converter can fail (its ``convert()``): it undoes its modules, the linears go back."""
    for lin, new in replacements:
        for _, parent, name in places[id(lin)]:
            setattr(parent, name, new)
    try:
        names = experts.apply(settings)
    except BaseException:
        for lin, _ in replacements:
            for _, parent, name in places[id(lin)]:
                setattr(parent, name, lin)
        raise
    assign_streams_to(model, [*(new for _, new in replacements), *settings])  # 4 bits only
    return names


def _checked_converters(
    converters: Mapping[type[nn.Linear], Converter] | None,
) -> dict[type[nn.Linear], Converter]:
    if converters is None:
        return {}
    if not isinstance(converters, Mapping):
        raise TypeError(
            f"converters must map nn.Linear subclasses to converters, got {describe(converters)}"
        )
    for cls, fn in converters.items():
        if (
            not isinstance(cls, type)
            or not issubclass(cls, nn.Linear)
            or cls is nn.Linear
            or issubclass(cls, (QuantizedLinear, Fp4Linear))
        ):
            raise TypeError(
                f"converters keys must be subclasses of nn.Linear (not nn.Linear itself or "
                f"QuantizedLinear), got {describe(cls)}"
            )
        if not callable(fn):
            raise TypeError(
                f"converters[{cls.__name__}] must be callable(linear, ctx, *, backend, "
                f"quantize) -> nn.Module, got {describe(fn)}"
            )
    return dict(converters)


@dataclass(frozen=True)
class _Rules:
    """The settings of one ``convert_to_quantized`` call, and the rules they imply."""

    model: nn.Module
    ctx: ComputeCtx
    module_filter: Callable[[nn.Module, str], bool] | None
    include_head: bool
    min_features: int
    converters: dict[type[nn.Linear], Converter]

    @property
    def fp4(self) -> Fp4Recipe | None:
        """The 4-bit recipe, if the call converts under one."""
        return self.ctx.recipe if isinstance(self.ctx.recipe, Fp4Recipe) else None

    @functools.cached_property
    def blocks(self) -> dict[int, tuple[int, int]]:
        """The model's blocks (``linear.fp4_rules.model_blocks``; asked under a 4-bit recipe)."""
        return model_blocks(self.model)

    def converter_for(self, lin: nn.Linear) -> Converter | None:
        """The converter registered for ``lin``'s class or the nearest base, if any."""
        for cls in type(lin).__mro__:
            if cls in self.converters:
                return self.converters[cls]
        return None

    def build(
        self, fqn: str, lin: nn.Linear, backend: Backend | str | None, how: QuantizeImpl
    ) -> nn.Module:
        """The replacement of ``lin``: its converter's, or a ``QuantizedLinear``."""
        convert = self.converter_for(lin)
        if convert is None and self.fp4 is not None:
            return Fp4Linear.from_linear(lin, self.ctx)
        if convert is None:
            return QuantizedLinear.from_linear(lin, self.ctx, backend=backend, quantize=how)
        new = convert(lin, self.ctx, backend=backend, quantize=how)
        if not isinstance(new, nn.Module):
            raise TypeError(
                f"the converter for {type(lin).__name__} returned {describe(new)} for "
                f"{fqn!r}, not an nn.Module; the model was left unchanged"
            )
        return new

    def skip(self, fqn: str, lin: nn.Linear, heads: dict[int, str]) -> tuple[SkipRule, str] | None:
        """Why ``lin`` stays as it is, or ``None`` to convert it."""
        if isinstance(lin, (QuantizedLinear, Fp4Linear)):
            return "already_fp8", f"already a {type(lin).__name__} under this policy"
        added = unconvertible_behaviour(lin) if self.converter_for(lin) is None else None
        if added is not None:
            # Swapping it for a QuantizedLinear would silently drop that behaviour.
            return "subclass", (
                f"{type(lin).__name__} is a subclass of nn.Linear and {added}; pass "
                f"converters={{{type(lin).__name__}: ...}} to convert it"
            )
        if self.module_filter is not None:
            if filtered_out(self.module_filter, lin, fqn):
                return "module_filter", "module_filter returned False"
        elif id(lin) in heads and not self.include_head:
            return "head", f"{heads[id(lin)]}; pass include_head=True to convert it"
        if self.fp4 is not None and self.fp4.keeps_high(fqn, *self.blocks.get(id(lin), (None, 0))):
            return "kept_high", f"kept in high precision by the 4-bit recipe {self.fp4}"
        n_in, n_out = lin.in_features, lin.out_features
        try:
            check_fp8_widths(n_in, n_out)
        except ValueError as e:
            return "feature_multiple", str(e)
        if self.fp4 is not None and (n_in % self.fp4.block or n_out % self.fp4.block):
            return "granularity", f"widths {n_in}, {n_out}: mxfp4 needs multiples of 32"
        try:
            if isinstance(self.ctx.recipe, Recipe):
                check_granularity_widths(self.ctx.recipe.granularity, n_in, n_out)
        except ValueError as e:
            return "granularity", str(e)
        if self.module_filter is None and min(n_in, n_out) < self.min_features:
            return "min_features", (
                f"min(in_features, out_features)={min(n_in, n_out)} < min_features="
                f"{self.min_features}: the quantize passes cost more than the fp8 GEMMs save"
            )
        if lin.weight.dtype not in FLOAT_DTYPES:
            return "dtype", f"weight dtype {lin.weight.dtype} is not bf16, fp16 or fp32"
        if lin is self.model:
            return (
                "root",
                "the root module has no parent to swap it in; use QuantizedLinear.from_linear",
            )
        return None
