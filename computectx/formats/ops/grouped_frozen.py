"""Converted experts frozen for serving: each expert weight held as fp8 codes and steps.

``QuantizedLinear.freeze_for_serving`` has this twin for a mixture-of-experts module's 3-D
expert weights. ``freeze_experts(module, experts, weights, given)`` holds each weight
``name`` of ``weights`` (``[E, N, K]`` as the grouped GEMM multiplies it: the converter's
``weights(module)``) as two buffers of ``module``, ``{name}_fp8`` (the codes ``[E, N, K]``,
contiguous, in the recipe's forward format) and ``{name}_step`` (their float32 dequantize
steps, ``weight ≈ codes * step``, laid out as a ``ServingWeight`` of experts:
``(E, 1)`` per tensor, ``(E, N, 1)`` per row, ``(E, ceil(N/128), ceil(K/128))`` per 128x128
block, ``(E, N, K/32)`` per MX group), and drops the high-precision parameter
(``register_parameter(name, None)``, as the linear drops its ``weight``). Without ``given``
the codes are those the grouped forward makes of each expert under the recipe
(``experts_serving_weight``: per tensor the step of the expert's own amax with the recipe's
margin, as the experts always quantize dynamically; otherwise the forward's block quantize
under its step rule), so a frozen module's output is the unfrozen one's bit for bit. Given
``ServingWeight``s are checked first (``ServingWeight.check_fits`` against ``[E, N, K]``, the
layout and the forward format) and copied bit for bit; a refused call changes nothing.

``frozen_experts_mm(experts, x, held, offs)`` is then the grouped GEMM: only ``x``'s rows
are quantized (``ops.grouped.held_grouped_mm_op``, ``computectx::fp8_held_grouped_mm``: the
GEMM half of ``computectx::fp8_grouped_mm``, an operator that reads ``offs`` inside, so a
compiled call guards on none of its values) and the held codes are multiplied as they are.
Its input gradient uses the codes too where the layout transposes (``tensor``: one step per
expert; ``128x128``: each block's codes and step transposed), so it is the unfrozen module's
bit for bit; ``row`` and ``mx`` quantize ``Wᵀ`` along ``N``, which their blocks do not
transpose into: from the codes times their steps in float32, as the frozen row linear does.
Nothing is recorded and there is no weight gradient.

A framework's experts forward chooses: ``held_experts(module, name, experts)`` is the held
weight (a ``ServingWeight`` of views) or ``None`` when ``name`` is not frozen.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from computectx.dtypes import FP8_DTYPES, Fp8Format
from computectx.formats.backend import Backend, check_backend
from computectx.formats.numerics import blockwise
from computectx.formats.ops.grouped import (
    GroupedPlan,
    QuantizedExperts,
    check_grouped,
    held_grouped_mm_op,
    outside_autocast,
)
from computectx.formats.ops.grouped_wgrad import quantize_experts
from computectx.formats.policy import refuse_sharded
from computectx.formats.serving import ServingWeight, check_state_entries, recipe_layout

__all__ = [
    "FROZEN_SUFFIXES",
    "check_frozen_load",
    "experts_serving_weight",
    "freeze_experts",
    "frozen_expert_buffers",
    "frozen_experts_mm",
    "held_experts",
]

FROZEN_SUFFIXES: Final = ("_fp8", "_step")
"""A frozen expert weight ``name``'s buffers: ``name + "_fp8"`` (codes), ``name + "_step"``."""


def experts_serving_weight(w: torch.Tensor, experts: QuantizedExperts) -> ServingWeight:
    """Experts ``w [E, N, K]`` as the codes and steps the grouped forward makes of them under
    ``experts``' recipe (module docstring); ``ValueError`` when the recipe has no layout."""
    plan, layout = experts.plan, recipe_layout(experts.policy)
    fmt = Fp8Format.parse(plan.fwd)
    with torch.inference_mode(False), torch.no_grad():
        codes, scale = quantize_experts(
            w.detach(), fmt, plan.weight, plan.rule, plan.margin, experts.backend
        )
        steps = scale.reshape(-1, 1) if layout == "tensor" else blockwise.steps_of_scale(scale)
    return ServingWeight(codes, steps, layout)


def held_experts(module: nn.Module, name: str, experts: QuantizedExperts) -> ServingWeight | None:
    """``module``'s frozen expert weight ``name`` (views of its two buffers), ``None`` when
    ``name`` is not frozen; ``ValueError`` when the buffers were cast (a module-wide
    ``.to(dtype)`` or ``.half()`` after freezing widens fp8 codes and rounds float32 steps)."""
    codes = module._buffers.get(name + FROZEN_SUFFIXES[0])
    if codes is None:
        return None
    steps = module._buffers.get(name + FROZEN_SUFFIXES[1])
    if steps is None or codes.dtype not in FP8_DTYPES or steps.dtype != torch.float32:
        got = "no steps" if steps is None else f"{codes.dtype} codes, {steps.dtype} steps"
        raise ValueError(
            f"{type(module).__name__}'s frozen expert weight {name!r} holds {got}: fp8 codes "
            f"and float32 steps were frozen (a .to(dtype) or .half() of the model after "
            f"freezing casts them); cast the model before freezing its experts"
        )
    return ServingWeight(codes, steps, recipe_layout(experts.policy))


def _check_given(
    given: object, who: str, weights: Mapping[str, torch.Tensor], experts: QuantizedExperts
) -> dict[str, ServingWeight]:
    # Every name given, each a ServingWeight that fits its weight: the refusals, before any change.
    if not isinstance(given, Mapping):
        raise TypeError(
            f"{who}.freeze_for_serving(weights=...) takes a mapping of expert weight names "
            f"({', '.join(weights)}) to ServingWeight, got {type(given).__name__}"
        )
    missing = [n for n in weights if n not in given]
    unknown = [str(n) for n in given if n not in weights]
    if missing or unknown:
        raise ValueError(
            f"{who}.freeze_for_serving(weights=...) takes one ServingWeight for each of its "
            f"expert weights {list(weights)}; not given: {missing or 'none'}; unknown: "
            f"{unknown or 'none'}. Nothing was changed"
        )
    policy, layout = experts.policy, recipe_layout(experts.policy)
    out = {}
    for name, w in weights.items():
        sw = given[name]
        if not isinstance(sw, ServingWeight):
            raise TypeError(
                f"{who}.freeze_for_serving(weights=...): {name!r} must be a ServingWeight, got "
                f"{type(sw).__name__}"
            )
        sw.check_fits(
            f"{who}'s expert weight {name!r} under policy {str(policy)!r}",
            policy.format.forward.torch,
            tuple(w.shape),
            layout,
            w.device,
            takes="serves with",
            given="freeze_for_serving was given",
        )
        out[name] = sw
    return out


def freeze_experts(
    module: nn.Module,
    experts: QuantizedExperts,
    weights: Mapping[str, torch.Tensor],
    given: Mapping[str, ServingWeight] | None = None,
) -> None:
    """Hold ``module``'s expert weights ``weights`` (name -> ``[E, N, K]`` as multiplied; a
    frozen module's codes) as codes and steps, dropping the parameters (module docstring).
    ``given``: the ``ServingWeight`` of every name, copied bit for bit; ``TypeError``/
    ``ValueError`` naming what was given and what the module takes otherwise, nothing
    changed. Without ``given`` a frozen weight stays as it is."""
    who = type(module).__name__
    refuse_sharded(f"{who}.freeze_for_serving", module)
    try:
        recipe_layout(experts.policy)
    except ValueError as e:
        raise ValueError(f"{who}.freeze_for_serving: {e}. Nothing was changed") from None
    for name in weights:
        for held in (name + s for s in FROZEN_SUFFIXES):
            if hasattr(module, held) and held not in module._buffers:
                raise ValueError(
                    f"{who}.freeze_for_serving: the module already has an attribute {held!r}, "
                    f"where the frozen codes of {name!r} go. Nothing was changed"
                )
    own = getattr(type(module), CHECK_LOAD, None)
    if own is not None:
        raise ValueError(
            f"{who}.freeze_for_serving: the module's class has a {CHECK_LOAD!r} of its own, "
            f"where the check of frozen codes loaded into it goes. Nothing was changed"
        )
    checked = None if given is None else _check_given(given, who, weights, experts)
    held_now = {n: held_experts(module, n, experts) for n in weights}
    new: dict[str, ServingWeight] = {}
    with torch.inference_mode(False), torch.no_grad():
        for name, w in weights.items():
            if checked is not None:
                sw = checked[name]
                copy = {"memory_format": torch.contiguous_format}
                new[name] = ServingWeight(sw.codes.clone(**copy), sw.steps.clone(**copy), sw.layout)
            elif held_now[name] is None:
                new[name] = experts_serving_weight(w, experts)
    for name, sw in new.items():
        if module._parameters.get(name) is not None:
            module.register_parameter(name, None)
        module.register_buffer(name + FROZEN_SUFFIXES[0], sw.codes)
        module.register_buffer(name + FROZEN_SUFFIXES[1], sw.steps)
    # The whole-load guard (``seam.guard_whole_loads``) runs a module's ``check_load`` on the
    # state dict before anything loads: the frozen codes and steps are checked there.
    vars(module)[CHECK_LOAD] = functools.partial(check_frozen_load, module, experts)


CHECK_LOAD: Final = "check_load"
"""The attribute ``freeze_experts`` sets on a frozen module: ``check_frozen_load`` bound to
it, which the whole-load guard calls."""


def frozen_expert_buffers(module: nn.Module) -> tuple[str, ...]:
    """The names of the buffers ``freeze_experts`` holds ``module``'s frozen expert weights in
    (``{name}_fp8``, ``{name}_step`` of each, in registration order), ``()`` for a module it
    froze nothing of."""
    check = vars(module).get(CHECK_LOAD)
    if not (isinstance(check, functools.partial) and check.func is check_frozen_load):
        return ()
    codes, steps = FROZEN_SUFFIXES
    held = [b.removesuffix(codes) for b in module._buffers if b.endswith(codes)]
    return tuple(n + s for n in held if n + steps in module._buffers for s in FROZEN_SUFFIXES)


def check_frozen_load(
    module: nn.Module, experts: QuantizedExperts, entries: Mapping[str, object], prefix: str
) -> None:
    """``ValueError`` unless every frozen expert weight's ``{name}_fp8`` and ``{name}_step``
    among ``entries`` (a state dict's, by local name; ``prefix`` the module's key prefix) can
    replace the held ones: codes exactly in the recipe's forward format and steps float32
    (``load_state_dict``'s ``copy_`` would convert any other dtype), laid out as the module's
    own layout, every code finite, every step finite and positive (a power of two under
    ``mx``), every code times its step finite (``ServingWeight.check_fits``). All names are
    checked before anything is copied, so a refused load changes nothing."""
    who = f"the frozen {type(module).__name__} {prefix.rstrip('.') or '<root>'!r}"
    for name in list(module._buffers):
        if not name.endswith(FROZEN_SUFFIXES[0]):
            continue
        weight = name.removesuffix(FROZEN_SUFFIXES[0])
        held = held_experts(module, weight, experts)
        if held is None:
            continue
        codes, steps = (weight + s for s in FROZEN_SUFFIXES)
        check_state_entries(
            f"{who}'s expert weight {weight!r} under policy {str(experts.policy)!r}",
            held,
            (prefix + codes, prefix + steps),
            entries.get(codes),
            entries.get(steps),
        )


def frozen_experts_mm(
    experts: QuantizedExperts, x: torch.Tensor, held: ServingWeight, offs: torch.Tensor
) -> torch.Tensor:
    """``[M, N]``: group ``g``'s rows ``x[offs[g-1]:offs[g]]`` times the held expert ``g``'s
    codes (``held``, ``[E, N, K]``) under ``experts``' recipe, differentiable in ``x`` only
    (module docstring). The checks of ``QuantizedExperts.mm``."""
    check_grouped(x, held.codes, offs, w_dtypes=FP8_DTYPES)
    check_backend(experts.backend, x, held.codes)
    plan, backend = experts.plan, experts.backend
    codes, scale = held.codes, held.steps
    if plan.weight == "tensor":
        scale = scale.reshape(-1)
    elif plan.weight == "mx":  # the GEMM takes E8M0 bytes: exact for powers of two
        scale = scale.to(torch.float8_e8m0fnu)
    out: torch.Tensor = outside_autocast(_FrozenGroupedMm, x, codes, scale, offs, plan, backend)
    return out


def _held_gemm(
    a: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    fmt_a: torch.dtype,
    plan: GroupedPlan,
    backend: Backend,
) -> torch.Tensor:
    # The operator: offs are read inside it, as fp8_grouped_mm reads them (a compiled call
    # keeps them data, never a guard), and a's quantize, E8M0 bytes included, stays out of
    # what Inductor generates code for.
    out = a.dtype if a.dtype in (torch.bfloat16, torch.float16) else torch.float32
    args = (plan.act, plan.weight, fmt_a, plan.rule, plan.margin, out, backend.value)
    y: torch.Tensor = held_grouped_mm_op(a, qb, sb, offs, *args)
    return y if y.dtype == a.dtype else y.to(a.dtype)


class _FrozenGroupedMm(torch.autograd.Function):
    """``Y[rows of g] = X[rows of g] W[g]ᵀ`` with ``W`` held as codes; ``dX`` only."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        codes: torch.Tensor,
        scale: torch.Tensor,
        offs: torch.Tensor,
        plan: GroupedPlan,
        backend: Backend,
    ) -> torch.Tensor:
        ctx.save_for_backward(codes, scale, offs)
        c: Any = ctx
        c.plan, c.backend, c.x_dtype = plan, backend, x.dtype
        return _held_gemm(x, codes, scale, offs, plan.fwd, plan, backend)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        p: GroupedPlan = ctx.plan
        codes, scale, offs = ctx.saved_tensors
        dy = dy.contiguous()
        if p.weight in ("tensor", "128x128"):
            # dX_g = dY_g · W_g: W_gᵀ's codes are W_g's transposed, each step with its block.
            codes_t = codes.transpose(1, 2).contiguous()
            scale_t = scale if p.weight == "tensor" else scale.transpose(1, 2).contiguous()
            dx = _held_gemm(dy, codes_t, scale_t, offs, p.bwd, p, ctx.backend)
        else:
            # Row and MX blocks run along K: Wᵀ is quantized along N from the codes times
            # their steps, in float32 (as a frozen row linear's dgrad).
            w = ServingWeight(codes, blockwise.steps_of_scale(scale), p.weight).dequantize()
            dx = p.gemm(dy, w.transpose(1, 2), offs, p.bwd, dy.dtype, ctx.backend.value)
        return dx.to(ctx.x_dtype), None, None, None, None, None
