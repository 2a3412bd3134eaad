"""fp8 operations behind one interface: input checks, then dispatch to a backend.

The checked quantize entry points users call live here (the GEMMs' in ``ops.gemm``);
``computectx.fp8.ops.registry`` registers the ``torch.library`` custom operators,
the nodes ``torch.compile`` sees, which these functions call once their checks pass.

Every operation takes a ``backend`` (``computectx.fp8.backend``: ``select_backend`` picks
one for a device and says why). ``TRITON`` runs the kernels in ``computectx.kernels``,
imported inside the function that launches them, so ``import computectx.fp8`` works without
triton; ``REFERENCE`` runs the pure-torch twins in ``computectx.fp8.numerics.tensorwise``;
``CUBLAS`` runs the GEMM on ``torch._scaled_mm`` and quantizes as ``TRITON`` does on a GPU, as
``REFERENCE`` elsewhere. Quantized bytes agree bit for bit between them; GEMM outputs agree
to float32 accumulation order.

The checks run in Python before the operator is called, so under ``torch.compile`` they
are traced and raise the same errors as in eager.
``Fp8Backend`` and ``select_backend`` are re-exported here for callers of these functions.

The step of an amax is ``amax / (fmt.max / 2**margin)`` (1.0 for a zero or non-finite
amax): the amax maps to ``fmt.max / 2**margin``, leaving ``2**margin`` of headroom.

Scalars (steps, amaxes) are float32 tensors of shape ``(1,)`` on the data's device, never
Python floats, so no operation here waits for the device. The delayed-scaling ledger of one
operand (``ledger_new``) is laid out by ``computectx.fp8.numerics.ledger``; the Triton kernel
receives that layout's offsets from ``ops.ledger_quantize``.
"""

from __future__ import annotations

from typing import Literal

import torch

from computectx.dtypes import FLOAT_DTYPES, FP8_DTYPES, DType, Fp8Format
from computectx.fp8.backend import Fp8Backend, check_backend, default_backend, select_backend
from computectx.fp8.numerics import blockwise, inline, layouts, tensorwise
from computectx.fp8.numerics.layouts import Granularity, MxRounding
from computectx.fp8.numerics.ledger import (
    LEDGER_SHAPE,
    TALLY_LEN,
    is_ledger,
    ledger_history_len,
    ledger_new,
)
from computectx.fp8.ops import block_quantize, ledger_quantize, registry
from computectx.recipes import DelayedScaling, DynamicScaling

__all__ = [
    "Fp8Backend",
    "fp8_dequantize",
    "fp8_quantize",
    "ledger_new",
    "quantize_delayed",
    "quantize_dynamic",
    "quantize_granular",
    "quantize_operand",
    "quantize_with_step",
    "scalar_arg",
    "seed_ledger",
    "select_backend",
]


# ---------------------------------------------------------------------------------------
# Input checks. Each raises TypeError/ValueError quoting the value and what is accepted;
# none reads a tensor's contents (that would wait for the device).


def _fmt_arg(fmt: object) -> Fp8Format:
    if isinstance(fmt, Fp8Format):
        return fmt
    if isinstance(fmt, (str, torch.dtype)):
        return Fp8Format.parse(fmt)
    raise TypeError(f"fmt must be an Fp8Format or its name, got {fmt!r}; accepted: e4m3, e5m2")


def _quantizable_arg(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor to quantize, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        accepted = ", ".join(map(str, FLOAT_DTYPES))
        raise ValueError(f"cannot quantize a {x.dtype} tensor; accepted: {accepted}")
    return x


def _input_arg(x: object) -> torch.Tensor:
    data = _quantizable_arg(x)
    return data if data.is_contiguous() else data.contiguous()


def scalar_arg(name: str, s: object, device: torch.device) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor of one element, got {type(s).__name__}")
    if s.dtype != torch.float32 or s.numel() != 1:
        raise ValueError(
            f"{name} must be a float32 tensor of one element (shape (1,) or ()); "
            f"got dtype {s.dtype}, shape {tuple(s.shape)}"
        )
    if s.device != device:
        raise ValueError(f"{name} is on {s.device} but the data is on {device}")
    return s.reshape(1)


def _margin_arg(margin: object) -> int:
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= 64:
        raise ValueError(f"margin must be an int in [0, 64], got {margin!r}")
    return margin


def _ledger_args(ledger: object, idx: object, algo: object, device: torch.device) -> int:
    if not isinstance(ledger, torch.Tensor):
        raise TypeError(f"ledger must be a tensor from ledger_new, got {type(ledger).__name__}")
    if not is_ledger(ledger):
        raise ValueError(
            f"ledger must be {LEDGER_SHAPE} (ledger_new); "
            f"got dtype {ledger.dtype}, shape {tuple(ledger.shape)}"
        )
    if not ledger.is_contiguous():
        raise ValueError("ledger must be contiguous (it is updated in place)")
    if ledger.device != device:
        raise ValueError(f"ledger is on {ledger.device} but the data is on {device}")
    n = ledger_history_len(ledger)
    if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
        raise ValueError(f"ledger index must be an int in [0, {n}), got {idx!r}")
    if algo not in ("max", "most_recent"):
        raise ValueError(f"unknown amax window algo {algo!r}; accepted: 'max', 'most_recent'")
    return n


# ---------------------------------------------------------------------------------------
# Operations.


def seed_ledger(ledger: torch.Tensor, x: torch.Tensor, fmt: Fp8Format, margin: int) -> None:
    """Seed an operand's ledger from its first input: history := amax(x), step from it.

    A non-finite amax leaves the ledger alone and counts nothing: the quantize that follows
    (``quantize_delayed``) measures the same amax and counts it, once. Device ops only.
    """
    data = _input_arg(x)
    fmt = _fmt_arg(fmt)
    _ledger_args(ledger, 0, "max", data.device)
    tensorwise.seed_ledger(ledger, data, fmt, _margin_arg(margin))


def quantize_with_step(
    x: torch.Tensor, fmt: Fp8Format, step: torch.Tensor, *, backend: Fp8Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (bf16/fp16/fp32) with ``step``: returns ``(data_fp8, amax)``.

    ``data = fp8(clamp(x / step, ±fmt.max))``, same shape as ``x`` and contiguous; the
    amax of ``x`` comes from the same pass over the data (float32, shape ``(1,)``).
    """
    data = _input_arg(x)
    fmt = _fmt_arg(fmt)
    s = scalar_arg("step", step, data.device)
    b = check_backend(backend, data)
    q, a = registry.fp8_quantize_with_step(data, s, fmt.torch, b.value)
    return q, a


def quantize_dynamic(
    x: torch.Tensor, fmt: Fp8Format, margin: int, *, backend: Fp8Backend
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize with the step from ``x``'s own amax: returns ``(data_fp8, step, amax)``.

    Two passes (amax, then cast). A zero or non-finite amax gives ``step = 1.0``; the caller
    decides whether to count a non-finite one.
    """
    data = _input_arg(x)
    fmt = _fmt_arg(fmt)
    m = _margin_arg(margin)
    return ledger_quantize.quantize_dynamic_with(data, fmt, m, check_backend(backend, data))


def quantize_delayed(
    x: torch.Tensor,
    fmt: Fp8Format,
    ledger: torch.Tensor,
    idx: int,
    algo: Literal["max", "most_recent"],
    margin: int,
    *,
    backend: Fp8Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with the ledger's step and advance the ledger: returns ``(data_fp8, step_used)``.

    ``step_used`` is a copy of the ledger's step as it was before the call. Afterwards history
    slot ``idx`` holds ``amax(x)`` and the ledger's step is the next one from the window
    (``"max"``: largest amax in the history; ``"most_recent"``: this amax). A non-finite amax
    leaves history and step untouched and adds 1 to the non-finite count; elements with
    ``|x / step| > fmt.max`` are added to the saturated count. On the Triton backend all of
    this happens inside the one quantize launch.
    """
    data = _input_arg(x)
    fmt = _fmt_arg(fmt)
    _ledger_args(ledger, idx, algo, data.device)
    m = _margin_arg(margin)
    return ledger_quantize.quantize_delayed_at(
        data, fmt, ledger, idx, algo, m, check_backend(backend, data)
    )


def quantize_operand(
    x: torch.Tensor,
    fmt: Fp8Format,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    scaling: DelayedScaling | DynamicScaling,
    *,
    backend: Fp8Backend,
    may_seed: bool = True,
    impl: inline.QuantizeImpl = "op",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one operand through its ledger and tally (``computectx.fp8.ops.registry``'s
    ``fp8_quantize_delayed`` / ``fp8_quantize_dynamic``): returns ``(data_fp8, step)``.

    Delayed: the step is the ledger's (seeded from ``amax(x)`` on the operand's first call);
    dynamic: the step is ``x``'s own. Both record into the ledger and count ``x`` in the tally.
    ``may_seed=False`` promises a seeded ledger (eager callers that know it, to skip a pass).
    ``impl="inline"`` computes the same bytes with plain torch ops
    (``computectx.fp8.numerics.inline``) instead of the operator, so Inductor can fuse them; it
    always checks the seeded flag (``may_seed`` is ignored) and runs on any backend.
    """
    data = _input_arg(x)
    fmt = _fmt_arg(fmt)
    algo = scaling.algo if isinstance(scaling, DelayedScaling) else "max"
    _ledger_args(ledger, 0, algo, data.device)
    if (
        not isinstance(tally, torch.Tensor)
        or tally.dtype != torch.int64
        or tuple(tally.shape) != (TALLY_LEN,)
        or tally.device != data.device
    ):
        got = (
            f"{tally.dtype} {tuple(tally.shape)} on {tally.device}"
            if isinstance(tally, torch.Tensor)
            else type(tally).__name__
        )
        raise ValueError(
            f"tally must be an int64 tensor of shape ({TALLY_LEN},) on {data.device} "
            f"(computectx.fp8.numerics.ledger.tally_new); got {got}"
        )
    b = check_backend(backend, data)
    m = _margin_arg(scaling.margin)
    how = inline.parse_quantize(impl)
    q: torch.Tensor
    step: torch.Tensor
    if isinstance(scaling, DelayedScaling):
        if how == "inline":
            return inline.quantize_delayed(data, ledger, tally, fmt, scaling.algo, m)
        q, step = registry.fp8_quantize_delayed(
            data, ledger, tally, fmt.torch, scaling.algo, m, b.value, may_seed
        )
    elif how == "inline":
        return inline.quantize_dynamic(data, ledger, tally, fmt, m)
    else:
        q, step = registry.fp8_quantize_dynamic(data, ledger, tally, fmt.torch, m, b.value)
    return q, step


# ---------------------------------------------------------------------------------------
# The standalone API.


def _scale_arg(scale: object, device: torch.device) -> torch.Tensor:
    if isinstance(scale, bool):
        raise TypeError(f"scale must be a positive float or a float32 tensor, got {scale!r}")
    if isinstance(scale, (int, float)):
        value = float(scale)
        if not (value > 0.0 and value != float("inf")):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        # A fill on the device, not torch.tensor(..., device=...): no blocking host copy.
        return torch.full((1,), value, dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        return scalar_arg("scale", scale, device)
    raise TypeError(
        f"scale must be a positive float, a float32 tensor of one element or None, "
        f"got {type(scale).__name__}"
    )


def fp8_quantize(
    x: torch.Tensor,
    fmt: Fp8Format | str,
    scale: torch.Tensor | float | None = None,
    *,
    granularity: Granularity = "tensor",
    power_of_two: bool | None = None,
    mx_rounding: MxRounding | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to fp8: returns ``(data, scale)`` with ``x ≈ data.float() * scale``.

    ``scale`` is the dequantize step: ``data = fp8(clamp(x / scale))`` and
    ``x ≈ data * scale``, the factor ``torch._scaled_mm`` takes as ``scale_a``/``scale_b``.
    torchao's and TransformerEngine's ``scale`` is its reciprocal (``data = x * scale``):
    pass ``scale=1 / their_scale`` (docs/migrating.md).

    ``fmt`` is an ``Fp8Format`` or its name (``"e4m3"``, ``"fp8_e5m2"``, ...). ``scale=None``
    measures ``amax(x)`` and uses ``scale = amax / fmt.max`` (dynamic scaling, margin 0; 1.0
    for an all-zero or non-finite input); a given scale (positive float, or float32 tensor
    of one element on ``x``'s device, whose value is not inspected) is used as is and
    returned as a tensor. Values beyond ``fmt.max * scale`` saturate; NaN stays NaN.
    The backend is ``select_backend(x.device)``'s choice.

    ``granularity`` (``"tensor"``, ``"row"``, ``"1x128"``, ``"128x128"``, ``"mx"``) gives
    each block of ``x`` its own step; ``scale`` then has one step per block (documented
    shape, float32; ``float8_e8m0fnu`` for ``"mx"``), measured or given. ``power_of_two``
    rounds measured steps up to powers of two (default: on for ``"row"`` only);
    ``mx_rounding`` picks the MX exponent rule (``"rceil"``, the default, or ``"floor"``).
    See ``computectx.fp8.numerics.blockwise`` and docs/fp8.md, "Fine-grained scaling".
    """
    data = _quantizable_arg(x)
    return quantize_granular(
        data,
        fmt,
        granularity,
        scale,
        power_of_two=power_of_two,
        mx_rounding=mx_rounding,
        backend=default_backend(data.device),
    )


def quantize_granular(
    x: torch.Tensor,
    fmt: Fp8Format | str,
    granularity: Granularity = "tensor",
    scale: torch.Tensor | float | None = None,
    *,
    power_of_two: bool | None = None,
    mx_rounding: MxRounding | None = None,
    columnwise: bool = False,
    backend: Fp8Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quantize`` on a given backend: ``(data, scale)``.

    ``columnwise=True`` quantizes ``x.t()`` of a 2-D ``x`` (``data`` is ``[K, rows]``,
    contiguous, its blocks run along ``x``'s columns): the operand a backward GEMM that
    contracts over ``x``'s rows needs. The kernels read the transpose in place.
    """
    data = _quantizable_arg(x)
    f = _fmt_arg(fmt)
    g = layouts.granularity_arg(granularity)
    rule = block_quantize.step_rule(g, power_of_two, mx_rounding, given=scale is not None)
    if not isinstance(columnwise, bool):
        raise TypeError(f"columnwise must be a bool, got {columnwise!r}")
    if columnwise:
        if data.dim() != 2:
            raise ValueError(
                f"columnwise quantizes the transpose of a 2-D tensor; got shape {tuple(data.shape)}"
            )
        data = data.t()
    b = check_backend(backend, data)
    if g != "tensor":
        return block_quantize.quantize_blocks(data, f, g, rule, scale, backend=b)
    data = data.contiguous()
    if scale is not None:
        step = _scale_arg(scale, data.device)
    elif rule == "pow2":
        step = blockwise.power_of_two_steps(tensorwise.step_from_amax(tensorwise.amax(data), f, 0))
    else:
        q, step, _ = quantize_dynamic(data, f, 0, backend=b)
        return q, step
    q, _ = quantize_with_step(data, f, step, backend=b)
    return q, step


def fp8_dequantize(
    data: torch.Tensor, scale: torch.Tensor | float, dtype: DType | torch.dtype | str
) -> torch.Tensor:
    """``data.float() * scale`` rounded once to ``dtype`` (a ``DType``, name or torch dtype).

    ``data`` must be an fp8 tensor; the product is formed in float32 (the precision the
    kernels dequantize in) and then rounded to ``dtype``. A per-block ``scale`` (from
    ``fp8_quantize(..., granularity=)``: more than one element, or E8M0) is broadcast
    back over its blocks; its shape and dtype say which granularity it is.
    """
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data must be an fp8 tensor, got {type(data).__name__}")
    if data.dtype not in FP8_DTYPES:
        raise ValueError(
            f"data must be float8_e4m3fn or float8_e5m2 (from fp8_quantize), got {data.dtype}"
        )
    target = DType.parse(dtype).torch
    if block_quantize.is_block_scale(scale):
        return block_quantize.dequantize_blocks(data, scale, target)
    out: torch.Tensor = registry.fp8_dequantize(data, _scale_arg(scale, data.device), target)
    return out
