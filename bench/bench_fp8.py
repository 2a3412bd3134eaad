"""Benchmark computectx's fp8 kernels against torch on one CUDA GPU, side by side.

Measures, in one run on one device:

1. quantize throughput (bf16 -> fp8, amax in the same pass) against device-to-device copy
   bandwidth; target: >= 90% of copy bandwidth;
2. fp8 GEMM TFLOP/s against ``torch._scaled_mm`` and bf16 ``torch.mm`` at 8192^3 and two LLM
   shapes; target: >= 1.0x ``torch._scaled_mm`` at 8192^3;
3. ``QuantizedLinear`` forward+backward against bf16 ``nn.Linear`` (eager); target: >= 1.4x.

Every timed result is also checked (quantized bytes against the reference twin, GEMM and
linear outputs against torch) so a fast wrong kernel cannot pass. Prints the GPU, driver,
CUDA, torch and triton versions.

    python bench/bench_fp8.py             # full sizes (a few minutes, mostly autotuning)
    python bench/bench_fp8.py --quick     # smaller quantize tensor, fewer repetitions
    python bench/bench_fp8.py --cpu-smoke # no GPU: tiny shapes, reference + interpreter

Without a CUDA GPU the default mode prints that it needs one and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# (M, K, N): tokens x in_features x out_features, Y[M, N] = X[M, K] W[N, K]^T.
GEMM_SHAPES: tuple[tuple[int, int, int], ...] = (
    (8192, 8192, 8192),
    (4096, 8192, 16384),
    (16384, 4096, 14336),
)
LINEAR_SHAPE = (4096, 8192, 16384)
QUANTIZE_TARGET = 0.90
GEMM_TARGET = 1.0
LINEAR_TARGET = 1.4


@dataclass
class Row:
    """One line of the report: what was measured, how fast, against what."""

    name: str
    value: str
    ratio: float | None = None
    target: float | None = None
    check: str = ""

    def line(self) -> str:
        ratio = "" if self.ratio is None else f"{self.ratio:6.2f}x"
        target = ""
        if self.target is not None and self.ratio is not None:
            verdict = "meets" if self.ratio >= self.target else "MISSES"
            target = f"target >= {self.target:.2f}x: {verdict}"
        return f"  {self.name:<46} {self.value:>16} {ratio:>8}  {target:<24} {self.check}"


def versions() -> list[str]:
    """GPU, driver, CUDA, torch and triton versions, one per line."""
    import torch

    lines = [f"python   {platform.python_version()}", f"torch    {torch.__version__}"]
    try:
        import triton

        lines.append(f"triton   {triton.__version__}")
    except ImportError:
        lines.append("triton   not installed")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"gpu      {props.name} (compute capability {props.major}.{props.minor})")
        lines.append(f"cuda     {torch.version.cuda}")
        lines.append(f"driver   {_driver_version()}")
    return lines


def _driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (nvidia-smi not found)"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def time_ms(dev: str, fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median time of ``fn`` in milliseconds: CUDA events on a GPU, a wall clock on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        if dev == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _sync(dev: str) -> None:
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------
# Benchmarks (on "cuda"; --cpu-smoke runs the same code on "cpu" under the interpreter)


def bench_quantize(dev: str, numel: int, warmup: int, reps: int) -> list[Row]:
    """bf16 -> E4M3 quantize variants against a bf16 device-to-device copy."""
    import torch

    from computectx.dtypes import Fp8Format
    from computectx.formats import backend as fp8_backend
    from computectx.formats.numerics.ledger import ledger_new
    from computectx.formats.ops import tensorwise as tensor_ops

    tri = fp8_backend.Backend.TRITON
    fmt = Fp8Format.E4M3
    x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    step = torch.tensor([x.float().abs().max().item() / fmt.max], device=dev)
    ledger = ledger_new(16, dev)
    tensor_ops.seed_ledger(ledger, x, fmt, 0)

    t_copy = time_ms(dev, lambda: dst.copy_(x), warmup, reps)
    copy_bw = 2 * x.nbytes / t_copy / 1e6  # read + write, GB/s
    rows = [Row(f"copy bf16 ({numel / 2**20:.0f} Mi elements)", f"{copy_bw:8.0f} GB/s")]
    # Minimal traffic of a quantize: read 2 bytes, write 1 byte per element.
    moved = 3 * numel

    q_ref, _ = tensor_ops.quantize_with_step(x, fmt, step, backend=fp8_backend.Backend.REFERENCE)
    q_tri, _ = tensor_ops.quantize_with_step(x, fmt, step, backend=tri)
    same = torch.equal(q_ref.view(torch.uint8), q_tri.view(torch.uint8))
    check = "bytes == reference" if same else "BYTES DIFFER FROM REFERENCE"

    cases: list[tuple[str, Callable[[], object]]] = [
        (
            "quantize_with_step (triton)",
            lambda: tensor_ops.quantize_with_step(x, fmt, step, backend=tri),
        ),
        (
            "quantize_delayed (triton, ledger finalize)",
            lambda: tensor_ops.quantize_delayed(x, fmt, ledger, 0, "max", 0, backend=tri),
        ),
        (
            "quantize_dynamic (triton, 2 passes)",
            lambda: tensor_ops.quantize_dynamic(x, fmt, 0, backend=tri),
        ),
        (
            "quantize_with_step (torch reference)",
            lambda: tensor_ops.quantize_with_step(
                x, fmt, step, backend=fp8_backend.Backend.REFERENCE
            ),
        ),
    ]
    for name, fn in cases:
        t = time_ms(dev, fn, warmup, reps)
        bw = moved / t / 1e6
        target = QUANTIZE_TARGET if "triton" in name and "dynamic" not in name else None
        rows.append(Row(name, f"{bw:8.0f} GB/s", bw / copy_bw, target, check))
    return rows


def bench_gemm(
    dev: str, shapes: tuple[tuple[int, int, int], ...], warmup: int, reps: int
) -> list[Row]:
    """fp8 GEMM (bf16 out) against torch._scaled_mm and bf16 torch.mm, at every shape."""
    import torch

    rows: list[Row] = []
    for m, k, n in shapes:
        rows += _gemm_rows(dev, m, k, n, warmup, reps)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def _gemm_rows(dev: str, m: int, k: int, n: int, warmup: int, reps: int) -> list[Row]:
    import torch

    from computectx.dtypes import Fp8Format
    from computectx.formats import backend as fp8_backend
    from computectx.formats.ops import tensorwise as tensor_ops

    tri = fp8_backend.Backend.TRITON
    fmt = Fp8Format.E4M3
    flops = 2.0 * m * n * k
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    a, sa, _ = tensor_ops.quantize_dynamic(x, fmt, 0, backend=tri)
    b, sb, _ = tensor_ops.quantize_dynamic(w, fmt, 0, backend=tri)
    # The layouts the backward pass hands in: dgrad dY @ W (b is a .t() view) and wgrad
    # dY^T @ X (both operands are .t() views).
    b_cm = b.t().contiguous().t()
    a_cm = a.t().contiguous().t()

    def ours() -> torch.Tensor:
        return tensor_ops.scaled_mm(a, b, sa, sb, None, torch.bfloat16, backend=tri)

    def theirs(fast: bool = False) -> torch.Tensor:
        out: torch.Tensor = torch._scaled_mm(
            a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast
        )
        return out

    def dgrad_layout() -> torch.Tensor:
        return tensor_ops.scaled_mm(a, b_cm, sa, sb, None, torch.bfloat16, backend=tri)

    def wgrad_layout() -> torch.Tensor:
        return tensor_ops.scaled_mm(a_cm, b_cm, sa, sb, None, torch.float32, backend=tri)

    t0 = time.perf_counter()
    y = ours()  # the first call autotunes
    _sync(dev)
    tune_s = time.perf_counter() - t0
    y_ref = theirs()
    rel = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
    check = f"rel diff vs _scaled_mm {rel:.1e}" + ("" if rel < 1e-2 else " TOO LARGE")

    t_ours = time_ms(dev, ours, warmup, reps)
    t_sm = time_ms(dev, theirs, warmup, reps)
    t_fast = time_ms(dev, lambda: theirs(True), warmup, reps)
    t_bf16 = time_ms(dev, lambda: torch.mm(x, w.t()), warmup, reps)
    t_dgrad = time_ms(dev, dgrad_layout, warmup, reps)
    t_wgrad = time_ms(dev, wgrad_layout, warmup, reps)

    def tflops(t: float) -> str:
        return f"{flops / t / 1e9:7.0f} TFLOP/s"

    target = GEMM_TARGET if (m, k, n) == (8192, 8192, 8192) else None
    return [
        Row(f"M={m} K={k} N={n} triton fp8 (tuned {tune_s:.0f} s)", tflops(t_ours)),
        Row("  vs torch._scaled_mm", tflops(t_sm), t_sm / t_ours, target, check),
        Row("  vs torch._scaled_mm(use_fast_accum=True)", tflops(t_fast), t_fast / t_ours),
        Row("  vs bf16 torch.mm", tflops(t_bf16), t_bf16 / t_ours),
        Row("  triton, b column-major (dgrad layout)", tflops(t_dgrad), t_sm / t_dgrad),
        Row("  triton, a and b column-major (wgrad, f32 out)", tflops(t_wgrad), t_sm / t_wgrad),
    ]


def bench_linear(
    dev: str, shape: tuple[int, int, int], warmup: int, reps: int, force: str | None = None
) -> list[Row]:
    """QuantizedLinear (HYBRID, delayed scaling) forward+backward against bf16 nn.Linear."""
    import torch
    from torch import nn

    from computectx.ctx import ComputeCtx

    try:
        from computectx.formats import QuantizedLinear
    except ImportError as e:
        return [Row("QuantizedLinear", "unavailable", check=f"import failed: {e}")]

    m, k, n = shape
    ctx = ComputeCtx.from_flag("fp8_hybrid", dev)
    ref = nn.Linear(k, n, bias=True, device=dev, dtype=torch.bfloat16)
    fp8 = QuantizedLinear(k, n, bias=True, ctx=ctx, backend=force, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        fp8.weight.copy_(ref.weight)
        assert fp8.bias is not None and ref.bias is not None
        fp8.bias.copy_(ref.bias)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def step(layer: nn.Module) -> Callable[[], None]:
        def run() -> None:
            x.grad = None
            for p in layer.parameters():
                p.grad = None
            layer(x).backward(dy)

        return run

    with torch.no_grad():
        y8 = fp8(x).float()
        y16 = ref(x).float()
    sqnr = 10 * math.log10((y16.pow(2).mean() / (y8 - y16).pow(2).mean()).item())
    check = f"output SQNR vs bf16 {sqnr:.1f} dB" + ("" if sqnr > 20 else " TOO LOW")
    t8 = time_ms(dev, step(fp8), warmup, reps)
    t16 = time_ms(dev, step(ref), warmup, reps)
    flops = 6.0 * m * n * k
    label = f"M={m} K={k} N={n}"
    return [
        Row(f"{label} bf16 nn.Linear fwd+bwd", f"{flops / t16 / 1e9:7.0f} TFLOP/s"),
        Row(
            f"{label} QuantizedLinear fwd+bwd (hybrid)",
            f"{flops / t8 / 1e9:7.0f} TFLOP/s",
            t16 / t8,
            LINEAR_TARGET,
            check,
        ),
    ]


def run_gpu(quick: bool) -> int:
    import torch

    from computectx.formats import backend as fp8_backend

    backend, why = fp8_backend.select_backend("cuda")
    print(f"fp8 backend on cuda: {why}")
    if backend is not fp8_backend.Backend.TRITON:
        print("The Triton fp8 kernels cannot run on this GPU; nothing to benchmark.")
        return 0
    warmup, reps = (3, 10) if quick else (10, 50)
    numel = 2**26 if quick else 2**28
    torch.manual_seed(0)
    sections: list[tuple[str, Callable[[], list[Row]]]] = [
        (
            "quantize bf16 -> e4m3 (bandwidth over 3 bytes/element; ratio vs copy)",
            lambda: bench_quantize("cuda", numel, warmup, reps),
        ),
        (
            "scaled GEMM, bf16 out (ratio = their time / our time)",
            lambda: bench_gemm("cuda", GEMM_SHAPES, warmup, reps),
        ),
        (
            "QuantizedLinear forward+backward, eager (ratio = bf16 time / fp8 time)",
            lambda: bench_linear("cuda", LINEAR_SHAPE, warmup, reps),
        ),
    ]
    failed = False
    for title, fn in sections:
        print(f"\n{title}")
        for row in fn():
            print(row.line())
            failed |= "DIFFER" in row.check or "TOO" in row.check
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------
# CPU smoke run


def run_cpu_smoke() -> int:
    """Tiny shapes through the reference backend and the Triton interpreter; checks only."""
    # Kernels decide compiled-or-interpreted when their module is imported.
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from computectx.dtypes import Fp8Format
    from computectx.formats import backend as fp8_backend
    from computectx.formats.numerics import ledger, tensorwise
    from computectx.formats.ops import tensorwise as tensor_ops

    tri, ref = fp8_backend.Backend.TRITON, fp8_backend.Backend.REFERENCE
    print(f"fp8 backend on cpu: {fp8_backend.select_backend('cpu')[1]}")
    print(f"forced: {fp8_backend.select_backend('cpu', force='triton')[1]}")
    gen = torch.Generator().manual_seed(0)
    ok = True

    x = (torch.randn(4099, generator=gen) * 7).to(torch.bfloat16)
    for fmt in Fp8Format:
        step = torch.tensor([0.013])
        t0 = time.perf_counter()
        q_t, a_t = tensor_ops.quantize_with_step(x, fmt, step, backend=tri)
        dt = time.perf_counter() - t0
        q_r, a_r = tensor_ops.quantize_with_step(x, fmt, step, backend=ref)
        same = torch.equal(q_t.view(torch.uint8), q_r.view(torch.uint8)) and torch.equal(a_t, a_r)
        ok &= same
        print(f"  quantize {fmt} n={x.numel()}: interpreter {dt * 1e3:.0f} ms, bit-exact: {same}")
        ledger_t, ledger_r = ledger.ledger_new(4, "cpu"), ledger.ledger_new(4, "cpu")
        for i in range(3):
            xi = x * (i + 1)
            tensor_ops.quantize_delayed(xi, fmt, ledger_t, i, "max", 1, backend=tri)
            tensor_ops.quantize_delayed(xi, fmt, ledger_r, i, "max", 1, backend=ref)
        same = torch.equal(ledger_t, ledger_r)
        ok &= same
        print(f"  delayed ledger {fmt}, 3 steps: ledger bit-exact: {same}")

    for m, k, n in ((37, 45, 29), (64, 100, 48)):
        a, sa, _ = tensor_ops.quantize_dynamic(
            torch.randn(m, k, generator=gen), Fp8Format.E4M3, 0, backend=ref
        )
        b, sb, _ = tensor_ops.quantize_dynamic(
            torch.randn(n, k, generator=gen), Fp8Format.E5M2, 0, backend=ref
        )
        t0 = time.perf_counter()
        out = tensor_ops.scaled_mm(
            a, b.t().contiguous().t(), sa, sb, None, torch.bfloat16, backend=tri
        )
        dt = time.perf_counter() - t0
        exact = (a.double() @ b.double().t()) * (sa.double() * sb.double())
        bound = tensorwise.scaled_mm_error_bound(
            tensorwise.GemmArgs(a, b, sa, sb, None, torch.bfloat16)
        )
        within = bool(((out.double() - exact).abs() <= bound).all())
        ok &= within
        print(
            f"  scaled_mm M={m} K={k} N={n}: interpreter {dt * 1e3:.0f} ms, within bound: {within}"
        )

    try:
        from computectx.ctx import ComputeCtx
        from computectx.formats import QuantizedLinear
    except ImportError as e:
        print(f"  QuantizedLinear: not available ({e})")
    else:
        ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
        xin = torch.randn(6, 48, generator=gen).to(torch.bfloat16)
        for backend in (ref, tri):
            layer = QuantizedLinear(
                48, 80, ctx=ctx, backend=backend, device="cpu", dtype=torch.bfloat16
            )
            xg = xin.clone().requires_grad_()
            y = layer(xg)
            y.float().sum().backward()
            y16 = torch.nn.functional.linear(xin, layer.weight, layer.bias).float()
            err = (y.detach().float() - y16).pow(2).mean()
            sqnr = 10 * math.log10((y16.pow(2).mean() / err).item()) if err > 0 else math.inf
            good = xg.grad is not None and bool(torch.isfinite(xg.grad.float()).all())
            good &= sqnr > 20
            ok &= good
            print(
                f"  QuantizedLinear fwd+bwd ({backend}): output SQNR vs bf16 {sqnr:.1f} dB: {good}"
            )
    # The benchmark functions themselves, at tiny sizes (their timings mean nothing here).
    print("benchmark code paths at tiny sizes (CPU timings, not performance):")
    rows = bench_quantize("cpu", 4099, 0, 1)
    rows += bench_gemm("cpu", ((37, 45, 29),), 0, 1)
    rows += bench_linear("cpu", (16, 64, 48), 0, 1, force="triton")
    for row in rows:
        print(row.line())
        ok &= not ("DIFFER" in row.check or "TOO" in row.check or "failed" in row.check)
    print("cpu smoke:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="no GPU needed: run tiny shapes through the reference and the Triton interpreter",
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        return run_cpu_smoke()
    import torch

    print("\n".join(versions()))
    if not torch.cuda.is_available():
        print(
            "\nbench_fp8 needs a CUDA GPU (compute capability >= 8.9 for the fp8 kernels); "
            "none is available here, so nothing was measured. Run with --cpu-smoke to check "
            "the code paths on the CPU."
        )
        return 0
    return run_gpu(args.quick)


if __name__ == "__main__":
    sys.exit(main())
