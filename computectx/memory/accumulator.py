"""``LowPrecGradAccumulator``: drain gradients during backward into ``ctx.grad`` buffers.

Error bound (per element, documented in docs/memory.md and tested with hypothesis). Let
``g_1 .. g_K`` be the micro-batch gradients of one element as autograd produced them, and
``S = sum_k g_k``. Every micro-batch passes through at most two roundings before it is part
of the buffer (an optional cast for the transfer, then the rounded add), and the first
gradient is touched by at most ``K`` roundings in all. With ``u`` the relative error of one
rounding, the standard recursive-summation argument (Higham, *Accuracy and Stability of
Numerical Algorithms*, Lemma 3.1 and section 4.2) gives

    |buffer - S| <= gamma_K * sum_k |g_k|  +  2 * K * eta,   gamma_K = K*u / (1 - K*u)

where ``eta`` is the subnormal spacing of the buffer dtype (rounding is absolute, not
relative, below the normal range). ``u`` is ``2**-p`` for round-to-nearest and ``2**(1-p)``
for stochastic rounding (which may round to either neighbour), ``p`` the significand bits
(bf16: 8, f16: 11, f32: 24). A 16-bit buffer is updated through an f32 sum, so its ``u``
also absorbs one f32 rounding. The bound is vacuous (infinite) once ``K*u >= 1``: for bf16
round-to-nearest that is ``K >= 256``, for bf16 stochastic ``K >= 128``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import get_args

import torch
from torch.utils.hooks import RemovableHandle

from computectx.ctx import ComputeCtx
from computectx.dtypes import DType
from computectx.memory._rounding import (
    AccumMode,
    RoundingGenerators,
    stochastic_round,
    subnormal_spacing,
    unit_roundoff,
)
from computectx.memory._transfer import Staging, Transfer, check_transfer, uses_staging

__all__ = ["AccumMode", "LowPrecGradAccumulator", "Transfer"]


class _Slot:
    """The accumulation state of one parameter."""

    __slots__ = ("buffer", "count", "handle", "param", "pending", "staging")

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param
        self.buffer: torch.Tensor | None = None
        self.staging: Staging | None = None
        self.pending = False  # staging holds a gradient not yet added to buffer
        self.count = 0  # micro-batch gradients in buffer (or pending)
        self.handle: RemovableHandle | None = None


class LowPrecGradAccumulator:
    """Sum gradients across micro-batches in ``ctx.grad`` buffers on ``ctx.offload_device``.

    A post-accumulate-grad hook on every parameter that requires grad takes the gradient
    the moment autograd finalises it, adds it to that parameter's buffer and sets
    ``param.grad = None``, so full-precision gradients never pile up on the compute device.
    Parameters that do not require grad are ignored; parameters that get no gradient in
    a backward keep their buffer (or none). Hand the sums on with ``flush_to_param_grads``
    or ``OffloadedOptimizer.ingest_grads(accumulator)``.

    ``mode="nearest"`` rounds every partial sum to nearest; ``mode="stochastic"`` rounds it
    stochastically (unbiased; needs a 16-bit ``ctx.grad``), seeded by ``seed`` on a private
    generator so the global RNG is untouched. For the most accurate sums use an f32 buffer:
    ``ctx.replace(grad=DType.F32)``. See the module docstring (and ``error_bound``) for the
    precision each option guarantees. ``transfer`` picks how gradients cross devices (see
    ``Transfer``). Use as a context manager, or call ``close()``, to remove the hooks.
    ``state_dict``/``load_state_dict`` save and restore the generator's state (tensors only),
    so a stochastic run resumes bit for bit.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        ctx: ComputeCtx,
        *,
        mode: AccumMode = "nearest",
        transfer: Transfer = "auto",
        seed: int = 0,
    ) -> None:
        if not isinstance(ctx, ComputeCtx):
            raise TypeError(f"ctx must be a ComputeCtx, got {type(ctx).__name__}")
        if mode not in get_args(AccumMode):
            raise ValueError(f"unknown mode {mode!r}; accepted: 'nearest', 'stochastic'")
        transfer = check_transfer(transfer)
        if mode == "stochastic" and ctx.grad not in (DType.BF16, DType.F16):
            raise ValueError(
                f"mode='stochastic' rounds f32 partial sums into a 16-bit buffer, but "
                f"ctx.grad={ctx.grad}; use mode='nearest' with grad={ctx.grad}, or a ctx "
                f"with grad=bf16 or grad=f16"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if isinstance(params, (torch.Tensor, torch.nn.Module)):
            raise TypeError(
                f"params must be an iterable of tensors (e.g. model.parameters()), got "
                f"{type(params).__name__}"
            )
        self.grad_dtype = ctx.grad
        self.device = ctx.offload_device
        self.mode: AccumMode = mode
        self.transfer: Transfer = transfer
        self._generators = RoundingGenerators(seed)
        self._slots: dict[int, _Slot] = {}
        self._closed = False
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] is a {type(p).__name__}, not a tensor")
            if not p.requires_grad or id(p) in self._slots:
                continue
            if not p.is_leaf:
                raise ValueError(
                    f"params[{i}] (shape {tuple(p.shape)}) is not a leaf tensor; gradients "
                    f"are accumulated only for leaves such as nn.Parameter"
                )
            self._slots[id(p)] = _Slot(p)
        for slot in self._slots.values():
            hook = self._hook_for(slot)
            slot.handle = slot.param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    # ----- hooks ------------------------------------------------------------------------

    def _hook_for(self, slot: _Slot) -> _Hook:
        return _Hook(self, slot)

    def _receive(self, slot: _Slot, param: torch.Tensor) -> None:
        g = param.grad
        if g is None:
            return
        if g.layout != torch.strided:
            raise TypeError(
                f"LowPrecGradAccumulator got a {g.layout} gradient for a parameter of shape "
                f"{tuple(param.shape)}; only dense (strided) gradients are supported"
            )
        param.grad = None
        g = g.detach()
        if self._staged(g.device):
            if slot.pending:
                self._fold_pending(slot)
            if slot.staging is None:
                slot.staging = Staging(
                    g.shape, self.grad_dtype.torch, host=self.device, peer=g.device
                )
            # The transfer moves buffer-dtype bytes; the rounding for it counts as one of
            # the two roundings per micro-batch in the error bound.
            slot.staging.fill_from(self._round(g))
            slot.pending = True
        else:
            self._add(slot, g.to(self.device))
        slot.count += 1

    def _staged(self, src: torch.device) -> bool:
        return uses_staging(self.transfer, src, self.device)

    def _fold_pending(self, slot: _Slot) -> None:
        staging = slot.staging
        if not slot.pending or staging is None:
            return
        staging.wait()
        self._add(slot, staging.buffer)
        slot.pending = False

    def _add(self, slot: _Slot, g: torch.Tensor) -> None:
        with torch.no_grad():
            if slot.buffer is None:
                # Sums are contiguous whatever the gradient's layout, so that a reduction
                # can hand them over in pieces of the row-major order (set_sum_part).
                if self.mode == "nearest":
                    slot.buffer = g.to(
                        self.grad_dtype.torch, copy=True, memory_format=torch.contiguous_format
                    )
                else:
                    rounded = self._round(g)
                    # The buffer must own its memory: g may be a reused staging buffer.
                    slot.buffer = (
                        rounded.clone(memory_format=torch.contiguous_format)
                        if rounded is g
                        else rounded.contiguous()
                    )
                return
            if self.mode == "nearest":
                # The add runs in the promoted dtype (f32 for a 16-bit buffer and an f32
                # gradient) and rounds once into the buffer.
                slot.buffer.add_(g)
            else:
                slot.buffer.copy_(self._round(slot.buffer.float() + g.float()))

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded into the buffer dtype by this accumulator's mode.

        Returns ``x`` itself when it already has that dtype.
        """
        target = self.grad_dtype.torch
        if self.mode == "nearest" or x.dtype == target:
            return x.to(target)
        return stochastic_round(x, target, self._generators.get(x.device))

    # ----- public API -------------------------------------------------------------------

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """The parameters this accumulator drains (those that required grad)."""
        return tuple(s.param for s in self._slots.values())

    @property
    def micro_batches(self) -> int:
        """The most micro-batch gradients any one buffer holds (``K`` in the bound)."""
        return max((s.count for s in self._slots.values()), default=0)

    def tracks(self, param: torch.Tensor) -> bool:
        """Whether ``param`` (this exact tensor) is drained by this accumulator."""
        return id(param) in self._slots and self._slots[id(param)].param is param

    def count(self, param: torch.Tensor) -> int:
        """How many micro-batch gradients ``param``'s buffer holds."""
        return self._slot(param).count

    def sync(self) -> None:
        """Make the sums final before they are handed over; a no-op here.

        ``peek``, ``pop``, ``flush_to_param_grads`` and ``OffloadedOptimizer.ingest_grads``
        call it first. A subclass that reduces the sums across ranks
        (``computectx.distributed.DataParallelGradAccumulator``) does it here, once per
        batch of new gradients.
        """

    def set_sum(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Replace ``param``'s accumulated sum with ``value``, rounded once into ``ctx.grad``.

        The result lives on ``ctx.offload_device`` (an existing buffer is overwritten in
        place); the micro-batch count is kept (at least 1). For code that combines sums
        outside the hooks, such as a reduction across ranks.
        """
        slot = self._slot(param)
        if not isinstance(value, torch.Tensor) or value.shape != param.shape:
            raise ValueError(
                f"set_sum needs a tensor of the parameter's shape {tuple(param.shape)}, got "
                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
            )
        self._write(slot, param, value, None)

    def set_sum_part(self, param: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Replace elements ``start .. start + values.numel()`` of ``param``'s sum (in
        row-major order) with the 1-D ``values``, rounded once into ``ctx.grad``.

        ``set_sum`` for a sum handed over in pieces, such as a reduction in buckets smaller
        than the parameter. Rounding is per element, so setting every piece in order gives
        what ``set_sum`` gives for the whole (with ``mode="stochastic"`` the random draws
        come in pieces too: the same numbers on the CPU, where torch draws them one after
        another). A parameter with no sum yet gets one of zeros first; the micro-batch
        count is kept (at least 1).
        """
        slot = self._slot(param)
        if not isinstance(values, torch.Tensor) or values.dim() != 1:
            raise ValueError(
                f"set_sum_part needs a 1-D tensor of values, got "
                f"{tuple(values.shape) if isinstance(values, torch.Tensor) else type(values)}"
            )
        if isinstance(start, bool) or not isinstance(start, int):
            raise TypeError(f"start must be an int, got {start!r}")
        if not 0 <= start <= param.numel() - values.numel():
            raise ValueError(
                f"elements {start} .. {start + values.numel()} are outside the parameter's "
                f"{param.numel()} elements"
            )
        self._write(slot, param, values, start)

    def _write(
        self, slot: _Slot, param: torch.Tensor, values: torch.Tensor, start: int | None
    ) -> None:
        """Fold what is pending into ``slot``, then replace its whole sum (``start`` None) or
        the elements from ``start`` with ``values`` rounded once into ``ctx.grad``; the
        micro-batch count is kept (at least 1)."""
        self._fold_pending(slot)
        with torch.no_grad():
            rounded = self._round(values.detach().to(self.device))
            if start is None and slot.buffer is None:
                # Never an alias of the caller's tensor; contiguous, as every sum is.
                slot.buffer = rounded.clone(memory_format=torch.contiguous_format)
            elif start is None:
                assert slot.buffer is not None
                slot.buffer.copy_(rounded)
            else:
                if slot.buffer is None:
                    slot.buffer = torch.zeros(
                        param.shape, dtype=self.grad_dtype.torch, device=self.device
                    )
                slot.buffer.view(-1)[start : start + values.numel()].copy_(rounded)
        slot.count = max(slot.count, 1)

    def peek(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s accumulated gradient (the live buffer, not a copy), or ``None``."""
        self.sync()
        slot = self._slot(param)
        self._fold_pending(slot)
        return slot.buffer

    def pop(self, param: torch.Tensor) -> torch.Tensor | None:
        """Hand over ``param``'s accumulated gradient and forget it.

        Returns the buffer itself (dtype ``ctx.grad``, on ``ctx.offload_device``), or
        ``None`` when the parameter got no gradient since the last pop, or is not tracked.
        """
        if not self.tracks(param):
            return None
        self.sync()
        slot = self._slots[id(param)]
        self._fold_pending(slot)
        buf, slot.buffer, slot.count = slot.buffer, None, 0
        return buf

    def flush_to_param_grads(self, dtype: DType = DType.F32) -> None:
        """Move every accumulated sum into ``param.grad`` (at ``dtype``, on the param's device).

        torch requires ``param.grad`` to have the parameter's dtype, so ``dtype`` must equal
        the dtype of every parameter with a sum to flush, and a ``param.grad`` that already
        exists (it is added to) must be dense; both are checked for all of them before any
        gradient or sum changes. The buffers are emptied, each once its gradient is written.
        """
        dtype = DType.parse(dtype)
        self.sync()
        flushing = [s for s in self._slots.values() if s.pending or s.buffer is not None]
        bad = [s for s in flushing if s.param.dtype != dtype.torch]
        if bad:
            kinds = sorted({str(s.param.dtype) for s in bad})
            raise ValueError(
                f"flush_to_param_grads(dtype={dtype}) would give {len(bad)} parameter(s) of "
                f"dtype {', '.join(kinds)} a {dtype} gradient, which torch rejects; pass the "
                f"parameters' dtype, or hand the sums to OffloadedOptimizer.ingest_grads"
            )
        sparse = [
            i
            for i, s in enumerate(self._slots.values())
            if s in flushing and s.param.grad is not None and s.param.grad.layout != torch.strided
        ]
        if sparse:
            raise ValueError(
                f"flush_to_param_grads adds the sums to param.grad, but parameter(s) "
                f"{sparse[:8]} (in the accumulator's order) hold a sparse param.grad, which a "
                f"dense sum cannot be added to in place; set those param.grad to None (or "
                f"dense) first. Nothing was flushed"
            )
        with torch.no_grad():
            for slot in flushing:
                self._fold_pending(slot)
                if slot.buffer is None:
                    continue
                # The sum is forgotten only once its gradient is written: a failure here
                # (out of memory on the way) loses no sum.
                g = slot.buffer.to(device=slot.param.device, dtype=dtype.torch)
                if slot.param.grad is None:
                    slot.param.grad = g
                else:
                    slot.param.grad.add_(g)
                slot.buffer, slot.count = None, 0

    def reset(self) -> None:
        """Drop every accumulated sum (the next backward starts from zero)."""
        for slot in self._slots.values():
            if slot.staging is not None:
                slot.staging.wait()
            slot.pending = False
            slot.buffer = None
            slot.count = 0

    # ----- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The random state of stochastic rounding, as tensors: save it to resume bit for bit.

        ``"seed"`` (an int64 scalar) and ``"generator.<device>"`` (the uint8 state of the
        generator on that device) for every device drawn on so far; a copy. The same on every
        rank of a data-parallel group, which draws alike. Holds no sums, as torch's state
        dicts hold no ``.grad``: with sums still held (a backward since the last hand-over)
        it raises instead of losing them; save between steps, after ``ingest_grads``.
        """
        held = [s for s in self._slots.values() if s.pending or s.buffer is not None]
        if held:
            raise ValueError(
                f"{len(held)} parameter(s) hold gradient sums that the accumulator's "
                f"state_dict does not save; hand them over first (ingest_grads, "
                f"flush_to_param_grads or pop) or drop them with reset(), and save between "
                f"steps"
            )
        return self._generators.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Restore the random state saved by ``state_dict``, everything checked first.

        The saved seed replaces this accumulator's (it seeds generators not yet drawn from);
        each saved generator state is restored. Refused, changing nothing: a missing or
        malformed seed, unknown keys, a state that is not a 1-D uint8 tensor or that torch
        rejects for that device, a generator of a device this accumulator never draws on
        (the offload device and the parameters' devices), and any generator when
        ``mode="nearest"``.
        """
        devices = {self.device, *(s.param.device for s in self._slots.values())}
        self._generators.load_state_dict(state_dict, devices, self.mode)

    def close(self) -> None:
        """Remove the hooks and release the staging buffers; sums stay until flushed."""
        for slot in self._slots.values():
            if slot.handle is not None:
                slot.handle.remove()
                slot.handle = None
            self._fold_pending(slot)
            slot.staging = None
        self._closed = True

    @property
    def closed(self) -> bool:
        """True after ``close()``: no more gradients are drained."""
        return self._closed

    def __enter__(self) -> LowPrecGradAccumulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({len(self._slots)} params, grad={self.grad_dtype}, "
            f"device={self.device}, mode={self.mode!r}, transfer={self.transfer!r})"
        )

    @staticmethod
    def error_bound(
        abs_sum: torch.Tensor, micro_batches: int, grad: DType, mode: AccumMode = "nearest"
    ) -> torch.Tensor:
        """The elementwise worst-case error of a ``grad``-dtype sum of ``micro_batches`` terms.

        ``abs_sum`` is ``sum_k |g_k|`` per element (any float dtype). Returns
        ``gamma_K * abs_sum + 2 * K * eta`` in f64 (see the module docstring); ``inf``
        where ``K * u >= 1``.
        """
        grad = DType.parse(grad)
        if mode not in get_args(AccumMode):
            raise ValueError(f"unknown mode {mode!r}; accepted: 'nearest', 'stochastic'")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            raise TypeError(f"micro_batches must be an int, got {micro_batches!r}")
        if micro_batches < 0:
            raise ValueError(f"micro_batches must be >= 0, got {micro_batches}")
        u = unit_roundoff(grad, mode)
        k = micro_batches
        gamma = k * u / (1.0 - k * u) if k * u < 1.0 else math.inf
        eta = subnormal_spacing(grad)
        return gamma * abs_sum.to(torch.float64) + 2.0 * k * eta

    def _slot(self, param: torch.Tensor) -> _Slot:
        if not self.tracks(param):
            raise ValueError(
                f"the tensor of shape {tuple(param.shape)} is not tracked by this "
                f"accumulator (only parameters that required grad when it was built are)"
            )
        return self._slots[id(param)]

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor this accumulator holds, with its role for ``memory_report``.

        ``("accumulator", sum)`` per parameter with a sum, ``("staging", buffer)`` per
        staging buffer.
        """
        for slot in self._slots.values():
            if slot.buffer is not None:
                yield "accumulator", slot.buffer
            if slot.staging is not None:
                yield "staging", slot.staging.buffer


class _Hook:
    """The post-accumulate-grad hook of one parameter.

    A callable object rather than a closure, so it keeps no closure cell alive after
    ``close``.
    """

    __slots__ = ("acc", "slot")

    def __init__(self, acc: LowPrecGradAccumulator, slot: _Slot) -> None:
        self.acc = acc
        self.slot = slot

    def __call__(self, param: torch.Tensor) -> None:
        self.acc._receive(self.slot, param)
