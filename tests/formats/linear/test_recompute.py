"""Activation checkpointing of fp8 layers is exact.

A checkpointed region's recomputed forward quantizes with the steps its original forward
used and records nothing, so gradients, ledgers and element counts are bit-identical to the
same steps run without checkpointing: torch.utils.checkpoint (reentrant and not) and
checkpoint_sequential, checkpoint_wrapper (both implementations, as torchtitan applies it),
FSDP2's composable checkpoint and selective checkpointing; delayed and dynamic scaling; a
layer called several times per step (a chunked loss); a graph backwarded twice. Inputs grow
over the steps so that delayed steps move between a forward and its recomputation.

Under torch.compile (aot_eager, a few small graphs) dynamic scaling is exact as it is;
delayed scaling is exact with ``checkpoint_context_fn`` and without a context_fn (each
fp8 call checkpoints itself under it), and refuses at trace time under another context_fn or
an inline quantize (AOTAutograd would recompute from the advanced ledger).
"""

from __future__ import annotations

import copy
import functools
import gc
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.distributed._composable.checkpoint_activation import (
    checkpoint as composable_checkpoint,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.nn import functional
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, convert_to_quantized
from computectx.formats.linear.recompute import (
    checkpoint_context_fn,
    checkpoint_policy,
    checkpoint_site,
    live_regions,
)
from computectx.recipes import DelayedScaling, DynamicScaling, Recipe

SCALINGS = [DelayedScaling(history_len=4), DynamicScaling()]
SCALING_IDS = ["delayed", "dynamic"]
STEPS = 4
ROLES = ("input", "weight", "grad")

Forward = Callable[[nn.Module, torch.Tensor], torch.Tensor]
ContextFn = Callable[[], tuple[Any, Any]]


def ctx_with(scaling: DelayedScaling | DynamicScaling) -> ComputeCtx:
    return ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(recipe=Recipe(scaling=scaling))


def mlp(scaling: DelayedScaling | DynamicScaling) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    report = convert_to_quantized(m, ctx_with(scaling), min_features=16, include_head=True)
    assert len(report.converted) == 2
    return m


def scaling_state(m: nn.Module) -> dict[str, object]:
    """Every fp8 layer's ledgers, seeded flags and element counts (public attributes)."""
    out: dict[str, object] = {}
    for name, layer in m.named_modules():
        if isinstance(layer, QuantizedLinear):
            for role in ROLES:
                op = getattr(layer.scaling, role)
                out[f"{name}.{role}.ledger"] = op.ledger.clone()
                out[f"{name}.{role}.elements"] = op.elements
                out[f"{name}.{role}.seeded"] = op.seeded
    return out


def _strip(name: str) -> str:
    # Wrappers prefix the wrapped module's names (checkpoint_wrapper's
    # "_checkpoint_wrapped_module."): compare by the model's own names.
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def assert_same_state(want: dict[str, object], got: dict[str, object], where: str) -> None:
    got = {_strip(k): v for k, v in got.items()}
    assert set(want) == set(got), where
    for key, value in want.items():
        other = got[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor)
            assert torch.equal(value, other), f"{where}: {key}"
        else:
            assert value == other, f"{where}: {key}: {value} != {other}"


def backward(loss: torch.Tensor, retain_graph: bool = False) -> None:
    loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]


def inputs(step: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    # The scale grows every step, so a delayed step moves at every call.
    return (torch.randn(24, 64) * (1.0 + 3.0 * step)).requires_grad_()


def train(model: nn.Module, forward: Forward) -> Iterator[tuple[torch.Tensor, ...]]:
    """Per step: output, input gradient, parameter gradients (the model keeps its state)."""
    for step in range(STEPS):
        x = inputs(step)
        model.zero_grad(set_to_none=True)
        y = forward(model, x)
        backward(y.float().square().mean())
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        assert x.grad is not None
        yield (y.detach(), x.grad.clone(), *grads)


def plain(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = m(x)
    return out


def sequential(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Two segments: the first checkpointed, the last run as usual (checkpoint_sequential).
    out: torch.Tensor = checkpoint_sequential(m, 2, x, use_reentrant=False)  # type: ignore[no-untyped-call]
    return out


def _save_gemms(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    # torchtitan's kind of policy: keep the matmul outputs, recompute the rest.
    if op is torch.ops.computectx.fp8_scaled_mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


WRAPPERS: dict[str, tuple[Callable[[nn.Module], nn.Module], Forward]] = {
    "non_reentrant": (lambda m: m, lambda m, x: checkpoint(m, x, use_reentrant=False)),
    "reentrant": (lambda m: m, lambda m, x: checkpoint(m, x, use_reentrant=True)),
    "sequential": (lambda m: m, sequential),
    "wrapper_non_reentrant": (
        lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        plain,
    ),
    "wrapper_reentrant": (
        lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.REENTRANT),
        plain,
    ),
    "fsdp2_composable": (composable_checkpoint, plain),
    "selective": (
        lambda m: m,
        lambda m, x: checkpoint(
            m,
            x,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _save_gemms),
        ),
    ),
    "selective_fp8_policy": (
        lambda m: m,
        lambda m, x: checkpoint(
            m, x, use_reentrant=False, context_fn=checkpoint_context_fn(_save_gemms)
        ),
    ),
}


def regions_left() -> int:
    """The regions still remembered once every dead graph is collected."""
    # A full gc.collect costs ~0.2 s on the suite's heap (torch, dynamo): run it only when
    # regions are left, which is when it can change the count (zero stays zero).
    if live_regions() == 0:
        return 0
    gc.collect()
    return live_regions()


@pytest.fixture(autouse=True)
def _no_regions_left() -> Iterator[None]:
    yield
    assert regions_left() == 0  # nothing a test's graphs remembered outlives them


# ----- one call per layer per step ----------------------------------------------------------


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
def test_checkpointed_training_is_bit_identical_to_plain_training(
    scaling: DelayedScaling | DynamicScaling, wrapper: str
) -> None:
    wrap, forward = WRAPPERS[wrapper]
    ref, ckpt = mlp(scaling), wrap(mlp(scaling))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to replay would warn
        runs = zip(train(ref, plain), train(ckpt, forward), strict=True)
        for step, (want, got) in enumerate(runs):
            assert len(want) == len(got) == 6  # y, dx, two weights, two biases
            for a, b in zip(want, got, strict=True):
                assert torch.equal(a, b), (wrapper, step)
            assert_same_state(scaling_state(ref), scaling_state(ckpt), f"{wrapper} step {step}")
    # Each operand counted once per call: a recomputation adds nothing.
    assert mlp_elements(ckpt) == (STEPS * 24 * 64, STEPS * 24 * 128)


def mlp_elements(m: nn.Module) -> tuple[int, int]:
    first, second = (layer for layer in m.modules() if isinstance(layer, QuantizedLinear))
    return first.scaling.input.elements, second.scaling.input.elements


def test_the_recorded_steps_move_between_a_forward_and_its_recomputation() -> None:
    # The premise of the tests above: without replay, the recomputation would see another
    # step (the input ledger advanced when the forward recorded).
    m = mlp(DelayedScaling(history_len=4))
    layer = m[0]
    assert isinstance(layer, QuantizedLinear)
    for step in range(2):
        m(inputs(step)).sum().backward()
    before = layer.scaling.input.ledger.clone()
    y = checkpoint(m, inputs(2), use_reentrant=False)
    assert not torch.equal(before, layer.scaling.input.ledger)
    y.sum().backward()


# ----- a layer called several times in one step ----------------------------------------------


class ChunkedLM(nn.Module):
    """A trunk and a head; the loss runs the head chunk by chunk (each chunk checkpointed)."""

    def __init__(self, scaling: DelayedScaling | DynamicScaling) -> None:
        super().__init__()
        torch.manual_seed(1)
        ctx = ctx_with(scaling)
        self.trunk = QuantizedLinear(64, 64, ctx=ctx, dtype=torch.float32)
        self.head = QuantizedLinear(64, 256, ctx=ctx, dtype=torch.float32)

    def head_loss(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(self.head(h).float(), target, reduction="sum")

    def loss(self, x: torch.Tensor, target: torch.Tensor, reentrant: bool | None) -> torch.Tensor:
        h = functional.gelu(self.trunk(x))
        total = torch.zeros(())
        for hc, tc in zip(h.chunk(3), target.chunk(3), strict=True):
            if reentrant is None:
                total = total + self.head_loss(hc, tc)
            else:
                total = total + checkpoint(self.head_loss, hc, tc, use_reentrant=reentrant)
        return total / target.numel()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("scaling", SCALINGS, ids=SCALING_IDS)
def test_a_head_called_per_chunk_is_scaled_and_recorded_per_call(
    scaling: DelayedScaling | DynamicScaling, reentrant: bool
) -> None:
    ref, ckpt = ChunkedLM(scaling), ChunkedLM(scaling)
    for step in range(STEPS):
        torch.manual_seed(200 + step)
        x = torch.randn(30, 64) * (1.0 + 3.0 * step)
        target = torch.randint(0, 256, (30,))
        for m, mode in ((ref, None), (ckpt, reentrant)):
            m.zero_grad(set_to_none=True)
            backward(m.loss(x, target, mode))
        for (name, a), b in zip(ref.named_parameters(), ckpt.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad), (step, name)
        assert_same_state(scaling_state(ref), scaling_state(ckpt), f"step {step}")
    # Three calls per step, each counted once: 30 rows of 64 inputs, 30 rows of 256 grads.
    assert ckpt.head.scaling.input.elements == STEPS * 30 * 64
    assert ckpt.head.scaling.grad.elements == STEPS * 30 * 256


# ----- graphs backwarded twice, graphs never backwarded -------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_graph_backwarded_twice_replays_the_same_steps_twice(reentrant: bool) -> None:
    scaling = DelayedScaling(history_len=4)
    ref, ckpt = mlp(scaling), mlp(scaling)
    for step in range(2):
        x = inputs(step)
        for m, ckptd in ((ref, False), (ckpt, True)):
            m.zero_grad(set_to_none=True)
            y = checkpoint(m, x, use_reentrant=reentrant) if ckptd else m(x)
            loss = y.float().square().mean()
            loss.backward(retain_graph=True)
            loss.backward()
        for a, b in zip(ref.parameters(), ckpt.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad), step
        assert_same_state(scaling_state(ref), scaling_state(ckpt), f"step {step}")


def test_forwards_whose_backward_never_runs_leave_nothing_behind() -> None:
    m = mlp(DelayedScaling(history_len=4))
    for step in range(3):
        checkpoint(m, inputs(step), use_reentrant=False)  # training, dropped unused
        m.eval()
        checkpoint(m, inputs(step), use_reentrant=False)  # eval under grad, dropped
        m.train()
    assert regions_left() == 0
    # Training with checkpointing holds one region per step at most, only until backward.
    for step in range(3):
        y = checkpoint(m, inputs(step), use_reentrant=False)
        assert live_regions() == 1
        y.sum().backward()
        del y
        assert regions_left() == 0


def test_an_eval_forward_under_checkpointing_records_nothing() -> None:
    m = mlp(DelayedScaling(history_len=4))
    m(inputs(0)).sum().backward()
    before = scaling_state(m)
    m.eval()
    for reentrant in (False, True):
        checkpoint(m, inputs(1), use_reentrant=reentrant).sum().backward()
    assert_same_state(before, scaling_state(m), "eval")


# ----- where a call is, and what is not recognised ------------------------------------------


def test_checkpoint_site_tells_forward_recompute_and_neither_apart() -> None:
    seen: list[tuple[str, str | None]] = []

    def region(x: torch.Tensor, tag: str) -> torch.Tensor:
        site = checkpoint_site(record=True)
        seen.append((tag, None if site is None else site.kind))
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    backward(region(x, "plain").sum())
    checkpoint(region, x, "non_reentrant", use_reentrant=False).sum().backward()
    checkpoint(region, x, "reentrant", use_reentrant=True).sum().backward()
    assert seen == [
        ("plain", None),
        ("non_reentrant", "forward"),
        ("non_reentrant", "recompute"),
        ("reentrant", "forward"),
        ("reentrant", "recompute"),
    ]


def test_a_nested_checkpoint_records_nothing_twice_and_says_so() -> None:
    # An inner region re-entered by an outer region's recomputation has no steps of its
    # own to replay: it quantizes from the state as it is, records nothing, and warns.
    m = mlp(DelayedScaling(history_len=4))
    inner = m[0]

    def outer(x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(inner, x, use_reentrant=False)
        out: torch.Tensor = m[2](m[1](h))
        return out

    for step in range(2):
        loss = checkpoint(outer, inputs(step), use_reentrant=False).sum()
        with pytest.warns(UserWarning, match="no steps remembered"):
            backward(loss)
    assert mlp_elements(m) == (2 * 24 * 64, 2 * 24 * 128)


# ----- selective policies -------------------------------------------------------------------


def test_fp8_checkpoint_policy_saves_the_delayed_quantize_and_defers_the_rest() -> None:
    delayed = torch.ops.computectx.fp8_quantize_delayed.default
    mm = torch.ops.aten.mm.default
    gemm = torch.ops.computectx.fp8_scaled_mm.default
    must, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert checkpoint_policy()(None, delayed) is must
    assert checkpoint_policy()(None, gemm) is recompute
    assert checkpoint_policy([mm])(None, mm) is must
    assert checkpoint_policy([mm])(None, gemm) is recompute
    assert checkpoint_policy(_save_gemms)(None, gemm) is must
    assert checkpoint_policy(_save_gemms)(None, delayed) is must


# ----- torch.compile ------------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, context_fn: ContextFn | None) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context_fn is None:
            out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
        else:
            out = checkpoint(self.inner, x, use_reentrant=False, context_fn=self.context_fn)
        return out


def _compiled_matches_eager(
    scaling: DelayedScaling | DynamicScaling, context_fn: ContextFn | None
) -> None:
    torch._dynamo.reset()
    try:
        ref = mlp(scaling)
        model = Checkpointed(copy.deepcopy(ref), context_fn)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        for step, (want, got) in enumerate(
            zip(train(ref, plain), train(model, lambda _, x: compiled(x)), strict=True)
        ):
            for a, b in zip(want, got, strict=True):
                assert torch.equal(a, b), step
            assert_same_state(
                scaling_state(ref), scaling_state(model.inner), f"compiled step {step}"
            )
    finally:
        torch._dynamo.reset()


def test_compiled_dynamic_scaling_is_bit_identical() -> None:
    _compiled_matches_eager(DynamicScaling(), None)


def test_compiled_delayed_scaling_with_the_fp8_policy_is_bit_identical() -> None:
    _compiled_matches_eager(DelayedScaling(history_len=4), checkpoint_context_fn())


def test_compiled_delayed_scaling_without_a_context_fn_is_bit_identical() -> None:
    # AOTAutograd would recompute the delayed quantize from the ledger the forward already
    # advanced (pytorch/pytorch#197039): each fp8 call checkpoints itself under the fp8
    # policy inside the region, so its quantize is saved.
    _compiled_matches_eager(DelayedScaling(history_len=4), None)


def _compile_one_step(layer: QuantizedLinear, context_fn: ContextFn | None) -> None:
    torch._dynamo.reset()
    try:
        compiled = torch.compile(
            Checkpointed(layer, context_fn), fullgraph=True, backend="aot_eager"
        )
        compiled(torch.randn(4, 32, requires_grad=True)).float().sum().backward()
    finally:
        torch._dynamo.reset()


def test_compiled_delayed_scaling_under_another_context_fn_refuses_at_trace_time() -> None:
    # Another policy cannot be extended from inside its region: rather than gradients that
    # silently differ, the trace stops and names the fix.
    foreign = functools.partial(create_selective_checkpoint_contexts, _save_gemms)
    layer = QuantizedLinear(
        32, 32, ctx=ctx_with(DelayedScaling(history_len=4)), dtype=torch.float32
    )
    with pytest.raises(RuntimeError, match=r"context_fn=checkpoint_context_fn\(your_policy\)"):
        _compile_one_step(layer, foreign)
    assert layer.scaling.input.elements == 0  # refused while tracing, before any step ran
    # Dynamic scaling reads no ledger: any policy is exact (nothing refused).
    _compiled_matches_eager(DynamicScaling(), foreign)


def test_compiled_inline_delayed_quantize_in_a_checkpoint_refuses_at_trace_time() -> None:
    ctx = ctx_with(DelayedScaling(history_len=4))
    for context_fn in (None, checkpoint_context_fn()):
        layer = QuantizedLinear(32, 32, ctx=ctx, quantize="inline", dtype=torch.float32)
        with pytest.raises(RuntimeError, match="quantize='inline'"):
            _compile_one_step(layer, context_fn)


def test_a_reentrant_checkpoint_under_no_grad_records_nothing() -> None:
    # A validation pass in training mode through a reentrant checkpoint (Hugging Face's
    # gradient-checkpointing pattern) builds no graph, is never recomputed, and so is no
    # training forward: its ledgers stay as they were.
    layer = QuantizedLinear(32, 32, ctx=ComputeCtx.from_flag("fp8_hybrid", "cpu"))
    x = torch.randn(4, 32, requires_grad=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint(layer, x, use_reentrant=True)
    assert layer.scaling.input.elements == 0
    checkpoint(layer, x, use_reentrant=True).sum().backward()
    assert layer.scaling.input.elements == x.numel()
