"""``ComputeCtx``: the one immutable value that decides how a model's numbers flow."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, TypedDict, cast, overload

import torch
from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    model_validator,
)
from torch import Tensor
from typing_extensions import Self, Unpack

from computectx._checks import validation_message
from computectx.activations import (
    ACTIVATION_KINDS,
    ActivationKind,
    Activations,
    ActivationsField,
    parse_activations,
)
from computectx.dtypes import (
    DType,
    PromotionError,
    cast_if,
    is_compute_dtype,
    outside_lattice_message,
    promote,
)
from computectx.flags import DTYPE_FLAGS, flag_policy
from computectx.fp4_recipe import AnyRecipe, Fp4Recipe
from computectx.kv_policy import KvField, KvFp8
from computectx.optim_state import OptimState, OptimStateField, parse_optim_state
from computectx.recipes import Recipe
from computectx.residency import Residency, TorchDevice, parse_device
from computectx.saved import SAVING, saved_call

__all__ = ["DTYPE_FLAGS", "BuiltUnder", "ComputeCtx", "CtxChanges"]


def _is_none_text(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == "none"


def _lenient_recipe(value: object) -> object:
    # "none" is no recipe; any other text is AnyRecipe's to read (fp8 or 4-bit).
    return None if _is_none_text(value) else value


def _lenient_offload(value: object) -> object:
    # "none" reads as None here as in the text form, whatever the case.
    return None if _is_none_text(value) else value


def _same_as_compute(validated: dict[str, Any]) -> DType:
    # ComputeCtx._defaults_from_compute fills kv and accum before validation; the factories
    # mark the fields optional in the schema and serve model_construct.
    compute: DType = validated.get("compute", DType.F32)
    return compute


def _compute_join_f32(validated: dict[str, Any]) -> DType:
    # F32 for the half dtypes and F32 itself, F64 for an F64 model: never below compute.
    return promote(_same_as_compute(validated), DType.F32)


# Names, aliases and torch dtypes become members; parse's error quotes anything else.
DTypeField = Annotated[DType, BeforeValidator(DType.parse)]
ResidencyField = Annotated[Residency, BeforeValidator(Residency.parse)]
RecipeField = Annotated[AnyRecipe | None, BeforeValidator(_lenient_recipe)]
OffloadField = Annotated[TorchDevice | None, BeforeValidator(_lenient_offload)]


class CtxChanges(TypedDict, total=False):
    """The keyword arguments ``ComputeCtx.replace`` accepts (checked by mypy)."""

    compute: DType
    kv: DType | KvFp8
    accum: DType
    residency: Residency
    device: torch.device
    recipe: Recipe | Fp4Recipe | None
    fp8: Recipe | Fp4Recipe | None  # the 0.1.0 name of recipe
    grad: DType
    master: DType
    offload: torch.device | None
    optim_state: OptimState
    activations: Activations


# precise's f with 0, 1 or 2 operands after t (typed, so that mypy checks a lambda's body).
_F0 = Callable[[Tensor], Tensor]
_F1 = Callable[[Tensor, Tensor], Tensor]
_F2 = Callable[[Tensor, Tensor, Tensor], Tensor]
_Kind = ActivationKind


class ComputeCtx(BaseModel, frozen=True, extra="forbid", use_attribute_docstrings=True):
    """The compute policy of one model: a frozen, hashable value threaded to every consumer.

    Build one with a preset (``new``, ``parity``, ``serving``, ``from_flag``), from its text
    form (``ComputeCtx.parse``) or from JSON (``model_validate_json``). Change one with
    ``with_kv``, ``with_accum``, ``with_optim_state`` or ``replace``: each returns a new,
    validated value.
    """

    compute: DTypeField
    """Dtype activations flow in (projections, attention, residual stream)."""
    kv: KvField = Field(default_factory=_same_as_compute)
    """How the KV cache stores keys and values: a dtype (defaults to ``compute``), or a
    ``KvFp8`` (fp8 codes with float32, bf16 or e8m0 steps, ``e4m3/per_token_head`` in the
    text form), which the cache quantizes into and attention reads back in float32."""
    accum: DTypeField = Field(default_factory=_compute_join_f32)
    """Dtype precision-sensitive ops run in through ``precise``; at or above ``compute``
    (defaults to ``compute ⊔ f32``)."""
    residency: ResidencyField = Residency.AUTO
    """Where weights live: ``device``, ``mmap``, or ``auto`` (device when the model fits)."""
    device: TorchDevice
    """Device the model computes on."""
    recipe: RecipeField = None
    """The low-precision recipe of the linears and grouped GEMMs: an fp8 ``Recipe`` (format,
    scaling, granularity) or a 4-bit ``Fp4Recipe`` (``nvfp4``, ``mxfp4``), told apart by the
    format word; ``None`` means every GEMM runs at ``compute``. The text and JSON forms of
    0.1.0 named it ``fp8``, which still reads."""
    grad: DTypeField = DType.F32
    """Dtype gradients are accumulated in across micro-batches."""
    master: DTypeField = DType.F32
    """Dtype of the optimizer's master weights."""
    offload: OffloadField = Field(default=None)
    """Device for gradient buffers, master weights and optimizer state; ``None`` = ``device``."""
    optim_state: OptimStateField = OptimState()
    """How optimizer state tensors are stored: ``f32`` (default, torch's own), ``bf16``, or
    block-wise ``int8``, ``fp8``, ``int4`` codes with scales (an ``OptimState``; text form
    ``int8``, ``int4/block=64/min=0``). Scalars and tensors under ``min_size`` elements stay
    float32."""
    activations: ActivationsField = Activations()
    """How the backward keeps each kind of activation (an ``Activations``): ``keep`` (default),
    ``fp8`` codes with scales, ``offload`` or ``recompute``; text form ``precise:fp8/group=64``."""

    _TEXT_ALWAYS: ClassVar[tuple[str, ...]] = ("compute", "kv", "accum", "residency", "device")
    _NULLABLE: ClassVar[frozenset[str]] = frozenset({"recipe", "offload"})
    # The 0.1.0 names of fields, read as the field they became.
    _OLD_KEYS: ClassVar[dict[str, str]] = {"fp8": "recipe"}

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """``obj`` (a dict of the fields) as a ``ComputeCtx``; a bad ``kv`` or
        ``optim_state`` is a ``ValueError`` naming it (``_nested_errors``)."""
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise _nested_errors(e) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        """The JSON form as a ``ComputeCtx``; errors as ``model_validate``."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as e:
            raise _nested_errors(e) from None

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_compute(cls, data: Any) -> Any:
        # kv and accum default from compute, filled in here rather than by their default
        # factories: pydantic skips a factory that reads validated data as soon as any
        # earlier field failed, and reports one more error for it. Placeholders stand in
        # when compute itself is missing or bad, so its error is the only one.
        if isinstance(data, dict):
            data = cls._new_keys(data)
        if isinstance(data, dict) and not ("kv" in data and "accum" in data):
            try:
                compute = DType.parse(data["compute"])
            except (KeyError, ValueError):
                defaults = {"kv": DType.F32, "accum": DType.F64}
            else:
                defaults = {"kv": compute, "accum": promote(compute, DType.F32)}
            data = {**defaults, **data}
        return data

    @classmethod
    def _new_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        # An old key (fp8=) reads as the field it became; both at once is a repeated key.
        for old, new in cls._OLD_KEYS.items():
            if old in data:
                if new in data:
                    raise ValueError(
                        f"ComputeCtx got both {old!r} and {new!r}: {old} is the old name of {new}"
                    )
                data = {(new if k == old else k): v for k, v in data.items()}
        return data

    def __setstate__(self, state: dict[Any, Any]) -> None:
        # A ctx pickled by 0.1.0 holds its recipe under the field's old name, and none of
        # the fields added since (activations), which take their defaults.
        values = state.get("__dict__")
        if isinstance(values, dict) and not {"recipe", "activations"} <= values.keys():
            state = {**state, "__dict__": self._new_keys({"activations": Activations(), **values})}
            fields_set = state.get("__pydantic_fields_set__")
            if isinstance(fields_set, set):
                state["__pydantic_fields_set__"] = set(self._new_keys(dict.fromkeys(fields_set)))
        super().__setstate__(state)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's copy; an ``update`` may name ``recipe`` by its old name, ``fp8``.
        ``replace`` is the validated way to change a ctx."""
        return super().model_copy(
            update=None if update is None else self._new_keys(dict(update)), deep=deep
        )

    @property
    def fp8(self) -> Recipe | Fp4Recipe | None:
        """The old name of ``recipe`` (0.1.0); it goes in 0.3.0."""
        return self.recipe

    @model_validator(mode="after")
    def _accum_not_below_compute(self) -> Self:
        if not self.compute <= self.accum:
            ok = ", ".join(str(d) for d in DType if self.compute <= d)
            raise ValueError(
                f"accum={self.accum} is not at or above compute={self.compute} in the dtype "
                f"lattice, so precise() would lose precision; accepted accum for "
                f"compute={self.compute}: {ok}"
            )
        return self

    # ----- presets (mirroring the Rust design) ------------------------------------------

    @classmethod
    def new(cls, compute: DType, device: torch.device | str) -> ComputeCtx:
        """Activations and KV cache at ``compute``; accumulate in ``compute ⊔ F32``."""
        return cls(compute=compute, device=parse_device(device))

    @classmethod
    def parity(cls, device: torch.device | str) -> ComputeCtx:
        """Numeric-parity policy: everything F32 (the Rust ``ds4_parity``)."""
        return cls(compute=DType.F32, kv=DType.F32, accum=DType.F32, device=parse_device(device))

    @classmethod
    def ds4_parity(cls, device: torch.device | str) -> ComputeCtx:
        """The Rust design's name for ``parity``: the same all-F32 policy."""
        return cls.parity(device)

    @classmethod
    def serving(cls, device: torch.device | str) -> ComputeCtx:
        """Serving policy: BF16 activations, F32 KV cache (decode stability), F32 accum.

        Serving with an fp8 KV cache is ``serving(device).with_kv(KvFp8())``: the same policy
        with e4m3 codes and dynamic ``per_token_head`` steps (docs/serving.md).
        """
        return cls(compute=DType.BF16, kv=DType.F32, accum=DType.F32, device=parse_device(device))

    @classmethod
    def from_flag(cls, name: str, device: torch.device | str) -> ComputeCtx:
        """The ``--dtype`` convention (``DTYPE_FLAGS``), in any case.

        ``fp32`` is ``parity``; ``fp16``/``bf16`` are ``new`` at that dtype; the fp8 flags
        are BF16 activations with fp8 linears in the named scheme: ``fp8_e4m3`` and
        ``fp8_e5m2`` use that format in both directions, ``fp8_hybrid`` uses E4M3 forward
        and E5M2 for gradients. They scale with ``DelayedScaling()``; the same flags with a
        ``_dynamic`` suffix (``fp8_hybrid_dynamic``) scale with ``DynamicScaling()``.
        ``fp8_rowwise`` and ``fp8_rowwise_gw_hp`` scale every row of every operand
        (``Recipe(granularity="row")``, with ``gw_hp=True`` for the second);
        ``fp8_block`` and ``fp8_mx`` scale 1x128/128x128 and 1x32 blocks
        (``Recipe(granularity="block")``, ``Recipe(granularity="mx")``). ``nvfp4`` and ``mxfp4``
        are BF16 activations with 4-bit linears (``Fp4Recipe()``, TransformerEngine's NVFP4
        recipe, and ``Fp4Recipe(format="mxfp4")``).
        """
        compute, policy = flag_policy(name)
        return cls(compute=compute, device=parse_device(device), recipe=policy)

    # ----- validated copies ---------------------------------------------------------------

    def replace(self, **changes: Unpack[CtxChanges]) -> ComputeCtx:
        """A new context with ``changes`` applied and validated; ``self`` never changes."""
        fields = type(self).model_fields
        changes = cast(CtxChanges, self._new_keys(dict(changes)))
        unknown = [k for k in changes if k not in fields]
        if unknown:
            raise ValueError(
                f"unknown ComputeCtx field(s) {', '.join(map(repr, unknown))}; accepted: "
                f"{', '.join(fields)}"
            )
        data: dict[str, object] = {name: getattr(self, name) for name in fields}
        data.update(changes)
        return type(self).model_validate(data)

    def with_kv(self, kv: DType | KvFp8) -> ComputeCtx:
        """The same policy with the KV cache stored at ``kv``: a dtype, or a ``KvFp8`` for an
        fp8 cache (``with_kv(KvFp8())``: e4m3 codes, dynamic ``per_token_head`` steps)."""
        return self.replace(kv=kv)

    def with_accum(self, accum: DType) -> ComputeCtx:
        """The same policy accumulating in ``accum`` (must be at or above ``compute``)."""
        return self.replace(accum=accum)

    def with_optim_state(self, optim_state: OptimState | str) -> ComputeCtx:
        """The same policy storing optimizer state as ``optim_state``: an ``OptimState`` or
        its text form (``with_optim_state("int8")``: block-wise 8-bit moments)."""
        return self.replace(optim_state=parse_optim_state(optim_state))

    def with_activations(self, activations: Activations | str) -> ComputeCtx:
        """The same policy keeping activations for the backward as ``activations`` says: an
        ``Activations`` or its text form (``with_activations("fp8")``: fp8 everywhere)."""
        return self.replace(activations=parse_activations(activations))

    # ----- the casts ----------------------------------------------------------------------

    @overload
    def precise(self, t: Tensor, f: _F0, *, kind: ActivationKind = ...) -> Tensor: ...
    @overload
    def precise(self, t: Tensor, f: _F1, a: Tensor, /, *, kind: ActivationKind = ...) -> Tensor: ...
    @overload
    def precise(
        self, t: Tensor, f: _F2, a: Tensor, b: Tensor, /, *, kind: _Kind = ...
    ) -> Tensor: ...
    def precise(
        self,
        t: torch.Tensor,
        f: Callable[..., torch.Tensor],
        *operands: torch.Tensor,
        kind: ActivationKind = "precise",
    ) -> torch.Tensor:
        """Run ``f`` on ``t`` lifted to ``t.dtype ⊔ accum``; return the result in ``t.dtype``.

        The upcast ⊣ downcast pair around norms, softmax and RoPE. When ``t`` is already at
        (or above) ``accum``, ``f`` receives ``t`` itself and nothing is cast, so the all-F32
        policy pays nothing. ``t`` must hold a lattice dtype (fp8, integer and bool tensors
        raise ``PromotionError``), and so must ``f``'s result when it has to be cast back.
        ``operands`` (a norm's weight) reach ``f`` after ``t``. The backward keeps what
        ``activations`` says for ``kind`` (``computectx.saved``: ``f`` may then run again).
        """
        if (work := _WORK_DTYPE.get((t.dtype, self.accum))) is None:
            raise PromotionError(outside_lattice_message(t.dtype))
        if kind not in ACTIVATION_KINDS:  # checked here: the default path enters no other module
            raise ValueError(f"unknown activation kind {kind!r}; accepted: {ACTIVATION_KINDS}")
        if (mode := getattr(self.activations, kind)) != "keep":
            body, group = functools.partial(_lifted, f, work), self.activations.group
            return saved_call(body, t, *operands, mode=mode, group=group, kind=kind)
        if torch.compiler.is_compiling():
            return _lifted(f, work, t, *operands)
        # The default enters no other module: f runs here, what it saves tagged with its kind.
        token = SAVING.set(kind)
        try:
            return _lifted(f, work, t, *operands)
        finally:
            SAVING.reset(token)

    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` at the compute dtype (the residual-stream entry boundary); ``t`` itself if
        already there."""
        return cast_if(t, self.compute)

    def to_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` at the KV-cache dtype (the cache-append boundary); ``t`` itself if already
        there.

        Only for a ``kv`` in the lattice: with an fp8 ``kv`` (a ``KvFp8``) the cache quantizes,
        producing codes and their steps together, which no cast can do, so ``to_kv`` raises
        ``PromotionError`` saying so (``computectx.nn.KVCache`` quantizes).
        """
        if isinstance(self.kv, KvFp8):
            raise PromotionError(f"to_kv: {outside_lattice_message(self.kv)}")
        return cast_if(t, self.kv)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A context for the forward pass: ``torch.autocast`` on the device's type at the
        compute dtype for F16/BF16; nothing for F32/F64 (autocast only ever lowers)."""
        if self.compute in (DType.F32, DType.F64):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute.torch)

    @property
    def offload_device(self) -> torch.device:
        """Where gradient buffers, master weights and optimizer state live."""
        return self.device if self.offload is None else self.offload

    # ----- text form ----------------------------------------------------------------------

    def __str__(self) -> str:
        """The policy string, e.g. ``compute=bf16,kv=f32,accum=f32,residency=auto,device=cpu``.

        ``recipe``, ``grad``, ``master``, ``offload``, ``optim_state`` and ``activations``
        appear only when they differ from their defaults (``...,optim_state=int4/block=64``);
        ``ComputeCtx.parse`` reads the string back to an equal value.
        """
        fields = type(self).model_fields
        parts = []
        for name, info in fields.items():
            value = getattr(self, name)
            if name in self._TEXT_ALWAYS or value != info.default:
                parts.append(f"{name}={'none' if value is None else value}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> ComputeCtx:
        """Read a policy string (``key=value`` pairs separated by commas).

        ``compute`` and ``device`` are required; ``kv`` defaults to ``compute`` and ``accum``
        to ``compute ⊔ f32``; other keys take their defaults. Unknown or repeated keys raise
        ``ValueError`` naming them.
        """
        if not isinstance(text, str):
            raise TypeError(f"ComputeCtx.parse takes a str, got {type(text).__name__}")
        fields = cls.model_fields
        data: dict[str, object] = {}
        written: dict[str, str] = {}  # field -> the key as the text spelled it
        for item in text.split(","):
            key, sep, value = item.partition("=")
            spelled, value = key.strip().lower(), value.strip()
            key = cls._OLD_KEYS.get(spelled, spelled)
            if not sep or not key:
                raise ValueError(
                    f"bad policy item {item.strip()!r} in {text!r}: expected key=value with "
                    f"keys {', '.join(fields)}"
                )
            if key not in fields:
                raise ValueError(
                    f"unknown policy key {key!r} in {text!r}; accepted: {', '.join(fields)}"
                )
            if key in data:
                if written[key] == spelled:
                    raise ValueError(f"policy key {spelled!r} given twice in {text!r}")
                raise ValueError(
                    f"policy keys {written[key]!r} and {spelled!r} both given in {text!r}: fp8 is "
                    f"the old name of recipe"
                )
            written[key] = spelled
            data[key] = None if key in cls._NULLABLE and _is_none_text(value) else value
        return cls.model_validate(data)


def _nested_errors(e: ValidationError) -> ValueError:
    # The nested policy values' errors (kv, optim_state, activations) are the library's
    # ValueError without pydantic's URL, as they raise on their own; others stay pydantic's.
    errors, nested = e.errors(), {("kv",), ("optim_state",), ("activations",)}
    if errors and all(err["loc"][:1] in nested for err in errors):
        return ValueError(validation_message(e, "ComputeCtx", ComputeCtx.model_fields))
    return e


def _lifted(
    f: Callable[..., torch.Tensor], work: torch.dtype, t: torch.Tensor, *operands: torch.Tensor
) -> torch.Tensor:
    # precise's body: f at the work dtype, its result back at t's dtype.
    if work is (src := t.dtype):
        return f(t, *operands)
    if not is_compute_dtype((out := f(t.to(work), *operands)).dtype):
        raise PromotionError(
            f"precise: f returned a {out.dtype} tensor, which cannot be cast back to {src} "
            f"without loss of meaning; return a floating tensor from f, or call f outside precise"
        )
    return out.to(src)


# (input torch dtype, accum) -> input ⊔ accum: one lookup instead of three on the hot path.
_WORK_DTYPE: dict[tuple[torch.dtype, DType], torch.dtype] = {
    (src.torch, accum): promote(src, accum).torch for src in DType for accum in DType
}


class BuiltUnder:
    """A module whose ``ctx`` is the policy it was built under (a base listed before
    ``nn.Module``: ``computectx.nn``'s blocks). Its constructor decided from it the parameters'
    dtypes, which linears became fp8 or 4-bit layers and its children, each holding its own,
    so a later ``model.ctx = other`` would reach its own forward only (half a policy): ``ctx``
    is set once; assigning it again is an ``AttributeError`` that changes nothing."""

    _ctx: ComputeCtx

    @property
    def ctx(self) -> ComputeCtx:
        """The policy this module was built under (read-only: class docstring)."""
        return self._ctx

    @ctx.setter
    def ctx(self, value: ComputeCtx) -> None:
        if "_ctx" in self.__dict__:
            kind = type(self).__name__
            raise AttributeError(
                f"{kind}.ctx is the policy it was built under ({self._ctx}); assigning "
                f"{value!s} would apply half a policy (its children and parameters were built "
                f"under the first). Build a new {kind} under the new ctx instead"
            )
        if not isinstance(value, ComputeCtx):
            raise TypeError(f"ctx must be a ComputeCtx, got {type(value).__name__}")
        self._ctx = value
