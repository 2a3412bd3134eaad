"""The grouped fp8 GEMM's operators and ``torch.compile`` (issue 23, "Grouped GEMMs").

``computectx::fp8_grouped_mm`` and ``computectx::fp8_grouped_wgrad`` pass
``torch.library.opcheck`` on the reference backend, every check included (no fp8 tensor
crosses their boundary, so torch's schema check runs too), on ragged groups with an empty
one and rows past the last group. A function calling ``quantized_grouped_mm`` compiles whole
(``fullgraph=True``, so a graph break would raise), forward and backward, with the eager
results bit for bit, and does not recompile when the group sizes change with M fixed: the
group sizes are the values of ``offs``, data that no guard reads. M changing is one
recompile under the default automatic-dynamic shapes (the second M makes M symbolic) and
none with ``dynamic=True``. Bad ``offs`` values raise from a compiled call as from an eager
one (the operator reads them).

Every compile here uses ``backend="aot_eager"`` (dynamo and AOTAutograd, the traced forward
and backward graphs, without code generation), except one Inductor test, whose graphs hold the
two operators (extern calls), a scaling and a cast: 4-9 s on a loaded 2-core machine when
Inductor has already compiled something in the process, about 25 s in a fresh one (as the
other Inductor tests of tests/formats/test_compile.py).

Frozen experts (``ops.grouped_frozen.frozen_experts_mm``) multiply their held codes through
``computectx::fp8_held_grouped_mm``: it passes ``opcheck``, compiles whole with ``offs`` as
data (no guard on its values, no recompile as the groups change: adv35 F5), and Inductor
compiles MX codes (their E8M0 scales cross the operator, none is generated code: adv35 F4),
outputs and input gradients the eager ones bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo.testing

from computectx.formats import Backend, QuantizedExperts, Recipe, quantized_grouped_mm
from computectx.formats.ops.grouped_frozen import experts_serving_weight, frozen_experts_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E, K, N = 4, 64, 48
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


# ----- the operators ------------------------------------------------------------------------


def test_opcheck_passes_for_both_grouped_operators_on_the_reference_backend() -> None:
    gen = torch.Generator().manual_seed(0)
    m = 24
    offs = offsets([5, 0, 13, 3])  # an empty group; rows 21-23 past the last group
    x = torch.randn(m, K, generator=gen).bfloat16()
    w = torch.randn(E, N, K, generator=gen).bfloat16()
    dy = torch.randn(m, N, generator=gen).bfloat16()
    mm, wgrad = torch.ops.computectx.fp8_grouped_mm, torch.ops.computectx.fp8_grouped_wgrad
    ref, bf16, f32 = "reference", torch.bfloat16, torch.float32
    cases: list[tuple[Any, tuple[object, ...]]] = [
        # forward: x [M, K] by w [E, N, K]
        (mm, (x, w, offs, "tensor", "tensor", E4M3, E4M3, "amax", 0, bf16, ref)),
        (mm, (x, w, offs, "1x128", "128x128", E4M3, E4M3, "pow2", 0, bf16, ref)),
        (mm, (x.float(), w.float(), offs, "mx", "mx", E4M3, E4M3, "mx_floor", 0, f32, ref)),
        # dgrad: dy [M, N] by wᵀ [E, K, N], a transposed view, the gradient in E5M2
        (mm, (dy, w.transpose(1, 2), offs, "row", "row", E5M2, E4M3, "pow2", 1, bf16, ref)),
        # wgrad: dyᵀ x over each group's own rows, float32 [E, N, K]
        (wgrad, (dy, x, offs, "mx", E5M2, E4M3, "mx_rceil", 0, False, ref)),
        (wgrad, (dy, x, offs, "1x128", E5M2, E4M3, "amax", 0, False, ref)),
        (wgrad, (dy, x, offs, "tensor", E5M2, E4M3, "amax", 2, False, ref)),
        (wgrad, (dy, x, offs, "row", E5M2, E4M3, "pow2", 0, True, ref)),  # gw_hp
    ]  # fmt: skip
    for op, args in cases:
        torch.library.opcheck(op, args)
    out = wgrad(dy, x, offs, "row", E5M2, E4M3, "pow2", 0, False, "reference")
    assert out.shape == (E, N, K) and out.dtype == torch.float32
    assert torch.equal(out[1], torch.zeros(N, K))  # the empty group's expert


def test_opcheck_passes_for_the_held_grouped_operator() -> None:
    # Frozen experts' GEMM: fp8 codes and E8M0 scales cross it (torch's schema check does
    # not run on fp8 tensors, as for fp8_block_scaled_mm).
    gen = torch.Generator().manual_seed(4)
    offs = offsets([5, 0, 13, 3])
    x = torch.randn(24, K, generator=gen).bfloat16()
    w = torch.randn(E, N, K, generator=gen).bfloat16()
    op, checks = torch.ops.computectx.fp8_held_grouped_mm, ("test_faketensor",)
    for g, rule in (("tensor", "amax"), ("mx", "mx_floor")):
        held = experts_serving_weight(
            w, QuantizedExperts(Recipe.parse(f"e4m3/{g}/dynamic/0"), Backend.REFERENCE)
        )
        sb = held.steps.reshape(-1) if g == "tensor" else held.steps.to(torch.float8_e8m0fnu)
        args = (x, held.codes, sb, offs, g, g, E4M3, rule, 0, torch.bfloat16, "reference")
        torch.library.opcheck(op, args, test_utils=checks)


def test_the_grouped_operators_mutate_nothing() -> None:
    for name in ("fp8_grouped_mm", "fp8_held_grouped_mm", "fp8_grouped_wgrad"):
        schema = getattr(torch.ops.computectx, name).default._schema
        assert not any(a.alias_info is not None for a in schema.arguments), name


# ----- torch.compile --------------------------------------------------------------------------


def grouped(
    policy: Recipe,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return quantized_grouped_mm(x, w, offs, policy, backend="reference") * 2

    return f


def step(
    f: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    dy: torch.Tensor,
) -> Grads:
    """``f``'s output and the gradients of x and w for the output gradient ``dy``."""
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = f(xg, wg, offs)
    y.backward(dy)  # type: ignore[no-untyped-call]
    assert xg.grad is not None and wg.grad is not None
    return y.detach(), xg.grad, wg.grad


def assert_equal(got: Grads, want: Grads, label: object) -> None:
    for name, g, e in zip(("y", "dx", "dw"), got, want, strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e), (label, name)


GROUP_SIZES = [
    [9, 0, 22, 9],
    [40, 0, 0, 0],
    [0, 0, 0, 40],
    [3, 3, 3, 31],
    [1, 2, 3, 4],
    [0, 0, 0, 0],
]


@pytest.mark.parametrize("text", ["e4m3/block/dynamic/0", "hybrid/row+gw_hp/dynamic/0"])
def test_compiles_whole_equals_eager_and_does_not_recompile_as_the_groups_change(text: str) -> None:
    policy = Recipe.parse(text)
    f = grouped(policy)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)  # a break would raise
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(E, N, K, generator=gen) / 8).bfloat16()
    m = 40
    for sizes in GROUP_SIZES:  # M fixed, the group sizes (offs' values) change every call
        x = torch.randn(m, K, generator=gen).bfloat16()
        dy = torch.randn(m, N, generator=gen).bfloat16()
        offs = offsets(sizes)
        assert_equal(step(compiled, x, w, offs, dy), step(f, x, w, offs, dy), sizes)
    assert counter.frame_count == 1, counter.frame_count


def test_m_changing_is_one_recompile_by_default_and_none_with_dynamic_shapes() -> None:
    f = grouped(Recipe.parse("e4m3/mx/dynamic/0"))
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(E, N, K, generator=gen) / 8).bfloat16()
    for dynamic, frames in ((None, 2), (True, 1)):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(f, fullgraph=True, backend=counter, dynamic=dynamic)
        for m, sizes in (
            (24, [5, 0, 13, 3]),
            (40, [0, 33, 7, 0]),
            (56, [14] * 4),
            (72, [70, 0, 1, 1]),
        ):
            x = torch.randn(m, K, generator=gen).bfloat16()
            dy = torch.randn(m, N, generator=gen).bfloat16()
            offs = offsets(sizes)
            assert_equal(step(compiled, x, w, offs, dy), step(f, x, w, offs, dy), (dynamic, m))
        assert counter.frame_count == frames, (dynamic, counter.frame_count)


def test_bad_offs_raise_from_a_compiled_call() -> None:
    compiled = torch.compile(
        grouped(Recipe.parse("e4m3/row/dynamic/0")), fullgraph=True, backend="aot_eager"
    )
    x, w = torch.randn(16, K), torch.randn(E, N, K)
    assert compiled(x, w, offsets([4, 4, 4, 4])).shape == (16, N)
    with pytest.raises(ValueError, match=r"offs\[2\] = 3 is below offs\[1\] = 8"):
        compiled(x, w, torch.tensor([4, 8, 3, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offs\[3\] = 17 is past the 16 rows"):
        compiled(x, w, torch.tensor([4, 8, 12, 17], dtype=torch.int32))


def test_inductor_compiles_forward_and_backward_bit_for_bit() -> None:
    f = grouped(Recipe.parse("e4m3/block/dynamic/0"))
    compiled = torch.compile(f, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(E, N, K, generator=gen) / 8).bfloat16()
    for sizes in ([9, 0, 22, 9], [1, 30, 0, 5]):
        x = torch.randn(40, K, generator=gen).bfloat16()
        dy = torch.randn(40, N, generator=gen).bfloat16()
        offs = offsets(sizes)
        assert_equal(step(compiled, x, w, offs, dy), step(f, x, w, offs, dy), sizes)


# ----- frozen experts (adv35 F4, F5) ------------------------------------------------------------


def frozen(text: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``f(x, w, offs)``: ``frozen_experts_mm`` of ``x`` by ``w`` frozen under ``text``
    (the codes made once, outside the compiled function)."""
    experts = QuantizedExperts(Recipe.parse(text), Backend.REFERENCE)
    w = (torch.randn(E, N, K, generator=torch.Generator().manual_seed(5)) / 8).bfloat16()
    held = experts_serving_weight(w, experts)

    def f(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return frozen_experts_mm(experts, x, held, offs) * 2

    return f


def assert_x_step_equal(
    got: Callable[..., torch.Tensor],
    want: Callable[..., torch.Tensor],
    x: torch.Tensor,
    offs: torch.Tensor,
) -> None:
    """``got``'s output and input gradient (for an all-ones output gradient) are ``want``'s."""
    for name, g, e in zip(("y", "dx"), _x_step(got, x, offs), _x_step(want, x, offs), strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e), (offs.tolist(), name)


def _x_step(
    f: Callable[..., torch.Tensor], x: torch.Tensor, offs: torch.Tensor
) -> list[torch.Tensor]:
    xg = x.clone().requires_grad_()
    y = f(xg, offs)
    y.backward(torch.ones_like(y))  # type: ignore[no-untyped-call]
    assert xg.grad is not None
    return [y.detach(), xg.grad]


def test_frozen_experts_compile_whole_and_do_not_recompile_as_the_groups_change() -> None:
    # F5: offs' values were read by the frozen GEMM's Python (a guard on u0 < 0 under
    # fullgraph); the operator reads them now, as the unfrozen GEMM's does.
    f = frozen("e4m3/row/dynamic/0")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(6)
    for sizes in GROUP_SIZES[:4]:
        x, offs = torch.randn(40, K, generator=gen).bfloat16(), offsets(sizes)
        assert_x_step_equal(compiled, f, x, offs)
    assert counter.frame_count == 1, counter.frame_count


def test_inductor_compiles_frozen_mx_experts_bit_for_bit() -> None:
    # F4: the activations' E8M0 scales were generated code (float8_e8m0fnu has no C++ type
    # in Inductor's CPU backend); they stay inside the operator now.
    f = frozen("e4m3/mx/dynamic/0")
    compiled = torch.compile(f)  # as reported: fullgraph=False, so F5's break did not hide it
    gen = torch.Generator().manual_seed(7)
    for sizes in ([9, 0, 22, 9], [1, 30, 0, 5]):
        x, offs = torch.randn(40, K, generator=gen).bfloat16(), offsets(sizes)
        assert_x_step_equal(compiled, f, x, offs)
