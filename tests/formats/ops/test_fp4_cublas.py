"""The 4-bit ``"cublas"`` backend (``computectx.kernels.cublas_fp4``, ``ops.fp4_backend``)
against a stand-in for CUDA's ``torch.nn.functional.scaled_mm`` FP4 path: no Blackwell GPU is
reachable here, so the stand-in enforces the rules torch's CUDA build states
(``ScaledBlas.cpp``: ``_scaled_mm_cuda_v2_out``, ``_scaled_nvfp4_nvfp4``, ``_scaled_mxfp4_mxfp4``,
``check_swizzle_lengths``; ``_meta_registrations.py``: ``_check_scaled_mm_sizes_v2``) and
computes the product from the operands and scales as laid out, summing in the twin's order, so
the launcher's result is the twin's bit for bit. The stand-in's reading of the swizzled scales is
held to torch's own ``to_blocked`` (``torch.testing._internal.common_quantized``), so it cannot
share a layout bug with the launcher (which uses ``kernels.cublas.swizzled``).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from computectx import capability
from computectx.formats.numerics import fp4_gemm
from computectx.formats.numerics.fp4 import Mxfp4Operand, Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Operand, Fp4Quant
from computectx.formats.ops import fp4 as ops
from computectx.formats.ops import fp4_backend
from computectx.kernels import cublas_fp4

F = torch.nn.functional
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def refuse(why: str) -> None:
    raise RuntimeError(f"strict scaled_mm v2 FP4 (CUDA rules): {why}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def decode_codes(t: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    # float64 [rows, k] from packed bytes, element 2j in byte j's low nibble (torch's
    # pack_uint4: uint8_data[1::2] << 4 | uint8_data[::2]).
    u8 = t.view(torch.uint8).long()
    nib = torch.stack([u8 & 15, u8 >> 4], dim=-1).reshape(rows, k)
    mag = torch.tensor(E2M1, dtype=torch.float64)[nib & 7]
    return torch.where(nib >= 8, -mag, mag)


def unswizzle(flat: torch.Tensor, rows: int, kblocks: int) -> torch.Tensor:
    # [rows, kblocks] of a flat SWIZZLE_32_4_4 scale (cuBLAS's 1D block-scaling layout, as
    # torch's from_blocked reads it): tile (i // 128, j // 4) of 512 bytes, row-block-major;
    # inside it (i % 32) * 16 + (i % 128 // 32) * 4 + j % 4.
    c4 = _round_up(kblocks, 4)
    i = torch.arange(rows).reshape(-1, 1)
    j = torch.arange(kblocks).reshape(1, -1)
    at = ((i // 128) * (c4 // 4) + j // 4) * 512 + (i % 32) * 16 + (i % 128 // 32) * 4 + j % 4
    return flat.flatten()[at]


Unswizzle = Callable[[torch.Tensor, int, int], torch.Tensor]


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int]:
    if a.dtype != torch.float4_e2m1fn_x2 or b.dtype != torch.float4_e2m1fn_x2:
        refuse(f"float4_e2m1fn_x2 operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        refuse(f"a [M, K/2] and b [K/2, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    (m, kh), n = a.shape, b.shape[1]
    if not (a.stride(1) == 1 and a.stride(0) > 1) or not (b.stride(0) == 1 and b.stride(1) > 1):
        refuse(f"a row-major, b column-major, got strides {a.stride()} and {b.stride()}")
    if (2 * kh) % 16 or n % 16:
        refuse(f"K and N multiples of 16, got K = {2 * kh}, N = {n}")
    # cuBLASLt: 16-byte aligned rows and base pointers.
    if a.stride(0) % 16 or b.stride(1) % 16 or a.storage_offset() % 16 or b.storage_offset() % 16:
        refuse("16-byte aligned operand rows")
    return m, 2 * kh, n


def _scale(
    s: torch.Tensor, dtype: torch.dtype, rows: int, kblocks: int, read: Unswizzle
) -> torch.Tensor:
    want = _round_up(rows, 128) * _round_up(kblocks, 4)
    if s.dtype != dtype or s.numel() != want or not s.is_contiguous():
        refuse(f"a {dtype} scale of {want} contiguous bytes, got {s.dtype} {s.numel()}")
    return read(s.view(torch.uint8), rows, kblocks).view(dtype).float()


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _recipe(
    scale_a: Any, recipe_a: Any, swizzle_a: Any, scale_b: Any, recipe_b: Any, swizzle_b: Any
) -> tuple[str, list[Any], list[Any]]:
    sa, sb = _as_list(scale_a), _as_list(scale_b)
    ra, rb = _as_list(recipe_a), _as_list(recipe_b)
    wa, wb = _as_list(swizzle_a), _as_list(swizzle_b)
    nv2 = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    if ra == rb == nv2 and len(sa) == len(sb) == 2:
        fmt = "nvfp4"
        for g in (sa[1], sb[1]):
            if g.dtype != torch.float32 or g.numel() != 1:
                refuse(f"a float32 global scale of one element, got {g.dtype} {g.numel()}")
        if len(wa) != 2 or len(wb) != 2:  # check_swizzle_lengths: NVFP4_NVFP4 takes 2
            refuse(f"two swizzle values a side, got {len(wa)} and {len(wb)}")
    elif ra == rb == [F.ScalingType.BlockWise1x32] and len(sa) == len(sb) == 1:
        fmt = "mxfp4"
        if len(wa) != 1 or len(wb) != 1:
            refuse(f"one swizzle value a side, got {len(wa)} and {len(wb)}")
    else:
        refuse(f"an FP4 recipe, got {ra} and {rb}")
    if wa[0] != F.SwizzleType.SWIZZLE_32_4_4 or wb[0] != F.SwizzleType.SWIZZLE_32_4_4:
        refuse(f"SWIZZLE_32_4_4 block scales, got {wa[0]} and {wb[0]}")
    return fmt, sa, sb


class StandIn:
    """``F.scaled_mm`` as CUDA's FP4 path checks it; ``calls`` records each call's recipe and
    padded ``M x K x N``; ``drop_alpha`` models a torch that ignores the global scales and
    ``read_scales`` a GPU reading them in some layout (the swizzled one)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.drop_alpha = False
        self.read_scales: Unswizzle = unswizzle

    def __call__(
        self,
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        scale_a: Any,
        recipe_a: Any,
        scale_b: Any,
        recipe_b: Any,
        swizzle_a: Any = None,
        swizzle_b: Any = None,
        bias: torch.Tensor | None = None,
        output_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        m, k, n = _check_operands(mat_a, mat_b)
        fmt, sa, sb = _recipe(scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b)
        if output_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            refuse(f"a bf16, fp16 or fp32 result, got {output_dtype}")
        if bias is not None and (output_dtype == torch.float32 or bias.dtype != output_dtype):
            refuse(f"a bias of the 16-bit result's dtype, got {bias.dtype} for {output_dtype}")
        if bias is not None and fmt == "mxfp4":
            refuse("a bias on the MXFP4 path (torch's f4f4bf16 is not handed it)")
        width = 16 if fmt == "nvfp4" else 32
        dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
        da, db = decode_codes(mat_a, m, k), decode_codes(mat_b.t(), n, k)
        kb_ = k // width
        s_a = _scale(sa[0], dtype, m, kb_, self.read_scales)
        s_b = _scale(sb[0], dtype, n, kb_, self.read_scales)
        acc = torch.zeros(m, n, dtype=torch.float32)
        for kb in range(kb_):  # the twin's order: exact block terms, added in K order
            sl = slice(kb * width, (kb + 1) * width)
            part = (da[:, sl] @ db[:, sl].t()).float()
            acc = acc + part * (s_a[:, kb : kb + 1] * s_b[:, kb].reshape(1, -1))
        if fmt == "nvfp4" and not self.drop_alpha:
            acc = acc * (sa[1].float() * sb[1].float()).reshape(())
        if bias is not None:
            acc = acc + bias.float()
        self.calls.append(f"{fmt} {m}x{k}x{n}")
        return acc.to(output_dtype)


def forget_probes() -> None:
    cublas_fp4._VERDICTS.clear()
    fp4_backend._no_kernels.cache_clear()
    fp4_backend._CUBLAS_RUNS.clear()


@pytest.fixture
def cuda_fp4(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    stand_in = StandIn()
    monkeypatch.setattr(F, "scaled_mm", stand_in)
    forget_probes()
    yield stand_in
    forget_probes()


def torchs_to_blocked() -> Callable[[torch.Tensor], torch.Tensor]:
    # torch's own to_blocked (and its ceil_div), read from the installed source: importing
    # common_quantized needs expecttest, which this environment lacks.
    path = Path(torch.__file__).parent / "testing/_internal/common_quantized.py"
    tree = ast.parse(path.read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name in ("ceil_div", "to_blocked")]  # fmt: skip
    space: dict[str, Any] = {"torch": torch}
    module = ast.Module(body=list[ast.stmt](wanted), type_ignores=[])
    exec(compile(module, str(path), "exec"), space)
    fn: Callable[[torch.Tensor], torch.Tensor] = space["to_blocked"]
    return fn


def test_the_stand_ins_scale_reading_inverts_torchs_to_blocked() -> None:
    to_blocked = torchs_to_blocked()
    gen = torch.Generator().manual_seed(0)
    for rows, cols in [(1, 1), (130, 5), (256, 12), (37, 3)]:
        s = torch.randint(0, 255, (rows, cols), generator=gen, dtype=torch.uint8)
        assert torch.equal(unswizzle(to_blocked(s), rows, cols), s)


def operands(m: int, n: int, k: int, how: Fp4Quant, seed: int) -> tuple[Fp4Operand, Fp4Operand]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k).reshape(1, -1)
    x[:, :16] = 0.0  # a zero block
    x[0, 16:48] = 1e-30  # blocks whose values underflow
    w = torch.randn(n, k, generator=gen).bfloat16()
    qa = fp4_gemm.quantize_rows(x.bfloat16(), how)
    return qa, fp4_gemm.quantize_rows(w, how, weight=True)


def launch(qa: Fp4Operand, qb: Fp4Operand, bias: Any, out: torch.dtype) -> torch.Tensor:
    alpha = None
    tiles = ["1x32", "1x32"]
    if isinstance(qa, Nvfp4Operand) and isinstance(qb, Nvfp4Operand):
        alpha = fp4_gemm.tensor_scale_alpha(qa.amax, qb.amax).reshape(1)
        tiles = [qa.tile, qb.tile]
    return cublas_fp4.fp4_scaled_mm(
        a=qa.codes, scale_a=qa.scale, tile_a=tiles[0], b=qb.codes, scale_b=qb.scale,
        tile_b=tiles[1], alpha=alpha, bias=bias, out_dtype=out,
    )  # fmt: skip


HOWS = {
    "nvfp4 1x16": Fp4Quant(format="nvfp4", weight_tile="1x16"),
    "nvfp4 16x16": Fp4Quant(format="nvfp4", weight_tile="16x16"),
    "mxfp4 floor": Fp4Quant(format="mxfp4", mx_rounding="floor"),
    "mxfp4 rceil": Fp4Quant(format="mxfp4", mx_rounding="rceil"),
}


@pytest.mark.parametrize("name", list(HOWS))
@pytest.mark.parametrize(("m", "n", "k", "bias_dtype", "out"), [
    (1, 48, 96, None, torch.bfloat16),  # M = 1, K not a multiple of 64
    (37, 144, 160, torch.bfloat16, torch.bfloat16),  # N not a multiple of 128, a fused bias
    (130, 32, 64, torch.float32, torch.float32),  # a bias added after a float32 GEMM
    (5, 16, 224, torch.float16, torch.float16),
])  # fmt: skip
def test_the_launcher_is_the_twin_bit_for_bit_under_cudas_rules(
    cuda_fp4: StandIn,
    name: str,
    m: int,
    n: int,
    k: int,
    bias_dtype: torch.dtype | None,
    out: torch.dtype,
) -> None:
    how = HOWS[name]
    qa, qb = operands(m, n, k, how, seed=m + k)
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    got = launch(qa, qb, bias, out)
    assert got.shape == (m, n) and got.dtype == out and got.is_contiguous()
    assert torch.equal(got, fp4_gemm.reference_fp4_mm(qa, qb, out, bias))
    # K padded to whole scale tiles (64 / 128 elements), N to 16; M as it is.
    tile = 4 * how.block
    assert cuda_fp4.calls[-1] == f"{how.format} {m}x{_round_up(k, tile)}x{_round_up(n, 16)}"


def test_a_transposed_or_offset_operand_is_copied_row_major(cuda_fp4: StandIn) -> None:
    how = HOWS["nvfp4 1x16"]
    qa, qb = operands(32, 32, 64, how, seed=3)
    assert isinstance(qa, Nvfp4Operand) and isinstance(qb, Nvfp4Operand)
    # The same codes through a transposed-back view, and at a byte offset.
    bt = qb.codes.view(torch.uint8).t().contiguous().t().view(torch.float4_e2m1fn_x2)
    shifted = torch.empty(32 * 32 + 1, dtype=torch.uint8)[1:].view(32, 32)
    shifted.copy_(qa.codes.view(torch.uint8))
    qa2 = Nvfp4Operand(shifted.view(torch.float4_e2m1fn_x2), qa.scale, qa.amax, qa.tile)
    qb2 = Nvfp4Operand(bt, qb.scale, qb.amax, qb.tile)
    got = launch(qa2, qb2, None, torch.float32)
    assert torch.equal(got, fp4_gemm.reference_fp4_mm(qa, qb, torch.float32))


class _Made(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Counts the float32 ``(1,)`` tensors made by ``torch.ones`` (NVFP4's unit scale: a fill
    launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func is torch.ops.aten.ones.default
        return func(*args, **(kwargs or {}))


def test_the_nvfp4_unit_scale_is_made_once_per_device(
    cuda_fp4: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One torch.ones per GEMM before; kept per device now, but never while a graph is captured.
    monkeypatch.setattr(cublas_fp4, "_UNIT_SCALES", {})
    qa, qb = operands(16, 32, 64, HOWS["nvfp4 1x16"], seed=6)
    first = launch(qa, qb, None, torch.bfloat16)
    with _Made() as made:
        again = launch(qa, qb, None, torch.bfloat16)
    assert made.count == 0 and torch.equal(first, again)
    monkeypatch.setattr(cublas_fp4, "_capturing", lambda device: True)
    with _Made() as made:
        launch(qa, qb, None, torch.bfloat16)
    assert made.count == 1 and list(cublas_fp4._UNIT_SCALES) == [torch.device("cpu")]


def test_the_probe_passes_the_stand_in_and_catches_a_dropped_alpha(cuda_fp4: StandIn) -> None:
    cpu = torch.device("cpu")
    found = cublas_fp4.fp4_recipes(cpu)
    assert all(runs for runs, _ in found.values()), found
    forget_probes()
    cuda_fp4.drop_alpha = True  # a torch that ignores NVFP4's global scales
    found = cublas_fp4.fp4_recipes(cpu)
    assert found["nvfp4"] == (False, f"torch.nn.functional.scaled_mm runs nvfp4 on {cpu} but "
                              "gave a wrong product")  # fmt: skip
    assert found["mxfp4"][0]


def test_the_probe_catches_unswizzled_scales(cuda_fp4: StandIn) -> None:
    # A GPU reading the scales row-major (no swizzle): the probe's varied scales see it.
    def row_major(flat: torch.Tensor, rows: int, kblocks: int) -> torch.Tensor:
        return flat.flatten().reshape(-1, _round_up(kblocks, 4))[:rows, :kblocks]

    cuda_fp4.read_scales = row_major
    found = cublas_fp4.fp4_recipes(torch.device("cpu"))
    assert not found["nvfp4"][0] and "wrong product" in found["nvfp4"][1]
    assert not found["mxfp4"][0] and "wrong product" in found["mxfp4"][1]


# ----- backend selection ------------------------------------------------------------------


@pytest.fixture
def blackwell(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, tuple[bool, str]]]:
    """A CUDA device reported as compute capability 10.0 with triton; the probe's answer is
    the dict the test fills (both recipes refused until it does)."""
    answer = {"nvfp4": (False, "refused (nvfp4)"), "mxfp4": (False, "refused (mxfp4)")}
    probe = capability.Probe(True, "B200 has compute capability 10.0 >= 10.0")
    monkeypatch.setattr(fp4_backend, "fp4_tensor_cores", lambda dev: probe)
    monkeypatch.setattr(capability, "triton_available", lambda: capability.Probe(True, "ok"))
    monkeypatch.setattr(cublas_fp4, "fp4_recipes", lambda dev: answer)
    forget_probes()
    yield answer
    forget_probes()


def test_a_hopper_gpu_is_emulated_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    why = "NVIDIA H100 has compute capability 9.0 < 10.0: no FP4 tensor cores"
    monkeypatch.setattr(fp4_backend, "fp4_tensor_cores", lambda dev: capability.Probe(False, why))
    forget_probes()
    try:
        backend, reason = ops.select_fp4_backend("cuda:0")
        assert backend == ops.EMULATED
        assert why in reason and "never an 8-bit fallback" in reason
        refused = "the 4-bit backend 'cublas' cannot run on cuda:0: " + why
        got = fp4_backend.cublas_refusal(torch.device("cuda:0"))
        assert got == refused + " (an H100/H200 has none)"
    finally:
        forget_probes()


def test_a_blackwell_gpu_runs_cublas_where_the_probe_passes_else_triton(
    blackwell: dict[str, tuple[bool, str]],
) -> None:
    backend, reason = ops.select_fp4_backend("cuda:0")
    assert backend == ops.TRITON and "refused (nvfp4)" in reason and "refused (mxfp4)" in reason
    blackwell["nvfp4"] = (True, "runs")
    backend, reason = ops.select_fp4_backend("cuda:0")
    assert backend == ops.CUBLAS and reason.startswith("cublas: B200")


def test_a_device_cublas_runs_on_is_not_probed_again_per_call(
    blackwell: dict[str, tuple[bool, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every operator call on "cublas" asks cublas_refusal: a yes is kept per device (the
    # probes were read on every call before); a no is asked again.
    reads: list[torch.device] = []
    answer = dict(blackwell)

    def recipes(dev: torch.device) -> dict[str, tuple[bool, str]]:
        reads.append(dev)
        return answer

    monkeypatch.setattr(cublas_fp4, "fp4_recipes", recipes)
    dev = torch.device("cuda", 0)
    assert fp4_backend.cublas_refusal(dev) is not None
    assert fp4_backend.cublas_refusal(dev) is not None and len(reads) == 2
    answer["mxfp4"] = (True, "runs")
    assert fp4_backend.cublas_refusal(dev) is None
    assert fp4_backend.cublas_refusal(dev) is None and len(reads) == 3


def test_forcing_cublas_where_it_cannot_run_names_the_device_and_why(
    data_cpu: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, _ = data_cpu
    signs = list(Fp4Quant().signs)
    with pytest.raises(ValueError, match=r"backend 'cublas' cannot run on cpu: cpu is not a GPU"):
        ops.fp4_quantize(x, "nvfp4", "1x16", "rceil", False, False, signs, None, ops.CUBLAS)
    with pytest.raises(ValueError, match=r"unknown 4-bit backend 'fp8'; accepted: emulated, "
                       "triton, cublas"):  # fmt: skip
        ops.fp4_quantize(x, "nvfp4", "1x16", "rceil", False, False, signs, None, "fp8")


@pytest.fixture
def data_cpu() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen)


def _op_args(qa: Fp4Operand, qb: Fp4Operand) -> list[object]:
    args: list[object] = []
    for q in (qa, qb):
        if isinstance(q, Nvfp4Operand):
            args += [q.codes, q.scale, q.amax.reshape(1), q.tile]
        else:
            args += [q.codes, q.scale, None, "1x32"]
    return args


@pytest.mark.parametrize("name", ["nvfp4 16x16", "mxfp4 rceil"])
def test_the_operator_on_cublas_is_the_emulated_operator(
    cuda_fp4: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    data_cpu: tuple[torch.Tensor, torch.Tensor],
    name: str,
) -> None:
    # The wiring: backend "cublas" where it runs (the refusal answered None) takes the cuBLAS
    # call for the dense GEMM, and the result is the emulated operator's.
    monkeypatch.setattr(fp4_backend, "cublas_refusal", lambda dev: None)
    x, w = data_cpu
    how = HOWS[name]
    qa, qb = fp4_gemm.quantize_rows(x, how), fp4_gemm.quantize_rows(w, how, weight=True)
    bias = torch.randn(48).bfloat16()
    got = ops.fp4_scaled_mm(*_op_args(qa, qb), bias, torch.bfloat16, ops.CUBLAS)
    assert cuda_fp4.calls[-1].startswith(HOWS[name].format)
    want = ops.fp4_scaled_mm(*_op_args(qa, qb), bias, torch.bfloat16, ops.EMULATED)
    assert torch.equal(got, want)


def test_a_recipe_cublas_does_not_run_takes_the_triton_kernel(
    cuda_fp4: StandIn, monkeypatch: pytest.MonkeyPatch, data_cpu: tuple[torch.Tensor, torch.Tensor]
) -> None:
    from computectx.kernels import fp4_gemm as kernel

    monkeypatch.setattr(fp4_backend, "cublas_refusal", lambda dev: None)
    monkeypatch.setattr(cublas_fp4, "serves", lambda scale, bias, out: False)
    ran: list[str] = []

    def fake(**_: object) -> torch.Tensor:
        ran.append("triton")
        return torch.zeros(32, 48)

    monkeypatch.setattr(kernel, "fp4_scaled_mm", fake)
    x, w = data_cpu
    how = HOWS["mxfp4 floor"]
    qa, qb = fp4_gemm.quantize_rows(x, how), fp4_gemm.quantize_rows(w, how, weight=True)
    ops.fp4_scaled_mm(*_op_args(qa, qb), None, torch.float32, ops.CUBLAS)
    assert ran == ["triton"] and not cuda_fp4.calls


class RefusesABias(StandIn):
    """A torch whose FP4 path refuses any bias (or, with ``drop``, ignores it)."""

    def __init__(self, drop: bool = False) -> None:
        super().__init__()
        self.drop = drop

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("bias") is not None:
            if not self.drop:
                refuse("a bias on the FP4 path")
            kwargs["bias"] = None
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("name", ["nvfp4 16x16", "mxfp4 rceil"])
def test_no_4bit_call_fuses_a_bias(monkeypatch: pytest.MonkeyPatch, name: str, drop: bool) -> None:
    # The bias is added in float32 after a float32 GEMM, one rounding (the twin's epilogue, in
    # our code): a torch refusing or dropping a fused bias, which the probe (no bias) cannot
    # see, changes nothing. Failed before: NVFP4 handed a bf16 bias to a bf16 GEMM.
    monkeypatch.setattr(F, "scaled_mm", RefusesABias(drop))
    for out in (torch.bfloat16, torch.float16):
        assert cublas_fp4.fp4_gemm_dtype(HOWS[name].format, torch.zeros(2), out) == torch.float32
        assert cublas_fp4.fp4_gemm_dtype(HOWS[name].format, None, out) == out
        qa, qb = operands(3, 32, 64, HOWS[name], seed=9)
        bias = (torch.randn(32) * 100).to(out)
        got = launch(qa, qb, bias, out)
        assert got.dtype == out and torch.equal(got, fp4_gemm.reference_fp4_mm(qa, qb, out, bias))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 48, 96), (37, 144, 160), (256, 256, 256)])
def test_the_nvfp4_call_passes_torchs_own_meta_check(m: int, n: int, k: int) -> None:
    # torch 2.13's meta function of _scaled_mm_v2 (_check_scaled_mm_sizes_v2, is_nv) states
    # the shapes, scale sizes and swizzles its CUDA build takes; the launcher's call, run on
    # meta tensors with the real F.scaled_mm, passes it. (Its MXFP4 branch counts K blocks of
    # the packed K, half the CUDA kernel's _scaled_mxfp4_mxfp4 count, so it is not held here.)
    meta = torch.device("meta")
    a = torch.empty(m, k // 2, dtype=torch.float4_e2m1fn_x2, device=meta)
    b = torch.empty(n, k // 2, dtype=torch.float4_e2m1fn_x2, device=meta)
    sa = torch.empty(m, k // 16, dtype=torch.float8_e4m3fn, device=meta)
    sb = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device=meta)
    alpha = torch.empty(1, device=meta)
    half = torch.empty(n, dtype=torch.float16, device=meta)
    cases = [(None, torch.bfloat16), (torch.empty(n, device=meta), torch.float32)]
    for bias, out in [*cases, (half, torch.float16)]:
        got = cublas_fp4.fp4_scaled_mm(
            a=a, scale_a=sa, tile_a="1x16", b=b, scale_b=sb, tile_b="1x16", alpha=alpha,
            bias=bias, out_dtype=out,
        )  # fmt: skip
        assert got.shape == (m, n) and got.dtype == out


# ----- the probe's verdicts (the adversarial review of the backend) --------------------------


class Wrong(StandIn):
    """A torch whose FP4 path returns float32 (``dtype``), raises ``raise_`` for the first
    ``times`` calls, or records the devices it was asked for."""

    def __init__(self, raise_: BaseException | None = None, times: int = 1 << 30) -> None:
        super().__init__()
        self.raise_, self.times, self.float32 = raise_, times, False

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.raise_ is not None and self.times > 0:
            self.times -= 1
            raise self.raise_
        out = super().__call__(*args, **kwargs)
        return out.float() if self.float32 else out


def test_the_probe_refuses_a_result_of_another_dtype(cuda_fp4: StandIn) -> None:
    # torch.equal compares values across dtypes: a float32 result for bf16 passed before.
    wrong = Wrong()
    wrong.float32 = True
    F.scaled_mm = wrong  # the fixture restores it
    found = cublas_fp4.fp4_recipes(torch.device("cpu"))
    api = "torch.nn.functional.scaled_mm"
    for fmt in ("nvfp4", "mxfp4"):
        assert found[fmt] == (False, f"{api} runs {fmt} on cpu but gave torch.float32 for "
                              "torch.bfloat16")  # fmt: skip


def test_any_exception_of_the_probe_is_a_verdict_naming_it(cuda_fp4: StandIn) -> None:
    # An IndexError (torch's TORCH_CHECK_INDEX) escaped the probe before; a BaseException
    # (an interrupt) is never swallowed.
    F.scaled_mm = Wrong(IndexError("Dimension out of range"))
    found = cublas_fp4.fp4_recipes(torch.device("cpu"))
    for fmt in ("nvfp4", "mxfp4"):
        runs, why = found[fmt]
        assert not runs and why.endswith(f"{fmt} on cpu: IndexError: Dimension out of range")
    forget_probes()
    F.scaled_mm = Wrong(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        cublas_fp4.fp4_recipes(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only torch's refusal")
def test_fp4_cublas_recipes_answers_for_a_device_torch_cannot_run_on() -> None:
    # NVFP4's alpha was built on the device before the probe's try: AssertionError escaped.
    forget_probes()
    try:
        for dev in ("cuda:0", "mps"):
            found = fp4_backend.fp4_cublas_recipes(dev)
            assert set(found) == {"nvfp4", "mxfp4"}
            for fmt, (runs, why) in found.items():
                assert not runs and f"refuses {fmt} on {dev}: " in why and len(why) < 300
    finally:
        forget_probes()


def test_an_out_of_memory_probe_is_not_kept(cuda_fp4: StandIn) -> None:
    F.scaled_mm = Wrong(torch.OutOfMemoryError("CUDA out of memory."), times=2)
    found = cublas_fp4.fp4_recipes(torch.device("cpu"))
    for fmt in ("nvfp4", "mxfp4"):
        assert not found[fmt][0] and "not kept: probed again on the next call" in found[fmt][1]
    assert not cublas_fp4._VERDICTS
    assert all(runs for runs, _ in cublas_fp4.fp4_recipes(torch.device("cpu")).values())


def test_no_probe_runs_while_a_cuda_graph_is_captured(
    cuda_fp4: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    found = cublas_fp4.fp4_recipes(torch.device("cuda", 0))
    for runs, why in found.values():
        assert not runs and "not probed while a CUDA graph is captured" in why
    assert not cublas_fp4._VERDICTS and not cuda_fp4.calls


def test_a_bare_cuda_device_is_probed_and_kept_as_the_current_one(
    cuda_fp4: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On this CPU-only torch the probe's tensors cannot be built on CUDA: a "no", kept under
    # the current device's index (it was kept under "cuda" before, whatever device was current).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    found = fp4_backend.fp4_cublas_recipes("cuda")
    assert all(" on cuda:1: " in why for _, why in found.values()), found
    assert {key[0] for key in cublas_fp4._VERDICTS} == {torch.device("cuda", 1)}


def test_the_probe_takes_every_padding_of_the_launcher(cuda_fp4: StandIn) -> None:
    # M and N ragged for the 128-row scale tiles, N (not a multiple of 16) padded to 16, K to
    # whole scale tiles; N was 144 before, a multiple of 16.
    m, n, k = cublas_fp4._PROBE_SHAPE
    assert m % 128 and n % 128 and n % 16 and k % 64 and k % 128
    cublas_fp4.fp4_recipes(torch.device("cpu"))
    assert cuda_fp4.calls == [f"nvfp4 {m}x192x{_round_up(n, 16)}", f"mxfp4 {m}x256x{n + 8}"]


def test_a_strided_bias_reaches_cublas_contiguous() -> None:
    from computectx.kernels import cublas

    bias = torch.randn(64).bfloat16()[::2]
    fused = cublas.cublas_bias(bias, torch.bfloat16, 32)
    assert fused is not None and fused.is_contiguous() and torch.equal(fused, bias)


# ----- the operands' checks and empty products, one behaviour on every backend -----------


def _cut(q: Fp4Operand, codes: torch.Tensor, scale: torch.Tensor) -> Fp4Operand:
    if isinstance(q, Nvfp4Operand):
        return Nvfp4Operand(codes, scale, q.amax, q.tile)
    return Mxfp4Operand(codes, scale)


def _on_every_backend(
    qa: Fp4Operand, qb: Fp4Operand, monkeypatch: pytest.MonkeyPatch
) -> list[torch.Tensor | Exception]:
    # The public entry on the emulated backend (this CPU), then the operator on 'cublas'.
    got: list[torch.Tensor | Exception] = []
    for run in ("entry", "cublas"):
        try:
            if run == "entry":
                got.append(ops.scaled_mm(qa, qb, torch.bfloat16))
            else:
                monkeypatch.setattr(fp4_backend, "cublas_refusal", lambda dev: None)
                args = _op_args(qa, qb)
                got.append(ops.fp4_scaled_mm(*args, None, torch.bfloat16, ops.CUBLAS))
        except ValueError as e:
            got.append(e)
    return got


@pytest.mark.parametrize("name", ["nvfp4 1x16", "nvfp4 16x16", "mxfp4 rceil"])
def test_a_scale_that_does_not_fit_its_codes_is_refused_on_every_backend(
    cuda_fp4: StandIn, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Before: 'cublas' read a missing row's scale as 1.0; 'emulated' raised torch's reshape
    # error.
    qa, qb = operands(32, 32, 96, HOWS[name], seed=4)
    one_more = torch.cat([qb.scale, qb.scale[:, :1]], dim=1)
    for bad, which in [
        (_cut(qa, qa.codes, qa.scale[:-1]), "a"),
        (_cut(qb, qb.codes, one_more), "b"),
    ]:
        pair = (bad, qb) if which == "a" else (qa, bad)
        got = _on_every_backend(*pair, monkeypatch)
        want = tuple(pair[which == "b"].scale.shape)
        for e in got:
            assert isinstance(e, ValueError), e
            assert f"{which}'s scale" in str(e) and f"got {bad.scale.dtype} {want}" in str(e)
        assert str(got[0]) == str(got[1]) and not cuda_fp4.calls


def test_the_entry_checks_each_scale_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # check_gemm and the operator both checked both scales before (4 checks a GEMM).
    checked: list[str] = []
    real = fp4_backend.check_scale

    def counted(codes: torch.Tensor, scale: torch.Tensor, tile: str, who: str) -> None:
        checked.append(who)
        real(codes, scale, tile, who)

    monkeypatch.setattr(fp4_backend, "check_scale", counted)
    monkeypatch.setattr(ops, "check_scale", counted)
    qa, qb = operands(16, 32, 64, HOWS["nvfp4 1x16"], seed=7)
    ops.scaled_mm(qa, qb, torch.bfloat16)
    assert checked == ["a", "b"]
    flat = _cut(qa, qa.codes.reshape(-1), qa.scale)  # named by the operator, bias or not
    with pytest.raises(ValueError, match=r"a must be 2-D, got codes of shape \(512,\)"):
        ops.scaled_mm(flat, qb, torch.bfloat16, torch.zeros(32))


@pytest.mark.parametrize("name", ["nvfp4 1x16", "mxfp4 rceil"])
def test_an_empty_product_is_empty_on_every_backend_and_k_0_is_refused(
    cuda_fp4: StandIn, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    qa, qb = operands(16, 32, 64, HOWS[name], seed=5)
    for pair, shape in [((_cut(qa, qa.codes[:0], qa.scale[:0]), qb), (0, 32)),
                        ((qa, _cut(qb, qb.codes[:0], qb.scale[:0])), (16, 0))]:  # fmt: skip
        for y in _on_every_backend(*pair, monkeypatch):
            assert isinstance(y, torch.Tensor) and y.shape == shape and y.dtype == torch.bfloat16
    k0 = (_cut(qa, qa.codes[:, :0], qa.scale[:, :0]), _cut(qb, qb.codes[:, :0], qb.scale[:, :0]))
    for e in _on_every_backend(*k0, monkeypatch):
        assert isinstance(e, ValueError) and "K > 0" in str(e) and "(16, 0)" in str(e)
    assert not cuda_fp4.calls


@pytest.mark.parametrize("how", [HOWS["nvfp4 16x16"], HOWS["mxfp4 rceil"]])
def test_quantize_takes_0_rows_and_refuses_k_0(how: Fp4Quant) -> None:
    for weight in (False, True):
        q = ops.quantize(torch.zeros(0, 64), how, weight=weight)
        assert q.codes.shape == (0, 32) and q.scale.shape == (0, 64 // how.block)
    q = ops.quantize(torch.zeros(64, 0), how, columnwise=True)  # 0 rows of x.t()
    assert q.codes.shape == (0, 32) and q.scale.shape == (0, 64 // how.block)
    if isinstance(q, Nvfp4Operand):
        assert float(q.amax) == 0.0
    for x, columnwise in [(torch.zeros(4, 0), False), (torch.zeros(0, 16), True)]:
        with pytest.raises(ValueError, match=r"K \(dimension [01]\) > 0 and .*got shape \((4|0), "):
            ops.quantize(x, how, columnwise=columnwise)
