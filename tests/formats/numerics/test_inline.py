"""The inline quantize (plain torch ops, ``computectx.formats.numerics.inline``) against the
operators,
eager.

The operators are the specification: after every call of a sequence the inline functions
must give the same fp8 bytes, the same step, and leave the same ledger and tally, bit for bit.
The sequences start unseeded, vary the scale so the steps move, and include a NaN input
and an empty tensor, so seeding, rotation, the window, the counts and the tally are all
exercised. (Compiled runs are in tests/formats/test_compile.py.)
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.dtypes import Fp8Format
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.formats.backend import Backend
from computectx.formats.numerics import inline
from computectx.formats.numerics.ledger import (
    TALLY_ELEMENTS,
    TALLY_SEEDED,
    ledger_new,
    ledger_nonfinite,
    read_ledger,
    tally_new,
)
from computectx.formats.ops import tensorwise as tensor_ops
from computectx.formats.scaling.operand import OperandScaling
from computectx.recipes import DelayedScaling, DynamicScaling, Recipe

SCALINGS = [
    DelayedScaling(history_len=4),
    DelayedScaling(history_len=4, algo="most_recent", margin=2),
    DelayedScaling(history_len=1),
    DynamicScaling(),
    DynamicScaling(margin=1),
]


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    xs = [torch.randn(8, 16, dtype=torch.float32) * s for s in (1.0, 40.0, 0.01, 3.0, 1e6)]
    xs.insert(2, xs[0].clone())
    xs[2][1, 3] = math.nan  # a non-finite amax: counted, not recorded
    xs.insert(4, torch.zeros(0, 16))  # nothing to measure
    xs.append(torch.zeros(8, 16))  # amax 0: step 1.0
    return [x.to(dtype) for x in xs]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: repr(s))
@pytest.mark.parametrize("fmt", [Fp8Format.E4M3, Fp8Format.E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", [Backend.REFERENCE, Backend.CUBLAS])
def test_inline_quantize_matches_the_operator_bit_for_bit_call_after_call(
    scaling: DelayedScaling | DynamicScaling,
    fmt: Fp8Format,
    dtype: torch.dtype,
    backend: Backend,
) -> None:
    n = scaling.history_len if isinstance(scaling, DelayedScaling) else 1
    xs = _inputs(dtype)
    # Seeded by a finite first call, and (a fresh ledger) by a first call whose amax is NaN.
    for seq in (xs, [xs[2], *xs]):
        ledgers, tallies = _run_both(seq, fmt, scaling, backend, n)
        # The sequence did move the state (a no-op would pass the checks in _run_both).
        per_call = 8 * 16
        assert int(tallies["op"][TALLY_ELEMENTS]) == per_call * (len(seq) - 1)
        # Every NaN call is counted exactly once, a delayed first call included.
        assert float(ledger_nonfinite(ledgers["op"])) == len(seq) - len(xs) + 1


def _run_both(
    seq: list[torch.Tensor],
    fmt: Fp8Format,
    scaling: DelayedScaling | DynamicScaling,
    backend: Backend,
    n: int,
) -> tuple[dict[inline.QuantizeImpl, torch.Tensor], dict[inline.QuantizeImpl, torch.Tensor]]:
    dev = torch.device("cpu")
    ledgers = {impl: ledger_new(n, dev) for impl in inline.QUANTIZE_IMPLS}
    tallies = {impl: tally_new(dev) for impl in inline.QUANTIZE_IMPLS}
    for i, x in enumerate(seq):
        got = {
            impl: tensor_ops.quantize_operand(
                x, fmt, ledgers[impl], tallies[impl], scaling, backend=backend, impl=impl
            )
            for impl in inline.QUANTIZE_IMPLS
        }
        (q_op, s_op), (q_fu, s_fu) = got["op"], got["inline"]
        assert q_fu.dtype == q_op.dtype == fmt.torch and q_fu.shape == x.shape
        assert torch.equal(_u8(q_fu), _u8(q_op)), i
        assert torch.equal(s_fu, s_op), i
        assert torch.equal(ledgers["inline"], ledgers["op"]), (i, ledgers)
        assert torch.equal(tallies["inline"], tallies["op"]), (i, tallies)
    return ledgers, tallies


def test_parse_quantize_accepts_the_two_names_and_rejects_others() -> None:
    assert inline.parse_quantize("op") == "op"
    assert inline.parse_quantize("inline") == "inline"
    for bad in ("Fused", "inductor", None, 1):
        with pytest.raises(ValueError, match="'op' or 'inline'"):
            inline.parse_quantize(bad)


def test_the_quantize_option_reaches_every_converted_layer_and_is_checked(
    fp8_ctx: ComputeCtx,
) -> None:
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_quantized(m, fp8_ctx, min_features=16, include_head=True, quantize="inline")
    layers = [x for x in m.modules() if isinstance(x, QuantizedLinear)]
    assert len(layers) == 2 and all(x.quantize == "inline" for x in layers)
    assert QuantizedLinear(16, 16, ctx=fp8_ctx).quantize == "op"  # the default
    layers[0].quantize = "op"
    assert layers[0].quantize == "op"
    with pytest.raises(ValueError, match="'op' or 'inline'"):
        layers[0].quantize = "triton"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="'op' or 'inline'"):
        QuantizedLinear(16, 16, ctx=fp8_ctx, quantize="fast")  # type: ignore[arg-type]
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    with pytest.raises(ValueError, match="'op' or 'inline'"):
        convert_to_quantized(plain, fp8_ctx, min_features=16, quantize="")  # type: ignore[arg-type]
    assert not any(isinstance(x, QuantizedLinear) for x in plain.modules())  # left unchanged


def test_the_old_spelling_of_inline_is_refused_naming_the_new_one(fp8_ctx: ComputeCtx) -> None:
    old = inline.OLD_SPELLING
    assert old == "fused"  # rename.py: keep (the spelling before issue 14)
    renamed = f"'{old}' was renamed 'inline'"
    with pytest.raises(ValueError, match=renamed):
        inline.parse_quantize(old)
    with pytest.raises(ValueError, match=renamed):
        QuantizedLinear(16, 16, ctx=fp8_ctx, quantize=old)  # type: ignore[arg-type]
    layer = QuantizedLinear(16, 16, ctx=fp8_ctx)
    with pytest.raises(ValueError, match=renamed):
        layer.quantize = old  # type: ignore[assignment]
    assert layer.quantize == "op"
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    with pytest.raises(ValueError, match=renamed):
        convert_to_quantized(plain, fp8_ctx, min_features=16, quantize=old)  # type: ignore[arg-type]
    assert not any(isinstance(x, QuantizedLinear) for x in plain.modules())


def test_eager_calls_of_an_inline_layer_run_the_operators(
    fp8_ctx: ComputeCtx, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Outside torch.compile an "inline" layer keeps the operators (the Triton kernel on a GPU).
    called: list[str] = []
    real = inline.quantize_delayed

    def spy(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        called.append("inline")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(inline, "quantize_delayed", spy)
    layer = QuantizedLinear(16, 16, ctx=fp8_ctx, quantize="inline")
    layer(torch.randn(4, 16)).sum().backward()
    assert called == []
    assert isinstance(fp8_ctx.recipe, Recipe) and isinstance(fp8_ctx.recipe.scaling, DelayedScaling)
    # ... while the operand-level switch does route to it.
    x = torch.randn(4, 16)
    tensor_ops.quantize_operand(
        x,
        Fp8Format.E4M3,
        ledger_new(4, "cpu"),
        tally_new(torch.device("cpu")),
        DelayedScaling(history_len=4),
        backend=Backend.REFERENCE,
        impl="inline",
    )
    assert called == ["inline"]


class _OneRank:
    """An amax reduction over a group of one (what ``sync_scaling`` plugs in)."""

    armed = True
    reduces = True
    lockstep = True

    def __call__(self, amax: torch.Tensor, /) -> torch.Tensor:
        return amax.clone()


FIRST_CALL_PATHS = [
    "op",
    "op, may_seed=False after the seed",
    "inline",
    "scaling",
    "scaling, reduced",
]


@pytest.mark.parametrize("path", FIRST_CALL_PATHS)
def test_a_nan_in_the_first_delayed_call_is_counted_once_and_leaves_step_one(path: str) -> None:
    # docs/fp8.md, "Non-finite amax": the first call's NaN amax is neither seeded nor recorded,
    # the step stays 1.0 (a fresh ledger's), the count goes up by exactly one and the operand
    # counts as seeded; the next call quantizes with step 1.0 and records its own amax.
    fmt, scaling, dev = Fp8Format.E4M3, DelayedScaling(history_len=4), torch.device("cpu")
    ledger, tally = ledger_new(4, dev), tally_new(dev)
    op = OperandScaling(4, dev)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    x[2, 5] = math.nan

    def call(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if path.startswith("scaling"):
            # OperandScaling.quantize, eager: without a reduction the operator seeds; with
            # one (the data-parallel path) ops.seed_ledger seeds first and the operator skips it.
            reduce = _OneRank() if path.endswith("reduced") else None
            return op.quantize(t, fmt, scaling, Backend.REFERENCE, reduce=reduce)
        if path.startswith("op, may_seed=False"):
            tensor_ops.seed_ledger(ledger, t, fmt, scaling.margin)
            tally[TALLY_SEEDED] = 1
        return tensor_ops.quantize_operand(
            t, fmt, ledger, tally, scaling, backend=Backend.REFERENCE,
            may_seed=not path.startswith("op, may_seed=False"),
            impl="inline" if path == "inline" else "op",
        )  # fmt: skip

    q, step_used = call(x)
    r, t = (op.ledger, op.tally) if path.startswith("scaling") else (ledger, tally)
    after = read_ledger(r)
    assert after.nonfinite == 1.0
    assert after.history == (0.0, 0.0, 0.0, 0.0) and after.step == 1.0
    assert step_used.item() == 1.0 and after.saturated == 0.0
    assert t.tolist() == [1, x.numel()]
    assert torch.isnan(q.float()[2, 5]) and torch.equal(
        q.float().nan_to_num(), x.nan_to_num().to(fmt.torch).float()
    )
    # The next (finite) call is not seeded again: it quantizes with step 1.0 and records.
    y = torch.full((4, 16), 3.0)
    _, step_used = call(y) if not path.startswith("op, may_seed=False") else _second(y, r, t)
    after = read_ledger(r)
    assert step_used.item() == 1.0 and after.history == (0.0, 0.0, 0.0, 3.0)
    assert after.step == (torch.tensor([3.0]) / fmt.max).item() and after.nonfinite == 1.0


def _second(
    y: torch.Tensor, ledger: torch.Tensor, tally: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return tensor_ops.quantize_operand(
        y, Fp8Format.E4M3, ledger, tally, DelayedScaling(history_len=4),
        backend=Backend.REFERENCE, may_seed=False,
    )  # fmt: skip
