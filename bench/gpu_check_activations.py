"""gpu_check's activations section (issue 36): what each ``ctx.activations`` setting keeps for
the backward, the step's peak memory and its time, on one model, side by side.

``section_activations(device, smoke, reps)`` returns one row per (flag, setting) over the same
``ByteLM`` (``GPU_CONFIG``: 8 blocks of d_model 2048 on 8 x 2048 tokens; ``SMOKE_CONFIG`` on
the CPU), each row:

- ``saved_mib``: every storage autograd keeps during one forward and backward, parameters
  excluded, counted by ``computectx.memory.SavedActivations`` (the demo's ``saved MiB``);
- ``peak_mib``: ``torch.cuda.max_memory_allocated`` over one training step (forward, backward,
  SGD step) less what was allocated before it: the step's activations and temporaries (on
  the CPU: ``None``);
- ``step_ms``: the median of ``reps`` steps after a warm-up, synchronised;
- the ratios of both to the ``keep`` row of the same flag.

Settings: ``keep`` (what the ops save), ``fp8`` (every kind as fp8 groups), the norms and
softmax recomputed with fp8 activation-function inputs, ``offload/linear:keep`` (every kind
but the linears' inputs, which do not take it yet, copied to pinned host memory and brought
back a block ahead of its backward: on a GPU only),
``checkpoint=all`` (whole blocks recomputed) and ``checkpoint=every:2``. Eager, so that the
saved-tensor hooks count what each setting keeps (a compiled graph's saves are its own).
Nothing here is a target or a threshold: the reader compares the ratios with the issue's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from computectx import ComputeCtx
from computectx.activations import parse_activations
from computectx.memory import SavedActivations
from computectx.nn import ByteLM, LMConfig

GPU_CONFIG = LMConfig(d_model=2048, n_heads=16, n_layers=8, d_ff=5632, max_len=2048)
GPU_BATCH = (8, 2048)
SMOKE_CONFIG = LMConfig(d_model=32, n_heads=1, n_layers=2, d_ff=64, max_len=16)
SMOKE_BATCH = (2, 16)
FLAGS = ("bf16", "fp8_hybrid")
SETTINGS = (
    "keep",
    "fp8",
    "precise:recompute/act_fn:fp8/attention:recompute",
    "offload/linear:keep",
    "checkpoint=all",
    "checkpoint=every:2",
)
_MIB = 2.0**20


def _step(model: ByteLM, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    torch.autograd.backward(loss)
    opt.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _row(flag: str, setting: str, device: torch.device, smoke: bool, reps: int) -> dict[str, Any]:
    ctx = ComputeCtx.from_flag(flag, device).replace(activations=parse_activations(setting))
    config, (batch, seq) = (SMOKE_CONFIG, SMOKE_BATCH) if smoke else (GPU_CONFIG, GPU_BATCH)
    torch.manual_seed(0)
    model = ByteLM(ctx, config)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (batch, seq + 1), device=device)
    _step(model, opt, ids)  # warm-up: the optimizer's state, the allocator's pools
    params = list(model.parameters())
    with SavedActivations(exclude=params) as saved:
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        torch.autograd.backward(loss)
    peak: float | None = None
    if device.type == "cuda":
        opt.zero_grad(set_to_none=True)
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(model, opt, ids)
        _sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - before) / _MIB
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        _step(model, opt, ids)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {
        "flag": flag,
        "setting": setting,
        "saved_mib": saved.bytes() / _MIB,
        "peak_mib": peak,
        "step_ms": statistics.median(times) * 1e3,
    }


def section_activations(device: torch.device, smoke: bool, reps: int) -> list[dict[str, Any]]:
    """One row per flag and setting (module docstring); ``offload`` only on a GPU."""
    rows = []
    # The smoke run keeps the code working in the suite: one flag, three settings.
    for flag in FLAGS[:1] if smoke else FLAGS:
        keep: dict[str, Any] | None = None
        for setting in SETTINGS[::2] if smoke else SETTINGS:
            if setting.startswith("offload") and device.type != "cuda":
                continue  # a no-op on the CPU: nothing to measure
            row = _row(flag, setting, device, smoke, reps)
            keep = keep or row
            row["saved_x_keep"] = row["saved_mib"] / keep["saved_mib"]
            row["peak_x_keep"] = (
                None if row["peak_mib"] is None else row["peak_mib"] / keep["peak_mib"]
            )
            row["time_x_keep"] = row["step_ms"] / keep["step_ms"]
            rows.append(row)
    return rows
