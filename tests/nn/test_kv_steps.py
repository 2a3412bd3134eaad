"""Compact KV steps and the window of recent positions (``KvFp8.step``, ``KvFp8.recent``) in
``KVCache`` and ``Attention``: the storage and its bytes, steps rounded up so no code
saturates, the round trip within the code step, and a window read exactly, through append,
write, reset, reorder and both decode paths."""

from __future__ import annotations

import pytest
import torch

from computectx import ComputeCtx, DType, Fp8Format
from computectx.kv_policy import KV_STEPS, KvFp8, KvStep
from computectx.nn import Attention, KVCache, kv_bytes_per_token
from computectx.nn.kv_cache import kv_window_bytes
from computectx.nn.kv_steps import stored_steps

CPU = torch.device("cpu")
F32 = ComputeCtx.parity(CPU)
H, D = 2, 16
STEP_DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16, "e8m0": torch.float8_e8m0fnu}


def _values(b: int, t: int, seed: int, d: int = D) -> torch.Tensor:
    # Vectors of spread magnitudes (1e-3 .. 1e3), so the steps differ over many binades.
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(b, H, t, 1, generator=gen) * 6 - 3)
    return torch.randn(b, H, t, d, generator=gen) * scale


@pytest.mark.parametrize("step", KV_STEPS)
@pytest.mark.parametrize("scaling", ["per_token_head", "per_head", "per_tensor"])
def test_steps_are_stored_at_their_format_and_counted(step: KvStep, scaling: str) -> None:
    kv = KvFp8(scaling=scaling, step=step)  # type: ignore[arg-type]
    steps = None
    if kv.static:
        n = H if scaling == "per_head" else 1
        steps = (torch.full((n,), 0.01), torch.full((n,), 0.03))
    cache = KVCache(F32.with_kv(kv), 3, H, D, 8, steps=steps)
    assert cache.k_step is not None and cache.k_step.dtype == STEP_DTYPE[step]
    size = {"f32": 4, "bf16": 2, "e8m0": 1}[step]
    per_token = 2 * H * D + (2 * H * size if scaling == "per_token_head" else 0)
    assert cache.bytes_per_token == kv_bytes_per_token(kv, H, D) == per_token
    fixed = 0 if scaling == "per_token_head" else 2 * size * (H if scaling == "per_head" else 1)
    assert cache.nbytes == 3 * 8 * per_token + fixed


def test_at_head_dim_32_e8m0_steps_hold_at_most_052_of_bf16() -> None:
    # The target: at D = 32 the cache holds <= 0.52x the bytes of a bf16 cache;
    # f32 steps hold 0.5625x (the measure can fail), bf16 steps 0.53x, e8m0 steps 0.516x.
    d, t = 32, 64
    bf16 = KVCache(F32.with_kv(DType.BF16), 2, H, d, t).nbytes
    ratio = {s: KVCache(F32.with_kv(KvFp8(step=s)), 2, H, d, t).nbytes / bf16 for s in KV_STEPS}
    assert ratio == {"f32": 0.5625, "bf16": 34 / 64, "e8m0": 33 / 64}
    assert ratio["e8m0"] <= 0.52 < ratio["bf16"] < ratio["f32"]


def test_e8m0_and_bf16_steps_round_up() -> None:
    exact = torch.tensor([1.0, 1.5, 0.75, 2.0**-130, 3e-39, 2.0**100 * 1.01, 1 / 448])
    e8m0 = stored_steps(exact, "e8m0").float()
    want = [1.0, 2.0, 1.0, 2.0**-126, 2.0**-126, 2.0**101, 2.0**-8]
    assert e8m0.tolist() == want
    bf16 = stored_steps(exact, "bf16")
    assert bf16.dtype == torch.bfloat16 and bool((bf16.float() >= exact).all())
    # At most one bf16 ulp above (2**-7 relative where the step is a normal float32), and
    # exact where bf16 holds the value.
    normal = exact >= 2.0**-126
    assert bool((bf16.float() <= exact * (1 + 2.0**-7))[normal].all())
    assert bf16.float()[:3].tolist() == [1.0, 1.5, 0.75]
    assert torch.equal(stored_steps(exact, "f32"), exact)


@pytest.mark.parametrize("step", KV_STEPS)
@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_a_compact_step_never_saturates_and_reads_back_within_a_code_step(
    step: KvStep, fmt: Fp8Format
) -> None:
    kv = KvFp8(format=fmt, step=step)
    cache = KVCache(F32.with_kv(kv), 2, H, D, 40)
    x = _values(2, 40, seed=1)
    cache.append(x[:, :, :30], x[:, :, :30])
    for i in range(30, 40):
        cache.append(x[:, :, i : i + 1], x[:, :, i : i + 1])
    assert cache.k_step is not None
    s = cache.k_step.float()
    exact = x.abs().amax(dim=-1) / fmt.max
    assert bool((s >= exact).all())  # rounded up: |x / step| <= fmt.max, nothing clamps
    assert bool((cache.k.float().abs() <= fmt.max).all())
    if step == "e8m0":
        assert bool((s < 2 * exact).all()) and bool((torch.frexp(s).mantissa == 0.5).all())
    # Within half a code step: the relative rounding of the format, or the subnormal spacing.
    k, _ = cache.read()
    rel = 2.0 ** -(fmt.mantissa_bits + 1)
    bound = rel * x.abs() + 0.5 * fmt.min_subnormal * s.unsqueeze(-1)
    assert bool(((k - x).abs() <= bound).all())


@pytest.mark.parametrize("step", KV_STEPS)
def test_the_window_reads_the_last_positions_exactly(step: KvStep) -> None:
    n = 4
    plain = KVCache(F32.with_kv(KvFp8(step=step)), 2, H, D, 24)
    window = KVCache(F32.with_kv(KvFp8(step=step, recent=n)), 2, H, D, 24)
    by_pos = KVCache(F32.with_kv(KvFp8(step=step, recent=n)), 2, H, D, 24)
    x = _values(2, 16, seed=2)
    # A prefill longer than the window, then one position at a time; and the same by position.
    for c in (plain, window):
        c.append(x[:, :, :9], -x[:, :, :9])
    by_pos.write(x[:, :, :9], -x[:, :, :9], torch.tensor(0))
    for i in range(9, 16):
        for c in (plain, window):
            c.append(x[:, :, i : i + 1], -x[:, :, i : i + 1])
        by_pos.write(x[:, :, i : i + 1], -x[:, :, i : i + 1], torch.tensor(i))
        k, v = window.read()
        pk, _ = plain.read()
        # Positions i+1-n .. i exactly as written; the rest as their codes say.
        assert torch.equal(k[:, :, i + 1 - n :], x[:, :, i + 1 - n : i + 1])
        assert torch.equal(v[:, :, i + 1 - n :], -x[:, :, i + 1 - n : i + 1])
        assert torch.equal(k[:, :, : i + 1 - n], pk[:, :, : i + 1 - n])
        assert not torch.equal(pk[:, :, i + 1 - n :], k[:, :, i + 1 - n :])  # codes round
        assert torch.equal(by_pos.read(i + 1)[0], k)
    # The window holds the last n positions at the compute dtype; the codes every position.
    assert torch.equal(window.k, plain.k) and window.k_recent is not None
    assert window.k_recent.dtype == torch.float32
    assert sorted(window.window_pos.tolist()) == list(range(16 - n, 16))
    extra = kv_window_bytes(KvFp8(recent=n), H, D, DType.F32)
    assert extra == 2 * H * n * D * 4 and window.nbytes == plain.nbytes + 2 * extra
    assert kv_window_bytes(DType.BF16, H, D, DType.F32) == 0


def test_a_window_as_long_as_the_sequence_is_an_f32_cache() -> None:
    # Every position in the window: attention reads exactly what an f32 cache holds, in the
    # prefill, in forward's one-position steps and in the static-shape decode steps; a
    # window shorter than the sequence does not.
    torch.manual_seed(3)
    attn = Attention(F32, H * D, H, max_len=12)
    x = torch.randn(2, 12, H * D)

    def run(kv: DType | KvFp8, by_pos: bool) -> torch.Tensor:
        a = Attention(F32.with_kv(kv), H * D, H, max_len=12)
        a.load_state_dict(attn.state_dict())
        cache = a.new_cache(2)
        with torch.no_grad():
            outs = [a(x[:, :5], cache)]
            for i in range(5, 12):
                if by_pos:
                    outs.append(a.decode(x[:, i : i + 1], torch.tensor(i), cache))
                else:
                    outs.append(a(x[:, i : i + 1], cache))
        return torch.cat(outs, dim=1)

    for by_pos in (False, True):
        ref = run(DType.F32, by_pos)
        torch.testing.assert_close(run(KvFp8(step="e8m0", recent=12), by_pos), ref)
        assert not torch.allclose(run(KvFp8(step="e8m0", recent=3), by_pos), ref, atol=1e-6)


def test_reset_and_reorder_keep_the_buffers_and_move_the_window() -> None:
    cache = KVCache(F32.with_kv(KvFp8(step="e8m0", recent=3)), 2, H, D, 8)
    x = _values(2, 5, seed=4)
    cache.append(x, x)
    buffers = [t.data_ptr() for t in cache.held]
    before = cache.read()[0].clone()
    cache.reorder(torch.tensor([1, 0]))
    assert torch.equal(cache.read()[0], before.flip(0))
    cache.reset()
    assert cache.length == 0 and cache.window_pos.tolist() == [-1, -1, -1]
    assert [t.data_ptr() for t in cache.held] == buffers
    assert cache.k_step is not None and bool((cache.k_step.float() == 1).all())
    cache.append(x, x)
    assert torch.equal(cache.read()[0], before)


def test_a_dtype_cache_takes_no_window_dtype() -> None:
    with pytest.raises(ValueError, match="nor a window dtype"):
        KVCache(F32, 1, H, D, 8, window_dtype=torch.bfloat16)
    cache = KVCache(F32.with_kv(KvFp8(recent=2)), 1, H, D, 8, window_dtype=torch.bfloat16)
    assert cache.k_recent is not None and cache.k_recent.dtype == torch.bfloat16


def test_the_compiled_decode_step_reads_e8m0_steps_in_one_graph() -> None:
    # decode_attention's operator takes the e8m0 steps as they are (fake tensors included):
    # the static-shape decode step compiles whole once and matches eager as pos moves.
    from torch._dynamo.testing import CompileCounterWithBackend

    from computectx.nn import ByteLM, LMConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=16)
    model = ByteLM(F32.with_kv(KvFp8(step="e8m0")), config).eval()
    eager, compiled = model.new_caches(1, 16), model.new_caches(1, 16)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(model.decode_step, fullgraph=True, backend=counter)
    with torch.no_grad():
        model(ids[:, :4], eager)
        model(ids[:, :4], compiled)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(4, 10):
                x, pos = ids[:, i : i + 1], torch.tensor(i)
                want = model.decode_step(x, pos, eager)
                torch.testing.assert_close(step(x, pos, compiled), want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
