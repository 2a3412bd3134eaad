"""What ``OffloadedOptimizer`` and ``CompactOptimizer`` share: a ``torch.optim.Optimizer``
around an inner torch optimizer whose ``param_groups``, ``state`` and ``defaults`` it holds.

``InnerWrapper`` is built by ``Optimizer.__init__``, which hands each group to the
subclass's ``add_param_group``: the first builds the inner optimizer, the rest join it.
The wrapper then holds no optimizer state of its own: its groups, state and defaults are the
inner optimizer's very objects, so LR schedulers write the learning rate the inner step
reads, and ``state_dict`` describes exactly one optimizer. It also keeps what both steps
share: the step itself (``step``: check the state, skip non-finite gradients, update), the
clip, the stepper of compact state (``computectx.memory.optim.stepper.Stepper``, built when
the state is compact or a stepped weight is below float32), the load of a checked state
dict, and the tensors that optimizer state and scratch take.

What the subclasses step (the ``MasterWeights``' masters: copies on the offload device, or
the model's parameters) is theirs to make; ``OffloadedOptimizer`` adds to the step through
``_gather`` (ingest ``param.grad``), ``_before_update`` and ``_after_update`` (adopt outside
edits, copy the masters back).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, overload

import torch

from computectx._checks import check_max_norm
from computectx.ctx import ComputeCtx
from computectx.memory._rounding import check_seed
from computectx.memory.optim._grad_health import GradHealth
from computectx.memory.optim._implementation import HOW, fastest
from computectx.memory.optim._masters import MasterWeights, normalise_groups
from computectx.memory.optim.checkpoint import (
    check_checkpoint_scalars,
    check_group_options,
    state_tensors,
)
from computectx.memory.optim.classes import check_fits, check_optimizer_class
from computectx.memory.optim.state.load import LoadPlan, load_plan
from computectx.memory.optim.state.store import check_scalars
from computectx.memory.optim.stepper import STEPPED_DTYPES, Stepper, below_f32, check_compile

__all__ = ["InnerWrapper"]


class InnerWrapper(torch.optim.Optimizer):
    """A torch optimizer stepping ``weights.master`` through an inner ``optimizer_class``.

    ``_who`` (the subclass's name) opens its errors and warnings. A subclass checks its
    arguments with ``_check_args`` (refusing classes in ``_refuse``), makes the
    ``MasterWeights`` and calls ``__init__``; its ``add_param_group`` checks a group and
    hands it to ``_join``.
    """

    _who: ClassVar[str] = "InnerWrapper"

    @classmethod
    def _check_args(
        cls, ctx: object, optimizer_class: object, seed: object, compile: object
    ) -> None:
        """``TypeError`` (or ``_refuse``'s error) for a bad argument, in argument order."""
        if not isinstance(ctx, ComputeCtx):
            raise TypeError(f"ctx must be a ComputeCtx, got {type(ctx).__name__}")
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. "
                f"torch.optim.AdamW), got {optimizer_class!r}"
            )
        cls._refuse(optimizer_class)
        check_seed(seed)
        check_compile(compile)

    @classmethod
    def _refuse(cls, optimizer_class: type[torch.optim.Optimizer]) -> None:
        """Raise for an optimizer class this wrapper cannot step (none here)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        weights: MasterWeights,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        *,
        seed: int,
        compile: bool | None,
    ) -> None:
        self._weights = weights
        self._health = GradHealth(weights, native=compile is not False)
        self._seed = seed
        self._compile = compile
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = optimizer_kwargs
        self._inner: torch.optim.Optimizer | None = None
        self._stepper: Stepper | None = None
        # The groups whose implementation this wrapper picked (``_implementation.fastest``).
        self._picked: list[dict[str, Any]] = []
        self.last_step_skipped = False
        """Whether the most recent ``step`` skipped the update (non-finite gradients)."""
        self.skipped_steps = 0
        """How many steps were skipped for non-finite gradients."""
        # Optimizer.__init__ hands each group to add_param_group, which builds the inner
        # optimizer from the first group and adds the rest to it (``_join``), as torch does.
        super().__init__(normalise_groups(params), {})
        self._share_inner()
        self._ensure_stepper()

    def _built(self) -> torch.optim.Optimizer:
        """The inner optimizer (``RuntimeError`` while the first group is being added)."""
        if self._inner is None:
            raise RuntimeError(f"the {self._who} is still being constructed")
        return self._inner

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer whose update steps the weights (``OffloadedOptimizer``: the
        masters)."""
        return self._built()

    @property
    def ctx(self) -> ComputeCtx:
        """The policy this optimizer was built from."""
        return self._weights.ctx

    @property
    def stepper(self) -> Stepper | None:
        """The per-parameter stepper (``None``: f32 state and f32 weights, torch's step)."""
        return self._stepper

    def _share_inner(self) -> None:
        # One set of groups, state and defaults: the base class's ones are replaced by the
        # inner optimizer's objects themselves, so a scheduler writing ``lr`` into a group
        # writes what the inner step reads.
        inner = self._built()
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = inner.state

    def _rounds(self) -> bool:
        """Whether some stepped weight is below float32 (written back with rounding)."""
        return any(below_f32(w.dtype) for w in self._weights.master)

    def _steps_itself(self) -> bool:
        """Whether the stepper steps the weights (compact state, or a weight below float32)."""
        return self._weights.ctx.optim_state.compact or self._rounds()

    def _pick(self, groups: list[dict[str, Any]]) -> None:
        """Give each of ``groups`` that names no implementation torch's fastest for it
        (``_implementation.fastest``), unless the stepper steps the weights."""
        if self._stepper is not None or self._steps_itself():
            return
        for group in groups:
            how = fastest(group)
            if how:
                group.update(how)
                self._picked.append(group)

    def _unpick(self) -> None:
        """Put the picked groups back unset: the stepper takes over the step, and reads the
        groups' options as the user left them."""
        for group in self._picked:
            group.update(dict.fromkeys(HOW))
        self._picked = []

    def _repick_sparse(self) -> None:
        """A picked fused group that holds a sparse gradient (SGD, Adagrad over a sparse
        embedding), which torch's fused kernels refuse, goes to its next-fastest path."""
        for group in self._picked:
            if group.get("fused") and any(
                p.grad is not None and p.grad.is_sparse for p in group["params"]
            ):
                group.update(dict.fromkeys(HOW))
                group.update(fastest(group))

    def _ensure_stepper(self) -> None:
        if self._stepper is None and self._steps_itself():
            self._unpick()
            self._stepper = Stepper(
                self._built(),
                self._weights.ctx.optim_state,
                seed=self._seed,
                compile=self._compile,
                who=self._who,
            )

    def _where(self, param_group: object) -> str:
        """``"param_groups[i]"`` for the group about to be added (``TypeError`` unless a dict)."""
        if not isinstance(param_group, Mapping):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        inner = self._inner
        return f"param_groups[{0 if inner is None else len(inner.param_groups)}]"

    def _join(
        self, group: dict[str, Any], compute: list[torch.Tensor], stepped: list[torch.Tensor]
    ) -> None:
        """Add ``group`` (its params: ``stepped``) to the inner optimizer, which the first
        group builds (the class checks its keyword arguments here), and align ``compute``.

        Checked first: the group's options (``check_group_options``, the rule a load
        applies, so that what is saved can be loaded) and, when the stepper steps these
        weights, their dtypes."""
        inner = self._inner
        where = f"{self._who}.add_param_group: param_groups[{len(self.param_groups)}]"
        options = {k: v for k, v in group.items() if k != "params"}
        if inner is None:
            # The keyword arguments are the class's to check (torch's own messages).
            where = f"{self._who}: param_groups[0]"
        check_group_options(options, where)
        self._check_stepped_dtypes(stepped, where)
        if inner is None:
            self._inner = self._optimizer_class([group], **self._optimizer_kwargs)
        else:
            if self._stepper is None and any(below_f32(w.dtype) for w in stepped):
                # This group brings the first weight below float32, so the stepper will be
                # needed: the class is checked before anything is added.
                options = {**inner.defaults, **{k: v for k, v in group.items() if k != "params"}}
                check_fits(type(inner), options, self._weights.ctx.optim_state, self._who)
            inner.add_param_group(group)
        self._weights.add(compute, stepped)
        self._watch(compute)
        self._pick([self._built().param_groups[-1]])
        if inner is not None:
            self._ensure_stepper()

    def _check_stepped_dtypes(self, stepped: list[torch.Tensor], where: str) -> None:
        """``TypeError`` naming the weight when the stepper would step one it cannot: the
        stepper (compact state, or a weight below float32 among all of them) updates each
        weight in float32 and writes it back as float32, bfloat16 or float16."""
        old = list(self._weights.master)
        every = old + stepped
        if not (self._weights.ctx.optim_state.compact or any(below_f32(w.dtype) for w in every)):
            return
        for i, w in enumerate(every):
            if w.dtype not in STEPPED_DTYPES:
                which = (
                    f"{where}['params'][{i - len(old)}]"
                    if i >= len(old)
                    else f"parameter {i} (already in this optimizer)"
                )
                raise TypeError(
                    f"{which} has dtype {w.dtype} (shape {list(w.shape)}); with "
                    f"optim_state={self._weights.ctx.optim_state} or a weight below float32 "
                    f"each weight is stepped in float32 and written back, which takes "
                    f"float32, bfloat16 or float16 weights; convert it (e.g. model.float()) "
                    f"or keep optim_state='f32' with float32/float64 weights"
                )

    # ----- the step -------------------------------------------------------------------

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the gradients to total norm ``max_norm``; return the norm before.

        ``math.inf`` measures only. ``OffloadedOptimizer`` first ingests the gradients left
        in ``param.grad`` and clips the master gradients; with a ``sharding`` the norm is the
        global one over every rank's shards (one all-reduce). A non-finite norm (an inf or
        NaN gradient) is returned as is, and the next ``step`` skips these gradients without
        being told; that ``step`` decides by this norm, without looking at them again.
        """
        check_max_norm(max_norm)
        self._gather()
        return self._health.clip(max_norm, norm_type)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step every weight with a gradient; skipped for inf or NaN gradients.

        A ``closure`` is evaluated once (with grad enabled) first; its loss is returned.
        ``OffloadedOptimizer`` ingests the gradients left in ``param.grad``, steps the masters
        and copies them into the model. When a gradient about to be applied is inf or NaN, or
        finite with a float32 square that overflows (``|g| >= 2**64``), or ``clip_grad_norm``
        measured a non-finite norm for these gradients, the step is skipped instead: the
        gradients are dropped, weights and optimizer state are untouched, a
        ``RuntimeWarning`` says so, ``last_step_skipped`` is set and ``skipped_steps``
        counts it. State that cannot be stepped (a ``step`` that is not a whole number >= 0,
        a bad packed part) raises ``ValueError`` before any gradient is moved or weight
        written.
        """
        loss = self._loss(closure)
        self._check_state()
        self._gather()
        if self._skipped():
            return loss
        self._before_update()
        self._update()
        self._after_update()
        self._stepped()
        self.last_step_skipped = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients."""
        self._built().zero_grad(set_to_none=set_to_none)
        self._health.forget()

    def _watch(self, compute: list[torch.Tensor]) -> None:
        """``compute`` were just added (nothing to hook here; an overlapped
        ``OffloadedOptimizer`` hooks their gradients)."""

    def _applicable(self) -> bool:
        """Whether the gradients may be applied (``GradHealth.applicable``)."""
        return self._health.applicable()

    def _stepped(self) -> None:
        """A step ended, applied or skipped: the clip's verdict is spent."""
        self._health.forget()

    def _gather(self) -> None:
        """Bring the gradients to the stepped weights before a clip or a step (none here)."""

    def _before_update(self) -> None:
        """Run after the skip check, before the update, when the step is not skipped."""

    def _after_update(self) -> None:
        """Run after the update."""

    @staticmethod
    def _loss(closure: Callable[[], float] | None) -> float | None:
        """The closure's loss, evaluated once with grad enabled (``None`` without one)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _skipped(self) -> bool:
        """Whether the gradients are non-finite (or an element's square overflows float32),
        so the step is skipped: they are then dropped, the skip counted and a
        ``RuntimeWarning`` given (at ``step``'s caller)."""
        if self._applicable():
            return False
        self.skipped_steps += 1
        self.last_step_skipped = True
        for w in self._weights.master:
            w.grad = None
        self._stepped()
        warnings.warn(
            f"{self._who}.step() skipped the update: the gradients hold inf or NaN values, or "
            f"finite values of magnitude >= 2**64 (~1.8e19) whose square overflows float32, "
            f"and were dropped ({self.skipped_steps} step(s) skipped so far)",
            RuntimeWarning,
            stacklevel=3,
        )
        return True

    def _check_state(self) -> None:
        """``ValueError`` unless every weight's state is sound (its scalars: ``step`` a whole
        number >= 0, the rest finite; its packed parts), so that a refused ``step`` changes
        nothing (state edited in place since the last step or load is caught here, before
        any gradient is moved or weight written)."""
        if self._stepper is not None:
            self._stepper.check()
            return
        inner = self._built()
        check_scalars(
            [
                (f"{self._who}.step: state of param_groups[{j}]['params'][{k}]", inner.state[p])
                for j, group in enumerate(inner.param_groups)
                for k, p in enumerate(group["params"])
                if inner.state.get(p)
            ]
        )

    def _update(self) -> None:
        """Step every weight with a gradient: torch's step, or the stepper's (``step`` ran
        ``_check_state`` before it moved a gradient, so the stepper does not check again)."""
        if self._stepper is None:
            self._repick_sparse()
            self._built().step()
        else:
            self._stepper.step(checked=True)

    # ----- checkpoints ----------------------------------------------------------------

    def _with_extras(self, sd: dict[str, Any]) -> dict[str, Any]:
        """``sd`` with the stepper's ``"optim_state"`` and ``"master_rounding"`` added."""
        if self._stepper is not None:
            sd.update(self._stepper.extras(self._rounds()))
        return sd

    def _checked(self, state_dict: object) -> dict[str, Any]:
        """``state_dict`` as a dict, refused unless a mapping of the inner optimizer's class
        (``classes.check_optimizer_class``)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        inner = self._built()
        who = f"{self._who}.load_state_dict"
        check_optimizer_class(state_dict, type(inner), inner.defaults, who)
        check_checkpoint_scalars(state_dict, who)
        return dict(state_dict)

    def check_step(self) -> None:
        """Run every check ``step`` runs on the optimizer's state before it moves a gradient
        (``step`` a whole number >= 0, the other scalars finite, the packed parts sound, the
        stepped dtypes), changing nothing: the ``ValueError``/``TypeError`` ``step`` would
        raise. ``Parallel.step`` has the ranks agree on it before any of them steps."""
        self._check_state()

    def _plan(self, sd: Mapping[str, Any]) -> tuple[LoadPlan, Any]:
        """The checked load of groups and state (nothing changes): the plan, and the checked
        rounding generators (``None`` unless a stepped master is below float32)."""
        stepper = self._stepper
        plan = load_plan(
            sd,
            self.param_groups,
            self._weights.ctx.optim_state,
            stepped=stepper is not None,
            who=f"{self._who}.load_state_dict",
        )
        rounding = None
        if stepper is not None and self._rounds():
            devices = [w.device for w in self._weights.master if below_f32(w.dtype)]
            rounding = stepper.checked_rounding(plan.rounding, devices)
        return plan, rounding

    def _load(self, sd: Mapping[str, Any]) -> None:
        """Load groups and state: the packed parts and the rounding generators are checked
        (and the state converted from another ``optim_state``) before anything changes."""
        stepper = self._stepper
        plan, rounding = self._plan(sd)
        super().load_state_dict(plan.torch_sd)
        # The loaded groups replace the picked ones: those that name no implementation (a
        # plain torch checkpoint) are picked for again.
        self._picked = []
        self._pick(self.param_groups)
        # torch moves a loaded ``step`` to its parameter's device only for groups already fused
        # when they load; a group picked fused just now gets it moved the same way.
        for group in self._picked:
            if group.get("fused"):
                for p in group["params"]:
                    step = self.state.get(p, {}).get("step")
                    if isinstance(step, torch.Tensor) and step.device != p.device:
                        self.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
        # The conversion warning points at the caller of the subclass's load_state_dict.
        plan.finish(self.state, stacklevel=4)
        if stepper is not None:
            stepper.forget()
            if rounding is not None:
                stepper.rounding = rounding

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Optimizer.load_state_dict installs the loaded groups and state through
        # __setstate__. The inner optimizer takes them (its class fills in the options it
        # needs), and the wrapper goes on sharing its objects.
        self._built().__setstate__(state)
        self._share_inner()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            f"{self._who} cannot be pickled or deep-copied; save state_dict() and build a new "
            f"one around the model"
        )

    def _repr_fields(self) -> str:
        """What ``repr`` shows before the inner optimizer."""
        return ""

    def __repr__(self) -> str:
        inner = repr(self._built()).replace("\n", "\n  ")
        return f"{self._who}({self._repr_fields()}, inner={inner})"

    # ----- accounting -----------------------------------------------------------------

    def _state_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``("optimizer_state", t)`` per stored state tensor (packed parts included)."""
        for per_param in self.state.values():
            yield from (("optimizer_state", t) for t in state_tensors(per_param))

    def _scratch_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``("scratch", buffer)`` per scratch buffer of the stepper."""
        if self._stepper is not None:
            for buffer in self._stepper.scratch_buffers():
                yield "scratch", buffer
