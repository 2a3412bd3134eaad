"""The Triton decode-attention kernel against float64 attention and its twin.

Bit-exactness with the twin is impossible in general: the kernel's dot products and sums
run in ``tl.sum``'s order, not torch's, and its ``exp`` is another implementation (numpy's
in the interpreter, ``ex2.approx`` on a GPU). Both are therefore held to
``decode_attention_error_bound`` against float64 attention over the dequantized cache
(derived in its docstring, for any order and any split of T). Where every float32
operation is exact (all scores equal, so each weight is ``exp(0) = 1``; power-of-two steps
and small codes, so every sum of values is exact) the kernel matches the twin bit for bit,
with and without the split-K merge, which pins down the masking, the step layouts, the
dequantization and the final rounding.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

from computectx.formats import Backend
from computectx.formats.numerics.attention import (
    DecodeArgs,
    decode_attention_error_bound,
    decode_attention_reference,
)
from computectx.formats.ops.attention import decode_attention

from .conftest import ON_GPU

pytestmark = pytest.mark.interpreter

_NAME = "computectx.kernels.decode_attention"


def _kernel_module() -> object:
    # As tests/kernels/conftest.py does for the older kernel modules: on the CPU the module
    # must be decorated for the interpreter, whatever imported it before.
    if ON_GPU:
        return importlib.import_module(_NAME)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = sys.modules.get(_NAME)
        if module is None:
            return importlib.import_module(_NAME)
        if not getattr(module, "INTERPRETED", False):
            return importlib.reload(module)
        return module
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LAYOUTS = ("per_token_head", "per_head", "per_tensor")


def make_case(
    b: int,
    h: int,
    t: int,
    d: int,
    fp8: torch.dtype,
    layout: str,
    seed: int,
    q_dtype: torch.dtype = torch.bfloat16,
    aligned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A query and a quantized cache, on the CPU (the cases of
    tests/formats/ops/test_attention.py: keys of spread magnitudes, values growing with the
    head, amax mapped to the format's max).
    ``aligned``: a non-negative float32 query and non-negative keys."""
    gen = torch.Generator().manual_seed(seed)
    if aligned:
        q = torch.rand(b, h, d, generator=gen)
        k = torch.rand(b, h, t, d, generator=gen) * torch.rand(b, h, t, 1, generator=gen) * 3
    else:
        q = (torch.randn(b, h, d, generator=gen) * 2).to(q_dtype)
        k = torch.randn(b, h, t, d, generator=gen) * torch.rand(b, h, t, 1, generator=gen) * 4
    v = torch.randn(b, h, t, d, generator=gen) * (1 + torch.arange(h).view(1, h, 1, 1))
    dims = {"per_token_head": (-1,), "per_head": (0, 2, 3), "per_tensor": (0, 1, 2, 3)}[layout]
    cache = []
    for x in (k, v):
        amax = x.abs().amax(dim=dims, keepdim=True)
        step = amax / torch.finfo(fp8).max
        cache.append((x / step).to(fp8))
        shape = {"per_token_head": (b, h, t), "per_head": (h,), "per_tensor": (1,)}[layout]
        cache.append(step.reshape(shape).contiguous())
    return q, cache[0], cache[2], cache[1], cache[3]


def assert_within_bound(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ks: torch.Tensor | None,
    vs: torch.Tensor | None,
    length: list[int],
    sm_scale: float,
    block_t: int,
) -> None:
    """``out`` within ``decode_attention_error_bound`` of float64 attention over the
    dequantized cache (that function's float64 attention is checked against an independent
    one in tests/formats/ops/test_attention.py)."""
    exact, bound = decode_attention_error_bound(
        DecodeArgs(q, k, v, ks, vs, torch.tensor(length), sm_scale, block_t)
    )
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"


KERNEL = _kernel_module()
TRITON = Backend.TRITON


def kernel(
    device: torch.device,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ks: torch.Tensor | None,
    vs: torch.Tensor | None,
    length: torch.Tensor,
    *,
    block_t: int,
    splits: int,
    sm_scale: float = 0.25,
) -> torch.Tensor:
    """The kernel's launcher on ``device`` (forced ``splits``); the output on the CPU."""

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    out: torch.Tensor = KERNEL.decode_attention(  # type: ignore[attr-defined]
        q=on(q),
        k=on(k),
        v=on(v),
        k_step=on(ks),
        v_step=on(vs),
        length=length.to(device),
        sm_scale=sm_scale,
        block_t=block_t,
        splits=splits,
    )
    return out


# The query's dtype (how the kernel loads and widens q, and rounds the output) and the
# cache's format (how it decodes the codes) are independent parts of the kernel: each dtype
# and each format runs with every layout and split, in two pairs rather than all four (each
# case runs interpreted; test_kernel_bit_exact_with_twin_where_float32_is_exact crosses three
# query dtypes with every layout, E4M3 and at 2 splits E5M2).
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("q_dtype", "fp8"),
    [(torch.bfloat16, E4M3), (torch.float32, E5M2)],
    ids=["bf16-e4m3", "f32-e5m2"],
)
def test_kernel_within_bound(
    device: torch.device, splits: int, layout: str, fp8: torch.dtype, q_dtype: torch.dtype
) -> None:
    q, k, v, ks, vs = make_case(3, 2, 70, 48, fp8, layout, seed=21, q_dtype=q_dtype)
    length = [70, 33, 1]
    out = kernel(device, q, k, v, ks, vs, torch.tensor(length), block_t=16, splits=splits)
    assert out.dtype == q_dtype and out.shape == q.shape
    assert_within_bound(out, q, k, v, ks, vs, length, 0.25, 16)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_on_a_value_cache(device: torch.device, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(22)
    q = torch.randn(2, 2, 32, generator=gen).to(torch.bfloat16)
    k = torch.randn(2, 2, 40, 32, generator=gen).to(cache_dtype)
    v = torch.randn(2, 2, 40, 32, generator=gen).to(cache_dtype)
    length = [40, 23]
    for splits in (1, 2):
        lt = torch.tensor(length)
        out = kernel(device, q, k, v, None, None, lt, block_t=16, splits=splits, sm_scale=32**-0.5)
        assert_within_bound(out, q, k, v, None, None, length, 32**-0.5, 16)


def exact_case(
    layout: str, fp8: torch.dtype, q_dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    # All keys equal within a row: every score is the same number, so each weight is
    # exp(0) = 1 in both implementations whatever order they sum the dot in. Small integer
    # codes times power-of-two steps: every sum of values is exact in float32.
    gen = torch.Generator().manual_seed(seed)
    b, h, t, d = 2, 3, 45, 16
    q = torch.randn(b, h, d, generator=gen).to(q_dtype)
    k = torch.randint(-6, 7, (b, h, 1, d), generator=gen).float().expand(b, h, t, d).to(fp8)
    v = torch.randint(-6, 7, (b, h, t, d), generator=gen).float().to(fp8)

    def steps() -> torch.Tensor:
        shape = {"per_token_head": (b, h, t), "per_head": (h,), "per_tensor": (1,)}[layout]
        return torch.pow(2.0, torch.randint(-8, 4, shape, generator=gen).float())

    ks = steps()
    if layout == "per_token_head":
        ks = ks[:, :, :1].expand(b, h, t).contiguous()  # equal keys need equal steps
    return q, k, v, ks, steps()


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_bit_exact_with_twin_where_float32_is_exact(
    device: torch.device, splits: int, layout: str, q_dtype: torch.dtype
) -> None:
    q, k, v, ks, vs = exact_case(layout, E4M3 if splits != 2 else E5M2, q_dtype, seed=23)
    length = torch.tensor([45, 19])
    twin = decode_attention_reference(DecodeArgs(q, k, v, ks, vs, length, 0.3, 16))
    out = kernel(device, q, k, v, ks, vs, length, block_t=16, splits=splits, sm_scale=0.3)
    assert torch.equal(out, twin)


def test_positions_beyond_length_are_never_read(device: torch.device) -> None:
    q, k, v, ks, vs = make_case(2, 2, 40, 16, E4M3, "per_token_head", seed=24)
    length = torch.tensor([25, 9])
    k2, v2, ks2, vs2 = k.clone(), v.clone(), ks.clone(), vs.clone()
    for b, n in enumerate(length.tolist()):
        k2[b, :, n:] = torch.tensor(math.nan).to(E4M3)
        v2[b, :, n:] = torch.tensor(math.nan).to(E4M3)
        ks2[b, :, n:] = 0.0
        vs2[b, :, n:] = math.nan
    for splits in (1, 3):
        clean = kernel(device, q, k, v, ks, vs, length, block_t=16, splits=splits)
        dirty = kernel(device, q, k2, v2, ks2, vs2, length, block_t=16, splits=splits)
        assert torch.equal(clean, dirty)


def test_long_context_within_bound(device: torch.device) -> None:
    # 4096 positions, 64 blocks of 64 (and 4 programs of 16 blocks, merged): the float32
    # accumulation keeps the error within the bound (about 2e-4 of sum_t w_t |v_t|).
    q, k, v, ks, vs = make_case(
        1, 1, 4096, 16, E4M3, "per_token_head", seed=25, q_dtype=torch.float32
    )
    length = [4096]
    for splits in (1, 4):
        lt = torch.tensor(length)
        out = kernel(device, q, k, v, ks, vs, lt, block_t=64, splits=splits)
        assert_within_bound(out, q, k, v, ks, vs, length, 0.25, 64)


def test_the_triton_backend_dispatches_to_the_kernel(device: torch.device) -> None:
    q, k, v, ks, vs = make_case(2, 2, 24, 32, E5M2, "per_head", seed=26)
    length = torch.tensor([24, 7])
    out = decode_attention(
        q.to(device),
        k.to(device),
        v.to(device),
        ks.to(device),
        vs.to(device),
        length.to(device),
        sm_scale=0.25,
        block_t=16,
        backend=TRITON,
    ).cpu()
    direct = kernel(device, q, k, v, ks, vs, length, block_t=16, splits=1)
    if not ON_GPU:  # on the CPU the launcher never splits
        assert torch.equal(out, direct)
    assert_within_bound(out, q, k, v, ks, vs, [24, 7], 0.25, 16)


def test_opcheck_on_the_triton_backend(device: torch.device) -> None:
    q, k, v, ks, vs = make_case(2, 2, 24, 16, E4M3, "per_token_head", seed=27)
    tensors = [t.to(device) for t in (q, k, v, ks, vs, torch.tensor([24, 3]))]
    args = (*tensors, 0.25, 16, "triton")
    # torch's test_schema compares inputs with allclose, which has no fp8 kernel on the CPU.
    without_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        torch.ops.computectx.fp8_decode_attention, args, test_utils=without_schema
    )


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_within_bound_where_scores_spread_widely(
    device: torch.device, splits: int, layout: str
) -> None:
    # A case where the bound is tight enough to see a slip in the score path: non-negative
    # queries and keys, so each score is as large as its magnitude sum_d |q_d k_td| (which
    # sets the score error bound) and scores spread from 0 to that size; a float32 query,
    # so no bf16 rounding covers the error. (A key step off by 1e-4 fails here.)
    q, k, v, ks, vs = make_case(2, 2, 60, 32, E4M3, layout, seed=28, aligned=True)
    length = [60, 41]
    lt = torch.tensor(length)
    out = kernel(device, q, k, v, ks, vs, lt, block_t=16, splits=splits, sm_scale=1.0)
    assert_within_bound(out, q, k, v, ks, vs, length, 1.0, 16)


def test_kernel_reads_strided_views(device: torch.device) -> None:
    # A cache sliced out of a bigger buffer (strides over heads and positions that are not
    # the view's own), a column-major K (last dim not contiguous: copied), a query that is
    # a slice of a fused projection, per_head steps: the same output as contiguous copies.
    q, k, v, ks, vs = make_case(2, 3, 40, 32, E4M3, "per_head", seed=29)
    big_q = torch.zeros(2, 3, 3 * 32, dtype=q.dtype)
    big_q[:, :, 32:64] = q
    big_v = torch.zeros(2, 5, 64, 32, dtype=E4M3)
    big_v[:, 1:4, :40] = v
    k_cols = k.transpose(-1, -2).contiguous().transpose(-1, -2)
    length = torch.tensor([40, 13])
    views = (big_q[:, :, 32:64], k_cols, big_v[:, 1:4, :40])
    out = kernel(device, *views, ks, vs, length, block_t=16, splits=2)
    dense = kernel(device, q, k, v, ks, vs, length, block_t=16, splits=2)
    assert torch.equal(out, dense)


def test_the_triton_backend_compiles_whole_with_no_recompile(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The TRITON backend inside torch.compile(fullgraph=True): the backend and capability
    # checks (triton's import, the interpreter flag, the device's capability) must neither
    # break the graph nor guard on the process's state (a module imported between two decode
    # steps must not compile the step again), and a new length tensor must not either.
    import types

    import torch._dynamo.testing

    q, k, v, ks, vs = (t.to(device) for t in make_case(2, 2, 40, 32, E4M3, "per_head", seed=30))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(q: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        out = decode_attention(q, k, v, ks, vs, length, sm_scale=0.25, block_t=16, backend=TRITON)
        return out * 2

    # A serving process imports the decode kernel only, not the GEMM kernels (here all are
    # imported by the conftest; hide one, as if it never was).
    monkeypatch.delitem(sys.modules, "computectx.kernels.scaled_mm_blocks", raising=False)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for i, length in enumerate(([40, 7], [19, 40], [1, 33])):
        lt = torch.tensor(length, device=device)
        if i == 2:  # another module imported, as a serving process does at any time
            sys.modules["_computectx_test_late_import"] = types.ModuleType("late")
        try:
            out = compiled(q, lt)
        finally:
            sys.modules.pop("_computectx_test_late_import", None)
        assert torch.equal(out, step(q, lt))
        q0, k0, v0, ks0, vs0 = (t.cpu() for t in (q, k, v, ks, vs))
        assert_within_bound((out / 2).cpu(), q0, k0, v0, ks0, vs0, length, 0.25, 16)
    assert counter.frame_count == 1, counter.frame_count
    ops = [str(node.target) for node in counter.graphs[0].graph.nodes]
    assert "computectx.fp8_decode_attention.default" in ops, ops
