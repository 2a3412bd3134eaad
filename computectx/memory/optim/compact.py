"""``CompactOptimizer``: any ``torch.optim`` optimizer stepping the model's own parameters with
its state stored as ``ctx.optim_state`` (bf16, int8, fp8 or int4), without master copies.

The wrapper is a real ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and
``defaults`` are the very objects of the inner optimizer (as ``OffloadedOptimizer``'s are), so
LR schedulers and checkpoints work as with the inner class. The step is
``computectx.memory.optim.stepper.Stepper``'s: one parameter at a time, state decoded into a reused
float32 scratch buffer, torch's own update (or the fused Adam(W) update), state encoded back;
a parameter below float32 (bf16/f16) is updated in float32 and written back with stochastic
rounding. Non-finite gradients skip the step, as ``OffloadedOptimizer`` skips it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from computectx.ctx import ComputeCtx
from computectx.memory.optim._masters import MasterWeights, is_dtensor
from computectx.memory.optim._wrapper import InnerWrapper
from computectx.memory.optim.offloaded import OffloadedOptimizer

__all__ = ["CompactOptimizer"]


class CompactOptimizer(InnerWrapper):
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
    updates smaller than half an ulp still move it on average. ``compile`` picks how the
    fused Adam(W) update runs: ``None`` (default) or ``True``, on the CPU the native kernel
    (its torch-ops twin where the kernel cannot be built), on CUDA through ``torch.compile``;
    ``False``, the twin eagerly (docs/memory.md, "The compact step's implementation").

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

    _who = "CompactOptimizer"

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
        self._check_args(ctx, optimizer_class, seed, compile)
        # The gradient health of OffloadedOptimizer, over the parameters themselves (their
        # "masters" are the parameters: nothing is copied).
        weights = MasterWeights(ctx, "blocking", None)
        super().__init__(
            params, weights, optimizer_class, optimizer_kwargs, seed=seed, compile=compile
        )

    @classmethod
    def _refuse(cls, optimizer_class: type[torch.optim.Optimizer]) -> None:
        if issubclass(optimizer_class, (OffloadedOptimizer, CompactOptimizer)):
            raise TypeError(
                f"optimizer_class cannot itself be a {optimizer_class.__name__}; pass the "
                f"torch.optim class"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of parameters (checked before anything is added)."""
        where = self._where(param_group)
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
        self._join({**param_group, "params": params}, params, params)

    # ----- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict (packed state under ``"name.part"``) plus ``"optim_state"`` and,
        with a parameter below float32, ``"master_rounding"``."""
        return self._with_extras(dict(super().state_dict()))

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore groups and state; all of it is checked before anything changes.

        Another optimizer class's state is refused (``ValueError`` naming both), as are bad
        packed parts (``ValueError`` naming the key) and bad rounding generators. A state
        saved under another ``optim_state`` is converted with a ``UserWarning``.
        """
        self._load(self._checked(state_dict))

    def _repr_fields(self) -> str:
        return f"optim_state={self.ctx.optim_state}"

    # ----- accounting -----------------------------------------------------------------

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``("grads", p.grad)`` per gradient, ``("optimizer_state", t)`` per stored state
        tensor (packed parts), ``("scratch", buffer)`` per scratch buffer. The parameters
        are the model's and are not included."""
        for p in self._weights.master:
            if p.grad is not None:
                yield "grads", p.grad
        yield from self._state_tensors()
        yield from self._scratch_tensors()
