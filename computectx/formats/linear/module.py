"""``QuantizedLinear``: a drop-in ``nn.Linear`` whose GEMMs run in fp8 under ``ctx.recipe``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from typing_extensions import Self

from computectx.ctx import ComputeCtx
from computectx.formats.backend import Backend, check_linear_input, default_backend, select_backend
from computectx.formats.linear.autocast import REGION, region_fp8_enabled
from computectx.formats.linear.frozen import (
    FROZEN_BUFFERS,
    adopt,
    check_given,
    check_loaded,
    dequantized,
    quantize_weight,
    serving_weight,
    weight_layout,
)
from computectx.formats.linear.function import fp8_linear
from computectx.formats.linear.plan import Fp8LinearPlan, gemm_dtype_for
from computectx.formats.linear.recompute import in_reentrant_checkpoint_forward
from computectx.formats.linear.unsynced import warn_if_unsynced
from computectx.formats.numerics.inline import QuantizeImpl, parse_quantize
from computectx.formats.numerics.layouts import check_granularity_widths
from computectx.formats.policy import (
    check_fp8_widths,
    check_param_dtype,
    check_quantize,
    checked_layer_ctx,
    default_device,
    policy_of,
    refuse_sharded,
)
from computectx.formats.scaling.layer import ScalingState, held_out
from computectx.formats.scaling.load import (
    ScalingLoad,
    check_held_dtypes,
    copied_on_save,
    plan_scaling_load,
    refuse_whole,
)
from computectx.formats.scaling.operand import AmaxReduce
from computectx.formats.serving import ServingWeight
from computectx.recipes import Recipe
from computectx.residency import parse_device

__all__ = ["SCALING_PREFIX", "QuantizedLinear"]

SCALING_PREFIX = "fp8_"
"""The scaling state's buffers are ``fp8_{role}_ledger``, ``fp8_{role}_tally`` (role in
input, weight, grad) and ``fp8_meta`` (``computectx.formats.scaling.saved``)."""
_META = f"{SCALING_PREFIX}meta"


class QuantizedLinear(nn.Linear):
    """A drop-in ``nn.Linear`` whose GEMMs run in fp8 under ``ctx.recipe``.

    Same ``weight``/``bias`` parameters and state-dict keys as ``nn.Linear`` (an
    ``nn.Linear`` checkpoint loads; the scaling state starts fresh), plus the scaling state
    of its three operands (input, weight, gradient) as persistent buffers, ``fp8_*``
    (``SCALING_PREFIX``): tensors only, which never change dtype and follow the weight's
    device. Loading checks them against the policy (``computectx.formats.scaling.saved``).
    Inputs of any leading shape in bf16/fp16/fp32; the output has the input's dtype (under
    ``torch.autocast``, the autocast dtype, as ``nn.Linear``'s), after an epilogue at
    ``ctx.compute``. New weights default to ``ctx.master`` on torch's
    default device when one other than the CPU is set (``torch.device("meta")`` included),
    else on ``ctx.device``.

    ``backend`` forces a ``Backend`` (or ``"triton"``/``"reference"``); by default each
    call uses ``select_backend`` for the weight's device. Inside ``autocast(
    enabled=False)`` the layer runs as a plain linear at the input's dtype.
    ``freeze_for_serving()`` quantizes the weight once for inference (or takes given codes).

    ``quantize`` says how a *compiled* call quantizes: ``"op"`` (default) keeps the opaque
    ``computectx::fp8_quantize_*`` operators (the Triton kernel on a GPU); ``"inline"``
    traces the same computation as plain torch ops so Inductor can fuse amax, step and cast
    into the neighbouring norm or activation. The bytes, ledgers and tallies are the same
    either way, and eager calls always run the operators. Settable later
    (``layer.quantize = "inline"``). ``"inline"`` is a per-tensor option: under a ``row``,
    ``block`` or ``mx`` policy (whose quantize is always its operator) it is refused with a
    ``ValueError`` when the layer is built or the attribute set.
    """

    weight_fp8: torch.Tensor
    """The pre-quantized weight's codes (after ``freeze_for_serving``)."""
    weight_step: torch.Tensor
    """The steps of ``weight_fp8`` in the recipe's weight layout (after
    ``freeze_for_serving``): ``(1,)``, per row ``(N, 1)`` or per 128x128 block."""
    _settled: tuple[torch.Tensor | None, torch.device] | None
    _plans: dict[bool, Fp8LinearPlan] | None
    amax_reduce: AmaxReduce | None
    """The data-parallel seam (``computectx.distributed.sync_scaling`` sets it;
    ``None``: one process, or ranks that nothing keeps in step). While it is armed (a
    synchronized forward is running) the input's and the output gradient's amax go to the
    group's where a quantize needs the current one (``OperandScaling.quantize``); while it
    is not, a training call is rank-local and records nothing."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        ctx: ComputeCtx,
        backend: Backend | str | None = None,
        quantize: QuantizeImpl = "op",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        policy = policy_of(ctx, "QuantizedLinear")
        check_fp8_widths(in_features, out_features)
        check_granularity_widths(policy.granularity, in_features, out_features)
        self._quantize = check_quantize(parse_quantize(quantize), policy)
        dev = parse_device(device) if device is not None else default_device(ctx)
        param_dtype = dtype if dtype is not None else ctx.master.torch
        check_param_dtype("weight", param_dtype)
        super().__init__(in_features, out_features, bias, device=dev, dtype=param_dtype)
        self.ctx = ctx
        self._forced_backend = None if backend is None else select_backend(dev, force=backend)[0]
        self.scaling = ScalingState(policy, dev, store=self._buffers, prefix=SCALING_PREFIX)
        self.amax_reduce = None
        self._frozen = False
        # The per-device default, looked up when the weight's device is set (here, in
        # from_linear and in _apply), so that compiled code reads an attribute instead of
        # tracing the probes; `backend` looks again if the weight moved any other way.
        self._auto = (dev, default_backend(dev))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        ctx: ComputeCtx,
        *,
        backend: Backend | str | None = None,
        quantize: QuantizeImpl = "op",
    ) -> QuantizedLinear:
        """A ``QuantizedLinear`` holding ``linear``'s own ``weight`` and ``bias`` Parameters.

        The Parameter objects are shared, not copied, so an optimizer built over the old
        module keeps training the new one. Hooks registered on ``linear`` do not carry over.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        check_param_dtype("weight", w.dtype)
        if linear.bias is not None:
            check_param_dtype("bias", linear.bias.dtype)
        forced = None if backend is None else select_backend(w.device, force=backend)[0]
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            ctx=ctx,
            quantize=quantize,
            device="meta",
            dtype=w.dtype,
        )
        new.weight = w
        new.bias = linear.bias
        new._forced_backend = forced
        new._auto = (w.device, default_backend(w.device))
        new._unsettle()
        new.scaling.reset(w.device)
        new.train(linear.training)
        return new

    @property
    def ctx(self) -> ComputeCtx:
        """The compute policy. ``layer.ctx = other`` checks ``other`` as construction does
        (``policy.checked_layer_ctx``); a refused one changes nothing."""
        return self._ctx

    @ctx.setter
    def ctx(self, value: ComputeCtx) -> None:
        frozen = (
            (self.policy.granularity, self.weight_fp8.dtype)
            if getattr(self, "_frozen", False)
            else None
        )
        self._ctx = checked_layer_ctx(
            value, self.in_features, self.out_features, self._quantize, frozen
        )
        self._policy = policy_of(self._ctx, "QuantizedLinear")
        self._unsettle()

    @property
    def policy(self) -> Recipe:
        """The fp8 policy (``ctx.recipe``)."""
        return self._policy

    @property
    def frozen(self) -> bool:
        """Whether the weight is held pre-quantized (``freeze_for_serving``)."""
        return self._frozen

    @property
    def backend(self) -> Backend:
        """The backend the next call runs on."""
        if self._forced_backend is not None:
            return self._forced_backend
        dev = self._storage_device()
        if dev != self._auto[0]:  # e.g. load_state_dict(assign=True) or a new Parameter
            self._auto = (dev, default_backend(dev))
        return self._auto[1]

    @property
    def quantize(self) -> QuantizeImpl:
        """How a compiled call quantizes: ``"op"`` or ``"inline"`` (see the class)."""
        return self._quantize

    @quantize.setter
    def quantize(self, value: QuantizeImpl) -> None:
        self._quantize = check_quantize(parse_quantize(value), self.policy)
        self._unsettle()

    def _storage_device(self) -> torch.device:
        w = self.weight_fp8 if self._frozen else self.weight
        return w.device

    # ----- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b`` in fp8 (or plain, inside ``autocast(enabled=False)``)."""
        check_linear_input(x, self.in_features, "QuantizedLinear")
        if _region_turns_fp8_off():
            return self._plain_linear(x)
        return fp8_linear(x, None if self._frozen else self.weight, self.bias, self._call_plan())

    def _plain_linear(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantized(self._plan(False), x.dtype) if self._frozen else self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return functional.linear(x, w, b)

    def _call_plan(self) -> Fp8LinearPlan:
        """This call's plan: the layer's own for its mode, armed for a data-parallel sync."""
        dev = self._storage_device()
        compiling = torch.compiler.is_compiling()
        if compiling:
            self.scaling.conform(self._policy, dev)
        elif self._settled is None or not (
            self._settled[0] is self._buffers.get(_META) and self._settled[1] == dev
        ):
            self._settle(dev)
        # Ledgers advance in training only (as TransformerEngine's do): an eval, no_grad or
        # inference_mode call quantizes from the state as it stands and writes nothing,
        # so its output never depends on earlier calls of its kind, and on many ranks it
        # issues no collective (rank-local validation or sampling cannot hang the group).
        # A frozen layer never records, in any mode: serving is deterministic per request.
        # Reentrant checkpointing runs a region's forward under no_grad: a training call
        # all the same, which records (docs/fp8.md, "Activation checkpointing").
        record = (
            self.training
            and not self._frozen
            and (torch.is_grad_enabled() or in_reentrant_checkpoint_forward())
        )
        reduce = self.amax_reduce
        if reduce is not None:
            record = record and reduce.armed
            armed = reduce if record and reduce.reduces else None
            return self._plan(record, armed, lockstep=record and reduce.lockstep)
        many = torch.distributed.is_available() and torch.distributed.is_initialized()
        if record and self._policy.granularity == "tensor" and not compiling and many:
            # Row, block and mx keep no scaling history: nothing to keep in step.
            warn_if_unsynced(self)
        if compiling or self._plans is None:
            return self._plan(record)
        return self._plans[record]

    def _plan(
        self, record: bool, amax_reduce: AmaxReduce | None = None, lockstep: bool = False
    ) -> Fp8LinearPlan:
        return Fp8LinearPlan(
            policy=self._policy,
            state=self.scaling,
            backend=self.backend,
            gemm_dtype=gemm_dtype_for(self.ctx.compute),
            save=self.ctx.activations.linear,
            frozen_weight=(self.weight_fp8, self.weight_step) if self._frozen else None,
            quantize=self._quantize,
            amax_reduce=amax_reduce,
            record=record,
            lockstep=lockstep,
        )

    def _settle(self, device: torch.device) -> None:
        # Fit the scaling state to the policy and device (ScalingState.conform, which also
        # adopts tensors loaded from outside) and make the plans the next calls read; calls
        # skip this while the state's meta tensor and the weight's device stay.
        self.scaling.conform(self._policy, device)
        self._settled = (self._buffers.get(_META), device)
        # A frozen weight's buffers may be replaced by assignment: its plan is made per call.
        self._plans = None if self._frozen else {r: self._plan(r) for r in (False, True)}

    def _unsettle(self) -> None:
        """The policy, the quantize, the device or the weight changed: settle again."""
        self._settled = None
        self._plans = None

    # ----- serving ------------------------------------------------------------------------

    def freeze_for_serving(self, weight: ServingWeight | None = None) -> Self:
        """Hold the weight as fp8 codes and steps, dropping the high-precision copy.

        The weight becomes the buffers ``weight_fp8`` (codes in the recipe's forward format,
        1 byte per element) and ``weight_step`` (float32, ``weight ≈ codes * step``), laid
        out as the recipe's forward quantizes its weight (``linear.frozen``): one step, one
        per output row, per 128x128 block or per 1x32 MX group. Without ``weight`` they are
        the codes that forward makes (per tensor from the weight's own amax, no margin).
        ``weight``, a ``ServingWeight`` of this layer's ``[out_features, in_features]`` in the
        recipe's layout (``"tensor"``, ``"row"``, ``"128x128"``, ``"mx"``) and forward
        format, on the layer's device, is copied bit for bit instead (also into a frozen
        layer); else ``TypeError``/``ValueError`` naming what was given and what the layer
        takes. A refused call changes nothing.

        Later calls multiply with the codes as they are; inputs are still quantized under
        the policy, and a frozen layer records nothing in any mode, so an output depends on
        its own request only: under delayed scaling the input step is the one training (or
        calibration) left in the input ledger, saved in ``fp8_input_ledger``; an input
        ledger never seeded, and dynamic scaling, take each request's own amax. Input
        gradients still flow; the weight no longer trains (freeze a copy for both). Works
        inside ``torch.inference_mode``. Returns ``self``.
        """
        policy = self.policy
        weight_layout(policy)  # a granularity with no layout: refused before any change
        refuse_sharded("QuantizedLinear.freeze_for_serving", self)
        if weight is None and self._frozen:
            return self
        shape, device = (self.out_features, self.in_features), self._storage_device()
        given = None if weight is None else check_given(weight, policy, shape, device)
        plan = self._plan(False)
        data, steps = quantize_weight(self.weight, plan) if given is None else adopt(given, plan)
        if not self._frozen:
            self.register_parameter("weight", None)
        self.register_buffer("weight_fp8", data)
        self.register_buffer("weight_step", steps)
        self._frozen = True
        self._unsettle()
        return self

    def serving_weight(self) -> ServingWeight:
        """The codes and steps this layer serves with: a frozen layer's buffers (views),
        else its weight's as ``freeze_for_serving`` would make them (nothing recorded)."""
        return serving_weight(None if self._frozen else self.weight, self._plan(False))

    # ----- state ----------------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation; the scaling state starts fresh with the new
        weights (``to_empty`` then ``reset_parameters`` gives a working layer)."""
        super().reset_parameters()
        if "scaling" in self.__dict__:  # nn.Linear.__init__ calls this before it exists
            self.scaling.reset(self._storage_device())

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # Copies of the scaling tensors and a frozen layer's steps (copied_on_save).
        steps = ("weight_step",) if self._frozen else ()
        copied_on_save(destination, prefix, keep_vars, (*self.scaling.tensor_names(), *steps))

    def plan_state_load(
        self, tensors: Mapping[str, torch.Tensor], *, prefix: str = ""
    ) -> Callable[[], None]:
        """``computectx.memory.load_weights``' seam: read this layer's entries among
        ``tensors`` (local names; ``prefix`` its key prefix, for messages) by the one loading
        rule ``load_state_dict`` follows (``computectx.formats.scaling.load``), on the device the
        loaded ``weight`` lives on, and return what installs the result, once the weights
        are in place. Raises ``ValueError`` (naming keys, dtypes or both policies) and
        changes nothing when the entries cannot load."""
        w = tensors.get("weight", tensors.get("weight_fp8"))
        device = w.device if isinstance(w, torch.Tensor) else None
        plan = self.scaling_load(tensors, prefix, device)
        return lambda: self._finish_load(plan)

    def state_load_keys(self) -> tuple[str, ...]:
        """The local names ``plan_state_load`` loads by its own rule (the scaling tensors):
        ``load_weights`` leaves them out of its key, shape and dtype checks."""
        return self.scaling.tensor_names()

    def scaling_load(
        self, entries: Mapping[str, Any], prefix: str = "", device: torch.device | None = None
    ) -> ScalingLoad:
        """What loading ``entries`` (local names) does to the scaling state, by the one rule
        (``computectx.formats.scaling.load``), changing nothing; ``ValueError`` when they cannot
        load (a frozen layer's ``weight_fp8`` and ``weight_step`` only at their dtypes)."""
        if self._frozen:
            held = {k: getattr(self, k) for k in FROZEN_BUFFERS}
            check_held_dtypes(entries, held, prefix)
            check_loaded(entries, (self.weight_fp8, self.weight_step), self.policy, prefix)
        return plan_scaling_load(
            entries,
            names=self.scaling.tensor_names(),
            weights=("weight", *FROZEN_BUFFERS),
            policy=self.policy,
            device=device,
            prefix=prefix,
        )

    def _finish_load(self, plan: ScalingLoad) -> None:
        if plan.saved is not None:
            self.scaling.install(plan.saved)
        elif plan.action == "fresh":
            self.scaling.reset(self._storage_device())
        self.scaling.to(self._storage_device())

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # The scaling tensors follow the one loading rule (computectx.formats.scaling.load, which
        # load_weights follows too): read and checked against this layer's policy (and
        # fitted to its history length) before anything changes, then installed as new
        # tensors (the amax sync tells a loaded ledger from a trained one by identity).
        names = self.scaling.tensor_names()
        local = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        plan = self.scaling_load(local, prefix)
        if refuse_whole(self, state_dict, prefix, error_msgs, missing_keys, unexpected_keys):
            return  # torch raises what was recorded; the layer is left as it was
        with held_out(self._buffers, names):
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        for key in (*(prefix + n for n in names), prefix + "_extra_state"):
            if key in unexpected_keys:
                unexpected_keys.remove(key)
        self._finish_load(plan)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # The scaling tensors are float32 and int64 records (a .to(bfloat16) would round the
        # float32 counts and steps), so they follow the weight's device here and never change
        # dtype; from the meta device they start fresh (ScalingState.to). The same goes
        # for a frozen weight: fp8 counts as floating point, so a module-wide .half() or
        # .to(torch.bfloat16) would widen weight_fp8 (doubling its bytes) and round the
        # float32 step; both only follow the device, which fn applied to the step reveals.
        with held_out(self._buffers, (*self.scaling.tensor_names(), *FROZEN_BUFFERS)) as held:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
            step = held.get("weight_step")
            if step is not None:
                device = fn(step).device
                for k in FROZEN_BUFFERS:
                    t = held.get(k)
                    if t is not None:
                        held[k] = t.to(device)
        dev = self._storage_device()
        self.scaling.to(dev)
        self._auto = (dev, default_backend(dev))
        self._unsettle()
        return self

    def extra_repr(self) -> str:
        base = super().extra_repr()
        frozen = ", frozen" if self._frozen else ""
        return f"{base}, fp8={self.policy}{frozen}"


def _region_turns_fp8_off() -> bool:
    # The innermost open autocast region's ContextVar, read here (no call into
    # linear.autocast). Compiled code cannot read it: region_fp8_enabled then raises while a
    # disabled region is open anywhere, and is None otherwise (fp8 stays on).
    if torch.compiler.is_compiling():
        return region_fp8_enabled() is False
    frame = REGION.get()
    return frame is not None and not frame.enabled
