"""Gradient health: the clip norm of the master gradients and whether they may be applied.

``GradHealth`` measures (and clips to) the norm of the master gradients, global over the
ranks under a ``Sharding``, and gives ``step`` its verdict: may these gradients be applied?
They may not when an element is inf or NaN, or finite but so large that its square overflows
float32 (``|g| >= SQUARE_OVERFLOW = 2**64``, about 1.8e19): every second-moment optimizer
(Adam's ``exp_avg_sq``, Adagrad's ``sum``, RMSprop's ``square_avg``) would store inf for it,
which freezes that weight for the rest of the run under float32 state and, in a block-wise
format, would take the whole block's scale. The verdict of ``clip`` is kept with stamps of
the gradients it was taken on and reused while they are unchanged, so a step after clipping
reads nothing again.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from computectx._checks import check_max_norm
from computectx.memory.optim._masters import MasterWeights, Sharding
from computectx.memory.optim.fused import native_cleared

__all__ = ["SQUARE_OVERFLOW", "GradHealth", "all_applicable"]

SQUARE_OVERFLOW = 2.0**64
"""The smallest magnitude whose float32 square overflows (``2**64 * 2**64 = 2**128``; the
largest float32 is just below ``2**128``): a gradient element this large skips the step."""

GradStamp = tuple[int, int, int] | None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether the master gradients were finite, and which gradients that was said of."""

    stamps: tuple[GradStamp, ...]
    finite: bool


class GradHealth:
    """The norm and the non-finite verdict of the master gradients of ``weights``."""

    def __init__(self, weights: MasterWeights, *, native: bool = True) -> None:
        self.weights = weights
        self.native = native  # False (compile=False): never build the native check's kernel
        self._verdict: Verdict | None = None

    def forget(self) -> None:
        """Drop the kept verdict (the gradients changed, or are gone)."""
        self._verdict = None

    def clip(self, max_norm: float, norm_type: float) -> float:
        """Clip the master gradients to total norm ``max_norm``; return the norm before.

        A non-finite norm is returned as is (clipping scaled the gradients by NaN), and
        kept as the verdict ``finite`` reuses. With a sharding the norm is the global one
        over every rank's shards (one all-reduce).
        """
        check_max_norm(max_norm)
        masters = [mp for mp in self.weights.master if mp.grad is not None]
        sharding = self.weights.sharding
        if sharding is None:
            norm = float(
                torch.nn.utils.clip_grad_norm_(masters, float(max_norm), norm_type=norm_type)
            )
        else:
            norm = clip_sharded(sharding, masters, float(max_norm), float(norm_type))
        # Every element is at most the norm (p >= 1) and, once clipped, at most max_norm: below
        # SQUARE_OVERFLOW so, no element needs a look. Otherwise (a measure-only clip of huge
        # gradients, or p < 1) the elements are read. The norm is global under a sharding, so
        # every rank takes the same branch (and the same all-reduce).
        if not math.isfinite(norm):
            applicable = False
        elif norm_type >= 1 and min(norm, float(max_norm)) < SQUARE_OVERFLOW:
            applicable = True
        else:
            grads = [mp.grad for mp in masters if mp.grad is not None]
            applicable = all_applicable(grads, native=self.native)
            if sharding is not None:
                bad = torch.tensor([0.0 if applicable else 1.0], dtype=torch.float64)
                applicable = bool(sharding.all_reduce(bad, "max")[0] == 0.0)
        # Stamped after clipping (which rewrote the gradients in place), so any later change
        # to them, ours or the caller's, makes applicable() look again.
        self._verdict = Verdict(self._stamps(), applicable)
        return norm

    def applicable(self) -> bool:
        """Whether every master gradient element is finite with a finite float32 square
        (``|g| < SQUARE_OVERFLOW``), decided by all ranks together.

        The kept verdict of ``clip`` when the gradients are unchanged since; otherwise one
        summing pass over them (one host read). Under a sharding, one all-reduce of the
        rank's verdict either way, so that every rank takes the same decision and runs the
        same collectives: whether a rank's kept verdict still holds is its own (a gradient
        written after the clip on one rank only), and a rank that looked again alone would
        wait on the others.
        """
        verdict = self._verdict
        if verdict is not None and verdict.stamps == self._stamps():
            finite = verdict.finite
        else:
            masters = self.weights.master
            grads = [mp.grad for mp in masters if mp.grad is not None]
            finite = all_applicable(grads, native=self.native)
        sharding = self.weights.sharding
        if sharding is None:
            return finite
        # Every rank must take the same decision, or the shards of one weight diverge.
        bad = torch.tensor([0.0 if finite else 1.0], dtype=torch.float64)
        return bool(sharding.all_reduce(bad, "max")[0] == 0.0)

    def _stamps(self) -> tuple[GradStamp, ...]:
        return tuple(None if mp.grad is None else grad_stamp(mp.grad) for mp in self.weights.master)


def clip_sharded(
    sharding: Sharding, masters: list[torch.Tensor], max_norm: float, p: float
) -> float:
    """Clip gradients split across ranks to their global ``p``-norm; return the norm before.

    The local shards' sum of ``|g|^p`` (max ``|g|`` for ``p=inf``) is all-reduced, then the
    ``p``-th root taken; clipping then scales each local shard as
    ``torch.nn.utils.clip_grad_norm_`` scales a whole gradient.
    """
    grads = [mp.grad for mp in masters if mp.grad is not None]
    # One host read for all the shards' norms, not one per gradient.
    norms = (
        torch.stack([torch.linalg.vector_norm(g, p) for g in grads]).double().cpu()
        if grads
        else torch.zeros(0, dtype=torch.float64)
    )
    if math.isinf(p):
        local = norms.max() if grads else torch.zeros((), dtype=torch.float64)
        total = sharding.all_reduce(local.reshape(1), "max")[0]
    else:
        local = norms.pow(p).sum()
        total = sharding.all_reduce(local.reshape(1), "sum")[0].pow(1.0 / p)
    norm = float(total)
    coef = min(max_norm / (norm + 1e-6), 1.0) if math.isfinite(norm) else math.nan
    if coef < 1.0 or math.isnan(coef):
        for g in grads:
            g.mul_(coef)
    return norm


def all_applicable(tensors: list[torch.Tensor], *, native: bool = True) -> bool:
    """Whether every element of ``tensors`` is finite and below ``SQUARE_OVERFLOW`` in
    magnitude (its float32 square finite); one host sync per device (the masters of small
    parameters may stay on their GPU under ``overlap``).

    Each tensor is cleared by ``_cleared``: exactly by the native check where it reads the
    tensor, else by a bound (one read pass; inf and NaN never clear); the rare tensor that the
    bound alone does not clear (many large but applicable elements) is told apart exactly,
    element by element (only the tensors the native check did not clear). ``native=False``
    (an optimizer built with ``compile=False``) never loads or builds the native kernel.
    """
    flags = [_cleared(_values(t), native) for t in tensors]
    if any(f is False for f in flags):
        return False  # the native check is exact: no second look
    bounds = [(t, f) for t, f in zip(tensors, flags, strict=True) if not isinstance(f, bool)]
    if _all_true([f for _, f in bounds]):
        return True
    return all(bool((_values(t).abs() < SQUARE_OVERFLOW).all()) for t, _ in bounds)


def _all_true(flags: list[torch.Tensor]) -> bool:
    """Whether every 0-d bool tensor of ``flags`` is true: one host read per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return all(bool(torch.stack(fs).all()) for fs in by_device.values())


def _cleared(v: torch.Tensor, native: bool = True) -> bool | torch.Tensor:
    """Whether every element of ``v`` is finite with a finite float32 square: a ``bool``,
    exact, from the native check; else a 0-d bool tensor that is true only then (false may
    be a false alarm, which ``all_applicable`` then tells apart exactly).

    A contiguous float32, bfloat16 or float16 tensor on the CPU, where the native kernel
    builds (``fused.native_cleared``; silently skipped where it does not): the largest magnitude
    of its bit patterns, below 2**64's (the condition exactly: NaN and inf above it), on
    torch's threads; one read at memory speed (measured: 16.8M bf16 elements, one thread,
    2.6 ms against ``aminmax``'s 4.9).

    Without it: a contiguous float32 tensor on the CPU (with fewer than ``2**31`` elements,
    the count BLAS takes): its dot product with itself, a float32 sum of the squares
    (non-negative terms, so at least each one) that is inf when a square overflows (``|g| >=
    SQUARE_OVERFLOW``) or the sum does, NaN with a NaN or inf element. A contiguous bfloat16
    or float16 one on the CPU: its least and largest elements (``aminmax``, which a NaN makes
    NaN), both within ``SQUARE_OVERFLOW``: exactly the condition. Any other tensor: its
    2-norm, below ``SQUARE_OVERFLOW``.
    """
    exact = native_cleared(v) if native else None
    if exact is not None:
        return exact
    if v.device.type == "cpu" and v.is_contiguous():
        flat = v.view(-1)
        if v.dtype == torch.float32 and v.numel() < 2**31:
            squares: torch.Tensor = torch.dot(flat, flat)
            return squares < math.inf  # false for inf and NaN
        if v.dtype in (torch.bfloat16, torch.float16) and v.numel() > 0:
            lo, hi = torch.aminmax(flat)
            return (hi.float() < SQUARE_OVERFLOW) & (lo.float() > -SQUARE_OVERFLOW)
    norm: torch.Tensor = torch.linalg.vector_norm(v).float()
    return norm < SQUARE_OVERFLOW


def _values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of ``t`` (a sparse gradient's non-zeros)."""
    return t.coalesce().values() if t.is_sparse else t


def grad_stamp(g: torch.Tensor) -> tuple[int, int, int]:
    """What tells a changed gradient apart: assigning another tensor changes the id, an
    in-place edit bumps the version, ``grad.data = t`` swaps the storage."""
    return id(g), g.data_ptr(), g._version
