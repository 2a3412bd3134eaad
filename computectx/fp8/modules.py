"""``Fp8Linear`` (a drop-in ``nn.Linear`` running in fp8) and ``convert_to_fp8``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from typing_extensions import Self

from computectx.ctx import ComputeCtx, parse_device
from computectx.fp8 import ops, reference
from computectx.fp8.autograd import ACTIVATION_DTYPES, Fp8LinearPlan, fp8_linear, gemm_dtype_for
from computectx.fp8.policy import policy_of
from computectx.fp8.region import region_fp8_enabled
from computectx.fp8.scaling import Fp8ScalingState
from computectx.recipes import Fp8Policy

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FEATURE_MULTIPLE",
    "Fp8ConversionReport",
    "Fp8Linear",
    "SkippedLinear",
    "convert_to_fp8",
]

FEATURE_MULTIPLE = 16
"""``in_features`` and ``out_features`` must be multiples of this to convert: fp8 tensor
core tiles (and cuBLASLt's fp8 GEMMs) work on 16-element K and N steps; other widths run
masked edge tiles at a fraction of the speed."""

DEFAULT_MIN_FEATURES = 1024
"""Narrowest ``min(in_features, out_features)`` that ``convert_to_fp8`` converts by default.

Per training step an fp8 linear with ``M`` rows saves about half of its three GEMMs'
``6·M·N·K`` flops (fp8 tensor cores run at twice the bf16 rate) and pays three quantize
passes that read 2 and write 1 byte per element of ``X [M, K]``, ``W [N, K]`` and
``dY [M, N]``. It wins when ``3·M·N·K / P > 3·(M·K + N·K + M·N) / B``, i.e. when
``1 / (1/M + 1/N + 1/K) > P / B``, with ``P`` the bf16 peak and ``B`` the memory bandwidth.
On an H100 (989 TFLOP/s, 3.35 TB/s) ``P / B ≈ 300``: with many rows, ``N = K ≈ 600`` only
breaks even, and at 1024 the saving is still well under half the ideal. Pass
``min_features`` to ``convert_to_fp8`` to choose otherwise (tests use 16)."""


_FROZEN_BUFFERS = ("weight_fp8", "weight_step")


class Fp8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose GEMMs run in fp8 under ``ctx.fp8``.

    Same ``weight``/``bias`` parameters and state-dict keys as ``nn.Linear`` (an
    ``nn.Linear`` checkpoint loads; the scaling state starts fresh), plus the scaling state
    of its three operands (input, weight, gradient), saved versioned as extra state.
    Inputs of any leading shape in bf16/fp16/fp32; the output has the input's dtype, after
    an epilogue at ``ctx.compute``. New weights default to ``ctx.master`` on ``ctx.device``.

    ``backend`` forces an ``Fp8Backend`` (or ``"triton"``/``"reference"``); by default each
    call uses ``select_backend`` for the weight's device. Inside ``fp8_autocast(
    enabled=False)`` the layer runs as a plain linear at the input's dtype.
    ``freeze_for_serving()`` quantizes the weight once for inference.
    """

    weight_fp8: torch.Tensor
    """The pre-quantized weight (after ``freeze_for_serving``)."""
    weight_step: torch.Tensor
    """The step of ``weight_fp8`` (after ``freeze_for_serving``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        ctx: ComputeCtx,
        backend: ops.Fp8Backend | str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        policy = policy_of(ctx, "Fp8Linear")
        dev = parse_device(device) if device is not None else ctx.device
        param_dtype = dtype if dtype is not None else ctx.master.torch
        _check_param_dtype("weight", param_dtype)
        super().__init__(in_features, out_features, bias, device=dev, dtype=param_dtype)
        self.ctx = ctx
        self._forced_backend = (
            None if backend is None else ops.select_backend(dev, force=backend)[0]
        )
        self.scaling = Fp8ScalingState(policy, dev)
        self._frozen = False

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        ctx: ComputeCtx,
        *,
        backend: ops.Fp8Backend | str | None = None,
    ) -> Fp8Linear:
        """An ``Fp8Linear`` holding ``linear``'s own ``weight`` and ``bias`` Parameters.

        The Parameter objects are shared, not copied, so an optimizer built over the old
        module keeps training the new one. Hooks registered on ``linear`` do not carry over.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        _check_param_dtype("weight", w.dtype)
        if linear.bias is not None:
            _check_param_dtype("bias", linear.bias.dtype)
        forced = None if backend is None else ops.select_backend(w.device, force=backend)[0]
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            ctx=ctx,
            device="meta",
            dtype=w.dtype,
        )
        new.weight = w
        new.bias = linear.bias
        new._forced_backend = forced
        new.scaling = Fp8ScalingState(new.policy, w.device)
        new.train(linear.training)
        return new

    # ----- properties ---------------------------------------------------------------------

    @property
    def policy(self) -> Fp8Policy:
        """The fp8 policy (``ctx.fp8``)."""
        return policy_of(self.ctx, "Fp8Linear")

    @property
    def frozen(self) -> bool:
        """Whether the weight is held pre-quantized (``freeze_for_serving``)."""
        return self._frozen

    @property
    def backend(self) -> ops.Fp8Backend:
        """The backend the next call runs on."""
        if self._forced_backend is not None:
            return self._forced_backend
        return ops.default_backend(self._storage_device())

    def _storage_device(self) -> torch.device:
        w = self.weight_fp8 if self._frozen else self.weight
        return w.device

    # ----- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b`` in fp8 (or plain, inside ``fp8_autocast(enabled=False)``)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Fp8Linear takes a tensor, got {type(x).__name__}")
        if x.dtype not in ACTIVATION_DTYPES:
            raise TypeError(
                f"Fp8Linear quantizes bf16, fp16 or fp32 inputs; got {x.dtype}. Cast the "
                f"input first (e.g. ctx.to_compute(x))"
            )
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Fp8Linear expects inputs of shape (..., {self.in_features}), got {tuple(x.shape)}"
            )
        if region_fp8_enabled() is False:
            w = (
                reference.dequantize(self.weight_fp8, self.weight_step, x.dtype)
                if self._frozen
                else self.weight.to(x.dtype)
            )
            b = None if self.bias is None else self.bias.to(x.dtype)
            return functional.linear(x, w, b)
        policy = self.policy
        frozen = (self.weight_fp8, self.weight_step) if self._frozen else None
        self.scaling.conform(policy, self._storage_device())
        plan = Fp8LinearPlan(
            policy=policy,
            state=self.scaling,
            backend=self.backend,
            gemm_dtype=gemm_dtype_for(self.ctx.compute),
            frozen_weight=frozen,
        )
        return fp8_linear(x, None if self._frozen else self.weight, self.bias, plan)

    # ----- serving ------------------------------------------------------------------------

    def freeze_for_serving(self) -> Self:
        """Quantize the weight once and drop the high-precision copy (for inference).

        The weight becomes ``weight_fp8`` (the fp8 data, 1 byte per element: half of bf16)
        and ``weight_step`` buffers, in the policy's forward format with the step from the
        weight's own amax. No margin: a frozen weight never grows, so headroom would only
        cost precision. Later calls skip the weight quantize; inputs are still quantized
        under the policy. The layer can no longer train its weight: freeze a copy if you
        need both. Works inside ``torch.inference_mode`` too. Returns ``self``.
        """
        if self._frozen:
            return self
        w = self.weight.detach()
        fmt = self.policy.format.forward
        # Not inference tensors, even when frozen inside inference_mode: those could
        # never be saved for an input gradient or loaded into by load_state_dict later.
        with torch.inference_mode(False), torch.no_grad():
            data, step, amax = ops.quantize_dynamic(w, fmt, 0, backend=self.backend)
            step = step.reshape(1).clone()
        state = self.scaling.weight
        state.record(amax, step)
        state.elements += w.numel()
        self.register_parameter("weight", None)
        self.register_buffer("weight_fp8", data)
        self.register_buffer("weight_step", step)
        self._frozen = True
        return self

    # ----- state ----------------------------------------------------------------------------

    def get_extra_state(self) -> dict[str, object]:
        """The scaling state, versioned (``Fp8ScalingState.to_dict``)."""
        return self.scaling.to_dict()

    def set_extra_state(self, state: Any) -> None:
        """Load saved scaling state, resized to this layer's history length if needed."""
        self.scaling.load_dict(state)

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
        # An nn.Linear checkpoint has no scaling state: it loads into a fresh one rather
        # than failing strict loading on the missing extra-state key. Fresh, not kept: the
        # rings hold amaxes of the weights being replaced, and delayed scaling would
        # quantize the new weights with that stale step for up to history_len calls. A
        # partial state dict that does not mention this layer's weight changes nothing.
        key = prefix + "_extra_state"
        had_state = key in state_dict
        new_weight = any(prefix + k in state_dict for k in ("weight", *_FROZEN_BUFFERS))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if not had_state:
            if key in missing_keys:
                missing_keys.remove(key)
            if new_weight:
                self.scaling = Fp8ScalingState(self.policy, self._storage_device())

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        # Rings are not buffers (a .to(bfloat16) would round the float32 counts), so they
        # follow the weight's device here and never change dtype. The same goes for a
        # frozen weight: fp8 counts as floating point, so a module-wide .half() or
        # .to(torch.bfloat16) would widen weight_fp8 (doubling its bytes) and round the
        # float32 step; both only follow the device, which fn applied to the step reveals.
        held: dict[str, torch.Tensor] = {}
        for k in _FROZEN_BUFFERS:
            t = self._buffers.pop(k, None)
            if t is not None:
                held[k] = t
        try:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
            if held:
                device = fn(held["weight_step"]).device
                held = {k: t.to(device) for k, t in held.items()}
        finally:
            self._buffers.update(held)
        self.scaling.to(self._storage_device())
        return self

    def extra_repr(self) -> str:
        base = super().extra_repr()
        frozen = ", frozen" if self._frozen else ""
        return f"{base}, fp8={self.policy}{frozen}"


def _check_param_dtype(name: str, dtype: torch.dtype) -> None:
    # Checked when the layer is built: a float64 master weight would otherwise only fail
    # at the first forward, deep inside the quantize call.
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"Fp8Linear quantizes its {name} from bf16, fp16 or fp32; got {dtype}. Pass "
            f"dtype=torch.float32 (or a ctx whose master dtype is f32/bf16/f16)"
        )


# ----- conversion -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SkippedLinear:
    """A linear ``convert_to_fp8`` left alone, and why."""

    fqn: str
    reason: str


@dataclass(frozen=True)
class Fp8ConversionReport:
    """What ``convert_to_fp8`` did: converted layer names and skipped ones with reasons."""

    converted: tuple[str, ...]
    skipped: tuple[SkippedLinear, ...]

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} linear(s) to fp8:"]
        lines += [f"  {fqn}" for fqn in self.converted]
        lines.append(f"skipped {len(self.skipped)}:")
        lines += [f"  {s.fqn}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def convert_to_fp8(
    model: nn.Module,
    ctx: ComputeCtx,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    *,
    include_head: bool = False,
    min_features: int = DEFAULT_MIN_FEATURES,
    backend: ops.Fp8Backend | str | None = None,
) -> Fp8ConversionReport:
    """Swap ``model``'s ``nn.Linear`` layers for ``Fp8Linear`` in place; report what happened.

    Each linear (by fully qualified name, in registration order) is skipped, with the
    reason recorded, when:

    1. ``module_filter(module, fqn)`` returns False;
    2. it is the output head and ``include_head`` is False. The head is the *last*
       ``nn.Linear`` in registration order, and any linear whose weight is tied to an
       ``nn.Embedding``'s: logits feed a softmax over the whole vocabulary, where fp8's
       2**-4 relative error is most visible;
    3. its shape makes fp8 a loss: ``in_features`` or ``out_features`` not a multiple of
       ``FEATURE_MULTIPLE`` (16), or ``min(in_features, out_features) < min_features``
       (default ``DEFAULT_MIN_FEATURES``; its docstring derives the break-even);
    4. its weight is not bf16/fp16/fp32, or it is ``model`` itself (there is no parent to
       swap it in; use ``Fp8Linear.from_linear``);
    5. it is an instance of a *subclass* of ``nn.Linear`` (only plain ``nn.Linear`` layers
       are swapped: a subclass's forward may do more than ``x Wᵀ + b``).

    Converted layers keep their ``weight``/``bias`` Parameter objects (optimizers keep
    working). A linear reachable under several names is converted once and replaced
    everywhere. All decisions are made before the model changes, so an exception from
    ``module_filter`` leaves it untouched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_fp8 takes an nn.Module, got {type(model).__name__}")
    policy_of(ctx, "convert_to_fp8")
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 1:
        raise ValueError(f"min_features must be an int >= 1, got {min_features!r}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError(
            f"module_filter must be callable(module, fqn) -> bool, got {module_filter!r}"
        )
    # Every place each linear sits (a module shared under two names sits in two).
    places: dict[int, list[tuple[str, nn.Module, str]]] = {}
    order: list[tuple[str, nn.Linear]] = []
    for fqn, child in model.named_modules(remove_duplicate=False):
        if isinstance(child, nn.Linear) and fqn:
            parent_fqn, _, name = fqn.rpartition(".")
            parent = model.get_submodule(parent_fqn)
            if id(child) not in places:
                places[id(child)] = []
                order.append((fqn, child))
            places[id(child)].append((fqn, parent, name))
    root_is_linear = isinstance(model, nn.Linear)
    if root_is_linear:
        order.insert(0, ("", model))  # type: ignore[arg-type]  # narrowed just above

    heads = _heads(model, order)
    converted: list[tuple[str, nn.Linear]] = []
    skipped: list[SkippedLinear] = []
    for fqn, lin in order:
        reason = _skip_reason(fqn, lin, model, module_filter, heads, include_head, min_features)
        if reason is None:
            converted.append((fqn, lin))
        else:
            skipped.append(SkippedLinear(fqn or "<root>", reason))

    # Build every replacement (which validates ctx and backend) before swapping any.
    replacements = [(lin, Fp8Linear.from_linear(lin, ctx, backend=backend)) for _, lin in converted]
    for lin, new in replacements:
        for _, parent, name in places[id(lin)]:
            setattr(parent, name, new)
    names = tuple(alias for _, lin in converted for alias, _, _ in places[id(lin)])
    return Fp8ConversionReport(converted=names, skipped=tuple(skipped))


def _heads(model: nn.Module, order: list[tuple[str, nn.Linear]]) -> dict[int, str]:
    heads: dict[int, str] = {}
    if order:
        heads[id(order[-1][1])] = "output head (the last nn.Linear in registration order)"
    for efqn, emb in model.named_modules():
        if isinstance(emb, nn.Embedding):
            for _, lin in order:
                if lin.weight is emb.weight:
                    heads[id(lin)] = f"output head (weight tied to nn.Embedding {efqn!r})"
    return heads


def _skip_reason(
    fqn: str,
    lin: nn.Linear,
    model: nn.Module,
    module_filter: Callable[[nn.Module, str], bool] | None,
    heads: dict[int, str],
    include_head: bool,
    min_features: int,
) -> str | None:
    if isinstance(lin, Fp8Linear):
        return "already an Fp8Linear"
    if type(lin) is not nn.Linear:
        # A subclass may compute more than x Wᵀ + b (adapters, extra parameters) or never
        # call its own forward (nn.MultiheadAttention's out_proj); swapping it for an
        # Fp8Linear would silently drop that behaviour.
        return (
            f"{type(lin).__name__} is a subclass of nn.Linear, whose forward may differ; "
            f"only plain nn.Linear layers are converted"
        )
    if module_filter is not None and not module_filter(lin, fqn):
        return "module_filter returned False"
    if id(lin) in heads and not include_head:
        return f"{heads[id(lin)]}; pass include_head=True to convert it"
    n_in, n_out = lin.in_features, lin.out_features
    if n_in % FEATURE_MULTIPLE or n_out % FEATURE_MULTIPLE:
        return (
            f"in_features={n_in}, out_features={n_out}: both must be multiples of "
            f"{FEATURE_MULTIPLE} for full fp8 GEMM tiles"
        )
    if min(n_in, n_out) < min_features:
        return (
            f"min(in_features, out_features)={min(n_in, n_out)} < min_features="
            f"{min_features}: the quantize passes cost more than the fp8 GEMMs save"
        )
    if lin.weight.dtype not in ACTIVATION_DTYPES:
        return f"weight dtype {lin.weight.dtype} is not bf16, fp16 or fp32"
    if lin is model:
        return "the root module has no parent to swap it in; use Fp8Linear.from_linear"
    return None
