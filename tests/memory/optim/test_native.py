"""The native CPU kernel of the compact Adam step (``computectx.kernels.host_adam``) against
its twin (``fused._update``, torch ops), and the counter-based stochastic rounding.

Tolerance (docs/memory.md, "The compact step's implementation"): torch's ``lerp`` and
``addcmul`` fuse a multiply-add in their vector paths and the kernel does not, so the new
moments may differ in the last float32 bit; then the parameter agrees within a few float32
ulps, a block's scale within one ulp, and a code differs only where the value lies within
that rounding of a decision boundary (to a neighbouring code). Where the arithmetic is exact
in both (``beta1 = beta2 = 0``: the new moments are ``g`` and ``g * g``) everything is equal
bit for bit, which holds the encoders, the nearest-code search and the write-back exact.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from computectx import ComputeCtx
from computectx.kernels import host_adam
from computectx.memory import CompactOptimizer, OffloadedOptimizer
from computectx.memory._rounding import draw_key, keyed_bits, stochastic_round_keyed
from computectx.memory.optim import fused
from computectx.memory.optim.fused import adam_update
from computectx.memory.optim.state import Packed, encode
from computectx.memory.optim.state.packed import spec_of, unpack4
from computectx.optim_state import OptimState

pytestmark = pytest.mark.skipif(
    host_adam.library() is None, reason="the native kernel did not build here"
)

BLOCK = 32
FORMATS = ["f32", "bf16", "int8", "fp8", "int4"]


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
        lr=1e-2,
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "shape", [(1,), (BLOCK - 1,), (BLOCK + 1,), (3 * BLOCK + 5,), (51, 99), (64, 128)]
)
def test_native_step_agrees_with_the_twin(fmt: str, shape: tuple[int, ...]) -> None:
    twin, native = run_pair(fmt, shape)
    torch.testing.assert_close(native[0], twin[0], rtol=2**-20, atol=2**-20 * 1e-2)
    assert_close_moment(native[1], twin[1])
    assert_close_moment(native[2], twin[2])


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
    torch.testing.assert_close(native[0], twin[0], rtol=2**-20, atol=2**-20 * 1e-2)
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


def test_int8_codes_of_a_large_tensor_are_the_twins() -> None:
    # From 65536 elements int8 takes the one-load table (code and bound in one word); beta1
    # = beta2 = 0 makes the arithmetic exact, so every code, scale and weight is the twin's.
    st = OptimState.parse("int8/min=0")
    gen = torch.Generator().manual_seed(5)
    shape = (257, 256)
    g = adversarial(shape[0] * shape[1], gen).view(shape)
    g[7] = torch.linspace(-1, 1, 256)  # every code: a block spanning the map
    g[8] = -g[7].abs().sqrt()
    g[9, :4] = float("nan")  # a NaN block (its scale NaN, normalized by 1)
    p0 = torch.randn(shape, generator=gen)
    mv = moments(shape, st, gen)
    outs = []
    for native in (False, True):
        p = p0.clone()
        outs.append([p, *step(p, g, [clone(x) for x in mv], st, native, beta1=0.0, beta2=0.0)])
    for a, b in zip(outs[0], outs[1], strict=True):
        pa = a.parts if isinstance(a, Packed) else {"": a}
        pb = b.parts if isinstance(b, Packed) else {"": b}
        for k in pa:
            torch.testing.assert_close(pa[k], pb[k], rtol=0.0, atol=0.0, equal_nan=True)


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
    torch.testing.assert_close(native[0], twin[0], rtol=2**-20, atol=2**-20 * 1e-2)
    for a, b, c in zip(native[1:], twin[1:], portable[1:], strict=True):
        assert_close_moment(a, b)
        pa = a.parts if isinstance(a, Packed) else {"": a}
        pc = c.parts if isinstance(c, Packed) else {"": c}
        assert all(torch.equal(pa[k], pc[k]) for k in pa), fmt
    assert torch.equal(native[0], portable[0])


# ----- bf16 / f16 weights: the write-back --------------------------------------------------


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


def test_a_failed_build_warns_once_and_runs_the_twin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(host_adam, "COMPILER", "false")
    host_adam._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built with 'false'.*twin"):
            twin, native = run_pair("int8", (3 * BLOCK,))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run_pair("int8", (3 * BLOCK,))  # no second warning
    finally:
        host_adam._library.cache_clear()
    assert torch.equal(native[0], twin[0])  # the twin ran both
    assert all(torch.equal(native[1].parts[k], twin[1].parts[k]) for k in twin[1].parts)
    assert host_adam.cache_dir() == tmp_path / "computectx" / "host_adam"
    assert not list(host_adam.cache_dir().glob("*.so"))


def test_the_build_is_cached_by_a_hash_and_replaced_atomically(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(host_adam, "FLAGS", (*host_adam.FLAGS[1:], "-O1"))  # a cheap build
    first = host_adam._build(host_adam.COMPILER)
    assert first.exists() and first.parent == host_adam.cache_dir()
    assert host_adam._build(host_adam.COMPILER) == first  # cached
    assert [f.name for f in first.parent.iterdir() if f.name.startswith(".host_adam-")] == []


# ----- end to end --------------------------------------------------------------------------


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
