"""gpu_check's MoE section: fp8 grouped GEMMs against bf16 ``F.grouped_mm`` (issue 23 item 8).

``section_moe_gemm(device, smoke, reps)`` times one expert projection of a mixture-of-experts
layer at the shapes of torchao's MoE training README (``torchao/prototype/moe_training``), forward
and forward + backward (dX and dW), for:

- ``bf16 F.grouped_mm``: torch's grouped GEMM, the baseline (``vs_bf16`` is its time over the
  row's, fwd+bwd: above 1 is faster than bf16);
- ``fp8 <granularity> (<backend>)``: ``computectx.formats.quantized_grouped_mm`` under each grouped
  recipe (tensor, row, row+gw_hp, block, mx; ``RECIPES``) on the Triton grouped kernel, and on
  ``cublas`` for the row-wise recipes (``F.scaled_grouped_mm``; the other recipes run the
  Triton kernel there too, so they are not timed twice).

Shapes (``GPU_SHAPES``): ``M = 128,000`` rows (tokens x top-k, after the dispatch) split over
``G`` groups (experts on this rank: torchao's G from 1 to 8 stands for the degree of expert
parallelism), ``N x K``: Llama 4 17B-16E ``8192 x 5120`` and DeepSeek-V3 ``2048 x 7168``.
Group sizes are a seeded random split with no alignment (the kernels pad nothing the caller
sees). TFLOP/s counts ``2 M N K`` for the forward and three times that for the forward and
backward.

**Anchor** (``ANCHORS``): torchao's B200 MXFP8 speedups over bf16 ``torch._grouped_mm``, fwd+bwd,
from the README's microbenchmark tables (torchao 0.14.0+gitc7b8e13da, torch 2.10.0a0,
``benchmark_scaled_grouped_mm_dq.py --compile``), printed beside the ``mx`` rows of the same
shape and G; the README's headline: 1.4-1.8x for Llama 4 shapes, 1.15-1.3x (later 1.19-1.6x)
for DeepSeek-V3. A B200 (sm_100) has MX tensor cores; an H100/H200 (sm_90) does not, so there
the ``mx`` rows say what the emulation costs, not what a B200 gains.

Importing this module needs no CUDA. On the CPU, without ``smoke``, the section is skipped;
with ``smoke`` it runs tiny shapes on the reference backend to keep the code working (its
figures say nothing about a GPU).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from computectx import ComputeCtx
from computectx.formats import Backend, quantized_grouped_mm

__all__ = [
    "ANCHORS",
    "GPU_SHAPES",
    "RECIPES",
    "SMOKE_SHAPES",
    "group_offs",
    "section_moe_gemm",
]

RECIPES: tuple[tuple[str, str], ...] = (
    ("tensor", "fp8_hybrid_dynamic"),
    ("row", "fp8_rowwise"),
    ("row+gw_hp", "fp8_rowwise_gw_hp"),
    ("block", "fp8_block"),
    ("mx", "fp8_mx"),
)
"""Each grouped recipe's granularity and the ``--dtype`` flag whose ``ctx.recipe`` it runs."""

CUBLAS_RECIPES = ("row", "row+gw_hp")
"""The recipes ``F.scaled_grouped_mm`` runs on the ``cublas`` backend (row-wise scales)."""

GPU_SHAPES: tuple[tuple[str, int, int, int, int], ...] = (
    ("Llama 4 17B-16E", 128000, 8192, 5120, 1),
    ("Llama 4 17B-16E", 128000, 8192, 5120, 8),
    ("DeepSeek-V3", 128000, 2048, 7168, 1),
    ("DeepSeek-V3", 128000, 2048, 7168, 8),
)
"""``(model, M, N, K, G)`` timed on a GPU: torchao's README shapes at G = 1 and 8."""

SMOKE_SHAPES: tuple[tuple[str, int, int, int, int], ...] = (("DeepSeek-V3", 70, 32, 96, 4),)
"""A tiny shape for the CPU smoke run (ragged groups; the anchor of its name and G)."""

ANCHORS: dict[tuple[str, int], float] = {
    ("Llama 4 17B-16E", 1): 1.808,
    ("Llama 4 17B-16E", 2): 1.690,
    ("Llama 4 17B-16E", 4): 1.637,
    ("Llama 4 17B-16E", 8): 1.700,
    ("DeepSeek-V3", 1): 1.188,
    ("DeepSeek-V3", 2): 1.321,
    ("DeepSeek-V3", 4): 1.595,
    ("DeepSeek-V3", 8): 1.440,
}
"""torchao's B200 MXFP8 fwd+bwd speedup over bf16 ``torch._grouped_mm`` at M = 128,000, by
(model, G): the README's microbenchmark tables."""


def anchor(model: str, groups: int, granularity: str) -> str:
    """The torchao figure printed beside a row (the ``mx`` rows only)."""
    figure = ANCHORS.get((model, groups))
    if granularity != "mx" or figure is None:
        return ""
    return f"torchao B200 MXFP8 fwd+bwd over bf16: {figure:.3f}x (G={groups})"


def group_offs(m: int, groups: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """int32 end rows of ``groups`` seeded random groups that cover all ``m`` rows (each
    about ``m / groups``, no alignment)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 0.5 + torch.rand(groups, generator=gen)
    sizes = (weights / weights.sum() * m).floor().to(torch.int64)
    sizes[-1] += m - int(sizes.sum())
    return sizes.cumsum(0).to(torch.int32).to(device)


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def run(fn: Callable[[], object], reps: int) -> float:
        fn()  # warm-up (and the kernels' compile)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    return run


Grouped = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _variants(device: torch.device) -> list[tuple[str, str, Grouped]]:
    """``(label, granularity, grouped)`` of every row, the baseline first."""

    def bf16(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)

    rows: list[tuple[str, str, Grouped]] = [("bf16 F.grouped_mm", "-", bf16)]
    backends = [Backend.REFERENCE] if device.type != "cuda" else [Backend.TRITON, Backend.CUBLAS]
    for granularity, flag in RECIPES:
        policy = ComputeCtx.from_flag(flag, device).fp8
        assert policy is not None
        for backend in backends:
            if backend is Backend.CUBLAS and granularity not in CUBLAS_RECIPES:
                continue

            def fp8(
                x: torch.Tensor,
                w: torch.Tensor,
                offs: torch.Tensor,
                policy: Any = policy,
                backend: Backend = backend,
            ) -> torch.Tensor:
                return quantized_grouped_mm(x, w, offs, policy, backend=backend)

            rows.append((f"fp8 {granularity} ({backend})", granularity, fp8))
    return rows


def _forward(fn: Grouped, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> object:
    with torch.no_grad():
        return fn(x, w, offs)


def _forward_backward(
    fn: Grouped, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dy: torch.Tensor
) -> object:
    x.grad = w.grad = None
    y = fn(x, w, offs)
    torch.autograd.backward(y, dy)
    return y


def _shape_rows(
    device: torch.device, reps: int, shape: tuple[str, int, int, int, int]
) -> list[dict[str, Any]]:
    model, m, n, k, groups = shape
    gen = torch.Generator(device=device).manual_seed(m + n + k + groups)
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(groups, n, k, device=device, generator=gen, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=device, generator=gen, dtype=torch.bfloat16)
    x.requires_grad_(True)
    w.requires_grad_(True)
    offs = group_offs(m, groups, device)
    flops = 2.0 * m * n * k
    timed = _timer(device)
    rows: list[dict[str, Any]] = []
    base: float | None = None
    for label, granularity, fn in _variants(device):
        t_fwd = timed(functools.partial(_forward, fn, x, w, offs), reps)
        t_all = timed(functools.partial(_forward_backward, fn, x, w, offs, dy), reps)
        base = t_all if base is None else base
        rows.append(
            {
                "op": label,
                "model": model,
                "m": m,
                "n": n,
                "k": k,
                "groups": groups,
                "fwd_ms": t_fwd * 1e3,
                "fwd_bwd_ms": t_all * 1e3,
                "fwd_tflops": flops / t_fwd / 1e12,
                "fwd_bwd_tflops": 3 * flops / t_all / 1e12,
                "vs_bf16": base / t_all,
                "anchor": anchor(model, groups, granularity),
            }
        )
    return rows


def section_moe_gemm(
    device: torch.device, smoke: bool, reps: int
) -> list[dict[str, Any]] | dict[str, str]:
    """Grouped GEMM time and TFLOP/s per recipe against bf16 (the module docstring says
    what each row is); ``{"skipped": why}`` on a CPU without ``smoke``."""
    if device.type != "cuda" and not smoke:
        return {"skipped": f"no CUDA device ({device}): run on a GPU, or with --cpu-smoke"}
    rows: list[dict[str, Any]] = []
    for shape in SMOKE_SHAPES if smoke else GPU_SHAPES:
        rows += _shape_rows(device, reps, shape)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next shape's operands, not this one's, fill it
    return rows
