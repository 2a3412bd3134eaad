"""``OffloadedOptimizer``: any ``torch.optim`` optimizer stepping master weights on ``ctx.offload``.

The wrapper is a real ``torch.optim.Optimizer``, built by ``Optimizer.__init__``, but holds
no optimizer state of its own: ``param_groups``, ``state`` and ``defaults`` are the very
objects of the inner (master) optimizer, so LR schedulers write the learning rate the
master step reads, and ``state_dict`` describes exactly one optimizer.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, Protocol, overload

import torch

from computectx.ctx import ComputeCtx
from computectx.memory._transfer import Staging, Transfer, check_transfer, uses_staging
from computectx.memory.accumulator import LowPrecGradAccumulator

__all__ = ["OffloadedOptimizer", "Sharding", "state_tensors"]

MASTER_WEIGHTS = "master_weights"
"""The key under which ``OffloadedOptimizer.state_dict()`` holds the master weights."""


class Sharding(Protocol):
    """How the compute parameters are split across ranks (``sharding=`` of the optimizer).

    ``computectx.distributed.ShardedParams`` is the implementation for FSDP2; the memory
    layer itself never talks to ``torch.distributed``.
    """

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a compute parameter or gradient, as a plain tensor (a view)."""
        ...

    def all_reduce(self, values: torch.Tensor, op: Literal["sum", "max"]) -> torch.Tensor:
        """``values`` (a small f64 tensor on the CPU) reduced over the ranks sharing the params."""
        ...


def _normalise_groups(params: Any) -> list[dict[str, Any]]:
    if isinstance(params, (torch.Tensor, torch.nn.Module)):
        raise TypeError(
            f"params must be an iterable of tensors or of param-group dicts (e.g. "
            f"model.parameters()), got {type(params).__name__}"
        )
    try:
        items = list(params)
    except TypeError:
        raise TypeError(
            f"params must be an iterable of tensors or of param-group dicts, got "
            f"{type(params).__name__}"
        ) from None
    if not items:
        raise ValueError("OffloadedOptimizer got an empty parameter list")
    if all(isinstance(g, Mapping) for g in items):
        return [dict(g) for g in items]
    if any(isinstance(g, Mapping) for g in items):
        raise TypeError("params mixes tensors and param-group dicts; pass one kind")
    return [{"params": items}]


_GradStamp = tuple[int, int, int] | None


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """Whether the master gradients were finite, and which gradients that was said of."""

    stamps: tuple[_GradStamp, ...]
    finite: bool


class OffloadedOptimizer(torch.optim.Optimizer):
    """Step master weights (``ctx.master``) and optimizer state on ``ctx.offload_device``.

    The compute parameters stay where they are; each gets a master copy at ``ctx.master``
    on the offload device, and ``optimizer_class(master_groups, **optimizer_kwargs)`` steps
    those. One step is: ``ingest_grads`` (move gradients from an accumulator and/or
    ``param.grad`` onto the masters), optional ``clip_grad_norm``, ``step`` (step the
    masters, copy them back into the compute parameters at their dtype), ``zero_grad``.
    ``step`` ingests any ``param.grad`` left behind, so ``loss.backward(); opt.step()``
    works as with any torch optimizer.

    Non-finite gradients are never applied, and nothing else is needed: a ``step`` whose
    gradients hold an inf or NaN (or whose norm ``clip_grad_norm`` measured as inf or NaN)
    drops them, changes no weight and no optimizer state, warns (``RuntimeWarning``), sets
    ``last_step_skipped`` and counts itself in ``skipped_steps``. No decision carries over
    to a later step. The check reuses the norm of ``clip_grad_norm`` when the gradients are
    unchanged since it was measured; otherwise it is one summing pass over the master
    gradients, which waits for the device when they live on a GPU.

    ``transfer`` (keyword, a ``Transfer``) picks how gradients and weights cross devices:
    ``"auto"`` (default) stages them through one reused pinned host buffer per parameter
    exactly for CUDA <-> CPU, ``"blocking"`` always copies directly, ``"staged"`` always
    stages (also between tensors on one device). ``state_dict`` is the inner optimizer's
    plus the master weights under ``"master_weights"``, so a resume is exact even when the
    compute copy is lower precision. LBFGS is rejected: it re-evaluates its closure against
    the tensors it steps, which here are the masters, not the model.

    ``sharding`` (keyword, a ``Sharding``) is for parameters split across ranks (FSDP2's
    DTensors): each master is then this rank's local shard as a plain tensor on the offload
    device, optimizer state is per shard, ``clip_grad_norm`` measures the global norm with
    one all-reduce, and the skip decision for non-finite gradients is taken by all ranks
    together. ``computectx.distributed.ShardedParams(mesh)`` provides it; see
    docs/distributed.md. Under DDP no sharding is needed: the gradients the masters receive
    are already reduced, so every rank measures the same global norm.

    Weights changed outside the optimizer between steps (``model.load_state_dict``,
    ``load_weights``, an in-place edit under ``no_grad``) are adopted: ``step`` and
    ``state_dict`` first copy every such compute parameter into its master, so the next
    update starts from the new weights, as a plain torch optimizer's would, instead of
    overwriting them with the old master. Optimizer state (moments) is kept, as torch keeps it.
    """

    def __init__(
        self,
        params_or_groups: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        ctx: ComputeCtx,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        transfer: Transfer = "auto",
        sharding: Sharding | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not isinstance(ctx, ComputeCtx):
            raise TypeError(f"ctx must be a ComputeCtx, got {type(ctx).__name__}")
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
                f"torch.optim.AdamW), got {optimizer_class!r}"
            )
        if issubclass(optimizer_class, OffloadedOptimizer):
            raise TypeError("optimizer_class cannot itself be an OffloadedOptimizer")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS re-evaluates its closure several times per step against the tensors "
                "it optimizes, which here are the offloaded master copies, not the model; "
                "use LBFGS directly on the model's parameters"
            )
        self._transfer: Transfer = check_transfer(transfer)
        if sharding is not None and not (
            callable(getattr(sharding, "local", None))
            and callable(getattr(sharding, "all_reduce", None))
        ):
            raise TypeError(
                f"sharding must be a Sharding (e.g. computectx.distributed.ShardedParams(mesh)) "
                f"or None, got {type(sharding).__name__}"
            )
        self._sharding = sharding
        self._ctx = ctx
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = optimizer_kwargs
        self._master_optimizer: torch.optim.Optimizer | None = None
        self._compute: list[torch.Tensor] = []
        self._master: list[torch.Tensor] = []
        self._seen: list[tuple[int, int]] = []
        self._grad_staging: dict[int, Staging] = {}
        self._param_staging: dict[int, Staging] = {}
        self._verdict: _Verdict | None = None
        self.last_step_skipped = False
        """Whether the most recent ``step`` skipped the update (non-finite gradients)."""
        self.skipped_steps = 0
        """How many steps were skipped for non-finite gradients."""
        # Optimizer.__init__ hands each group to add_param_group (below), which builds the
        # master optimizer from the first group and adds the rest to it, as torch does.
        super().__init__(_normalise_groups(params_or_groups), {})
        # One set of groups, state and defaults: the base class's (still empty) ones are
        # replaced by the master optimizer's objects themselves, so a scheduler writing
        # ``lr`` into a group writes what the master step reads.
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer that steps the master weights."""
        if self._master_optimizer is None:
            raise RuntimeError("the OffloadedOptimizer is still being constructed")
        return self._master_optimizer

    @property
    def transfer(self) -> Transfer:
        """How gradients and weights cross devices (the ``transfer`` constructor option)."""
        return self._transfer

    @property
    def sharding(self) -> Sharding | None:
        """How the parameters are split across ranks (``None``: each rank holds them whole)."""
        return self._sharding

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._sharding is None else self._sharding.local(t)

    @property
    def ctx(self) -> ComputeCtx:
        """The policy this optimizer was built from."""
        return self._ctx

    @property
    def compute_params(self) -> tuple[torch.Tensor, ...]:
        """The model's parameters, in param-group order."""
        return tuple(self._compute)

    @property
    def master_params(self) -> tuple[torch.Tensor, ...]:
        """The master copies, aligned with ``compute_params``."""
        return tuple(self._master)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The master copy of compute parameter ``param``."""
        for cp, mp in zip(self._compute, self._master, strict=True):
            if cp is param:
                return mp
        raise ValueError(f"the tensor of shape {tuple(param.shape)} is not optimized here")

    # ----- construction helpers -------------------------------------------------------

    def _check_group(self, group: dict[str, Any], where: str, seen: set[int]) -> list[torch.Tensor]:
        if "params" not in group:
            raise ValueError(f"{where} has no 'params' key; got keys {sorted(group)}")
        raw = group["params"]
        compute = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        known = {id(p) for p in self._compute}
        for i, p in enumerate(compute):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{where}['params'][{i}] is a {type(p).__name__}, not a tensor")
            if not p.is_leaf:
                raise ValueError(f"{where}['params'][{i}] is not a leaf tensor; can't optimize it")
            if not p.is_floating_point():
                raise TypeError(
                    f"{where}['params'][{i}] has dtype {p.dtype}; only floating tensors "
                    f"can be optimized"
                )
            if self._sharding is None and hasattr(p, "placements") and hasattr(p, "to_local"):
                raise TypeError(
                    f"{where}['params'][{i}] is a DTensor (a parameter sharded by FSDP2 "
                    f"fully_shard); pass sharding=computectx.distributed.ShardedParams(mesh) "
                    f"so that the masters are this rank's local shards and clip_grad_norm "
                    f"measures the global norm"
                )
            if id(p) in known or id(p) in seen:
                raise ValueError(
                    f"{where}['params'][{i}] (shape {tuple(p.shape)}) appears more than once "
                    f"in this optimizer's parameters"
                )
            seen.add(id(p))
        return compute

    def _make_master(self, p: torch.Tensor) -> torch.Tensor:
        data = self._local(p.detach()).to(
            device=self._ctx.offload_device, dtype=self._ctx.master.torch, copy=True
        )
        return torch.nn.Parameter(data, requires_grad=p.requires_grad)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of compute parameters; their masters join the inner optimizer.

        Options the group leaves out take the inner optimizer's defaults. Everything is
        checked before anything is added.
        """
        if not isinstance(param_group, Mapping):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        inner = self._master_optimizer
        where = f"param_groups[{0 if inner is None else len(inner.param_groups)}]"
        compute = self._check_group(dict(param_group), where, seen=set())
        masters = [self._make_master(p) for p in compute]
        master_group = {**param_group, "params": masters}
        if inner is None:
            # Optimizer.__init__ passes the first group: the optimizer class is built on it
            # (and checks its keyword arguments) here.
            self._master_optimizer = self._optimizer_class([master_group], **self._optimizer_kwargs)
        else:
            inner.add_param_group(master_group)
        self._compute.extend(compute)
        self._master.extend(masters)
        self._seen.extend(_stamp(self._local(p)) for p in compute)

    # ----- gradients ------------------------------------------------------------------

    def ingest_grads(self, accumulator: LowPrecGradAccumulator | None = None) -> None:
        """Move gradients onto the master copies (adding to any already there).

        From ``accumulator`` (its sums are handed over and emptied) when given, then from
        every compute ``param.grad`` (which becomes ``None``). Staged copies (see
        ``transfer``) are all issued before any is waited on.
        """
        if accumulator is not None:
            if not isinstance(accumulator, LowPrecGradAccumulator):
                raise TypeError(
                    f"accumulator must be a LowPrecGradAccumulator, got "
                    f"{type(accumulator).__name__}"
                )
            if not any(accumulator.tracks(p) for p in self._compute):
                raise ValueError(
                    "the accumulator tracks none of this optimizer's parameters; build it "
                    "from the same parameters (e.g. model.parameters())"
                )
            accumulator.sync()
            late = (
                []
                if accumulator.closed
                else [
                    i
                    for i, p in enumerate(self._compute)
                    if p.grad is not None and accumulator.tracks(p)
                ]
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
        with torch.no_grad():
            if accumulator is not None:
                for cp, mp in zip(self._compute, self._master, strict=True):
                    buf = accumulator.pop(cp)
                    if buf is not None:
                        self._add_master_grad(mp, buf)
            self._ingest_param_grads()

    def _ingest_param_grads(self) -> None:
        staged: list[tuple[Staging, torch.Tensor]] = []
        for i, (cp, mp) in enumerate(zip(self._compute, self._master, strict=True)):
            g = cp.grad
            if g is None:
                continue
            cp.grad = None
            g = self._local(g.detach())
            if uses_staging(self._transfer, g.device, mp.device):
                st = self._grad_staging.get(i)
                if st is None or st.buffer.dtype != g.dtype:
                    st = Staging(g.shape, g.dtype, host=mp.device, peer=g.device)
                    self._grad_staging[i] = st
                st.fill_from(g)
                staged.append((st, mp))
            else:
                self._add_master_grad(mp, g)
        for st, mp in staged:
            st.wait()
            # The staging buffer is reused, so the master gradient must be a copy of it.
            self._add_master_grad(mp, st.buffer.to(mp.dtype, copy=True))

    def _add_master_grad(self, master: torch.Tensor, g: torch.Tensor) -> None:
        g = g.to(device=master.device, dtype=master.dtype)
        if master.grad is None:
            master.grad = g
        else:
            master.grad.add_(g)
        self._verdict = None

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the master gradients to total norm ``max_norm``; return the norm before.

        ``max_norm=math.inf`` measures without clipping. ``param.grad`` left on the compute
        parameters is ingested first. A non-finite norm (an inf or NaN gradient) is returned
        as is, and the next ``step`` skips these gradients without being told; nothing
        else is needed, and ``zero_grad`` leaves nothing pending. The norm is also what
        that ``step`` decides by, so it need not look at the gradients again. With a
        ``sharding`` the norm is the global one over every rank's shards (one all-reduce).
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"max_norm must be a number, got {max_norm!r}")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (math.inf to only measure), got {max_norm}")
        with torch.no_grad():
            self._ingest_param_grads()
        with_grads = [mp for mp in self._master if mp.grad is not None]
        if self._sharding is None:
            norm = float(
                torch.nn.utils.clip_grad_norm_(with_grads, float(max_norm), norm_type=norm_type)
            )
        else:
            norm = self._clip_sharded(self._sharding, with_grads, float(max_norm), float(norm_type))
        # Stamped after clipping (which rewrote the gradients in place), so any later change
        # to them, ours or the caller's, makes step() check again.
        self._verdict = _Verdict(self._grad_stamps(), math.isfinite(norm))
        return norm

    def _clip_sharded(
        self, sharding: Sharding, masters: list[torch.Tensor], max_norm: float, p: float
    ) -> float:
        # The global norm of gradients split across ranks: the local shards' sum of |g|^p
        # (max |g| for p=inf) all-reduced, then the p-th root. Clipping then scales each
        # local shard as torch.nn.utils.clip_grad_norm_ scales a whole gradient.
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

    def _grad_stamps(self) -> tuple[_GradStamp, ...]:
        return tuple(None if mp.grad is None else _grad_stamp(mp.grad) for mp in self._master)

    def _grads_are_finite(self) -> bool:
        verdict = self._verdict
        if verdict is not None and verdict.stamps == self._grad_stamps():
            return verdict.finite
        finite = _all_finite([mp.grad for mp in self._master if mp.grad is not None])
        if self._sharding is None:
            return finite
        # Every rank must take the same decision, or the shards of one weight diverge.
        bad = torch.tensor([0.0 if finite else 1.0], dtype=torch.float64)
        return bool(self._sharding.all_reduce(bad, "max")[0] == 0.0)

    # ----- the step -------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step the masters and copy them into the model; skipped for inf or NaN gradients.

        A ``closure`` is evaluated once (with grad enabled) before the step, and the
        gradients it leaves in ``param.grad`` are ingested. When any gradient about to be
        applied is inf or NaN (or ``clip_grad_norm`` measured a non-finite norm for these
        gradients), the step is skipped instead: the gradients are dropped, weights and
        optimizer state are untouched, a ``RuntimeWarning`` says so, ``last_step_skipped``
        is set and ``skipped_steps`` counts it. Returns the closure's loss, if any.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._ingest_param_grads()
        if not self._grads_are_finite():
            self.skipped_steps += 1
            self.last_step_skipped = True
            self._drop_master_grads()
            warnings.warn(
                f"OffloadedOptimizer.step() skipped the update: the gradients hold inf or "
                f"NaN values and were dropped ({self.skipped_steps} step(s) skipped so far)",
                RuntimeWarning,
                stacklevel=2,
            )
            return loss
        self._adopt_outside_edits()
        if all(mp.grad is None for mp in self._master):
            warnings.warn(
                "OffloadedOptimizer.step() found no gradient on any parameter; if a "
                "LowPrecGradAccumulator holds them, call ingest_grads(accumulator) first",
                RuntimeWarning,
                stacklevel=2,
            )
        self.inner.step()
        self._sync_to_compute()
        self.last_step_skipped = False
        return loss

    def _drop_master_grads(self) -> None:
        for mp in self._master:
            mp.grad = None
        self._verdict = None

    def _adopt_outside_edits(self) -> None:
        # A compute parameter whose storage or version counter moved since the last sync was
        # written by someone else; its master would otherwise undo that write at the next
        # sync. Reading the stamps costs no device work.
        with torch.no_grad():
            for i, (cp, mp) in enumerate(zip(self._compute, self._master, strict=True)):
                local = self._local(cp)
                stamp = _stamp(local)
                if stamp != self._seen[i]:
                    mp.copy_(local)
                    self._seen[i] = stamp

    def _sync_to_compute(self) -> None:
        with torch.no_grad():
            for i, (cp, mp) in enumerate(zip(self._compute, self._master, strict=True)):
                dst = self._local(cp)
                if uses_staging(self._transfer, dst.device, mp.device):
                    st = self._param_staging.get(i)
                    if st is None:
                        st = Staging(dst.shape, dst.dtype, host=mp.device, peer=dst.device)
                        self._param_staging[i] = st
                    # The previous upload may still be reading the buffer.
                    st.wait()
                    st.buffer.copy_(mp)  # the cast to the compute dtype runs on the host
                    st.drain_to(dst)
                else:
                    dst.copy_(mp)
                self._seen[i] = _stamp(dst)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the master gradients and any ``param.grad`` on the compute parameters."""
        self.inner.zero_grad(set_to_none=set_to_none)
        self._verdict = None
        for cp in self._compute:
            if cp.grad is None:
                continue
            if set_to_none:
                cp.grad = None
            else:
                cp.grad.detach_()
                cp.grad.zero_()

    # ----- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"master_weights"`` (index -> tensor)."""
        self._adopt_outside_edits()
        sd = dict(super().state_dict())
        sd[MASTER_WEIGHTS] = dict(enumerate(self._master))
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore state, groups and master weights, then refresh the compute parameters.

        Without ``"master_weights"`` (e.g. a plain torch optimizer's state dict) the
        masters are rebuilt from the current compute parameters. Everything is validated
        before anything changes.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        sd = dict(state_dict)
        saved = sd.pop(MASTER_WEIGHTS, None)
        masters: list[torch.Tensor] | None = None
        if saved is not None:
            masters = self._check_saved_masters(saved)
        for key in ("state", "param_groups"):
            if key not in sd:
                raise ValueError(f"state_dict has no {key!r} entry; got keys {sorted(sd)}")
        super().load_state_dict(sd)
        with torch.no_grad():
            sources = masters if masters is not None else self._compute
            for mp, src in zip(self._master, sources, strict=True):
                mp.copy_(self._local(src))
        self._sync_to_compute()

    def _check_saved_masters(self, saved: Any) -> list[torch.Tensor]:
        if not isinstance(saved, Mapping):
            raise TypeError(f"state_dict[{MASTER_WEIGHTS!r}] must be a mapping index -> tensor")
        want = set(range(len(self._master)))
        if set(saved) != want:
            missing = sorted(want - set(saved))
            extra = sorted(set(saved) - want, key=str)
            raise ValueError(
                f"state_dict[{MASTER_WEIGHTS!r}] does not match this optimizer's "
                f"{len(self._master)} parameters: missing indices {missing}, unexpected {extra}"
            )
        out = []
        for i, mp in enumerate(self._master):
            t = saved[i]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state_dict[{MASTER_WEIGHTS!r}][{i}] is not a tensor")
            if t.shape != mp.shape or t.dtype != mp.dtype:
                raise ValueError(
                    f"state_dict[{MASTER_WEIGHTS!r}][{i}] is {t.dtype}{list(t.shape)}, but the "
                    f"master weight is {mp.dtype}{list(mp.shape)} (ctx.master="
                    f"{self._ctx.master}); the checkpoint was made under another policy"
                )
            out.append(t)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Optimizer.load_state_dict installs the loaded groups and state through
        # __setstate__. The master optimizer takes them (its class fills in the options it
        # needs), and the wrapper goes on sharing its objects.
        inner = self.inner
        inner.__setstate__(state)
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "OffloadedOptimizer cannot be pickled or deep-copied; save state_dict() and "
            "build a new one around the model"
        )

    def __repr__(self) -> str:
        inner = repr(self.inner).replace("\n", "\n  ")
        return (
            f"OffloadedOptimizer(master={self._ctx.master}, "
            f"device={self._ctx.offload_device}, inner={inner})"
        )

    # ----- accounting -----------------------------------------------------------------

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor this optimizer holds, with its role for ``memory_report``.

        ``("master", w)`` and, while it exists, ``("grads", w.grad)`` per master weight;
        ``("optimizer_state", t)`` per tensor in the inner optimizer's state; and
        ``("staging", buffer)`` per staging buffer. The compute parameters are the model's
        and are not included.
        """
        for mp in self._master:
            yield "master", mp
            if mp.grad is not None:
                yield "grads", mp.grad
        for per_param in self.state.values():
            yield from (("optimizer_state", t) for t in state_tensors(per_param))
        for st in (*self._grad_staging.values(), *self._param_staging.values()):
            yield "staging", st.buffer


def state_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in an optimizer's ``state`` (or in one entry of it).

    Nested mappings, lists and tuples are walked; anything else is skipped.
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from state_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from state_tensors(v)


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether no element of ``tensors`` is inf or NaN; one host sync with their device."""
    if not tensors:
        return True
    # A sum is finite only if every term is: inf and NaN never add back to a finite value.
    # Summing is the cheapest full read (measured on CPU: a third of a 2-norm, a tenth of
    # a max-|g|); the rare finite tensor whose sum overflows is told apart exactly.
    sums = torch.stack([t.sum() for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _stamp(p: torch.Tensor) -> tuple[int, int]:
    # In-place writes bump the version counter; ``param.data = t`` swaps the storage.
    return p.data_ptr(), p._version


def _grad_stamp(g: torch.Tensor) -> tuple[int, int, int]:
    # Our own writes to master gradients drop the verdict outright; this catches the
    # caller's: assigning another tensor changes the id, an in-place edit bumps the version,
    # ``grad.data = t`` swaps the storage.
    return id(g), g.data_ptr(), g._version
