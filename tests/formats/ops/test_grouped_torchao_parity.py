"""Parity of ``quantized_grouped_mm`` with torchao 0.18's grouped fp8 recipes (issue 23,
"Numerics").

**MXFP8.** torchao's ``_to_mxfp8_then_scaled_grouped_mm`` with
``kernel_preference=KernelPreference.EMULATED`` runs on the CPU: it quantizes with ``to_mx``
and multiplies the dequantized bf16 operands with ``torch._grouped_mm``. Ragged groups need
``pad_token_groups_for_grouped_mm=True`` (its wgrad's ``to_mx`` along M wants a multiple of 32
rows; torchao zero-pads each group to one, so its blocks along M start at each group's first
row, as ours do), and every row must belong to a group (``offs[-1] == M``). Ours under
``e4m3/mx/dynamic/0`` (``rceil``) and ``e4m3/mx+floor/dynamic/0`` against torchao's ``RCEIL``
and ``FLOOR`` on the same bf16 X and dY and a bf16 or float32 W, ragged groups with empty ones:

- the six quantized operands are identical, codes and E8M0 scales byte for byte: forward X
  and W 1x32 along K, dgrad dY and Wᵀ 1x32 along N, wgrad dYᵀ and Xᵀ 1x32 along each group's
  own rows (ours: each group's blocks, a group under 32 rows zero-padded to one block; torchao:
  its padded groups); ours never quantizes the expert of an empty group, so those experts are
  not compared;
- the SQNR of Y, dX and dW against float64 on the same values is within 0.5 dB of torchao's.
  Measured: Y, dX and dW 28.4-28.6 dB under rceil and 27.5 dB under floor, ours and torchao's
  within 0.005 dB. On this machine the results are even bit for bit equal (torchao sums the
  dequantized bf16 operands in float32 and rounds once, as the twin does), but for dW with a
  float32 W (ours is float32, torchao's rounded to bf16); the test does not require it.

**Row-wise.** torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` does not run on the CPU: its
default ``pad_token_groups_for_grouped_mm=True`` asserts "not yet supported", and with
``False`` its Triton quantize kernels refuse CPU tensors ("triton_fp8_rowwise_2d_scale_and_cast
requires triton installed") and ``torch._scaled_grouped_mm`` has no CPU kernel. The blockwise
``_to_fp8_blockwise_then_emulated_scaled_grouped_mm`` quantizes with Triton kernels too and
fails without a GPU driver (even under ``TRITON_INTERPRET=1``). So no SQNR is compared for
them; the row-wise operands are compared with torchao's pure-torch reference quantizers (the
ones its Triton kernels are tested against), power-of-two scales: forward X and W row-wise
along K (``tensor_to_scale`` axiswise, ``to_fp8_saturated``), dgrad Wᵀ along N
(``torch_to_3d_rowwise_float8_transpose_rhs``), wgrad dYᵀ and Xᵀ per group along its rows
(``torch_to_float8_per_group_rowwise``/``_colwise``): the codes are identical and our steps
are the reciprocals of torchao's scales. torchao's per-group references raise on an empty
group (``amax()`` of an empty dimension), so they are given the non-empty groups' offsets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from computectx.formats import Recipe, quantized_grouped_mm
from computectx.formats.numerics import grouped as twin

ao_mx = pytest.importorskip("torchao.prototype.moe_training.mxfp8_grouped_mm")
ao_utils = pytest.importorskip("torchao.prototype.moe_training.utils")
mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")
ao_common = pytest.importorskip("torchao.quantization.quantize_.common")
float8_utils = pytest.importorskip("torchao.float8.float8_utils")
float8_config = pytest.importorskip("torchao.float8.config")

import bench_granularity as bench  # noqa: E402  (after the skips above)

sqnr: Callable[..., float] = bench.sqnr  # the bench's SQNR, in dB

E4M3 = torch.float8_e4m3fn
MX = 32
SIZES = (0, 37, 5, 0, 70, 20, 64)  # empty, ragged, under one mx block, aligned; M = 196
M, K, N, E = sum(SIZES), 96, 64, len(SIZES)  # K and N whole mx blocks, as to_mx wants
POLICIES = {"rceil": "e4m3/mx/dynamic/0", "floor": "e4m3/mx+floor/dynamic/0"}
Record = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (input, codes, scale)


def offsets(sizes: tuple[int, ...] = SIZES) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def groups() -> list[tuple[int, int, int]]:
    """``(g, start, size)`` of each non-empty group."""
    starts = [sum(SIZES[:g]) for g in range(E)]
    return [(g, starts[g], SIZES[g]) for g in range(E) if SIZES[g]]


def operands(w_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).bfloat16()
    w = (torch.randn(E, N, K, generator=gen) / math.sqrt(K)).to(w_dtype)
    dy = torch.randn(M, N, generator=gen).bfloat16()
    return x, w, dy


def exact(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    y, dx, dw = x64.new_zeros(M, N), x64.new_zeros(M, K), x64.new_zeros(E, N, K)
    for g, start, size in groups():
        rows = slice(start, start + size)
        y[rows], dx[rows] = x64[rows] @ w64[g].t(), dy64[rows] @ w64[g]
        dw[g] = dy64[rows].t() @ x64[rows]
    return y, dx, dw


def run(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xg, wg)
    y.backward(dy)  # type: ignore[no-untyped-call]
    assert xg.grad is not None and wg.grad is not None
    return y.detach(), xg.grad, wg.grad


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_bytes(
    ours: tuple[torch.Tensor, torch.Tensor],
    theirs: tuple[torch.Tensor, torch.Tensor],
    label: object,
) -> None:
    assert ours[1].dtype == theirs[1].dtype == torch.float8_e8m0fnu, label
    assert ours[0].shape == theirs[0].shape and ours[1].shape == theirs[1].shape, label
    assert torch.equal(u8(ours[0]), u8(theirs[0])), (label, "codes")
    assert torch.equal(u8(ours[1]), u8(theirs[1])), (label, "scales")


# ----- MXFP8 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["w-bf16", "w-fp32"])
@pytest.mark.parametrize("mode", list(POLICIES))
def test_mx_operands_are_torchaos_bytes_and_the_sqnr_within_half_a_db(
    mode: str, w_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, w, dy = operands(w_dtype)
    offs = offsets()
    theirs_q: Record = []
    to_mx = ao_mx.to_mx

    def recording_to_mx(data: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scale, codes = to_mx(data, *args, **kwargs)
        theirs_q.append((data.detach().clone(), codes, scale))
        return scale, codes

    monkeypatch.setattr(ao_mx, "to_mx", recording_to_mx)
    ours_q: Record = []
    quantize = twin.quantize_operand

    def recording_quantize(t: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale = quantize(t, *args)
        ours_q.append((t.detach().clone(), codes, scale))
        return codes, scale

    monkeypatch.setattr(twin, "quantize_operand", recording_quantize)
    mode_enum = getattr(mx_config.ScaleCalculationMode, mode.upper())

    def torchao(xg: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = ao_mx._to_mxfp8_then_scaled_grouped_mm(
            xg, wg.transpose(-2, -1), offs, out_dtype=torch.bfloat16,
            kernel_preference=ao_common.KernelPreference.EMULATED,
            scale_calculation_mode=mode_enum, pad_token_groups_for_grouped_mm=True,
        )  # fmt: skip
        return out

    policy = Recipe.parse(POLICIES[mode])
    theirs = run(torchao, x, w, dy)
    ours = run(
        lambda xg, wg: quantized_grouped_mm(xg, wg, offs, policy, backend="reference"), x, w, dy
    )

    # torchao: forward X (padded), W; dgrad dY (padded), Wᵀ; wgrad dYᵀ, Xᵀ (padded).
    assert len(theirs_q) == 6
    fx, fw, gdy, gwt, wdy, wx = theirs_q
    padded = [0]
    for size in SIZES:
        padded.append(padded[-1] + -(-size // MX) * MX)
    assert torch.equal(fw[0], w) and torch.equal(gwt[0], w.transpose(1, 2))
    # ours: per non-empty group, (a, b) of the forward, then of the dgrad, then of the wgrad.
    live = groups()
    assert len(ours_q) == 6 * len(live)
    forward, dgrad, wgrad = (ours_q[i * 2 * len(live) : (i + 1) * 2 * len(live)] for i in range(3))
    for i, (g, start, size) in enumerate(live):
        rows, prow = slice(start, start + size), slice(padded[g], padded[g] + size)
        pblk = slice(padded[g] // MX, padded[g] // MX + -(-size // MX))
        a, b = forward[2 * i], forward[2 * i + 1]
        assert torch.equal(a[0], x[rows]) and torch.equal(b[0], w[g])
        assert_bytes(a[1:], (fx[1][prow], fx[2][prow]), ("forward X", g))
        assert_bytes(b[1:], (fw[1][g], fw[2][g]), ("forward W", g))
        a, b = dgrad[2 * i], dgrad[2 * i + 1]
        assert torch.equal(a[0], dy[rows]) and torch.equal(b[0], w[g].t())
        assert_bytes(a[1:], (gdy[1][prow], gdy[2][prow]), ("dgrad dY", g))
        assert_bytes(b[1:], (gwt[1][g], gwt[2][g]), ("dgrad Wt", g))
        for (t, codes, scale), (_, tq, ts), what in zip(
            wgrad[2 * i : 2 * i + 2], (wdy, wx), ("dYt", "Xt"), strict=True
        ):
            assert t.shape[1] == size  # the group's own rows, padded to one block under 32
            assert_bytes((codes[:, :size], scale), (tq[:, prow], ts[:, pblk]), ("wgrad " + what, g))

    want = exact(x, w, dy)
    for name, o, t, e in zip(("Y", "dX", "dW"), ours, theirs, want, strict=True):
        assert o.shape == t.shape, name
        ours_db, theirs_db = sqnr(o, e), sqnr(t, e)
        assert abs(ours_db - theirs_db) <= 0.5, (name, ours_db, theirs_db)
        assert ours_db > 26.0, (name, ours_db)


# ----- row-wise -------------------------------------------------------------------------------


def test_row_operands_are_torchaos_reference_quantizers_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w, dy = operands(torch.float32)
    ours_q: Record = []
    quantize = twin.quantize_operand

    def recording_quantize(t: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale = quantize(t, *args)
        ours_q.append((t.detach().clone(), codes, scale))
        return codes, scale

    monkeypatch.setattr(twin, "quantize_operand", recording_quantize)
    policy = Recipe.parse("e4m3/row/dynamic/0")
    run(
        lambda xg, wg: quantized_grouped_mm(xg, wg, offsets(), policy, backend="reference"),
        x,
        w,
        dy,
    )

    axiswise = float8_config.ScalingGranularity.AXISWISE

    def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = float8_utils.tensor_to_scale(
            t, E4M3, scaling_granularity=axiswise, axiswise_dim=-1, round_scales_to_power_of_2=True
        )
        return float8_utils.to_fp8_saturated(t.float() * scale, E4M3), scale

    live = groups()
    sizes = tuple(size for _, _, size in live)  # torchao's per-group references refuse empty ones
    wt_q, wt_s = ao_utils.torch_to_3d_rowwise_float8_transpose_rhs(
        w.transpose(-2, -1), E4M3, round_scales_to_power_of_2=True
    )  # [E, N, K] codes (column major) and [E, 1, K] scales, along N
    dyt_q, dyt_s = ao_utils.torch_to_float8_per_group_rowwise(
        dy.t().contiguous(), offsets(sizes), E4M3, round_scales_to_power_of_2=True
    )
    x_q, x_s = ao_utils.torch_to_float8_per_group_colwise(
        x, offsets(sizes), E4M3, round_scales_to_power_of_2=True
    )
    forward, dgrad, wgrad = (ours_q[i * 2 * len(live) : (i + 1) * 2 * len(live)] for i in range(3))
    for i, (g, start, size) in enumerate(live):
        rows = slice(start, start + size)
        expected = [
            ("forward X", forward[2 * i], rowwise(x[rows])),
            ("forward W", forward[2 * i + 1], rowwise(w[g])),
            ("dgrad dY", dgrad[2 * i], rowwise(dy[rows])),
            ("dgrad Wt", dgrad[2 * i + 1], (wt_q[g].t(), wt_s[g].t())),
            ("wgrad dYt", wgrad[2 * i], (dyt_q[:, rows], dyt_s[i * N : (i + 1) * N, None])),
            ("wgrad Xt", wgrad[2 * i + 1], (x_q[rows].t(), x_s[i * K : (i + 1) * K, None])),
        ]
        for what, (_, codes, step), (their_codes, their_scale) in expected:
            assert codes.dtype == their_codes.dtype == E4M3, (what, g)
            assert torch.equal(u8(codes), u8(their_codes)), (what, g)
            assert torch.equal(step.reshape(-1), their_scale.reshape(-1).reciprocal()), (what, g)
