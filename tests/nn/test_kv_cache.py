"""KVCache: fp8 codes plus float32 steps, the byte count, the quantizer's bounds, the static
schemes' steps, writes by position, and the errors of a cache read under another policy."""

from __future__ import annotations

import math
import re

import pytest
import torch

from computectx import ComputeCtx, DType, Fp8Format, KvFp8, PromotionError
from computectx.formats import Backend
from computectx.formats.numerics.kv_quant import dequantize_kv, quantize_kv, static_kv_steps
from computectx.nn import Attention, KVCache, kv_bytes_per_token

CPU = torch.device("cpu")
F32 = ComputeCtx.parity(CPU)
PTH = F32.with_kv(KvFp8())
PER_HEAD = F32.with_kv(KvFp8(scaling="per_head"))
PER_TENSOR = F32.with_kv(KvFp8(scaling="per_tensor"))
H, D = 2, 16


def _steps(shape: tuple[int, ...], value: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full(shape, value), torch.full(shape, 2 * value)


@pytest.mark.parametrize(
    ("kv", "codes", "step_shape", "fixed_step_bytes"),
    [
        (KvFp8(), torch.float8_e4m3fn, (3, H, 8), 0),
        (KvFp8(format=Fp8Format.E5M2), torch.float8_e5m2, (3, H, 8), 0),
        (KvFp8(scaling="per_head"), torch.float8_e4m3fn, (H,), 2 * H * 4),
        (KvFp8(scaling="per_tensor"), torch.float8_e4m3fn, (1,), 2 * 4),
    ],
)
def test_fp8_layout_and_bytes(
    kv: KvFp8, codes: torch.dtype, step_shape: tuple[int, ...], fixed_step_bytes: int
) -> None:
    ctx = F32.with_kv(kv)
    steps = _steps(step_shape) if kv.static else None
    cache = KVCache(ctx, batch=3, n_heads=H, head_dim=D, max_len=8, steps=steps)
    assert cache.k.shape == cache.v.shape == (3, H, 8, D)
    assert cache.k.dtype == cache.v.dtype == codes == cache.dtype
    assert cache.k_step is not None and cache.v_step is not None
    assert cache.k_step.shape == cache.v_step.shape == step_shape
    assert cache.k_step.dtype == torch.float32 and cache.fp8 == kv and cache.backend is not None
    # Codes: one byte per element; per_token_head adds one float32 step per (token, head)
    # for keys and one for values; the static steps are a fixed cost per layer.
    per_token = 2 * H * D + (2 * H * 4 if kv.scaling == "per_token_head" else 0)
    assert cache.bytes_per_token == per_token == kv_bytes_per_token(kv, H, D)
    assert cache.nbytes == 3 * 8 * per_token + fixed_step_bytes


def test_bytes_per_token_against_the_dtype_caches() -> None:
    # The figure docs/serving.md gives: at H=4, D=64, fp8 per_token_head is half of bf16 plus
    # 4 bytes of steps per head for keys and 4 for values.
    bf16, f32 = kv_bytes_per_token(DType.BF16, 4, 64), kv_bytes_per_token(DType.F32, 4, 64)
    assert (bf16, f32) == (1024, 2048)
    assert kv_bytes_per_token(KvFp8(), 4, 64) == bf16 // 2 + 2 * 4 * 4 == 544
    assert kv_bytes_per_token(KvFp8(scaling="per_head"), 4, 64) == bf16 // 2
    cache = KVCache(ComputeCtx.new(DType.BF16, CPU), 2, 4, 64, 8)
    assert cache.bytes_per_token == bf16 and cache.nbytes == 2 * 8 * bf16
    assert cache.k_step is None and cache.fp8 is None and cache.backend is None


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_per_token_head_round_trip_is_within_half_a_code_step(fmt: Fp8Format) -> None:
    g = torch.Generator().manual_seed(0)
    # Every (token, head) vector at its own magnitude, 1e-3 .. 1e3.
    scale = torch.pow(10.0, torch.empty(2, H, 12, 1).uniform_(-3, 3, generator=g))
    x = torch.randn(2, H, 12, D, generator=g) * scale
    codes, step = quantize_kv(x, fmt)
    assert codes.dtype == fmt.torch and step.shape == (2, H, 12)
    amax = x.abs().amax(dim=-1)
    torch.testing.assert_close(step, amax / fmt.max, rtol=0, atol=0)
    # The largest element of every vector lands on +-fmt.max: the whole range, no saturation.
    assert torch.equal(codes.float().abs().amax(dim=-1), torch.full_like(amax, fmt.max))
    back = dequantize_kv(codes, step)
    # Rounding to fp8 costs at most half an ulp: 2**-(m+1) relative in the normal range,
    # half the smallest subnormal (times the step) below it; the float32 division and
    # product add a few float32 ulps.
    half_ulp = x.abs() * 2.0 ** -(fmt.mantissa_bits + 1)
    floor = step.unsqueeze(-1) * fmt.min_subnormal / 2
    bound = torch.maximum(half_ulp, floor) * (1 + 2.0**-20) + x.abs() * 2.0**-22
    assert bool(((back - x).abs() <= bound).all())


def test_edge_vectors_never_give_a_nan_step() -> None:
    x = torch.randn(1, 1, 6, D)
    x[0, 0, 0] = 0.0  # all zero
    x[0, 0, 1] = 1e-44  # amax / 448 underflows float32
    x[0, 0, 2, 3] = math.inf
    x[0, 0, 3, 5] = math.nan
    x[0, 0, 4] = -3.0e38  # near float32's max
    codes, step = quantize_kv(x, Fp8Format.E4M3)
    assert bool((torch.isfinite(step) & (step > 0)).all()), step
    back = dequantize_kv(codes, step)
    assert bool((back[0, 0, 0] == 0).all()) and bool(torch.isfinite(back[0, 0, 1]).all())
    assert bool(back[0, 0, 1].abs().max() <= 1e-44)
    # A non-finite input shows as NaN (never a saturated finite value), like an f32 cache.
    assert bool(back[0, 0, 2, 3].isnan()) and bool(back[0, 0, 3, 5].isnan())
    torch.testing.assert_close(back[0, 0, 4], x[0, 0, 4], rtol=2.0**-4, atol=0)
    clean = dequantize_kv(*quantize_kv(x[:, :, 5:], Fp8Format.E4M3))
    assert torch.equal(back[:, :, 5:], clean)  # the other vectors are untouched


@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_element_leaves_its_vectors_finite_values_alone(
    fmt: Fp8Format, bad: float
) -> None:
    # The step comes from the finite entries' amax: the vector reads back as the same vector
    # with the bad element zeroed, except that element, which reads back as NaN.
    x = torch.tensor([bad, 1000.0, 0.001, 3.0, -7.5, 0.25, 12.0, -0.5]).view(1, 1, 1, 8)
    codes, step = quantize_kv(x, fmt)
    zeroed = x.clone()
    zeroed[..., 0] = 0.0
    want_codes, want_step = quantize_kv(zeroed, fmt)
    assert torch.equal(step, want_step)
    assert torch.equal(step.flatten(), torch.tensor([1000.0]) / fmt.max)  # float32 quotient
    back, want = dequantize_kv(codes, step), dequantize_kv(want_codes, want_step)
    assert bool(back[..., 0].isnan()) and torch.equal(back[..., 1:], want[..., 1:])
    # Every element non-finite: nothing finite to take an amax of, the step is 1.0.
    codes, step = quantize_kv(torch.full((1, 1, 1, 4), bad), fmt)
    assert float(step) == 1.0 and bool(dequantize_kv(codes, step).isnan().all())


def test_static_steps_come_from_calibrated_amax_and_saturate_beyond_it() -> None:
    amax = torch.tensor([[4.48, 0.896], [1.0, 2.0]])  # (2, H): keys, values
    k_step, v_step = static_kv_steps(amax, KvFp8(scaling="per_head"))
    torch.testing.assert_close(k_step, torch.tensor([0.01, 0.002]))
    torch.testing.assert_close(v_step, torch.tensor([1.0, 2.0]) / 448)
    k_tensor, _ = static_kv_steps(amax, KvFp8(scaling="per_tensor"))
    torch.testing.assert_close(k_tensor, torch.tensor([0.01]))
    e5, _ = static_kv_steps(amax, KvFp8(format=Fp8Format.E5M2, scaling="per_tensor"))
    torch.testing.assert_close(e5, torch.tensor([4.48 / 57344]))
    # A value beyond the calibrated range saturates at fmt.max * step, never inf or NaN.
    x = torch.tensor([100.0, -100.0, 1.0, 0.0]).view(1, 1, 1, 4).expand(1, 2, 1, 4)
    codes, step = quantize_kv(x, Fp8Format.E4M3, k_step)
    back = dequantize_kv(codes, step)
    torch.testing.assert_close(back[0, :, 0, 0], 448 * k_step)
    torch.testing.assert_close(back[0, :, 0, 1], -448 * k_step)
    with pytest.raises(ValueError, match="not static"):
        static_kv_steps(amax, KvFp8())


@pytest.mark.parametrize("ctx", [PER_HEAD, PER_TENSOR])
def test_a_static_scheme_without_steps_is_refused_when_built(ctx: ComputeCtx) -> None:
    with pytest.raises(ValueError, match=r"static scheme.*a step of 1\.0 is never assumed"):
        KVCache(ctx, 1, H, D, 8)
    attn = Attention(ctx, H * D, H, max_len=8)
    assert not attn.kv_calibrated
    with pytest.raises(ValueError, match="no calibrated KV amax"):
        attn.new_cache(1)


@pytest.mark.parametrize(
    ("ctx", "steps", "needle"),
    [
        (PER_HEAD, _steps((1,)), r"needs key steps of shape \(2,\), got \(1,\)"),
        (PER_TENSOR, _steps((H,)), r"needs key steps of shape \(1,\), got \(2,\)"),
        # What is wrong and where, never the steps' values.
        (PER_HEAD, (torch.ones(H), torch.tensor([1.0, math.nan])), "value step of head 1 is NaN$"),
        (PER_TENSOR, (torch.zeros(1), torch.ones(1)), "key steps must be .*; the key step is 0$"),
        (PER_TENSOR, (torch.ones(1), -torch.ones(1)), "; the value step is negative$"),
        (PTH, _steps((H,)), "takes no calibrated steps"),
        (F32, _steps((H,)), "stores values, not fp8 codes"),
    ],
)
def test_bad_steps_are_refused(
    ctx: ComputeCtx, steps: tuple[torch.Tensor, torch.Tensor], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        KVCache(ctx, 1, H, D, 8, steps=steps)


def test_to_kv_refuses_an_fp8_cache_setting() -> None:
    with pytest.raises(PromotionError, match="quantizer"):
        PTH.to_kv(torch.zeros(2))


def test_write_at_a_position_stores_what_append_stores() -> None:
    g = torch.Generator().manual_seed(1)
    ks = torch.randn(1, H, 5, D, generator=g)
    vs = torch.randn(1, H, 5, D, generator=g)
    appended = KVCache(PTH, 1, H, D, 8)
    written = KVCache(PTH, 1, H, D, 8)
    appended.append(ks[:, :, :2], vs[:, :, :2])
    written.write(ks[:, :, :2], vs[:, :, :2], torch.tensor(0))
    for i in range(2, 5):
        appended.append(ks[:, :, i : i + 1], vs[:, :, i : i + 1])
        written.write(ks[:, :, i : i + 1], vs[:, :, i : i + 1], torch.tensor(i))
    assert appended.length == 5 and written.length == 0  # write leaves the cursor alone
    for name in ("k", "v", "k_step", "v_step"):
        assert torch.equal(getattr(appended, name), getattr(written, name)), name
    # Positions never written keep zero codes and step 1.
    assert appended.k_step is not None and bool((appended.k_step[:, :, 5:] == 1).all())
    with pytest.raises(ValueError, match="0-d int64"):
        written.write(ks[:, :, :1], vs[:, :, :1], torch.tensor([5]))
    with pytest.raises(ValueError, match="at most 3 more"):
        appended.append(ks[:, :, :4], vs[:, :, :4])
    assert appended.length == 5


def test_read_dequantizes_in_float32() -> None:
    cache = KVCache(PTH, 1, H, D, 8)
    k = torch.randn(1, H, 3, D)
    cache.append(k, -k)
    keys, values = cache.read()
    assert keys.dtype == values.dtype == torch.float32 and keys.shape == (1, H, 3, D)
    torch.testing.assert_close(values, -keys, rtol=0, atol=0)
    torch.testing.assert_close(keys, k, rtol=2.0**-4, atol=0)


def test_a_cache_read_under_another_policy_is_an_error() -> None:
    torch.manual_seed(0)
    for built, read in ((PTH, PER_HEAD), (F32, PTH), (PTH, F32), (PTH, PTH.with_kv(DType.BF16))):
        cache = KVCache(built, 1, H, D, 8)
        attn = Attention(read, H * D, H, max_len=8)
        with pytest.raises(ValueError, match=f"built for kv={built.kv} but is read under"):
            attn(torch.randn(1, 2, H * D), cache)
        with pytest.raises(ValueError, match=f"built for kv={built.kv} but is read under"):
            attn.decode(torch.randn(1, 1, H * D), torch.tensor(0), cache)
        assert cache.length == 0  # refused before anything was written


def test_kernel_backend_refuses_a_head_dim_it_cannot_serve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # D = 24 is not a multiple of 16: asking for the Triton kernel is an error naming it
    # (the interpreter makes the backend runnable on the CPU); the default reads with the
    # reference twin, which serves any head dim.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    attn = Attention(PTH, 48, 2, max_len=8)
    with pytest.raises(ValueError, match="cannot serve head dim D=24"):
        attn.new_cache(1, backend="triton")
    with pytest.raises(ValueError, match="cannot serve head dim D=24"):
        attn.new_cache(1, backend=Backend.TRITON)
    cache = attn.new_cache(1)
    assert cache.backend is Backend.REFERENCE
    with torch.no_grad():
        out = attn(torch.randn(1, 3, 48), cache)
        step = attn(torch.randn(1, 1, 48), cache)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(step).all())
    with pytest.raises(ValueError, match="takes no steps and no decode backend"):
        KVCache(F32, 1, 2, 24, 8, backend="reference")


def test_decode_step_and_forward_step_read_the_cache_alike() -> None:
    # One position through forward (the python length) and through decode (a position
    # tensor) write the same codes and run the same decode attention: bit-identical.
    torch.manual_seed(2)
    attn = Attention(PTH, H * D, H, max_len=16)
    x = torch.randn(2, 6, H * D)
    by_length, by_pos = attn.new_cache(2), attn.new_cache(2)
    with torch.no_grad():
        attn(x[:, :5], by_length)
        attn(x[:, :5], by_pos)
        a = attn(x[:, 5:], by_length)
        b = attn.decode(x[:, 5:], torch.tensor(5), by_pos)
    assert torch.equal(a, b)
    assert by_length.v_step is not None and by_pos.v_step is not None
    assert torch.equal(by_length.k, by_pos.k) and torch.equal(by_length.v_step, by_pos.v_step)


def test_prefill_and_one_by_one_agree() -> None:
    # The same codes either way (each (token, head) vector is quantized on its own): the
    # prefill's float32 causal attention and the decode steps' block-wise float32 attention
    # differ only by float32 reassociation.
    torch.manual_seed(3)
    attn = Attention(PTH, H * D, H, max_len=16)
    x = torch.randn(1, 9, H * D)
    whole, steps = attn.new_cache(1), attn.new_cache(1)
    with torch.no_grad():
        full = attn(x, whole)
        parts = [attn(x[:, i : i + 1], steps) for i in range(9)]
    assert torch.equal(whole.k, steps.k) and torch.equal(whole.v, steps.v)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-6)


def test_static_steps_never_fall_back_to_one() -> None:
    # An amax that is zero, NaN or inf (set by hand, or loaded with torch's load_state_dict,
    # which load_weights' check does not see) is refused, never turned into a step of 1.0.
    attn = Attention(PER_TENSOR, H * D, H, max_len=8)
    # The error names what is wrong and where (never printing the amax).
    for bad, what in ((0.0, "0"), (math.nan, "NaN"), (math.inf, "inf"), (-2.5, "negative")):
        with torch.no_grad():
            attn.kv_amax.fill_(1.0)
            attn.kv_amax[1, 1] = bad
        want = (
            f"a calibrated KV amax must be finite and positive for kv={PER_TENSOR.kv}: "
            f"the values' amax of head 1 is {what}"
        )
        with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
            attn.new_cache(1)
    with torch.no_grad():
        attn.kv_amax[0] = -math.inf
    with pytest.raises(ValueError, match=r": the keys' amax of head 0 is -inf \(3 of the 4 "):
        attn.new_cache(1)
    with torch.no_grad():
        attn.kv_amax.fill_(4.48)
    cache = attn.new_cache(1)
    assert cache.k_step is not None
    torch.testing.assert_close(cache.k_step, torch.tensor([0.01]), rtol=2.0**-23, atol=0)


def test_the_default_backend_falling_back_to_the_twin_warns_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where the device's default backend runs the Triton kernel (a GPU; here the TRITON
    # backend standing in for one), a head dim it cannot serve reads with the twin and says
    # so, once per device and head dim; a head dim it serves says nothing.
    import warnings

    from computectx.nn import kv_cache

    monkeypatch.setattr(kv_cache, "default_backend", lambda device: Backend.TRITON)
    monkeypatch.setattr(kv_cache, "_WARNED_FALLBACKS", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = KVCache(PTH, 1, 2, 24, 8)
        again = KVCache(PTH, 1, 2, 24, 8)
        served = KVCache(PTH, 1, 2, 32, 8)
    assert first.backend is again.backend is Backend.REFERENCE
    assert served.backend is Backend.TRITON
    fallbacks = [w for w in seen if issubclass(w.category, kv_cache.DecodeKernelFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in seen]
    assert "head dim D=24" in str(fallbacks[0].message)


def test_the_decode_step_reads_no_host_value() -> None:
    # ByteLM.decode_step's promise (a CUDA graph can hold it): no tensor value read by the
    # host, for a dtype cache and an fp8 one (the decode operator's own body is checked in
    # tests/formats/ops/test_attention.py).
    from typing import Any

    from torch.utils._python_dispatch import TorchDispatchMode

    from computectx.nn import ByteLM, LMConfig

    class HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.count = 0

        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.count += 1
            return func(*args, **(kwargs or {}))

    cfg = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=16)
    for ctx in (F32, PTH):
        torch.manual_seed(0)
        model = ByteLM(ctx, cfg).eval()
        caches = model.new_caches(1)
        with torch.no_grad(), HostReads() as reads:
            for pos in range(3):
                model.decode_step(torch.tensor([[65 + pos]]), torch.tensor(pos), caches)
        assert reads.count == 0, ctx.kv


@pytest.mark.parametrize("max_len", [0, -3, 2.5, True])
def test_new_cache_refuses_a_max_len_that_is_not_a_positive_int(max_len: object) -> None:
    # 0 is not "the default": it is refused like any other bad length.
    attn = Attention(PTH, H * D, H, max_len=16)
    with pytest.raises(ValueError, match=f"max_len must be a positive int, got {max_len!r}"):
        attn.new_cache(1, max_len=max_len)  # type: ignore[arg-type]
    assert attn.new_cache(1).max_len == 16 and attn.new_cache(1, max_len=5).max_len == 5


@pytest.mark.parametrize("ctx", [F32, PTH], ids=["f32", "fp8"])
def test_read_refuses_an_end_outside_the_cache(ctx: ComputeCtx) -> None:
    cache = KVCache(ctx, 1, H, D, 8)
    cache.append(torch.randn(1, H, 3, D), torch.randn(1, H, 3, D))
    for end in (-1, 9, 2.0, True, None):
        if end is None:
            assert cache.read()[0].shape[2] == 3  # the default: the appended positions
            continue
        with pytest.raises(ValueError, match=f"end={end!r}.* 0 <= end <= 8"):
            cache.read(end)  # type: ignore[arg-type]
    # Any end up to max_len reads: positions past length hold what write() put there.
    cache.write(torch.ones(1, H, 1, D), torch.ones(1, H, 1, D), torch.tensor(6))
    keys, _ = cache.read(7)
    assert keys.shape[2] == 7 and bool((keys[:, :, 6] == 1).all()) and cache.read(0)[0].numel() == 0


@pytest.mark.parametrize("kv", [DType.F32, DType.BF16, KvFp8()], ids=str)
def test_the_decode_step_never_reads_stale_slots_past_its_position(kv: DType | KvFp8) -> None:
    # A preallocated cache may hold anything past the position (a previous sequence's
    # values, NaN, inf): the static-shape decode step's output is the same as over a clean
    # cache, bit for bit, for a 16/32-bit cache as for an fp8 one.
    torch.manual_seed(3)
    ctx = F32.with_kv(kv)
    attn = Attention(ctx, H * D, H, max_len=12)
    x = torch.randn(1, 5, H * D)
    clean, dirty = attn.new_cache(1), attn.new_cache(1)
    with torch.no_grad():
        for cache in (clean, dirty):
            for p in range(4):
                attn.decode(x[:, p : p + 1], torch.tensor(p), cache)
        for t, bad in ((dirty.k, math.inf), (dirty.v, math.nan)):
            if t.element_size() == 1:
                t[:, :, 5:] = torch.tensor(bad).to(t.dtype)
            else:
                t[:, :, 5:] = bad
        a = attn.decode(x[:, 4:5], torch.tensor(4), clean)
        b = attn.decode(x[:, 4:5], torch.tensor(4), dirty)
    assert bool(torch.isfinite(a).all()) and torch.equal(a, b)


def test_an_fp8_prefill_under_tf32_on_cuda_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The prefill's float32 matmuls would run in TF32 on a CUDA device whose float32 matmul
    # precision is not "highest": a named warning, once; never on the CPU or at "highest".
    import warnings

    from computectx.nn import attention

    calls: list[torch.device] = []
    check = attention._check_float32_matmul
    monkeypatch.setattr(attention, "_check_float32_matmul", calls.append)
    attn = Attention(PTH, H * D, H, max_len=8)
    with torch.no_grad():
        attn(torch.randn(1, 3, H * D), attn.new_cache(1))
    assert calls == [CPU]  # the prefill asks
    monkeypatch.setattr(attention, "_TF32_WARNED", [])
    previous = torch.get_float32_matmul_precision()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.set_float32_matmul_precision("highest")
            check(torch.device("cuda"))
            torch.set_float32_matmul_precision("high")
            check(CPU)
            check(torch.device("cuda"))
            check(torch.device("cuda"))
    finally:
        torch.set_float32_matmul_precision(previous)
    assert [w.category for w in seen] == [attention.Float32MatmulPrecisionWarning]
    assert "'high'" in str(seen[0].message) and "'highest'" in str(seen[0].message)


def test_a_step_that_fits_no_layout_is_refused_naming_its_shape() -> None:
    # One layout rule for the quantizer, the dequantization and decode attention
    # (kv_quant.step_layout): (B, H, T) per_token_head, (H,) per_head, (1,) per_tensor.
    x = torch.randn(1, H, 3, D)
    codes, step = quantize_kv(x, Fp8Format.E4M3)
    for bad in (torch.ones(H + 1), torch.ones(1, H, 5), torch.ones(H, 3)):
        with pytest.raises(ValueError, match=re.escape(f"shape {tuple(bad.shape)} fits no")):
            quantize_kv(x, Fp8Format.E4M3, bad)
        with pytest.raises(ValueError, match=re.escape(f"shape {tuple(bad.shape)} fits no")):
            dequantize_kv(codes, bad)
    # float64 dequantization is exact: code * step with no rounding (a code has 4 significant
    # bits and a float32 step 24, so the product fits float64's 53).
    exact = dequantize_kv(codes, step, dtype=torch.float64)
    assert exact.dtype == torch.float64
    assert torch.equal(exact, codes.double() * step.double().unsqueeze(-1))
    assert torch.equal(exact.float(), dequantize_kv(codes, step))  # float32 exact too here
    assert torch.equal(dequantize_kv(x, None), x)  # a value cache: widened, nothing else


def _put(cache: KVCache, where: str, k: torch.Tensor, v: torch.Tensor) -> None:
    if where == "append":
        cache.append(k, v)
    else:
        cache.write(k, v, torch.tensor(1))


def _state(cache: KVCache) -> list[torch.Tensor]:
    parts = (cache.k, cache.v, cache.k_step, cache.v_step)
    return [t.clone() for t in parts if t is not None]


@pytest.mark.parametrize(
    "ctx",
    [
        F32,
        ComputeCtx.new(DType.BF16, CPU),
        PTH,
        PER_HEAD,
        F32.with_kv(KvFp8(format=Fp8Format.E5M2)),
    ],
    ids=["f32", "bf16", "e4m3/per_token_head", "e4m3/per_head", "e5m2/per_token_head"],
)
@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("where", ["append", "write"])
def test_every_cache_refuses_values_outside_the_compute_dtypes_alike(
    ctx: ComputeCtx, dtype: torch.dtype, where: str
) -> None:
    # Integers, bools, complex (whose imaginary part a cast would drop) and raw fp8 codes
    # (which mean nothing without their scale) are refused by an fp8 cache exactly as by a
    # dtype cache: a PromotionError with the same message, naming the argument, before
    # anything is written (k is good and v is bad, or the reverse).
    steps = _steps((H,)) if ctx is PER_HEAD else None
    cache = KVCache(ctx, 1, H, D, 4, steps=steps)
    cache.append(torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))
    before, length = _state(cache), cache.length
    good = torch.randn(1, H, 1, D)
    bad = torch.ones(1, H, 1, D).to(dtype)
    expected = re.escape(str(dtype))
    for k, v, name in ((good, bad, "v"), (bad, good, "k")):
        with pytest.raises(PromotionError, match=rf"KVCache.{where}: {name}: {expected} is") as e:
            _put(cache, where, k, v)
        with pytest.raises(PromotionError) as plain:
            _put(KVCache(F32, 1, H, D, 4), where, k, v)
        assert str(e.value) == str(plain.value)  # one rule, one message
        assert cache.length == length
        assert all(torch.equal(a, b) for a, b in zip(_state(cache), before, strict=True))
    with pytest.raises(PromotionError, match=expected):
        quantize_kv(bad, Fp8Format.E4M3)


def test_every_compute_dtype_enters_an_fp8_cache() -> None:
    # The rule refuses what is outside the lattice only: f16, bf16, f32, f64 all quantize.
    x = torch.randn(1, H, 1, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        cache = KVCache(PTH, 1, H, D, 2)
        cache.append(x.to(dtype), x.to(dtype))
        k, _ = cache.read()
        exact = x.to(dtype).to(torch.float32)
        # Half an E4M3 ulp (2**-4 relative), or half its smallest subnormal times the step.
        step = exact.abs().amax(dim=-1, keepdim=True) / 448
        bound = torch.maximum(exact.abs() * 2.0**-4, step * 2.0**-10) * (1 + 2.0**-20)
        assert bool(((k - exact).abs() <= bound).all()), dtype
