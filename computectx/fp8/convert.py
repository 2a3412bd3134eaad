"""``convert_to_fp8``: swap a model's ``nn.Linear`` layers for ``Fp8Linear``, and report."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn

from computectx.ctx import ComputeCtx
from computectx.fp8.autograd import ACTIVATION_DTYPES
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.fused import QuantizeImpl, parse_quantize
from computectx.fp8.linear import Fp8Linear
from computectx.fp8.policy import describe, policy_of

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FEATURE_MULTIPLE",
    "Fp8ConversionReport",
    "SkipRule",
    "SkippedLinear",
    "convert_to_fp8",
]

FEATURE_MULTIPLE = 16
"""``in_features`` and ``out_features`` must be multiples of this to convert: fp8 tensor
core tiles (and cuBLASLt's fp8 GEMMs) work on 16-element K and N steps; other widths run
masked edge tiles at a fraction of the speed."""

DEFAULT_MIN_FEATURES = 1024
"""Narrowest ``min(in_features, out_features)`` that ``convert_to_fp8`` converts by default.

Per training step an fp8 linear with ``M`` rows saves about half of its three GEMMs'
``6·M·N·K`` flops (fp8 tensor cores run at twice the bf16 rate) and pays three quantize
passes that read 2 and write 1 byte per element of ``X [M, K]``, ``W [N, K]`` and
``dY [M, N]``. It wins when ``3·M·N·K / P > 3·(M·K + N·K + M·N) / B``, i.e. when
``1 / (1/M + 1/N + 1/K) > P / B``, with ``P`` the bf16 peak and ``B`` the memory bandwidth.
On an H100 (989 TFLOP/s, 3.35 TB/s) ``P / B ≈ 300``: with many rows, ``N = K ≈ 600`` only
breaks even, and at 1024 the saving is still well under half the ideal. Pass
``min_features`` (or a ``module_filter``) to ``convert_to_fp8`` to choose otherwise."""


SkipRule = Literal[
    "already_fp8",
    "subclass",
    "module_filter",
    "head",
    "feature_multiple",
    "min_features",
    "dtype",
    "root",
]
"""Which rule left a linear alone (``SkippedLinear.rule``); ``convert_to_fp8`` lists them."""


@dataclass(frozen=True)
class SkippedLinear:
    """A linear ``convert_to_fp8`` left alone, why (``reason``), and by which rule."""

    fqn: str
    reason: str
    rule: SkipRule


@dataclass(frozen=True)
class Fp8ConversionReport:
    """What ``convert_to_fp8`` did: converted layer names and skipped ones with reasons."""

    converted: tuple[str, ...]
    skipped: tuple[SkippedLinear, ...]

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} linear(s) to fp8:"]
        lines += [f"  {fqn}" for fqn in self.converted]
        lines.append(f"skipped {len(self.skipped)}:")
        lines += [f"  {s.fqn}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def convert_to_fp8(
    model: nn.Module,
    ctx: ComputeCtx,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    *,
    include_head: bool | None = None,
    min_features: int | None = None,
    backend: Fp8Backend | str | None = None,
    quantize: QuantizeImpl = "op",
) -> Fp8ConversionReport:
    """Swap ``model``'s ``nn.Linear`` layers for ``Fp8Linear`` in place; report what happened.

    Which layers convert is decided one of two ways:

    - **Without** ``module_filter``, by the built-in rules: the output head is skipped
      unless ``include_head=True`` (default ``False``); the head is the *last*
      ``nn.Linear`` in registration order, and any linear whose weight is tied to an
      ``nn.Embedding``'s (logits feed a softmax over the whole vocabulary, where fp8's
      2**-4 relative error is most visible). A linear with ``min(in_features,
      out_features) < min_features`` (default ``DEFAULT_MIN_FEATURES``, 1024, whose
      docstring derives the break-even) is skipped because fp8 would make it slower.
    - **With** ``module_filter(module, fqn) -> bool``, the filter alone decides, as torchao's
      ``module_filter_fn`` does: it is called for every plain ``nn.Linear`` and converts
      exactly the ones it returns ``True`` for, head and narrow layers included. Passing
      ``include_head`` or ``min_features`` as well raises ``ValueError`` (they would be
      ignored); fold them into the filter.

    Either way, what fp8 cannot run is skipped, with the reason recorded: a layer that is
    already an ``Fp8Linear``; an instance of a *subclass* of ``nn.Linear`` (its forward may
    do more than ``x Wᵀ + b``; the filter is not asked about these); ``in_features`` or
    ``out_features`` not a multiple of ``FEATURE_MULTIPLE`` (16, the fp8 GEMM tile step); a
    weight that is not bf16/fp16/fp32; ``model`` itself (no parent to swap it into; use
    ``Fp8Linear.from_linear``).

    When nothing converts and the model holds no ``Fp8Linear`` afterwards, a
    ``UserWarning`` says why, grouped by rule, and which knob would change it.

    ``backend`` and ``quantize`` are passed to every new ``Fp8Linear`` (``quantize="fused"``
    lets Inductor fuse the quantize of a compiled model; same bytes as the default ``"op"``).

    Converted layers keep their ``weight``/``bias`` Parameter objects (optimizers keep
    working). A linear reachable under several names is converted once and replaced
    everywhere. All decisions are made before the model changes, so an exception from
    ``module_filter`` (or a filter result that is not a bool, a ``TypeError``) leaves it
    untouched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_fp8 takes an nn.Module, got {describe(model)}")
    policy_of(ctx, "convert_to_fp8")
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
                f"convert_to_fp8: a module_filter decides alone which linears convert, so "
                f"{' and '.join(given)} would be ignored; drop it, or fold it into the filter "
                f"(e.g. lambda m, fqn: min(m.in_features, m.out_features) >= 64)"
            )
    if include_head is not None and not isinstance(include_head, bool):
        raise TypeError(f"include_head must be a bool, got {describe(include_head)}")
    if min_features is not None and (
        isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 1
    ):
        raise ValueError(f"min_features must be an int >= 1, got {min_features!r}")
    rules = _Rules(
        model=model,
        module_filter=module_filter,
        include_head=bool(include_head),
        min_features=DEFAULT_MIN_FEATURES if min_features is None else min_features,
    )

    # Every place each linear sits (a module shared under two names sits in two).
    places: dict[int, list[tuple[str, nn.Module, str]]] = {}
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

    heads = _heads(model, order)
    converted: list[tuple[str, nn.Linear]] = []
    skipped: list[SkippedLinear] = []
    for fqn, lin in order:
        found = rules.skip(fqn, lin, heads)
        if found is None:
            converted.append((fqn, lin))
        else:
            skipped.append(SkippedLinear(fqn or "<root>", found[1], found[0]))

    # Build every replacement (which validates ctx and backend) before swapping any.
    replacements = [
        (lin, Fp8Linear.from_linear(lin, ctx, backend=backend, quantize=how))
        for _, lin in converted
    ]
    for lin, new in replacements:
        for _, parent, name in places[id(lin)]:
            setattr(parent, name, new)
    names = tuple(alias for _, lin in converted for alias, _, _ in places[id(lin)])
    report = Fp8ConversionReport(converted=names, skipped=tuple(skipped))
    if not names and not any(s.rule == "already_fp8" for s in skipped):
        warnings.warn(_nothing_converted(model, rules, report), UserWarning, stacklevel=2)
    return report


def _heads(model: nn.Module, order: list[tuple[str, nn.Linear]]) -> dict[int, str]:
    heads: dict[int, str] = {}
    if order:
        heads[id(order[-1][1])] = "output head (the last nn.Linear in registration order)"
    for efqn, emb in model.named_modules():
        if isinstance(emb, nn.Embedding):
            for _, lin in order:
                if lin.weight is emb.weight:
                    heads[id(lin)] = f"output head (weight tied to nn.Embedding {efqn!r})"
    return heads


@dataclass(frozen=True)
class _Rules:
    """The settings of one ``convert_to_fp8`` call, and the rules they imply."""

    model: nn.Module
    module_filter: Callable[[nn.Module, str], bool] | None
    include_head: bool
    min_features: int

    def skip(self, fqn: str, lin: nn.Linear, heads: dict[int, str]) -> tuple[SkipRule, str] | None:
        """Why ``lin`` stays as it is, or ``None`` to convert it."""
        if isinstance(lin, Fp8Linear):
            return "already_fp8", "already an Fp8Linear"
        if type(lin) is not nn.Linear:
            # A subclass may compute more than x Wᵀ + b (adapters, extra parameters) or
            # never call its own forward (nn.MultiheadAttention's out_proj); swapping it for
            # an Fp8Linear would silently drop that behaviour.
            return "subclass", (
                f"{type(lin).__name__} is a subclass of nn.Linear, whose forward may differ; "
                f"only plain nn.Linear layers are converted"
            )
        if self.module_filter is not None:
            chosen = self.module_filter(lin, fqn)
            if not isinstance(chosen, bool):
                raise TypeError(
                    f"module_filter must return a bool, got {describe(chosen)} for "
                    f"{fqn or '<root>'!r}; the model was left unchanged"
                )
            if not chosen:
                return "module_filter", "module_filter returned False"
        elif id(lin) in heads and not self.include_head:
            return "head", f"{heads[id(lin)]}; pass include_head=True to convert it"
        n_in, n_out = lin.in_features, lin.out_features
        if n_in % FEATURE_MULTIPLE or n_out % FEATURE_MULTIPLE:
            return "feature_multiple", (
                f"in_features={n_in}, out_features={n_out}: both must be multiples of "
                f"{FEATURE_MULTIPLE} for fp8 GEMM tiles"
            )
        if self.module_filter is None and min(n_in, n_out) < self.min_features:
            return "min_features", (
                f"min(in_features, out_features)={min(n_in, n_out)} < min_features="
                f"{self.min_features}: the quantize passes cost more than the fp8 GEMMs save"
            )
        if lin.weight.dtype not in ACTIVATION_DTYPES:
            return "dtype", f"weight dtype {lin.weight.dtype} is not bf16, fp16 or fp32"
        if lin is self.model:
            return "root", "the root module has no parent to swap it in; use Fp8Linear.from_linear"
        return None


def _nothing_converted(model: nn.Module, rules: _Rules, report: Fp8ConversionReport) -> str:
    """The warning text for a conversion that converted nothing: reasons grouped by rule."""
    what = type(model).__name__
    if not report.skipped:
        return f"convert_to_fp8 found no nn.Linear in {what}: nothing runs in fp8"
    hints: dict[SkipRule, str] = {
        "module_filter": "module_filter returned False; with a filter given it alone decides",
        "head": "output head; pass include_head=True (or a module_filter) to convert it",
        "min_features": (
            f"min(in_features, out_features) < min_features={rules.min_features}; pass a "
            f"smaller min_features (e.g. min_features={FEATURE_MULTIPLE}) or a module_filter"
        ),
        "feature_multiple": (
            f"in_features or out_features not a multiple of {FEATURE_MULTIPLE}, which fp8 "
            f"GEMM tiles need"
        ),
        "dtype": "weight dtype is not bf16, fp16 or fp32; cast the model first",
        "subclass": "a subclass of nn.Linear; only plain nn.Linear layers are converted",
        "root": "the model itself; use Fp8Linear.from_linear",
    }
    groups: dict[SkipRule, list[str]] = {}
    for s in report.skipped:
        groups.setdefault(s.rule, []).append(s.fqn)
    lines = [
        f"convert_to_fp8 converted none of the {len(report.skipped)} nn.Linear layer(s) in "
        f"{what}, so nothing in it runs in fp8:"
    ]
    for rule, fqns in groups.items():
        shown = ", ".join(repr(f) for f in fqns[:3]) + (", ..." if len(fqns) > 3 else "")
        lines.append(f"  {len(fqns)} skipped ({shown}): {hints.get(rule, rule)}")
    lines.append("The returned Fp8ConversionReport gives every layer's reason.")
    return "\n".join(lines)
