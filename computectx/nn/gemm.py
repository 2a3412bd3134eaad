"""The blocks' GEMMs at ``ctx.compute``: torch's own kernel, or tensor-core numerics in float32.

A bf16 (or f16) GEMM on a tensor core reads half-precision operands, accumulates their
products in float32 and rounds the sum once to the output dtype. A CPU without bf16/f16 dot
products (an AVX2 x86, say) has no such kernel: torch converts inside its GEMM and runs
10-80x slower than float32. ``GemmPath.UPCAST`` computes the same thing fast there: the
half-precision operands are widened to float32 (exact: every bf16/f16 value is a float32
value), multiplied by the float32 GEMM, and the result is rounded once to the half dtype. That
is a bf16 GEMM with float32 accumulation, up to the order of the float32 additions, in
forward and in both backward GEMMs; what autograd keeps for backward stays at the half dtype.

``Gemm.for_ctx`` picks the path once, when a block is built, from
``computectx.capability.native_half_gemm`` (a measured bf16/f32 time ratio), so the forward
holds no probe and compiles without graph breaks. ``QuantizedLinear`` layers run their own GEMMs and
are called as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from computectx import capability
from computectx.activations import SaveMode
from computectx.ctx import ComputeCtx
from computectx.saved import (
    CODED_DTYPES,
    SAVING,
    decode_groups,
    encode_groups,
    kept_back,
    offload_kept,
    refuse_double_backward,
)

__all__ = ["Gemm", "GemmPath", "forced_gemm_path", "input_kept", "keep_input"]


class GemmPath(enum.Enum):
    """How a ``Gemm`` multiplies at its dtype."""

    WIDE = "wide"
    """The compute dtype is float32 or float64: one plain GEMM at that dtype."""
    NATIVE = "native"
    """torch's own kernel at the half dtype (tensor cores on CUDA; native dot products on a
    CPU that has them)."""
    UPCAST = "upcast"
    """Half-precision operands widened exactly to float32, a float32 GEMM, one rounding to the
    half dtype: the tensor-core numerics at float32 GEMM speed, for CPUs without native
    half-precision GEMMs."""


_HALF = (torch.bfloat16, torch.float16)

_forced: contextvars.ContextVar[GemmPath | None] = contextvars.ContextVar(
    "computectx_forced_gemm_path", default=None
)


@contextlib.contextmanager
def forced_gemm_path(path: GemmPath) -> Iterator[None]:
    """Blocks built inside this context use ``path`` for their half-precision GEMMs.

    For comparing the paths (tests, benchmarks): ``NATIVE`` runs torch's half-precision
    kernel even where the probe found it slow, ``UPCAST`` emulates even where it is native.
    Float32/float64 policies stay ``WIDE``; forcing ``WIDE`` itself is refused
    (``ValueError``): a half-precision policy has no plain float32 GEMM.
    """
    if not isinstance(path, GemmPath) or path is GemmPath.WIDE:
        raise ValueError(f"forced_gemm_path takes GemmPath.NATIVE or GemmPath.UPCAST, got {path!r}")
    token = _forced.set(path)
    try:
        yield
    finally:
        _forced.reset(token)


@dataclass(frozen=True)
class Gemm:
    """The GEMMs of one block: ``linear``, ``matmul`` and ``project`` at ``dtype`` by ``path``.

    Results have ``dtype``; operands of any floating dtype are rounded to ``dtype`` first (what
    autocast does), so under an F32 policy these are exactly ``F.linear`` and ``@``.
    """

    path: GemmPath
    dtype: torch.dtype
    save: SaveMode = "keep"
    """How ``linear``'s backward keeps its input (``ctx.activations.linear``, read by
    ``for_ctx``): ``keep`` as the GEMM saves it (at ``dtype``), ``fp8`` as E4M3 codes and
    a float32 scale per row (``keep_input``), ``offload`` in host memory (as it is on a
    CPU)."""

    @classmethod
    def for_ctx(cls, ctx: ComputeCtx) -> Gemm:
        """The GEMMs for ``ctx.compute`` on ``ctx.device``.

        ``WIDE`` for float32/float64; for bf16/f16, ``NATIVE`` on CUDA and on CPUs where
        ``capability.native_half_gemm`` measures a native kernel, ``UPCAST`` on other CPUs;
        inside ``forced_gemm_path`` the forced path for bf16/f16.
        """
        dtype, save = ctx.compute.torch, ctx.activations.linear
        if dtype not in _HALF:
            return cls(GemmPath.WIDE, dtype, save)
        forced = _forced.get()
        if forced is not None:
            return cls(forced, dtype, save)
        if ctx.device.type != "cpu" or capability.native_half_gemm(dtype).ok:
            return cls(GemmPath.NATIVE, dtype, save)
        return cls(GemmPath.UPCAST, dtype, save)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` at ``dtype`` (``F.linear`` semantics and shapes), what its
        backward keeps tagged ``"linear"`` (``computectx.saved.SAVING``) and, under ``save``
        ``fp8``, its input kept as E4M3 codes with a scale per row (``keep_input``)."""
        if torch.compiler.is_compiling():  # a compiled graph's saves carry no kind
            return self._linear(x, weight, bias)
        token = SAVING.set("linear")
        try:
            return self._linear(x, weight, bias)
        finally:
            SAVING.reset(token)

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        x, bias = _cast(x, self.dtype), None if bias is None else _cast(bias, self.dtype)
        if self.save != "keep" and _builds_graph(x, weight, bias):
            work = torch.float32 if self.path is GemmPath.UPCAST else self.dtype
            args = (x, weight, bias, self.dtype, work, self.save)
            kept: torch.Tensor = _KeptInputLinear.apply(*args)  # type: ignore[no-untyped-call]
            return kept
        weight = _cast(weight, self.dtype)
        if self.path is GemmPath.UPCAST:
            out: torch.Tensor = _UpcastLinear.apply(x, weight, bias)  # type: ignore[no-untyped-call]
            return out
        return nn.functional.linear(x, weight, bias)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` at ``dtype`` (``torch.matmul`` semantics for operands of 2 or more dims)."""
        a, b = _cast(a, self.dtype), _cast(b, self.dtype)
        if self.path is GemmPath.UPCAST:
            out: torch.Tensor = _UpcastMatmul.apply(a, b)  # type: ignore[no-untyped-call]
            return out
        return a @ b

    def project(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)`` for a block's linear layer: a plain ``nn.Linear`` runs through
        ``linear`` with its own weight and bias; anything else (a ``QuantizedLinear``, which does
        its
        own GEMMs) is called as it is."""
        if type(layer) is nn.Linear:
            return self.linear(x, layer.weight, layer.bias)
        out: torch.Tensor = layer(x)
        return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _builds_graph(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def keep_input(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a linear's backward keeps of its input ``x`` under ``linear: fp8``: E4M3 codes and
    one float32 scale per row (per token: the row's finite absmax / 448;
    ``computectx.saved.encode_groups`` with a group as wide as the row), or ``(x,)`` itself
    for a dtype that codec does not code (float64) and an empty ``x``. Per row rather than
    per tensor: a token's codes depend on that token alone, so a batch split across ranks or
    micro-batches keeps what the whole batch keeps (4 bytes a row). ``input_kept`` reads it
    back."""
    if x.dtype not in CODED_DTYPES or x.numel() == 0:
        return (x,)
    return encode_groups(x, x.shape[-1])


def input_kept(
    kept: tuple[torch.Tensor, ...], shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """The input ``keep_input`` kept, decoded to ``shape`` and ``dtype``."""
    return kept[0] if len(kept) == 1 else decode_groups(kept[0], kept[1], shape, dtype)


def _linear_grads(
    needs: tuple[bool, ...],
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    work: torch.dtype,
) -> tuple[torch.Tensor | None, ...]:
    # dX, dW and db of F.linear at ``work`` (float32 for UPCAST: one rounding each).
    gx = gw = gb = None
    with torch.autocast(grad.device.type, enabled=False):
        g = grad.to(work)
        if needs[0]:
            gx = (g @ weight.to(work)).to(x.dtype)
        if needs[1]:
            gw = (_rows(g).mT @ _rows(x.to(work))).to(weight.dtype)
        if needs[2]:
            gb = _rows(g).sum(0).to(x.dtype)
    return gx, gw, gb


def _rows(t: torch.Tensor) -> torch.Tensor:
    # t as (tokens, features); reshape(-1, 0) would be ambiguous with no features.
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _wide_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, work: torch.dtype
) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        wide_bias = None if bias is None else bias.to(work)
        y = nn.functional.linear(x.to(work), weight.to(work), wide_bias)
    return y.to(x.dtype)


class _UpcastLinear(torch.autograd.Function):
    """``F.linear`` of half-precision tensors as float32 GEMMs rounded once (see the module)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # The half-precision operands, not their float32 copies, wait for backward: the
        # memory a half-precision policy is meant to save.
        ctx.save_for_backward(x, weight)
        return _wide_linear(x, weight, bias, torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        return _linear_grads(ctx.needs_input_grad, grad, x, weight, torch.float32)


class _KeptInputLinear(torch.autograd.Function):
    """``F.linear`` at ``work`` (``dtype``, or float32 for ``UPCAST``), its backward keeping the
    weight as it came (a parameter, not its copy at ``dtype``: cast again in the backward)
    and the input as ``save`` says: ``fp8`` as ``keep_input`` codes it, ``offload`` in host
    memory (``computectx.saved.offload_kept``: as it is on a CPU or compiled)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        work: torch.dtype,
        save: SaveMode,
    ) -> torch.Tensor:
        kept = keep_input(x) if save == "fp8" else (x,)
        kept = offload_kept(ctx, kept) if save == "offload" else kept
        ctx.save_for_backward(*kept, weight)
        c: Any = ctx
        c.like, c.dtype, c.work, c.save = (x.shape, x.dtype), dtype, work, save
        return _wide_linear(x, _cast(weight, dtype), bias, work)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The input comes back as codes or a host copy, outside the graph: no double backward
        # (a CPU's offload keeps it as it is, and is refused alike: the same on any device).
        refuse_double_backward("linear", ctx.save)
        *kept, weight = ctx.saved_tensors
        x = input_kept(kept_back(ctx, tuple(kept)), *ctx.like)
        gx, gw, gb = _linear_grads(
            ctx.needs_input_grad, grad, x, _cast(weight, ctx.dtype), ctx.work
        )
        return gx, None if gw is None else _cast(gw, weight.dtype), gb, None, None, None


class _UpcastMatmul(torch.autograd.Function):
    """``a @ b`` of half-precision tensors as a float32 matmul rounded once (see the module)."""

    @staticmethod
    def forward(ctx: FunctionCtx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        with torch.autocast(a.device.type, enabled=False):
            y = a.float() @ b.float()
        return y.to(a.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        needs = ctx.needs_input_grad
        ga = gb = None
        with torch.autocast(grad.device.type, enabled=False):
            g = grad.float()
            # sum_to_size undoes matmul's broadcasting of batch dimensions.
            if needs[0]:
                ga = (g @ b.float().mT).sum_to_size(a.shape).to(a.dtype)
            if needs[1]:
                gb = (a.float().mT @ g).sum_to_size(b.shape).to(b.dtype)
        return ga, gb
