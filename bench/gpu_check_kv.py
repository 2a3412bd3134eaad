"""gpu_check's decode-attention section: an fp8 KV cache against a bf16 one (issue 17 item 4).

``section_kv_decode(device, smoke, reps)`` returns one row per (context length, variant):

- ``fp8 e4m3 per_token_head``: ``decode_attention`` on the Triton kernel over E4M3 codes
  with a float32 step per (token, head);
- ``bf16 (same kernel)``: the same kernel over a bf16 cache (no steps): what the fp8 cache
  saves, kernel for kernel;
- ``bf16 SDPA``: ``torch.nn.functional.scaled_dot_product_attention`` over the bf16 cache,
  one query per (batch, head): torch's own decode path, the baseline.

At ``B = 8`` sequences, ``H = 32`` heads, ``D = 128``, contexts of 4,096 and 32,768
positions, every row full (``length = T``: SDPA has no ragged length). Each row gives the
time per call and the effective bandwidth: the bytes a decode step must read and write
(``decode_bytes``: K and V, the steps, the query and the output) over that time. The KV
bytes dominate: an fp8 cache reads half a bf16 cache's codes plus 4 bytes per (token, head)
of each of K and V (``2 * 4 / (2 * D)`` more, 3% at D = 128).

``decode_attention`` is called with ``check_values=False``, as a serving loop does once a
cache has validated its steps (the value checks would add a host read per call).

Importing this module needs no CUDA. On the CPU, without ``smoke``, the section is
skipped; with ``smoke`` it runs at tiny sizes on the reference backend to keep the code
working (its figures say nothing about a GPU).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from computectx import Fp8Format
from computectx.formats import Backend
from computectx.formats.numerics.kv_quant import quantize_kv
from computectx.formats.ops.attention import decode_attention

__all__ = ["GPU_SHAPE", "SMOKE_SHAPE", "decode_bytes", "section_kv_decode"]

GPU_SHAPE: dict[str, Any] = {"batch": 8, "heads": 32, "head_dim": 128, "contexts": (4096, 32768)}
"""The measured shape on a GPU."""
SMOKE_SHAPE: dict[str, Any] = {"batch": 2, "heads": 2, "head_dim": 16, "contexts": (64, 160)}
"""The CPU smoke shape."""


def decode_bytes(
    batch: int, heads: int, t: int, head_dim: int, cache: torch.dtype, per_token_steps: bool
) -> int:
    """Bytes one decode-attention call reads and writes over ``t`` cached positions: K and
    V (``2 B H T D`` elements of ``cache``), their float32 steps (``2 B H T`` of them when
    per (token, head)), the query and the output (``B H D`` each, bf16) and the lengths."""
    kv = 2 * batch * heads * t * head_dim * torch.empty((), dtype=cache).element_size()
    steps = 2 * batch * heads * t * 4 if per_token_steps else 0
    q_out = 2 * batch * heads * head_dim * 2
    return kv + steps + q_out + batch * 8


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def run(fn: Callable[[], object], reps: int) -> float:
        fn()  # warm-up (and the kernel's compile)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    return run


def section_kv_decode(
    device: torch.device, smoke: bool, reps: int
) -> list[dict[str, Any]] | dict[str, str]:
    """Decode attention time and effective GB/s, fp8 KV against bf16 KV (the module
    docstring says what each row is); ``{"skipped": why}`` on a CPU without ``smoke``."""
    if device.type != "cuda" and not smoke:
        return {"skipped": f"no CUDA device ({device}): run on a GPU, or with --cpu-smoke"}
    shape = SMOKE_SHAPE if smoke else GPU_SHAPE
    rows: list[dict[str, Any]] = []
    for t in shape["contexts"]:
        rows += _context_rows(device, reps, shape, int(t))
    return rows


def _context_rows(
    device: torch.device, reps: int, shape: dict[str, Any], t: int
) -> list[dict[str, Any]]:
    b, h, d = int(shape["batch"]), int(shape["heads"]), int(shape["head_dim"])
    backend = Backend.REFERENCE if device.type != "cuda" else Backend.TRITON
    gen = torch.Generator(device=device).manual_seed(t)
    q = torch.randn(b, h, d, device=device, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(b, h, t, d, device=device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(b, h, t, d, device=device, generator=gen, dtype=torch.bfloat16)
    kc, ks = quantize_kv(k, Fp8Format.E4M3)  # per_token_head: what KVCache stores
    vc, vs = quantize_kv(v, Fp8Format.E4M3)
    length = torch.full((b,), t, dtype=torch.int64, device=device)
    attend = functools.partial(
        decode_attention, sm_scale=d**-0.5, backend=backend, check_values=False
    )
    variants = (
        ("fp8 e4m3 per_token_head", functools.partial(attend, q, kc, vc, ks, vs, length)),
        ("bf16 (same kernel)", functools.partial(attend, q, k, v, None, None, length)),
        (
            "bf16 SDPA",
            functools.partial(F.scaled_dot_product_attention, q.unsqueeze(2), k, v, scale=d**-0.5),
        ),
    )
    timed = _timer(device)
    rows = []
    for name, call in variants:
        seconds = timed(call, reps)
        fp8 = name.startswith("fp8")
        moved = decode_bytes(b, h, t, d, torch.float8_e4m3fn if fp8 else torch.bfloat16, fp8)
        rows.append(
            {
                "op": name,
                "backend": "torch" if name.endswith("SDPA") else str(backend),
                "batch": b,
                "heads": h,
                "head_dim": d,
                "context": t,
                "us": seconds * 1e6,
                "gbps": moved / seconds / 1e9,
                "mib_moved": moved / 2**20,
            }
        )
    return rows
