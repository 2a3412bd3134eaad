"""``FrozenFp4Experts``: 4-bit experts held pre-quantized for serving (weight-only or W4A4), the
grouped twin of ``FrozenFp4Linear``.

``FrozenFp4Experts.from_fp4_experts(experts, weights, mode)`` quantizes each expert ``e`` of
every weight ``[E, N, K]`` of an experts module (``GroupedExperts``' ``gate_up`` and ``down``)
as ``Fp4Experts``' forward does (``ops.fp4.quantize(w[e], how, weight=True)``: the codes
``Fp4Linear.quantized_weight()`` gives a linear holding ``w[e]``) and holds, per weight
``name``, the buffers (all persistent):

=================  ==========================================================================
``{name}_fp4``     ``float4_e2m1fn_x2`` ``[E, N, K/2]``: E2M1 codes, two a byte
``{name}_scale``   NVFP4: ``float8_e4m3fn`` ``[E, N, K/16]`` (1x16) or ``[E, N/16, K/16]``
                   (16x16 tiles); MXFP4: ``float8_e8m0fnu`` ``[E, N, K/32]``
``{name}_amax``    NVFP4 only: float32 ``(E,)``, each expert's own per-tensor amax
=================  ==========================================================================

with ``_extra_state`` int64 ``[version, weight code]`` (``FrozenFp4Linear``'s layout and
codes). Bytes per weight element: NVFP4 16x16 tiles 0.50390625, 1x16 blocks 0.5625, plus 4 an
expert; MXFP4 0.53125. ``install_frozen_experts`` puts one in the place of the experts
module's ``Fp4Experts`` child and drops the module's high-precision expert parameters.

**The two modes** (``linear.fp4_serving``'s, group by group):

- ``"weight_only"``: each expert dequantized to the input's dtype (``dequantized``: formed in
  float32, rounded once, ``computectx::fp4_dequantize_experts``), then a high-precision
  grouped GEMM: the experts module's own (``mm(..., grouped=)``; ``GroupedExperts`` passes
  its ``F.grouped_mm`` path), so the output is that module's high-precision forward with the
  dequantized weights, bit for bit, as batch-invariant as that GEMM (on the CPU a float32
  ``F.grouped_mm``: not). Eager on the CPU only the experts with rows are dequantized.
- ``"w4a4"``: each group's rows quantized at every call (round to nearest, never stochastic,
  no Hadamard transform: the forward's operands), times the held expert through
  ``computectx::fp4_grouped_mm_gathered`` (``ops.fp4_grouped_frozen.held_grouped_mm``).
  ``activation_amax="per_tensor"``: each group's rows take one amax, as ``Fp4Experts``'
  forward takes it; the output is ``Fp4Experts.mm`` under ``no_grad`` bit for bit (on the
  emulated backend; a GPU's kernels may sum in their own order) and a row's bits depend on
  the other rows routed to its expert in the same call.
  ``"per_row"`` (default; NVFP4): each row by its own amax, so row ``i`` of group ``g`` is
  ``Fp4Experts.mm`` on row ``i`` alone (a one-row group of expert ``g``), whatever else is
  in the batch. MXFP4 has no per-tensor scale: both rules are the forward's, batch-invariant.

An empty group reads nothing of its expert (weight-only: eager on the CPU); rows past
``offs[-1]`` are zero; ``offs`` is checked in either mode (``checked_bounds``). No gradient:
W4A4 refuses an input that needs one (serve under ``torch.inference_mode()`` or
``no_grad``); weight-only passes the input gradient through the grouped GEMM.

**Loading** refuses, before any module loads (``ValueError`` naming the key and both sides):
a 4-bit training state (``Fp4Experts``' counter ``[2, recipe, seed, counter, stream]``: load
it into the unfrozen model, then freeze), a state frozen under another format, tile or MXFP4
rounding, an entry of another dtype or shape, NaN or negative scales, an amax that is not
finite, a partial weight. A module-wide ``.to()`` moves the buffers, never casts them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

import torch
from torch import nn
from typing_extensions import Self

from computectx.formats.linear.fp4_experts import Fp4Experts
from computectx.formats.linear.fp4_frozen import (
    FROZEN_FP4_VERSION,
    frozen_weight_code,
    frozen_weight_name,
)
from computectx.formats.linear.fp4_frozen_experts_checks import (
    check_experts,
    check_input,
    check_state,
    check_width,
)
from computectx.formats.linear.fp4_serving import (
    ActivationAmax,
    ServeMode,
    check_serving,
    check_weights,
)
from computectx.formats.numerics.fp4 import Mxfp4Operand, MxRounding, Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Operand
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.ops.fp4_grouped_frozen import (
    dequantize_experts,
    expert_operand,
    held_grouped_mm,
)
from computectx.formats.ops.grouped import checked_bounds
from computectx.formats.policy import describe, refuse_sharded
from computectx.formats.scaling.layer import held_out
from computectx.formats.scaling.load import copied_on_save, guard_whole_loads

__all__ = [
    "FROZEN_EXPERTS_SUFFIXES",
    "FrozenFp4Experts",
    "GroupedGemm",
    "freeze_fp4_experts",
    "install_frozen_experts",
]

FROZEN_EXPERTS_SUFFIXES: Final = ("_fp4", "_scale", "_amax")
"""A frozen expert weight ``name``'s buffers (``_amax``: NVFP4 only)."""

GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A high-precision grouped GEMM ``(x [M, K], w [E, N, K], offs) -> [M, N]``."""


class FrozenFp4Experts(nn.Module):
    """Experts whose weights are held as 4-bit codes and block scales (module docstring),
    served by ``mode``: ``"weight_only"`` or ``"w4a4"``.

    ``weights``: for each name, one ``Nvfp4Operand``/``Mxfp4Operand`` per expert (codes
    ``[N, K/2]``, ``fp4_serving.check_weight`` says what is accepted), all of one format and
    tile, copied bit for bit; ``activation_amax``: NVFP4 W4A4's rule (``"per_row"``:
    batch-invariant; ``"per_tensor"``: each group's one amax, the training forward's);
    ``mx_rounding``: MXFP4's E8M0 rule for the activations. ``TypeError``/``ValueError`` naming
    the bad value."""

    kind = "frozen 4-bit experts"

    def __init__(
        self,
        weights: Mapping[str, Sequence[Fp4Operand]],
        *,
        mode: ServeMode = "weight_only",
        activation_amax: ActivationAmax = "per_row",
        mx_rounding: MxRounding = "rceil",
    ) -> None:
        who = "FrozenFp4Experts"
        check_serving(mode, activation_amax, who)
        if mx_rounding not in ("rceil", "floor"):
            raise ValueError(f"{who}: mx_rounding must be 'rceil' or 'floor', got {mx_rounding!r}")
        if not isinstance(weights, Mapping) or not weights:
            raise TypeError(
                f"{who} takes a non-empty mapping of weight names to per-expert operands, got "
                f"{describe(weights)}"
            )
        kinds = {n: check_experts(n, ops, who) for n, ops in weights.items()}
        if len(set(kinds.values())) != 1:
            raise ValueError(f"{who}: every weight must share one format and tile, got {kinds}")
        counts = {n: len(ops) for n, ops in weights.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(f"{who}: every weight must hold one operand an expert, got {counts}")
        super().__init__()
        first = next(iter(weights.values()))[0]
        nv = isinstance(first, Nvfp4Operand)
        self.format: Literal["nvfp4", "mxfp4"] = "nvfp4" if nv else "mxfp4"
        self.tile: str = first.tile if isinstance(first, Nvfp4Operand) else "1x32"
        self.mode: ServeMode = mode
        self.activation_amax: ActivationAmax = activation_amax
        self.mx_rounding: MxRounding = mx_rounding
        self.names: tuple[str, ...] = tuple(weights)
        self._code = frozen_weight_code(nv, self.tile, mx_rounding)
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, loadable later
            for name, ops in weights.items():
                self.register_buffer(name + "_fp4", torch.stack([q.codes for q in ops]))
                self.register_buffer(name + "_scale", torch.stack([q.scale for q in ops]))
                if nv:
                    amax = [q.amax.float().reshape(()) for q in ops]  # type: ignore[union-attr]
                    self.register_buffer(name + "_amax", torch.stack(amax))
        guard_whole_loads(self)  # load_state_dict checks every entry before any module loads

    @classmethod
    def from_fp4_experts(
        cls,
        experts: Fp4Experts,
        weights: Mapping[str, torch.Tensor],
        mode: ServeMode = "weight_only",
        *,
        activation_amax: ActivationAmax = "per_row",
    ) -> FrozenFp4Experts:
        """The frozen twin of experts running under ``experts`` (an ``Fp4Experts``) with
        ``weights`` (name -> ``[E, N, K]``): each expert's operand as the forward quantizes
        it. ``ValueError`` naming the weight and expert for one that cannot be frozen (a NaN)."""
        if not isinstance(experts, Fp4Experts):
            raise TypeError(f"from_fp4_experts takes an Fp4Experts, got {describe(experts)}")
        check_serving(mode, activation_amax, "from_fp4_experts")
        ops: dict[str, list[Fp4Operand]] = {}
        with torch.inference_mode(False), torch.no_grad():
            for name, w in weights.items():
                if not isinstance(w, torch.Tensor) or w.dim() != 3:
                    raise ValueError(
                        f"from_fp4_experts: {name!r} must be a 3-D tensor [E, N, K], got "
                        f"{describe(w) if not isinstance(w, torch.Tensor) else tuple(w.shape)}"
                    )
                check_width(name, w, experts)
                ops[name] = [fp4_ops.quantize(w[e].detach(), experts.how, weight=True)
                             for e in range(w.shape[0])]  # fmt: skip
        rounding = experts.recipe.mx_rounding or "rceil"
        return cls(ops, mode=mode, activation_amax=activation_amax, mx_rounding=rounding)

    # ----- the held weights ----------------------------------------------------------------

    def held(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``name``'s codes, scales and (NVFP4) amaxes: the buffers themselves."""
        if name not in self.names:
            raise KeyError(f"{type(self).__name__} holds {list(self.names)}, not {name!r}")
        amax = self._buffers.get(name + "_amax")
        return self._buffers[name + "_fp4"], self._buffers[name + "_scale"], amax  # type: ignore[return-value]

    def operand(self, name: str, expert: int) -> Fp4Operand:
        """Expert ``expert``'s operand of ``name`` (views of the buffers)."""
        return expert_operand(*self.held(name), self.tile, expert)

    def shape(self, name: str) -> tuple[int, int, int]:
        """``[E, N, K]`` of the weight ``name`` stands for."""
        codes = self.held(name)[0]
        return codes.shape[0], codes.shape[1], 2 * codes.shape[2]

    def weight_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the weights are held in (for ``memory_report``)."""
        return tuple(t for n in self.names for t in self.held(n) if t is not None)

    def dequantized(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[E, N, K]``: the values ``name`` stands for at ``dtype`` (each formed in float32,
        rounded once): what ``"weight_only"`` multiplies with."""
        return dequantize_experts(*self.held(name), self.tile, dtype, check_amax_values=False)

    def _dequantized_at(self, name: str, dtype: torch.dtype, offs: torch.Tensor) -> torch.Tensor:
        # As GroupedExperts' _experts_at: eager on the CPU only the experts with rows are
        # dequantized (each as dequantized() forms it), the others left uninitialized (no
        # grouped GEMM reads an empty group's weight); compiled, or on an accelerator (where a
        # host read of offs costs more), every expert.
        codes, scale, amax = self.held(name)
        if codes.device.type != "cpu" or torch.compiler.is_compiling():
            return self.dequantized(name, dtype)
        used = torch.diff(offs, prepend=offs.new_zeros(1)).nonzero().flatten()
        out = torch.empty(self.shape(name), dtype=dtype, device=codes.device)
        if used.numel():
            c, sc = (t.view(torch.uint8)[used].view(t.dtype) for t in (codes, scale))
            out[used] = dequantize_experts(
                c, sc, None if amax is None else amax[used], self.tile, dtype,
                check_amax_values=False,
            )  # fmt: skip
        return out

    # ----- the GEMM ------------------------------------------------------------------------

    def mm(
        self, x: torch.Tensor, name: str, offs: torch.Tensor, grouped: GroupedGemm | None = None
    ) -> torch.Tensor:
        """``[M, N]`` at ``x``'s dtype (the autocast dtype inside ``torch.autocast``): group
        ``g``'s rows of ``x [M, K]`` times expert ``g`` of ``name`` by ``mode`` (module
        docstring); ``offs`` int32 ``(E,)`` end rows. ``grouped``: weight-only's
        high-precision grouped GEMM (default: one ``F.linear`` per group, eager only)."""
        e, _, k = self.shape(name)
        check_input(x, offs, e, k, self.held(name)[0].device)
        if self.mode == "weight_only":
            if grouped is None:  # eager: offs read here, as the operators read it
                checked_bounds(offs, x.shape[0], e)
            w = self._dequantized_at(name, _at(x), offs)
            return (grouped if grouped is not None else _per_group)(x, w, offs)
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                "frozen 4-bit experts in w4a4 mode pass no gradient: serve under "
                "torch.inference_mode() or torch.no_grad() (or freeze with mode='weight_only')"
            )
        codes, scale, amax = self.held(name)
        per_row = self.activation_amax == "per_row"
        return held_grouped_mm(
            x.to(_at(x)), codes, scale, amax, offs, tile=self.tile,
            mx_rounding=self.mx_rounding, per_row=per_row, check_amax_values=False,
        )  # fmt: skip

    # ----- state ---------------------------------------------------------------------------

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
        """``ValueError`` naming the key and both sides unless these experts can load the
        entries among ``entries`` (local names) as they are (module docstring)."""
        where = f"the {self.kind} {prefix[:-1] or '<root>'!r} ({frozen_weight_name(self._code)})"
        state = entries.get("_extra_state")
        if state is not None:
            check_state(state, self._code, where, prefix)
        for name in self.names:
            _check_entries(self, name, entries, where, prefix)

    @staticmethod
    def refuse_high_precision(held: object, entries: Mapping[str, object], prefix: str) -> None:
        """The experts module's ``check_load`` (``install_frozen_experts`` sets it, as fp8's
        ``freeze_experts`` does): when ``held`` is a ``FrozenFp4Experts``, ``ValueError`` for
        a high-precision expert weight among the module's ``entries``, strict or not (as
        ``FrozenFp4Linear`` refuses a ``weight``)."""
        hp = [n for n in getattr(held, "names", ()) if n in entries]
        if isinstance(held, FrozenFp4Experts) and hp:
            raise ValueError(
                f"the {held.kind} {prefix[:-1] or '<root>'!r}: the state dict holds a "
                f"high-precision {prefix}{hp[0]} (a training state of the experts): load that "
                f"checkpoint into the unfrozen model, then freeze (freeze_fp4_for_serving)"
            )

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep)
        # The amaxes are checked once, at a load, not on each call (copied_on_save).
        copied_on_save(destination, prefix, keep, (n + "_amax" for n in self.names))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # The codes, scales and amaxes follow the module's device, never its dtype.
        names = tuple(n + s for n in self.names for s in FROZEN_EXPERTS_SUFFIXES)
        with held_out(self._buffers, names) as held:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
            some = next(t for t in held.values() if t is not None)
            device = fn(torch.zeros((), device=some.device)).device
            for key, t in held.items():
                if t is not None:
                    held[key] = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
        return self

    def extra_repr(self) -> str:
        e = self.shape(self.names[0])[0]
        rule = (
            f", activation_amax={self.activation_amax}"
            if self.format == "nvfp4" and self.mode == "w4a4"
            else ""
        )
        held = f"{frozen_weight_name(self._code)}, mode={self.mode}{rule}"
        return f"n_experts={e}, weights={list(self.names)}, {held}"


def freeze_fp4_experts(
    module: nn.Module,
    weights: Mapping[str, torch.Tensor],
    given: object,
    mode: ServeMode,
    activation_amax: ActivationAmax,
) -> None:
    """``module``'s ``Fp4Experts`` and expert parameters ``weights`` replaced by their
    ``FrozenFp4Experts`` (``GroupedExperts.freeze_for_serving``): built first, then put in
    place (a refusal changes nothing). Experts frozen already under the same ``mode`` and
    ``activation_amax`` stay as they are; under others, ``ValueError``. ``given`` (fp8's
    ``weights=``) must be ``None``: ``TypeError`` (build a ``FrozenFp4Experts`` from the
    operands and ``install_frozen_experts`` it instead)."""
    who = f"{type(module).__name__}.freeze_for_serving"
    if given is not None:
        raise TypeError(
            f"{who}: weights= takes fp8 experts' ServingWeights; 4-bit experts freeze from "
            f"their own weights (for operands from outside, build FrozenFp4Experts(...) and "
            f"install_frozen_experts it). Nothing was changed"
        )
    check_serving(mode, activation_amax, who)
    refuse_sharded(who, module)
    now = next((c for c in module.children() if isinstance(c, FrozenFp4Experts)), None)
    if now is not None:
        if (now.mode, now.activation_amax) != (mode, activation_amax):
            raise ValueError(
                f"{who}: the experts are frozen already (mode={now.mode!r}, activation_amax="
                f"{now.activation_amax!r}), not as asked ({mode!r}, {activation_amax!r}); "
                f"freeze a copy made before freezing. Nothing was changed"
            )
        return
    setting = next((c for c in module.children() if isinstance(c, Fp4Experts)), None)
    if setting is None:
        raise ValueError(f"{who}: the experts hold no Fp4Experts. Nothing was changed")
    frozen = FrozenFp4Experts.from_fp4_experts(
        setting, weights, mode, activation_amax=activation_amax
    )
    install_frozen_experts(module, frozen)


def install_frozen_experts(module: nn.Module, frozen: FrozenFp4Experts) -> None:
    """Put ``frozen`` in the place of ``module``'s ``Fp4Experts`` child and drop ``module``'s
    parameters named as ``frozen``'s weights (the high-precision expert weights)."""
    child = next((n for n, c in module.named_children() if isinstance(c, Fp4Experts)), None)
    if child is None:
        raise ValueError(
            f"install_frozen_experts: {type(module).__name__} holds no Fp4Experts to replace"
        )
    _check_fit(module, frozen)
    for name in frozen.names:
        if module._parameters.get(name) is not None:
            module.register_parameter(name, None)
    setattr(module, child, frozen)
    if getattr(type(module), "check_load", None) is None:  # as fp8's freeze_experts sets it
        vars(module)["check_load"] = functools.partial(frozen.refuse_high_precision, frozen)


def _check_fit(module: nn.Module, frozen: FrozenFp4Experts) -> None:
    # Before anything changes: frozen holds a weight for each of the module's expert
    # parameters (named by its NAMES, else frozen's names), each of the parameter's [E, N, K].
    who, kind = "install_frozen_experts", type(module).__name__
    if not isinstance(frozen, FrozenFp4Experts):
        raise TypeError(f"{who} takes a FrozenFp4Experts, got {describe(frozen)}")
    names = tuple(getattr(module, "NAMES", frozen.names))
    if set(names) != set(frozen.names):
        raise ValueError(
            f"{who}: {kind} holds the expert weights {list(names)}, the frozen experts "
            f"{list(frozen.names)}; nothing was changed"
        )
    for name in names:
        p = module._parameters.get(name)
        if p is None or tuple(p.shape) != frozen.shape(name):
            got = "none" if p is None else f"[E, N, K] = {tuple(p.shape)}"
            raise ValueError(
                f"{who}: {kind}'s {name!r} is {got}, the frozen experts' {frozen.shape(name)}; "
                f"nothing was changed"
            )


def _at(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _per_group(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = x.new_zeros((x.shape[0], w.shape[1]), dtype=w.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:  # an empty group's weight is never read (nor dequantized)
            out[start:end] = torch.nn.functional.linear(x[start:end].to(w.dtype), w[g])
        start = end
    return out


def _check_entries(
    frozen: FrozenFp4Experts, name: str, entries: Mapping[str, object], where: str, prefix: str
) -> None:
    own = dict(zip((name + s for s in FROZEN_EXPERTS_SUFFIXES), frozen.held(name), strict=True))
    held = {k: t for k, t in own.items() if t is not None}
    given = [k for k in own if k in entries]
    if not given:
        return
    if given != list(held):
        raise ValueError(
            f"{where}: the state dict holds {[prefix + k for k in given]}, but the experts "
            f"load {[prefix + k for k in held]}, whole"
        )
    for key, t in held.items():
        value = entries[key]
        if not isinstance(value, torch.Tensor) or (value.dtype, value.shape) != (t.dtype, t.shape):
            got = (
                f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else describe(value)
            )
            raise ValueError(
                f"{where}: {prefix}{key} is {got}, but the experts hold "
                f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} and load only that"
            )
    codes, scale = entries[name + "_fp4"], entries[name + "_scale"]
    amax = entries.get(name + "_amax")
    assert isinstance(codes, torch.Tensor) and isinstance(scale, torch.Tensor)
    ops: list[Fp4Operand] = [
        Nvfp4Operand(codes[e], scale[e], amax[e], frozen.tile)  # type: ignore[arg-type]
        if isinstance(amax, torch.Tensor)
        else Mxfp4Operand(codes[e], scale[e])
        for e in range(codes.shape[0])
    ]  # each expert checked as a dense layer's weight, the values in one host read
    check_weights([(q, f"{where}: {prefix}{name}_* expert {e}") for e, q in enumerate(ops)])
