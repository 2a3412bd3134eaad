"""The fp8 operations as torch operators (``torch.library``), so ``torch.compile`` sees them.

Two modules split the fp8 operations: this one, ``custom_ops``, registers the
``torch.library`` custom operators, the nodes a compiled graph sees; ``computectx.fp8.ops``
holds the checked entry points users call, which check their arguments and then call the
operators here.

Each operator below is one opaque node in a compiled graph: dynamo does not trace into it,
AOTAutograd functionalizes it through its declared mutations (``mutates_args``), and its
fake implementation gives the output shapes without touching data. Eager calls run the same
Python function as before (``computectx.fp8.ops`` checks the arguments first), so the bytes,
the bounds and the absence of host synchronisation are unchanged.

======================================  =========================================================
operator                                semantics
======================================  =========================================================
``computectx::fp8_quantize_delayed``    quantize with the ledger's step, advance ledger and tally
``computectx::fp8_quantize_dynamic``    quantize with ``x``'s own step, record it in the ledger
``computectx::fp8_quantize_with_step``  quantize with a given step; also ``amax(x)``
``computectx::fp8_scaled_mm``           ``(a * step_a) @ (b * step_b).T (+ bias)``
``computectx::fp8_dequantize``          ``data * step`` rounded once to a dtype
======================================  =========================================================

The state the quantize operators advance lives in two device tensors per operand, both
declared mutated: the float32 ledger (``computectx.fp8.ledger``'s layout) and an int64 *tally*
``[seeded, elements]``. Nothing is kept in Python attributes, so a compiled step advances
exactly what an eager step advances and no value is specialised into a guard.

Delayed ledgers are kept oldest to newest: each call rotates the history one slot to the left
(the oldest entry moves to the last slot) and the quantize writes its amax into the last
slot. That is the circular ring of earlier versions with the write index pinned to the end,
so the window (and therefore every step) is the same, and no host-side index exists to
change between calls.

None of these operators has an autograd formula of its own: gradients flow through the fp8
linear's ``autograd.Function`` (``computectx.fp8.autograd``), which is written over them.
Calling one on a tensor that requires grad and then differentiating raises torch's
"no autograd formula" error rather than returning a wrong gradient.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch.library import custom_op

from computectx import capability
from computectx.dtypes import Fp8Format
from computectx.fp8 import reference
from computectx.fp8.backend import Fp8Backend, parse_backend
from computectx.fp8.ledger import (
    LEDGER_NONFINITE,
    LEDGER_SATURATED,
    LEDGER_STEP,
    ledger_history,
    ledger_history_len,
    ledger_nonfinite,
    ledger_slot,
    ledger_step,
)

__all__ = [
    "CUBLAS_MULTIPLE",
    "TALLY_ELEMENTS",
    "TALLY_LEN",
    "TALLY_SEEDED",
    "count",
    "cublas_bias",
    "cublas_gemm_dtype",
    "cublas_operand",
    "cublas_result",
    "delayed_call",
    "dequantize",
    "quantize_delayed",
    "quantize_delayed_at",
    "quantize_dynamic",
    "quantize_dynamic_with",
    "quantize_with_step",
    "round_up",
    "scaled_mm",
    "tally_new",
    "triton_imports",
    "uses_kernels",
]

TALLY_SEEDED = 0
"""Tally slot: 1 once the operand's first call has run (its ledger was seeded), else 0."""
TALLY_ELEMENTS = 1
"""Tally slot: elements quantized through the operand so far."""
TALLY_LEN = 2


def tally_new(device: torch.device) -> torch.Tensor:
    """A fresh tally on ``device``: not seeded, no elements (int64 ``[seeded, elements]``).

    Never an inference tensor (it is updated in place, as the ledger is).
    """
    with torch.inference_mode(False):
        return torch.zeros(TALLY_LEN, dtype=torch.int64, device=device)


def _fmt(fp8: torch.dtype) -> Fp8Format:
    return Fp8Format.parse(fp8)


def count(tally: torch.Tensor, x: torch.Tensor) -> None:
    """Mark the tally seeded and add ``x``'s elements: a fill and an add on the device, no
    host read."""
    tally[TALLY_SEEDED : TALLY_SEEDED + 1].fill_(1)
    tally[TALLY_ELEMENTS : TALLY_ELEMENTS + 1].add_(x.numel())


def quantize_delayed_at(
    x: torch.Tensor,
    fmt: Fp8Format,
    ledger: torch.Tensor,
    slot: int,
    algo: Literal["max", "most_recent"],
    margin: int,
    backend: Fp8Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed quantize writing history ``slot``, on the kernels or the pure-torch twin
    (``uses_kernels``); arguments already checked. The kernel knows no ledger layout of its
    own: it gets this one's offsets."""
    if not uses_kernels(backend, x):
        return reference.quantize_delayed(x, fmt, ledger, slot, algo, margin)
    from computectx.kernels import quantize

    return quantize.quantize_delayed(
        x=x,
        fp8=fmt.torch,
        ledger=ledger,
        history_len=ledger_history_len(ledger),
        slot=slot,
        step_offset=LEDGER_STEP,
        nonfinite_offset=LEDGER_NONFINITE,
        saturated_offset=LEDGER_SATURATED,
        algo=algo,
        margin=margin,
    )


def quantize_dynamic_with(
    x: torch.Tensor, fmt: Fp8Format, margin: int, backend: Fp8Backend
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data_fp8, step, amax)`` from ``x``'s own amax, on the kernels or the twin."""
    if not uses_kernels(backend, x):
        return reference.quantize_dynamic(x, fmt, margin)
    # Kernel modules are imported on first use: importing one imports triton, and decorating
    # its kernels reads TRITON_INTERPRET, which must be settled by then.
    from computectx.kernels import quantize

    return quantize.quantize_dynamic(x=x, fp8=fmt.torch, margin=margin)


@functools.cache
def triton_imports() -> bool:
    """Whether triton imports here (``capability.triton_available``, probed once)."""
    return capability.triton_available().ok


def uses_kernels(backend: Fp8Backend, x: torch.Tensor) -> bool:
    """Whether ``backend`` quantizes ``x`` with the Triton kernels (else the pure-torch twins).

    TRITON runs every op on the kernels; CUBLAS quantizes with them on a GPU where triton
    imports (its GEMM is torch._scaled_mm) and with the twins elsewhere: ``select_backend``
    picks CUBLAS precisely when triton does not import.
    """
    return backend is Fp8Backend.TRITON or (
        backend is Fp8Backend.CUBLAS and x.device.type == "cuda" and triton_imports()
    )


def delayed_call(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fmt: Fp8Format,
    algo: Literal["max", "most_recent"],
    margin: int,
    backend: Fp8Backend,
    may_seed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``fp8_quantize_delayed`` runs, as a plain function: ``(data_fp8, step_used)``.

    When the tally says the ledger is not seeded yet, the history is first filled with
    ``amax(x)`` and the step set from it, so the first call quantizes with its own step (a
    non-finite amax leaves the ledger alone: the quantize counts it, once). ``may_seed=False``
    promises the ledger is seeded and skips that check. Then the history rotates one slot
    left, ``x`` is quantized with the ledger's step, its amax lands in the last slot and the
    step becomes the next one from the window (``algo``); the tally counts ``x``.

    Launches on a GPU with the kernels (docs/fp8.md, "Delayed scaling"): the quantize
    kernel, the rotation (roll, copy; none for a history of 1) and the tally (fill, add),
    plus the seeding check's small ops when ``may_seed``.
    """
    if may_seed:
        unseeded = tally[TALLY_SEEDED : TALLY_SEEDED + 1] == 0
        reference.seed_ledger(ledger, x, fmt, margin, when=unseeded)
    history = ledger_history(ledger)
    if history.numel() > 1:
        history.copy_(torch.roll(history, -1))
    q, step_used = quantize_delayed_at(x, fmt, ledger, history.numel() - 1, algo, margin, backend)
    count(tally, x)
    return q, step_used


@custom_op("computectx::fp8_quantize_delayed", mutates_args=("ledger", "tally"))
def quantize_delayed(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    algo: str,
    margin: int,
    backend: str,
    may_seed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed scaling through one operand's ledger: ``delayed_call``'s ``(data_fp8,
    step_used)``. Arguments are checked by ``computectx.fp8.ops.quantize_operand``."""
    window: Literal["max", "most_recent"] = "max" if algo == "max" else "most_recent"
    return delayed_call(
        x, ledger, tally, _fmt(fp8), window, margin, parse_backend(backend), may_seed
    )


@quantize_delayed.register_fake
def _quantize_delayed_fake(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    algo: str,
    margin: int,
    backend: str,
    may_seed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, dtype=fp8), ledger.new_empty(1)


@custom_op("computectx::fp8_quantize_dynamic", mutates_args=("ledger", "tally"))
def quantize_dynamic(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    margin: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic scaling through one operand's ledger: ``(data_fp8, step)``.

    The step comes from ``amax(x)``; the ledger records that amax in its last history slot
    (when finite; a non-finite one is counted instead) and the step; the tally counts ``x``.
    """
    q, step, a = quantize_dynamic_with(x, _fmt(fp8), margin, parse_backend(backend))
    record(ledger, a, step)
    count(tally, x)
    return q, step


@quantize_dynamic.register_fake
def _quantize_dynamic_fake(
    x: torch.Tensor,
    ledger: torch.Tensor,
    tally: torch.Tensor,
    fp8: torch.dtype,
    margin: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, dtype=fp8), ledger.new_empty(1)


def record(ledger: torch.Tensor, amax: torch.Tensor, step: torch.Tensor) -> None:
    """Write an amax (into the newest history slot) and the step used with it; a
    non-finite amax is counted and leaves the recorded amax as it was. Device ops only."""
    a = amax.reshape(1).to(device=ledger.device, dtype=torch.float32)
    finite = torch.isfinite(a)
    slot = ledger_slot(ledger, ledger_history_len(ledger) - 1)
    slot.copy_(torch.where(finite, a, slot))
    ledger_step(ledger).copy_(step.reshape(1))
    ledger_nonfinite(ledger).add_((~finite).to(torch.float32))


@custom_op("computectx::fp8_quantize_with_step", mutates_args=())
def quantize_with_step(
    x: torch.Tensor, step: torch.Tensor, fp8: torch.dtype, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8(clamp(x / step)), amax(x))``: quantize with a given step (no state)."""
    b = parse_backend(backend)
    if uses_kernels(b, x):
        from computectx.kernels import quantize

        return quantize.quantize_with_step(x=x, fp8=fp8, step=step)
    return reference.quantize_with_step(x, _fmt(fp8), step)


@quantize_with_step.register_fake
def _quantize_with_step_fake(
    x: torch.Tensor, step: torch.Tensor, fp8: torch.dtype, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, dtype=fp8), step.new_empty(1)


CUBLAS_MULTIPLE = 16
"""What ``torch._scaled_mm`` on CUDA wants K and N to be multiples of (M may be anything)."""


def round_up(n: int, multiple: int = CUBLAS_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def cublas_operand(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` itself when it is row-major with 16-byte aligned rows and the wanted shape; else
    a row-major copy, zero-padded to ``[rows, cols]`` (one read and write of a 1-byte
    operand): a GEMM operand as CUDA's ``_scaled_mm`` takes it."""
    aligned = t.stride(0) % CUBLAS_MULTIPLE == 0 and t.storage_offset() % CUBLAS_MULTIPLE == 0
    if tuple(t.shape) == (rows, cols) and t.stride(1) == 1 and t.stride(0) >= cols and aligned:
        return t
    padded = tuple(t.shape) != (rows, cols)
    out = t.new_zeros((rows, cols)) if padded else t.new_empty((rows, cols))
    out[: t.shape[0], : t.shape[1]].copy_(t)
    return out


def cublas_gemm_dtype(bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.dtype:
    """What a cuBLAS scaled GEMM returns: ``out_dtype``, or float32 when the bias cannot be
    fused (cuBLAS fuses one only into a 16-bit output of the bias's dtype) and is added
    after, before the one rounding to ``out_dtype``."""
    fuse = bias is not None and bias.dtype == out_dtype != torch.float32
    return out_dtype if bias is None or fuse else torch.float32


def cublas_bias(
    bias: torch.Tensor | None, out_dtype: torch.dtype, n_padded: int
) -> torch.Tensor | None:
    """The bias cuBLAS fuses, zero-padded to the padded N; ``None`` when there is none to
    fuse (see ``cublas_gemm_dtype``)."""
    if bias is None or cublas_gemm_dtype(bias, out_dtype) == torch.float32:
        return None
    n = bias.shape[0]
    return bias if n_padded == n else torch.cat([bias, bias.new_zeros(n_padded - n)])


def cublas_result(
    out: torch.Tensor,
    m: int,
    n: int,
    bias: torch.Tensor | None,
    fused: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """A padded cuBLAS result cut to ``[m, n]``, with an unfused bias added in float32 and
    rounded once to ``out_dtype``."""
    padded = tuple(out.shape) != (m, n)
    out = out[:m, :n] if padded else out
    if bias is not None and fused is None:
        return (out + bias.to(torch.float32)).to(out_dtype)
    return out.contiguous() if padded else out


def _cublas_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    # torch._scaled_mm's rules on CUDA (its meta function states them): mat1 row-major
    # [M, K], mat2 column-major [K, N] (b [N, K] row-major, transposed), K and N multiples
    # of 16, float32 scalar scales, never two E5M2 operands. Its scales are exactly our
    # steps (x = q * step). K and N are zero-padded to multiples of 16: a zero adds nothing
    # to a float32 sum, and the padded columns of the result are sliced off, so the result
    # is the same function. It takes a bias only for 16-bit outputs of the bias's dtype; a
    # float32 result adds it in float32 after, before the one rounding to out_dtype.
    if a.dtype == b.dtype == torch.float8_e5m2:
        # cuBLASLt has no E5M2 x E5M2 fp8 GEMM: the twin runs this one (float32 products of
        # the widened codes, which are exact), on the same device.
        return reference.scaled_mm(a, b, step_a, step_b, bias, out_dtype)
    m, k = a.shape
    n = b.shape[0]
    k16, n16 = round_up(k), round_up(n)
    a16 = cublas_operand(a, m, k16)
    b16 = cublas_operand(b, n16, k16)
    fused_bias = cublas_bias(bias, out_dtype, n16)
    out = torch._scaled_mm(
        a16,
        b16.t(),
        scale_a=step_a.reshape(()),
        scale_b=step_b.reshape(()),
        bias=fused_bias,
        out_dtype=cublas_gemm_dtype(bias, out_dtype),
    )
    return cublas_result(out, m, n, bias, fused_bias, out_dtype)


@custom_op("computectx::fp8_scaled_mm", mutates_args=())
def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """``(a * step_a) @ (b * step_b).T (+ bias)`` for fp8 ``a [M, K]``, ``b [N, K]``."""
    chosen = parse_backend(backend)
    if chosen is Fp8Backend.TRITON:
        from computectx.kernels import scaled_mm as gemm

        return gemm.scaled_mm(
            a=a, b=b, step_a=step_a, step_b=step_b, bias=bias, out_dtype=out_dtype
        )
    if chosen is Fp8Backend.CUBLAS:
        return _cublas_scaled_mm(a, b, step_a, step_b, bias, out_dtype)
    return reference.scaled_mm(a, b, step_a, step_b, bias, out_dtype)


@scaled_mm.register_fake
def _scaled_mm_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@custom_op("computectx::fp8_dequantize", mutates_args=())
def dequantize(data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * step`` formed in float32, rounded once to ``dtype``."""
    return reference.dequantize(data, step, dtype)


@dequantize.register_fake
def _dequantize_fake(data: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(data, dtype=dtype)
