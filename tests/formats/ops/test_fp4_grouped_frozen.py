"""Frozen 4-bit experts' operators (``formats.ops.fp4_grouped_frozen``): ``torch.library.opcheck``
on each, and the held grouped GEMM against the training one (``fp4_grouped_mm``) group for group;
the amaxes read to the host by a direct call, never by the modules that made them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._library.custom_ops import OPDEFS
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from computectx.formats import Fp4Experts, Fp4Recipe, FrozenFp4Experts
from computectx.formats.linear.fp4_gathered import Fp4ExpertsGather
from computectx.formats.numerics.fp4 import Nvfp4Operand
from computectx.formats.numerics.fp4_gemm import Fp4Quant
from computectx.formats.ops import fp4 as fp4_ops
from computectx.formats.ops.fp4_grouped_frozen import dequantize_experts, held_grouped_mm

NV = Fp4Quant(format="nvfp4", weight_tile="16x16", hadamard=False)
# test_schema copies the inputs, which torch cannot do for float4_e2m1fn_x2 (as for
# fp4_scaled_mm's float4 operands: tests/formats/ops/test_fp4_ops.py).
WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
MX = Fp4Quant(format="mxfp4", mx_rounding="floor", hadamard=False)


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def held(w: torch.Tensor, how: Fp4Quant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    ops = [fp4_ops.quantize(w[e], how, weight=True) for e in range(w.shape[0])]
    amax = [q.amax.reshape(()) for q in ops if isinstance(q, Nvfp4Operand)]
    codes, scale = torch.stack([q.codes for q in ops]), torch.stack([q.scale for q in ops])
    return codes, scale, torch.stack(amax) if amax else None


def test_held_grouped_mm_is_the_grouped_forward_and_passes_opcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=gen).bfloat16()
    w = torch.randn(3, 16, 32, generator=gen)
    offs = offsets([5, 0, 16])  # an empty expert; rows 21-23 past the last
    ops = torch.ops.computectx
    for how in (NV, MX):
        codes, scale, amax = held(w, how)
        tile = how.weight_tile if how.format == "nvfp4" else "1x32"
        rule = {"tile": tile, "mx_rounding": how.mx_rounding}
        got = held_grouped_mm(x, codes, scale, amax, offs, per_row=False, **rule)  # type: ignore[arg-type]
        assert torch.equal(got, fp4_ops.grouped_mm(x, w, offs, how))
        em, bf16 = "emulated", torch.bfloat16
        fmt, op_tile = how.format, tile if how.format == "nvfp4" else "1x16"
        args = (x, codes, scale, amax, offs, fmt, op_tile, how.mx_rounding, None, bf16, em, True)
        torch.library.opcheck(ops.fp4_grouped_mm_gathered, args, test_utils=WITHOUT_SCHEMA)
        deq = (codes, scale, amax, tile, torch.float32, em)
        torch.library.opcheck(ops.fp4_dequantize_experts, deq, test_utils=WITHOUT_SCHEMA)
        assert dequantize_experts(codes, scale, amax, tile, torch.bfloat16).shape == (3, 16, 32)


def test_the_operators_check_every_operand_against_the_codes_expert_count() -> None:
    # Each was accepted (a silent number) or a torch IndexError / RuntimeError before.
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 32, generator=gen).bfloat16(), torch.randn(4, 32, 32, generator=gen)
    codes, scale, amax = held(w, NV)
    assert amax is not None
    offs, bf16, em = offsets([2, 1, 0, 2]), torch.bfloat16, "emulated"
    # The frozen W4A4 GEMM is computectx::fp4_grouped_mm_gathered with per_row (or not).
    mm, dq = (
        torch.ops.computectx.fp4_grouped_mm_gathered,
        torch.ops.computectx.fp4_dequantize_experts,
    )
    rule, tail = ("nvfp4", "16x16", "rceil", None), (em, True)
    bad = [
        ((x, codes, scale, amax, offs[:3], *rule, bf16, *tail), r"offs \[E\] for codes"),
        ((x, codes, scale, amax, offsets([1] * 5), *rule, bf16, *tail), r"offs \[E\] for codes"),
        ((x, codes, scale, amax[:3], offs, *rule, bf16, *tail), r"one float32 amax each, \(4,\)"),
        ((x, codes, scale[:3], amax, offs, *rule, bf16, *tail), r"expected .*\(4, 2, 2\)"),
        ((x, codes, scale, amax.neg(), offs, *rule, bf16, *tail), "finite and >= 0"),
        ((x, codes, scale, amax * float("nan"), offs, *rule, bf16, *tail), "finite and >= 0"),
        ((x, codes, scale, amax, offs, *rule, torch.int32, *tail), "out_dtype must be one of"),
        ((x, codes, scale, None, offs, *rule, bf16, *tail), "NVFP4 experts take their amaxes"),
        ((x[:, :16], codes, scale, amax, offs, *rule, bf16, *tail), r"takes a \[M, K\]"),
        ((x, codes, scale, amax, offs, *rule[:3], torch.tensor([1, 2]), bf16, *tail), "per_row"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            mm(*args)
    with pytest.raises(ValueError, match=r"E >= 1 experts, got codes \(0, 32, 16\)"):
        mm(x, codes[:0], scale[:0], amax[:0], offs[:0], *rule, bf16, *tail)
    dq_bad: list[tuple[tuple[object, ...], str]] = [
        ((codes, scale, amax, "16x16", torch.int32, em), "out_dtype must be one of"),
        ((codes, scale, amax, "1x16", torch.float32, em), r"scale \(nvfp4 1x16\)"),
        ((codes[:0], scale[:0], amax[:0], "16x16", torch.float32, em), "with E >= 1"),
        ((codes, scale, amax[:3], "16x16", torch.float32, em), r"one float32 amax each"),
    ]
    for dq_args, match in dq_bad:
        with pytest.raises(ValueError, match=match):
            dq(*dq_args)
    # The training operator shares the offs-length check (checked_bounds): E - 1 entries left
    # the last group's rows zero, E + 1 an IndexError.
    train = torch.ops.computectx.fp4_grouped_mm
    for short in (offs[:3], offsets([1] * 5)):
        with pytest.raises(ValueError, match=r"offs must be int32 \(4,\)"):
            train(x, w.bfloat16(), short, "nvfp4", "16x16", "rceil", None, bf16, em)


def test_dequantize_experts_reads_the_format_from_the_scales_as_the_dense_operator() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(2, 16, 64, generator=gen)
    codes, scale, _ = held(w, MX)
    stray = torch.ones(2, dtype=torch.float32)  # an amax beside E8M0 scales: not NVFP4
    dense = torch.stack([fp4_ops.dequantize(fp4_ops.quantize(w[e], MX, weight=True), torch.float32)
                         for e in range(2)])  # fmt: skip
    dq = torch.ops.computectx.fp4_dequantize_experts
    assert torch.equal(dq(codes, scale, stray, "1x32", torch.float32, "emulated"), dense)
    nv_codes, nv_scale, _ = held(w, NV)
    with pytest.raises(ValueError, match="needs its per-expert amax"):
        dq(nv_codes, nv_scale, None, "16x16", torch.float32, "emulated")


_HOST_READS = (  # bool() dispatches is_nonzero, .item() item: each the read, once
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.item.default,
)


class _AmaxReads(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it untyped
    """Counts the host reads (``_HOST_READS``: ``.item()``, ``bool()``, ``.tolist()``; a
    device sync on a GPU) of any value computed from ``sources`` (the amaxes),
    through every op. A mode sees computectx's operators, not their bodies: it runs each
    body under itself (``offs`` and ``rng`` are read by design, and not counted)."""

    def __init__(self, sources: list[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kept, self.ids, self.reads = list(sources), {id(t) for t in sources}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        derived = any(isinstance(t, torch.Tensor) and id(t) in self.ids for t in leaves)
        self.reads += derived and func in _HOST_READS
        if func.namespace == "computectx":
            with self:
                out = OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out) if derived else ():
            if isinstance(t, torch.Tensor):
                self.kept.append(t)
                self.ids.add(id(t))
        return out


def _reads(sources: list[torch.Tensor], call: Any) -> int:
    with _AmaxReads(sources) as seen:
        call()
    return int(seen.reads)


def test_the_modules_read_no_amax_to_the_host_a_direct_call_does() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 32, 32, generator=gen)
    x, offs = torch.randn(7, 32, generator=gen).bfloat16(), offsets([3, 0, 4])
    trained = Fp4Experts(Fp4Recipe.parse("nvfp4"))
    ops = [fp4_ops.quantize(w[e], trained.how, weight=True) for e in range(3)]  # as frozen
    for mode, rule in (("w4a4", "per_row"), ("w4a4", "per_tensor"), ("weight_only", "per_row")):
        frozen = FrozenFp4Experts({"w": ops}, mode=mode, activation_amax=rule)  # type: ignore[arg-type]
        amax = frozen.held("w")[2]
        assert amax is not None
        with torch.inference_mode():
            assert _reads([amax], lambda f=frozen: f.mm(x, "w", offs)) == 0, (mode, rule)
            assert _reads([amax], lambda f=frozen: f.dequantized("w")) == 0
    # Fp4Experts on FSDP2's gathered experts: forward and dgrad.
    spec = trained.experts_gather
    assert isinstance(spec, Fp4ExpertsGather)
    gathered = spec.experts(spec.expert_inputs(w), torch.float32)
    amax = gathered.per_tensor_amax
    assert amax is not None
    xg = x.float().requires_grad_()

    def step() -> None:
        torch.autograd.backward(trained.mm(xg, torch.nn.Parameter(gathered), offs).sum())

    assert _reads([amax], step) == 0 and xg.grad is not None
    # Called directly, the operators read the amaxes (and refuse bad ones: the tests above).
    codes, scale, held_amax = frozen.held("w")  # the weight_only module's, unread so far
    assert held_amax is not None
    args = (x, codes, scale, held_amax, offs, "nvfp4", "16x16", "rceil", None, x.dtype, "emulated")
    mm = torch.ops.computectx.fp4_grouped_mm_gathered
    assert _reads([held_amax], lambda: mm(*args)) == 1
    dq = torch.ops.computectx.fp4_dequantize_experts
    deq = (codes, scale, held_amax, "16x16", torch.float32, "emulated")
    assert _reads([held_amax], lambda: dq(*deq)) == 1
