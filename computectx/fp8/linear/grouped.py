"""``fp8_grouped_mm``: the differentiable grouped fp8 GEMM of mixture-of-experts layers.

``fp8_grouped_mm(x, w, offs, policy)`` computes, for tokens sorted by expert, each group's
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
``tensor`` takes one step per group's rows and one per expert. X and W are quantized in
the policy's forward format, dY in its backward format. Every step is dynamic, from the
operand's own amax: experts keep no scaling history, whatever the policy's ``scaling`` (a
delayed per-tensor policy runs its experts dynamically, with its ``margin``). The GEMMs
write the dtype of ``x`` (bf16 and fp16 rounded once from the float32 sum; float32
otherwise); ``dW`` is float32 until it reaches ``w``'s dtype.

Both GEMM kinds are operators of ``ops.registry`` (``fp8_grouped_mm``,
``fp8_grouped_wgrad``) with fakes, so ``torch.compile(fullgraph=True)`` traces a call as one
node whatever the group sizes: ``offs`` is data, never a guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from computectx.fp8.backend import Fp8Backend, check_backend, default_backend, parse_backend
from computectx.fp8.numerics.layouts import OPERAND_GRANULARITY, Granularity, step_rule_of
from computectx.fp8.ops import registry
from computectx.fp8.ops.grouped import check_grouped
from computectx.fp8.policy import describe
from computectx.recipes import Fp8Policy

__all__ = ["ExpertsFp8", "fp8_grouped_mm", "grouped_operands"]


def grouped_operands(policy: Fp8Policy) -> tuple[Granularity, Granularity]:
    """The ``(activation, weight)`` granularities of ``policy``'s grouped GEMMs."""
    if policy.granularity == "tensor":
        return "tensor", "tensor"
    return OPERAND_GRANULARITY[policy.granularity]


def _gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


class _GroupedMmFunction(torch.autograd.Function):
    """``Y[rows of g] = X[rows of g] W[g]ᵀ`` in fp8 and its two gradients (module docstring)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        offs: torch.Tensor,
        policy: Fp8Policy,
        backend: Fp8Backend,
    ) -> torch.Tensor:
        g_act, g_w = grouped_operands(policy)
        fwd = policy.format.forward.torch
        y: torch.Tensor = registry.fp8_grouped_mm(
            x, w, offs, g_act, g_w, fwd, fwd, step_rule_of(policy), policy.scaling.margin,
            _gemm_dtype(x.dtype), backend.value,
        )  # fmt: skip
        ctx.save_for_backward(x, w, offs)
        c: Any = ctx
        c.policy, c.backend = policy, backend
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        policy: Fp8Policy = ctx.policy
        backend: Fp8Backend = ctx.backend
        x, w, offs = ctx.saved_tensors
        g_act, g_w = grouped_operands(policy)
        fwd, bwd = policy.format.forward.torch, policy.format.backward.torch
        rule, margin = step_rule_of(policy), policy.scaling.margin
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # dX_g [m, K] = dY_g [m, N] · W_g [N, K]: W_gᵀ [K, N] contracted over N.
            dx = registry.fp8_grouped_mm(
                dy, w.transpose(1, 2), offs, g_act, g_w, bwd, fwd, rule, margin,
                _gemm_dtype(x.dtype), backend.value,
            ).to(x.dtype)  # fmt: skip
        if ctx.needs_input_grad[1]:
            # dW_g [N, K] = dY_gᵀ · X_g over the group's own rows, float32 until w's dtype.
            dw = registry.fp8_grouped_wgrad(
                dy, x, offs, g_act, bwd, fwd, rule, margin, policy.gw_hp, backend.value
            ).to(w.dtype)
        return dx, dw, None, None, None


def fp8_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    policy: Fp8Policy,
    *,
    backend: Fp8Backend | str | None = None,
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
    if not isinstance(policy, Fp8Policy):
        raise TypeError(f"fp8_grouped_mm takes an Fp8Policy (ctx.fp8), got {describe(policy)}")
    check_grouped(x, w, offs)
    chosen = default_backend(x.device) if backend is None else parse_backend(backend)
    check_backend(chosen, x, w)
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        lowered = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            lowered_out: torch.Tensor = fp8_grouped_mm(
                x.to(lowered), w, offs, policy, backend=chosen
            )
            return lowered_out
    out: torch.Tensor = _GroupedMmFunction.apply(x, w, offs, policy, chosen)  # type: ignore[no-untyped-call]
    return out


@dataclass(frozen=True)
class ExpertsFp8:
    """What a converted experts module runs its GEMMs with: a policy and a backend.

    ``convert_to_fp8`` stores one on each experts module it converts (through that module's
    ``ExpertsConverter``); the module's forward calls ``mm`` for each expert projection.
    """

    policy: Fp8Policy
    backend: Fp8Backend

    def __post_init__(self) -> None:
        # Checked when built, not at the first GEMM: an Fp8Policy (``ctx.fp8``, not the ctx
        # or a flag) and an Fp8Backend member or its name (read as the member).
        if not isinstance(self.policy, Fp8Policy):
            raise TypeError(
                f"ExpertsFp8 takes an Fp8Policy (ctx.fp8) as its policy, got "
                f"{describe(self.policy)}"
            )
        backend: object = self.backend
        if isinstance(backend, str) and not isinstance(backend, Fp8Backend):
            backend = parse_backend(backend)
        if not isinstance(backend, Fp8Backend):
            accepted = ", ".join(repr(b.value) for b in Fp8Backend)
            raise TypeError(
                f"ExpertsFp8 takes an Fp8Backend as its backend (a member or one of "
                f"{accepted}), got {describe(backend)}"
            )
        object.__setattr__(self, "backend", backend)

    def mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """``fp8_grouped_mm(x, w, offs, self.policy, backend=self.backend)``."""
        return fp8_grouped_mm(x, w, offs, self.policy, backend=self.backend)
