"""The fp8 KV cache at its edges (issue 32's adversarial pass): a model checks every layer's
cache before any layer writes, a cache knows the calibration its static steps came from,
a prefill over a window reads as step-by-step decoding does, the window holds what the codes
read (NaN for inf and NaN, saturated beyond its dtype), and the cache's sizes, window dtype
and write positions are checked when given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from computectx import ComputeCtx, DType, KvFp8
from computectx.nn import Attention, ByteLM, KVCache, LMConfig, calibrate_kv

CPU = torch.device("cpu")
F32 = ComputeCtx.parity(CPU)
CONFIG = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32, max_len=12)


def _model(kv: KvFp8 | DType, seed: int = 0) -> ByteLM:
    torch.manual_seed(seed)
    return ByteLM(F32.with_kv(kv), CONFIG).eval()


def _ids(t: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, t), generator=torch.Generator().manual_seed(seed))


def _state(caches: list[KVCache]) -> list[object]:
    out: list[object] = []
    for c in caches:
        out += [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in c.held]
        out.append(c.length)
    return out


def _same(a: list[object], b: list[object]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


# ----- a model checks every layer's cache before any layer writes -----------------------


def _bad_second_cache(case: str) -> tuple[ByteLM, list[KVCache]]:
    model = _model(KvFp8())
    caches = model.new_caches(2, 8)
    if case == "kv":
        caches[1] = _model(KvFp8(step="e8m0", recent=2)).new_caches(2, 8)[1]
    elif case == "batch":
        caches[1] = model.new_caches(1, 8)[1]
    elif case == "max_len":
        caches[1] = model.new_caches(2, 2)[1]
    else:  # another length than layer 0's
        with torch.no_grad():
            model(_ids(1), caches)
        caches[1].reset()
    return model, caches


@pytest.mark.parametrize("case", ["kv", "batch", "max_len", "length"])
def test_forward_refuses_any_layers_cache_before_layer_0_writes(case: str) -> None:
    model, caches = _bad_second_cache(case)
    before = _state(caches)
    with torch.no_grad(), pytest.raises(ValueError, match=r"ByteLM.forward: caches\[1\]"):
        model(_ids(3), caches)
    assert _same(_state(caches), before)  # layer 0's cache was not appended to


def test_decode_step_refuses_any_layers_cache_before_layer_0_writes() -> None:
    model, caches = _bad_second_cache("kv")
    before = _state(caches)
    with torch.no_grad(), pytest.raises(ValueError, match=r"decode_step: caches\[1\]"):
        model.decode_step(_ids(1), torch.tensor(2), caches)
    assert _same(_state(caches), before)


# ----- a cache knows the calibration of its static steps --------------------------------


def _calibrated(seed: int, data_seed: int) -> ByteLM:
    model = _model(KvFp8(scaling="per_head"), seed)
    calibrate_kv(model, [_ids(6, seed=data_seed)])
    return model


def test_caches_of_another_calibration_are_refused() -> None:
    a, b = _calibrated(0, 1), _calibrated(0, 2)  # the same weights, other calibration data
    ids = _ids(4, seed=3)
    caches = a.new_caches(2, 8)
    before = _state(caches)
    with torch.no_grad():
        differ = r"another calibration \(its (key|value|key and value) steps differ from this"
        with pytest.raises(ValueError, match=r"caches\[0\]: .* " + differ):
            b(ids, caches)
        assert _same(_state(caches), before)
        with pytest.raises(ValueError, match="another calibration"):
            b.decode_step(ids[:, :1], torch.tensor(0), caches)
        assert _same(_state(caches), before)
        # The same calibration in another model (its weights and amax loaded) reads them.
        twin = _model(KvFp8(scaling="per_head"), seed=5)
        twin.load_state_dict(a.state_dict())
        torch.testing.assert_close(twin(ids, caches), a(ids, a.new_caches(2, 8)), rtol=0, atol=0)


def test_calibrating_again_after_new_caches_refuses_the_old_caches() -> None:
    model = _calibrated(0, 1)
    ids = _ids(4, seed=3)
    old = model.new_caches(2, 8)
    calibrate_kv(model, [_ids(6, seed=2)])
    with torch.no_grad(), pytest.raises(ValueError, match="another calibration"):
        model(ids, old)
    with torch.no_grad():
        model(ids, model.new_caches(2, 8))  # caches built after it are read


# ----- a prefill over a window reads as step-by-step decoding --------------------------


@pytest.mark.parametrize(
    "kv",
    [KvFp8(step="e8m0", recent=3), KvFp8(recent=1), KvFp8(scaling="per_tensor", recent=2)],
    ids=str,
)
def test_a_prefill_over_a_window_reads_as_one_position_at_a_time(kv: KvFp8) -> None:
    # docs/serving.md: the prefill and the decode steps see the same codes, and the same
    # window: the query at position s reads s - n < p <= s unquantized, the rest from codes.
    model = _model(kv)
    if kv.static:
        calibrate_kv(model, [_ids(8, seed=4)])
    ids = _ids(9, seed=5)
    with torch.no_grad():
        whole = model(ids, model.new_caches(2, 12))
        caches = model.new_caches(2, 12)
        steps = torch.cat([model(ids[:, i : i + 1], caches) for i in range(9)], dim=1)
        chunked = model.new_caches(2, 12)  # a prefill after cached positions
        parts = torch.cat([model(ids[:, :4], chunked), model(ids[:, 4:], chunked)], dim=1)
    assert (whole - steps).abs().max() <= 1e-6
    assert (parts - steps).abs().max() <= 1e-6


# ----- the window holds what the codes read -----------------------------------------------


def test_inf_and_nan_read_back_as_nan_in_the_window_and_after_it() -> None:
    cache = KVCache(F32.with_kv(KvFp8(recent=2)), 1, 1, 4, max_len=4)
    x = torch.tensor([[[[1.0, float("inf"), float("nan"), -float("inf")]]]])
    cache.append(x, x)
    k, _ = cache.read()
    assert k[0, 0, 0, 0] == 1.0 and bool(k[0, 0, 0, 1:].isnan().all())  # in the window
    cache.append(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    k, _ = cache.read()
    assert bool(k[0, 0, 0, 1:].isnan().all())  # from its codes, once it left


def test_the_window_saturates_beyond_its_dtype_as_the_codes_do() -> None:
    ctx = ComputeCtx.new(DType.F16, CPU).with_kv(KvFp8(recent=2))
    cache = KVCache(ctx, 1, 1, 4, max_len=4)
    x = torch.tensor([[[[1e38, -1e38, 1.0, 7e4]]]])  # float32, beyond f16's 65504
    cache.append(x, x)
    k, _ = cache.read()
    assert k[0, 0, 0].tolist() == [65504.0, -65504.0, 1.0, 65504.0]
    codes, _ = cache.read(window=False)
    assert bool(codes.isfinite().all())


# ----- sizes, window dtype and write positions are checked when given ---------------------


@pytest.mark.parametrize(
    "dtype", [torch.int8, torch.int64, torch.bool, torch.float8_e4m3fn, "bf16", 2]
)
def test_a_window_dtype_that_is_not_a_compute_dtype_is_refused(dtype: object) -> None:
    with pytest.raises(ValueError, match=r"window_dtype=.*accepted: None .*a DType"):
        KVCache(F32.with_kv(KvFp8(recent=2)), 1, 1, 4, 4, window_dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, DType.BF16]
)
def test_the_compute_dtypes_hold_a_window(dtype: torch.dtype | DType) -> None:
    cache = KVCache(F32.with_kv(KvFp8(recent=2)), 1, 1, 4, 4, window_dtype=dtype)
    want = dtype.torch if isinstance(dtype, DType) else dtype
    assert cache.k_recent is not None and cache.k_recent.dtype == want


@pytest.mark.parametrize("pos", [100, 7, -1])
def test_an_empty_write_outside_the_cache_is_refused(pos: int) -> None:
    cache = KVCache(F32.with_kv(KvFp8()), 1, 1, 4, max_len=6)
    empty = torch.zeros(1, 1, 0, 4)
    with pytest.raises(ValueError, match=rf"pos={pos}, T=0.*0 <= pos <= 6"):
        cache.write(empty, empty, torch.tensor(pos))
    cache.write(empty, empty, torch.tensor(6))  # the end itself holds 0 positions


def test_sizes_beyond_what_torch_can_address_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"max_len=4611686018427387904.*more than torch"):
        KVCache(F32.with_kv(KvFp8()), 1, 1, 1, max_len=2**62)


def test_numpy_integers_are_sizes() -> None:
    two, one = np.int64(2), np.int32(1)
    cache = KVCache(F32.with_kv(KvFp8(recent=two)), two, one, 4, 5)  # type: ignore[arg-type]
    assert cache.k.shape == (2, 1, 5, 4) and type(cache.max_len) is int
    with pytest.raises(ValueError, match="batch must be a positive int"):
        KVCache(F32, np.float64(2.0), 1, 4, 5)  # type: ignore[arg-type]


def test_attention_refuses_a_cache_of_another_shape() -> None:
    attn = Attention(F32, 32, 2, max_len=8)
    other = KVCache(F32, 1, 4, 8, 8)
    with pytest.raises(ValueError, match="4 heads of dim 8; this attention layer reads 2 heads"):
        attn(torch.zeros(1, 1, 32), other)
