"""The ``computectx`` command: ``info`` (this machine and the presets) and ``demo``.

Parsing and checking flags imports no torch (about 3 s on a small machine): ``--help``,
``--version`` and a rejected flag answer at once. ``info`` and a demo run load it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from computectx.demo import args as demo_args

if TYPE_CHECKING:
    import torch

__all__ = ["build_parser", "info_lines", "main"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info_lines() -> list[str]:
    """What ``computectx info`` prints, one line per entry."""
    import torch

    from computectx import capability
    from computectx.ctx import DTYPE_FLAGS, ComputeCtx
    from computectx.dtypes import DType
    from computectx.formats import Backend, select_backend
    from computectx.formats.seam import check_backend

    dev = capability.default_device()
    lines = ["versions:"]
    lines.append(f"  python      {platform.python_version()}")
    for dist in ("computectx", "torch", "triton", "pydantic"):
        lines.append(f"  {dist:<11} {_version(dist)}")
    lines.append(f"device: {dev}")
    if dev.type == "cuda":
        lines.append(f"  {torch.cuda.get_device_name(dev)}")
    lines.append("capabilities:")
    probes = {
        "cuda": capability.cuda(),
        "fp8 tensor cores": capability.fp8_tensor_cores(),
        "triton": capability.triton_available(),
        "triton interpreter": capability.triton_interpreter(),
        "cpu bf16 GEMM": capability.native_half_gemm(torch.bfloat16),
        "cpu f16 GEMM": capability.native_half_gemm(torch.float16),
    }
    for name, probe in probes.items():
        lines.append(f"  {name:<19} {'yes' if probe.ok else 'no ':<4} {probe.reason}")
    lines.append(f"fp8 backend: {select_backend(dev)[1]}")
    # Every backend, and whether it could be forced here (QuantizedLinear(backend=...)).
    probe_tensor = torch.empty(0, device=dev)
    for backend in Backend:
        try:
            check_backend(backend, probe_tensor)
        except ValueError as e:
            lines.append(f"  {backend.value:<19} no   {e}")
        else:
            lines.append(f"  {backend.value:<19} yes")
    lines.extend(_block_gemm_lines(dev))
    lines.extend(_fp4_gemm_lines(dev))
    lines.append("presets:")
    presets = {
        "new(bf16)": ComputeCtx.new(DType.BF16, dev),
        "parity": ComputeCtx.parity(dev),
        "serving": ComputeCtx.serving(dev),
    }
    for flag in DTYPE_FLAGS:
        presets[f"--dtype {flag}"] = ComputeCtx.from_flag(flag, dev)
    for name, ctx in presets.items():
        lines.append(f"  {name:<19} {ctx}")
    return lines


def _block_gemm_lines(dev: torch.device) -> list[str]:
    # Which cuBLAS recipes of the fine-grained GEMM (block_scaled_mm, backend cublas) run
    # here, probed by running each; a pair whose recipe does not run takes the fallback.
    import torch

    from computectx.formats import Backend
    from computectx.formats.seam import cublas_recipes, uses_kernels

    fallback = (
        "the Triton kernel"
        if uses_kernels(Backend.CUBLAS, torch.empty(0, device=dev))
        else "the twin (reference)"
    )
    labels = {
        "row": "row x row",
        "1x128x128x128": "1x128 x 128x128",
        "1x128x1x128": "1x128 x 1x128",
        "mx": "mx x mx",
    }
    lines = [f"fine-grained fp8 GEMM recipes on cublas (else {fallback}):"]
    for name, (runs, why) in cublas_recipes(dev).items():
        lines.append(f"  {labels[name]:<19} {'yes' if runs else 'no ':<4} {why}")
    return lines


def _fp4_gemm_lines(dev: torch.device) -> list[str]:
    # The 4-bit backend, and which 4-bit cuBLAS recipes (backend cublas) run here, probed by
    # running each; a recipe that does not run takes the Triton kernel.
    from computectx.formats.seam import fp4_cublas_recipes, select_fp4_backend

    lines = [f"4-bit backend: {select_fp4_backend(dev)[1]}"]
    lines.append("4-bit GEMM recipes on cublas (else the Triton kernel):")
    for name, (runs, why) in fp4_cublas_recipes(dev).items():
        lines.append(f"  {name:<19} {'yes' if runs else 'no ':<4} {why}")
    return lines


def _cmd_info(_args: argparse.Namespace) -> int:
    print("\n".join(info_lines()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every subcommand (building it imports no torch)."""
    parser = argparse.ArgumentParser(
        prog="computectx", description="Typed compute policy for PyTorch models."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('computectx')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="versions, device, capability probes and presets")
    info.set_defaults(func=_cmd_info)
    demo_parser = sub.add_parser(
        "demo",
        help="train a small LM under several precision policies and compare them",
        description=(
            "Train computectx.nn.ByteLM on the Python standard library's sources (or --data) "
            "once per --dtype policy, from the same weights and batches; print a results "
            "table and a sample, and write results.json and loss.png into --out."
        ),
    )
    demo_args.add_arguments(demo_parser)
    demo_parser.set_defaults(func=lambda args: demo_args.run_command(args, demo_parser))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and ``python -m computectx``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
