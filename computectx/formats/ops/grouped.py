"""The grouped fp8 operators of mixture-of-experts layers, and ``quantized_grouped_mm``, their
differentiable entry point.

======================================  =========================================================
operator                                semantics
======================================  =========================================================
``quantized_grouped_mm``                      each row group times its own matrix, in fp8
``fp8_held_grouped_mm``                 the same, the matrices held as codes (frozen experts)
``fp8_grouped_wgrad``                   each group's ``dYᵀ X`` over its own rows, in fp8
======================================  =========================================================

``quantized_grouped_mm(x, w, offs, policy)`` computes, for tokens sorted by expert, each group's
rows ``x[rows of g] · w[g]ᵀ`` in fp8, with ``w [E, N, K]`` stored as ``nn.Linear`` stores a
weight (out x in; transformers' ``gate_up_proj``/``down_proj``, torchtitan's ``w1``/``w2``/
``w3``) and ``offs`` each group's end row (int32, ``F.grouped_mm``'s convention). Each group
is the dense fine-grained linear (``linear.blockwise``) on its own rows, GEMM for GEMM:

================  ====================  ======================  ====================
GEMM              operands              ``block``               contraction
================  ====================  ======================  ====================
forward ``Y_g``   ``X_g``, ``W_g``      1x128, 128x128          K
dgrad ``dX_g``    ``dY_g``, ``W_gᵀ``    1x128, 128x128 (same    N
                                        blocks, transposed)
wgrad ``dW_g``    ``dY_gᵀ``, ``X_gᵀ``   1x128, 1x128            the group's own rows
================  ====================  ======================  ====================

``row`` and ``mx`` quantize every operand along its contraction (row-wise / 1x32);
``row+gw_hp`` computes ``dW_g`` in float32 from the unquantized ``dY_g`` and ``X_g``;
``tensor`` takes one step per group's rows and one per expert. X and W are quantized in the
policy's forward format, dY in its backward format, every step dynamic (experts keep no
scaling history; a delayed policy's experts run dynamically, with its ``margin``). The GEMMs
write ``x``'s dtype (bf16/fp16 rounded once from the float32 sum; float32 otherwise); ``dW``
is float32 until it reaches ``w``'s dtype.

``grouped_mm_op`` quantizes the experts (``quantize_experts``), then ``held_grouped_mm`` the
rows and multiplies: frozen experts' codes take that half as an operator, ``held_grouped_mm_op``.

``check_grouped`` is what the entry point checks before anything runs (no data is read);
``checked_bounds`` reads ``offs``' values inside the operators, so a compiled call checks
them as an eager one does, and ``offs`` is data, never a guard. Backends: ``REFERENCE`` the
float32 twin (``numerics.grouped``); ``TRITON`` the operands quantized as the twin quantizes
them, then one launch of the grouped kernel (``computectx.kernels.grouped_mm``,
``kernels.grouped_wgrad``), which finds each tile's group from ``offs`` on the device;
``CUBLAS`` ``F.scaled_grouped_mm`` for the row-wise recipe on CUDA (``kernels.cublas``), else
as ``TRITON`` where Triton runs, else the twin."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.library import custom_op

from computectx._checks import shown_ints
from computectx.activations import SaveMode
from computectx.dtypes import FLOAT_DTYPES, Fp8Format
from computectx.formats.backend import (
    Backend,
    check_backend,
    default_backend,
    parse_backend,
    uses_kernels,
)
from computectx.formats.numerics import grouped
from computectx.formats.numerics.layouts import (
    MX_BLOCK,
    OPERAND_GRANULARITY,
    Granularity,
    StepRule,
    step_rule_of,
)
from computectx.formats.ops import grouped_wgrad
from computectx.formats.ops.blockwise import quantize_blocks
from computectx.formats.ops.grouped_wgrad import GemmHow, quantize_experts
from computectx.formats.policy import describe
from computectx.recipes import Recipe
from computectx.saved import (
    decode_groups,
    encode_groups,
    kept_back,
    offload_kept,
    refuse_double_backward,
)

__all__ = [
    "GemmHow",
    "GroupedPlan",
    "QuantizedExperts",
    "check_grouped",
    "checked_bounds",
    "grouped_mm_op",
    "grouped_operands",
    "grouped_wgrad_op",
    "held_grouped_mm",
    "held_grouped_mm_op",
    "outside_autocast",
    "quantized_grouped_mm",
]


def check_grouped(
    x: object,
    w: object,
    offs: object,
    *,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    op: str = "quantized_grouped_mm",
    w_dtypes: tuple[torch.dtype, ...] | None = None,
) -> tuple[int, int, int, int]:
    """``(M, K, E, N)`` of a grouped GEMM's operands, or ``TypeError``/``ValueError``: ``x
    [M, K]`` and ``w [E, N, K]`` of ``dtypes`` (``w``: ``w_dtypes`` when given, frozen
    experts' codes) on one device, ``offs`` int32 ``[E]`` there (values:
    ``checked_bounds``). The fp8 GEMM and the high-precision grouped experts
    (``computectx.nn.GroupedExperts``) both call it: same inputs refused, same message."""
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(
            f"{op} takes tensors x [M, K] and w [E, N, K], got "
            f"{type(x).__name__} and {type(w).__name__}"
        )
    if not isinstance(offs, torch.Tensor):
        raise TypeError(
            f"offs must be an int32 tensor of each group's end row, got {type(offs).__name__}"
        )
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"{op} takes x [M, K] (2-D) and w [E, N, K] (3-D: one [N, K] matrix per "
            f"group, as nn.Linear stores a weight), got x {tuple(x.shape)}, w {tuple(w.shape)}"
        )
    for name, t, accepted in (("x", x, dtypes), ("w", w, w_dtypes or dtypes)):
        if t.dtype not in accepted:
            names = ", ".join(str(d).removeprefix("torch.") for d in accepted)
            raise TypeError(f"{name} must be one of {names} for {op}, got {t.dtype}")
    m, k = x.shape
    e, n, kw = w.shape
    if kw != k:
        raise ValueError(f"x is [M, K] = {tuple(x.shape)} but w[g] is [N, K] = ({n}, {kw})")
    if offs.dtype != torch.int32:
        raise TypeError(
            f"offs must be int32 (each group's end row, as F.grouped_mm takes it), got "
            f"{offs.dtype}; use offs.to(torch.int32)"
        )
    if e < 1:
        raise ValueError(f"w must hold at least one group, got shape {tuple(w.shape)}")
    if offs.dim() != 1 or offs.shape[0] != e:
        raise ValueError(
            f"offs must be 1-D with one end row per group (w has E = {e} groups), got shape "
            f"{tuple(offs.shape)}"
        )
    if not (x.device == w.device == offs.device):
        raise ValueError(
            f"x, w and offs must be on one device, got {x.device}, {w.device}, {offs.device}"
        )
    return m, k, e, n


def checked_bounds(offs: torch.Tensor, m: int, experts: int | None = None) -> list[tuple[int, int]]:
    """Each group's ``(start, end)`` rows from ``offs``; ``ValueError`` naming the first bad
    end (negative, below the one before, past ``m`` rows), or ``offs`` not int32 ``(experts,)``."""
    if experts is not None and (offs.dtype, tuple(offs.shape)) != (torch.int32, (experts,)):
        raise ValueError(
            f"offs must be int32 ({experts},), one end row per expert of the weight's "
            f"{experts}, got {offs.dtype} {tuple(offs.shape)}"
        )
    bounds = grouped.bounds_of(offs)
    prev = 0
    for g, (_, end) in enumerate(bounds):
        if end < prev:
            what = "negative" if end < 0 else f"below offs[{g - 1}] = {prev}"
            raise ValueError(
                f"offs must be non-decreasing end rows in [0, M = {m}]; offs[{g}] = {end} is "
                f"{what} (offs = {shown_ints(offs)})"
            )
        if end > m:
            raise ValueError(
                f"offs[{g}] = {end} is past the {m} rows of x; the ends must be in "
                f"[0, M = {m}] (offs = {shown_ints(offs)})"
            )
        prev = end
    return bounds


@custom_op("computectx::fp8_grouped_mm", mutates_args=())
def grouped_mm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    granularity_a: str,
    granularity_b: str,
    fp8_a: torch.dtype,
    fp8_b: torch.dtype,
    rule: str,
    margin: int,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows of ``a [M, K]`` times ``b[g]ᵀ`` (``b [E, N, K]``), each
    operand quantized dynamically at its granularity (module docstring)."""
    bounds = checked_bounds(offs, a.shape[0], b.shape[0])
    ga, gb, chosen = _g(granularity_a), _g(granularity_b), parse_backend(backend)
    fa, fb, r = Fp8Format.parse(fp8_a), Fp8Format.parse(fp8_b), _rule(rule)
    cublas = _cublas_rows(chosen, ga, a, out_dtype)
    if not cublas and not uses_kernels(chosen, a):
        return grouped.reference_grouped_mm(a, b, bounds, ga, gb, fa, fb, r, margin, out_dtype)
    if ga == "mx" and a.shape[1] < MX_BLOCK:
        # A contraction shorter than one MX block (K < 32 forward, N < 32 in the dgrad) is
        # zero-padded to one block, as the twin pads it: exact, since a zero changes no amax
        # and adds nothing to a dot product.
        pad = (0, MX_BLOCK - a.shape[1])
        a, b = torch.nn.functional.pad(a, pad), torch.nn.functional.pad(b, pad)
    quantizer = Backend.TRITON if cublas else chosen
    experts = [g for g, (start, end) in enumerate(bounds) if end > start]
    qb, sb = quantize_experts(b, fb, gb, r, margin, quantizer, experts)
    return held_grouped_mm(a, qb, sb, offs, (ga, gb, fa, r, margin, out_dtype, chosen), bounds)


def _cublas_rows(chosen: Backend, ga: Granularity, a: torch.Tensor, out: torch.dtype) -> bool:
    return chosen is Backend.CUBLAS and ga == "row" and a.is_cuda and out == torch.bfloat16


def held_grouped_mm(
    a: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    how: GemmHow,
    bounds: list[tuple[int, int]],
) -> torch.Tensor:
    """``[M, N]``: the grouped GEMM of ``a`` (quantized here) by experts already quantized,
    the codes ``qb [E, N, K]`` and their scales ``sb`` (``(E,)`` for ``tensor``, else
    ``(E, *grid)``; ``mx``'s E8M0) used as they are; ``bounds`` are ``offs``' checked
    ones. An expert whose group is empty is never read."""
    ga, gb, fa, r, margin, out_dtype, chosen = how
    if _cublas_rows(chosen, ga, a, out_dtype):
        from computectx.kernels import cublas

        qa, sa = quantize_blocks(a, fa, "row", r, None, backend=Backend.TRITON)
        return cublas.grouped_rowwise_mm(qa=qa, sa=sa, qb=qb, sb=sb, offs=offs, out_dtype=out_dtype)
    if not uses_kernels(chosen, a):
        return grouped.reference_held_grouped_mm(
            a, qb, sb, bounds, ga, gb, fa, r, margin, out_dtype
        )
    return grouped_wgrad.kernel_held_mm(a, qb, sb, offs, how, bounds)


@custom_op("computectx::fp8_held_grouped_mm", mutates_args=())
def held_grouped_mm_op(
    a: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    granularity_a: str,
    granularity_b: str,
    fp8_a: torch.dtype,
    rule: str,
    margin: int,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``held_grouped_mm`` as an operator (frozen experts' GEMM): ``offs`` is read inside
    (``checked_bounds``), so a compiled call guards on none of its values, as with
    ``fp8_grouped_mm``, and only ``a``'s quantize and the GEMM run in the operator."""
    bounds = checked_bounds(offs, a.shape[0], qb.shape[0])
    fa, r, chosen = Fp8Format.parse(fp8_a), _rule(rule), parse_backend(backend)
    how = (_g(granularity_a), _g(granularity_b), fa, r, margin, out_dtype, chosen)
    return held_grouped_mm(a, qb, sb, offs, how, bounds)


@grouped_mm_op.register_fake
@held_grouped_mm_op.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
    # The output is (M, N) at out_dtype, the last but one argument of both operators.
    out_dtype: Any = rest[-2]
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@custom_op("computectx::fp8_grouped_wgrad", mutates_args=())
def grouped_wgrad_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    offs: torch.Tensor,
    granularity: str,
    fp8_dy: torch.dtype,
    fp8_x: torch.dtype,
    rule: str,
    margin: int,
    high_precision: bool,
    backend: str,
) -> torch.Tensor:
    """float32 ``[E, N, K]``: ``dY[rows of g]ᵀ X[rows of g]`` over each group's own rows
    (``high_precision``: ``gw_hp``'s float32 product)."""
    bounds = checked_bounds(offs, dy.shape[0])
    g, chosen, r = _g(granularity), parse_backend(backend), _rule(rule)
    fd, fx = Fp8Format.parse(fp8_dy), Fp8Format.parse(fp8_x)
    if high_precision or not uses_kernels(chosen, dy):
        return grouped.reference_grouped_wgrad(dy, x, bounds, g, fd, fx, r, margin, high_precision)
    return grouped_wgrad.kernel_wgrad(dy, x, offs, bounds, g, (fd, fx), r, margin, chosen)


@grouped_wgrad_op.register_fake
def _grouped_wgrad_fake(
    dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, *_: object
) -> torch.Tensor:
    return dy.new_empty((offs.shape[0], dy.shape[1], x.shape[1]), dtype=torch.float32)


def _g(granularity: str) -> Granularity:
    return granularity  # type: ignore[return-value]  # checked by the entry point


def _rule(rule: str) -> StepRule:
    return rule  # type: ignore[return-value]  # step_rule_of's


# ---------------------------------------------------------------------------------------
# The differentiable entry point.


def grouped_operands(policy: Recipe) -> tuple[Granularity, Granularity]:
    """The ``(activation, weight)`` granularities of ``policy``'s grouped GEMMs."""
    if policy.granularity == "tensor":
        return "tensor", "tensor"
    return OPERAND_GRANULARITY[policy.granularity]


@dataclass(frozen=True)
class GroupedPlan:
    """What a policy asks of the grouped GEMMs, read once: plain values the operators take."""

    act: Granularity
    weight: Granularity
    fwd: torch.dtype
    bwd: torch.dtype
    rule: StepRule
    margin: int
    gw_hp: bool

    @staticmethod
    def of(policy: Recipe) -> GroupedPlan:
        act, weight = grouped_operands(policy)
        fwd, bwd = policy.format.forward.torch, policy.format.backward.torch
        rule, margin = step_rule_of(policy), policy.scaling.margin
        return GroupedPlan(act, weight, fwd, bwd, rule, margin, policy.gw_hp)

    def gemm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        offs: torch.Tensor,
        fmt_a: torch.dtype,
        like: torch.dtype,
        backend: str,
    ) -> torch.Tensor:
        """``grouped_mm_op`` of ``a`` at ``fmt_a`` by the experts ``b`` at the forward format,
        at ``like`` if it is a 16-bit dtype (else float32)."""
        out = like if like in (torch.bfloat16, torch.float16) else torch.float32
        args = (self.act, self.weight, fmt_a, self.fwd, self.rule, self.margin, out, backend)
        y: torch.Tensor = grouped_mm_op(a, b, offs, *args)
        return y


class _GroupedMmFunction(torch.autograd.Function):
    """``Y[rows of g] = X[rows of g] W[g]ᵀ`` in fp8 and its two gradients (module docstring)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        offs: torch.Tensor,
        plan: GroupedPlan,
        backend: Backend,
        save: SaveMode = "keep",
    ) -> torch.Tensor:
        y = plan.gemm(x, w, offs, plan.fwd, x.dtype, backend.value)
        # linear: fp8 keeps x as E4M3 codes with a float32 scale per row (nn.gemm.keep_input),
        # which the wgrad quantizes again per group as it would x (docs/activations.md);
        # offload keeps x in host memory (as it is on a CPU).
        c: Any = ctx
        coded = save == "fp8" and x.numel() > 0 and c.needs_input_grad[1]
        kept: tuple[torch.Tensor, ...] = encode_groups(x, x.shape[1]) if coded else (x,)
        kept = offload_kept(ctx, kept) if save == "offload" else kept
        ctx.save_for_backward(*kept, w, offs)
        c.plan, c.backend, c.like, c.save = plan, backend, (x.shape, x.dtype), save
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Under linear: fp8 or offload x comes back as codes or a host copy: refused by name.
        refuse_double_backward("linear", ctx.save, fp8_gemm=True)
        return _GroupedMmFunction.first_order(ctx, dy)

    @staticmethod
    @once_differentiable
    def first_order(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        p: GroupedPlan = ctx.plan
        backend: str = ctx.backend.value
        *saved, w, offs = ctx.saved_tensors
        kept = kept_back(ctx, tuple(saved))
        x = kept[0] if len(kept) == 1 else decode_groups(kept[0], kept[1], *ctx.like)
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # dX_g [m, K] = dY_g [m, N] · W_g [N, K]: W_gᵀ [K, N] contracted over N.
            dx = p.gemm(dy, w.transpose(1, 2), offs, p.bwd, x.dtype, backend).to(x.dtype)
        if ctx.needs_input_grad[1]:
            # dW_g [N, K] = dY_gᵀ · X_g over the group's own rows, float32 until w's dtype.
            dw = grouped_wgrad_op(
                dy, x, offs, p.act, p.bwd, p.fwd, p.rule, p.margin, p.gw_hp, backend
            ).to(w.dtype)
        return dx, dw, None, None, None, None


def outside_autocast(function: type[torch.autograd.Function], x: torch.Tensor, *args: Any) -> Any:
    """``function.apply(x, *args)``, under ``torch.autocast`` for ``x``'s device with ``x`` at
    the autocast dtype and autocast off (the grouped GEMMs choose their own dtypes)."""
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            x = x.to(torch.get_autocast_dtype(device))
            return function.apply(x, *args)  # type: ignore[no-untyped-call]
    return function.apply(x, *args)  # type: ignore[no-untyped-call]


def quantized_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    policy: Recipe,
    *,
    backend: Backend | str | None = None,
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows ``x[offs[g-1]:offs[g]] · w[g]ᵀ`` in fp8 under
    ``policy`` (module docstring), differentiable in ``x`` and ``w``.

    ``x`` is ``[M, K]`` (rows sorted by group), ``w`` ``[E, N, K]``, ``offs`` int32 ``[E]``
    of non-decreasing end rows in ``[0, M]``; groups may be empty and of any size, and rows
    past ``offs[-1]`` come out zero. The result has ``x``'s dtype, or under ``torch.autocast``
    for ``x``'s device the autocast dtype. ``backend`` defaults to the device's
    (``default_backend``). Wrong shapes, dtypes or devices raise ``TypeError``/``ValueError``
    before anything runs; bad ``offs`` values (negative, decreasing, past ``M``) raise
    ``ValueError`` naming the entry when the operator runs.
    """
    if not isinstance(policy, Recipe):
        raise TypeError(f"quantized_grouped_mm takes a Recipe (ctx.recipe), got {describe(policy)}")
    check_grouped(x, w, offs)
    chosen = default_backend(x.device) if backend is None else parse_backend(backend)
    check_backend(chosen, x, w)
    out: torch.Tensor = outside_autocast(
        _GroupedMmFunction, x, w, offs, GroupedPlan.of(policy), chosen
    )
    return out


@dataclass(frozen=True)
class QuantizedExperts:
    """What a converted experts module runs its GEMMs with: a policy and a backend.

    ``convert_to_quantized`` stores one on each experts module it converts (through that module's
    ``ExpertsConverter``); the module's forward calls ``mm`` for each expert projection.
    """

    policy: Recipe
    backend: Backend
    plan: GroupedPlan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Checked when built, not at the first GEMM: a Recipe (``ctx.recipe``, not the ctx
        # or a flag) and a Backend member or its name (read as the member).
        if not isinstance(self.policy, Recipe):
            raise TypeError(
                f"QuantizedExperts takes a Recipe (ctx.recipe) as its policy, got "
                f"{describe(self.policy)}"
            )
        backend: object = self.backend
        if isinstance(backend, str) and not isinstance(backend, Backend):
            backend = parse_backend(backend)
        if not isinstance(backend, Backend):
            accepted = ", ".join(repr(b.value) for b in Backend)
            raise TypeError(
                f"QuantizedExperts takes a Backend as its backend (a member or one of "
                f"{accepted}), got {describe(backend)}"
            )
        object.__setattr__(self, "backend", backend)
        # The policy read once, here: each GEMM gets its plain values.
        object.__setattr__(self, "plan", GroupedPlan.of(self.policy))

    def mm(
        self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, save: SaveMode = "keep"
    ) -> torch.Tensor:
        """``quantized_grouped_mm(x, w, offs, self.policy, backend=self.backend)``; ``save``:
        how its backward keeps ``x`` (``ctx.activations.linear``: ``fp8`` as E4M3 rows,
        ``offload`` in host memory)."""
        check_grouped(x, w, offs)
        check_backend(self.backend, x, w)
        out: torch.Tensor = outside_autocast(
            _GroupedMmFunction, x, w, offs, self.plan, self.backend, save
        )
        return out
