"""``KVCache`` at its edges (issue 32): rollbacks through the window, refused calls that change
nothing, extreme finite values, the compiled decode step with e8m0 steps, and a model-based
randomized test against a float32 model of the cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from computectx import ComputeCtx, DType, Fp8Format
from computectx.formats.numerics.kv_quant import dequantize_kv, quantize_kv
from computectx.kv_policy import KV_STEPS, KvFp8, KvStep
from computectx.nn import KVCache
from computectx.nn.kv_steps import held_steps, stored_steps, widen_steps

CPU = torch.device("cpu")
F32 = ComputeCtx.parity(CPU)
B, H, D, L = 2, 2, 8, 6


def _values(t: int, seed: int, b: int = B) -> torch.Tensor:
    # Each (token, head) vector at its own magnitude, 1e-3 .. 1e3.
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(b, H, t, 1, generator=gen) * 6 - 3)
    return torch.randn(b, H, t, D, generator=gen) * scale


def snapshot(cache: KVCache) -> tuple[list[bytes], dict[str, Any]]:
    """Every tensor's bytes and every attribute of ``cache``."""
    tensors = [t.view(torch.uint8).clone().numpy().tobytes() for t in _raw(cache)]
    attrs = {k: v for k, v in vars(cache).items() if not isinstance(v, torch.Tensor)}
    return tensors, attrs


def _raw(cache: KVCache) -> list[torch.Tensor]:
    return [t.contiguous().view(-1).view(torch.uint8) for t in cache.held]


def code_bound(x: torch.Tensor, step: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Half a code step (docs/serving.md, kv_quant): the format's relative rounding or half its
    smallest subnormal times the step, with float32 slack for the division and product."""
    rel = 2.0 ** -(fmt.mantissa_bits + 1)
    return (rel * x.abs() + 0.5 * fmt.min_subnormal * step) * (1 + 2.0**-20) + x.abs() * 2.0**-22


# ---------------------------------------------------------------------------------------
# Item 4: the window after a rollback.


@pytest.mark.parametrize("step", KV_STEPS)
def test_a_rollback_reads_each_positions_last_values(step: KvStep) -> None:
    # Issue 32 item 4: recent=4, positions 0..9 written, then position 3 again: read(4) gave
    # the values of 8, 9 and 6 for positions 0, 1 and 2. Each position now reads the last
    # values written at it: exactly where the ring holds it, its codes otherwise.
    kv = KvFp8(step=step, recent=4)
    window, plain = (
        KVCache(F32.with_kv(kv), 1, H, D, 16),
        KVCache(F32.with_kv(KvFp8(step=step)), 1, H, D, 16),
    )
    x = _values(10, seed=0, b=1)
    new = _values(1, seed=1, b=1)
    for c in (window, plain):
        for p in range(10):
            c.write(x[:, :, p : p + 1], -x[:, :, p : p + 1], torch.tensor(p))
        c.write(new, -new, torch.tensor(3))
    k, v = window.read(4)
    pk, pv = plain.read(4)
    assert torch.equal(k[:, :, :3], pk[:, :, :3]) and torch.equal(v[:, :, :3], pv[:, :, :3])
    assert torch.equal(k[:, :, 3:], new) and torch.equal(v[:, :, 3:], -new)
    want = torch.cat([x[:, :, :3], new], dim=2)
    assert bool(
        (
            (k - want).abs()
            <= code_bound(want, 2 * want.abs().amax(-1, keepdim=True) / 448, kv.format)
        ).all()
    )
    # The positions after the rollback read what was written there, exactly from the ring.
    k10, _ = window.read(10)
    assert torch.equal(k10[:, :, 8:], x[:, :, 8:10])


def test_a_window_holds_at_most_max_len_slots() -> None:
    # Issue 32 item 15: a window of recent=10**6 positions allocated 10**6 slots for a cache of
    # 8 positions. A window at least as long as the cache holds every position (exactly).
    cache = KVCache(F32.with_kv(KvFp8(recent=1000)), B, H, D, 8)
    assert cache.recent == 8 and cache.k_recent is not None and cache.k_recent.shape[2] == 8
    x = _values(8, seed=2)
    cache.append(x, x)
    assert torch.equal(cache.read()[0], x)


# ---------------------------------------------------------------------------------------
# Item 12 and "validate, then write": each check fails in turn, nothing changes.


def test_a_write_past_the_end_changes_nothing() -> None:
    # Issue 32 item 12: write(pos=2, T=3) with max_len=4 raised IndexError after replacing the
    # key codes of positions 2 and 3 (their steps not).
    cache = KVCache(F32.with_kv(KvFp8()), 1, H, D, 4)
    cache.write(_values(4, seed=3, b=1), _values(4, seed=4, b=1), torch.tensor(0))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"positions 2 \.\. 4 \(pos=2, T=3\).*max_len=4.*pos <= 1"):
        cache.write(_values(3, seed=5, b=1) * 100, _values(3, seed=6, b=1), torch.tensor(2))
    assert snapshot(cache) == before


def _caches() -> list[KVCache]:
    steps = (torch.full((H,), 0.01), torch.full((H,), 0.02))
    out = [KVCache(F32, B, H, D, L)]
    for step in KV_STEPS:
        out.append(KVCache(F32.with_kv(KvFp8(step=step, recent=3)), B, H, D, L))
        out.append(
            KVCache(F32.with_kv(KvFp8(scaling="per_head", step=step)), B, H, D, L, steps=steps)
        )
    for c in out:
        c.append(_values(3, seed=7), _values(3, seed=8))
    return out


_GOOD = _values(2, seed=9)
_BAD_WRITES: list[tuple[str, Callable[[KVCache], None]]] = [
    ("k not a tensor", lambda c: c.write(_GOOD.tolist(), _GOOD, torch.tensor(0))),  # type: ignore[arg-type]
    ("integer k", lambda c: c.write(_GOOD.long(), _GOOD, torch.tensor(0))),
    ("fp8 v", lambda c: c.write(_GOOD, _GOOD.to(torch.float8_e4m3fn), torch.tensor(0))),
    ("k, v shapes differ", lambda c: c.write(_GOOD, _GOOD[:, :, :1], torch.tensor(0))),
    ("wrong batch", lambda c: c.write(_GOOD[:1], _GOOD[:1], torch.tensor(0))),
    ("wrong head dim", lambda c: c.write(_GOOD[..., :4], _GOOD[..., :4], torch.tensor(0))),
    ("3-d k", lambda c: c.write(_GOOD[0], _GOOD[0], torch.tensor(0))),
    ("k on meta", lambda c: c.write(_GOOD.to("meta"), _GOOD, torch.tensor(0))),
    ("pos an int", lambda c: c.write(_GOOD, _GOOD, 0)),  # type: ignore[arg-type]
    ("pos int32", lambda c: c.write(_GOOD, _GOOD, torch.tensor(0, dtype=torch.int32))),
    ("pos 1-d", lambda c: c.write(_GOOD, _GOOD, torch.tensor([0]))),
    ("pos on meta", lambda c: c.write(_GOOD, _GOOD, torch.tensor(0, device="meta"))),
    ("pos negative", lambda c: c.write(_GOOD, _GOOD, torch.tensor(-1))),
    ("pos past the end", lambda c: c.write(_GOOD, _GOOD, torch.tensor(L - 1))),
    ("T past max_len", lambda c: c.write(_values(L + 1, 1), _values(L + 1, 1), torch.tensor(0))),
    ("append past the end", lambda c: c.append(_values(L + 1, 1), _values(L + 1, 1))),
    ("append integer v", lambda c: c.append(_GOOD, _GOOD.int())),
    ("append on meta", lambda c: c.append(_GOOD, _GOOD.to("meta"))),
    ("append wrong heads", lambda c: c.append(_GOOD[:, :1], _GOOD[:, :1])),
    ("reorder a list", lambda c: c.reorder([1, 0])),  # type: ignore[arg-type]
    ("reorder float rows", lambda c: c.reorder(torch.tensor([1.0, 0.0]))),
    ("reorder one row", lambda c: c.reorder(torch.tensor([1]))),
    ("reorder a row past B", lambda c: c.reorder(torch.tensor([0, B]))),
    ("reorder a negative row", lambda c: c.reorder(torch.tensor([-1, 0]))),
]


def test_a_refused_reorder_names_the_row_outside_and_caps_the_rows() -> None:
    cache = KVCache(F32, 10, H, D, L)
    rows = torch.arange(10)
    rows[9] = 10
    shown = r"rows \[0, 1, 2, 3, 4, 5, 6, 7, \.\.\. \(10 values\)\]"
    with pytest.raises(
        ValueError, match=shown + r" hold 1 row\(s\) outside \[0, 10\) .*: rows\[9\] = 10$"
    ):
        cache.reorder(rows)


@pytest.mark.parametrize(("name", "call"), _BAD_WRITES, ids=[n for n, _ in _BAD_WRITES])
def test_every_refused_call_changes_nothing(name: str, call: Callable[[KVCache], None]) -> None:
    for cache in _caches():
        before = snapshot(cache)
        with pytest.raises((TypeError, ValueError)):
            call(cache)
        assert snapshot(cache) == before, (name, cache.kv)


# ---------------------------------------------------------------------------------------
# Extreme finite values: the whole float32 range, both signs, subnormals.

_FINITE_F32 = st.floats(
    min_value=-3.4028234663852886e38,
    max_value=3.4028234663852886e38,
    allow_nan=False,
    allow_infinity=False,
    width=32,
)
_EXTREMES = [3.4028234663852886e38, 3.4e38, 1e38, 3e25, 1.8e19, 1.2e-38, 1e-40, 1e-45, 0.0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vector=st.lists(
        st.one_of(_FINITE_F32, st.sampled_from(_EXTREMES + [-e for e in _EXTREMES])),
        min_size=D,
        max_size=D,
    ),
    fmt=st.sampled_from(list(Fp8Format)),
)
def test_finite_in_gives_finite_out_for_every_step_format(
    vector: list[float], fmt: Fp8Format
) -> None:
    # quantize_kv, each step format's stored step, and the read back: never NaN, never inf,
    # within half a code step of the value, or one code step at the very top of float32
    # (kv_quant: a code whose product with its step would pass float32's max takes the one
    # below).
    x = torch.tensor(vector, dtype=torch.float32).view(1, 1, 1, D)
    codes, exact = quantize_kv(x, fmt)
    assert bool(torch.isfinite(exact).all()) and bool((exact > 0).all())
    for step in KV_STEPS:
        held = held_steps(exact, step)
        wide = widen_steps(held)
        assert torch.equal(wide, stored_steps(exact, step).to(torch.float32))
        assert bool((wide >= exact).all()) and bool(torch.isfinite(wide).all())
        codes, _ = quantize_kv(x, fmt, wide)
        back = dequantize_kv(codes, wide)
        assert bool(torch.isfinite(back).all()), (step, back)
        top = x.abs() > 2.0**127 * (2 - 2.0**-(fmt.mantissa_bits))  # within a code of the max
        bound = code_bound(x, wide.unsqueeze(-1), fmt)
        bound = torch.where(top, 2 * bound, bound)
        assert bool(((back - x).abs() <= bound).all()), (step, x, back)


@pytest.mark.parametrize("step", KV_STEPS)
def test_extreme_finite_values_through_every_cache(step: KvStep) -> None:
    # The same through the cache's own write and read, dynamic and calibrated (a value beyond
    # the calibrated amax saturates at fmt.max * step, finite), with and without the window.
    ext = torch.tensor(_EXTREMES + [-e for e in _EXTREMES][:-1], dtype=torch.float32)
    x = ext[torch.randperm(ext.numel(), generator=torch.Generator().manual_seed(0))][:D]
    x = torch.stack([x, x.flip(0)]).view(1, 1, 2, D).expand(B, H, 2, D).contiguous()
    steps = (torch.full((1,), 1e-3), torch.full((1,), 1e30))
    for kv, given_steps in (
        (KvFp8(step=step), None),
        (KvFp8(step=step, recent=1), None),
        (KvFp8(scaling="per_tensor", step=step), steps),
    ):
        cache = KVCache(F32.with_kv(kv), B, H, D, 4, steps=given_steps)
        cache.append(x, x)
        cache.write(x[:, :, :1], -x[:, :, :1], torch.tensor(2))
        k, v = cache.read(3)
        assert bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all()), kv


# ---------------------------------------------------------------------------------------
# Item 14: the compiled (inductor, fullgraph) decode step with e8m0 steps.


def test_the_inductor_compiled_decode_step_with_e8m0_steps_equals_eager() -> None:
    # Issue 32 item 14: InductorError "float8_e8m0fnu missing from DTYPE_TO_CPP". The cache
    # holds e8m0 steps as their bytes and hands the decode operator a view; the stored bytes
    # are the eager ones, bit for bit.
    from computectx.nn import ByteLM, LMConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=12)
    model = ByteLM(F32.with_kv(KvFp8(step="e8m0")), config).eval()
    eager, compiled = model.new_caches(1, 12), model.new_caches(1, 12)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    step = torch.compile(model.decode_step, fullgraph=True, backend="inductor")
    # One compile thread: no worker pool to start for a handful of kernels (half the time).
    with torch.no_grad(), torch._inductor.config.patch(compile_threads=1):
        model(ids[:, :4], eager)
        model(ids[:, :4], compiled)
        for i in range(4, 8):
            x, pos = ids[:, i : i + 1], torch.tensor(i)
            want = model.decode_step(x, pos, eager)
            torch.testing.assert_close(step(x, pos, compiled), want, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager[0].held, compiled[0].held, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert compiled[0].k_step is not None and compiled[0].k_step.dtype == torch.float8_e8m0fnu


# ---------------------------------------------------------------------------------------
# The model-based randomized test.


class KVCacheMachine(RuleBasedStateMachine):
    """``KVCache`` against a float32 model: the last values written at each position, the
    position each window slot holds, ``length``. Reads equal the model exactly where the
    window holds a position and within half a code step elsewhere; refused calls leave the
    cache byte for byte as it was."""

    cache: KVCache

    @initialize(
        step=st.sampled_from(KV_STEPS),
        recent=st.sampled_from([0, 2, 4, 9]),
        scaling=st.sampled_from(["per_token_head", "per_tensor"]),
        fmt=st.sampled_from(list(Fp8Format)),
    )
    def build(self, step: KvStep, recent: int, scaling: str, fmt: Fp8Format) -> None:
        kv = KvFp8(format=fmt, scaling=scaling, step=step, recent=recent)  # type: ignore[arg-type]
        steps = None
        self.bound_amax: float | None = None
        if kv.static:
            self.bound_amax = 1e3 * 4.5  # drawn values stay below (randn * 1e3 < 4.5e3)
            s = torch.full((1,), self.bound_amax / fmt.max)
            steps = (s, s)
        self.kv = kv
        self.cache = KVCache(F32.with_kv(kv), B, H, D, L, steps=steps)
        self.slots = min(recent, L)
        self.k = torch.zeros(B, H, L, D)
        self.v = torch.zeros(B, H, L, D)
        self.tags = [-1] * self.slots
        self.length = 0

    def _model_write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        t = k.shape[2]
        self.k[:, :, start : start + t] = k
        self.v[:, :, start : start + t] = v
        for p in range(max(start, start + t - self.slots), start + t):
            self.tags[p % self.slots] = p

    def _refused(self, call: Callable[[], None]) -> None:
        before = snapshot(self.cache)
        with pytest.raises((TypeError, ValueError)):
            call()
        assert snapshot(self.cache) == before

    def _clip(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.bound_amax is None else x.clamp(-self.bound_amax, self.bound_amax)

    @rule(t=st.integers(1, 4), seed=st.integers(0, 2**16))
    def append(self, t: int, seed: int) -> None:
        k, v = self._clip(_values(t, seed)), self._clip(_values(t, seed + 1))
        if self.length + t > L:
            self._refused(lambda: self.cache.append(k, v))
            return
        self.cache.append(k, v)
        self._model_write(k, v, self.length)
        self.length += t

    @rule(pos=st.integers(-2, L + 1), t=st.integers(1, 4), seed=st.integers(0, 2**16))
    def write(self, pos: int, t: int, seed: int) -> None:
        # Any position: forward, a rewrite, a rollback, or past either end (refused).
        k, v = self._clip(_values(t, seed)), self._clip(_values(t, seed + 1))
        if pos < 0 or pos + t > L:
            self._refused(lambda: self.cache.write(k, v, torch.tensor(pos)))
            return
        self.cache.write(k, v, torch.tensor(pos))
        self._model_write(k, v, pos)

    @rule(which=st.sampled_from(range(len(_BAD_WRITES))))
    def refused(self, which: int) -> None:
        self._refused(lambda: _BAD_WRITES[which][1](self.cache))

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.k.zero_()
        self.v.zero_()
        self.tags = [-1] * self.slots
        self.length = 0

    @precondition(lambda self: self.length > 0)
    @rule(flip=st.booleans())
    def reorder(self, flip: bool) -> None:
        rows = torch.tensor([1, 0] if flip else [0, 0])
        self.cache.reorder(rows)
        self.k, self.v = self.k[rows].clone(), self.v[rows].clone()

    @rule(end=st.integers(0, L))
    def read(self, end: int) -> None:
        self._check(end)

    @invariant()
    def reads_match_the_model(self) -> None:
        if hasattr(self, "cache"):
            self._check(L)
            assert self.cache.length == self.length

    def _check(self, end: int) -> None:
        got = self.cache.read(end)
        fmt = self.kv.format
        for x, want in zip(got, (self.k[:, :, :end], self.v[:, :, :end]), strict=True):
            assert x.shape == want.shape and bool(torch.isfinite(x).all())
            if self.bound_amax is not None:
                step = torch.full_like(want[..., :1], 2 * self.bound_amax / fmt.max)
            else:  # each vector's step: amax / max rounded up, at most 2x for e8m0
                step = 2 * want.abs().amax(-1, keepdim=True) / fmt.max
            ok = (x - want).abs() <= code_bound(want, step, fmt)
            assert bool(ok.all()), (self.kv, end)
            for p in range(end):
                if self.slots and self.tags[p % self.slots] == p:
                    assert torch.equal(x[:, :, p], want[:, :, p]), (self.kv, p)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=40, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_a_dtype_cache_refuses_the_same_calls() -> None:
    # The bf16 twin of the fp8 cache: the same checks, nothing changed.
    cache = KVCache(F32.with_kv(DType.BF16), B, H, D, L)
    cache.append(_values(3, seed=1), _values(3, seed=2))
    for _, call in _BAD_WRITES:
        before = snapshot(cache)
        with pytest.raises((TypeError, ValueError)):
            call(cache)
        assert snapshot(cache) == before
