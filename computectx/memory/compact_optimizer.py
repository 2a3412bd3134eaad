"""``CompactOptimizer``: any ``torch.optim`` optimizer stepping the model's own parameters with
its state stored as ``ctx.optim_state`` (bf16, int8, fp8 or int4), without master copies.

The wrapper is a real ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and
``defaults`` are the very objects of the inner optimizer (as ``OffloadedOptimizer``'s are), so
LR schedulers and checkpoints work as with the inner class. The step is
``computectx.memory.state.Stepper``'s: one parameter at a time, state decoded into a reused
float32 scratch buffer, torch's own update (or the fused Adam(W) update), state encoded back;
a parameter below float32 (bf16/f16) is updated in float32 and written back with stochastic
rounding. Non-finite gradients skip the step, as ``OffloadedOptimizer`` skips it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, overload

import torch

from computectx.ctx import ComputeCtx
from computectx.memory._grad_health import GradHealth, check_max_norm
from computectx.memory._masters import MasterWeights, is_dtensor, normalise_groups
from computectx.memory.optimizer import OffloadedOptimizer
from computectx.memory.optimizer_state import check_optimizer_class, state_tensors
from computectx.memory.state.stepper import Stepper, below_f32, check_compile, check_seed
from computectx.memory.state.store import load_plan

__all__ = ["CompactOptimizer"]


class CompactOptimizer(torch.optim.Optimizer):
    """Step the model's parameters in place with optimizer state stored as ``ctx.optim_state``.

    ``optimizer_class(params, **optimizer_kwargs)`` is built on the model's parameters; any
    torch.optim class whose state tensors have the parameter's shape or are scalars works
    (AdamW, Adam, SGD, RMSprop, Adagrad, ...). Classes whose state does not (Adafactor,
    SparseAdam, LBFGS) are refused at construction, by name, when the stepper is used:
    under a compact ``ctx.optim_state`` or with a parameter below float32. Otherwise (f32
    state, f32 parameters) the inner optimizer steps as it would alone.

    State tensors with fewer than ``min_size`` elements and scalars (``step``) stay float32
    as torch made them. A bf16/f16 parameter is its own weight (no master copy): its update
    is computed in float32 and written back with stochastic rounding drawn from generators
    seeded by ``seed`` (the same on every rank under DDP, so the ranks stay identical), so
    updates smaller than half an ulp still move it on average. ``compile`` runs the fused
    Adam(W) update through ``torch.compile`` (``None``: on CUDA only).

    A ``step`` whose gradients hold an inf or NaN (or whose norm ``clip_grad_norm``
    measured as non-finite) changes no weight and no state, drops the gradients, warns
    (``RuntimeWarning``), sets ``last_step_skipped`` and counts ``skipped_steps``: the rule
    and the code of ``OffloadedOptimizer``. Parameters sharded by FSDP2 (DTensors) are
    refused: step them with ``OffloadedOptimizer(..., sharding=ShardedParams(mesh))``.

    ``state_dict()`` is torch's with packed state under ``"name.part"`` keys, plus
    ``"optim_state"`` (the format's text) and, with a parameter below float32,
    ``"master_rounding"`` (the generators); ``load_state_dict`` restores it bit for bit,
    converts a state saved under another format (``UserWarning`` naming both and the
    bound) and encodes plain float tensors (a torch or DCP checkpoint).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        ctx: ComputeCtx,
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        seed: int = 0,
        compile: bool | None = None,
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
        if issubclass(optimizer_class, (OffloadedOptimizer, CompactOptimizer)):
            raise TypeError(
                f"optimizer_class cannot itself be a {optimizer_class.__name__}; pass the "
                f"torch.optim class"
            )
        check_seed(seed)
        check_compile(compile)
        self._ctx = ctx
        self._seed = seed
        self._compile = compile
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = optimizer_kwargs
        self._inner: torch.optim.Optimizer | None = None
        self._stepper: Stepper | None = None
        # The gradient health of OffloadedOptimizer, over the parameters themselves (their
        # "masters" are the parameters: nothing is copied).
        self._weights = MasterWeights(ctx, "blocking", None)
        self._health = GradHealth(self._weights)
        self.last_step_skipped = False
        """Whether the most recent ``step`` skipped the update (non-finite gradients)."""
        self.skipped_steps = 0
        """How many steps were skipped for non-finite gradients."""
        super().__init__(normalise_groups(params), {})
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._ensure_stepper()

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer whose update runs on each parameter."""
        if self._inner is None:
            raise RuntimeError("the CompactOptimizer is still being constructed")
        return self._inner

    @property
    def ctx(self) -> ComputeCtx:
        """The policy this optimizer was built from (``ctx.optim_state`` is read)."""
        return self._ctx

    @property
    def stepper(self) -> Stepper | None:
        """The per-parameter stepper (``None``: f32 state and f32 parameters, torch's step)."""
        return self._stepper

    def _rounds(self) -> bool:
        return any(below_f32(p.dtype) for p in self._weights.master)

    def _ensure_stepper(self) -> None:
        if self._stepper is None and (self._ctx.optim_state.compact or self._rounds()):
            self._stepper = Stepper(
                self.inner,
                self._ctx.optim_state,
                seed=self._seed,
                compile=self._compile,
                who="CompactOptimizer",
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters (checked before anything is added)."""
        if not isinstance(param_group, Mapping):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        inner = self._inner
        where = f"param_groups[{0 if inner is None else len(inner.param_groups)}]"
        raw = param_group.get("params")
        listed = [raw] if isinstance(raw, torch.Tensor) else list(raw or [])
        for i, p in enumerate(listed):
            if isinstance(p, torch.Tensor) and is_dtensor(p):
                raise TypeError(
                    f"{where}['params'][{i}] is a DTensor (a parameter sharded by FSDP2); "
                    f"CompactOptimizer steps plain tensors: use OffloadedOptimizer(params, "
                    f"ctx, sharding=computectx.distributed.ShardedParams(mesh)), which keeps "
                    f"each rank's shard and its compact state"
                )
        params = self._weights.check_group(dict(param_group), where)
        group = {**param_group, "params": params}
        if inner is None:
            self._inner = self._optimizer_class([group], **self._optimizer_kwargs)
        else:
            inner.add_param_group(group)
        self._weights.add(params, params)
        if inner is not None:
            self._ensure_stepper()

    # ----- the step -------------------------------------------------------------------

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients to total norm ``max_norm``; return the norm before.

        ``math.inf`` measures only. A non-finite norm makes the next ``step`` skip.
        """
        check_max_norm(max_norm)
        return self._health.clip(max_norm, norm_type)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step every parameter with a gradient; skipped for inf or NaN gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._health.finite():
            self.skipped_steps += 1
            self.last_step_skipped = True
            for p in self._weights.master:
                p.grad = None
            self._health.forget()
            warnings.warn(
                f"CompactOptimizer.step() skipped the update: the gradients hold inf or NaN "
                f"values and were dropped ({self.skipped_steps} step(s) skipped so far)",
                RuntimeWarning,
                stacklevel=2,
            )
            return loss
        if self._stepper is None:
            self.inner.step()
        else:
            self._stepper.step()
        self.last_step_skipped = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients."""
        self.inner.zero_grad(set_to_none=set_to_none)
        self._health.forget()

    # ----- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict (packed state under ``"name.part"``) plus ``"optim_state"`` and,
        with a parameter below float32, ``"master_rounding"``."""
        sd = dict(super().state_dict())
        if self._stepper is not None:
            sd.update(self._stepper.extras(self._rounds()))
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore groups and state; all of it is checked before anything changes.

        Another optimizer class's state is refused (``ValueError`` naming both), as are bad
        packed parts (``ValueError`` naming the key) and bad rounding generators. A state
        saved under another ``optim_state`` is converted with a ``UserWarning``.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        inner = self.inner
        check_optimizer_class(
            state_dict, type(inner), inner.defaults, "CompactOptimizer.load_state_dict"
        )
        stepper = self._stepper
        plan = load_plan(
            state_dict,
            self.param_groups,
            self._ctx.optim_state,
            stepped=stepper is not None,
            who="CompactOptimizer.load_state_dict",
        )
        rounding = None
        if stepper is not None and self._rounds():
            devices = [p.device for p in self._weights.master if below_f32(p.dtype)]
            rounding = stepper.checked_rounding(plan.rounding, devices)
        super().load_state_dict(plan.torch_sd)
        plan.finish(self.state)
        if stepper is not None:
            stepper.forget()
            if rounding is not None:
                stepper.rounding = rounding

    def __setstate__(self, state: dict[str, Any]) -> None:
        inner = self.inner
        inner.__setstate__(state)
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "CompactOptimizer cannot be pickled or deep-copied; save state_dict() and build "
            "a new one around the model"
        )

    def __repr__(self) -> str:
        inner = repr(self.inner).replace("\n", "\n  ")
        return f"CompactOptimizer(optim_state={self._ctx.optim_state}, inner={inner})"

    # ----- accounting -----------------------------------------------------------------

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``("grads", p.grad)`` per gradient, ``("optimizer_state", t)`` per stored state
        tensor (packed parts), ``("scratch", buffer)`` per scratch buffer. The parameters
        are the model's and are not included."""
        for p in self._weights.master:
            if p.grad is not None:
                yield "grads", p.grad
        for per_param in self.state.values():
            yield from (("optimizer_state", t) for t in state_tensors(per_param))
        if self._stepper is not None:
            for buffer in self._stepper.scratch_buffers():
                yield "scratch", buffer
