"""gpu_check's 4-bit section (issue 37): which 4-bit backend this GPU gets and why, and the
4-bit GEMMs' time beside bf16 ``mm`` and fp8 row-wise ``torch._scaled_mm`` on the same shape.

``section_fp4(device, smoke, reps)`` returns one row per op at ``GPU_SHAPE`` (M x K x N; a
tiny shape with ``smoke``): ``bf16 mm``, ``fp8 _scaled_mm rowwise`` (CUDA only), the NVFP4
(16x16 weights, 1x16 activations) and MXFP4 GEMMs of quantized operands through
``computectx::fp4_scaled_mm``, and the grouped GEMMs through ``computectx::fp4_grouped_mm``
(``GROUPS`` equal groups of the M rows, N x K experts, each group's rows and expert quantized
inside the call, as a 4-bit experts forward does), each with its TFLOP/s and the ``backend``
that ran it with its reason (``computectx.formats.ops.fp4.select_fp4_backend``): ``triton`` on
a GPU with FP4 tensor cores (a B200: ``tl.dot_scaled`` on ``tcgen05.mma``), ``emulated``
elsewhere (an H100/H200 has no FP4 tensor cores: the pure-torch twin in float32, whose TFLOP/s
measure the twin, not FP4 tensor cores, and the row says so). On a GPU with FP4 tensor cores the
dense GEMM is also timed on each of its backends, forced: ``{fmt} fp4_scaled_mm [triton]``, and
``[cublas]`` where torch's FP4 ``scaled_mm`` runs the format's recipe there
(``fp4_cublas_recipes``; the row's reason is the probe's)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.ops.fp4_backend import fp4_cublas_recipes

GPU_SHAPE = (4096, 4096, 4096)
GROUPS = 8
SMOKE_SHAPE = (32, 64, 48)


def _median_s(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _forced_dense(a: Fp4Operand, b: Fp4Operand, backend: str) -> Callable[[], torch.Tensor]:
    # The dense GEMM's operator on one backend, as the entry point calls it.
    args: list[object] = []
    for q in (a, b):
        if isinstance(q, Nvfp4Operand):
            args += [q.codes, q.scale, q.amax.reshape(1), q.tile]
        else:
            args += [q.codes, q.scale, None, "1x32"]
    return functools.partial(fp4_ops.fp4_scaled_mm, *args, None, torch.bfloat16, backend)


def _dense_backends(device: torch.device, fmt: str, selected: str) -> list[tuple[str, str]]:
    # (backend, reason) the dense GEMM is also timed on: none where the twins run.
    if selected == fp4_ops.EMULATED:
        return []
    runs, why = fp4_cublas_recipes(device)[fmt]
    forced = [(fp4_ops.TRITON, "forced: the Triton kernel (tl.dot_scaled)")]
    return forced + ([(fp4_ops.CUBLAS, f"forced: {why}")] if runs else [])


def section_fp4(device: torch.device, smoke: bool, reps: int) -> list[dict[str, Any]]:
    """One row per op (module docstring)."""
    m, k, n = SMOKE_SHAPE if smoke else GPU_SHAPE
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen)
    w = torch.randn(n, k, device=device, generator=gen)
    flops = 2.0 * m * k * n
    backend, reason = fp4_ops.select_fp4_backend(device)
    rows: list[dict[str, Any]] = []

    def add(op: str, fn: Callable[[], object], ran_on: str, why: str) -> None:
        seconds = _median_s(fn, device, reps)
        rows.append(
            {
                "op": op,
                "shape": f"{m}x{k}x{n}",
                "ms": seconds * 1e3,
                "tflops": flops / seconds / 1e12,
                "backend": ran_on,
                "reason": why,
            }
        )

    xb, wb = x.bfloat16(), w.bfloat16()
    add("bf16 mm", lambda: xb @ wb.t(), "torch", "")
    if device.type == "cuda":
        e4m3 = torch.float8_e4m3fn
        sx = x.abs().amax(1, keepdim=True).float() / 448
        sw = w.abs().amax(1, keepdim=True).float() / 448
        x8, w8 = (x / sx).to(e4m3), (w / sw).to(e4m3)
        add(
            "fp8 _scaled_mm rowwise",
            lambda: torch._scaled_mm(x8, w8.t(), sx, sw.t(), out_dtype=torch.bfloat16),
            "cublas",
            "",
        )
    for fmt in ("nvfp4", "mxfp4"):
        how = Fp4Quant(format=fmt)
        a = fp4_ops.quantize(x, how)
        b = fp4_ops.quantize(w, how, weight=True)
        add(
            f"{fmt} fp4_scaled_mm",
            functools.partial(fp4_ops.scaled_mm, a, b, torch.bfloat16),
            backend,
            reason,
        )
        for forced, why in _dense_backends(device, fmt, backend):
            add(f"{fmt} fp4_scaled_mm [{forced}]", _forced_dense(a, b, forced), forced, why)
        experts = wb.unsqueeze(0).expand(GROUPS, n, k).contiguous()
        ends = [(g + 1) * m // GROUPS for g in range(GROUPS)]
        offs = torch.tensor(ends, dtype=torch.int32, device=device)
        add(
            f"{fmt} fp4_grouped_mm ({GROUPS} groups)",
            functools.partial(fp4_ops.grouped_mm, xb, experts, offs, how),
            backend,
            reason,
        )
    return rows
