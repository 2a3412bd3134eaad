"""What ``convert_to_quantized`` returns and says: its report, the skip rules (the output
head found by what it is), notes and warning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from computectx.ctx import ComputeCtx
from computectx.formats.linear.fp4 import Fp4Linear
from computectx.formats.linear.module import QuantizedLinear
from computectx.formats.policy import FEATURE_MULTIPLE

__all__ = [
    "HEAD_NAMES",
    "ConversionReport",
    "SkipRule",
    "SkippedLinear",
    "head_dtype_notes",
    "nothing_converted",
    "output_heads",
    "refuse_another_policy",
    "unconvertible_behaviour",
]

HEAD_NAMES = ("lm_head", "output", "head")
"""Names (the last part of a layer's qualified name, any case) that mark an output head."""


SkipRule = Literal[
    "already_fp8",
    "subclass",
    "module_filter",
    "head",
    "feature_multiple",
    "granularity",
    "min_features",
    "dtype",
    "root",
    "router",
    "kept_high",
]
"""Which rule left a linear alone (``SkippedLinear.rule``); ``convert_to_quantized`` lists them."""


@dataclass(frozen=True)
class SkippedLinear:
    """A linear ``convert_to_quantized`` left alone, why (``reason``), and by which rule."""

    fqn: str
    reason: str
    rule: SkipRule


@dataclass(frozen=True)
class ConversionReport:
    """What ``convert_to_quantized`` did: converted layer names, skipped ones with reasons (layers
    converted before are skipped with rule ``already_fp8``), and ``notes`` on what to do
    next."""

    converted: tuple[str, ...]
    skipped: tuple[SkippedLinear, ...]
    notes: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    """The grouped-experts modules among ``converted`` (``convert_experts``): their expert
    GEMMs now run through ``quantized_grouped_mm`` (or the 4-bit grouped GEMM)."""
    target: str = "fp8"
    """What the layers were converted to: ``"fp8"``, or the 4-bit format (``"nvfp4"``,
    ``"mxfp4"``)."""

    @property
    def already_fp8(self) -> tuple[str, ...]:
        """Layers that were already ``QuantizedLinear`` under the same policy (left as they are)."""
        return tuple(s.fqn for s in self.skipped if s.rule == "already_fp8")

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} linear(s) to {self.target}:"]
        lines += [
            f"  {fqn}" + (" (grouped experts)" if fqn in self.experts else "")
            for fqn in self.converted
        ]
        if self.already_fp8:
            lines.append(
                f"already fp8 under this policy, left as they are: {len(self.already_fp8)}"
            )
            lines += [f"  {fqn}" for fqn in self.already_fp8]
        others = [s for s in self.skipped if s.rule != "already_fp8"]
        lines.append(f"skipped {len(others)}:")
        lines += [f"  {s.fqn}: {s.reason}" for s in others]
        if self.notes:
            lines.append("notes:")
            lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def head_dtype_notes(
    ctx: ComputeCtx, order: list[tuple[str, nn.Linear]], skipped: list[SkippedLinear]
) -> tuple[str, ...]:
    """What to do when a skipped head's weight is not at ``ctx.compute``: fp8 layers return
    their input's dtype, but a plain linear needs its input at its weight's dtype."""
    by_name = dict(order)
    compute = ctx.compute.torch
    notes = []
    for s in skipped:
        head = by_name.get(s.fqn)
        if s.rule != "head" or head is None or head.weight.dtype == compute:
            continue
        notes.append(
            f"the head {s.fqn!r} stays an nn.Linear with {head.weight.dtype} weights while "
            f"ctx.compute is {ctx.compute}: an {ctx.compute} activation reaching it fails "
            f"with a dtype mismatch. Run the forward under ctx.autocast() (the head then "
            f"computes at {ctx.compute} from its {head.weight.dtype} weights), cast the "
            f"model to {compute} before converting, or pass include_head=True"
        )
    return tuple(notes)


def nothing_converted(
    model: nn.Module, min_features: int, report: ConversionReport, fmt: str = "fp8"
) -> str:
    """The warning text for a conversion that converted nothing: reasons grouped by rule;
    ``fmt`` names the recipe's format (``fp8``, ``nvfp4``, ``mxfp4``)."""
    what = type(model).__name__
    if not report.skipped:
        return f"convert_to_quantized found no nn.Linear in {what}: nothing runs in {fmt}"
    hints: dict[SkipRule, str] = {
        "module_filter": "module_filter returned False; with a filter given it alone decides",
        "head": "output head; pass include_head=True (or a module_filter) to convert it",
        "min_features": (
            f"min(in_features, out_features) < min_features={min_features}; pass a "
            f"smaller min_features (e.g. min_features={FEATURE_MULTIPLE}) or a module_filter"
        ),
        "feature_multiple": (
            f"in_features or out_features not a multiple of {FEATURE_MULTIPLE}, which fp8 "
            f"GEMM tiles need"
        ),
        "granularity": "widths the policy's granularity cannot run (mx: multiples of 32)",
        "dtype": "weight dtype is not bf16, fp16 or fp32; cast the model first",
        "subclass": (
            "a subclass of nn.Linear that adds to it (see each reason); pass converters= "
            "to convert it"
        ),
        "root": "the model itself; use QuantizedLinear.from_linear",
        "router": "a mixture-of-experts router: routing stays in high precision",
        "kept_high": "kept in high precision by the 4-bit recipe's hp_last / hp rule",
    }
    groups: dict[SkipRule, list[str]] = {}
    for s in report.skipped:
        groups.setdefault(s.rule, []).append(s.fqn)
    lines = [
        f"convert_to_quantized converted none of the {len(report.skipped)} nn.Linear layer(s) in "
        f"{what}, so nothing in it runs in {fmt}:"
    ]
    for rule, fqns in groups.items():
        shown = ", ".join(repr(f) for f in fqns[:3]) + (", ..." if len(fqns) > 3 else "")
        lines.append(f"  {len(fqns)} skipped ({shown}): {hints.get(rule, rule)}")
    lines.append("The returned ConversionReport gives every layer's reason.")
    return "\n".join(lines)


def output_heads(model: nn.Module, order: list[tuple[str, nn.Linear]]) -> dict[int, str]:
    """The output head(s) by what they are (see ``convert_to_quantized``): id -> reason."""
    embeddings = [(f, m) for f, m in model.named_modules() if isinstance(m, nn.Embedding)]
    heads: dict[int, str] = {}
    for fqn, lin in order:
        tied = [f for f, emb in embeddings if lin.weight is emb.weight]
        name = fqn.rpartition(".")[2]
        if tied:
            heads[id(lin)] = f"output head (weight tied to nn.Embedding {tied[0]!r})"
        elif name.lower() in HEAD_NAMES:
            heads[id(lin)] = f"output head (named {name!r})"
    if not heads and embeddings:
        vfqn, vocab = max(embeddings, key=lambda e: e[1].num_embeddings)
        for _, lin in order:
            if lin.out_features == vocab.num_embeddings:
                heads[id(lin)] = (
                    f"output head (out_features={lin.out_features}, the vocabulary of "
                    f"nn.Embedding {vfqn!r})"
                )
    if not heads and order:
        heads[id(order[-1][1])] = (
            "output head (the last nn.Linear in registration order: no linear is tied to or "
            "sized like an nn.Embedding's vocabulary, or named lm_head, output or head)"
        )
    return heads


def refuse_another_policy(
    model: nn.Module, ctx: ComputeCtx, caller: str = "convert_to_quantized"
) -> None:
    """Raise a ``ValueError`` when a layer of ``model`` is already a ``QuantizedLinear`` or
    ``Fp4Linear`` under another policy (``recipe``, ``compute``) than ``ctx``'s: a converted
    layer keeps the policy it was built with."""
    want = (ctx.recipe, ctx.compute)
    other = [
        (fqn, m)
        for fqn, m in model.named_modules(remove_duplicate=True)
        if isinstance(m, (QuantizedLinear, Fp4Linear)) and (m.ctx.recipe, m.ctx.compute) != want
    ]
    if other:
        fqn, lin = other[0]
        more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
        raise ValueError(
            f"{caller}: {fqn or '<root>'!r}{more} is already a {type(lin).__name__} "
            f"under recipe={lin.ctx.recipe}, compute={lin.ctx.compute}, but this call asks for "
            f"recipe={ctx.recipe}, compute={ctx.compute}; a converted layer keeps the policy it "
            f"was built with. Convert an unconverted copy of the model under the new ctx, or "
            f"pass the ctx it was converted with; the model was left unchanged"
        )


def unconvertible_behaviour(lin: nn.Linear) -> str | None:
    """What a subclass instance adds that a ``QuantizedLinear`` would drop, or ``None``."""
    if isinstance(lin, NonDynamicallyQuantizableLinear):
        return (
            "nn.MultiheadAttention reads this layer's weight directly and never calls it, "
            "so as a QuantizedLinear it would still not run in fp8"
        )
    if "forward" in vars(lin):
        return "its forward was replaced on the instance"
    for cls in type(lin).__mro__:
        if cls is nn.Linear:
            break
        own = [n for n in ("forward", "__call__", "_call_impl", "weight", "bias") if n in vars(cls)]
        if own:
            return f"{cls.__name__} defines its own {own[0]}, which a QuantizedLinear would drop"
    extra = [n for n, _ in lin.named_parameters(recurse=False) if n not in ("weight", "bias")]
    extra += [n for n, _ in lin.named_buffers(recurse=False)]
    extra += [n for n, _ in lin.named_children()]
    if extra:
        return f"it holds {extra[0]!r}, which nn.Linear does not and a QuantizedLinear would drop"
    return None
