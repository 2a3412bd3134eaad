"""The decode-attention twin against float64 attention, within its derived bound.

``decode_attention_error_bound`` (derived in its docstring) bounds the float32 roundings of
the twin: the score dot products, the exponentials and the two levels of accumulation, the
final rounding to ``q``'s dtype. The reference here is softmax attention computed in
float64 over the *dequantized* cache (``code * step`` exactly), per row up to its length,
written independently of the module (a plain loop over the batch). The Triton kernel is
checked against the same bound in tests/kernels/test_decode_attention.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from computectx.formats import Backend
from computectx.formats.numerics.attention import (
    DecodeArgs,
    decode_attention_error_bound,
    decode_attention_reference,
)
from computectx.formats.numerics.kv_quant import step_layout
from computectx.formats.ops.attention import (
    KERNEL_HEAD_DIMS,
    check_kernel_head_dim,
    decode_attention,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LAYOUTS = ("per_token_head", "per_head", "per_tensor")


def quantize_cache(
    x: torch.Tensor, fp8: torch.dtype, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, H, T, D) as fp8 codes and float32 steps (amax maps to the format's max)."""
    fmax = torch.finfo(fp8).max
    if layout == "per_token_head":
        step = x.abs().amax(dim=-1) / fmax
        codes = (x / step.unsqueeze(-1)).to(fp8)
    elif layout == "per_head":
        step = x.abs().amax(dim=(0, 2, 3)) / fmax
        codes = (x / step.view(1, -1, 1, 1)).to(fp8)
    else:
        step = (x.abs().amax() / fmax).reshape(1)
        codes = (x / step).to(fp8)
    return codes, step.to(torch.float32)


def dequantized(codes: torch.Tensor, step: torch.Tensor | None) -> torch.Tensor:
    """The cache's values in float64: ``code * step`` exactly."""
    x = codes.to(torch.float64)
    if step is None:
        return x
    if step.dim() == 3:
        return x * step.to(torch.float64).unsqueeze(-1)
    if step.numel() > 1:
        return x * step.to(torch.float64).view(1, -1, 1, 1)
    return x * step.to(torch.float64)


def attention64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: list[int], sm_scale: float
) -> torch.Tensor:
    """Softmax attention in float64, one batch row at a time over its first ``length[b]``
    positions: (B, H, D)."""
    rows = []
    for b, n in enumerate(length):
        s = torch.einsum("hd,htd->ht", q[b].double(), k[b, :, :n]) * sm_scale
        rows.append(torch.einsum("ht,htd->hd", torch.softmax(s, dim=-1), v[b, :, :n]))
    return torch.stack(rows)


def make_case(
    b: int,
    h: int,
    t: int,
    d: int,
    fp8: torch.dtype,
    layout: str,
    seed: int,
    q_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, d, generator=gen) * 2).to(q_dtype)
    # Keys and values with a spread of magnitudes across tokens and heads, so per-token
    # steps differ from per-head ones.
    k = torch.randn(b, h, t, d, generator=gen) * torch.rand(b, h, t, 1, generator=gen) * 4
    v = torch.randn(b, h, t, d, generator=gen) * (1 + torch.arange(h).view(1, h, 1, 1))
    kc, ks = quantize_cache(k, fp8, layout)
    vc, vs = quantize_cache(v, fp8, layout)
    return q, kc, vc, ks, vs


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
) -> float:
    """``out`` within the bound of float64 attention over the dequantized cache; returns the
    worst error as a fraction of the bound."""
    lt = torch.tensor(length)
    exact, bound = decode_attention_error_bound(DecodeArgs(q, k, v, ks, vs, lt, sm_scale, block_t))
    mine = attention64(q, dequantized(k, ks), dequantized(v, vs), length, sm_scale)
    # The bound's own float64 attention is the independent one (to float64 rounding).
    assert torch.allclose(exact, mine, rtol=1e-12, atol=1e-12)
    err = (out.double() - mine).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item()}"
    return float((err / bound).max())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_twin_within_bound_every_layout(
    layout: str, fp8: torch.dtype, q_dtype: torch.dtype
) -> None:
    q, k, v, ks, vs = make_case(3, 2, 70, 16, fp8, layout, seed=1, q_dtype=q_dtype)
    length = [70, 33, 1]  # ragged, a whole block and a partial one, and one position
    out = decode_attention(q, k, v, ks, vs, torch.tensor(length), sm_scale=0.25, block_t=16)
    assert out.dtype == q_dtype and out.shape == q.shape
    assert_within_bound(out, q, k, v, ks, vs, length, 0.25, 16)


def test_each_of_k_and_v_has_its_own_layout() -> None:
    q, k, _, ks, _ = make_case(2, 3, 40, 16, E4M3, "per_token_head", seed=2)
    _, _, v, _, vs = make_case(2, 3, 40, 16, E4M3, "per_head", seed=3)
    length = [40, 17]
    out = decode_attention(q, k, v, ks, vs, torch.tensor(length), sm_scale=0.25, block_t=8)
    assert_within_bound(out, q, k, v, ks, vs, length, 0.25, 8)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unquantized_cache_is_plain_attention(cache_dtype: torch.dtype) -> None:
    # A 16/32-bit cache takes no steps: the twin is plain softmax attention over it, and
    # agrees with torch's SDPA in float64 as with the loop above.
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 32, generator=gen, dtype=torch.float32)
    k = torch.randn(2, 4, 50, 32, generator=gen).to(cache_dtype)
    v = torch.randn(2, 4, 50, 32, generator=gen).to(cache_dtype)
    length = [50, 50]
    scale = 32**-0.5
    out = decode_attention(q, k, v, None, None, 50, sm_scale=scale)
    assert_within_bound(out, q, k, v, None, None, length, scale, 64)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.double().unsqueeze(2), k.double(), v.double(), scale=scale
    ).squeeze(2)
    assert torch.allclose(out.double(), sdpa, rtol=1e-5, atol=1e-6)


def test_length_one_is_the_first_value_rounded_once() -> None:
    # One position: its weight is exp(0) / 1 = 1 exactly, so the output is that position's
    # value, dequantized in float32 and rounded once to q's dtype: bit for bit.
    q, k, v, ks, vs = make_case(2, 3, 20, 16, E4M3, "per_token_head", seed=5)
    out = decode_attention(q, k, v, ks, vs, 1, sm_scale=0.25)
    expected = (v[:, :, 0].float() * vs[:, :, :1]).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_int_length_equals_tensor_length() -> None:
    q, k, v, ks, vs = make_case(2, 2, 30, 16, E5M2, "per_head", seed=6)
    a = decode_attention(q, k, v, ks, vs, 21, sm_scale=0.25, block_t=8)
    b = decode_attention(q, k, v, ks, vs, torch.tensor([21, 21]), sm_scale=0.25, block_t=8)
    assert torch.equal(a, b)


class _Dispatched(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Counts reads of a tensor's value by the host (``item()``, ``int(t)``, ``bool(t)``,
    ``tolist()``: all go through ``aten._local_scalar_dense``), which a CUDA graph cannot
    hold and which make the host wait for the device; and notes every op run."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_length_tensor_is_never_read_by_the_host() -> None:
    # With a length tensor and check_values=False (what a cache that checked its steps
    # passes), the whole call, checks and twin, reads no tensor value on the host: the
    # twin masks every block of T_max rather than stopping at max(length).
    q, k, v, ks, vs = make_case(2, 2, 40, 16, E4M3, "per_token_head", seed=31)
    length = [33, 5]
    with _Dispatched() as reads:
        out = decode_attention(
            q, k, v, ks, vs, torch.tensor(length), sm_scale=0.25, block_t=8, check_values=False
        )
        # (the mode sees the operator as one call: the twin's own ops, directly)
        twin = decode_attention_reference(
            DecodeArgs(q, k, v, ks, vs, torch.tensor(length), 0.25, 8)
        )
    assert reads.count == 0
    assert torch.equal(out, twin)
    assert_within_bound(out, q, k, v, ks, vs, length, 0.25, 8)
    with _Dispatched() as reads:  # the value checks are one host read, when asked for
        decode_attention(q, k, v, ks, vs, torch.tensor(length), sm_scale=0.25, block_t=8)
    assert reads.count == 1


# The ops whose float32 form a CUDA device may run in TF32 (allow_tf32,
# set_float32_matmul_precision("high")), rounding the operands to 10 mantissa bits.
_TF32_OPS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "einsum", "convolution", "dot", "mv"}


def test_the_twin_runs_no_matmul_so_tf32_cannot_touch_it() -> None:
    # Its scores and weighted sums are elementwise products and sums, computed in float32
    # whatever the float32 matmul precision is: the error bound holds under TF32 too.
    q, k, v, ks, vs = make_case(2, 2, 40, 16, E4M3, "per_head", seed=32, q_dtype=torch.float32)
    with _Dispatched() as seen:
        decode_attention_reference(DecodeArgs(q, k, v, ks, vs, torch.tensor([40, 9]), 0.25, 16))
    assert "sum" in seen.ops and not seen.ops & _TF32_OPS, sorted(seen.ops)


def test_positions_beyond_length_are_never_read() -> None:
    # Stale codes, NaN codes and zero or NaN steps past a row's length change nothing.
    q, k, v, ks, vs = make_case(2, 2, 40, 16, E4M3, "per_token_head", seed=7)
    length = torch.tensor([25, 9])
    clean = decode_attention(q, k, v, ks, vs, length, sm_scale=0.25, block_t=16)
    k2, v2, ks2, vs2 = k.clone(), v.clone(), ks.clone(), vs.clone()
    for b, n in enumerate(length.tolist()):
        k2[b, :, n:] = torch.tensor(math.nan).to(E4M3)
        v2[b, :, n:] = torch.tensor(math.nan).to(E4M3)
        ks2[b, :, n:] = 0.0
        vs2[b, :, n:] = math.nan
    dirty = decode_attention(q, k2, v2, ks2, vs2, length, sm_scale=0.25, block_t=16)
    assert torch.equal(clean, dirty)


def test_block_size_changes_only_rounding() -> None:
    q, k, v, ks, vs = make_case(1, 2, 96, 16, E4M3, "per_tensor", seed=8)
    length = [96]
    for block_t in (1, 7, 32, 96, 200):
        out = decode_attention(q, k, v, ks, vs, 96, sm_scale=0.25, block_t=block_t)
        assert_within_bound(out, q, k, v, ks, vs, length, 0.25, block_t)


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_long_context_does_not_drift(fp8: torch.dtype) -> None:
    # 4096 positions in 64 blocks, float32 query so the bf16 output rounding does not hide
    # the accumulation error: the error stays within the bound, and the bound itself stays
    # small (relative to sum_t w_t |v_t|, at most 2a/(1-a) + u, a ~ 1e-4 here), unlike an
    # accumulation in fp8 or 16 bits whose error grows with T.
    q, k, v, ks, vs = make_case(
        1, 2, 4096, 16, fp8, "per_token_head", seed=9, q_dtype=torch.float32
    )
    length = [4096]
    out = decode_attention(q, k, v, ks, vs, 4096, sm_scale=0.25, block_t=64)
    assert_within_bound(out, q, k, v, ks, vs, length, 0.25, 64)
    _, bound = decode_attention_error_bound(
        DecodeArgs(q, k, v, ks, vs, torch.tensor(length), 0.25, 64)
    )
    big_w = attention64(q, dequantized(k, ks), dequantized(v, vs).abs(), length, 0.25)
    assert float((bound / big_w).max()) < 2e-4  # docs/decode-attention.md's figure


def test_the_bound_catches_a_wrong_step() -> None:
    # The checker can fail: values read with their steps in the wrong order (a step slip
    # along T) fall outside the bound the right output sits inside.
    q, k, v, ks, vs = make_case(2, 3, 40, 32, E4M3, "per_token_head", seed=1)
    assert vs is not None
    out = decode_attention(q, k, v, ks, vs.flip(-1).contiguous(), 40, sm_scale=0.25, block_t=16)
    with pytest.raises(AssertionError, match="worst excess"):
        assert_within_bound(out, q, k, v, ks, vs, [40, 40], 0.25, 16)


def test_step_layout_names_the_shape() -> None:
    assert step_layout(torch.ones(2, 3, 5), 2, 3, 5) == "per_token_head"
    assert step_layout(torch.ones(3), 2, 3, 5) == "per_head"
    assert step_layout(torch.ones(1), 2, 3, 5) == "per_tensor"
    with pytest.raises(ValueError, match=r"\(2, 3\).*per_token_head \(2, 3, 5\)"):
        step_layout(torch.ones(2, 3), 2, 3, 5)


def test_kernel_head_dims() -> None:
    assert KERNEL_HEAD_DIMS[0] == 16 and KERNEL_HEAD_DIMS[-1] == 256
    for d in (64, 80, 128, 256):
        check_kernel_head_dim(d)
    for d in (8, 40, 100, 512):
        with pytest.raises(ValueError, match=f"D={d}.*multiples of 16 from 16 to 256"):
            check_kernel_head_dim(d)


def _args() -> dict[str, object]:
    q, k, v, ks, vs = make_case(2, 3, 20, 16, E4M3, "per_token_head", seed=10)
    return {"q": q, "k": k, "v": v, "k_step": ks, "v_step": vs, "length": torch.tensor([20, 5])}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"q": torch.zeros(2, 3, 8)}, ValueError, r"q \(2, 3, 8\).*expected \(2, 3, 16\)"),
        ({"q": torch.zeros(2, 3, 16, dtype=torch.int32)}, ValueError, "q dtype torch.int32"),
        ({"v": torch.zeros(2, 3, 20, 16, dtype=E5M2)}, ValueError, "share one cache dtype"),
        ({"k": torch.zeros(2, 3, 20)}, ValueError, r"k, v \(B, H, T_max, D\)"),
        ({"k_step": None}, ValueError, "needs k_step"),
        ({"v_step": torch.ones(2, 3)}, ValueError, r"\(2, 3\) fits no layout"),
        ({"k_step": torch.ones(3, dtype=torch.float64)}, ValueError, "k_step must be float32"),
        ({"length": torch.tensor([20, 0])}, ValueError, r"length \[20, 0\] out of range"),
        ({"length": torch.tensor([21, 1])}, ValueError, r"1 <= length\[b\] <= 20"),
        ({"length": 0}, ValueError, "length=0 out of range"),
        ({"length": torch.tensor([3, 3], dtype=torch.int32)}, ValueError, "int64 of shape"),
        ({"length": 2.0}, TypeError, "length must be an int"),
    ],
)
def test_bad_arguments_raise_naming_them(
    change: dict[str, object], error: type[Exception], match: str
) -> None:
    args = _args() | change
    with pytest.raises(error, match=match):
        decode_attention(**args, sm_scale=0.25)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0])
@pytest.mark.parametrize("which", ["k_step", "v_step"])
def test_bad_steps_raise(bad: float, which: str) -> None:
    args = _args()
    step = args[which]
    assert isinstance(step, torch.Tensor)
    step = step.clone()
    step[1, 2, 3] = bad  # within row 1's length 5
    args[which] = step
    named = {0.0: "0", -1.0: "negative", math.inf: "inf"}.get(bad, "NaN")  # never the value
    with pytest.raises(
        ValueError, match=rf"{which} has 1 step.*first, {which}\[1, 2, 3\], is {named}\)"
    ):
        decode_attention(**args, sm_scale=0.25)  # type: ignore[arg-type]


def test_a_nan_per_tensor_step_raises() -> None:
    q, k, v, ks, _ = make_case(1, 2, 8, 16, E4M3, "per_tensor", seed=11)
    with pytest.raises(ValueError, match=r"v_step has 1 step.*\(the first, v_step\[0\], is NaN\)"):
        decode_attention(q, k, v, ks, torch.full((1,), math.nan), 8, sm_scale=0.25)


def test_a_value_cache_takes_no_steps_and_scalars_are_checked() -> None:
    q = torch.zeros(1, 1, 16)
    kv = torch.zeros(1, 1, 4, 16)
    with pytest.raises(ValueError, match="pass k_step=None and v_step=None"):
        decode_attention(q, kv, kv, torch.ones(1), torch.ones(1), 4, sm_scale=1.0)
    for scale in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"sm_scale=.* finite and positive"):
            decode_attention(q, kv, kv, None, None, 4, sm_scale=scale)
    with pytest.raises(ValueError, match="block_t=0"):
        decode_attention(q, kv, kv, None, None, 4, sm_scale=1.0, block_t=0)
    with pytest.raises(TypeError, match="Backend"):
        decode_attention(q, kv, kv, None, None, 4, sm_scale=1.0, backend="triton")  # type: ignore[arg-type]


def test_triton_refuses_head_dims_it_cannot_serve_while_the_twin_serves_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # D = 8: the twin runs; the Triton backend refuses before any kernel is touched (the
    # interpreter makes the backend runnable on the CPU here).
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, ks, vs = make_case(1, 2, 8, 8, E4M3, "per_head", seed=12)
    out = decode_attention(q, k, v, ks, vs, 8, sm_scale=0.25)
    assert_within_bound(out, q, k, v, ks, vs, [8], 0.25, 64)
    with pytest.raises(ValueError, match="cannot serve head dim D=8"):
        decode_attention(q, k, v, ks, vs, 8, sm_scale=0.25, backend=Backend.TRITON)
    q, k, v, ks, vs = make_case(1, 2, 8, 16, E4M3, "per_head", seed=12)
    with pytest.raises(ValueError, match=r"block_t in \(16, 32, 64, 128, 256\), got 48"):
        decode_attention(q, k, v, ks, vs, 8, sm_scale=0.25, block_t=48, backend=Backend.TRITON)


def test_check_values_false_skips_the_value_checks() -> None:
    q, k, v, ks, _ = make_case(1, 1, 8, 16, E4M3, "per_tensor", seed=13)
    out = decode_attention(
        q, k, v, ks, torch.full((1,), math.nan), 8, sm_scale=0.25, check_values=False
    )
    assert bool(out.isnan().all())  # the caller's promise broken: NaN in, NaN out


def test_compiles_whole_with_no_recompile_across_lengths() -> None:
    # A static-shape decode step: the length is a tensor, so new values reuse the graph;
    # the operator is one opaque node (fake implementation), so fullgraph holds.
    import torch._dynamo.testing

    q, k, v, ks, vs = make_case(2, 2, 32, 16, E4M3, "per_token_head", seed=14)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def step(q: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        return decode_attention(q, k, v, ks, vs, length, sm_scale=0.25, block_t=16) * 2

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for n in (1, 9, 32):
        length = torch.tensor([n, max(1, n - 5)])
        assert torch.equal(compiled(q, length), step(q, length))
    assert counter.frame_count == 1, counter.frame_count
    ops = [str(node.target) for node in counter.graphs[0].graph.nodes]
    assert "computectx.fp8_decode_attention.default" in ops, ops


def test_opcheck_on_the_reference_backend() -> None:
    q, k, v, ks, vs = make_case(2, 2, 24, 16, E4M3, "per_head", seed=15)
    args = (q, k, v, ks, vs, torch.tensor([24, 3]), 0.25, 16, "reference")
    # torch's test_schema compares inputs with allclose, which has no fp8 kernel on the CPU.
    without_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        torch.ops.computectx.fp8_decode_attention, args, test_utils=without_schema
    )
    kv = torch.randn(2, 2, 24, 16)
    torch.library.opcheck(
        torch.ops.computectx.fp8_decode_attention,
        (q, kv, kv, None, None, torch.tensor([24, 3]), 0.25, 16, "reference"),
    )


# ----- compact steps (KvFp8.step): bf16 and e8m0 -------------------------------------------


def _compact(step: torch.Tensor, fmt: str) -> torch.Tensor:
    """``step`` stored as ``fmt`` the way the cache stores it (rounded up)."""
    from computectx.nn.kv_steps import stored_steps

    return stored_steps(step, fmt)  # type: ignore[arg-type]


def _interpreted_kernel(monkeypatch: pytest.MonkeyPatch) -> Any:
    # As tests/kernels/conftest.py does: the kernel modules decorated for Triton's
    # interpreter on the CPU, whatever imported them before, with TRITON_INTERPRET set for
    # this test only (the backend checks read it too).
    import importlib
    import sys

    import triton  # noqa: F401  (a dev dependency: the kernel runs here, never skipped)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module: Any = None
    for name in ("computectx.kernels.fp8_codes", "computectx.kernels.decode_attention"):
        module = sys.modules.get(name)
        if module is None:
            module = importlib.import_module(name)
        elif not getattr(module, "INTERPRETED", False):
            module = importlib.reload(module)
    return module


@pytest.mark.parametrize("fmt", ["bf16", "e8m0"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compact_steps_read_as_their_float32_values(
    fmt: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bf16 or e8m0 step widens to float32 exactly, so a cache with compact steps gives the
    # very output of the same cache with those steps stored as float32: bit for bit, on the
    # twin and (under the interpreter) on the Triton kernel, which reads the compact steps
    # itself (e8m0 as bytes, widened by its exponent field).
    q, k, v, ks, vs = make_case(2, 2, 40, 16, E4M3, layout, seed=21)
    cks, cvs = _compact(ks, fmt), _compact(vs, fmt)
    assert cks.dtype == {"bf16": torch.bfloat16, "e8m0": torch.float8_e8m0fnu}[fmt]
    assert bool((cks.float() >= ks).all())  # rounded up: no code grows past the format's max
    wks, wvs = cks.float(), cvs.float()
    length = torch.tensor([40, 23])
    twin = decode_attention(q, k, v, cks, cvs, length, sm_scale=0.25, block_t=16)
    assert torch.equal(twin, decode_attention(q, k, v, wks, wvs, length, sm_scale=0.25, block_t=16))
    assert_within_bound(twin, q, k, v, wks, wvs, [40, 23], 0.25, 16)
    if (layout, fmt) not in (("per_token_head", "bf16"), ("per_head", "e8m0")):
        return  # the interpreter is slow: the kernel on one per-token and one static case
    kernel = _interpreted_kernel(monkeypatch)
    args: dict[str, Any] = {"q": q, "k": k, "v": v, "length": length, "sm_scale": 0.25}
    compact = kernel.decode_attention(**args, k_step=cks, v_step=cvs, block_t=16, splits=2)
    wide = kernel.decode_attention(**args, k_step=wks, v_step=wvs, block_t=16, splits=2)
    assert torch.equal(compact, wide)
    assert_within_bound(compact, q, k, v, wks, wvs, [40, 23], 0.25, 16)


def test_e8m0_extremes_widen_as_torch_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # Code 0 is 2**-127 (a float32 subnormal) and a power of two reads as itself; the kernel
    # and the twin agree on both (the cache itself clamps its exponents to float32's normal
    # range, so code 0 is only reachable by hand).
    q, k, v, _, _ = make_case(1, 2, 16, 16, E4M3, "per_token_head", seed=22)
    codes = torch.tensor([0, 1, 127, 130], dtype=torch.uint8).repeat(8).view(1, 2, 16)
    steps = codes.view(torch.float8_e8m0fnu)
    assert steps.float()[0, 0, :4].tolist() == [2.0**-127, 2.0**-126, 1.0, 8.0]
    length = torch.tensor([16])
    twin = decode_attention(q, k, v, steps, steps, length, sm_scale=0.25, block_t=16)
    kernel = _interpreted_kernel(monkeypatch)
    out = kernel.decode_attention(
        q=q, k=k, v=v, k_step=steps, v_step=steps, length=length, sm_scale=0.25, block_t=16
    )
    wide = kernel.decode_attention(
        q=q, k=k, v=v, k_step=steps.float(), v_step=steps.float(), length=length,
        sm_scale=0.25, block_t=16,
    )  # fmt: skip
    assert torch.equal(out, wide)
    assert_within_bound(out, q, k, v, steps.float(), steps.float(), [16], 0.25, 16)
    assert_within_bound(twin, q, k, v, steps.float(), steps.float(), [16], 0.25, 16)


def test_compact_steps_are_checked_like_float32_ones() -> None:
    q, k, v, ks, vs = make_case(1, 2, 8, 16, E4M3, "per_token_head", seed=23)
    with pytest.raises(ValueError, match=r"k_step must be float32, bfloat16 or float8_e8m0fnu"):
        decode_attention(q, k, v, ks.half(), vs, 8, sm_scale=0.25)
    with pytest.raises(ValueError, match=r"share one step format, got torch.bfloat16 and"):
        decode_attention(q, k, v, ks.bfloat16(), vs, 8, sm_scale=0.25)
    nan = torch.full_like(ks, 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"k_step has 16 step\(s\) .* k_step\[0, 0, 0\], is NaN\)"):
        decode_attention(q, k, v, nan, _compact(vs, "e8m0"), 8, sm_scale=0.25)
