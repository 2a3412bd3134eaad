"""Gradient ingest: moving gradients onto an ``OffloadedOptimizer``'s master weights.

Gradients come from a ``LowPrecGradAccumulator`` (its sums are handed over) and from the
compute parameters' ``.grad``; either way they are added to the masters' ``.grad`` at the
master dtype, on the offload device.

A master gradient that a step has applied (``mark_applied``) and that no ``zero_grad`` has
cleared is replaced, not added to, by the next gradient ingested for it: the master gradient
then holds what torch's ``param.grad`` would hold when the user assigns ``param.grad`` each
step without ``zero_grad`` (``torch.autograd.grad`` style), and gradients ingested between
two steps still add up.
"""

from __future__ import annotations

import torch

from computectx.memory._transfer import Staging, uses_staging
from computectx.memory.accumulator import LowPrecGradAccumulator
from computectx.memory.optim._masters import MasterWeights, is_dtensor

__all__ = ["GradIngest"]


class GradIngest:
    """Adds gradients to the masters of ``weights``; owns the download staging buffers."""

    def __init__(self, weights: MasterWeights) -> None:
        self.weights = weights
        self._staging: dict[int, Staging] = {}  # download buffers, by position
        self._applied: set[int] = set()  # positions whose master gradient a step applied

    def holds_nothing(self, i: int) -> bool:
        """Whether master ``i``'s gradient holds nothing the next ingest keeps: none, or one a
        step applied (replaced)."""
        return self.weights.master[i].grad is None or i in self._applied

    def mark_applied(self) -> None:
        """A step applied the master gradients: the next gradient ingested for a master
        replaces its gradient instead of adding to it."""
        self._applied = {i for i, mp in enumerate(self.weights.master) if mp.grad is not None}

    def clear_applied(self) -> None:
        """The master gradients were set to ``None`` (``zero_grad``)."""
        self._applied.clear()

    def add(self, i: int, master: torch.Tensor, g: torch.Tensor) -> None:
        """Add ``g`` to master ``i``'s gradient (replacing it where a step applied it)."""
        if i in self._applied:
            self._applied.discard(i)
            master.grad = None
        add_grad(master, g)

    def from_accumulator(self, accumulator: LowPrecGradAccumulator) -> bool:
        """Hand ``accumulator``'s sums over to the masters (they are emptied there); return
        whether any gradient moved.

        Checked before anything moves: the accumulator tracks some of these parameters, and
        no tracked parameter has a ``param.grad`` written after the accumulator drained it
        (DDP's reducer does that), which would be a gradient the sums never saw.
        """
        if not isinstance(accumulator, LowPrecGradAccumulator):
            raise TypeError(
                f"accumulator must be a LowPrecGradAccumulator, got {type(accumulator).__name__}"
            )
        compute = self.weights.compute
        if not any(accumulator.tracks(p) for p in compute):
            raise ValueError(
                "the accumulator tracks none of this optimizer's parameters; build it "
                "from the same parameters (e.g. model.parameters())"
            )
        sharded = [i for i, p in enumerate(compute) if accumulator.tracks(p) and is_dtensor(p)]
        if sharded:
            raise TypeError(
                f"parameters {sharded[:8]} are DTensors (FSDP2 fully_shard), so their sums in "
                f"the LowPrecGradAccumulator are DTensors too, which the masters (this rank's "
                f"plain shards) cannot take. FSDP2 reduce-scatters and sums gradients itself: "
                f"build no accumulator, leave "
                f"param.grad to FSDP2 (set_requires_gradient_sync(False) on all but the last "
                f"micro-batch skips the reduce-scatters) and let clip_grad_norm / step ingest "
                f"each rank's shard. Nothing was ingested"
            )
        accumulator.sync()
        late = (
            []
            if accumulator.closed
            else [i for i, p in enumerate(compute) if p.grad is not None and accumulator.tracks(p)]
        )
        if late:
            raise RuntimeError(
                f"{len(late)} parameter(s) drained by the LowPrecGradAccumulator (indices "
                f"{late[:8]}) have a param.grad written after the accumulator took their "
                f"gradient. Under DistributedDataParallel this is the reducer writing its "
                f"all-reduced gradient after the hook drained the local one, so the sums "
                f"were never reduced across ranks; use "
                f"computectx.distributed.DataParallelGradAccumulator(ddp_model, ctx) "
                f"instead. Otherwise set param.grad only on parameters the accumulator "
                f"does not track, or close() it first. Nothing was ingested"
            )
        moved = False
        with torch.no_grad():
            for i, (cp, mp) in enumerate(zip(compute, self.weights.master, strict=True)):
                buf = accumulator.pop(cp)
                if buf is not None:
                    self.add(i, mp, buf)
                    moved = True
        return moved

    def from_param_grads(self) -> bool:
        """Move every compute ``param.grad`` onto its master (``param.grad`` becomes ``None``).

        Staged copies (see ``transfer``) are all issued before any is waited on. Returns
        whether any gradient moved.
        """
        weights = self.weights
        staged: list[tuple[int, Staging, torch.Tensor]] = []
        moved = False
        with torch.no_grad():
            for i, (cp, mp) in enumerate(zip(weights.compute, weights.master, strict=True)):
                g = cp.grad
                if g is None:
                    continue
                cp.grad = None
                moved = True
                g = weights.local(g.detach())
                if uses_staging(weights.transfer, g.device, mp.device):
                    st = self._staging.get(i)
                    if st is None or st.buffer.dtype != g.dtype:
                        st = Staging(g.shape, g.dtype, host=mp.device, peer=g.device)
                        self._staging[i] = st
                    st.fill_from(g)
                    staged.append((i, st, mp))
                else:
                    self.add(i, mp, g)
            for i, st, mp in staged:
                st.wait()
                # The staging buffer is reused, so the master gradient must be a copy of it.
                self.add(i, mp, st.buffer.to(mp.dtype, copy=True))
        return moved

    def staging_buffers(self) -> list[torch.Tensor]:
        """The download staging buffers allocated so far (for ``memory_report``)."""
        return [st.buffer for st in self._staging.values()]


def add_grad(master: torch.Tensor, g: torch.Tensor) -> None:
    """Add ``g`` to ``master.grad`` (set it when there is none), at the master's dtype and in
    the master's layout: a weight whose layout changed after the optimizer was built (a
    ``channels_last`` move, ``param.data = t`` of other strides) has gradients of its new
    strides, which torch's fused kernels would read as the master's."""
    if g.layout != torch.strided or g.stride() == master.stride():  # sparse: as it is
        g = g.to(device=master.device, dtype=master.dtype)
    else:
        g = torch.empty_like(master).copy_(g)
    if master.grad is None:
        master.grad = g
    else:
        master.grad.add_(g)
