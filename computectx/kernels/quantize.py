"""fp8 quantize kernel: cast with a per-tensor step, amax in the same pass, ledger finalize.

One kernel serves three recipes, chosen by constexpr flags:

- ``quantize_with_step``: cast ``x / step`` to fp8 and measure ``amax(x)``;
- ``quantize_delayed``: the same with the step read from the operand's ledger; the last
  program to finish (an atomic ticket) writes the amax into the history, reduces the window
  and publishes the next step into the ledger: no host sync, no second launch. The ledger's
  layout belongs to the caller (``computectx.formats.numerics.ledger``), which passes its history
  length and offsets; they reach the kernel as constexpr arguments;
- ``quantize_dynamic``: an amax-only launch that also publishes the step, then a cast-only
  launch that reads it.

The pure-torch twins are in ``computectx.formats.numerics.tensorwise``; quantized bytes agree bit
for bit.
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

from typing import Final, Literal, NamedTuple

import torch
import triton
import triton.language as tl

from computectx.kernels.fp8_codes import FLOAT_DTYPES, code_bound
from computectx.kernels.quantize_cast import (
    FLT_MAX,
    FLT_MIN,
    check_fp8,
    clamped_byte,
    fp8_constants,
    load_widened,
)

__all__ = ["INTERPRETED", "quantize_delayed", "quantize_dynamic", "quantize_with_step"]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when it
was imported) rather than compiled for a GPU; fixed at import."""
# Under the interpreter every program runs in turn on the CPU: small tiles and few programs
# make small test tensors exercise the grid-stride loop and the last-program finalize.
_BLOCK: Final[int] = 64 if INTERPRETED else 4096
_WARPS: Final[int] = 4 if INTERPRETED else 8
_PROGRAMS_PER_SM: Final[int] = 8
_INTERPRET_PROGRAMS: Final[int] = 3
# The history window is reduced RBLOCK slots at a time; small under the interpreter so
# that short test histories exercise the loop.
_RBLOCK: Final[int] = 16 if INTERPRETED else 1024

# What the last program does after the pass (the kernel's REDUCE). The values are
# constexpr globals, the only globals a jit function may read.
_REDUCE_NONE = tl.constexpr(0)  # nothing: cast only
_REDUCE_AMAX = tl.constexpr(1)  # write amax
_REDUCE_DYNAMIC = tl.constexpr(2)  # write amax and the step derived from it
_REDUCE_LEDGER = tl.constexpr(3)  # delayed scaling: history, window, next step, counts

# The int32 scratch that programs fold their results into (one per device and stream).
_SCRATCH_TICKET = tl.constexpr(0)  # programs finished so far
_SCRATCH_AMAX = tl.constexpr(1)  # max |x| as int32 bits
_SCRATCH_SATURATED = tl.constexpr(2)  # saturated elements
_SCRATCH_LEN: Final[int] = 3


@triton.jit
def _step_of(amax, TARGET: tl.constexpr):  # type: ignore[no-untyped-def]
    # amax / TARGET; NaN, inf, underflow to 0 and overflow to inf all give 1. A step below
    # float32's normal range keeps too few bits: it is raised to the smallest normal
    # (numerics.tensorwise.step_from_amax does the same).
    step = tl.div_rn(amax, TARGET)
    ok = (step > 0.0) & (step <= FLT_MAX)
    step = tl.where(ok & (step < FLT_MIN), FLT_MIN, step)
    return tl.where(ok, step, 1.0)


@triton.jit
def _advance_ledger(  # type: ignore[no-untyped-def]
    ledger_ptr,
    ledger_idx,
    n_hist,
    amax,
    finite,
    sat_count,
    TARGET: tl.constexpr,
    ALGO_MAX: tl.constexpr,
    LEDGER_STEP: tl.constexpr,
    LEDGER_NONFINITE: tl.constexpr,
    LEDGER_SATURATED: tl.constexpr,
    RBLOCK: tl.constexpr,
):
    # The window with this amax in slot ledger_idx, built in registers (the ledger itself is
    # written once, below): history ledger_ptr[:n_hist], then the step, the non-finite count
    # and the saturated count at n_hist + the LEDGER_* offsets.
    window = tl.zeros((RBLOCK,), dtype=tl.float32)
    for hstart in tl.range(0, n_hist, RBLOCK):
        h_offs = hstart + tl.arange(0, RBLOCK)
        h = tl.load(ledger_ptr + h_offs, mask=h_offs < n_hist, other=0.0)
        h = tl.where(h_offs == ledger_idx, amax, h)
        window = tl.maximum(window, h)
    chosen = tl.max(window, axis=0) if ALGO_MAX else amax
    step_new = _step_of(chosen, TARGET)
    step_ptr_ledger = ledger_ptr + n_hist + LEDGER_STEP
    nonfinite_ptr = ledger_ptr + n_hist + LEDGER_NONFINITE
    saturated_ptr = ledger_ptr + n_hist + LEDGER_SATURATED
    old_hist = tl.load(ledger_ptr + ledger_idx)
    old_step = tl.load(step_ptr_ledger)
    n_bad = tl.load(nonfinite_ptr)
    n_sat_old = tl.load(saturated_ptr)
    tl.store(ledger_ptr + ledger_idx, tl.where(finite, amax, old_hist))
    tl.store(step_ptr_ledger, tl.where(finite, step_new, old_step))
    tl.store(nonfinite_ptr, n_bad + tl.where(finite, 0.0, 1.0))
    tl.store(saturated_ptr, n_sat_old + sat_count.to(tl.float32))


@triton.jit
def _quantize_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    q_ptr,
    step_ptr,
    n_elements,
    scratch_ptr,
    amax_out_ptr,
    step_out_ptr,
    ledger_ptr,
    ledger_idx,
    n_hist,
    FMT: tl.constexpr,
    TARGET: tl.constexpr,
    X_BF16: tl.constexpr,
    CAST: tl.constexpr,
    REDUCE: tl.constexpr,
    ALGO_MAX: tl.constexpr,
    LEDGER_STEP: tl.constexpr,
    LEDGER_NONFINITE: tl.constexpr,
    LEDGER_SATURATED: tl.constexpr,
    BLOCK: tl.constexpr,
    RBLOCK: tl.constexpr,
):
    # The ledger (REDUCE == _REDUCE_LEDGER only): history ledger_ptr[:n_hist], then the step, the
    # non-finite count and the saturated count at n_hist + the LEDGER_* offsets.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if CAST:
        step = tl.load(step_ptr)
        bound = code_bound(step, FMT.FMAX, FMT.MANT)
        if REDUCE == _REDUCE_LEDGER:  # noqa: SIM102  (constexpr test, then a run-time one)
            if pid == 0:
                tl.store(step_out_ptr, step)
    # |x| as int32 bits: for non-negative floats the integer order is the float order and
    # every NaN sorts above inf, so an integer max is a NaN-propagating float max.
    amax_bits = tl.zeros((BLOCK,), dtype=tl.int32)
    n_sat = tl.zeros((BLOCK,), dtype=tl.int32)
    num_tiles = tl.cdiv(n_elements, BLOCK)
    for tile in tl.range(pid, num_tiles, nprog):
        offs = tl.cast(tile, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elements
        x = load_widened(x_ptr, offs, mask, X_BF16)
        if REDUCE != _REDUCE_NONE:
            amax_bits = tl.maximum(amax_bits, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        if CAST:
            # IEEE division, as the twin does: x / step, not x * (1 / step).
            s = tl.div_rn(x, step)
            if REDUCE == _REDUCE_LEDGER:
                n_sat += ((s > FMT.FMAX) | (s < -FMT.FMAX)).to(tl.int32)
            tl.store(q_ptr + offs, clamped_byte(s, bound, FMT), mask=mask)
    if REDUCE != _REDUCE_NONE:
        # Cross-program traffic is scalar atomics only, issued in program order by one
        # thread: fold this program's amax and saturation count into the scratch, then take
        # a ticket with acq_rel, which publishes both to whoever draws the last ticket.
        tl.atomic_max(scratch_ptr + _SCRATCH_AMAX, tl.max(amax_bits, axis=0), sem="relaxed")
        if REDUCE == _REDUCE_LEDGER:
            tl.atomic_add(scratch_ptr + _SCRATCH_SATURATED, tl.sum(n_sat, axis=0), sem="relaxed")
        ticket = tl.atomic_add(scratch_ptr + _SCRATCH_TICKET, 1, sem="acq_rel")
        if ticket == nprog - 1:
            # Read-and-zero every slot: the scratch is ready for the next launch.
            bits = tl.atomic_xchg(scratch_ptr + _SCRATCH_AMAX, 0, sem="acq_rel")
            sat_count = tl.atomic_xchg(scratch_ptr + _SCRATCH_SATURATED, 0, sem="acq_rel")
            tl.atomic_xchg(scratch_ptr + _SCRATCH_TICKET, 0, sem="acq_rel")
            # One NaN for every NaN input (the twin's): payloads carry no information.
            bits = tl.where(bits > 0x7F800000, 0x7FC00000, bits)
            amax = bits.to(tl.float32, bitcast=True)
            finite = bits < 0x7F800000
            if REDUCE == _REDUCE_AMAX:
                tl.store(amax_out_ptr, amax)
            if REDUCE == _REDUCE_DYNAMIC:
                tl.store(amax_out_ptr, amax)
                tl.store(step_out_ptr, _step_of(amax, TARGET))
            if REDUCE == _REDUCE_LEDGER:
                _advance_ledger(
                    ledger_ptr,
                    ledger_idx,
                    n_hist,
                    amax,
                    finite,
                    sat_count,
                    TARGET,
                    ALGO_MAX,
                    LEDGER_STEP,
                    LEDGER_NONFINITE,
                    LEDGER_SATURATED,
                    RBLOCK,
                )


# ---------------------------------------------------------------------------------------
# Launchers: check constraints, allocate, launch.

_SCRATCH: dict[tuple[torch.device, int], torch.Tensor] = {}


def _scratch(device: torch.device) -> torch.Tensor:
    # int32 [ticket, amax bits, saturated count] per (device, stream), zeroed once and
    # zeroed again by the last program of every launch: launches on one stream run in
    # order, so the cached scratch needs no memset launch of its own.
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    t = _SCRATCH.get(key)
    if t is None:
        t = torch.zeros(_SCRATCH_LEN, dtype=torch.int32, device=device)
        _SCRATCH[key] = t
    return t


def _num_programs(x: torch.Tensor) -> int:
    tiles = max(1, triton.cdiv(x.numel(), _BLOCK))
    if INTERPRETED or x.device.type != "cuda":
        return min(tiles, _INTERPRET_PROGRAMS)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return min(tiles, sms * _PROGRAMS_PER_SM)


def _check_input(x: torch.Tensor, fp8: torch.dtype) -> None:
    check_fp8(fp8)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"quantize reads bf16, fp16 or fp32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("quantize kernels read contiguous tensors; pass x.contiguous()")


def _check_f32(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.dtype != torch.float32 or t.device != x.device or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 tensor on {x.device}; got {t.dtype} on {t.device}"
        )


class _Ledger(NamedTuple):
    """A delayed-scaling ledger and the caller's layout of it (see ``quantize_delayed``)."""

    tensor: torch.Tensor
    slot: int
    history_len: int
    step_offset: int
    nonfinite_offset: int
    saturated_offset: int

    def check(self, x: torch.Tensor) -> None:
        _check_f32("ledger", self.tensor, x)
        n = self.history_len
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"history_len must be an int >= 1, got {n!r}")
        if not 0 <= self.slot < n:
            raise ValueError(f"slot {self.slot} is outside the history [0, {n})")
        offsets = (self.step_offset, self.nonfinite_offset, self.saturated_offset)
        tail = self.tensor.numel() - n
        if len(set(offsets)) != 3 or not all(0 <= o < tail for o in offsets):
            raise ValueError(
                f"step, non-finite and saturated offsets must be distinct slots after the "
                f"history, in [0, {tail}) for a ledger of {self.tensor.numel()} with "
                f"history_len={n}; got {offsets}"
            )

    def step(self) -> torch.Tensor:
        at = self.history_len + self.step_offset
        return self.tensor[at : at + 1]


def _target(fp8: torch.dtype, margin: int) -> float:
    # The amax a step maps to: fmax / 2**margin, exact, so the step is one rounded division.
    return fp8_constants(fp8).FMAX / 2.0**margin


def _launch(
    *,
    x: torch.Tensor,
    q: torch.Tensor,
    fp8: torch.dtype,
    margin: int,
    reduce: tl.constexpr,
    cast: bool,
    step: torch.Tensor,
    amax_out: torch.Tensor | None = None,
    step_out: torch.Tensor | None = None,
    ledger: _Ledger | None = None,
    algo_max: bool = False,
) -> None:
    # One launch of the kernel over x. Pointer arguments a mode never touches still need a
    # tensor: they get `step`, which every mode has.
    n = x.numel()
    nprog = _num_programs(x)
    if n == 0:  # nothing to read or write, but the reduction (amax 0) still runs
        x, q = x.new_empty(1), q.new_empty(1)
    _quantize_kernel[(nprog,)](
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        q.view(torch.uint8),
        step,
        n,
        _scratch(x.device),
        step if amax_out is None else amax_out,
        step if step_out is None else step_out,
        step if ledger is None else ledger.tensor,
        0 if ledger is None else ledger.slot,
        0 if ledger is None else ledger.history_len,
        X_BF16=x.dtype == torch.bfloat16,
        CAST=cast,
        REDUCE=reduce.value,
        ALGO_MAX=algo_max,
        LEDGER_STEP=0 if ledger is None else ledger.step_offset,
        LEDGER_NONFINITE=0 if ledger is None else ledger.nonfinite_offset,
        LEDGER_SATURATED=0 if ledger is None else ledger.saturated_offset,
        BLOCK=_BLOCK,
        RBLOCK=_RBLOCK,
        num_warps=_WARPS,
        FMT=fp8_constants(fp8),
        TARGET=_target(fp8, margin),
    )


def quantize_with_step(
    *, x: torch.Tensor, fp8: torch.dtype, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8(clamp(x / step)), amax(x))`` in one pass; ``step`` is float32 ``(1,)``.

    ``fp8`` is ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (as in every launcher here).
    """
    _check_input(x, fp8)
    _check_f32("step", step, x)
    q = torch.empty(x.shape, dtype=fp8, device=x.device)
    amax = torch.empty(1, dtype=torch.float32, device=x.device)
    _launch(x=x, q=q, fp8=fp8, margin=0, reduce=_REDUCE_AMAX, cast=True, step=step, amax_out=amax)
    return q, amax


def quantize_dynamic(
    *, x: torch.Tensor, fp8: torch.dtype, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, step, amax)``: an amax launch that publishes the step, then a cast launch."""
    _check_input(x, fp8)
    q = torch.empty(x.shape, dtype=fp8, device=x.device)
    amax = torch.empty(1, dtype=torch.float32, device=x.device)
    step = torch.empty(1, dtype=torch.float32, device=x.device)
    _launch(
        x=x, q=q, fp8=fp8, margin=margin, reduce=_REDUCE_DYNAMIC, cast=False,
        step=step, amax_out=amax, step_out=step,
    )  # fmt: skip
    _launch(x=x, q=q, fp8=fp8, margin=margin, reduce=_REDUCE_NONE, cast=True, step=step)
    return q, step, amax


def quantize_delayed(
    *,
    x: torch.Tensor,
    fp8: torch.dtype,
    ledger: torch.Tensor,
    history_len: int,
    slot: int,
    step_offset: int,
    nonfinite_offset: int,
    saturated_offset: int,
    algo: Literal["max", "most_recent"],
    margin: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, step_used)``: quantize with the ledger's step and advance the ledger in-kernel.

    ``ledger`` is a contiguous float32 vector laid out by the caller: the amax history is
    ``ledger[:history_len]`` and the step, the non-finite count and the saturated count sit
    at ``history_len`` plus ``step_offset``, ``nonfinite_offset`` and ``saturated_offset``.
    Afterwards history slot ``slot`` holds ``amax(x)`` and the step is the next one from
    the window (``algo``), unless the amax was not finite, which is counted instead.
    """
    _check_input(x, fp8)
    r = _Ledger(ledger, slot, history_len, step_offset, nonfinite_offset, saturated_offset)
    r.check(x)
    if algo not in ("max", "most_recent"):
        raise ValueError(f"unknown amax window algo {algo!r}; accepted: 'max', 'most_recent'")
    q = torch.empty(x.shape, dtype=fp8, device=x.device)
    step_used = torch.empty(1, dtype=torch.float32, device=x.device)
    _launch(
        x=x, q=q, fp8=fp8, margin=margin, reduce=_REDUCE_LEDGER, cast=True,
        step=r.step(), step_out=step_used, ledger=r, algo_max=algo == "max",
    )  # fmt: skip
    return q, step_used
