"""``convert_to_fp8``: swap a model's ``nn.Linear`` layers for ``Fp8Linear``, and report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from computectx.ctx import ComputeCtx
from computectx.fp8.autograd import ACTIVATION_DTYPES
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.linear import Fp8Linear
from computectx.fp8.policy import policy_of

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FEATURE_MULTIPLE",
    "Fp8ConversionReport",
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
``min_features`` to ``convert_to_fp8`` to choose otherwise (tests use 16)."""


@dataclass(frozen=True)
class SkippedLinear:
    """A linear ``convert_to_fp8`` left alone, and why."""

    fqn: str
    reason: str


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
    include_head: bool = False,
    min_features: int = DEFAULT_MIN_FEATURES,
    backend: Fp8Backend | str | None = None,
) -> Fp8ConversionReport:
    """Swap ``model``'s ``nn.Linear`` layers for ``Fp8Linear`` in place; report what happened.

    Each linear (by fully qualified name, in registration order) is skipped, with the
    reason recorded, when:

    1. ``module_filter(module, fqn)`` returns False;
    2. it is the output head and ``include_head`` is False. The head is the *last*
       ``nn.Linear`` in registration order, and any linear whose weight is tied to an
       ``nn.Embedding``'s: logits feed a softmax over the whole vocabulary, where fp8's
       2**-4 relative error is most visible;
    3. its shape makes fp8 a loss: ``in_features`` or ``out_features`` not a multiple of
       ``FEATURE_MULTIPLE`` (16), or ``min(in_features, out_features) < min_features``
       (default ``DEFAULT_MIN_FEATURES``; its docstring derives the break-even);
    4. its weight is not bf16/fp16/fp32, or it is ``model`` itself (there is no parent to
       swap it in; use ``Fp8Linear.from_linear``);
    5. it is an instance of a *subclass* of ``nn.Linear`` (only plain ``nn.Linear`` layers
       are swapped: a subclass's forward may do more than ``x Wᵀ + b``).

    Converted layers keep their ``weight``/``bias`` Parameter objects (optimizers keep
    working). A linear reachable under several names is converted once and replaced
    everywhere. All decisions are made before the model changes, so an exception from
    ``module_filter`` leaves it untouched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_fp8 takes an nn.Module, got {type(model).__name__}")
    policy_of(ctx, "convert_to_fp8")
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 1:
        raise ValueError(f"min_features must be an int >= 1, got {min_features!r}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError(
            f"module_filter must be callable(module, fqn) -> bool, got {module_filter!r}"
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
    root_is_linear = isinstance(model, nn.Linear)
    if root_is_linear:
        order.insert(0, ("", model))  # type: ignore[arg-type]  # narrowed just above

    heads = _heads(model, order)
    converted: list[tuple[str, nn.Linear]] = []
    skipped: list[SkippedLinear] = []
    for fqn, lin in order:
        reason = _skip_reason(fqn, lin, model, module_filter, heads, include_head, min_features)
        if reason is None:
            converted.append((fqn, lin))
        else:
            skipped.append(SkippedLinear(fqn or "<root>", reason))

    # Build every replacement (which validates ctx and backend) before swapping any.
    replacements = [(lin, Fp8Linear.from_linear(lin, ctx, backend=backend)) for _, lin in converted]
    for lin, new in replacements:
        for _, parent, name in places[id(lin)]:
            setattr(parent, name, new)
    names = tuple(alias for _, lin in converted for alias, _, _ in places[id(lin)])
    return Fp8ConversionReport(converted=names, skipped=tuple(skipped))


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


def _skip_reason(
    fqn: str,
    lin: nn.Linear,
    model: nn.Module,
    module_filter: Callable[[nn.Module, str], bool] | None,
    heads: dict[int, str],
    include_head: bool,
    min_features: int,
) -> str | None:
    if isinstance(lin, Fp8Linear):
        return "already an Fp8Linear"
    if type(lin) is not nn.Linear:
        # A subclass may compute more than x Wᵀ + b (adapters, extra parameters) or never
        # call its own forward (nn.MultiheadAttention's out_proj); swapping it for an
        # Fp8Linear would silently drop that behaviour.
        return (
            f"{type(lin).__name__} is a subclass of nn.Linear, whose forward may differ; "
            f"only plain nn.Linear layers are converted"
        )
    if module_filter is not None and not module_filter(lin, fqn):
        return "module_filter returned False"
    if id(lin) in heads and not include_head:
        return f"{heads[id(lin)]}; pass include_head=True to convert it"
    n_in, n_out = lin.in_features, lin.out_features
    if n_in % FEATURE_MULTIPLE or n_out % FEATURE_MULTIPLE:
        return (
            f"in_features={n_in}, out_features={n_out}: both must be multiples of "
            f"{FEATURE_MULTIPLE} for full fp8 GEMM tiles"
        )
    if min(n_in, n_out) < min_features:
        return (
            f"min(in_features, out_features)={min(n_in, n_out)} < min_features="
            f"{min_features}: the quantize passes cost more than the fp8 GEMMs save"
        )
    if lin.weight.dtype not in ACTIVATION_DTYPES:
        return f"weight dtype {lin.weight.dtype} is not bf16, fp16 or fp32"
    if lin is model:
        return "the root module has no parent to swap it in; use Fp8Linear.from_linear"
    return None
