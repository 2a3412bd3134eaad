"""``Fp4Linear``: a drop-in ``nn.Linear`` whose three GEMMs run in NVFP4 or MXFP4 under an
``Fp4Recipe`` (``ctx.recipe``), through the ``computectx::fp4_*`` operators.

What each GEMM operand gets (TransformerEngine's ``NVFP4BlockScaling``; MXFP4 the same with
1x32 E8M0 blocks and no per-tensor scale; "col": quantized along the tokens M)::

    GEMM  a                                      b
    Y     X, 1x16 along K, nearest               W at the weight tile (16x16 or 1x16), nearest
    dX    dY, 1x16 along N, stochastic           Wᵀ at the weight tile (16x16: W's own tiles)
    dW    dYᵀ col, Hadamard along M, stochastic  Xᵀ col, Hadamard along M, nearest

The forward quantizes ``Xᵀ`` column-wise (the wgrad's operand: codes, E4M3 scales and the
float32 amax, 0.5625 bytes an element plus 4; MXFP4 0.53125) and keeps it, with the weight
parameter, for the backward: that is all the layer saves, under ``ctx.activations.linear``
``keep`` and ``fp8`` alike (the operand is already 4 bits); under ``offload`` that operand
goes to host memory and comes back for the backward, as the other linears' inputs do
(``computectx.offload``: a no-op on a CPU). A weight that needs no gradient keeps nothing of
``X``. Every scale comes from the current amax: the weight's from the weight itself, so ranks
holding the same weight (DDP) quantize it alike with no collective. A weight that arrives
already quantized (``Fp4GatheredWeight``: FSDP2's 4-bit all-gather, whose shards make the
whole weight's operands bit for bit, ``linear.fp4_gathered``) is multiplied with as it came,
its own ``Wᵀ`` operand in the dgrad.

**Stochastic rounding** (the gradients only, ``recipe.stochastic``) draws Philox bits keyed
by ``(key word, counter)``, the word the layer's stream's (``sr_stream``: the recipe's seed
itself on stream 0, a mix of the seed and the stream otherwise; ``assign_fp4_streams`` gives
each layer of a model its own): the counter (``sr_key``; its rules are ``linear.fp4_counter``'s)
is plain CPU state, never a buffer (DDP would broadcast it before each forward: a lone
validation forward on one rank would be a collective, and rank 0's counter would overwrite
the others'). Each call that can run a backward advances it by the elements its backward
rounds (``M * N`` for dY, ``N * M_pad`` for dYᵀ); ``_extra_state`` saves it, so a resumed
run draws the same bits (and the stream: it resumes on it). A replayed call
(``replays_a_call``: a non-reentrant checkpoint's recomputation) advances nothing and its
backward reads the original call's key, so the gradients are bit for bit a run's without
checkpointing; a reentrant checkpoint's forward runs under ``no_grad`` (no key) and its
recomputation draws and advances as the plain call would.

**Loading** checks the policy: ``_extra_state`` (int64 ``[version, recipe code, seed,
counter, stream]``; version 1's, without the stream, loads as stream 0) saved under another
4-bit recipe or seed, a counter outside ``[0, FP4_COUNTER_LIMIT)``, a negative stream, or fp8
scaling entries (``fp8_*``: an fp8 checkpoint), raise
``ValueError`` naming the layer before anything loads; an ``nn.Linear`` checkpoint (no
``_extra_state``) loads with the counter and stream as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx

from computectx.ctx import ComputeCtx
from computectx.formats.backend import check_linear_input
from computectx.formats.linear.fp4_counter import (
    FP4_COUNTER_LIMIT,
    FP4_STATE_VERSION,
    CounterLoads,
    check_stream,
    fp4_key,
    recipe_code,
    replays_a_call,
    saved_counter,
)
from computectx.formats.linear.fp4_frozen import FrozenFp4Linear
from computectx.formats.linear.fp4_gathered import Fp4GatheredWeight, Fp4ShardGather
from computectx.formats.linear.fp4_serving import ActivationAmax, ServeMode
from computectx.formats.linear.function import autocast_dtype
from computectx.formats.numerics.fp4 import Mxfp4Operand, Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant, grouped_counters
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.policy import (
    check_param_dtype,
    default_device,
    describe,
)
from computectx.formats.scaling.load import guard_whole_loads
from computectx.fp4_recipe import Fp4Recipe
from computectx.residency import parse_device
from computectx.saved import SAVING, kept_back, offload_kept, refuse_double_backward

__all__ = [
    "FP4_COUNTER_LIMIT",
    "FP4_STATE_VERSION",
    "Fp4Linear",
    "fp4_quant",
    "recipe_code",
]


def fp4_quant(recipe: Fp4Recipe) -> Fp4Quant:
    """The plain values the 4-bit operators take, read from the policy's recipe."""
    return Fp4Quant(
        format=recipe.format,
        weight_tile=recipe.weight_tile or "1x16",
        mx_rounding=recipe.mx_rounding or "rceil",
        hadamard=recipe.hadamard,
        signs=recipe.hadamard_signs,
    )


class Fp4Linear(CounterLoads, nn.Linear):
    """A drop-in ``nn.Linear`` whose GEMMs run in 4 bits under ``ctx.recipe``, an
    ``Fp4Recipe`` (module docstring: the operands, what is saved, stochastic rounding).

    Same ``weight``/``bias`` parameters as ``nn.Linear`` (an ``nn.Linear`` checkpoint loads),
    trained in high precision and quantized from their current values at every call, plus
    ``_extra_state``: the stochastic rounding's counter, its stream and the recipe it was
    drawn under (saved and loaded by ``CounterLoads``, ``linear.fp4_counter``). ``sr_stream``
    is the stream (0 unless given: the recipe's seed itself; ``set_sr_stream`` before the
    layer draws, or ``assign_fp4_streams`` for a whole model).
    Widths must be multiples of the recipe's block (16 for NVFP4, 32 for MXFP4); inputs of
    any leading shape and any number of rows (none: an empty output, zero weight gradient),
    bf16/fp16/fp32 (another dtype, float64 included, is a ``TypeError``); the output has the
    input's dtype (the autocast dtype inside ``torch.autocast``). First-order only: a double
    backward (``create_graph=True``) raises at the backward. The GEMMs run on the operators'
    backend (``computectx.formats.ops.fp4.select_fp4_backend``: the emulated twin today).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        ctx: ComputeCtx,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        sr_stream: int = 0,
    ) -> None:
        recipe = _recipe_of(ctx)
        sr_stream = check_stream(sr_stream, f"Fp4Linear({in_features}, {out_features})")
        for name, width in (("in_features", in_features), ("out_features", out_features)):
            if width % recipe.block:
                raise ValueError(
                    f"Fp4Linear({in_features}, {out_features}): {name}={width} is not a "
                    f"multiple of {recipe.block}, the {recipe.format} block"
                )
        dev = parse_device(device) if device is not None else default_device(ctx)
        param_dtype = dtype if dtype is not None else ctx.master.torch
        check_param_dtype("weight", param_dtype)
        super().__init__(in_features, out_features, bias, device=dev, dtype=param_dtype)
        self.ctx = ctx
        self.recipe = recipe
        self._how = fp4_quant(recipe)
        self.sr_stream = sr_stream
        self.sr_key = fp4_key(recipe, 0, sr_stream)
        # load_state_dict checks every layer's entries before any module loads, from whatever
        # root (an nn.Sequential of Fp4Linears): the guard climbs to each parent.
        guard_whole_loads(self)

    sr_key: torch.Tensor
    """int64 ``(2,)`` on the CPU: the stochastic rounding's key word (``recipe.seed``, two's
    complement, on stream 0; ``fp4_counter.stream_word``) and counter. Plain state, not a
    buffer (module docstring): ``.to()`` leaves it on the CPU, where the operators read it
    with no device sync."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, ctx: ComputeCtx, *, sr_stream: int = 0) -> Fp4Linear:
        """An ``Fp4Linear`` holding ``linear``'s own ``weight`` and ``bias`` Parameters
        (shared, not copied: an optimizer built over the old module trains the new one), on
        the stochastic-rounding stream ``sr_stream``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {describe(linear)}")
        w = linear.weight
        check_param_dtype("weight", w.dtype)
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            ctx=ctx,
            device="meta",
            dtype=w.dtype,
            sr_stream=sr_stream,
        )
        new.weight = w
        new.bias = linear.bias
        new.train(linear.training)
        return new

    @property
    def backend(self) -> str:
        """The 4-bit operators' backend the calls run on (``select_fp4_backend``: the
        emulated twin on every device today)."""
        return fp4_ops.select_fp4_backend(self.weight.device)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b`` in 4 bits."""
        check_linear_input(x, self.in_features, "Fp4Linear")
        lowered = autocast_dtype(x)
        if lowered is not None:  # as autocast runs a linear: the input at its dtype
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x.to(lowered))
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:  # no rows: nothing to quantize (an empty amax), nothing drawn
            return _no_rows(x, self.weight, self.bias)
        key = self._key(x2.shape[0])
        offloading = self.ctx.activations.linear == "offload"
        args = (x2, self.weight, self.bias, self._how, key, offloading)
        if torch.compiler.is_compiling():  # a compiled graph's saves carry no kind
            y2 = _Fp4LinearFn.apply(*args)  # type: ignore[no-untyped-call]
        else:
            token = SAVING.set("linear")  # what the linear keeps counts under its kind
            try:
                y2 = _Fp4LinearFn.apply(*args)  # type: ignore[no-untyped-call]
            finally:
                SAVING.reset(token)
        out: torch.Tensor = torch.ops.aten._unsafe_view(y2, (*x.shape[:-1], y2.shape[-1]))
        return out

    def _key(self, rows: int) -> torch.Tensor | None:
        """This call's stochastic-rounding key ``[seed, counter]``, the counter advanced past
        what its backward draws; ``None`` when nothing is rounded stochastically."""
        if not self.recipe.stochastic or not torch.is_grad_enabled():
            return None
        key = self.sr_key
        if replays_a_call():
            return key  # unused: the original call's key is the one its backward reads
        drawn = sum(
            grouped_counters([(0, rows)], self.out_features, self._how, wgrad)
            for wgrad in (False, True)  # dY's rows, then dYᵀ's padded columns
        )
        # A new tensor, never an in-place add: the key a backward holds is never written to
        # (a compiled backward may read it from the attribute as it was at the call).
        self.sr_key = key + key.new_tensor([0, drawn])
        return key

    def quantized_weight(self) -> Fp4Operand:
        """The weight's operand as the forward multiplies with it (codes, block scales and,
        NVFP4, the amax; no gradient). ``memory_report`` of its tensors counts 0.5039 bytes
        an element (NVFP4 16x16 tiles), 0.5625 (1x16) plus 4 a tensor, 0.53125 (MXFP4).
        Training holds none: every call quantizes the weight anew, as the fp8 linears do
        (a weight gathered in 4 bits, ``Fp4GatheredWeight``, is its operand as it came)."""
        with torch.no_grad():
            return _weight_operand(self.weight, self._how)

    def freeze_for_serving(
        self, mode: ServeMode = "weight_only", *, activation_amax: ActivationAmax = "per_row"
    ) -> FrozenFp4Linear:
        """This layer frozen for serving (``FrozenFp4Linear.from_fp4_linear``: its forward's
        own codes, ``mode`` ``"weight_only"`` or ``"w4a4"``), a new module to put in its place;
        ``freeze_fp4_for_serving`` does a whole model in place."""
        return FrozenFp4Linear.from_fp4_linear(self, mode, activation_amax=activation_amax)

    @property
    def weight_gather(self) -> Fp4ShardGather:
        """How a row shard of this layer's weight is quantized for FSDP2's 4-bit all-gather,
        and rebuilt into the whole weight's operands (``Fp4GatheredWeight``, which the layer
        multiplies with as it is: ``linear.fp4_gathered``)."""
        return Fp4ShardGather(self._how)

    # ----- state (get_extra_state, set_extra_state, plan_state_load: CounterLoads) -----------

    def check_load(self, entries: Mapping[str, object], prefix: str) -> None:
        """``ValueError`` naming the layer when ``entries`` (local names) were saved by an fp8
        layer or under another 4-bit recipe or seed (naming both policies), or hold a counter
        outside ``[0, FP4_COUNTER_LIMIT)`` or a negative stream (``guard_whole_loads`` runs
        this on every layer before any loads)."""
        layer = self.named(prefix[:-1])
        fp8 = sorted(k for k in entries if k.startswith("fp8_"))
        if fp8:
            raise ValueError(
                f"{layer} is an Fp4Linear under {self.recipe}, but the state dict holds "
                f"an fp8 layer's scaling state ({prefix}{fp8[0]}, ...): an fp8 checkpoint does not "
                f"load into a 4-bit model; convert under the fp8 recipe it was saved with"
            )
        if "_extra_state" in entries:  # an entry of None too: torch would hand it on
            where = f"{prefix}_extra_state of {layer}"
            saved_counter(entries["_extra_state"], self.recipe, where, "this layer runs")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def _recipe_of(ctx: object) -> Fp4Recipe:
    if not isinstance(ctx, ComputeCtx) or not isinstance(ctx.recipe, Fp4Recipe):
        got = ctx.recipe if isinstance(ctx, ComputeCtx) else ctx
        raise TypeError(
            f"Fp4Linear needs a ComputeCtx whose recipe is an Fp4Recipe (e.g. "
            f"ComputeCtx.from_flag('nvfp4', device)), got {describe(got)}"
        )
    return ctx.recipe


def _no_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The call on no rows, in high precision: an empty output of ``x``'s dtype, and a zero
    weight (and bias) gradient. A matmul of ``x`` as it came (its leading shape kept)."""
    y = x.matmul(weight.to(x.dtype).t())
    return y if bias is None else y + bias.to(x.dtype)


def _weight_operand(weight: torch.Tensor, how: Fp4Quant, dgrad: bool = False) -> Fp4Operand:
    """``W``'s operand (``Wᵀ``'s with ``dgrad``) at the weight's block: quantized from the
    weight, or, a weight gathered in 4 bits, as it came."""
    if isinstance(weight, Fp4GatheredWeight):
        return weight.dgrad_operand() if dgrad else weight.operand()
    return fp4_ops.quantize(weight.t() if dgrad else weight, how, weight=True)


def _operand(
    codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None = None
) -> Fp4Operand:
    if amax is None:
        return Mxfp4Operand(codes, scale)
    return Nvfp4Operand(codes, scale, amax.reshape(()), "1x16")


class _Fp4LinearFn(torch.autograd.Function):
    """Y = X Wᵀ + b in 4 bits; dX and dW by the operand table (module docstring)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        how: Fp4Quant,
        key: torch.Tensor | None,
        offloading: bool,
    ) -> torch.Tensor:
        qx = fp4_ops.quantize(x, how)
        qw = _weight_operand(weight, how)
        y = fp4_ops.scaled_mm(qx, qw, x.dtype, bias)
        saved: tuple[torch.Tensor, ...] = ()
        if weight.requires_grad:
            qxt = fp4_ops.quantize(x, how, columnwise=True)
            saved = (qxt.codes, qxt.scale, *([qxt.amax] if isinstance(qxt, Nvfp4Operand) else []))
            saved = offload_kept(ctx, saved) if offloading else saved
        ctx.save_for_backward(weight, *saved)
        ctx.how, ctx.key, ctx.x_dtype = how, key, x.dtype  # type: ignore[attr-defined]
        ctx.offloading = offloading  # type: ignore[attr-defined]
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        ctx.bias_dtype = None if bias is None else bias.dtype  # type: ignore[attr-defined]
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # 4-bit operands carry no graph: a second-order term would be lost (saved.py).
        refuse_double_backward("linear", "offload" if ctx.offloading else "keep", fp8_gemm=True)
        weight, *rest = ctx.saved_tensors
        kept = kept_back(ctx, tuple(rest))  # Xᵀ's operand: codes, scales (and NVFP4's amax)
        how, key = ctx.how, ctx.key
        dy = dy.contiguous()
        m, n = dy.shape
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            qdy = fp4_ops.quantize(dy, how, stochastic=key)
            qwt = _weight_operand(weight, how, dgrad=True)
            dx = fp4_ops.scaled_mm(qdy, qwt, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            col = None if key is None else key + key.new_tensor([0, m * n])  # dYᵀ: past dY's
            qdyt = fp4_ops.quantize(dy, how, columnwise=True, stochastic=col)
            dw = fp4_ops.scaled_mm(qdyt, _operand(*kept), torch.float32)
            dw = dw.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None
