"""``GroupedExperts``: the SwiGLU experts of a mixture-of-experts block as 3-D parameters,
run by grouped GEMMs over tokens sorted by expert.

The grouped GEMM of group ``g`` multiplies rows ``offs[g-1]:offs[g]`` of ``x`` (``offs[-1]``
read as 0) by ``w[g].T``, where ``w`` is ``(E, N, K)``, stored as ``nn.Linear`` stores a
weight (out x in) and as transformers 5 and torchtitan store experts. In high precision it
runs at ``ctx.compute`` with float32 accumulation and one rounding, by the block's
``GemmPath`` (``computectx.nn.Gemm``):

- ``NATIVE`` and ``WIDE``: ``torch.nn.functional.grouped_mm`` at the compute dtype;
- ``UPCAST`` (a CPU without native bf16/f16 GEMMs): the operands widened exactly to float32,
  a float32 ``grouped_mm``, one rounding; only the half-precision operands wait for backward.

``grouped_mm`` needs strides of multiples of 16 bytes: other widths are zero-padded (exact)
and cut back. It runs bf16 everywhere and, eager on the CPU, float32 and float16 too; compiled
(its fake kernel takes only bf16), ``UPCAST`` bf16 runs bf16's own ``grouped_mm`` (float32
accumulation in another order). Where it does not run (float64; float32/float16 on CUDA or
compiled) a dense twin computes the same rows: every row against every expert in one GEMM,
each row keeping its own expert's columns (``E`` times the FLOPs: for parity runs and small
models). Rows past ``offs[-1]`` come out zero, and their gradients are zero.

With ``fp8`` set (``formats.QuantizedExperts``, or 4 bits' ``formats.Fp4Experts``, a child
module holding its counter), the GEMMs run through ``fp8.mm(x, w, offs)`` instead, set by
``convert_to_quantized`` and ``apply_recipe`` through the converter registered below.
``freeze_for_serving`` (fp8) then holds both weights as fp8 codes and steps (buffers
``gate_up_fp8``, ``gate_up_step``, ``down_fp8``, ``down_step``; ``formats.ops.grouped_frozen``)
and drops the parameters, as ``QuantizedLinear.freeze_for_serving`` does: the forward
multiplies the held codes as they are, only the rows are quantized.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Self

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from computectx.activations import SaveMode
from computectx.ctx import BuiltUnder, ComputeCtx
from computectx.dtypes import FLOAT_DTYPES, FP8_DTYPES
from computectx.formats import (
    Fp4Experts,
    FrozenFp4Experts,
    QuantizedExperts,
    ServingWeight,
    register_experts_converter,
)
from computectx.formats.seam import (
    ActivationAmax,
    ServeMode,
    check_grouped,
    checked_bounds,
    freeze_experts,
    freeze_fp4_experts,
    frozen_experts_mm,
    guard_whole_loads,
    held_experts,
)
from computectx.nn.checks import checked_count
from computectx.nn.gemm import Gemm, GemmPath, input_kept, keep_input
from computectx.nn.params import param_dtype
from computectx.saved import SAVING, kept_back, offload_kept, refuse_double_backward, saved_call

__all__ = ["GroupedExperts", "grouped_linear"]


class GroupedExperts(BuiltUnder, nn.Module):
    """``E`` SwiGLU experts: ``down[e] @ (silu(gate[e] @ x) * (up[e] @ x))`` for each row ``x``
    of expert ``e``'s group.

    Parameters, at ``param_dtype(ctx)``: ``gate_up`` ``(E, 2 * hidden, dim)`` (rows
    ``:hidden`` are the gate, rows ``hidden:`` the up projection: transformers'
    ``gate_up_proj`` layout) and ``down`` ``(E, dim, hidden)``. ``forward(x_sorted, offs)``
    takes rows sorted by expert and ``offs``, int32 ``(E,)`` cumulative end offsets
    (``F.grouped_mm``'s convention), and returns ``(M, dim)`` at ``ctx.compute``.

    ``fp8`` is ``None`` (high precision) or the ``QuantizedExperts``/``Fp4Experts`` its GEMMs
    run through, set at construction under a quantized ctx (``apply_recipe``).
    ``freeze_for_serving`` holds the weights as fp8 codes instead (``frozen``), or, 4-bit, as
    a ``FrozenFp4Experts`` in ``fp8``'s place."""

    NAMES = ("gate_up", "down")

    fp8: QuantizedExperts | Fp4Experts | FrozenFp4Experts | None

    def __init__(self, ctx: ComputeCtx, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        dim = checked_count("GroupedExperts", "dim", dim, 1)
        hidden = checked_count("GroupedExperts", "hidden", hidden, 1)
        n_experts = checked_count("GroupedExperts", "n_experts", n_experts, 1)
        if not isinstance(ctx, ComputeCtx):
            raise TypeError(f"GroupedExperts takes a ComputeCtx, got {type(ctx).__name__}")
        self.ctx = ctx
        self.dim, self.hidden, self.n_experts = dim, hidden, n_experts
        dt = param_dtype(ctx)
        self.gate_up = nn.Parameter(
            torch.empty(n_experts, 2 * hidden, dim, device=ctx.device, dtype=dt)
        )
        self.down = nn.Parameter(torch.empty(n_experts, dim, hidden, device=ctx.device, dtype=dt))
        self.fp8 = None
        self.path = Gemm.for_ctx(ctx).path
        self.save = ctx.activations.linear  # read once, as the path: what the GEMMs keep of x
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initializes a weight: uniform in ``±1/sqrt(in)``."""
        with torch.no_grad():
            self.gate_up.uniform_(-1 / math.sqrt(self.dim), 1 / math.sqrt(self.dim))
            self.down.uniform_(-1 / math.sqrt(self.hidden), 1 / math.sqrt(self.hidden))

    def extra_repr(self) -> str:
        fp8 = f", fp8={self.fp8}" if isinstance(self.fp8, QuantizedExperts) else ""  # not a child
        return f"n_experts={self.n_experts}, dim={self.dim}, hidden={self.hidden}{fp8}"

    @property
    def frozen(self) -> bool:
        """Whether the weights are held as fp8 or 4-bit codes (``freeze_for_serving``)."""
        four = isinstance(self.fp8, FrozenFp4Experts)
        return four or self._buffers.get("gate_up_fp8") is not None

    def freeze_for_serving(
        self,
        weights: Mapping[str, ServingWeight] | None = None,
        *,
        mode: ServeMode = "weight_only",
        activation_amax: ActivationAmax = "per_row",
    ) -> Self:
        """Hold ``gate_up`` and ``down`` as fp8 codes and steps, dropping the parameters.

        The twin of ``QuantizedLinear.freeze_for_serving`` (``formats.ops.grouped_frozen``):
        without ``weights`` the codes are those the grouped forward makes of each expert
        under ``fp8``'s recipe, so the output stays the same bit for bit; ``weights``, a
        ``ServingWeight`` of ``[E, N, K]`` for each of ``"gate_up"`` and ``"down"`` in the
        recipe's layout and forward format on the module's device, is copied bit for bit
        instead (also into frozen experts); else ``TypeError``/``ValueError`` naming what was
        given and what the module takes, nothing changed. Later calls quantize only the rows;
        the input gradient flows (from the codes where the layout transposes, else their
        float32 dequantization), the weights no longer train.

        4-bit experts (``fp8`` an ``Fp4Experts``) become a ``FrozenFp4Experts`` served by
        ``mode`` (``"weight_only"``: dequantized, this module's grouped GEMM; ``"w4a4"``) and
        ``activation_amax`` (``formats.linear.fp4_frozen_experts``: ``freeze_fp4_experts``).
        ``ValueError`` for experts in high precision. Returns ``self``."""
        if isinstance(self.fp8, Fp4Experts | FrozenFp4Experts):
            freeze_fp4_experts(self, self.expert_weights(), weights, mode, activation_amax)
            return self
        if mode != "weight_only" or activation_amax != "per_row":
            raise ValueError(
                f"GroupedExperts.freeze_for_serving: mode and activation_amax are 4-bit "
                f"experts' (got {mode!r}, {activation_amax!r}); fp8 experts serve W8A8"
            )
        if not isinstance(self.fp8, QuantizedExperts):
            now = "in high precision" if self.fp8 is None else f"under {self.fp8.recipe}"
            raise ValueError(
                f"GroupedExperts.freeze_for_serving: the experts run {now}, not fp8 or 4-bit; "
                f"convert them first under an fp8 or 4-bit recipe (convert_to_quantized, or an "
                f"MoE built under such a ctx). Nothing was changed"
            )
        freeze_experts(self, self.fp8, self.expert_weights(), weights)
        guard_whole_loads(self)  # load_state_dict checks the codes and steps before any load
        return self

    def expert_weights(self) -> dict[str, torch.Tensor]:
        """``gate_up`` and ``down`` by name: the parameters, or a frozen module's codes."""
        if isinstance(self.fp8, FrozenFp4Experts):
            return {n: self.fp8.held(n)[0] for n in self.NAMES}
        frozen = self.frozen
        out: dict[str, torch.Tensor] = {}
        for n in self.NAMES:
            w = self._buffers.get(n + "_fp8") if frozen else getattr(self, n)
            assert isinstance(w, torch.Tensor)
            out[n] = w
        return out

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        # One check for every path (the quantized GEMMs' own): the same inputs, the same
        # message. Compiled, a quantized operator reads offs itself (a ValueError naming the
        # entry), so only the high-precision path needs the device check.
        if isinstance(self.fp8, FrozenFp4Experts):
            return self._serve_fp4(self.fp8, x, offs)
        gate_up, down = self._weight("gate_up"), self._weight("down")
        held = isinstance(gate_up, ServingWeight)
        w = gate_up.codes if isinstance(gate_up, ServingWeight) else gate_up
        accepted = FP8_DTYPES if held else None
        check_inputs(x, w, offs, "GroupedExperts", device_check=self.fp8 is None, w_dtypes=accepted)
        with self.ctx.autocast():
            x = self.ctx.to_compute(x)
            h = self._mm(x, gate_up, offs)
            act = _act_fn(self.ctx, h[:, : self.hidden], h[:, self.hidden :])
            return self.ctx.to_compute(self._mm(act, down, offs))

    def _serve_fp4(
        self, four: FrozenFp4Experts, x: torch.Tensor, offs: torch.Tensor
    ) -> torch.Tensor:
        # Frozen 4-bit experts: weight-only through this module's high-precision grouped GEMM
        # on the dequantized weights (_grouped_hp), W4A4 through their operator.
        with self.ctx.autocast():
            x = self.ctx.to_compute(x)
            h = four.mm(x, "gate_up", offs, self._grouped_hp)
            act = _act_fn(self.ctx, h[:, : self.hidden], h[:, self.hidden :])
            return self.ctx.to_compute(four.mm(act, "down", offs, self._grouped_hp))

    def _grouped_hp(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        check_inputs(x, w, offs, "GroupedExperts")
        return _grouped_linear(x, w, offs, self.path, self.save)

    def _weight(self, name: str) -> torch.Tensor | ServingWeight:
        # The parameter, or frozen experts' codes (read without leaving this module when
        # there are none).
        fp8 = self.fp8 if isinstance(self.fp8, QuantizedExperts) and self.frozen else None
        held = held_experts(self, name, fp8) if fp8 is not None else None
        if held is not None:
            return held
        w: torch.Tensor = getattr(self, name)
        return w

    def _mm(
        self, x: torch.Tensor, w: torch.Tensor | ServingWeight, offs: torch.Tensor
    ) -> torch.Tensor:
        # What the GEMM keeps for the backward counts as "linear", whatever the mode.
        if torch.compiler.is_compiling():
            return self._gemm(x, w, offs)
        token = SAVING.set("linear")
        try:
            return self._gemm(x, w, offs)
        finally:
            SAVING.reset(token)

    def _gemm(
        self, x: torch.Tensor, w: torch.Tensor | ServingWeight, offs: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(w, ServingWeight):
            assert isinstance(self.fp8, QuantizedExperts)  # held codes come with their recipe
            return frozen_experts_mm(self.fp8, x, w, offs)
        # x kept as ctx.activations.linear says: as it is, as E4M3 rows or in host memory.
        if isinstance(self.fp8, QuantizedExperts | Fp4Experts):
            return self.fp8.mm(x, w, offs, self.save)
        return _grouped_linear(x, w, offs, self.path, self.save)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # Frozen codes and steps follow the module's device, never its dtype (as a frozen
        # linear's): fp8 counts as floating point, so .half() would widen the codes.
        names = [n + s for n in self.NAMES for s in ("_fp8", "_step")]
        held: dict[str, torch.Tensor] = {}
        for n in names:
            t = self._buffers.pop(n, None)
            if t is not None:
                held[n] = t
        try:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        finally:
            if held:
                device = fn(held["gate_up_step"]).device
                self._buffers.update({n: t.to(device) for n, t in held.items()})
        return self


HIGH_PRECISION: tuple[torch.dtype, ...] = (*FLOAT_DTYPES, torch.float64)


def check_inputs(
    x: object,
    w: object,
    offs: object,
    op: str,
    *,
    device_check: bool = True,
    w_dtypes: tuple[torch.dtype, ...] | None = None,
) -> None:
    """The grouped GEMM's input check (``check_grouped``, the quantized paths' too) and
    ``offs``' values: non-decreasing end rows in ``[0, M]``. Eager, a host read of ``offs``
    and a ``ValueError`` naming the first bad entry; compiled (a host read would break the
    graph), a device check (``torch._assert_async``: a ``RuntimeError`` on the CPU, a
    device-side assertion on an accelerator), never rows computed from bad ``offs``;
    ``device_check=False`` leaves that to an operator that reads ``offs`` itself (the
    quantized grouped GEMMs); ``w_dtypes``: frozen experts' codes."""
    m = check_grouped(x, w, offs, dtypes=HIGH_PRECISION, op=op, w_dtypes=w_dtypes)[0]
    assert isinstance(offs, torch.Tensor)
    if not torch.compiler.is_compiling():
        checked_bounds(offs, m)
    elif device_check and offs.numel():
        before = torch.cat([offs.new_zeros(1), offs[:-1]])
        ok = ((offs >= before) & (offs <= m)).all()
        torch._assert_async(
            ok, f"{op}: offs must be non-decreasing end rows in [0, M] (the rows of x)"
        )


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, path: GemmPath
) -> torch.Tensor:
    """Row ``i`` of group ``g`` (``offs[g-1] <= i < offs[g]``) times ``w[g].T``, at ``x``'s
    dtype by ``path`` (see the module); ``w`` ``(E, N, K)`` is rounded to ``x``'s dtype first
    (what autocast does). Rows past ``offs[-1]`` are zero. Differentiable in ``x`` and ``w``.
    Bad inputs (``offs`` not int32 ``(E,)``, negative, decreasing or past ``M``; shapes,
    dtypes, devices) raise as ``quantized_grouped_mm`` does (``check_inputs``)."""
    check_inputs(x, w, offs, "grouped_linear")
    return _grouped_linear(x, w, offs, path)


def _grouped_linear(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, path: GemmPath, save: SaveMode = "keep"
) -> torch.Tensor:
    dtype = x.dtype
    work = torch.float32 if path is GemmPath.UPCAST and dtype != torch.float64 else dtype
    if _grouped_mm_runs(work, x.device):
        w = w if save != "keep" else _experts_at(w, offs, dtype)  # else the parameter kept
        out: torch.Tensor = _GroupedMM.apply(x, w, offs, work, save)  # type: ignore[no-untyped-call]
        return out
    w = w if w.dtype == dtype else w.to(dtype)
    if _grouped_mm_runs(dtype, x.device):
        # Inside torch.compile on the CPU: bf16's own grouped_mm (float32 accumulation, one
        # rounding, as UPCAST) rather than the dense twin.
        out = _GroupedMM.apply(x, w, offs, dtype, save)  # type: ignore[no-untyped-call]
        return out
    return _dense_twin(x, w, offs, work)


def _experts_at(w: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w`` at ``dtype`` for a grouped GEMM over ``offs``' groups.

    When nothing records a graph (``no_grad``, the decode path) and outside ``torch.compile``,
    only the experts that have rows are converted, the others left uninitialized
    (``F.grouped_mm`` never reads an empty group's weight): a memory-mapped expert no token
    chose is not read (``Residency.MMAP``). Otherwise, and on an accelerator (where a copy
    per expert and a host read of ``offs`` cost more), the whole weight (autograd's cast)."""
    if w.dtype == dtype:
        return w
    if (
        w.device.type != "cpu"
        or torch.compiler.is_compiling()
        or (torch.is_grad_enabled() and w.requires_grad)
    ):
        return w.to(dtype)
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    for e in counts.nonzero().flatten().tolist():
        out[e].copy_(w[e])
    return out


def _grouped_mm_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``F.grouped_mm`` takes ``dtype`` operands here (bf16 everywhere; float32 and
    float16 on the CPU in eager mode)."""
    if dtype == torch.bfloat16:
        return True
    return (
        dtype in (torch.float32, torch.float16)
        and device.type == "cpu"
        and not torch.compiler.is_compiling()
    )


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return nn.functional.pad(t, pad)


def _grouped(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(a, w.mT)`` for ``a`` ``(M, K)`` and ``w`` ``(E, N, K)``, the widths padded
    with zeros to 16 bytes and cut back: ``(M, N)``."""
    multiple = 16 // a.element_size()
    n = w.shape[1]
    if a.shape[0] == 0:  # grouped_mm refuses an empty operand
        return a.new_zeros((0, n))
    a = _pad_to(a.contiguous(), 1, multiple)
    w = _pad_to(_pad_to(w, 2, multiple), 1, multiple)
    y = nn.functional.grouped_mm(a, w.transpose(-2, -1), offs=offs)
    return y[:, :n] if y.shape[1] != n else y


def _grouped_wgrad(g: torch.Tensor, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``(E, N, K)``: group ``e``'s ``g_e.T @ a_e`` (zero for an empty group)."""
    multiple = 16 // a.element_size()
    n, k = g.shape[1], a.shape[1]
    if a.shape[0] == 0:  # no rows: every expert's gradient is zero
        return a.new_zeros((offs.shape[0], n, k))
    g = _pad_to(g.contiguous(), 1, multiple)
    a = _pad_to(a.contiguous(), 1, multiple)
    dw = nn.functional.grouped_mm(g.t(), a, offs=offs)
    return dw[:, :n, :k] if dw.shape[1:] != (n, k) else dw


def _zero_tail(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # grouped_mm leaves rows past offs[-1] unwritten (whatever the memory held).
    rows = torch.arange(y.shape[0], device=y.device)
    return y.masked_fill_((rows >= offs[-1]).unsqueeze(1), 0)


class _GroupedMM(torch.autograd.Function):
    """``grouped_linear`` through ``F.grouped_mm`` at ``work`` (the operands widened exactly
    when ``work`` is wider), each result rounded once to the operands' dtype."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        offs: torch.Tensor,
        work: torch.dtype,
        save: SaveMode,
    ) -> torch.Tensor:
        # linear: fp8 keeps x as E4M3 rows, only for dW; offload in host memory (a CPU: as it is).
        c: Any = ctx
        kept = keep_input(x) if save == "fp8" and c.needs_input_grad[1] else (x,)
        kept = offload_kept(ctx, kept) if save == "offload" else kept
        ctx.save_for_backward(*kept, w, offs)
        c.work, c.like, c.save = work, (x.shape, x.dtype), save
        with torch.autocast(x.device.type, enabled=False):
            y = _grouped(x.to(work), _experts_at(_experts_at(w, offs, x.dtype), offs, work), offs)
        return _zero_tail(y, offs).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refuse_double_backward("linear", ctx.save)  # x as codes or a host copy: first-order
        *kept, w, offs = ctx.saved_tensors
        x, work = input_kept(kept_back(ctx, tuple(kept)), *ctx.like), ctx.work
        needs = ctx.needs_input_grad
        gx = gw = None
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.to(work)
            if needs[0]:
                wt = w.to(x.dtype).to(work).transpose(-2, -1)  # w at x's dtype, then widened
                gx = _zero_tail(_grouped(g, wt, offs), offs).to(x.dtype)
            if needs[1]:
                gw = _grouped_wgrad(g, x.to(work), offs).to(x.dtype).to(w.dtype)
        return gx, gw, None, None, None


def _dense_twin(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, work: torch.dtype
) -> torch.Tensor:
    """``grouped_linear`` where ``grouped_mm`` does not run: every row against every expert in
    one GEMM at ``work``, each row keeping its own expert's columns, one rounding."""
    m, (e, n, k) = x.shape[0], w.shape
    rows = torch.arange(m, device=x.device)
    group = torch.searchsorted(offs, rows.to(offs.dtype), right=True)  # E past offs[-1]
    with torch.autocast(x.device.type, enabled=False):
        every = (x.to(work) @ w.to(work).reshape(e * n, k).t()).view(m, e, n)
        pick = group.clamp(max=e - 1).view(m, 1, 1).expand(m, 1, n)
        y = every.gather(1, pick).squeeze(1)
        y = torch.where((group < e).unsqueeze(1), y, torch.zeros((), dtype=work, device=x.device))
    return y.to(x.dtype)


class _GroupedExpertsConverter:
    """How ``convert_to_quantized`` finds and converts a ``GroupedExperts``."""

    serves_frozen = True  # the forward reads frozen codes (``freeze_for_serving``)
    runs_fp4 = True  # convert takes an Fp4Experts (formats.convert_experts)

    def weights(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        return module.expert_weights() if isinstance(module, GroupedExperts) else None

    def current(self, module: nn.Module) -> QuantizedExperts | None:
        fp8 = module.fp8 if isinstance(module, GroupedExperts) else None
        return fp8 if isinstance(fp8, QuantizedExperts) else None

    def convert(self, module: nn.Module, fp8: QuantizedExperts | Fp4Experts | None) -> None:
        if isinstance(module, GroupedExperts):
            if module.frozen:
                raise ValueError(
                    "GroupedExperts frozen for serving hold fp8 or 4-bit codes, no weights to run "
                    "another way; convert a copy made before freezing"
                )
            if "fp8" in module._modules:  # an Fp4Experts child: unregistered, any value fits
                del module.fp8
            module.fp8 = fp8


register_experts_converter(_GroupedExpertsConverter())


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return nn.functional.silu(gate) * up


def _act_fn(ctx: ComputeCtx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # nn.mlp.swiglu, inline: under the default (keep) the forward enters no other module.
    policy = ctx.activations
    if policy.act_fn != "keep":
        mode, group = policy.act_fn, policy.group
        return saved_call(_swiglu, gate, up, mode=mode, group=group, inputs=2, kind="act_fn")
    if torch.compiler.is_compiling():
        return _swiglu(gate, up)
    token = SAVING.set("act_fn")
    try:
        return _swiglu(gate, up)
    finally:
        SAVING.reset(token)
