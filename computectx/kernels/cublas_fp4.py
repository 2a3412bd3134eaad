"""The ``"cublas"`` 4-bit backend's launcher: the dense NVFP4/MXFP4 GEMM of
``computectx::fp4_scaled_mm`` on torch's ``torch.nn.functional.scaled_mm`` (``_scaled_mm_v2``)
with ``torch.float4_e2m1fn_x2`` operands, under CUDA's rules; and the probe of which 4-bit
recipes run on a device. Like ``kernels.cublas`` beside it, it imports only torch and is
reached lazily by the operator family (``computectx.formats.ops.fp4``), which calls it on
checked arguments and hands it NVFP4's ``alpha`` (the twin's ``tensor_scale_alpha``).

==========  ===========================================  =======================================
recipe      call                                         where torch runs it (its source)
==========  ===========================================  =======================================
``nvfp4``   ``[BlockWise1x16, TensorWise]`` a side:      CUDA builds with cuBLASLt >= 12.8 on
            the swizzled E4M3 scales and a float32       a device whose cuBLASLt has a VEC16
            global scale; torch multiplies the two       UE4M3 kernel (sm_100; sm_120 untested)
            global scales and hands cuBLAS the product
            as its ``alpha``
``mxfp4``   ``BlockWise1x32`` a side: the swizzled       CUDA builds with FBGEMM GenAI (MSLK's
            E8M0 scales                                  ``f4f4bf16``), compute capability 10.x
==========  ===========================================  =======================================

**The call** (``ScaledBlas.cpp``'s ``_scaled_mm_cuda_v2_out``, ``_scaled_nvfp4_nvfp4``,
``_scaled_mxfp4_mxfp4``; ``_meta_registrations.py``'s ``_check_scaled_mm_sizes_v2``): ``a``
``[M, K/2]`` row-major, ``b`` passed as ``b.t()`` (``[K/2, N]`` column-major), packed two codes
a byte with element ``2j`` in the low nibble (torch's ``pack_uint4``, which is ours); K and N
multiples of 16 (K unpacked); each scale the flat ``SWIZZLE_32_4_4`` layout of ``round_up(rows,
128) x round_up(K / block, 4)`` bytes (``cublas.swizzled``), contiguous. NVFP4 takes two
swizzle values a side (``check_swizzle_lengths``): ``[SWIZZLE_32_4_4, NO_SWIZZLE]``.

**What this launcher does**: K is zero-padded to whole scale tiles (64 elements for NVFP4, 128
for MXFP4: 16-byte aligned rows, as cuBLASLt wants, and no tile partly read) and N to 16; a
``"16x16"`` tile's scale is repeated over its 16 rows (cuBLAS has 1x16 scales only); the
padded scale entries are the dtype's 1.0 (E4M3 byte 0x38, E8M0 byte 127), which multiply zero
codes and add nothing; the padded rows and columns of the result are dropped. NVFP4's global
scales are ``alpha`` and 1.0 (a tensor kept per device, not made per call), so torch's
product is ``alpha`` exactly and cuBLAS forms ``alpha * acc`` in float32, the twin's
epilogue. The bias is never fused: with a bias the GEMM returns float32 and the bias is added
in float32 before the one rounding, in our code, which is the twin's epilogue whatever
cuBLAS's bias epilogue does (torch's MXFP4 path, ``f4f4bf16``, is not handed a bias at all),
so every call the launcher makes is a call the probe runs.

**The probe** (``fp4_recipes``, ``serves``): each recipe runs once per device and result dtype
on a ragged product (``_PROBE_SHAPE``: M = 144, N = 136, K = 160, so the K padding to whole
scale tiles, the N padding to 16 and the scales' partial 128-row tiles are all taken) of
varied codes (0, +-0.5 .. +-2) and 1x16 / 1x32 scales (0.5, 1, 2) in every row and K block
(NVFP4 with ``alpha = 0.5``), no bias (none is ever handed to cuBLAS), and runs only if its
result has the asked dtype and is the twin's bit for bit: every partial sum is exact there, so
a torch that refuses the call (any ``Exception``: its first line is the reason), drops
``alpha``, returns another dtype or reads the scales in another layout is caught and reported.
A 16x16 tile is not probed: the launcher repeats its scales into 1x16 ones, held to the twin
by the tests. Verdicts are kept per indexed device (a bare ``"cuda"`` is the current device),
recipe and result dtype, except an out-of-memory error, which is reported and probed again on
the next call, and a call while the current CUDA stream captures a graph, which is not probed
(the probe synchronizes) and reports so: the call takes the Triton kernel; run a 4-bit GEMM
or ``fp4_recipes`` before capturing. Where a recipe does not run, the operator runs the
Triton kernel.
"""

from __future__ import annotations

from typing import Final

import torch

from computectx.kernels.cublas import (
    CUBLAS_MULTIPLE,
    E8M0_ONE,
    cublas_operand,
    cublas_result,
    round_up,
    swizzled,
)

__all__ = [
    "E4M3_ONE",
    "FP4_RECIPES",
    "fp4_gemm_dtype",
    "fp4_recipes",
    "fp4_scaled_mm",
    "indexed",
    "serves",
]

FP4_RECIPES: Final[tuple[str, ...]] = ("nvfp4", "mxfp4")
"""The 4-bit cuBLAS recipes, by format."""
E4M3_ONE: Final = 0x38
"""The E4M3 byte of 1.0."""
_BLOCK: Final[dict[str, int]] = {"nvfp4": 16, "mxfp4": 32}
_TILE_BLOCKS: Final = 4  # K blocks per swizzled scale tile (its 4 columns)


def _format(scale: torch.Tensor) -> str:
    return "nvfp4" if scale.dtype == torch.float8_e4m3fn else "mxfp4"


def fp4_gemm_dtype(fmt: str, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.dtype:
    """What the cuBLAS call of recipe ``fmt`` returns: ``out_dtype``, or float32 where there is
    a bias, which is added after the GEMM (no 4-bit call fuses one: module docstring)."""
    del fmt  # the same rule for both recipes
    return out_dtype if bias is None else torch.float32


def _codes(codes: torch.Tensor, rows: int, kbytes: int) -> torch.Tensor:
    # Packed codes as a row-major [rows, kbytes] operand (zero bytes: two codes of +0).
    u8 = cublas_operand(codes.view(torch.uint8), rows, kbytes)
    return u8.view(torch.float4_e2m1fn_x2)


def _scales(scale: torch.Tensor, tile: str, rows: int, kblocks: int) -> torch.Tensor:
    # A side's block scales, one per row and K block (a 16x16 tile's repeated over its
    # rows), swizzled for `rows` x `kblocks`.
    if tile == "16x16":
        scale = scale.view(torch.uint8).repeat_interleave(16, dim=0).view(scale.dtype)
    one = E4M3_ONE if scale.dtype == torch.float8_e4m3fn else E8M0_ONE
    return swizzled(scale, rows, kblocks, one)


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}
_TRACING_MODES: Final = tuple(torch._C._TorchDispatchModeKey.__members__.values())


def _unit_scale(device: torch.device) -> torch.Tensor:
    # NVFP4's second global scale, float32 1.0 (1,), kept per device: one fill launch per
    # device, not one per GEMM. Never written to (scaled_mm reads it); made outside
    # inference_mode. Built afresh, not kept, while compiling, under a fake, proxy or
    # functional mode, or while the current stream captures a graph (a tensor made there is
    # filled only when the graph replays).
    if (
        torch.compiler.is_compiling()
        or any(torch._C._get_dispatch_mode(k) is not None for k in _TRACING_MODES)
        or _capturing(device)
    ):
        return torch.ones(1, dtype=torch.float32, device=device)
    one = _UNIT_SCALES.get(device)
    if one is None:
        with torch.inference_mode(False), torch.no_grad():
            one = _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one


def fp4_scaled_mm(
    *,
    a: torch.Tensor,
    scale_a: torch.Tensor,
    tile_a: str,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    tile_b: str,
    alpha: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``alpha * (a @ b.T) (+ bias)`` at ``out_dtype`` on cuBLAS (module docstring): ``a``
    ``[M, K/2]`` and ``b`` ``[N, K/2]`` packed codes, their scales (E4M3 for NVFP4, with
    ``alpha`` float32 ``(1,)`` on the operands' device; E8M0 for MXFP4, ``alpha`` None)."""
    fmt = _format(scale_a)
    block = _BLOCK[fmt]
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    kp = round_up(k, _TILE_BLOCKS * block)
    np_ = round_up(n, CUBLAS_MULTIPLE)
    a_p, b_p = _codes(a, m, kp // 2), _codes(b, np_, kp // 2)
    sa = _scales(scale_a, tile_a, m, kp // block)
    sb = _scales(scale_b, tile_b, np_, kp // block)
    gemm_dtype = fp4_gemm_dtype(fmt, bias, out_dtype)
    f = torch.nn.functional
    swz, plain = f.SwizzleType.SWIZZLE_32_4_4, f.SwizzleType.NO_SWIZZLE
    if fmt == "nvfp4":
        if alpha is None:
            raise ValueError("an NVFP4 cuBLAS GEMM needs its alpha (float32 (1,)), got None")
        one = _unit_scale(alpha.device)
        kinds = [f.ScalingType.BlockWise1x16, f.ScalingType.TensorWise]
        out = f.scaled_mm(
            a_p, b_p.t(), [sa, alpha.float().reshape(1)], kinds, [sb, one], kinds,
            swizzle_a=[swz, plain], swizzle_b=[swz, plain], bias=None, output_dtype=gemm_dtype,
        )  # fmt: skip
    else:
        kind = f.ScalingType.BlockWise1x32
        out = f.scaled_mm(
            a_p, b_p.t(), sa, kind, sb, kind,
            swizzle_a=swz, swizzle_b=swz, bias=None, output_dtype=gemm_dtype,
        )  # fmt: skip
    return cublas_result(out, m, n, bias, None, out_dtype)


# M, N, K of the probe: M and N ragged for the scales' 128-row tiles, N (136) for the
# N padding to 16, K (160) for the K padding to whole scale tiles.
_PROBE_SHAPE: Final = (144, 136, 160)
# 0, +-0.5 .. +-2: with scales 0.5 .. 2 every partial sum of the probe is a multiple of 1/16
# below 2**12, exact in 16 bits, whatever order and width the tensor cores add in.
_E2M1_CODES: Final = (0, 1, 2, 3, 4, 9, 10, 11, 12)
# What torch raises where it refuses a call (its TORCH_CHECK kinds); anything else is named.
_REFUSALS: Final = (RuntimeError, ValueError, NotImplementedError, TypeError)
_VERDICTS: dict[tuple[torch.device, str, torch.dtype], tuple[bool, str]] = {}
"""The probes' lasting verdicts, by (indexed device, recipe, result dtype)."""


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``"cuda"`` is the current CUDA device (where CUDA
    is available), so a verdict is kept for the device it was probed on."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _probe_operand(fmt: str, rows: int, k: int, seed: int, dev: torch.device) -> torch.Tensor:
    # Varied packed codes from a fixed pattern.
    i = torch.arange(rows).reshape(-1, 1)
    j = torch.arange(k).reshape(1, -1)
    idx = (i * 7 + j * 3 + seed) % len(_E2M1_CODES)
    nib = torch.tensor(_E2M1_CODES, dtype=torch.uint8)[idx]
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return packed.to(dev).view(torch.float4_e2m1fn_x2)


def _probe_scale(fmt: str, rows: int, k: int, seed: int, dev: torch.device) -> torch.Tensor:
    # Powers of two, 0.5 .. 2, varying by row and K block: E4M3 or E8M0 bytes.
    kb = k // _BLOCK[fmt]
    e = (3 * torch.arange(rows).reshape(-1, 1) + 5 * torch.arange(kb).reshape(1, -1) + seed) % 3
    if fmt == "nvfp4":
        byte = torch.exp2(e.float() - 1).to(torch.float8_e4m3fn).view(torch.uint8)
        return byte.to(dev).view(torch.float8_e4m3fn)
    return (e + E8M0_ONE - 1).to(torch.uint8).to(dev).view(torch.float8_e8m0fnu)


def _probe_twin(fmt: str, out: torch.dtype) -> torch.Tensor:
    # The product the twin's arithmetic gives (exact partial sums, alpha 0.5 for NVFP4),
    # from the same bytes decoded on the CPU.
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    cpu = torch.device("cpu")
    m, n, k = _PROBE_SHAPE
    vals = []
    for seed, rows in ((1, m), (2, n)):
        nib = _probe_operand(fmt, rows, k, seed, cpu).view(torch.uint8)
        codes = torch.stack([nib & 15, nib >> 4], dim=-1).reshape(rows, k).long()
        v = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        s = _probe_scale(fmt, rows, k, seed, cpu).double()
        vals.append(v * s.repeat_interleave(_BLOCK[fmt], dim=1))
    prod = vals[0] @ vals[1].t()
    return (prod * (0.5 if fmt == "nvfp4" else 1.0)).float().to(out)


def _probe_run(device: torch.device, fmt: str, out: torch.dtype) -> torch.Tensor:
    # The recipe's call on the probe's operands (alpha 0.5: NVFP4's global scales must reach
    # the result), every tensor built on `device` here.
    m, n, k = _PROBE_SHAPE
    alpha = torch.full((1,), 0.5, device=device) if fmt == "nvfp4" else None
    return fp4_scaled_mm(
        a=_probe_operand(fmt, m, k, 1, device),
        scale_a=_probe_scale(fmt, m, k, 1, device),
        tile_a="1x16",
        b=_probe_operand(fmt, n, k, 2, device),
        scale_b=_probe_scale(fmt, n, k, 2, device),
        tile_b="1x16",
        alpha=alpha,
        bias=None,
        out_dtype=out,
    )


def _capturing(device: torch.device) -> bool:
    # Whether the current CUDA stream is capturing a graph (the probe syncs: it cannot run).
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


def _verdict(device: torch.device, fmt: str, out: torch.dtype) -> tuple[tuple[bool, str], bool]:
    # The probe (module docstring) and whether its verdict lasts: an out-of-memory error and
    # a graph capture say nothing of the recipe, so those verdicts are not kept.
    f = torch.nn.functional
    api = "torch.nn.functional.scaled_mm"
    if not (hasattr(f, "scaled_mm") and hasattr(f, "ScalingType") and hasattr(f, "SwizzleType")):
        return (False, f"this torch ({torch.__version__}) has no {api}"), True
    if _capturing(device):
        why = "not probed while a CUDA graph is captured (the probe synchronizes); probe first"
        return (False, f"{api} ({fmt}) on {device}: {why}"), False
    try:
        got = _probe_run(device, fmt, out)
    except Exception as e:  # any refusal is a verdict (a BaseException is not caught)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        named = first if isinstance(e, _REFUSALS) and first else f"{type(e).__name__}: {first}"
        if isinstance(e, torch.OutOfMemoryError):
            return (False, f"{api} ran out of memory probing {fmt} on {device}: {first} "
                    "(not kept: probed again on the next call)"), False  # fmt: skip
        return (False, f"{api} refuses {fmt} on {device}: {named}"), True
    if got.dtype != out:  # torch.equal compares values across dtypes
        return (False, f"{api} runs {fmt} on {device} but gave {got.dtype} for {out}"), True
    m, n, _ = _PROBE_SHAPE
    if got.shape != (m, n) or not torch.equal(got.cpu(), _probe_twin(fmt, out)):
        return (False, f"{api} runs {fmt} on {device} but gave a wrong product"), True
    return (True, f"{api} ({fmt}) on {device}"), True


def _probe(device: torch.device, fmt: str, out: torch.dtype) -> tuple[bool, str]:
    # The verdict for (device, recipe, result dtype): kept once it lasts, run again otherwise.
    key = (indexed(device), fmt, out)
    kept = _VERDICTS.get(key)
    if kept is not None:
        return kept
    verdict, lasting = _verdict(*key)
    if lasting:
        _VERDICTS[key] = verdict
    return verdict


def fp4_recipes(device: torch.device) -> dict[str, tuple[bool, str]]:
    """Which 4-bit cuBLAS recipes run on ``device`` with a bf16 result: format -> ``(runs,
    reason)`` (the probe of the module docstring, once per device and result dtype; never
    raises for a device torch cannot run on: that is a ``(False, reason)``)."""
    return {fmt: _probe(device, fmt, torch.bfloat16) for fmt in FP4_RECIPES}


def serves(scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    """Whether cuBLAS runs this call's recipe (by its scale dtype) for its result here."""
    fmt = _format(scale)
    return _probe(scale.device, fmt, fp4_gemm_dtype(fmt, bias, out_dtype))[0]
