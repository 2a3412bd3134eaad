"""gpu_check's optimizer-state section: the compact AdamW step against fused f32 AdamW (issue 24).

``section_optim_state(device, smoke, reps)`` returns one row per optimizer over the same
parameters (``GPU_SHAPES``: 16 tensors of 2048x2048, 67.1M float32 parameters, random
gradients):

- ``torch AdamW fused`` and ``torch AdamW foreach``: float32 state, torch's own kernels (the
  baseline every ratio is over is ``fused``);
- ``CompactOptimizer STATE``: ``computectx.memory.CompactOptimizer`` over AdamW with
  ``ctx.optim_state = STATE`` (``f32`` is torch's own step, so it is left out), the fused
  update compiled (``compile=None``: compiled on CUDA);
- ``CompactOptimizer bf16 master + SR, STATE``: the same on bf16 parameters (their own
  master, written back with stochastic rounding).

Each row gives the time per step (median of ``reps`` after two warm-up steps, which
compile) and the bytes a step must move per parameter (``bytes_per_param``): read the
gradient, read and write the weight, read and write both moments at their stored size
(``packed_nbytes``: codes and scales), and the effective bandwidth those bytes give. An
f32 AdamW step moves 4 + 8 + 16 = 28 bytes per parameter; bf16 weights and 8-bit moments
2 + 4 + 4.06 = 10.06 (the gradient at the weight's dtype).

``section_offload_overlap(device, smoke, reps)`` (issue 35, item 4) times one training step
(forward, backward, optimizer step, each synchronised) of one model three ways: ``no offload``
(torch's fused AdamW on the device), ``offload, serial`` (``OffloadedOptimizer`` with f32
masters and state on the host, ``overlap=False``) and ``offload, overlapped``
(``overlap=True``: gradients copied down during the backward, each master stepped as its
copy lands). The model is ``OVERLAP_LAYERS`` float32 ``Linear(OVERLAP_D, OVERLAP_D)`` layers
run under bf16 autocast on ``OVERLAP_TOKENS`` tokens, sized so that the host step of its 134M
parameters can fit under the backward on a lent H100/H200 host; each row gives the step's
median and its ratio to ``no offload`` (target for the overlapped row: <= 1.20).

Importing this module needs no CUDA. On the CPU, without ``smoke``, the section is skipped;
with ``smoke`` it runs at tiny sizes eagerly (``compile=False``) to keep the code working
(its figures say nothing about a GPU).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from computectx import ComputeCtx, DType
from computectx.demo.footprint import adamw_moment_bytes
from computectx.memory import CompactOptimizer, OffloadedOptimizer
from computectx.optim_state import OptimState

__all__ = [
    "GPU_SHAPES",
    "SMOKE_SHAPES",
    "bytes_per_param",
    "section_offload_overlap",
    "section_optim_state",
]

GPU_SHAPES: list[tuple[int, int]] = [(2048, 2048)] * 16
"""The measured parameters on a GPU (67.1M elements)."""
SMOKE_SHAPES: list[tuple[int, int]] = [(64, 128)] * 2
"""The CPU smoke parameters."""
FORMATS = ("bf16", "int8", "fp8", "int4")


def bytes_per_param(shapes: list[tuple[int, int]], state: str, weight: torch.dtype) -> float:
    """Bytes one AdamW step reads and writes per parameter: the gradient (read), the weight
    (read and write) at ``weight``'s size, both moments (read and write) at ``state``'s
    stored size (tensors under ``min_size`` elements float32)."""
    st = OptimState.parse(state)
    w = torch.empty((), dtype=weight).element_size()
    n = sum(math.prod(s) for s in shapes)
    moments = sum(adamw_moment_bytes(shape, st) for shape in shapes)
    return 3 * w + 2 * moments / n


def _params(
    shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype
) -> list[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=g, device=device) * 0.02).to(dtype))
        p.grad = (torch.randn(shape, generator=g, device=device) * 1e-3).to(dtype)
        out.append(p)
    return out


def _median_step(opt: torch.optim.Optimizer, device: torch.device, reps: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):  # warm-up: state made, graphs compiled
        opt.step()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


Make = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _rows(device: torch.device, compile: bool | None) -> list[tuple[str, str, DType, Make]]:
    """``(label, state, weight dtype, make)`` per row."""
    rows: list[tuple[str, str, DType, Make]] = [
        ("torch AdamW fused", "f32", DType.F32, lambda p: torch.optim.AdamW(p, fused=True)),
        ("torch AdamW foreach", "f32", DType.F32, lambda p: torch.optim.AdamW(p, foreach=True)),
    ]
    for master in (DType.F32, DType.BF16):
        ctx = ComputeCtx.new(DType.BF16, device).replace(master=master)
        for fmt in FORMATS if master == DType.F32 else ("f32", "int8", "int4"):
            octx = ctx.with_optim_state(fmt)

            def make(p: list[torch.nn.Parameter], octx: ComputeCtx = octx) -> Any:
                return CompactOptimizer(p, octx, lr=1e-3, compile=compile)

            who = "" if master == DType.F32 else "bf16 master + SR, "
            rows.append((f"CompactOptimizer {who}{fmt}", fmt, master, make))
    return rows


def section_optim_state(device: torch.device, smoke: bool, reps: int) -> list[dict[str, Any]]:
    """One row per optimizer: step ms, bytes per parameter, GB/s, and the ratio to fused."""
    if device.type != "cuda" and not smoke:
        return [{"skipped": "no CUDA device"}]
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    n = sum(math.prod(s) for s in shapes)
    out: list[dict[str, Any]] = []
    base: float | None = None
    for label, state, weight, make in _rows(device, False if smoke else None):
        params = _params(shapes, device, weight.torch)
        t = _median_step(make(params), device, reps)
        base = t if base is None else base
        moved = bytes_per_param(shapes, state, weight.torch)
        out.append(
            {
                "op": label,
                "parameters": n,
                "step_ms": t * 1e3,
                "bytes_per_param": moved,
                "gbps": moved * n / t / 1e9,
                "vs_fused": t / base,
            }
        )
        del params
    return out


OVERLAP_LAYERS, OVERLAP_D, OVERLAP_TOKENS = 8, 4096, 32768
"""The overlap section's model on a GPU: 8 x Linear(4096, 4096), 134M f32 parameters."""
SMOKE_OVERLAP = (2, 64, 32)
"""Its CPU smoke sizes."""


def _overlap_rows(device: torch.device) -> list[tuple[str, Make]]:
    """``(label, make)`` per row of the overlap section."""
    ctx = ComputeCtx.new(DType.F32, device).replace(offload=torch.device("cpu"))

    def offloaded(overlap: bool) -> Make:
        return lambda p: OffloadedOptimizer(p, ctx, lr=1e-4, overlap=overlap)

    return [
        (
            "no offload (torch AdamW fused on the device)",
            lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
        ),
        ("offload, serial", offloaded(False)),
        ("offload, overlapped", offloaded(True)),
    ]


def _train_step_ms(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    device: torch.device,
    reps: int,
) -> float:
    """Median ms of forward + backward + step + zero_grad, synchronised, after two warm-up
    steps (state made; the overlapped hooks learn one firing per step)."""

    def one() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        one()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        one()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def section_offload_overlap(device: torch.device, smoke: bool, reps: int) -> list[dict[str, Any]]:
    """One row per way of stepping: train step ms and its ratio to ``no offload``."""
    if device.type != "cuda" and not smoke:
        return [{"skipped": "no CUDA device"}]
    layers, d, tokens = SMOKE_OVERLAP if smoke else (OVERLAP_LAYERS, OVERLAP_D, OVERLAP_TOKENS)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d, generator=gen, device=device)
    out: list[dict[str, Any]] = []
    base: float | None = None
    for label, make in _overlap_rows(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(layers)]).to(
            device
        )
        params = list(model.parameters())
        ms = _train_step_ms(model, make(params), x, device, reps)
        base = ms if base is None else base
        out.append(
            {
                "op": label,
                "parameters": sum(p.numel() for p in params),
                "tokens": tokens,
                "step_ms": ms,
                "vs_no_offload": ms / base,
            }
        )
        del model, params
    return out
