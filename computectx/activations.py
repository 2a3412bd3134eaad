"""What the backward keeps of the activations: the ``activations`` policy. Pure data in the core.

``ComputeCtx.activations`` holds an ``Activations``: for each kind of tensor autograd keeps
between a forward and its backward, how it is kept (a ``SaveMode``):

- ``keep``: as the op saves it today, at the precision it computes in (the default).
- ``fp8``: as E4M3 codes with float32 scales: one scale per row (token) for the inputs of
  plain linears and grouped GEMMs (the fp8 linears keep the fp8 operand their backward
  reads), one per group of ``group`` consecutive elements of a row (1x``group`` along the
  last dimension; one per row where rows are shorter) for the inputs of non-linear ops
  (COAT, arXiv 2410.19313). No scale spans two rows, so a token codes alike in any batch
  split. Each scale is ``absmax / 448``.
- ``offload``: moved to host memory after the forward and back before its backward.
- ``recompute``: the op keeps only its input, at the precision it arrived in, and computes
  its internals again in the backward (for ops that can: not linears, residuals, dispatch).

The kinds, one field each: ``linear`` (inputs of linears and grouped GEMMs), ``precise``
(norms, softmax, RoPE: the ops ``ctx.precise`` runs), ``act_fn`` (inputs of activation
functions), ``attention`` (queries, keys, values, probabilities), ``residual`` (residual-stream
tensors kept at block boundaries) and ``moe`` (the MoE combine's input: the experts' outputs
in expert order; the permuted tokens are the experts' GEMM input, ``linear``).

Text form: ``/``-separated parts in any order and any case: a bare ``MODE`` sets every kind
(``fp8``; a bare ``recompute`` is refused unless linear, residual and moe are overridden:
name the kinds, ``precise:recompute/act_fn:recompute/attention:recompute``), ``KIND:MODE``
sets one (``precise:fp8``), ``group=N`` the fp8 group, ``checkpoint=RULE`` the blocks
checkpointed; a kind named twice is refused, a bare mode then ``KIND:MODE`` overrides it
(``fp8/attention:keep``). JSON form: ``{"linear": "keep", "precise": "fp8", ..., "group": 128,
"checkpoint": "none"}``, each key optional.

``checkpoint`` recomputes whole blocks by rule (activation checkpointing: a checkpointed
block keeps only its input, the residual stream at its boundary, and runs again in the
backward): ``none`` (the default), ``all``, ``every:N`` (blocks 0, N, 2N, ...), ``first:N``,
``last:N``, or ``blocks:I+J+...`` (those indices; ``+`` since a comma ends the ctx's value).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, get_args

from pydantic import BeforeValidator, model_validator
from typing_extensions import Self

from computectx._checks import CheckedModel, checked_int, read_value, text_int

__all__ = [
    "ACTIVATION_KINDS",
    "DEFAULT_GROUP",
    "GROUPS",
    "KIND_MODES",
    "SAVE_MODES",
    "ActivationKind",
    "Activations",
    "ActivationsField",
    "SaveMode",
    "checked_checkpoint",
    "parse_activations",
]

SaveMode = Literal["keep", "fp8", "offload", "recompute"]
"""How the backward keeps one kind of activation (see the module docstring)."""
SAVE_MODES: Final[tuple[SaveMode, ...]] = get_args(SaveMode)
"""The mode names, as the text form spells them."""

ActivationKind = Literal["linear", "precise", "act_fn", "attention", "residual", "moe"]
"""A kind of tensor autograd keeps for the backward: one field of ``Activations`` each."""
ACTIVATION_KINDS: Final[tuple[ActivationKind, ...]] = get_args(ActivationKind)
"""The kinds, in field order."""

_NOT_RECOMPUTED: Final[tuple[SaveMode, ...]] = ("keep", "fp8", "offload")
KIND_MODES: Final[dict[ActivationKind, tuple[SaveMode, ...]]] = {
    # A linear's input, a residual-stream tensor and the dispatched tokens are made by the
    # op before them: only checkpointing a region can compute them again, not the op.
    "linear": _NOT_RECOMPUTED,
    "precise": SAVE_MODES,
    "act_fn": SAVE_MODES,
    "attention": SAVE_MODES,
    "residual": _NOT_RECOMPUTED,
    "moe": _NOT_RECOMPUTED,
}
"""The modes each kind accepts."""

GROUPS: Final[tuple[int, ...]] = (16, 32, 64, 128)
"""The fp8 group sizes accepted for the non-linear kinds (COAT's 1x128 or finer)."""
DEFAULT_GROUP: Final = 128
"""Elements per fp8 group when none is given (COAT's per-group 1x128)."""

_FORM = "'[MODE][/KIND:MODE]...[/group=N][/checkpoint=RULE]'"
_MODES = ", ".join(SAVE_MODES)
_KINDS = ", ".join(ACTIVATION_KINDS)
_GROUPS = ", ".join(map(str, GROUPS))
_TAKES = f"an Activations dict takes {_KINDS}, 'group' and 'checkpoint', each optional"
_ACCEPTED = (
    f"an Activations, its text form {_FORM} with MODE one of {_MODES} and KIND one of {_KINDS}, "
    f"or its dict"
)


def _mode(value: object) -> object:
    # Names are case-insensitive everywhere in the policy; which kind accepts which mode is
    # checked after, where the kind is known.
    key = value.strip().lower() if isinstance(value, str) else value
    if key not in SAVE_MODES:
        raise ValueError(f"unknown activation save mode {value!r}; accepted: {_MODES}")
    return key


def _group(value: object) -> object:
    return checked_int(
        value,
        "group must be an integer, got {type} {value!r}; accepted: " + _GROUPS,
        GROUPS,
        "group={n} is not one of " + _GROUPS + " (elements per fp8 group)",
    )


ModeField = Annotated[SaveMode, BeforeValidator(_mode)]

_RULES = "none, all, every:N, first:N, last:N or blocks:I+J+... (N >= 1, I >= 0)"


def checked_checkpoint(value: object) -> str:
    """A checkpoint rule in its shortest spelling (``"every:1"`` is ``"all"``, ``"blocks:2+0"``
    is ``"blocks:0+2"``), any case and spacing read; ``ValueError`` naming the forms."""
    if not isinstance(value, str):
        raise ValueError(f"checkpoint must be a str ({_RULES}), got {type(value).__name__}")
    text = "".join(value.split()).lower()
    if text in ("none", "all"):
        return text
    rule, colon, arg = text.partition(":")
    numbers = [int(n) if n.isdigit() and n.isascii() else -1 for n in arg.split("+")]
    counted = len(numbers) == 1 and numbers[0] >= 1 and rule in ("every", "first", "last")
    if colon and counted:
        return "all" if rule == "every" and numbers[0] == 1 else f"{rule}:{numbers[0]}"
    if colon and rule == "blocks" and min(numbers) >= 0:
        return "blocks:" + "+".join(map(str, sorted(set(numbers))))
    raise ValueError(f"bad checkpoint rule {value!r}; accepted: {_RULES}")


class Activations(CheckedModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """How the backward keeps each kind of activation (``ComputeCtx.activations``).

    ``Activations()`` keeps everything as the ops save it (today's behaviour);
    ``Activations.parse("fp8")`` keeps every kind as fp8 (a scale per row for linear inputs,
    1x128 groups for the rest); ``Activations(precise="fp8")`` only the
    norms', softmax's and RoPE's inputs. A kind refuses a mode it cannot take (``recompute``
    for ``linear``, ``residual``, ``moe``), naming the modes it accepts.

    Text form ``[MODE][/KIND:MODE]...[/group=N]`` (the shortest: ``keep``, ``fp8``,
    ``fp8/attention:keep``, ``precise:fp8/group=64``), which ``parse`` reads back in any case
    with the parts in any order; JSON form ``{"linear": "keep", ..., "group": 128}``.
    """

    linear: ModeField = "keep"
    """Inputs of linears and grouped GEMMs: ``keep``, ``fp8`` (E4M3, a scale per row) or
    ``offload``."""
    precise: ModeField = "keep"
    """What norms, softmax and RoPE keep (the ops ``ctx.precise`` runs): any mode."""
    act_fn: ModeField = "keep"
    """Inputs of activation functions (SwiGLU's gate and up): any mode."""
    attention: ModeField = "keep"
    """Queries, keys, values and probabilities of attention: any mode."""
    residual: ModeField = "keep"
    """Residual-stream tensors kept at block boundaries: ``keep``, ``fp8`` or ``offload``."""
    moe: ModeField = "keep"
    """The MoE combine's input (the experts' outputs in expert order; routing weights and
    order are kept as they are): ``keep``, ``fp8`` or ``offload``."""
    group: Annotated[int, BeforeValidator(_group)] = DEFAULT_GROUP
    """Elements per fp8 group of the non-linear kinds (consecutive, row-major): 16, 32, 64 or
    128 (default)."""
    checkpoint: Annotated[str, BeforeValidator(checked_checkpoint)] = "none"
    """Which blocks of a model are checkpointed (recomputed whole in the backward, keeping
    only their input): ``none``, ``all``, ``every:N``, ``first:N``, ``last:N`` or
    ``blocks:I+J+...`` (``checkpointed``)."""

    def __init__(self, /, **data: Any) -> None:
        """Validated fields; a bad one is a ``ValueError`` naming the field, the value and
        what is accepted (``CheckedModel``). Typed as taking any values: a mode reads in any
        case, so a literal type would refuse what the value accepts."""
        super().__init__(**data)

    @model_validator(mode="after")
    def _modes_fit_kinds(self) -> Self:
        for kind in ACTIVATION_KINDS:
            mode = self.mode(kind)
            if mode not in KIND_MODES[kind]:
                raise ValueError(
                    f"{kind}={mode}: {kind} cannot be kept as {mode}; accepted for {kind}: "
                    f"{', '.join(KIND_MODES[kind])} (recompute a region by checkpointing it)"
                )
        return self

    def mode(self, kind: ActivationKind) -> SaveMode:
        """How the backward keeps ``kind`` (``ValueError`` naming the kinds for another name)."""
        if kind not in ACTIVATION_KINDS:
            raise ValueError(f"unknown activation kind {kind!r}; accepted: {_KINDS}")
        mode: SaveMode = getattr(self, kind)
        return mode

    @property
    def default(self) -> bool:
        """Whether every kind is kept as the ops save it and no block is checkpointed (today's
        behaviour)."""
        return self.checkpoint == "none" and all(self.mode(k) == "keep" for k in ACTIVATION_KINDS)

    def checkpointed(self, index: int, blocks: int) -> bool:
        """Whether block ``index`` (from 0) of a model of ``blocks`` blocks is checkpointed:
        ``every:N`` takes blocks 0, N, 2N, ...; ``first:N`` the first N, ``last:N`` the last N;
        ``blocks:I+J`` those (an index past the model's blocks takes none)."""
        rule, _, arg = self.checkpoint.partition(":")
        if rule in ("none", "all"):
            return rule == "all"
        numbers = [int(n) for n in arg.split("+")]
        if rule == "every":
            return index % numbers[0] == 0
        if rule == "first":
            return index < numbers[0]
        if rule == "last":
            return index >= blocks - numbers[0]
        return index in numbers

    def __str__(self) -> str:
        """The shortest text form (``keep``, ``fp8/attention:keep``, ``precise:fp8``), which
        ``parse`` reads back: the mode most kinds share bare when all kinds accept it and it
        is not ``keep``, then each kind that differs, then ``group`` when not 128."""
        modes = [self.mode(k) for k in ACTIVATION_KINDS]
        common = max(_NOT_RECOMPUTED, key=modes.count)
        bare = common if common != "keep" and modes.count(common) > 1 else "keep"
        parts: list[str] = [] if bare == "keep" else [bare]
        parts += [f"{k}:{m}" for k, m in zip(ACTIVATION_KINDS, modes, strict=True) if m != bare]
        if self.group != DEFAULT_GROUP:
            parts.append(f"group={self.group}")
        if self.checkpoint != "none":
            parts.append(f"checkpoint={self.checkpoint}")
        return "/".join(parts) or "keep"

    @classmethod
    def parse(cls, text: str) -> Activations:
        """Read the text form (``"fp8"``, ``"FP8/Attention:keep/group=64"``): names in any
        case, parts in any order, a bare mode setting every kind and ``KIND:MODE`` one.
        ``ValueError`` quoting ``text`` and naming what is accepted otherwise."""
        if not isinstance(text, str):
            raise TypeError(f"Activations.parse takes a str, got {type(text).__name__}")
        shown = text.strip()
        bare: str | None = None
        data: dict[str, object] = {}
        for part in (p.strip() for p in shown.split("/")):
            kind, colon, mode = (s.strip().lower() for s in part.partition(":"))
            key, equals, value = (s.strip() for s in part.partition("="))
            if colon and kind in ACTIVATION_KINDS:
                if kind in data:
                    raise ValueError(f"activation kind {kind} given twice in {shown!r}")
                data[kind] = mode
            elif equals and key.lower() == "group":
                if "group" in data:
                    raise ValueError(f"group given twice in activations {shown!r}")
                data["group"] = text_int("group", value, f"activations {shown!r}")
            elif equals and key.lower() == "checkpoint":
                if "checkpoint" in data:
                    raise ValueError(f"checkpoint given twice in activations {shown!r}")
                data["checkpoint"] = value
            elif not colon and not equals and part.lower() in SAVE_MODES:
                if bare is not None:
                    raise ValueError(f"two bare modes in activations {shown!r}; give one")
                bare = part.lower()
            else:
                raise ValueError(
                    f"bad part {part!r} in activations {shown!r}; accepted: one MODE ({_MODES}), "
                    f"KIND:MODE with KIND one of {_KINDS}, group=N ({_GROUPS}), checkpoint=RULE "
                    f"({_RULES}) (form {_FORM})"
                )
        if bare is not None:
            for kind in ACTIVATION_KINDS:
                data.setdefault(kind, bare)
            _check_bare(bare, data, shown)
        return cls._from_text(data, "activations", shown)


def _check_bare(bare: str, data: dict[str, object], shown: str) -> None:
    # A bare mode sets every kind: one that a kind refuses (recompute) must be overridden for
    # it, and the error says which kinds take it.
    refusing = [k for k in ACTIVATION_KINDS if data[k] == bare and bare not in KIND_MODES[k]]
    if refusing:
        first = refusing[0]
        takers = "/".join(f"{k}:{bare}" for k in ACTIVATION_KINDS if bare in KIND_MODES[k])
        raise ValueError(
            f"bad activations {shown!r}: a bare mode sets every kind, and {first} cannot be "
            f"kept as {bare}; accepted for {first}: {', '.join(KIND_MODES[first])}; name the "
            f"kinds that take it instead ({takers}), or override {', '.join(refusing)}"
        )


def parse_activations(value: object) -> Activations:
    """An ``Activations`` from an ``Activations``, its text form (``"fp8"``,
    ``"precise:fp8/group=64"``) or its JSON form (a dict of the kinds and ``group``, each
    optional). Anything else raises ``ValueError`` quoting it and naming the accepted forms."""
    return read_value(value, Activations, Activations.parse, "activations", _TAKES, _ACCEPTED)


def _lenient(value: object) -> object:
    # As optim_state's field: text through Activations.parse, a dict left to pydantic (its
    # errors carry the field's location), anything else parse_activations' error.
    return value if isinstance(value, dict) else parse_activations(value)


ActivationsField = Annotated[Activations, BeforeValidator(_lenient)]
"""An ``Activations`` field (``ComputeCtx.activations``) that also reads the text form."""
