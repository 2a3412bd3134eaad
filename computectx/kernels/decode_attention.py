"""Decode attention over an fp8 (or 16/32-bit) KV cache: one query per (batch, head).

The twin and the semantics are in ``computectx.formats.ops.attention``: keys and values
dequantized per block in float32 (code widened, times its step), scores and online softmax
in float32, the weighted sum in a float32 accumulator rescaled across blocks, one rounding
to the query's dtype at the end.

Grid: ``(B * H, S)``. Each program walks its share of T (``S`` contiguous ranges of whole
blocks; positions at or beyond ``length[b]`` are masked and whole blocks beyond it are not
read) with its own running max ``m``, sum ``l`` and accumulator. With ``S == 1`` the
program divides and stores the output itself. With ``S > 1`` (split-K, "flash decoding")
each program stores its float32 ``(m, l, acc)`` and a second kernel merges them per
(b, h): ``M = max m_s``, ``l = sum l_s exp(m_s - M)``, ``acc = sum acc_s exp(m_s - M)``,
then ``acc / l``: one more level of float32 rescaling, inside the twin's error bound. The
launcher splits T only when ``B * H`` programs would leave the GPU's SMs idle: a decode
batch of 8 sequences x 32 heads is 256 programs, two per SM on a 132-SM H100/H200, and
every program streams ``T * D`` bytes of K and of V, so long contexts at small batches
need the split to keep every SM reading.

Steps are float32, bfloat16 or e8m0 (``KvFp8.step``): a bf16 step is loaded and widened, an
e8m0 step (passed as its uint8 bytes) becomes the float32 whose exponent field
it is (``e << 23``; code 0 is ``2**-127`` and 255 NaN, as torch reads them), all exact, so the
kernel reads the compact steps themselves: no float32 copy of them is made per decode step.
The step's type is the pointer's, so each step format compiles its own kernel.

The codes are loaded as fp8 and widened (exact); the bf16 output is rounded to nearest even
on the bit pattern (Triton's interpreter truncates in the cast, GPUs round), so the
interpreter and a GPU compute the same function. Sums use ``tl.sum`` (CUDA cores, no tensor
cores: one query row is too thin for an MMA), whose order is not torch's, so the kernel
meets the twin within ``decode_attention_error_bound``, not bit for bit.
"""

# ruff: noqa: N803  (upper-case names mark constexpr parameters, as in triton)
from __future__ import annotations

from typing import Final

import torch
import triton
import triton.language as tl

from computectx.kernels.fp8_codes import e8m0_step, round_to_bf16

__all__ = ["INTERPRETED", "decode_attention", "split_count"]

INTERPRETED: Final[bool] = triton.knobs.runtime.interpret
"""Whether this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when it
was imported) rather than compiled for a GPU; fixed at import."""

_NUM_WARPS = 4
_MIN_BLOCKS_PER_SPLIT = 4


@triton.jit
def _batch_head(H):  # type: ignore[no-untyped-def]
    # This program's row of the B * H grid axis, and its (b, h) as int64 offsets.
    bh = tl.program_id(0)
    return bh, (bh // H).to(tl.int64), (bh % H).to(tl.int64)


@triton.jit
def _store_out(out_ptr, offs_d, dmask, res, OUT_BF16: tl.constexpr):  # type: ignore[no-untyped-def]
    if OUT_BF16:
        res = round_to_bf16(res)
    tl.store(out_ptr + offs_d, res.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _widen_step(s):  # type: ignore[no-untyped-def]
    # A loaded step as float32, exactly: e8m0 bytes (uint8, known when the kernel is
    # compiled from the pointer's type) via their exponent field.
    return e8m0_step(s.to(tl.int32)) if s.dtype == tl.uint8 else s.to(tl.float32)


@triton.jit
def _store_partial(  # type: ignore[no-untyped-def]
    part_ptr, bh, split, m, l_sum, acc, offs_d, dmask, BLOCK_D: tl.constexpr
):
    # Partials, float32 rows of [m, l, acc[0:D]] at (bh, split); an empty split stores
    # m = -inf, l = 0, acc = 0, which the merge weighs by exp(-inf) = 0.
    row = part_ptr + (bh.to(tl.int64) * tl.num_programs(1) + split) * (BLOCK_D + 2)
    tl.store(row, m)
    tl.store(row + 1, l_sum)
    tl.store(row + 2 + offs_d, acc, mask=dmask)


@triton.jit
def _decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    len_ptr,
    out_ptr,
    part_ptr,
    H,
    T_max,
    D,
    sm_scale,
    split_len,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ksb,
    stride_ksh,
    stride_kst,
    stride_vsb,
    stride_vsh,
    stride_vst,
    stride_ob,
    stride_oh,
    HAS_STEP: tl.constexpr,
    K_PER_TOKEN: tl.constexpr,
    V_PER_TOKEN: tl.constexpr,
    SPLIT: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh, b, h = _batch_head(H)
    split = tl.program_id(1)
    n = tl.minimum(tl.load(len_ptr + b), T_max)
    start = split * split_len
    stop = tl.minimum(start + split_len, n)

    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=dmask, other=0.0)
    q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    ks_base = ks_ptr + b * stride_ksb + h * stride_ksh
    vs_base = vs_ptr + b * stride_vsb + h * stride_vsh
    if HAS_STEP:
        # per_head / per_tensor steps: one float32 for the whole program.
        k_one = _widen_step(tl.load(ks_base))
        v_one = _widen_step(tl.load(vs_base))

    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for t0 in tl.range(start, stop, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tmask = offs_t < stop
        tile = tmask[:, None] & dmask[None, :]
        rows = offs_t[:, None].to(tl.int64)
        # Both tiles (and their steps) are requested before any arithmetic, so their
        # reads are in flight together.
        kk = tl.load(k_base + rows * stride_kt + offs_d[None, :], mask=tile, other=0.0)
        vv = tl.load(v_base + rows * stride_vt + offs_d[None, :], mask=tile, other=0.0)
        if HAS_STEP:
            # Masked positions load 0 (an e8m0 0 is 2**-127): their scores are -inf and their
            # values zero below, whatever the step.
            if K_PER_TOKEN:
                k_st = _widen_step(tl.load(ks_base + offs_t * stride_kst, mask=tmask, other=0))
            if V_PER_TOKEN:
                v_st = _widen_step(tl.load(vs_base + offs_t * stride_vst, mask=tmask, other=0))
        kk = kk.to(tl.float32)
        vv = vv.to(tl.float32)
        if HAS_STEP:
            kk = kk * (k_st[:, None] if K_PER_TOKEN else k_one)
            vv = vv * (v_st[:, None] if V_PER_TOKEN else v_one)
        s = tl.sum(kk * q[None, :], axis=1) * sm_scale
        s = tl.where(tmask, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        # tl.exp is missing from typings/triton (the stubs this project keeps).
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vv, axis=0)
        m = m_new

    if SPLIT:
        _store_partial(part_ptr, bh, split, m, l_sum, acc, offs_d, dmask, BLOCK_D)
    else:
        _store_out(out_ptr + b * stride_ob + h * stride_oh, offs_d, dmask, acc / l_sum, OUT_BF16)


@triton.jit
def _merge_kernel(  # type: ignore[no-untyped-def]
    part_ptr,
    out_ptr,
    H,
    D,
    S,
    stride_ob,
    stride_oh,
    OUT_BF16: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh, b, h = _batch_head(H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < S
    dmask = offs_d < D
    rows = part_ptr + (bh.to(tl.int64) * S + offs_s) * (BLOCK_D + 2)
    ms = tl.load(rows, mask=smask, other=float("-inf"))
    ls = tl.load(rows + 1, mask=smask, other=0.0)
    accs = tl.load(rows[:, None] + 2 + offs_d[None, :], mask=smask[:, None] & dmask[None, :])
    big_m = tl.max(ms, axis=0)  # finite: the first split holds position 0
    w = tl.exp(ms - big_m)
    l_sum = tl.sum(ls * w, axis=0)
    acc = tl.sum(tl.where(smask[:, None], accs, 0.0) * w[:, None], axis=0)
    _store_out(out_ptr + b * stride_ob + h * stride_oh, offs_d, dmask, acc / l_sum, OUT_BF16)


def split_count(batch_heads: int, t_max: int, block_t: int, device: torch.device) -> int:
    """How many programs share each (b, h)'s positions: enough for about four programs per
    SM when ``batch_heads`` alone gives fewer, never under ``_MIN_BLOCKS_PER_SPLIT`` blocks
    of positions per program; 1 under the interpreter and on the CPU."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(4 * sms, batch_heads)
    most = max(1, triton.cdiv(t_max, block_t) // _MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, most))


def _splits(
    batch_heads: int, t_max: int, block_t: int, splits: int | None, device: torch.device
) -> tuple[int, int]:
    # (programs per (b, h), positions per program): split_count's (or the forced) number,
    # at most one per block, each program a whole number of blocks.
    n_split = splits if splits is not None else split_count(batch_heads, t_max, block_t, device)
    n_blocks = triton.cdiv(t_max, block_t)
    n_split = max(1, min(n_split, n_blocks))
    split_len = triton.cdiv(n_blocks, n_split) * block_t
    return triton.cdiv(t_max, split_len), split_len


def _step_strides(s: torch.Tensor | None) -> tuple[int, int, int]:
    # (b, h, t) strides of a step: none for a 16/32-bit cache or a per_tensor step.
    if s is None or (s.dim() == 1 and s.numel() == 1):
        return 0, 0, 0
    if s.dim() == 1:  # per_head (H,)
        return 0, s.stride(0), 0
    return s.stride(0), s.stride(1), s.stride(2)


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
    splits: int | None = None,
) -> torch.Tensor:
    """``(B, H, D)`` attention output at ``q``'s dtype; arguments as the twin's, already
    checked by ``computectx.formats.ops.attention`` (steps ``None`` for a 16/32-bit cache).
    ``splits`` forces the number of programs per (b, h) (tests); by default
    ``split_count``."""
    b, h, t_max, d = k.shape
    if d > 256 or block_t & (block_t - 1):
        raise ValueError(f"the kernel serves D <= 256 and power-of-two block_t; got {d}, {block_t}")
    # Rows of D elements are read as contiguous vectors (any other strides are free).
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    n_split, split_len = _splits(b * h, t_max, block_t, splits, q.device)
    block_d = triton.next_power_of_2(d)
    has_step = k_step is not None and v_step is not None
    # e8m0 steps are read as their bytes (triton has no e8m0 type); bf16 and f32 as they are.
    if k_step is not None and k_step.element_size() == 1:
        k_step = k_step.view(torch.uint8)
    if v_step is not None and v_step.element_size() == 1:
        v_step = v_step.view(torch.uint8)
    ks = k_step if k_step is not None else out
    vs = v_step if v_step is not None else out
    kss, vss = _step_strides(k_step), _step_strides(v_step)
    part = (
        torch.empty((b * h, n_split, block_d + 2), dtype=torch.float32, device=q.device)
        if n_split > 1
        else out
    )
    lengths = length.contiguous()
    _decode_kernel[(b * h, n_split)](
        q,
        k,
        v,
        ks,
        vs,
        lengths,
        out,
        part,
        h,
        t_max,
        d,
        sm_scale,
        split_len,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        *kss,
        *vss,
        out.stride(0),
        out.stride(1),
        HAS_STEP=has_step,
        K_PER_TOKEN=k_step is not None and k_step.dim() == 3,
        V_PER_TOKEN=v_step is not None and v_step.dim() == 3,
        SPLIT=n_split > 1,
        OUT_BF16=q.dtype == torch.bfloat16,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=_NUM_WARPS,
    )
    if n_split > 1:
        _merge_kernel[(b * h,)](
            part,
            out,
            h,
            d,
            n_split,
            out.stride(0),
            out.stride(1),
            OUT_BF16=q.dtype == torch.bfloat16,
            BLOCK_S=triton.next_power_of_2(n_split),
            BLOCK_D=block_d,
            num_warps=_NUM_WARPS,
        )
    return out
