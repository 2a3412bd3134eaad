"""The native CPU kernel of the compact Adam step (``computectx.kernels.host_adam``) against
its twin (``fused._update``, torch ops), and the counter-based stochastic rounding.

Tolerance (docs/memory.md, "The compact step's implementation"): torch's ``lerp`` and
``addcmul`` fuse a multiply-add in their vector paths and the kernel does not, so the new
moments may differ in the last float32 bit; then the parameter agrees within a few float32
ulps plus 2**-20 of the learning rate (``assert_weight_within_bound``), a block's scale within
one ulp, and a code differs only where the value lies within that rounding of a decision
boundary (to a neighbouring code). Where the arithmetic is exact
in both (``beta1 = beta2 = 0``: the new moments are ``g`` and ``g * g``) everything is equal
bit for bit, which holds the encoders, the nearest-code search and the write-back exact.
"""

from __future__ import annotations

import _ctypes
import functools
import hashlib
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from computectx import ComputeCtx
from computectx.kernels import host_adam
from computectx.memory import CompactOptimizer, OffloadedOptimizer
from computectx.memory._rounding import draw_key, keyed_bits, stochastic_round_keyed
from computectx.memory.optim import fused
from computectx.memory.optim.fused import adam_update
from computectx.memory.optim.state import Packed, decode, encode
from computectx.memory.optim.state.packed import spec_of, unpack4
from computectx.optim_state import OptimState

needs_kernel = pytest.mark.skipif(
    host_adam.library() is None, reason="the native kernel did not build here"
)
"""On the tests that run the built kernel; the others (no compiler: the twin, the warning;
the twin's rounding) run everywhere."""

BLOCK = 32
FORMATS = ["f32", "bf16", "int8", "fp8", "int4"]
LR = 1e-2


def assert_weight_within_bound(native: torch.Tensor, twin: torch.Tensor) -> None:
    """The documented bound of one step from the same state: 2**-20 of the weight plus
    2**-20 of the learning rate (a few float32 ulps of the weight and of the update)."""
    torch.testing.assert_close(native, twin, rtol=2**-20, atol=2**-20 * LR)


def state_of(fmt: str) -> OptimState:
    if fmt in ("f32", "bf16"):
        return OptimState.parse(fmt if fmt == "f32" else "bf16/min=0")
    return OptimState.parse(f"{fmt}/block={BLOCK}/min=0")


def moments(shape: tuple[int, ...], st: OptimState, gen: torch.Generator) -> list[Any]:
    m = torch.randn(shape, generator=gen) * 1e-2
    v = torch.rand(shape, generator=gen) * 1e-4
    if st.format == "f32":
        return [m, v]
    return [encode(m, st, "signed"), encode(v, st, "unsigned")]


def clone(x: Any) -> Any:
    if isinstance(x, Packed):
        return Packed(
            x.format, x.kind, x.shape, x.block, {k: t.clone() for k, t in x.parts.items()}
        )
    return x.clone()


def step(
    p: torch.Tensor,
    g: torch.Tensor,
    mv: list[Any],
    st: OptimState,
    native: bool,
    *,
    count: int = 3,
    beta1: float = 0.9,
    beta2: float = 0.99,
    decoupled: bool = True,
    weight_decay: float = 0.1,
    maximize: bool = False,
    generator: torch.Generator | None = None,
) -> list[Any]:
    m, v = adam_update(
        p,
        g,
        mv[0],
        mv[1],
        count,
        lr=LR,
        beta1=beta1,
        beta2=beta2,
        eps=1e-8,
        weight_decay=weight_decay,
        decoupled=decoupled,
        maximize=maximize,
        state=st,
        generator=generator,
        compiled=False,
        native=native,
    )
    return [m, v]


def codes_of(x: Packed) -> torch.Tensor:
    c = x.parts["codes"]
    return unpack4(c, x.numel) if x.format == "int4" else c.to(torch.int64)


def assert_close_moment(a: Any, b: Any) -> None:
    """Native ``a`` against twin ``b``, at the documented tolerance."""
    if not isinstance(a, Packed):  # an ulp of the larger term (lerp may cancel)
        torch.testing.assert_close(a, b, rtol=2**-21, atol=2**-22 * float(b.abs().max()))
        return
    assert a.parts.keys() == b.parts.keys() and spec_of(a) == spec_of(b)
    if a.format == "bf16":
        x, y = a.parts["values"].float(), b.parts["values"].float()
        torch.testing.assert_close(x, y, rtol=2**-7, atol=0.0)  # one bf16 ulp at most
        assert float((x != y).float().mean()) < 0.02
        return
    for name in a.parts.keys() - {"codes"}:
        torch.testing.assert_close(a.parts[name], b.parts[name], rtol=2**-22, atol=0.0)
    ca, cb = codes_of(a), codes_of(b)
    if a.format == "fp8":  # neighbours in the code's order (same sign)
        ca, cb = ca & 127, cb & 127
    differ = ca != cb
    assert int((ca - cb).abs().max()) <= 1
    assert int(differ.sum()) <= max(2, ca.numel() // 200)


def run_pair(
    fmt: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, **kw: Any
) -> tuple[list[Any], list[Any]]:
    """The same step by the twin and the kernel, from the same random state."""
    st = state_of(fmt)
    gen = torch.Generator().manual_seed(sum(shape) + len(fmt))
    p0 = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    mv = moments(shape, st, gen)
    out = []
    for native in (False, True):
        p = p0.clone()
        sr = torch.Generator().manual_seed(7) if dtype != torch.float32 else None
        out.append([p, *step(p, g, [clone(x) for x in mv], st, native, generator=sr, **kw)])
    return out[0], out[1]


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "shape", [(1,), (BLOCK - 1,), (BLOCK + 1,), (3 * BLOCK + 5,), (51, 99), (64, 128)]
)
def test_native_step_agrees_with_the_twin(fmt: str, shape: tuple[int, ...]) -> None:
    twin, native = run_pair(fmt, shape)
    assert_weight_within_bound(native[0], twin[0])
    assert_close_moment(native[1], twin[1])
    assert_close_moment(native[2], twin[2])


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize(
    ("decoupled", "weight_decay", "maximize"), [(False, 0.1, False), (True, 0.0, True)]
)
def test_l2_decay_and_maximize_agree_with_the_twin(
    fmt: str, decoupled: bool, weight_decay: float, maximize: bool
) -> None:
    kw: dict[str, Any] = {
        "decoupled": decoupled,
        "weight_decay": weight_decay,
        "maximize": maximize,
    }
    twin, native = run_pair(fmt, (51, 99), **kw)
    assert_weight_within_bound(native[0], twin[0])
    assert_close_moment(native[1], twin[1])
    assert_close_moment(native[2], twin[2])


def adversarial(n: int, gen: torch.Generator) -> torch.Tensor:
    """Gradients with zero blocks, huge finite values, subnormals and ordinary ones."""
    g = torch.randn(n, generator=gen)
    g[:BLOCK] = 0.0  # a zero block
    g[BLOCK : BLOCK + 4] = torch.tensor([1e38, -1e38, 1e-40, -1e-44])
    g[2 * BLOCK : 3 * BLOCK] *= 1e-42  # a block of subnormals (and their squares: 0)
    g[3 * BLOCK + 1] = 3e19  # its square overflows: v saturates
    return g


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(4 * BLOCK + 7,), (51, 99)])
def test_exact_arithmetic_gives_identical_codes_scales_and_weights(
    fmt: str, shape: tuple[int, ...]
) -> None:
    # beta1 = beta2 = 0: the new moments are g and g * g in both, so every byte agrees.
    st = state_of(fmt)
    gen = torch.Generator().manual_seed(3)
    numel = torch.Size(shape).numel()
    g = adversarial(numel, gen).view(shape)
    p0 = torch.randn(shape, generator=gen)
    mv = moments(shape, st, gen)
    outs = []
    for native in (False, True):
        p = p0.clone()
        outs.append([p, *step(p, g, [clone(x) for x in mv], st, native, beta1=0.0, beta2=0.0)])
    for a, b in zip(outs[0], outs[1], strict=True):
        if isinstance(a, Packed):
            assert a.parts.keys() == b.parts.keys()
            for k in a.parts:
                assert torch.equal(a.parts[k], b.parts[k]), (fmt, k)
        else:
            assert torch.equal(a, b), fmt


@needs_kernel
def test_bf16_codes_at_the_edges_of_the_range_are_the_twins() -> None:
    # beta1 = beta2 = 0: m = g and v = g * g exactly. Around bf16's largest (rounding to it,
    # the tie that rounds to inf, FLT_MAX: clamped), a square that overflows, squares below
    # half of bf16's smallest subnormal (an unsigned code 0 lifted to 1) and just above, NaN
    # (a NaN either way: the twin's keeps a payload), each also negated.
    st = state_of("bf16")
    edges = [0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F7F0000, 0x00000001]
    bits = torch.tensor(edges, dtype=torch.int64).to(torch.int32).view(torch.float32)
    # (Not -0.0: the twin's vector lerp may give m = -0.0 where the kernel's gives +0.0.)
    tiny = torch.tensor([5e-21, -5e-21, 8e-21, 3e19, 1.0, 0.0])
    g = torch.cat([bits, -bits, tiny, torch.randn(64, generator=torch.Generator().manual_seed(2))])
    outs = []
    for native in (False, True):
        mv = moments(tuple(g.shape), st, torch.Generator().manual_seed(4))
        outs.append(step(g.clone(), g, mv, st, native, beta1=0.0, beta2=0.0))
    for a, b in zip(outs[0], outs[1], strict=True):
        x, y = a.parts["values"], b.parts["values"]
        nan = x.isnan()  # the kernel's NaN is 0x7FC0, the twin's keeps a payload
        assert torch.equal(nan, y.isnan())
        assert torch.equal(x[~nan].view(torch.int16), y[~nan].view(torch.int16))


@needs_kernel
def test_int8_codes_of_a_large_tensor_are_the_twins() -> None:
    # From 65536 elements int8 takes the one-load table (code and bound in one word), and
    # (AVX-512) keeps an old code where a check finds it still the nearest; beta1 = beta2 = 0
    # makes the arithmetic exact, so every code, scale and weight is the twin's.
    st = OptimState.parse("int8/min=0")
    gen = torch.Generator().manual_seed(5)
    shape = (257, 256)
    g = adversarial(shape[0] * shape[1], gen).view(shape)
    g[7] = torch.linspace(-1, 1, 256)  # every code: a block spanning the map
    g[8] = -g[7].abs().sqrt()
    g[9, :4] = float("nan")  # a NaN block (its scale NaN, normalized by 1)
    p0 = torch.randn(shape, generator=gen)
    mv = moments(shape, st, gen)
    # A second step from each one's result: the same gradient but for some rows, so most old
    # codes are still the nearest (the kernel keeps them after a check) and some are not.
    g2 = g.clone()
    g2[100:140] = torch.randn(40, shape[1], generator=gen)
    g2[150, ::7] *= 1.01
    outs = []
    for native in (False, True):
        p = p0.clone()
        mv1 = step(p, g, [clone(x) for x in mv], st, native, beta1=0.0, beta2=0.0)
        first = [p.clone(), *(clone(x) for x in mv1)]  # (the kernel writes codes in place)
        outs.append([*first, p, *step(p, g2, mv1, st, native, beta1=0.0, beta2=0.0)])
    for a, b in zip(outs[0], outs[1], strict=True):
        pa = a.parts if isinstance(a, Packed) else {"": a}
        pb = b.parts if isinstance(b, Packed) else {"": b}
        for k in pa:
            torch.testing.assert_close(pa[k], pb[k], rtol=0.0, atol=0.0, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4", "bf16"])
def test_the_result_does_not_depend_on_the_thread_count(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused, "NATIVE_MIN_PER_THREAD", 64)
    threads = torch.get_num_threads()
    outs = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outs.append(run_pair(fmt, (96, 131))[1])
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            pa = a.parts if isinstance(a, Packed) else {"": a}
            pb = b.parts if isinstance(b, Packed) else {"": b}
            assert all(torch.equal(pa[k], pb[k]) for k in pa)


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_vector_code_equals_the_portable_build_and_the_twin(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of 128 (the hand-written AVX-512 loops take 64 elements at a time) and a short
    # last block (their scalar tails); the portable build has none of that code.
    st = OptimState.parse(fmt if fmt in ("f32", "bf16") else f"{fmt}/block=128/min=0")
    gen = torch.Generator().manual_seed(11)
    shape = (5, 3 * 128 + 23)
    p0, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    g[0, :128] *= 1e-41  # subnormal values and squares
    mv = moments(shape, st, gen)
    portable_lib = host_adam._library(True)
    assert portable_lib is not None
    outs = []
    for build in ("twin", "native", "portable"):
        if build == "portable":
            monkeypatch.setattr(host_adam, "library", lambda: portable_lib)
        p = p0.clone()
        outs.append([p, *step(p, g, [clone(x) for x in mv], st, build != "twin")])
    twin, native, portable = outs
    assert_weight_within_bound(native[0], twin[0])
    for a, b, c in zip(native[1:], twin[1:], portable[1:], strict=True):
        assert_close_moment(a, b)
        pa = a.parts if isinstance(a, Packed) else {"": a}
        pc = c.parts if isinstance(c, Packed) else {"": c}
        assert all(torch.equal(pa[k], pc[k]) for k in pa), fmt
    assert torch.equal(native[0], portable[0])


def edge_quotients() -> torch.Tensor:
    """Gradients whose blocks (of BLOCK) put the encode's x / absmax at the edges of the
    division by a reciprocal: dividends about 2**-100 and quotients about 2**-124 (either
    side), zeros and -0, subnormals; scales at 2**-60 and 2**60 (either side)."""
    tiny = [2.0**-100, 2.0**-100 * (1 - 2**-24), 2.0**-124, 2.0**-124 * (1 + 2**-23), 1e-40, 0.0]
    blocks = []
    for top in (1.0, 2.0**60, 2.0**60 * (1 + 2**-23), 2.0**-60, 2.0**-60 * (1 - 2**-24), 3.0):
        b = [top, -0.0] + [sign * t * top**e for t in tiny for sign in (1, -1) for e in (0, 1)]
        b += [top * (1 - k * 2**-20) / 3 for k in range(BLOCK - len(b))]
        blocks.append(torch.tensor(b[:BLOCK], dtype=torch.float64).clamp(-3e38, 3e38))
    return torch.cat(blocks).float()


@needs_kernel
@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "int4"])
def test_divisions_by_a_reciprocal_equal_the_portable_builds_divisions(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # beta1 = beta2 = 0: the new moments are g and g * g, so the encode's quotients are the
    # edge cases of edge_quotients; then a step with beta2 = 0.999 at step 1 (sqrt(bc2)
    # about 0.03, not 1): the update's sqrt(v) / sqrt(bc2), seen in the last bits of weights
    # that start at 0 (each is its update). The portable build divides.
    st = state_of(fmt)
    gen = torch.Generator().manual_seed(3)
    g = torch.cat([edge_quotients(), torch.randn(128 * BLOCK, generator=gen)])
    p0 = torch.zeros(g.numel())
    mv = moments(g.shape, st, gen)
    portable_lib = host_adam._library(True)
    assert portable_lib is not None
    outs = []
    for lib in (host_adam.library(), portable_lib):
        monkeypatch.setattr(host_adam, "library", lambda lib=lib: lib)
        p = p0.clone()
        state = step(p, g, [clone(x) for x in mv], st, True, count=1, beta1=0.0, beta2=0.0)
        state = step(p, g * 1e-3, state, st, True, count=1, beta2=0.999)
        outs.append([p, *state])
    for a, b in zip(*outs, strict=True):
        pa, pb = bits(a), bits(b)
        assert all(torch.equal(pa[k], pb[k]) for k in pa), fmt


# ----- bf16 / f16 weights: the write-back --------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["f32", "int8"])
def test_stochastic_rounding_is_the_same_in_the_kernel_and_the_twin(
    dtype: torch.dtype, fmt: str
) -> None:
    # beta1 = beta2 = 0: the same float32 weight in both, then the same rounding bits.
    st = state_of(fmt)
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(3 * BLOCK + 3, generator=gen).to(dtype)
    g = torch.randn(p0.shape, generator=gen).to(dtype)
    mv = moments(p0.shape, st, gen)
    outs = []
    for native in (False, True):
        p = p0.clone()
        sr = torch.Generator().manual_seed(11)
        step(p, g, [clone(x) for x in mv], st, native, beta1=0.0, beta2=0.0, generator=sr)
        outs.append(p)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], p0)


def test_keyed_bits_are_splitmix64_of_key_and_index() -> None:
    def reference(key: int, i: int) -> int:
        mask = 2**64 - 1
        z = (key + (i + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    for key in (0, 1, -(2**63), 2**63 - 1, -12345):
        got = keyed_bits(torch.tensor(key, dtype=torch.int64), 5).tolist()
        assert [b % 2**64 for b in got] == [reference(key % 2**64, i) for i in range(5)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_keyed_stochastic_rounding_is_unbiased_and_leaves_inf_and_nan(dtype: torch.dtype) -> None:
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    x = torch.full((200_000,), 1.0 + 0.3 * ulp)
    key = draw_key(torch.Generator().manual_seed(0))
    r = stochastic_round_keyed(x, dtype, key).float()
    assert set(r.tolist()) == {1.0, 1.0 + ulp}
    sigma = ulp * (0.3 * 0.7) ** 0.5 / x.numel() ** 0.5
    assert abs(float(r.mean()) - float(x[0])) < 5 * sigma
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    out = stochastic_round_keyed(special, dtype, key).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and bool(out[2].isnan())
    assert out[3] == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_saturates_a_finite_value_beyond_the_range(dtype: torch.dtype) -> None:
    # Finite in, finite out: a float32 value beyond the largest finite one of the dtype
    # (where rounding to nearest gives inf from the midpoint up) rounds to that largest one;
    # inf and NaN stay.
    top = float(torch.finfo(dtype).max)
    f32max = float(torch.finfo(torch.float32).max)
    ulp = 2.0 ** (127 - 7) if dtype == torch.bfloat16 else 32.0
    x = torch.tensor([top + ulp / 4, top + ulp * 3 / 4, f32max, top, float("inf"), float("nan")])
    x = torch.cat([x, -x])
    key = draw_key(torch.Generator().manual_seed(0))
    for _ in range(20):
        key = key + 1
        r = stochastic_round_keyed(x, dtype, key).float()
        want = torch.tensor([top, top, top, top, float("inf"), float("nan")])
        torch.testing.assert_close(r, torch.cat([want, -want]), rtol=0, atol=0, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_stochastic_rounding_saturates_as_the_twins(dtype: torch.dtype) -> None:
    # A weight at the dtype's largest finite value and an update that takes it beyond, below
    # and above the midpoint: the kernel's write-back saturates as the twin's.
    top = float(torch.finfo(dtype).max)
    ulp = 2.0 ** (127 - 7) if dtype == torch.bfloat16 else 32.0
    for lr in (ulp / 4, ulp * 3 / 4):  # an update below and above the midpoint
        outs = []
        for native in (False, True):
            p = torch.full((4 * BLOCK + 3,), top).to(dtype)
            adam_update(
                p,
                -torch.ones(p.shape),
                torch.zeros(p.shape),
                torch.zeros(p.shape),
                1,
                lr=lr,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.0,
                decoupled=True,
                maximize=False,
                state=OptimState(),
                generator=torch.Generator().manual_seed(5),
                compiled=False,
                native=native,
            )
            outs.append(p)
        assert torch.equal(outs[0], outs[1])
        assert bool((outs[1].float() == top).all()), lr


@needs_kernel
def test_fp8_blocks_too_small_for_the_scale_decode_the_same_though_codes_may_differ() -> None:
    # A block whose absmax / 448 underflows to 0 (subnormal moments): the kernel's codes may
    # differ from the twin's, but every code decodes to the same value, and the weights agree.
    st = OptimState.parse(f"fp8/block={BLOCK}/min=0")
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(8 * BLOCK + 1, generator=gen) * 1e-44 for _ in range(3)]
    p0 = torch.randn(8 * BLOCK + 1, generator=gen)
    runs = []
    for native in (False, True):
        p, zero = p0.clone(), torch.zeros(p0.shape)
        mv: list[Any] = [encode(zero, st, "signed"), encode(zero, st, "unsigned")]
        seen = []
        for count, g in enumerate(grads, 1):
            mv = step(p, g, mv, st, native, count=count)
            seen.append([p.clone(), decode(mv[0]), decode(mv[1])])
        runs.append(seen)
    for a, b in zip(*runs, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


@needs_kernel
def test_one_key_per_parameter_per_step() -> None:
    gen = torch.Generator().manual_seed(1)
    draw_key(gen)
    after_one = gen.get_state()
    p = torch.randn(1000).to(torch.bfloat16)
    gen2 = torch.Generator().manual_seed(1)
    step(
        p,
        torch.randn(1000),
        [torch.zeros(1000), torch.zeros(1000)],
        OptimState(),
        True,
        count=1,
        generator=gen2,
    )
    assert torch.equal(gen2.get_state(), after_one)


# ----- no compiler: the twin, with one warning ---------------------------------------------


def forget_builds() -> None:
    host_adam._load.cache_clear()
    host_adam._warn.cache_clear()


def failing_compiler(folder: Path, *, version: bool = False) -> str:
    """A compiler that fails (as ``g++`` without its back end), whatever ``PATH`` holds;
    with ``version``, ``--version`` succeeds and only a build would fail."""
    path = folder / "failing-g++"
    answer = 'if [ "$1" = --version ]; then echo "failing-g++ 1.0"; exit 0; fi\n' if version else ""
    error = "echo 'failing-g++: fatal error: no back end' >&2\nexit 1\n"
    path.write_text(f"#!/bin/sh\n{answer}{error}")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("world", [1, 2])
def test_a_failed_build_on_one_of_several_ranks_raises_instead_of_drifting(
    world: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # The twin rounds differently in the last bits: a rank on it while the others run the
    # kernel would leave the replicas apart. Under several ranks the step raises, naming the
    # error and the remedies; compile=False (the twin everywhere) still runs.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = failing_compiler(tmp_path)
    monkeypatch.setattr(host_adam, "COMPILER", compiler)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: world - 1)
    forget_builds()
    ctx = ComputeCtx.parity("cpu").with_optim_state(OptimState.parse("int8/min=0"))
    try:
        for compile in (None, False):
            p = torch.nn.Parameter(torch.randn(3 * BLOCK))
            opt = CompactOptimizer([p], ctx, lr=1e-2, compile=compile)
            p.grad = torch.randn(3 * BLOCK)
            if compile is False:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    opt.step()
            elif world > 1:
                match = (
                    f"(?s)could not be built with '{re.escape(compiler)}' on rank 1 of 2 "
                    r".*no back end.*g\+\+\) on every node.*compile=False"
                )
                for _ in range(2):  # at every step, not once
                    with pytest.raises(RuntimeError, match=match):
                        opt.step()
            else:
                with pytest.warns(
                    RuntimeWarning, match="(?s)could not be built with .*no back end"
                ):
                    opt.step()
    finally:
        forget_builds()


def cheap_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Builds of a stand-in source, for the tests of the cache's mechanics (hash, atomic
    replacement, rebuilds): the kernel's three C entry points, its ABI and nothing else, so
    that each build takes a fraction of a second instead of the kernel's several; ``_build``
    and ``_load`` run as they do for the kernel (every other test here builds the real one)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = tmp_path / "host_adam_stand_in.cpp"
    source.write_text(
        "#include <cstdint>\n"
        f'extern "C" int cc_host_adam_abi(void) {{ return {host_adam.ABI}; }}\n'
        'extern "C" int cc_host_adam_step(const void*) { return 1; }\n'
        'extern "C" int cc_host_adam_cleared(const void*, int64_t, int32_t, int32_t) '
        "{ return 0; }\n"
    )
    monkeypatch.setattr(host_adam, "SOURCE", source)


@needs_kernel
def test_a_truncated_or_foreign_cached_library_is_rebuilt_not_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # A truncated library mapped by the loader dies with SIGBUS at its first call, and a
    # foreign one lacks the symbols: the sidecar's sha256 (written after the library) keeps
    # both from being loaded, and the next use rebuilds.
    cheap_builds(monkeypatch, tmp_path)
    target = host_adam._build(host_adam.COMPILER)
    sidecar = target.with_name(target.name + ".sha256")
    whole = target.read_bytes()
    assert sidecar.read_text().split() == [hashlib.sha256(whole).hexdigest()]
    foreign = Path(_ctypes.__file__).read_bytes()  # a shared library without the kernel
    for bad in (whole[:4096], foreign):
        target.write_bytes(bad)
        assert not host_adam._intact(target)
        assert host_adam._build(host_adam.COMPILER) == target
        assert host_adam._intact(target) and len(target.read_bytes()) == len(whole)
    assert [f.name for f in target.parent.iterdir() if f.name.startswith(".host_adam-")] == []
    # A foreign library with a matching sidecar loads but is not the kernel: rebuilt once.
    target.write_bytes(foreign)
    sidecar.write_text(hashlib.sha256(foreign).hexdigest())
    forget_builds()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lib = host_adam.library()
        assert lib is not None and lib.cc_host_adam_abi() == host_adam.ABI
        assert host_adam._intact(target) and target.read_bytes() != foreign
    finally:
        forget_builds()


# ----- no CPU feature changes a result -----------------------------------------------------

BASELINE_FLAGS = tuple("-march=x86-64" if f == "-march=native" else f for f in host_adam.FLAGS)


@functools.cache
def baseline_lib() -> Any:
    """The kernel built for the x86-64 baseline: no AVX, AVX-512 or F16C."""
    return host_adam._open(host_adam._build(host_adam.COMPILER, BASELINE_FLAGS))


def bits(x: Any) -> dict[str, torch.Tensor]:
    parts = x.parts if isinstance(x, Packed) else {"": x}
    return {k: t.view(torch.uint8) if t.dtype.itemsize == 1 else t for k, t in parts.items()}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_baseline_x86_64_build_gives_the_same_bits_as_the_native_one(
    fmt: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nodes with other CPUs build other code (-march=native); ranks must still agree bit for
    # bit. Float16 without F16C takes the same path (software conversions), not the twin.
    if not host_adam._cpu_flags().startswith("flags"):
        pytest.skip("not an x86 CPU")
    native_lib, base = host_adam.library(), baseline_lib()
    st = state_of(fmt)
    gen = torch.Generator().manual_seed(13)
    shape = (7, 3 * BLOCK + 5)
    p0 = (torch.randn(shape, generator=gen) * 3).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    g[0, :BLOCK] *= 1e-41 if dtype == torch.float32 else 1e-6  # subnormal in the dtype
    mv = moments(shape, st, gen)
    outs = []
    for lib in (native_lib, base):
        monkeypatch.setattr(host_adam, "library", lambda lib=lib: lib)
        p = p0.clone()
        sr = torch.Generator().manual_seed(3) if dtype != torch.float32 else None
        outs.append([p, *step(p, g, [clone(x) for x in mv], st, True, generator=sr)])
    for a, b in zip(outs[0], outs[1], strict=True):
        ba, bb = bits(a), bits(b)
        assert all(torch.equal(ba[k].view(torch.uint8), bb[k].view(torch.uint8)) for k in ba)


@needs_kernel
def test_float16_conversions_without_f16c_are_the_hardwares_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every float16 pattern (NaN payloads, infinities, subnormals) as weight and gradient,
    # and results that overflow, underflow or round to the subnormals.
    if "f16c" not in host_adam._cpu_flags().split():
        pytest.skip("no F16C to compare with")
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    p0 = codes.view(torch.float16)
    g = codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(1))]
    outs = []
    for lib in (host_adam.library(), baseline_lib()):
        monkeypatch.setattr(host_adam, "library", lambda lib=lib: lib)
        for sr in (None, torch.Generator().manual_seed(2)):
            p = p0.clone()
            mv = [torch.zeros(p.shape), torch.zeros(p.shape)]
            step(p, g.view(torch.float16), mv, OptimState(), True, count=1, generator=sr)
            outs.append(p.view(torch.int16))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


@pytest.mark.parametrize("failure", ["the compiler fails", "no compiler", "no cache folder"])
def test_a_failed_build_warns_once_and_runs_the_twin(
    failure: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # Runs with or without a compiler here: a compiler that fails, none at all, or a cache
    # folder that cannot be made (a file in its place) give one RuntimeWarning quoting the
    # error, then the twin, in one process; an optimizer with compile=None then steps as
    # with compile=False, bit for bit.
    cache = tmp_path / "cache"
    if failure == "the compiler fails":
        compiler = failing_compiler(tmp_path)
    elif failure == "no compiler":
        compiler = str(tmp_path / "no-such-g++")
    else:
        compiler = failing_compiler(tmp_path, version=True)
        cache.write_text("")
    monkeypatch.setattr(host_adam, "COMPILER", compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    why = {
        "the compiler fails": "--version failed: failing-g\\+\\+: fatal error: no back end",
        "no compiler": "could not be run",
        "no cache folder": "Not a directory",
    }[failure]
    forget_builds()
    try:
        with pytest.warns(RuntimeWarning, match=f"(?s)could not be built with .*twin.*{why}"):
            twin, native = run_pair("int8", (3 * BLOCK,))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run_pair("int8", (3 * BLOCK,))  # no second warning
            ctx = ComputeCtx.parity("cpu").with_optim_state(OptimState.parse("int8/min=0"))
            stepped = []
            for compile in (None, False):
                p = torch.nn.Parameter(torch.linspace(-1, 1, 3 * BLOCK))
                opt = CompactOptimizer([p], ctx, lr=1e-2, compile=compile)
                p.grad = torch.linspace(1, -2, 3 * BLOCK)
                opt.step()
                stepped.append(p.detach())
    finally:
        forget_builds()
    assert torch.equal(native[0], twin[0])  # the twin ran both
    assert all(torch.equal(native[1].parts[k], twin[1].parts[k]) for k in twin[1].parts)
    assert torch.equal(stepped[0], stepped[1])
    assert host_adam.cache_dir() == cache / "computectx" / "host_adam"
    assert not list(host_adam.cache_dir().glob("*.so"))


@needs_kernel
def test_the_build_is_cached_by_a_hash_and_replaced_atomically(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    cheap_builds(monkeypatch, tmp_path)
    first = host_adam._build(host_adam.COMPILER)
    assert first.exists() and first.parent == host_adam.cache_dir()
    assert host_adam._build(host_adam.COMPILER) == first  # cached
    assert [f.name for f in first.parent.iterdir() if f.name.startswith(".host_adam-")] == []


# ----- end to end --------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("cls", [CompactOptimizer, OffloadedOptimizer])
def test_optimizers_with_int8_state_step_natively_like_compile_false(cls: Any) -> None:
    ctx = ComputeCtx.parity("cpu").with_optim_state(OptimState.parse("int8/min=0"))
    runs = []
    for compile in (None, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 33), torch.nn.Linear(33, 7))
        opt = cls(model.parameters(), ctx, lr=1e-2, weight_decay=0.1, compile=compile)
        for i in range(3):
            x = torch.randn(16, 40, generator=torch.Generator().manual_seed(i))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(model)
    for a, b in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
