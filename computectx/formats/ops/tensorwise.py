"""The tensor-wise fp8 operators: one step for a whole tensor.

Each operator is one ``torch.library`` custom op, one opaque node in a compiled graph: dynamo
does not trace into it, AOTAutograd functionalizes it through its declared mutations
(``mutates_args``), and its fake gives the output shapes without touching data. The
operator's Python signature is its argument list's one spelling: the Triton kernels
(``computectx.kernels.quantize``, ``kernels.scaled_mm``, imported on first use) are called
with its keywords and the pure-torch twins (``computectx.formats.numerics.tensorwise``) with
its values; the GEMM's twin and its error bound take the one ``GemmArgs`` the operator builds.

======================================  =========================================================
operator                                semantics
======================================  =========================================================
``fp8_quantize_delayed``                quantize with the ledger's step, advance ledger and tally
``fp8_quantize_dynamic``                quantize with ``x``'s own step, record it in the ledger
``fp8_quantize_with_step``              quantize with a given step; also ``amax(x)``
``fp8_scaled_mm``                       ``(a * step_a) @ (b * step_b).T (+ bias)``
``fp8_dequantize``                      ``data * step`` rounded once to a dtype
``wgrad_float32``                       ``dY^T X`` as an IEEE float32 matmul (``gw_hp``)
======================================  =========================================================

The checked entry points (``quantize_operand``, ``quantize_delayed``, ``quantize_dynamic``,
``quantize_with_step``, ``seed_ledger``, ``scaled_mm``) check in Python before the operator
is called, so under ``torch.compile`` they are traced and raise the same errors as in eager.

Backends (``computectx.formats.backend``): ``TRITON`` runs the kernels; ``REFERENCE`` the twins;
``CUBLAS`` the GEMM on ``torch._scaled_mm`` (``computectx.kernels.cublas``; two E5M2 operands,
which cuBLASLt refuses, on the twin) and the quantizes as ``TRITON`` on a GPU, as
``REFERENCE`` elsewhere. Quantized bytes agree bit for bit; GEMM outputs to float32
accumulation order. The step of an amax is ``amax / (fmt.max / 2**margin)`` (1.0 for a zero
or non-finite amax). Scalars are float32 ``(1,)`` tensors on the data's device, never Python
floats, so nothing here waits for the device.

The state the quantize operators advance lives in two device tensors per operand, both
declared mutated: the float32 ledger (``computectx.formats.numerics.ledger``'s layout; delayed
ledgers are kept oldest to newest, the history rotating one slot left per call) and an int64
*tally* ``[seeded, elements]``. None of these operators has an autograd formula: gradients
flow through the fp8 linear's ``autograd.Function``, written over them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal, cast

import torch
from torch.library import custom_op

from computectx.dtypes import Fp8Format
from computectx.formats.backend import (
    Backend,
    check_backend,
    check_bias_and_out,
    check_gemm_operands,
    fmt_arg,
    input_arg,
    margin_arg,
    parse_backend,
    scalar_arg,
    uses_kernels,
)
from computectx.formats.numerics import inline, tensorwise
from computectx.formats.numerics.inline import QuantizeImpl
from computectx.formats.numerics.ledger import (
    LEDGER_NONFINITE,
    LEDGER_SATURATED,
    LEDGER_STEP,
    TALLY_SEEDED,
    check_ledger,
    check_tally,
    count,
    ledger_history,
    ledger_history_len,
    record,
)
from computectx.formats.numerics.tensorwise import FORMAT_OF, FORMATS
from computectx.recipes import DelayedScaling, DynamicScaling

__all__ = [
    "delayed_call",
    "fp8_dequantize",
    "fp8_quantize_delayed",
    "fp8_quantize_dynamic",
    "fp8_quantize_with_step",
    "fp8_scaled_mm",
    "quantize_delayed",
    "quantize_dynamic",
    "quantize_operand",
    "quantize_with_step",
    "scaled_mm",
    "seed_ledger",
    "wgrad_float32",
]

Window = Literal["max", "most_recent"]

_BACKENDS = {b.value: b for b in Backend}
# An operator's backend argument is a member's value (the checked entry points pass
# `b.value`): looked up here, with parse_backend for any other spelling and its error.


# ---------------------------------------------------------------------------------------
# The operators.


def _quantize_kernels() -> ModuleType:
    # computectx.kernels.quantize, imported on first use (it imports triton).
    from computectx.kernels import quantize

    return quantize


def _delayed_at(
    x: torch.Tensor,
    fmt: Fp8Format,
    ledger: torch.Tensor,
    slot: int,
    algo: Window,
    margin: int,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    # One delayed quantize writing history `slot`, on the twin or the kernel.
    if not uses_kernels(backend, x):
        return tensorwise.quantize_delayed(x, fmt, ledger, slot, algo, margin)
    return _delayed_kernel(x, FORMATS[fmt].dtype, ledger, slot, algo, margin)


def _delayed_kernel(
    x: torch.Tensor,
    fp8: torch.dtype,
    ledger: torch.Tensor,
    slot: int,
    algo: Window,
    margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The kernel knows no ledger layout of its own: it gets this one's offsets.
    out: tuple[torch.Tensor, torch.Tensor] = _quantize_kernels().quantize_delayed(
        x=x,
        fp8=fp8,
        ledger=ledger,
        history_len=ledger_history_len(ledger),
        slot=slot,
        step_offset=LEDGER_STEP,
        nonfinite_offset=LEDGER_NONFINITE,
        saturated_offset=LEDGER_SATURATED,
        algo=algo,
        margin=margin,
    )
    return out


def _dynamic(
    x: torch.Tensor, fp8: torch.dtype, margin: int, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not uses_kernels(backend, x):
        return tensorwise.quantize_dynamic(x, FORMAT_OF.get(fp8) or Fp8Format.parse(fp8), margin)
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    out = _quantize_kernels().quantize_dynamic(x=x, fp8=fp8, margin=margin)
    return out


def delayed_call(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    algo: str,
    margin: int,
    backend: str,
    may_seed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize_delayed``: delayed scaling through one operand's ledger, ``(data_fp8,
    step_used)``.

    When the tally says the ledger is not seeded yet (and ``may_seed``), the history is first
    filled with ``amax(x)`` and the step set from it, so the first call quantizes with its own
    step (a non-finite amax leaves the ledger alone: the quantize counts it, once). Then the
    history rotates one slot left, ``x`` is quantized with the ledger's step, its amax lands
    in the last slot and the step becomes the next one from the window (``algo``); the tally
    counts ``x``. On a GPU with the kernels (docs/fp8.md, "Delayed scaling"): the quantize
    kernel, the rotation (none for a history of 1), the tally, and the seeding check's small
    ops when ``may_seed``.
    """
    chosen = _BACKENDS.get(backend) or parse_backend(backend)
    # REFERENCE runs the twin without asking (the call stays out of backend.py).
    kernels = chosen is not Backend.REFERENCE and uses_kernels(chosen, x)
    fmt = FORMAT_OF.get(fp8) or Fp8Format.parse(fp8)
    if may_seed:
        unseeded = tally[TALLY_SEEDED : TALLY_SEEDED + 1] == 0
        tensorwise.seed_ledger(ledger, x, fmt, margin, when=unseeded)
    history = ledger_history(ledger)
    if history.numel() > 1:
        history.copy_(torch.roll(history, -1))
    # The tally counts x after the rotation and before the quantize (which never reads it):
    # the launches stay in the order docs/fp8-kernels.md gives, the ledger's module entered once.
    count(tally, x)
    window: Window = "max" if algo == "max" else "most_recent"
    slot = history.numel() - 1
    if kernels:
        return _delayed_kernel(x, fp8, ledger, slot, window, margin)
    return tensorwise.quantize_delayed(x, fmt, ledger, slot, window, margin)


fp8_quantize_delayed = custom_op(
    "computectx::fp8_quantize_delayed", delayed_call, mutates_args=("ledger", "tally")
)
"""The operator over ``delayed_call`` (its plain function, which tests call to count launches)."""


@custom_op("computectx::fp8_quantize_dynamic", mutates_args=("ledger", "tally"))
def fp8_quantize_dynamic(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    margin: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic scaling through one operand's ledger: ``(data_fp8, step)``. The step comes from
    ``amax(x)``; the ledger records that amax in its last history slot (when finite; a
    non-finite one is counted instead) and the step; the tally counts ``x``."""
    q, step, a = _dynamic(x, fp8, margin, _BACKENDS.get(backend) or parse_backend(backend))
    record(ledger, a, step)
    count(tally, x)
    return q, step


@fp8_quantize_delayed.register_fake
@fp8_quantize_dynamic.register_fake
def _quantize_ledger_fake(
    x: torch.Tensor, ledger: torch.Tensor, tally: torch.Tensor, fp8: torch.dtype, *_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    # Both ledger quantizes: codes shaped like x, a (1,) float32 step.
    return torch.empty_like(x, dtype=fp8), ledger.new_empty(1)


@custom_op("computectx::fp8_quantize_with_step", mutates_args=())
def fp8_quantize_with_step(
    x: torch.Tensor, step: torch.Tensor, fp8: torch.dtype, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8(clamp(x / step)), amax(x))``: quantize with a given step (no state)."""
    if uses_kernels(_BACKENDS.get(backend) or parse_backend(backend), x):
        return _quantize_kernels().quantize_with_step(x=x, fp8=fp8, step=step)  # type: ignore[no-any-return]
    return tensorwise.quantize_with_step(x, FORMAT_OF.get(fp8) or Fp8Format.parse(fp8), step)


@fp8_quantize_with_step.register_fake
def _quantize_with_step_fake(
    x: torch.Tensor, step: torch.Tensor, fp8: torch.dtype, *_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, dtype=fp8), step.new_empty(1)


@custom_op("computectx::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``(a * step_a) @ (b * step_b).T (+ bias)`` for fp8 ``a [M, K]``, ``b [N, K]``."""
    chosen = _BACKENDS.get(backend) or parse_backend(backend)
    args = tensorwise.GemmArgs(a, b, step_a, step_b, bias, out_dtype)
    out: torch.Tensor
    if chosen is Backend.TRITON:
        from computectx.kernels import scaled_mm as kernel

        out = kernel.scaled_mm(**vars(args))
    elif chosen is Backend.CUBLAS and not a.dtype == b.dtype == torch.float8_e5m2:
        from computectx.kernels import cublas

        # cuBLAS's one launcher, at the per-tensor pair of granularities.
        out = cublas.scaled_mm(a, b, step_a, "tensor", step_b, "tensor", bias, out_dtype)
    else:
        # The twin; also CUBLAS's for two E5M2 operands, which cuBLASLt refuses (float32
        # products of the widened codes, which are exact), on the same device.
        out = tensorwise.scaled_mm(args)
    return out


@fp8_scaled_mm.register_fake
def _scaled_mm_fake(a: torch.Tensor, b: torch.Tensor, *rest: object) -> torch.Tensor:
    # The output is (M, N) at out_dtype, the last but one argument.
    return a.new_empty((a.shape[0], b.shape[0]), dtype=cast(torch.dtype, rest[-2]))


@custom_op("computectx::fp8_dequantize", mutates_args=())
def fp8_dequantize(data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * step`` formed in float32, rounded once to ``dtype``."""
    return tensorwise.dequantize(data, step, dtype)


@fp8_dequantize.register_fake
def _dequantize_fake(data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(data, dtype=dtype)


@custom_op("computectx::wgrad_float32", mutates_args=())
def wgrad_float32(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``gw_hp``'s weight gradient ``dYᵀ X`` as an IEEE float32 matmul, whatever the process's
    TF32 setting: TF32 would round float32 activations to 10 significant bits, below the
    high precision the option promises (bf16 and fp16 values are exact in TF32 either way).

    cuBLAS reads the setting when the matmul is launched, and torch offers no per-call
    argument for it, so the operator sets ``torch.backends.cuda.matmul.fp32_precision`` to
    ``"ieee"`` around that one call and restores it: nothing leaks, but a float32 matmul
    another thread launches in that window also runs IEEE. An operator, so that
    ``torch.compile`` neither traces the setting (a graph break) nor drops it.
    """
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        return torch.mm(dy.to(torch.float32).t(), x.to(torch.float32))
    finally:
        matmul.fp32_precision = before


@wgrad_float32.register_fake
def _wgrad_float32_fake(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return dy.new_empty((dy.shape[1], x.shape[1]), dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# The checked entry points.


def _unknown_window(algo: object) -> ValueError:
    return ValueError(f"unknown amax window algo {algo!r}; accepted: 'max', 'most_recent'")


def seed_ledger(ledger: torch.Tensor, x: torch.Tensor, fmt: Fp8Format, margin: int) -> None:
    """Seed an operand's ledger from its first input: history := amax(x), step from it.

    A non-finite amax leaves the ledger alone and counts nothing: the quantize that follows
    (``quantize_delayed``) measures the same amax and counts it, once. Device ops only.
    """
    data = input_arg(x)
    fmt = fmt_arg(fmt)
    check_ledger(ledger, 0, data.device)
    tensorwise.seed_ledger(ledger, data, fmt, margin_arg(margin))


def quantize_with_step(
    x: torch.Tensor, fmt: Fp8Format, step: torch.Tensor, *, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (bf16/fp16/fp32) with ``step``: returns ``(data_fp8, amax)``.

    ``data = fp8(clamp(x / step, ±fmt.max))``, same shape as ``x`` and contiguous; the
    amax of ``x`` comes from the same pass over the data (float32, shape ``(1,)``).
    """
    data = input_arg(x)
    fmt = fmt_arg(fmt)
    s = scalar_arg("step", step, data.device)
    b = check_backend(backend, data)
    q, a = fp8_quantize_with_step(data, s, FORMATS[fmt].dtype, b.value)
    return q, a


def quantize_dynamic(
    x: torch.Tensor, fmt: Fp8Format, margin: int, *, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize with the step from ``x``'s own amax: returns ``(data_fp8, step, amax)``.

    Two passes (amax, then cast). A zero or non-finite amax gives ``step = 1.0``; the caller
    decides whether to count a non-finite one.
    """
    data = input_arg(x)
    fmt = fmt_arg(fmt)
    m = margin_arg(margin)
    return _dynamic(data, FORMATS[fmt].dtype, m, check_backend(backend, data))


def quantize_delayed(
    x: torch.Tensor,
    fmt: Fp8Format,
    ledger: torch.Tensor,
    idx: int,
    algo: Window,
    margin: int,
    *,
    backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with the ledger's step and advance the ledger: returns ``(data_fp8, step_used)``.

    ``step_used`` is a copy of the ledger's step as it was before the call. Afterwards history
    slot ``idx`` holds ``amax(x)`` and the ledger's step is the next one from the window
    (``"max"``: largest amax in the history; ``"most_recent"``: this amax). A non-finite amax
    leaves history and step untouched and adds 1 to the non-finite count; elements with
    ``|x / step| > fmt.max`` are added to the saturated count. On the Triton backend all of
    this happens inside the one quantize launch.
    """
    data = input_arg(x)
    fmt = fmt_arg(fmt)
    check_ledger(ledger, idx, data.device)
    if algo not in ("max", "most_recent"):
        raise _unknown_window(algo)
    m = margin_arg(margin)
    return _delayed_at(data, fmt, ledger, idx, algo, m, check_backend(backend, data))


def quantize_operand(
    x: torch.Tensor,
    fmt: Fp8Format,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    scaling: DelayedScaling | DynamicScaling,
    *,
    backend: Backend,
    may_seed: bool = True,
    impl: QuantizeImpl = "op",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one operand through its ledger and tally (``fp8_quantize_delayed`` /
    ``fp8_quantize_dynamic``): returns ``(data_fp8, step)``.

    Delayed: the step is the ledger's (seeded from ``amax(x)`` on the operand's first call);
    dynamic: the step is ``x``'s own. Both record into the ledger and count ``x`` in the tally.
    ``may_seed=False`` promises a seeded ledger (eager callers that know it, to skip a pass).
    ``impl="inline"`` computes the same bytes with plain torch ops
    (``computectx.formats.numerics.inline``) instead of the operator, so Inductor can fuse them; it
    always checks the seeded flag (``may_seed`` is ignored) and runs on any backend.
    """
    data = input_arg(x)
    fmt = fmt_arg(fmt)
    b = check_backend(backend, data)
    m = margin_arg(scaling.margin)
    algo = scaling.algo if isinstance(scaling, DelayedScaling) else "max"
    check_ledger(ledger, 0, data.device)
    if algo not in ("max", "most_recent"):
        raise _unknown_window(algo)
    check_tally(tally, data.device)
    if impl != "op" and inline.parse_quantize(impl) == "inline":
        if isinstance(scaling, DelayedScaling):
            return inline.quantize_delayed(data, ledger, tally, fmt, scaling.algo, m)
        return inline.quantize_dynamic(data, ledger, tally, fmt, m)
    q: torch.Tensor
    step: torch.Tensor
    fp8 = FORMATS[fmt].dtype
    if isinstance(scaling, DelayedScaling):
        q, step = fp8_quantize_delayed(data, ledger, tally, fp8, scaling.algo, m, b.value, may_seed)
    else:
        q, step = fp8_quantize_dynamic(data, ledger, tally, fp8, m, b.value)
    return q, step


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: Backend,
) -> torch.Tensor:
    """``(a * step_a) @ (b * step_b).T (+ bias)`` with float32 accumulation.

    ``a`` is ``[M, K]`` and ``b`` is ``[N, K]``, each E4M3 or E5M2 (they may differ), any
    strides (``.t()`` views work); ``bias`` is ``[N]`` (bf16/fp16/fp32) or None; the result
    is a new ``[M, N]`` tensor of ``out_dtype`` (bf16, fp16 or fp32).
    """
    check_gemm_operands(a, b)
    sa = scalar_arg("step_a", step_a, a.device)
    sb = scalar_arg("step_b", step_b, a.device)
    check_bias_and_out(bias, out_dtype, a, b)
    chosen = check_backend(backend, a)
    out: torch.Tensor = fp8_scaled_mm(a, b, sa, sb, bias, out_dtype, chosen.value)
    return out
