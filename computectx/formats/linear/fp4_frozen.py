"""``FrozenFp4Linear``: a 4-bit weight held pre-quantized for serving (weight-only or W4A4).

Built from an ``Fp4Linear`` (``from_fp4_linear``: the codes its forward multiplies with,
``Fp4Linear.quantized_weight()``) or from pre-quantized weights given from outside (the
constructor: an ``Nvfp4Operand`` or ``Mxfp4Operand``, checked by ``fp4_serving.check_weight``).
The buffers, all persistent:

=================  ==========================================================================
``weight_fp4``     ``float4_e2m1fn_x2`` ``[N, K/2]``: E2M1 codes, two a byte
``weight_scale``   NVFP4: ``float8_e4m3fn`` ``[N, K/16]`` (1x16) or ``[N/16, K/16]`` (16x16
                   tiles); MXFP4: ``float8_e8m0fnu`` ``[N, K/32]``
``weight_amax``    NVFP4 only: float32 ``(1,)``, the per-tensor amax (``S_enc = 2688 / amax``)
``input_amax``     ``activation_amax="static"`` only: float32 ``(1,)``, the calibrated amax of
                   the input (``calibrate_fp4_activations``; NaN until calibrated or loaded)
=================  ==========================================================================

with ``bias`` a parameter as ``nn.Linear``'s, and ``_extra_state`` int64 ``[version, weight
code]`` (format, NVFP4 tile, MXFP4 rounding): 0.5625 bytes a weight element plus 4 for NVFP4
1x16, 0.5039 plus 4 for 16x16 tiles, 0.53125 for MXFP4. The arithmetic of the two modes, and
the activation amax rule of NVFP4 W4A4 (``"per_row"``: batch-invariant), are
``fp4_serving``'s.

**Loading** refuses, naming both sides and before any module of a model loads (the layer
guards whole loads: ``formats.scaling.load``): a high-precision ``weight`` (a training
checkpoint: load it, then freeze), an fp8 layer's entries, a state saved under another weight
format, tile or MXFP4 rounding, entries of another dtype or shape, scales that are NaN or
negative, an amax that is not finite, an ``input_amax`` that is not a float32 ``(1,)`` finite
and ``> 0`` or NaN (NaN: saved before calibration, loads as not calibrated), and a partial
weight. New weights loaded without an ``input_amax`` leave a static layer uncalibrated (as
``import_pretrained``). A static layer runs only once its ``input_amax`` is calibrated, loaded
or set (``set_input_amax``); before, its W4A4 forward is a
``RuntimeError``. The mode and the activation rule are the layer's own, not the
checkpoint's: the same weights serve either.

No weight gradient. Input gradients flow: ``"weight_only"`` through torch's GEMM,
``"w4a4"`` straight through the activation's rounding (``dX = dY · W``, the dequantized
weight at the input's dtype). Works under ``torch.inference_mode``. A module-wide ``.to()``
moves the frozen tensors and never changes their dtypes (``.half()`` casts the bias only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, Protocol

import torch
from torch import nn
from torch.autograd.function import FunctionCtx
from typing_extensions import Self

from computectx.formats.backend import check_linear_input
from computectx.formats.linear.fp4_serving import (
    ActivationAmax,
    ServeMode,
    check_bias,
    check_input_amax,
    check_serving,
    check_weight,
    dequantized,
    w4a4_mm,
    weight_only_mm,
)
from computectx.formats.linear.function import autocast_dtype
from computectx.formats.numerics.fp4 import Mxfp4Operand, MxRounding, Nvfp4Operand, tensor_amax
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant
from computectx.formats.policy import describe, refuse_sharded
from computectx.formats.scaling.layer import held_out
from computectx.formats.scaling.load import copied_on_save, guard_whole_loads
from computectx.fp4_recipe import Fp4Recipe

__all__ = [
    "FROZEN_FP4_BUFFERS",
    "FROZEN_FP4_VERSION",
    "FROZEN_WEIGHT_CODES",
    "Fp4Layer",
    "FrozenFp4Linear",
    "frozen_weight_code",
    "frozen_weight_name",
]

FROZEN_FP4_VERSION: Final[int] = 1
"""``_extra_state[0]``: the layout ``[version, weight code]`` (int64)."""
FROZEN_FP4_BUFFERS: Final = ("weight_fp4", "weight_scale", "weight_amax")
"""A frozen 4-bit layer's buffers (``weight_amax``: NVFP4 only)."""
_FP8_KEYS: Final = ("weight_fp8", "weight_step")


class Fp4Layer(Protocol):
    """What ``from_fp4_linear`` reads of an ``Fp4Linear``."""

    @property
    def recipe(self) -> Fp4Recipe: ...

    @property
    def bias(self) -> torch.Tensor | None: ...

    def quantized_weight(self) -> Fp4Operand: ...


def frozen_weight_code(nvfp4: bool, tile: str, rounding: str) -> int:
    """``_extra_state[1]`` of frozen 4-bit weights: their format, tile and MXFP4 rounding."""
    # Bits as Fp4Linear's recipe code: format, 1x16 weights, MXFP4 floor.
    return (not nvfp4) | (nvfp4 and tile == "1x16") << 1 | (not nvfp4 and rounding == "floor") << 2


FROZEN_WEIGHT_CODES: Final = frozenset(
    frozen_weight_code(nv, tile, r)
    for nv in (True, False)
    for tile in ("1x16", "16x16")
    for r in ("rceil", "floor")
)
"""The weight codes a frozen layer saves: NVFP4 16x16 and 1x16, MXFP4 rceil and floor."""


def frozen_weight_name(code: int) -> str:
    """A frozen weight code in words (``"nvfp4 weights in 16x16 tiles"``)."""
    if code & 1:
        return f"mxfp4 weights ({'floor' if code & 4 else 'rceil'} scales)"
    return f"nvfp4 weights in {'1x16 blocks' if code & 2 else '16x16 tiles'}"


class FrozenFp4Linear(nn.Module):
    """A linear whose weight is held as 4-bit codes and block scales (module docstring), served
    by ``mode``: ``"weight_only"`` (the weight dequantized to the input's dtype, torch's GEMM)
    or ``"w4a4"`` (the input quantized to nearest at every call, the 4-bit GEMM).

    ``weight``: an ``Nvfp4Operand`` or ``Mxfp4Operand`` of codes ``[out_features,
    in_features / 2]`` (``fp4_serving.check_weight`` says what is accepted), copied bit for
    bit; ``bias``: ``None`` or a float tensor ``(out_features,)`` on the codes' device (a
    ``Parameter`` is held as it is, another tensor copied into one that needs no gradient);
    ``activation_amax``: NVFP4 W4A4's rule, ``"per_row"`` (each row's output is ``Fp4Linear``'s
    on that row alone, whatever the batch), ``"per_tensor"`` (``Fp4Linear``'s forward on the
    batch, bit for bit) or ``"static"`` (one calibrated amax, ``input_amax``: NVFP4 only);
    ``mx_rounding``: MXFP4's E8M0 rule for the activations (the weight's
    codes are taken as given). Bad input: ``TypeError``/``ValueError`` naming the value.

    The output has the input's dtype (the autocast dtype inside ``torch.autocast``); inputs of
    any leading shape, bf16/fp16/fp32.
    """

    weight_fp4: torch.Tensor
    weight_scale: torch.Tensor
    weight_amax: torch.Tensor
    """NVFP4 only."""
    input_amax: torch.Tensor
    """``activation_amax="static"`` only."""

    def __init__(
        self,
        weight: Fp4Operand,
        bias: torch.Tensor | None = None,
        *,
        mode: ServeMode = "weight_only",
        activation_amax: ActivationAmax = "per_row",
        mx_rounding: MxRounding = "rceil",
    ) -> None:
        who = "FrozenFp4Linear"
        check_serving(mode, activation_amax, who, static=True)
        if mx_rounding not in ("rceil", "floor"):
            raise ValueError(f"{who}: mx_rounding must be 'rceil' or 'floor', got {mx_rounding!r}")
        q = check_weight(weight, who)
        if activation_amax == "static" and not isinstance(q, Nvfp4Operand):
            raise ValueError(
                f"{who}: activation_amax='static' sets NVFP4's per-tensor S_enc; MXFP4 has "
                f"none (its rules are 'per_row' and 'per_tensor', the same)"
            )
        n, k = q.codes.shape[0], 2 * q.codes.shape[1]
        b = check_bias(bias, n, q.codes.device, who)
        super().__init__()
        self.in_features, self.out_features = k, n
        self.mode: ServeMode = mode
        self.activation_amax: ActivationAmax = activation_amax
        nv = isinstance(q, Nvfp4Operand)
        self.format: Literal["nvfp4", "mxfp4"] = "nvfp4" if nv else "mxfp4"
        self.tile: Literal["1x16", "16x16", "1x32"] = (
            q.tile if isinstance(q, Nvfp4Operand) else "1x32"
        )
        self._how = Fp4Quant(
            format=self.format,
            weight_tile="16x16" if self.tile == "16x16" else "1x16",
            mx_rounding=mx_rounding,
            hadamard=False,
        )
        self._code = frozen_weight_code(nv, self.tile, mx_rounding)
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, loadable later
            for name, t in (("weight_fp4", q.codes), ("weight_scale", q.scale)):
                self.register_buffer(name, t.clone(memory_format=torch.contiguous_format))
            if isinstance(q, Nvfp4Operand):
                self.register_buffer("weight_amax", q.amax.float().reshape(1).clone())
            if activation_amax == "static":
                nan = torch.full((1,), float("nan"), dtype=torch.float32, device=q.codes.device)
                self.register_buffer("input_amax", nan)
            if b is not None and not isinstance(b, nn.Parameter):
                b = nn.Parameter(b.detach().clone(), requires_grad=False)
        self.bias: nn.Parameter | None = b
        self.input_calibrated = False
        """Whether ``input_amax`` holds a calibrated value (``"static"``)."""
        self.calibrating: torch.Tensor | None = None
        """During ``calibrate_fp4_activations``: the max |x| of the inputs seen (float32 ``()``);
        the forward then serves ``"weight_only"``."""
        self.register_load_state_dict_post_hook(_loaded)  # type: ignore[no-untyped-call]
        guard_whole_loads(self)  # load_state_dict checks every entry before any module loads

    @classmethod
    def from_fp4_linear(
        cls,
        layer: Fp4Layer,
        mode: ServeMode = "weight_only",
        *,
        activation_amax: ActivationAmax = "per_row",
    ) -> FrozenFp4Linear:
        """The frozen twin of an ``Fp4Linear`` (not one FSDP2 sharded): the codes, scales and
        amax its forward multiplies with (``quantized_weight()``, at the recipe's weight tile),
        its MXFP4 rounding, and its ``bias`` Parameter itself (shared)."""
        recipe = getattr(layer, "recipe", None)
        if not isinstance(layer, nn.Linear) or not isinstance(recipe, Fp4Recipe):
            raise TypeError(f"from_fp4_linear takes an Fp4Linear, got {describe(layer)}")
        check_serving(mode, activation_amax, "from_fp4_linear", static=True)
        refuse_sharded("FrozenFp4Linear.from_fp4_linear", layer)
        return cls(
            layer.quantized_weight(),
            layer.bias,
            mode=mode,
            activation_amax=activation_amax,
            mx_rounding=recipe.mx_rounding or "rceil",
        )

    @property
    def weight_operand(self) -> Fp4Operand:
        """The held weight as an operand of the 4-bit ops (views of the buffers)."""
        if self.format == "mxfp4":
            return Mxfp4Operand(self.weight_fp4, self.weight_scale)
        tile: Literal["1x16", "16x16"] = "16x16" if self.tile == "16x16" else "1x16"
        return Nvfp4Operand(self.weight_fp4, self.weight_scale, self.weight_amax.reshape(()), tile)

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the weight is held in (for ``computectx.memory.memory_report``, which
        counts a model's parameters but not its buffers)."""
        return tuple(getattr(self, n) for n in FROZEN_FP4_BUFFERS if n in self._buffers)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values at ``dtype`` (formed in float32, rounded once): what
        ``"weight_only"`` multiplies with."""
        return dequantized(self.weight_operand, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b`` by ``mode`` (``fp4_serving``)."""
        check_linear_input(x, self.in_features, "FrozenFp4Linear")
        lowered = autocast_dtype(x)
        if lowered is not None:  # as autocast runs a linear: the input at its dtype
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x.to(lowered))
        x2 = x.reshape(-1, x.shape[-1])
        if self.calibrating is not None:  # the input as the W4A4 path would quantize it
            self.calibrating = torch.maximum(self.calibrating, tensor_amax(x2.detach()))
        elif self.mode == "w4a4" and self.activation_amax == "static" and not self.input_calibrated:
            raise RuntimeError(
                "FrozenFp4Linear: activation_amax='static' but input_amax is not calibrated: "
                "run calibrate_fp4_activations(model, batches), load a calibrated state dict, "
                "or set_input_amax(amax)"
            )
        if self.mode == "weight_only" or x2.shape[0] == 0 or self.calibrating is not None:
            # No rows: nothing to quantize; the empty GEMM keeps the graph (zero gradients).
            y2 = weight_only_mm(x2, self.weight_operand, self.bias)
        elif torch.is_grad_enabled() and (
            x2.requires_grad or (self.bias is not None and self.bias.requires_grad)
        ):
            y2 = _W4A4Fn.apply(x2, self.bias, self)  # type: ignore[no-untyped-call]
        else:
            y2 = self._w4a4(x2)
        return y2.reshape(*x.shape[:-1], self.out_features)

    def _w4a4(self, x2: torch.Tensor) -> torch.Tensor:
        w, rule = self.weight_operand, self.activation_amax
        a = self.input_amax if rule == "static" else None
        return w4a4_mm(x2.detach(), w, self._how, rule, _epilogue_bias(self.bias), x2.dtype, a)

    def set_input_amax(self, amax: torch.Tensor) -> None:
        """Install a static layer's calibrated input amax (float32 ``(1,)``, finite, ``> 0``;
        ``fp4_serving.check_input_amax``), copied: the layer serves with it from now."""
        if self.activation_amax != "static":
            raise ValueError(
                f"set_input_amax: the layer's activation_amax is {self.activation_amax!r}; a "
                f"calibrated amax is 'static''s"
            )
        check_input_amax(amax, "set_input_amax")
        with torch.no_grad():
            self.input_amax.copy_(amax)
        self.input_calibrated = True

    # ----- state ----------------------------------------------------------------------------

    def get_extra_state(self) -> torch.Tensor:
        """int64 ``[FROZEN_FP4_VERSION, weight code]``."""
        return torch.tensor([FROZEN_FP4_VERSION, self._code], dtype=torch.int64)

    def set_extra_state(self, state: Any) -> None:
        """Nothing to install: the state is checked (``check_load``)."""
        self.check_load({"_extra_state": state}, "")

    def check_state_tensors(self, tensors: Mapping[str, object], prefix: str = "") -> None:
        """``computectx.memory.load_weights``' check: ``check_load``."""
        self.check_load(tensors, prefix)

    def check_load(self, entries: Mapping[str, object], prefix: str) -> None:
        """``ValueError`` naming the key and both sides unless this layer can load the
        entries among ``entries`` (local names) as they are (module docstring); a state dict
        holding none of the layer's entries passes (torch reports missing keys)."""
        layer = (
            f"the frozen 4-bit layer {prefix[:-1] or '<root>'!r} ({frozen_weight_name(self._code)})"
        )
        if "weight" in entries:
            raise ValueError(
                f"{layer}: the state dict holds a high-precision {prefix}weight (a training "
                f"checkpoint: nn.Linear or Fp4Linear); load it into the model before freezing, "
                f"then freeze (freeze_fp4_for_serving)"
            )
        fp8 = sorted(k for k in entries if k.startswith("fp8_") or k in _FP8_KEYS)
        if fp8:
            raise ValueError(
                f"{layer}: the state dict holds an fp8 layer's {prefix}{fp8[0]}: an fp8 "
                f"checkpoint does not load into a 4-bit layer"
            )
        self._check_state(entries.get("_extra_state"), layer, prefix)
        self._check_weight_entries(entries, layer, prefix)
        if "input_amax" in entries and self.activation_amax == "static":
            amax, who = entries["input_amax"], f"{layer}: {prefix}input_amax"
            check_input_amax(amax, who, uncalibrated=True)

    def adopt_written(self) -> None:
        """Take the buffers as written from outside (``load_state_dict``; another rank's bytes:
        ``broadcast_frozen``): a static layer is calibrated when ``input_amax`` is finite."""
        amax = self._buffers.get("input_amax")
        if amax is not None and not amax.is_meta:
            self.input_calibrated = bool(torch.isfinite(amax).all())

    def clear_input_amax(self) -> None:
        """A static layer back to uncalibrated (``input_amax`` NaN): for new weights."""
        with torch.no_grad():
            self.input_amax.fill_(float("nan"))
        self.input_calibrated = False

    def state_load_keys(self) -> tuple[str, ...]:
        """``computectx.memory.load_weights``' seam: a static layer's ``input_amax``."""
        return ("input_amax",) if self.activation_amax == "static" else ()

    def plan_state_load(
        self, tensors: Mapping[str, torch.Tensor], *, prefix: str = ""
    ) -> Callable[[], None]:
        """Check ``tensors`` (``check_load``) and return what installs ``input_amax``: a
        calibrated one, or back to uncalibrated for a NaN one and for new weights without one."""
        self.check_load(tensors, prefix)
        saved = tensors.get("input_amax")
        new = any(n in tensors for n in FROZEN_FP4_BUFFERS)  # new weights
        if self.activation_amax != "static" or (saved is None and not new):
            return lambda: None
        if saved is None or bool(saved.isnan().all()):  # NaN: saved before calibration
            return self.clear_input_amax
        saved = saved.clone()  # read now: a memory-mapped file may go
        return lambda: self.set_input_amax(saved.to(self.input_amax.device))

    def _load_from_state_dict(
        self, state_dict: Mapping[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # New weights without an input_amax (strict=False): uncalibrated (import_pretrained's rule)
        new = any(f"{prefix}{n}" in state_dict for n in FROZEN_FP4_BUFFERS)
        if self.activation_amax == "static" and f"{prefix}input_amax" not in state_dict and new:
            self.clear_input_amax()

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep)
        copied_on_save(destination, prefix, keep, ("weight_amax", "input_amax"))  # checked once

    def _check_state(self, state: object, layer: str, prefix: str) -> None:
        if state is None:
            return
        if (
            not isinstance(state, torch.Tensor)
            or state.dtype != torch.int64
            or tuple(state.shape) != (2,)
            or state.is_meta
        ):
            raise ValueError(
                f"{layer}: {prefix}_extra_state must be an int64 tensor [version, weight "
                f"code] holding values (not on the meta device), got {_what(state)}"
                f"{' on meta' if isinstance(state, torch.Tensor) and state.is_meta else ''} "
                f"(an Fp4Linear's training state is [version, recipe code, seed, counter]: "
                f"load it before freezing)"
            )
        version, code = (int(v) for v in state.tolist())
        if version != FROZEN_FP4_VERSION:
            raise ValueError(
                f"{prefix}_extra_state has version {version}; this computectx reads frozen "
                f"4-bit layers of version {FROZEN_FP4_VERSION}"
            )
        if code != self._code:
            known = code in FROZEN_WEIGHT_CODES
            shown = frozen_weight_name(code) if known else f"<unknown weight code {code}>"
            raise ValueError(f"{layer}: the state dict holds {shown}; freeze under that format")

    def _check_weight_entries(self, entries: Mapping[str, object], layer: str, prefix: str) -> None:
        held = dict(zip(FROZEN_FP4_BUFFERS, self.weight_tensors(), strict=False))
        given = [n for n in FROZEN_FP4_BUFFERS if n in entries]
        if not given:
            return
        if given != list(held):
            raise ValueError(
                f"{layer}: the state dict holds {[prefix + n for n in given]}, but the layer "
                f"loads {[prefix + n for n in held]}, whole"
            )
        got: dict[str, torch.Tensor] = {}
        for name, own in held.items():
            value = entries[name]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{layer}: {prefix}{name} must be a tensor, got {describe(value)}")
            why = (
                "a cast has already rounded it"
                if value.dtype != own.dtype
                else "another shape is another layer's"
            )
            if (value.dtype, value.shape) != (own.dtype, own.shape):
                raise ValueError(
                    f"{layer}: {prefix}{name} is {_what(value)}, but the layer holds "
                    f"{_what(own)} and loads only that ({why})"
                )
            got[name] = value
        q = self.weight_operand
        if isinstance(q, Nvfp4Operand):
            q = Nvfp4Operand(got["weight_fp4"], got["weight_scale"], got["weight_amax"][0], q.tile)
        else:
            q = Mxfp4Operand(got["weight_fp4"], got["weight_scale"])
        check_weight(q, f"{layer}: {prefix}weight_*")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # The codes, scales and amax follow the module's device, never its dtype: 4-bit and
        # fp8 count as floating point, so .half() would cast (or fail on) them.
        with held_out(self._buffers, (*FROZEN_FP4_BUFFERS, "input_amax")) as held:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
            codes = held["weight_fp4"]
            assert codes is not None  # the layer always holds its codes
            device = fn(torch.zeros((), device=codes.device)).device
            for k, t in held.items():
                if t is not None:
                    # From the meta device there is nothing to copy: fresh memory, to load.
                    held[k] = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
        return self

    def extra_repr(self) -> str:
        b = self.bias is not None
        rule = f", activation_amax={self.activation_amax}" if self._per_tensor_matters() else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={b}, "
            f"{frozen_weight_name(self._code)}, mode={self.mode}{rule}"
        )

    def _per_tensor_matters(self) -> bool:
        return self.format == "nvfp4" and self.mode == "w4a4"


def _loaded(layer: FrozenFp4Linear, _: object) -> None:
    """After ``load_state_dict`` (a loaded ``input_amax`` was checked: > 0, or NaN)."""
    layer.adopt_written()


def _what(value: object) -> str:
    """``value`` for a message: a tensor by its dtype and shape, never its contents."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    return describe(value)


def _epilogue_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as W4A4's float32 epilogue adds it: a float64 one (a module-wide
    ``.double()``) at float32, the others as they are."""
    if bias is None:
        return None
    return bias.detach().float() if bias.dtype == torch.float64 else bias.detach()


class _W4A4Fn(torch.autograd.Function):
    """W4A4's forward; the backward passes straight through the activation's rounding:
    ``dX = dY W`` (the dequantized weight at the input's dtype), ``db = sum dY``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x2: torch.Tensor, bias: torch.Tensor | None, layer: FrozenFp4Linear
    ) -> torch.Tensor:
        ctx.layer, ctx.x_dtype = layer, x2.dtype  # type: ignore[attr-defined]
        ctx.bias_dtype = None if bias is None else bias.dtype  # type: ignore[attr-defined]
        return layer._w4a4(x2)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = dy.to(ctx.x_dtype) @ ctx.layer.dequantized_weight(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            db = dy.float().sum(0).to(ctx.bias_dtype)
        return dx, db, None
