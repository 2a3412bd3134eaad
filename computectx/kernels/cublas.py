"""The ``CUBLAS`` backend's launchers: torch's scaled GEMMs (``torch._scaled_mm``,
``F.scaled_mm``, ``F.scaled_grouped_mm``) under CUDA's rules, and which cuBLAS recipes run
here. Like the Triton kernels beside it, it imports only torch and is reached lazily by the
operator families (``computectx.formats.ops.tensorwise``, ``ops.blockwise``, ``ops.grouped``),
which call it on checked arguments.

``scaled_mm`` is the one dense launcher, for a pair of granularities: the per-tensor GEMM of
``computectx::fp8_scaled_mm`` (``tensor x tensor``, which runs wherever ``torch._scaled_mm``
does) and ``computectx::fp8_block_scaled_mm`` where ``serves`` says the recipe runs;
``grouped_rowwise_mm`` is the row-wise grouped GEMM of ``computectx::fp8_grouped_mm``.

``CUBLAS`` runs, per pair of granularities:

==================  ==============================================  =======================
pair                call                                            where it runs
==================  ==============================================  =======================
tensor x tensor     ``torch._scaled_mm``, float32 scalar scales     CUDA and the CPU
row x row           ``torch._scaled_mm``, scales ``(M, 1)`` and     CUDA (cuBLASLt >= 12.9
                    ``(1, N)`` float32                              on sm_90, else CUTLASS)
                                                                    and the CPU
1x128 x 1x128,      ``torch.nn.functional.scaled_mm``,              sm_90 with cuBLASLt
1x128 x 128x128,    ``ScalingType.BlockWise1x128`` /                >= 12.9 (torch refuses
128x128 x 1x128     ``BlockWise128x128`` (DeepSeek-V3's recipe)     them elsewhere)
mx x mx             ``torch.nn.functional.scaled_mm``,              sm_100 (E4M3 operands)
                    ``ScalingType.BlockWise1x32``, E8M0 scales
                    swizzled (``SwizzleType.SWIZZLE_32_4_4``)
==================  ==============================================  =======================

CUDA's rules are kept as the per-tensor path keeps them (``CUBLAS_MULTIPLE``): the
operands are row-major with 16-byte aligned rows, K and N zero-padded to multiples of 16 (K to
a multiple of 128 for the block recipes, whose scales cover whole 128-wide K blocks, and the
rows of a ``128x128`` operand to a multiple of 128: torch's check of those recipes, its meta
function included, wants that operand's scale to be ``(round_up(K/128, 4), rows // 128)``,
which only whole 128-row blocks fill), the scales laid out as torch's CUDA checks want
(``cublas_scales``) and padded with steps of 1 where the operands were padded with zero codes,
which add nothing; the padded rows and columns of the result are dropped. A bias is fused
only for a 16-bit result of the bias's dtype; otherwise the GEMM returns float32 and the bias
is added in float32 before the one rounding. Two E5M2
operands (which cuBLASLt refuses) and E5M2 operands in the block and MX recipes (torch
accepts E4M3 only there) take the fallback.

**Where a recipe does not run** (probed by running it on a small problem once per device,
operand formats and result dtype; ``cublas_recipes`` reports E4M3 with a bf16 result): the
``CUBLAS`` backend (``ops.blockwise``) computes that pair with the Triton kernel when the
device is a GPU where triton imports (as the ``CUBLAS`` backend quantizes with the kernels
there), and with the twin (``numerics.blockwise.reference_scaled_mm``) otherwise, on the same
device; it never raises for a valid call. So on the CPU, ``row x row`` runs on
``torch._scaled_mm``'s CPU kernel and the block pairs run on the twin. ``computectx info``
lists the probe's results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Final

import torch

__all__ = [
    "CUBLAS_MULTIPLE",
    "E8M0_ONE",
    "RECIPES",
    "cublas_bias",
    "cublas_gemm_dtype",
    "cublas_operand",
    "cublas_recipes",
    "cublas_result",
    "cublas_scales",
    "grouped_rowwise_mm",
    "recipe_of",
    "round_up",
    "scaled_mm",
    "serves",
    "swizzled",
]

RECIPES: Final[tuple[str, ...]] = ("row", "1x128x128x128", "1x128x1x128", "mx")
"""The cuBLAS recipes, by name: ``row x row``; ``1x128 x 128x128`` (either order);
``1x128 x 1x128``; ``mx x mx``."""
CUBLAS_MULTIPLE = 16
"""What ``torch._scaled_mm`` on CUDA wants K and N to be multiples of (M may be anything)."""
_TILE: Final = 128  # a 1x128/128x128 block's width, and the K padding of the block recipes
_MX_BLOCK: Final = 32  # an MX block's width
_E8M0: Final = torch.float8_e8m0fnu
E8M0_ONE: Final = 127
"""The E8M0 byte of 1.0 (``2**(127 - 127)``)."""


def round_up(n: int, multiple: int = CUBLAS_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def cublas_operand(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` itself when it is row-major with 16-byte aligned rows and the wanted shape; else
    a row-major copy, zero-padded to ``[rows, cols]`` (one read and write of a 1-byte
    operand): a GEMM operand as CUDA's ``_scaled_mm`` takes it."""
    aligned = t.stride(0) % CUBLAS_MULTIPLE == 0 and t.storage_offset() % CUBLAS_MULTIPLE == 0
    if tuple(t.shape) == (rows, cols) and t.stride(1) == 1 and t.stride(0) >= cols and aligned:
        return t
    padded = tuple(t.shape) != (rows, cols)
    out = t.new_zeros((rows, cols)) if padded else t.new_empty((rows, cols))
    out[: t.shape[0], : t.shape[1]].copy_(t)
    return out


def cublas_gemm_dtype(bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.dtype:
    """What a cuBLAS scaled GEMM returns: ``out_dtype``, or float32 when the bias cannot be
    fused (cuBLAS fuses one only into a 16-bit output of the bias's dtype) and is added
    after, before the one rounding to ``out_dtype``."""
    fuse = bias is not None and bias.dtype == out_dtype != torch.float32
    return out_dtype if bias is None or fuse else torch.float32


def cublas_bias(
    bias: torch.Tensor | None, out_dtype: torch.dtype, n_padded: int
) -> torch.Tensor | None:
    """The bias cuBLAS fuses, contiguous and zero-padded to the padded N; ``None`` when there
    is none to fuse (see ``cublas_gemm_dtype``)."""
    if bias is None or cublas_gemm_dtype(bias, out_dtype) == torch.float32:
        return None
    n = bias.shape[0]
    # cuBLASLt's bias epilogue reads N elements from one pointer: a strided view is copied.
    return bias.contiguous() if n_padded == n else torch.cat([bias, bias.new_zeros(n_padded - n)])


def cublas_result(
    out: torch.Tensor,
    m: int,
    n: int,
    bias: torch.Tensor | None,
    fused: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """A padded cuBLAS result cut to ``[m, n]``, with an unfused bias added in float32 and
    rounded once to ``out_dtype``."""
    padded = tuple(out.shape) != (m, n)
    out = out[:m, :n] if padded else out
    if bias is not None and fused is None:
        return (out + bias.to(torch.float32)).to(out_dtype)
    return out.contiguous() if padded else out


def recipe_of(ga: str, gb: str) -> str:
    """The name in ``RECIPES`` of the cuBLAS recipe that serves the pair of granularities
    (``"tensor"`` for the per-tensor pair, which runs everywhere and is not probed)."""
    if ga in ("tensor", "row"):
        return ga
    if ga == "mx":
        return "mx"
    return "1x128x1x128" if ga == gb else "1x128x128x128"


def _pad_rows(s: torch.Tensor, rows: int, cols: int, fill: float) -> torch.Tensor:
    # s [r, c] into a contiguous [rows, cols] tensor filled with ``fill`` (a step of 1 for
    # the zero codes of padded operand rows and K blocks).
    if tuple(s.shape) == (rows, cols):
        return s.contiguous()
    out = torch.full((rows, cols), fill, dtype=torch.float32, device=s.device)
    out[: s.shape[0], : s.shape[1]].copy_(s.to(torch.float32))
    return out.to(s.dtype)


def swizzled(scale: torch.Tensor, rows: int, kblocks: int, one: int) -> torch.Tensor:
    """1-byte block scales ``[r, c]`` (E8M0 or E4M3) in cuBLAS's 128 x 4 tiles
    (``SWIZZLE_32_4_4``), flat, of the scale's dtype: padded to ``[128 r, 4 c]`` for
    ``rows`` x ``kblocks`` with the byte ``one`` (the dtype's 1.0: the step of the zero codes
    of padded rows and K blocks); inside a tile, element ``(i, j)`` is at
    ``(i % 32) * 16 + (i // 32) * 4 + j``; the tiles follow row-block-major."""
    r128, c4 = round_up(rows, 128), round_up(kblocks, 4)
    padded = torch.full((r128, c4), one, dtype=torch.uint8, device=scale.device)
    padded[: scale.shape[0], : scale.shape[1]].copy_(scale.view(torch.uint8))
    tiles = padded.view(r128 // 128, 4, 32, c4 // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().flatten().view(scale.dtype)


def cublas_scales(
    scale: torch.Tensor, granularity: str, rows: int, k: int, *, operand: str
) -> torch.Tensor:
    """An operand's scale in the layout torch's CUDA ``scaled_mm`` wants, for an operand
    padded to ``rows`` rows and ``k`` columns (``operand`` is ``"a"`` or ``"b"``, which is
    passed transposed, as ``b.t()``).

    tensor: the step as a scalar; row: ``a`` ``(M, 1)``, ``b`` ``(1, N)``; ``1x128``:
    ``(rows, K/128)`` column-major; ``128x128``: ``(K/128 rounded up to 4, rows/128)``
    column-major, that is the row-major ``(rows/128, K/128 padded to 4)`` transposed;
    ``mx``: the swizzled E8M0 bytes, flat.
    (torch's checks for the CUDA v2 path, ``_scaled_block1x128_block1x128`` and its
    siblings in ``ScaledBlas.cpp``, state these layouts.)
    """
    if granularity == "tensor":
        return scale.reshape(())
    if granularity == "row":
        s = _pad_rows(scale.reshape(-1, 1), rows, 1, 1.0)
        return s if operand == "a" else s.reshape(1, rows)
    if granularity == "mx":
        return swizzled(scale, rows, -(-k // _MX_BLOCK), E8M0_ONE)
    kb = -(-k // _TILE)
    if granularity == "1x128":
        return _pad_rows(scale, rows, kb, 1.0).t().contiguous().t()
    return _pad_rows(scale, -(-rows // _TILE), round_up(kb, 4), 1.0).t()


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    granularity_a: str,
    scale_b: torch.Tensor,
    granularity_b: str,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * steps_a) @ (b * steps_b).T (+ bias)`` on cuBLAS, under CUDA's shape rules
    (module docstring): ``computectx::fp8_scaled_mm`` as the pair ``("tensor", "tensor")``
    (never two E5M2 operands: the caller runs those on the twin), and
    ``computectx::fp8_block_scaled_mm`` for a pair ``serves`` accepts."""
    # torch._scaled_mm's rules on CUDA (its meta function states them): mat1 row-major
    # [M, K], mat2 column-major [K, N] (b [N, K] row-major, transposed), K and N multiples
    # of 16, never two E5M2 operands. Its scales are exactly our steps (x = q * step). K and
    # N are zero-padded: a zero adds nothing to a float32 sum, and the padded columns of the
    # result are sliced off, so the result is the same function.
    # A 128x128 operand's rows are padded to whole 128-row blocks: torch's check of the block
    # recipes wants its scale to be (round_up(K/128, 4), rows // 128), so only whole blocks fit.
    ga, gb = granularity_a, granularity_b
    recipe = recipe_of(ga, gb)
    m, k = a.shape
    n = b.shape[0]
    kp = round_up(k, CUBLAS_MULTIPLE if recipe in ("tensor", "row") else _TILE)
    mp = round_up(m, _TILE) if ga == "128x128" else m
    np_ = round_up(n, _TILE if gb == "128x128" else CUBLAS_MULTIPLE)
    a_p, b_p = cublas_operand(a, mp, kp), cublas_operand(b, np_, kp)
    sa = cublas_scales(scale_a, ga, mp, kp, operand="a")
    sb = cublas_scales(scale_b, gb, np_, kp, operand="b")
    gemm_dtype = cublas_gemm_dtype(bias, out_dtype)
    fused_bias = cublas_bias(bias, out_dtype, np_)
    if recipe in ("tensor", "row"):
        out = torch._scaled_mm(
            a_p, b_p.t(), scale_a=sa, scale_b=sb, bias=fused_bias, out_dtype=gemm_dtype
        )
    else:
        f = torch.nn.functional
        kinds = {
            "1x128": f.ScalingType.BlockWise1x128,
            "128x128": f.ScalingType.BlockWise128x128,
            "mx": f.ScalingType.BlockWise1x32,
        }
        swizzle = f.SwizzleType.SWIZZLE_32_4_4 if recipe == "mx" else f.SwizzleType.NO_SWIZZLE
        out = f.scaled_mm(
            a_p,
            b_p.t(),
            sa,
            kinds[ga],
            sb,
            kinds[gb],
            swizzle_a=swizzle,
            swizzle_b=swizzle,
            bias=fused_bias,
            output_dtype=gemm_dtype,
        )
    return cublas_result(out, m, n, bias, fused_bias, out_dtype)


_PROBE_PAIRS: Final[dict[str, tuple[str, str]]] = {
    "row": ("row", "row"),
    "1x128x128x128": ("1x128", "128x128"),
    "1x128x1x128": ("1x128", "1x128"),
    "mx": ("mx", "mx"),
}
_PROBE_SHAPE: Final = (144, 160)  # rows of each operand, K: ragged for every recipe


def _probe_scale(g: str, rows: int, k: int, dev: torch.device) -> torch.Tensor:
    # Steps of 1 in the granularity's scale shape (numerics.layouts' table).
    shape = {
        "row": (rows, 1),
        "1x128": (rows, -(-k // _TILE)),
        "128x128": (-(-rows // _TILE), -(-k // _TILE)),
        "mx": (rows, -(-k // _MX_BLOCK)),
    }[g]
    if g == "mx":
        return torch.full(shape, E8M0_ONE, dtype=torch.uint8, device=dev).view(_E8M0)
    return torch.ones(shape, dtype=torch.float32, device=dev)


@functools.cache
def _probe(
    device: torch.device, recipe: str, fa: torch.dtype, fb: torch.dtype, out: torch.dtype
) -> tuple[bool, str]:
    # Run the recipe once on a ragged product of ones (M = N = 144, K = 160: every padding
    # of scaled_mm is taken) with these operand formats and this result dtype; it runs
    # when the call succeeds and gives 160 everywhere.
    f = torch.nn.functional
    api = "torch._scaled_mm" if recipe == "row" else "torch.nn.functional.scaled_mm"
    if recipe != "row" and not (hasattr(f, "scaled_mm") and hasattr(f, "ScalingType")):
        return False, f"this torch ({torch.__version__}) has no {api}"
    ga, gb = _PROBE_PAIRS[recipe]
    rows, k = _PROBE_SHAPE
    one = torch.ones(rows, k, device=device)
    sa, sb = _probe_scale(ga, rows, k, device), _probe_scale(gb, rows, k, device)
    try:
        got = scaled_mm(
            a=one.to(fa),
            b=one.to(fb),
            scale_a=sa,
            granularity_a=ga,
            scale_b=sb,
            granularity_b=gb,
            bias=None,
            out_dtype=out,
        )
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return False, f"{api} refuses it on {device}: {first}"
    if not bool((got == float(k)).all()):
        return False, f"{api} runs on {device} but gave a wrong product"
    return True, f"{api} on {device}"


def cublas_recipes(device: torch.device) -> dict[str, tuple[bool, str]]:
    """Which cuBLAS recipes run on ``device``: name (``RECIPES``) -> ``(runs, reason)``.

    Probed by running each, E4M3 operands and a bf16 result, on a 144 x 144 x 160 product of
    ones (ragged, so the call pads as a ragged layer's does) and checking the result (160
    everywhere); a recipe this torch lacks, or one it
    refuses on this device, is reported with torch's reason (its first line). Each probe
    runs once per device, operand formats and result dtype, the first time a call needs it.
    """
    e4m3 = torch.float8_e4m3fn
    return {name: _probe(device, name, e4m3, e4m3, torch.bfloat16) for name in RECIPES}


def serves(
    ga: str, gb: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.dtype
) -> bool:
    """Whether cuBLAS runs the pair ``(ga, gb)`` for these operands and result here."""
    if a.dtype == b.dtype == torch.float8_e5m2:
        return False  # cuBLASLt has no E5M2 x E5M2 GEMM
    recipe = recipe_of(ga, gb)
    if recipe != "row" and torch.float8_e5m2 in (a.dtype, b.dtype):
        return False  # torch's block and MX recipes take E4M3 only
    return _probe(a.device, recipe, a.dtype, b.dtype, cublas_gemm_dtype(bias, out))[0]


def grouped_rowwise_mm(
    *,
    qa: torch.Tensor,
    sa: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """torch's grouped fp8 GEMM (CUDA only) with one float32 step per row of ``qa`` and per
    row of each ``qb[g]``; rows past the last group are zeroed (torch leaves them as is)."""
    f = torch.nn.functional
    # torch/nn/functional.pyi (2.13) does not declare scaled_grouped_mm.
    scaled_grouped_mm: Callable[..., torch.Tensor] = getattr(f, "scaled_grouped_mm")  # noqa: B009
    out = scaled_grouped_mm(
        qa, qb.transpose(-2, -1), sa.reshape(-1), f.ScalingType.RowWise,
        sb.reshape(sb.shape[0], -1), f.ScalingType.RowWise, offs=offs, output_dtype=out_dtype,
    )  # fmt: skip
    out[offs[-1] :] = 0
    return out
