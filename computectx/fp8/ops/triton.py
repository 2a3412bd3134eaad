"""The Triton kernels as the fp8 operators launch them: the one place that imports
``computectx.kernels``.

Each launcher here imports its kernel module on first use, inside the function: importing a
kernel module imports triton, and decorating its kernels reads ``TRITON_INTERPRET``, which must
be settled by then; so ``import computectx.fp8`` works without triton. The signatures are the
kernel launchers' own (keyword-only), so a call here is checked as a call there would be.
``uses_kernels`` says whether a backend quantizes a tensor with the kernels at all.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from computectx import capability
from computectx.fp8.backend import Fp8Backend
from computectx.fp8.numerics.layouts import Granularity, StepRule

__all__ = [
    "decode_attention",
    "grouped_scaled_mm",
    "grouped_scaled_wgrad",
    "quantize_blocks",
    "quantize_delayed",
    "quantize_dynamic",
    "quantize_with_step",
    "scaled_mm",
    "scaled_mm_blocks",
    "triton_imports",
    "uses_kernels",
]


@functools.cache
def triton_imports() -> bool:
    """Whether triton imports here (``capability.triton_available``, probed once)."""
    return capability.triton_available().ok


def uses_kernels(backend: Fp8Backend, x: torch.Tensor) -> bool:
    """Whether ``backend`` quantizes ``x`` with the Triton kernels (else the pure-torch twins).

    TRITON runs every op on the kernels; CUBLAS quantizes with them on a GPU where triton
    imports (its GEMM is torch._scaled_mm) and with the twins elsewhere: ``select_backend``
    picks CUBLAS precisely when triton does not import.
    """
    return backend is Fp8Backend.TRITON or (
        backend is Fp8Backend.CUBLAS and x.device.type == "cuda" and triton_imports()
    )


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
    """``computectx.kernels.quantize.quantize_delayed``."""
    from computectx.kernels import quantize

    return quantize.quantize_delayed(
        x=x,
        fp8=fp8,
        ledger=ledger,
        history_len=history_len,
        slot=slot,
        step_offset=step_offset,
        nonfinite_offset=nonfinite_offset,
        saturated_offset=saturated_offset,
        algo=algo,
        margin=margin,
    )


def quantize_dynamic(
    *, x: torch.Tensor, fp8: torch.dtype, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``computectx.kernels.quantize.quantize_dynamic``."""
    from computectx.kernels import quantize

    return quantize.quantize_dynamic(x=x, fp8=fp8, margin=margin)


def quantize_with_step(
    *, x: torch.Tensor, fp8: torch.dtype, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``computectx.kernels.quantize.quantize_with_step``."""
    from computectx.kernels import quantize

    return quantize.quantize_with_step(x=x, fp8=fp8, step=step)


def quantize_blocks(
    *,
    x: torch.Tensor,
    fp8: torch.dtype,
    block_rows: int,
    block_cols: int | None,
    rule: StepRule,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``computectx.kernels.quantize_blocks.quantize_blocks``."""
    from computectx.kernels import quantize_blocks as kernel

    return kernel.quantize_blocks(
        x=x, fp8=fp8, block_rows=block_rows, block_cols=block_cols, rule=rule, scale=scale
    )


def scaled_mm(
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    step_a: torch.Tensor,
    step_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``computectx.kernels.scaled_mm.scaled_mm``."""
    from computectx.kernels import scaled_mm as kernel

    return kernel.scaled_mm(a=a, b=b, step_a=step_a, step_b=step_b, bias=bias, out_dtype=out_dtype)


def scaled_mm_blocks(
    *,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    block_rows_a: int,
    scale_b: torch.Tensor,
    block_rows_b: int,
    block_k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``computectx.kernels.scaled_mm_blocks.scaled_mm_blocks``."""
    from computectx.kernels import scaled_mm_blocks as kernel

    return kernel.scaled_mm_blocks(
        a=a,
        b=b,
        scale_a=scale_a,
        block_rows_a=block_rows_a,
        scale_b=scale_b,
        block_rows_b=block_rows_b,
        block_k=block_k,
        bias=bias,
        out_dtype=out_dtype,
    )


def decode_attention(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_step: torch.Tensor | None,
    v_step: torch.Tensor | None,
    length: torch.Tensor,
    sm_scale: float,
    block_t: int,
) -> torch.Tensor:
    """``computectx.kernels.decode_attention.decode_attention``."""
    from computectx.kernels import decode_attention as kernel

    return kernel.decode_attention(
        q=q,
        k=k,
        v=v,
        k_step=k_step,
        v_step=v_step,
        length=length,
        sm_scale=sm_scale,
        block_t=block_t,
    )


def grouped_scaled_mm(
    *,
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    granularity_a: Granularity,
    granularity_b: Granularity,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``computectx.kernels.grouped_mm.grouped_scaled_mm``."""
    from computectx.kernels import grouped_mm as kernel

    return kernel.grouped_scaled_mm(
        a=a,
        sa=sa,
        b=b,
        sb=sb,
        offs=offs,
        granularity_a=granularity_a,
        granularity_b=granularity_b,
        out_dtype=out_dtype,
    )


def grouped_scaled_wgrad(
    *,
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    block_start: torch.Tensor,
    granularity: Granularity,
) -> torch.Tensor:
    """``computectx.kernels.grouped_wgrad.grouped_scaled_wgrad`` (``"128x128"`` is refused)."""
    from computectx.kernels import grouped_wgrad as kernel

    return kernel.grouped_scaled_wgrad(
        a=a, sa=sa, b=b, sb=sb, offs=offs, block_start=block_start, granularity=granularity
    )
