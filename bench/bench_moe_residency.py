"""Expert residency of a memory-mapped MoE checkpoint while decoding with 2 of 16 experts.

Run: ``.venv/bin/python bench/bench_moe_residency.py`` (Linux; one to two minutes on a CPU, most
of it the ``fp8-block`` row, whose GEMMs run the float32 twin).

**Model.** A ``ByteLM`` with MoE blocks (``--layers`` blocks, ``d_model`` 256, 16 experts of
hidden width 1024, top-2): one float32 expert is ``3 * 1024 * 256 * 4`` bytes = 3 MiB, 48 MiB
of experts per block. Every block's router carries a selection bias that sends every token to
experts 3 and 11 (the routing weights are unchanged), and the model is saved with
``save_weights``.

**Each setting.** The checkpoint (one per parameter dtype) is dropped from the page cache
(``posix_fadvise(DONTNEED)``, as a checkpoint that was not just written would be), loaded
with ``Residency.MMAP`` into a fresh model built under the setting's policy, and
``generate`` decodes ``--tokens`` bytes after a 4-byte prompt. Then, for the experts of every block:

- *resident*: the bytes mapped into this process (``/proc/self/pagemap``, what
  ``/proc/self/smaps`` counts as ``Rss``), in units of the 2 chosen experts' bytes: the
  issue's bound is 1.25;
- *page cache*: the bytes of the expert tensors in the page cache (``mincore``), including
  what the kernel read ahead around each page fault (``/sys/block/*/queue/read_ahead_kb``)
  and around the loader's header read;
- the decode time (indicative: the first touch of each expert reads it from the disk).

Settings: ``f32`` (the parity policy), ``f32+prefetch`` (the same, with a forward pre-hook on
each experts module that calls ``prefetch_experts`` with the group sizes: one
``madvise(WILLNEED)`` per chosen expert slice before the GEMM touches it), ``bf16`` (the
serving policy: bf16 compute from float32 parameters), ``bf16-params`` (serving with bf16
parameters, ``master=BF16``, saved at bf16) and ``fp8-block`` (serving with
``Recipe(granularity="block")``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import torch

from computectx import ComputeCtx, DType, Residency
from computectx.memory import load_weights, save_weights
from computectx.memory.expert_residency import (
    cached_bytes,
    expert_residency,
    experts_of,
    prefetch_experts,
)
from computectx.nn import ByteLM, LMConfig
from computectx.nn.experts import GroupedExperts
from computectx.nn.generate import generate
from computectx.nn.moe import MoE
from computectx.nn.params import param_dtype
from computectx.recipes import Recipe

CHOSEN = (3, 11)
SETTINGS = ("f32", "f32+prefetch", "bf16", "bf16-params", "fp8-block")


def ctx_of(setting: str) -> ComputeCtx:
    if setting.startswith("f32"):
        return ComputeCtx.parity("cpu")
    serving = ComputeCtx.serving("cpu")
    if setting == "bf16-params":
        return serving.replace(master=DType.BF16)
    if setting == "fp8-block":
        return serving.replace(recipe=Recipe(granularity="block"))
    return serving


def build(ctx: ComputeCtx, layers: int, seed: int) -> ByteLM:
    config = LMConfig(
        d_model=256, n_layers=layers, n_heads=4, max_len=64, n_experts=16, top_k=2,
        moe_hidden=1024, moe_balance="none",
    )  # fmt: skip
    torch.manual_seed(seed)
    return ByteLM(ctx, config).eval()


def route_to_chosen(model: ByteLM) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE):
                m.router.bias.fill_(-1e4)
                m.router.bias[list(CHOSEN)] = 1e4


def drop_from_page_cache(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def add_prefetch(model: ByteLM) -> None:
    """A pre-hook on every experts module: advise the chosen experts before the GEMMs."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        assert isinstance(module, GroupedExperts)
        offs = args[1]
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        prefetch_experts((module.gate_up, module.down), counts)

    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.register_forward_pre_hook(hook)


def run(setting: str, folder: pathlib.Path, layers: int, tokens: int) -> dict[str, float]:
    ctx = ctx_of(setting)
    path = folder / f"params-{param_dtype(ctx)}.safetensors".replace("torch.", "")
    if not path.exists():
        src = build(ctx, layers, 0)
        route_to_chosen(src)
        save_weights(src, path)
        del src
    drop_from_page_cache(path)
    mapped = ctx.replace(residency=Residency.MMAP)
    model = build(mapped, layers, 1)
    report = load_weights(model, path, mapped)
    assert report.chosen is Residency.MMAP
    if setting.endswith("+prefetch"):
        add_prefetch(model)
    prompt = torch.tensor([72, 101, 108, 108])
    t0 = time.perf_counter()
    with torch.no_grad():
        generate(model, prompt, tokens)
    seconds = time.perf_counter() - t0
    loads = [m.last_load for m in model.modules() if isinstance(m, MoE)]
    assert all(load.nonzero().flatten().tolist() == list(CHOSEN) for load in loads), loads
    residency = expert_residency(model)
    per = residency[0].expert_bytes
    chosen = len(CHOSEN) * per
    resident = max(r.resident_total for r in residency) / chosen
    cached = max(
        sum(cached_bytes(w) for w in weights.values()) for weights in experts_of(model).values()
    )
    return {
        "expert_mib": per / 2**20,
        "resident": resident,
        "cached": cached / chosen,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("expert residency is read from /proc/self/pagemap and mincore: Linux only")
        return 0
    ra = pathlib.Path("/sys/block")
    ahead = sorted({p.read_text().strip() for p in ra.glob("*/queue/read_ahead_kb")})
    print(f"{args.layers} MoE blocks, 16 experts each, routing to experts {CHOSEN}; decoding "
          f"{args.tokens} bytes; read_ahead_kb {'/'.join(ahead) or '?'}")  # fmt: skip
    print(
        f"{'setting':14s} {'expert MiB':>10s} {'resident':>9s} {'page cache':>11s} "
        f"{'decode s':>9s}   (resident, page cache: x the 2 chosen experts' bytes, worst block)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings:
            r = run(setting, pathlib.Path(tmp), args.layers, args.tokens)
            verdict = "ok" if r["resident"] <= 1.25 else "OVER 1.25"
            print(
                f"{setting:14s} {r['expert_mib']:10.2f} {r['resident']:9.2f} {r['cached']:11.2f} "
                f"{r['seconds']:9.2f}   {verdict}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
