"""The GPU run-book of issue 9: one command, one JSON file and one markdown table.

    python bench/gpu_check.py --out gpu-check          # on one H100/H200 (budget: 8 min)
    python bench/gpu_check.py --cpu-smoke --out DIR    # tiny sizes on the CPU (the suite runs it)

Sections, in order (each timed; a section that fails records its error and the run goes on):

1. ``cuda_tests``: the CUDA-only tests (tests/kernels, the Triton backend test), by pytest;
2. ``gemm``: TFLOP/s of the Triton fp8 GEMM, ``torch._scaled_mm`` (cuBLAS) and bf16 ``mm`` at
   8192³, 4096×4096×14336, 8192×8192×28672 and decode M = 1, 16;
3. ``quantize``: delayed-scaling quantize GB/s against a plain device copy of the same tensor;
4. ``linear``: ``QuantizedLinear`` fwd+bwd against bf16 ``nn.Linear``, eager and compiled, at
   M×K×N = 4096×8192×16384 (delayed and dynamic scaling);
5. ``bytelm``: ``ByteLM`` train-step time compiled, bf16 against fp8_hybrid;
6. ``granularity_gemm`` (issue 16): TFLOP/s of bf16 ``mm``, ``torch._scaled_mm`` per-tensor
   and row-wise, and ``block_scaled_mm`` (Triton) for 1x128 x 128x128 and MX (and its cuBLAS
   recipes where ``computectx.formats.ops.blockwise.cublas_recipes`` finds them), at
   M×K×N = 4096×8192×16384 and 8192³, each with its ratio to bf16 and to row-wise
   ``_scaled_mm``, next to the anchors: TransformerEngine's H200 GEMM speedups over bf16
   (delayed 1.69x, current 1.57x, block 1.41x). The table is printed as well.
7. ``kv_decode`` (issue 17): decode attention over an fp8 KV cache against bf16
   (``gpu_check_kv``);
8. ``moe_gemm`` (issue 23): fp8 grouped GEMMs per recipe against bf16 ``F.grouped_mm`` at
   torchao's Llama 4 17B-16E and DeepSeek-V3 shapes, fwd and fwd+bwd TFLOP/s, with torchao's
   B200 MXFP8 speedups beside the ``mx`` rows (``gpu_check_moe``);
9. ``optim_state`` (issue 24): the compact AdamW step (``CompactOptimizer`` per
   ``optim_state``, f32 and bf16 masters) against fused f32 AdamW: step time, bytes moved per
   parameter and GB/s (``gpu_check_optim``);
10. ``offload_overlap`` (issue 35): a train step with and without the offloaded optimizer,
   serial and overlapped (``gpu_check_optim``);
11. ``activations`` (issue 36): saved bytes, the step's peak memory and its time per
   ``ctx.activations`` setting on a ByteLM, bf16 and fp8_hybrid (``gpu_check_activations``);
12. ``fp4_gemm`` (issue 37): the 4-bit backend this GPU gets and why (an H100/H200 has no FP4
   tensor cores: the emulated twin), its GEMM time beside bf16 and fp8 (``gpu_check_fp4``).

Figures are whatever this machine measures; the JSON records the device, torch, triton and
CUDA versions next to them. Nothing here is a target or a pass/fail threshold: the issue's
targets are compared by a reader of the table. ``--cpu-smoke`` runs every section at tiny
sizes on the CPU (reference and cublas backends, ``aot_eager`` compiles) to keep the script
working; its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpu_check_activations
import gpu_check_fp4
import gpu_check_kv
import gpu_check_moe
import gpu_check_optim
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats import Backend, QuantizedLinear, quantize_tensor
from computectx.formats.numerics.layouts import BlockGranularity
from computectx.formats.numerics.ledger import ledger_new, tally_new
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.formats.ops.blockwise import block_scaled_mm, cublas_recipes
from computectx.nn import ByteLM, LMConfig
from computectx.recipes import DelayedScaling, DynamicScaling, Recipe

ROOT = Path(__file__).resolve().parent.parent
GPU_GEMM_SHAPES = [(8192, 8192, 8192), (4096, 4096, 14336), (8192, 8192, 28672)]
GPU_DECODE = [(1, 8192, 8192), (16, 8192, 8192)]
SMOKE_GEMM_SHAPES = [(64, 64, 64), (32, 64, 96)]
SMOKE_DECODE = [(1, 64, 64)]
GPU_GRANULARITY_SHAPES = [(4096, 8192, 16384), (8192, 8192, 8192)]
SMOKE_GRANULARITY_SHAPES = [(32, 256, 48)]
ANCHORS = {
    "_scaled_mm per-tensor": "TE H200 over bf16: delayed 1.69x, current 1.57x",
    "1x128 x 128x128": "TE H200 over bf16: block 1.41x",
}
"""TransformerEngine's H200 GEMM speedups over bf16 (the issue's anchors), by row."""


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def run(fn: Callable[[], object], reps: int) -> float:
        fn()  # warm-up (and compile)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    return run


def section_cuda_tests(smoke: bool) -> dict[str, Any]:
    if smoke or not torch.cuda.is_available():
        return {"skipped": "no CUDA device" if not torch.cuda.is_available() else "--cpu-smoke"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "tests/kernels",
        "tests/formats",  # its compile tests included (tests/formats/test_compile.py)
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    return {
        "command": " ".join(cmd[1:]),
        "returncode": proc.returncode,
        "summary": proc.stdout.strip().splitlines()[-1:] if proc.stdout else [],
        "seconds": time.perf_counter() - t0,
    }


def section_gemm(device: torch.device, smoke: bool, reps: int) -> list[dict[str, Any]]:
    timed = _timer(device)
    shapes = (SMOKE_GEMM_SHAPES + SMOKE_DECODE) if smoke else (GPU_GEMM_SHAPES + GPU_DECODE)
    backends = [Backend.CUBLAS, Backend.REFERENCE] if smoke else [Backend.TRITON, Backend.CUBLAS]
    rows = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        s = torch.ones(1, device=device)
        flops = 2.0 * m * n * k
        for backend in backends:
            t = timed(
                functools.partial(
                    tensor_ops.scaled_mm, a, b, s, s, None, torch.bfloat16, backend=backend
                ),
                reps,
            )
            rows.append(
                {"op": f"fp8 {backend}", "m": m, "k": k, "n": n, "tflops": flops / t / 1e12}
            )
        ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
        t = timed(functools.partial(torch.matmul, ab, bb.t()), reps)
        rows.append({"op": "bf16 mm", "m": m, "k": k, "n": n, "tflops": flops / t / 1e12})
    return rows


def section_quantize(
    device: torch.device, smoke: bool, reps: int, backend: Backend
) -> list[dict[str, Any]]:
    timed = _timer(device)
    numel = 1 << (14 if smoke else 28)
    x = torch.randn(numel, device=device, dtype=torch.bfloat16)
    ledger = ledger_new(16, device)
    tally = tally_new(device)
    fmt_scaling = DelayedScaling()
    from computectx.dtypes import Fp8Format

    def quant() -> object:
        return tensor_ops.quantize_operand(
            x, Fp8Format.E4M3, ledger, tally, fmt_scaling, backend=backend, may_seed=False
        )

    moved = numel * (2 + 1)  # read bf16, write fp8
    t_q = timed(quant, reps)
    t_c = timed(lambda: x.clone(), reps)
    return [
        {"op": f"quantize delayed ({backend})", "elements": numel, "gbps": moved / t_q / 1e9},
        {"op": "device copy (bf16 clone)", "elements": numel, "gbps": numel * 4 / t_c / 1e9},
    ]


def _fwd_bwd(layer: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    def step() -> object:
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        y.backward(torch.ones_like(y))
        return y

    return step


def section_linear(
    device: torch.device, smoke: bool, reps: int, backend: Backend, compile_backend: str
) -> list[dict[str, Any]]:
    timed = _timer(device)
    m, k, n = (32, 64, 96) if smoke else (4096, 8192, 16384)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    base = ComputeCtx.from_flag("fp8_hybrid", device)
    plain = nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    for compiled in (False, True):
        runner: nn.Module = plain
        if compiled:
            torch._dynamo.reset()
            runner = torch.compile(plain, backend=compile_backend)  # type: ignore[assignment]
        t = timed(_fwd_bwd(runner, x), reps)
        rows.append({"op": "bf16 nn.Linear", "compiled": compiled, "ms": t * 1e3})
        for name, scaling in (("delayed", DelayedScaling()), ("dynamic", DynamicScaling())):
            ctx = base.replace(recipe=Recipe(scaling=scaling))
            layer = QuantizedLinear(k, n, ctx=ctx, backend=backend, device=device)
            r: nn.Module = layer
            if compiled:
                torch._dynamo.reset()
                r = torch.compile(layer, backend=compile_backend)  # type: ignore[assignment]
            t = timed(_fwd_bwd(r, x), reps)
            rows.append(
                {"op": f"QuantizedLinear {name} ({backend})", "compiled": compiled, "ms": t * 1e3}
            )
    return rows


def section_bytelm(
    device: torch.device, smoke: bool, reps: int, compile_backend: str
) -> list[dict[str, Any]]:
    timed = _timer(device)
    cfg = (
        LMConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, max_len=16)
        if smoke
        else LMConfig(d_model=2048, n_heads=16, n_layers=8, d_ff=8192, max_len=2048)
    )
    batch, seq = (2, 16) if smoke else (8, 2048)
    rows = []
    for flag in ("bf16", "fp8_hybrid"):
        ctx = ComputeCtx.from_flag(flag, device)
        torch.manual_seed(0)
        model = ByteLM(ctx, cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch._dynamo.reset()
        loss_fn = torch.compile(model.loss, backend=compile_backend)
        ids = torch.randint(0, 256, (batch, seq), device=device)

        def step(
            loss_fn: Callable[..., torch.Tensor] = loss_fn,
            opt: torch.optim.Optimizer = opt,
            ids: torch.Tensor = ids,
        ) -> object:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ids, ids)
            torch.autograd.backward(loss)
            opt.step()
            return loss

        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        t = timed(step, reps)
        rows.append(
            {
                "flag": flag,
                "first_step_s": first,
                "step_ms": t * 1e3,
                "tokens_per_s": batch * seq / t,
            }
        )
    return rows


def _block_operands(
    x: torch.Tensor, w: torch.Tensor, ga: BlockGranularity, gb: BlockGranularity
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    qa, sa = quantize_tensor(x, "e4m3", granularity=ga)
    qb, sb = quantize_tensor(w, "e4m3", granularity=gb)
    return qa, sa, qb, sb


def section_granularity_gemm(device: torch.device, smoke: bool, reps: int) -> list[dict[str, Any]]:
    """The GEMM of each fine granularity against bf16 and row-wise ``_scaled_mm``."""
    timed = _timer(device)
    shapes = SMOKE_GRANULARITY_SHAPES if smoke else GPU_GRANULARITY_SHAPES
    # On the CPU smoke run the reference backend stands in for the Triton one.
    kernel = Backend.REFERENCE if smoke else Backend.TRITON
    recipes = cublas_recipes(device)
    pairs: dict[str, tuple[BlockGranularity, BlockGranularity, str]] = {
        "1x128 x 128x128": ("1x128", "128x128", "1x128x128x128"),
        "mx x mx": ("mx", "mx", "mx"),
    }
    rows: list[dict[str, Any]] = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        timings: dict[str, float] = {}
        timings["bf16 mm"] = timed(functools.partial(torch.matmul, x, w.t()), reps)
        qa, sa = quantize_tensor(x, "e4m3")
        qb, sb = quantize_tensor(w, "e4m3")
        timings["_scaled_mm per-tensor"] = timed(
            functools.partial(
                torch._scaled_mm,
                qa,
                qb.t(),
                sa.reshape(()),
                sb.reshape(()),
                out_dtype=torch.bfloat16,
            ),
            reps,
        )
        ra, rsa, rb, rsb = _block_operands(x, w, "row", "row")
        timings["_scaled_mm rowwise"] = timed(
            functools.partial(
                torch._scaled_mm, ra, rb.t(), rsa, rsb.reshape(1, n), out_dtype=torch.bfloat16
            ),
            reps,
        )
        for label, (ga, gb, recipe) in pairs.items():
            ba, bsa, bb, bsb = _block_operands(x, w, ga, gb)
            call = functools.partial(block_scaled_mm, ba, bb, bsa, ga, bsb, gb, None)
            timings[f"block_scaled_mm {kernel} {label}"] = timed(
                functools.partial(call, torch.bfloat16, backend=kernel), reps
            )
            if recipes[recipe][0]:
                timings[f"block_scaled_mm cublas {label}"] = timed(
                    functools.partial(call, torch.bfloat16, backend=Backend.CUBLAS), reps
                )
        for op, t in timings.items():
            anchor = next((text for key, text in ANCHORS.items() if key in op), "")
            rows.append(
                {
                    "op": op,
                    "m": m,
                    "k": k,
                    "n": n,
                    "tflops": flops / t / 1e12,
                    "vs_bf16": timings["bf16 mm"] / t,
                    "vs_rowwise": timings["_scaled_mm rowwise"] / t,
                    "anchor": anchor,
                }
            )
    return rows


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# gpu_check on {result['device_name']}", "", f"versions: {result['versions']}", ""]
    for name, rows in result["sections"].items():
        lines.append(f"## {name}")
        lines.append("")
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            keys = list(rows[0])
            lines.append("| " + " | ".join(keys) + " |")
            lines.append("|" + " --- |" * len(keys))
            for row in rows:
                cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
                lines.append("| " + " | ".join(cells) + " |")
        else:
            lines.append(f"`{json.dumps(rows)}`")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args(argv)
    smoke: bool = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu-smoke, or on a GPU")
    device = torch.device("cpu" if smoke else "cuda")
    reps = args.reps or (2 if smoke else 20)
    backend = Backend.REFERENCE if smoke else Backend.TRITON
    compile_backend = "aot_eager" if smoke else "inductor"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result: dict[str, Any] = {
        "smoke": smoke,
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "triton": triton_version,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "sections": {},
        "seconds": {},
    }
    sections: dict[str, Callable[[], Any]] = {
        "cuda_tests": lambda: section_cuda_tests(smoke),
        "gemm": lambda: section_gemm(device, smoke, reps),
        "quantize": lambda: section_quantize(device, smoke, reps, backend),
        "linear": lambda: section_linear(device, smoke, reps, backend, compile_backend),
        "bytelm": lambda: section_bytelm(device, smoke, reps, compile_backend),
        "granularity_gemm": lambda: section_granularity_gemm(device, smoke, reps),
        "kv_decode": lambda: gpu_check_kv.section_kv_decode(device, smoke, reps),
        # Each fwd+bwd at M = 128,000 is tens of ms: 10 reps keep the section near a minute.
        "moe_gemm": lambda: gpu_check_moe.section_moe_gemm(device, smoke, min(reps, 10)),
        "optim_state": lambda: gpu_check_optim.section_optim_state(device, smoke, reps),
        "offload_overlap": lambda: gpu_check_optim.section_offload_overlap(device, smoke, reps),
        "activations": lambda: gpu_check_activations.section_activations(device, smoke, reps),
        "fp4_gemm": lambda: gpu_check_fp4.section_fp4(device, smoke, reps),
    }
    for name, run in sections.items():
        t0 = time.perf_counter()
        try:
            result["sections"][name] = run()
        except Exception as exc:  # one failing section must not lose the others' figures
            result["sections"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"][name] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    markdown = _markdown(result)
    (args.out / "gpu_check.md").write_text(markdown)
    print(markdown[markdown.find("## granularity_gemm") :])
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
