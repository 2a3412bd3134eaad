"""``offload``: activations kept in host memory, tested on a CPU through a stand-in for CUDA's
streams that keeps CUDA's rules: a copy runs only once something waits for it (the latest a
device may run it), a tensor brought back reads NaN until the compute stream waited for it, a
copy back starts only after the copy out it reads; and it counts the device bytes offload
holds at every step."""

from __future__ import annotations

import gc
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

from computectx import ComputeCtx, DType
from computectx.formats import Fp4Linear, QuantizedLinear, convert_to_quantized
from computectx.memory import SavedActivations
from computectx.memory.activation_bytes import SavedKind
from computectx.nn import ByteLM, Gemm, GemmPath, LMConfig
from computectx.nn.experts import GroupedExperts
from computectx.offload import STREAMS, OffloadBlocks
from computectx.saved import saved_call

CONFIG = LMConfig(d_model=32, n_layers=3, n_heads=2, d_ff=32, max_len=32)
DENSE = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32, max_len=32)
MOE = LMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=32, max_len=32, n_experts=4, top_k=2)
KINDS = "precise:offload/act_fn:offload/attention:offload/residual:offload"


class _Event:
    def __init__(self, action: Callable[[], None]) -> None:
        self.action: Callable[[], None] | None = action

    def complete(self) -> None:
        if self.action is not None:  # an event holds no tensor once its copy is done
            action, self.action = self.action, None
            action()


class StandIn:
    """``Streams`` on a CPU, lazily: see the module docstring."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []  # (operation, tensor number)
        self.holding: dict[int, int] = {}  # tensor number -> device bytes offload holds
        self.peak_in: list[int] = []  # what it holds at each operation
        self.nbytes: list[int] = []  # device bytes of each tensor offloaded
        self._numbers: dict[int, int] = {}  # id(event or host) -> tensor number

    def _record(self, what: str, number: int) -> None:
        self.log.append((what, number))
        self.peak_in.append(sum(self.holding.values()))

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        number = len(self.nbytes)  # ids are looked up only while their objects live
        host = torch.empty(t.shape, dtype=t.dtype)
        self.holding[number] = t.untyped_storage().nbytes()  # t stays until the copy
        self.nbytes.append(self.holding[number])

        def copy() -> None:
            host.copy_(t)
            del self.holding[number]

        done = _Event(copy)
        self._numbers[id(done)] = self._numbers[id(host)] = number
        self._record("to_host", number)
        return host, done

    def to_device(
        self, host: torch.Tensor, device: torch.device, after: Any
    ) -> tuple[torch.Tensor, Any]:
        number = self._numbers[id(host)]
        assert self._numbers[id(after)] == number, "the copy back waits for its own copy out"
        t = torch.empty_like(host)  # unreadable until waited for: all bits set (NaN for
        t.reshape(-1).view(torch.uint8).fill_(255)  # a float; -6 for a pair of e2m1 codes)
        key = -1 - number  # the copy back, held while the backward uses it
        self.holding[key] = t.untyped_storage().nbytes()
        weakref.finalize(t, self.holding.pop, key, None)

        def copy() -> None:
            after.complete()
            t.copy_(host)

        done = _Event(copy)
        self._numbers[id(done)] = number
        self._record("to_device", number)
        return t, done

    def wait(self, event: Any, t: torch.Tensor | None = None) -> None:
        event.complete()
        self._record("wait" if t is not None else "throttle", self._numbers[id(event)])


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    streams = StandIn()
    token = STREAMS.set(streams)
    try:
        yield streams
    finally:
        STREAMS.reset(token)


def _train(spec: str) -> tuple[ByteLM, torch.Tensor, SavedActivations]:
    ctx = ComputeCtx.new(DType.BF16, "cpu").with_activations(spec)
    torch.manual_seed(0)
    model = ByteLM(ctx, CONFIG)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    with SavedActivations(exclude=[*model.parameters(), *model.buffers()]) as saved:
        loss = model.loss(ids[:, :-1], ids[:, 1:])
    return model, loss, saved


def _grads(model: ByteLM) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


class _Blocks:
    """What the stand-in saw of a ``ByteLM``'s blocks: the tensors each offloaded, the device
    bytes held as the last block starts, and where the log stood once the last block's
    backward was done (its input's gradient computed)."""

    def __init__(self, model: ByteLM, stand_in: StandIn) -> None:
        self.ends: list[int] = []  # tensors offloaded by the end of each block
        self.last_starts: list[int] = []  # device bytes offload holds as the last block starts
        self.last_done: list[int] = []  # log length once the last block's backward is done
        for blk in model.blocks:
            blk.register_forward_hook(lambda *_: self.ends.append(len(stand_in.nbytes)))

        def last(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.last_starts.append(sum(stand_in.holding.values()))
            args[0].register_hook(done)  # type: ignore[no-untyped-call]

        def done(_: torch.Tensor) -> None:
            self.last_done.append(len(stand_in.log))

        model.blocks[-1].register_forward_pre_hook(last)

    def groups(self) -> list[list[int]]:
        """The numbers of the tensors each block offloaded."""
        return [list(range(a, b)) for a, b in zip([0, *self.ends], self.ends, strict=False)]


def _assert_one_block(stand_in: StandIn, blocks: _Blocks, forward: int) -> int:
    """The bound of docs/activations.md ("Offload"), checked at every operation of a step
    (``forward``: the log's length when the backward started): the device bytes offload holds
    never exceed the largest block's offloaded bytes, none while the last block (not
    offloaded: it keeps its inputs as they are) runs its forward or its backward; every
    tensor's copy back was started before the tensor used just before it was waited for
    (prefetched, not fetched on demand; the first of them comes back while nothing computes:
    the cost of the bound). Returns that bound."""
    largest = max(sum(stand_in.nbytes[n] for n in group) for group in blocks.groups())
    assert max(stand_in.peak_in) <= largest
    assert blocks.last_starts == [0]
    final = stand_in.log[forward:]
    first_back = next(i for i, (op, _) in enumerate(final) if op == "to_device")
    assert blocks.last_done and forward + first_back >= blocks.last_done[0]
    waits = [i for i, (op, _) in enumerate(final) if op == "wait"]
    for before, now in itertools.pairwise(waits):
        assert final.index(("to_device", final[now][1])) < before
    return largest


def test_offload_holds_at_most_one_block_on_the_device_and_keeps_gradients(
    stand_in: StandIn,
) -> None:
    ctx = ComputeCtx.new(DType.BF16, "cpu").with_activations(KINDS)
    torch.manual_seed(0)
    model = ByteLM(ctx, CONFIG)
    blocks = _Blocks(model, stand_in)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    with SavedActivations(exclude=[*model.parameters(), *model.buffers()]) as saved:
        loss = model.loss(ids[:, :-1], ids[:, 1:])
    forward = len(stand_in.log)
    groups = blocks.groups()
    sizes = [len(g) for g in groups]
    # The last block (and the final norm) keeps its inputs on the device: its backward
    # comes first.
    assert sizes == [sizes[0], sizes[0], 0] and sizes[0] > 1
    per_block = sum(stand_in.nbytes[n] for n in groups[0])
    assert sum(stand_in.nbytes) == 2 * per_block
    # The forward overlaps each copy out with about a block of compute: the compute stream
    # waits for a copy only when the tensor of the same place in the next block goes out.
    for n in range(2 * sizes[0]):
        waited = stand_in.log.index(("throttle", n))
        assert waited > stand_in.log.index(("to_host", min(n + sizes[0] - 1, 2 * sizes[0] - 1)))
    torch.autograd.backward(loss, retain_graph=True)
    assert _assert_one_block(stand_in, blocks, forward) == per_block
    # Each tensor came back once, the last offloaded first, and was used once; nothing is
    # left on the device.
    final = stand_in.log[forward:]
    assert sorted(n for op, n in final if op == "wait") == list(range(2 * sizes[0]))
    assert [n for op, n in final if op == "to_device"] == list(range(2 * sizes[0]))[::-1]
    assert not stand_in.holding
    # Exact: on the way back the op computes its internals again from the same input.
    keep, keep_loss, kept = _train("keep")
    torch.autograd.backward(keep_loss)
    assert torch.equal(loss, keep_loss)
    first = _grads(model)
    assert all(torch.equal(a, b) for a, b in zip(first, _grads(keep), strict=True))
    # A second backward (retain_graph) brings them back again, the same way.
    first = [g.clone() for g in first]
    torch.autograd.backward(loss)
    assert stand_in.log[forward + len(final) :] == final and not stand_in.holding
    assert all(torch.equal(2 * a, b) for a, b in zip(first, _grads(model), strict=True))
    # What stays on the device for the backward: the inputs of the first two blocks' ops
    # are gone; the last block keeps them as recompute does.
    assert saved.bytes() < kept.bytes()
    _, _, recomputed = _train("precise:recompute/act_fn:recompute/attention:recompute")
    kinds: tuple[SavedKind, ...] = ("precise", "act_fn", "attention", "residual")
    assert all(saved.bytes(kind) > 0 for kind in kinds)
    assert sum(saved.bytes(k) for k in kinds) < sum(recomputed.bytes(k) for k in kinds) * 2 // 3


def test_the_window_is_the_largest_block_offloaded_so_far(stand_in: StandIn) -> None:
    # Blocks of 1, 3 and 2 tanh's (128 bytes each offloaded), then a last block kept: the
    # compute stream waits for a copy out only when the copies in flight and the new one
    # would pass the largest block seen so far (this one counted as it grows).
    x = torch.randn(4, 8, requires_grad=True)
    blocks = OffloadBlocks()
    with blocks.active():
        h = x
        for n in (1, 3, 2):
            for _ in range(n):
                h = saved_call(torch.tanh, h, mode="offload")
            h = blocks.boundary(h)
        blocks.last_block()
        h = blocks.boundary(saved_call(torch.tanh, h, mode="offload"))
    host, wait = ("to_host", "throttle")
    assert stand_in.log == [
        (host, 0), (wait, 0), (host, 1), (host, 2), (host, 3), (wait, 1),
        (host, 4), (wait, 2), (host, 5), (wait, 3), (wait, 4), (wait, 5),
    ]  # fmt: skip
    forward = len(stand_in.log)
    torch.autograd.backward(h.sum())
    assert max(stand_in.peak_in) == 3 * 128 and not stand_in.holding
    final = stand_in.log[forward:]  # the last block's three come back at once, then one a use
    assert final[:3] == [("to_device", 5), ("to_device", 4), ("to_device", 3)]
    assert [n for op, n in final if op == "wait"] == [5, 4, 3, 2, 1, 0]
    y = x.detach().requires_grad_()
    reference = y
    for _ in range(7):
        reference = torch.tanh(reference)
    torch.autograd.backward(reference.sum())
    assert torch.equal(h, reference) and x.grad is not None and y.grad is not None
    assert torch.equal(x.grad, y.grad)


def test_offload_outside_a_model_fetches_on_demand_and_a_second_backward_again(
    stand_in: StandIn,
) -> None:
    x = torch.randn(8, 64, requires_grad=True)
    w = torch.nn.Parameter(torch.rand(64))
    y = saved_call(lambda t, v: torch.tanh(t) * v, x, w, mode="offload")
    assert stand_in.log == [("to_host", 0)]
    torch.autograd.backward(y.sum(), retain_graph=True)
    assert stand_in.log[1:] == [("to_device", 0), ("wait", 0)]
    first = x.grad.clone() if x.grad is not None else None
    x.grad = None
    torch.autograd.backward(y.sum())
    assert stand_in.log[3:] == [("to_device", 0), ("wait", 0)]
    assert first is not None and x.grad is not None and torch.equal(first, x.grad)
    torch.testing.assert_close(first, (1 - torch.tanh(x.detach()) ** 2) * w.detach())


def test_offload_on_a_cpu_keeps_the_input_as_recompute_does() -> None:
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    with SavedActivations() as offloaded:
        torch.autograd.backward(saved_call(torch.tanh, x, mode="offload", kind="precise").sum())
    with SavedActivations() as recomputed:
        torch.autograd.backward(saved_call(torch.tanh, x, mode="recompute", kind="precise").sum())
    assert offloaded.counts == recomputed.counts and offloaded.bytes("precise") == 8 * 64 * 2


# ----- linear: offload ---------------------------------------------------------------------

M, K, H = 32, 64, 48  # rows, in features, hidden (the experts' second GEMM reads M x H)
OFFS = torch.tensor([10, 10, M], dtype=torch.int32)  # one empty group
# What each linear sends to the host: its input as its backward keeps it.
_SENT = {
    "upcast": 2 * M * K,  # X at bf16
    "native": 2 * M * K,
    "fp8_rowwise": 2 * M * K,  # X: the wgrad quantizes Xᵀ from it
    "fp8_hybrid": M * K,  # the per-tensor fp8 codes of X
    "bf16 experts": 2 * M * K + 2 * M * H,  # both GEMMs' inputs at bf16
    "fp8_rowwise experts": 2 * M * K + 2 * M * H,
    # Xᵀ's 4-bit operand: K x M codes two a byte, an E4M3 scale per 16, the float32 amax.
    "nvfp4": K * M // 2 + K * M // 16 + 4,
}


def _linear_run(layer: str, mode: str) -> tuple[torch.nn.Module, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    if layer in ("upcast", "native"):
        linear = torch.nn.Linear(K, H, bias=False)
        gemm = Gemm(GemmPath(layer), torch.bfloat16, mode)  # type: ignore[arg-type]
        return linear, lambda x: gemm.linear(x, linear.weight)
    flag = layer.removesuffix(" experts")
    ctx = ComputeCtx.from_flag(flag, "cpu").with_activations(f"linear:{mode}")
    if layer == "nvfp4":
        f = Fp4Linear.from_linear(torch.nn.Linear(K, H, bias=False), ctx)
        return f, f
    if layer == flag:
        q = QuantizedLinear.from_linear(torch.nn.Linear(K, H, bias=False), ctx)
        return q, q
    experts = GroupedExperts(ctx, K, H, 3)
    if ctx.recipe is not None:
        convert_to_quantized(experts, ctx, min_features=16)
    return experts, lambda x: experts(x, OFFS)


@pytest.mark.parametrize("layer", list(_SENT))
def test_linears_offload_the_input_they_keep_and_give_keeps_gradients(
    stand_in: StandIn, layer: str
) -> None:
    x0 = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grads, kept = [], []
    for mode in ("keep", "offload"):
        module, run = _linear_run(layer, mode)
        x = x0.clone().requires_grad_()
        with SavedActivations(exclude=list(module.parameters())) as saved:
            y = run(x)
        torch.autograd.backward(y.float().pow(2).sum())
        grads.append([x.grad, *(p.grad for p in module.parameters())])
        kept.append(saved.bytes("linear"))
    # Keep sent nothing; offload each kept input once, brought back and used once.
    assert sum(stand_in.nbytes) == _SENT[layer] and not stand_in.holding
    sent = len(stand_in.nbytes)
    assert sorted(n for op, n in stand_in.log if op == "wait") == list(range(sent))
    assert kept[1] < kept[0]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("streams", ["stand-in", "cpu"])
def test_a_bare_offload_trains_a_byte_lm_as_keep(config: LMConfig, streams: str) -> None:
    # Every kind offloaded, the linears too: through the stand-in, or on a CPU (each input
    # kept as it is), the gradients of keep.
    stand_in = StandIn()
    token = STREAMS.set(stand_in if streams == "stand-in" else None)
    grads = []
    try:
        for spec in ("keep", "offload"):
            torch.manual_seed(0)
            model = ByteLM(ComputeCtx.new(DType.BF16, "cpu").with_activations(spec), config)
            blocks = _Blocks(model, stand_in)
            ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
            loss = model.loss(ids[:, :-1], ids[:, 1:])
            forward = len(stand_in.log)
            torch.autograd.backward(loss)
            grads.append(_grads(model))
    finally:
        STREAMS.reset(token)
    if streams == "stand-in":  # the bound, with the linears and the experts offloaded
        assert _assert_one_block(stand_in, blocks, forward) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    sent = len(stand_in.nbytes)  # each brought back and used once; nothing left
    assert (sent > 0) == (streams == "stand-in") and not stand_in.holding
    assert sorted(n for op, n in stand_in.log if op == "wait") == list(range(sent))


# ----- the adversarial review of the one-block bound (notes/adv_offload) -------------------


class _Eager:
    """``Streams`` copying at once and holding nothing: what lives is what offload holds."""

    def __init__(self) -> None:
        self.hosts: list[weakref.ref[torch.Tensor]] = []
        self.backs: list[weakref.ref[torch.Tensor]] = []

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        host = t.detach().clone()
        self.hosts.append(weakref.ref(host))
        return host, None

    def to_device(
        self, host: torch.Tensor, device: torch.device, after: Any
    ) -> tuple[torch.Tensor, Any]:
        back = host.clone()
        self.backs.append(weakref.ref(back))
        return back, None

    def wait(self, event: Any, t: torch.Tensor | None = None) -> None:
        pass


def _square(t: torch.Tensor) -> torch.Tensor:
    return t * t


def test_an_input_changed_in_place_after_it_went_out_is_refused_as_keep_refuses(
    stand_in: StandIn,
) -> None:
    # The copy out runs as late as CUDA may: it would read the new values (a wrong gradient).
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1.0
    y = saved_call(_square, h, mode="offload")
    h.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*\(4, 8\)"):
        torch.autograd.backward(y.sum())
    weight = torch.nn.Parameter(torch.randn(6, 8))
    gemm = Gemm(GemmPath("upcast"), torch.float32, "offload")
    h = x * 1.0
    y = gemm.linear(h, weight)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.backward(y.sum())
    # In a window, the input is watched until its copy out is waited for, even once dropped.
    blocks = OffloadBlocks()
    with blocks.active():
        h = x * 1.0
        y = saved_call(_square, h, mode="offload")
        h.mul_(2.0)
        del h
        y = blocks.boundary(saved_call(_square, y, mode="offload"))
        blocks.last_block()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.backward(y.sum())


def test_host_copies_are_freed_with_the_graph_without_the_cyclic_gc() -> None:
    streams = _Eager()
    token = STREAMS.set(streams)
    model = ByteLM(ComputeCtx.new(DType.BF16, "cpu").with_activations("offload"), CONFIG)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(2):
            torch.autograd.backward(model.loss(ids[:, :-1], ids[:, 1:]))
            assert streams.hosts and not [h for h in streams.hosts if h() is not None]
            assert not [b for b in streams.backs if b() is not None]
    finally:
        if enabled:
            gc.enable()
        STREAMS.reset(token)


def test_a_partial_backward_brings_back_only_what_it_runs_and_holds_nothing_after() -> None:
    streams = _Eager()
    token = STREAMS.set(streams)
    enabled = gc.isenabled()
    gc.disable()
    try:
        config = LMConfig(d_model=32, n_layers=4, n_heads=2, d_ff=32, max_len=32)
        model = ByteLM(ComputeCtx.new(DType.BF16, "cpu").with_activations("offload"), config)
        inputs: list[torch.Tensor] = []
        model.blocks[2].register_forward_pre_hook(lambda _, a: inputs.append(a[0]))
        ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        per_block = len(streams.hosts) // 3  # blocks 0-2 offload, the last keeps
        torch.autograd.grad(loss, inputs[0])  # blocks 3 and 2 run, 1 and 0 not
        assert len(streams.backs) == per_block  # block 2's, none below
        assert not [b for b in streams.backs if b() is not None]  # nothing left on the device
    finally:
        if enabled:
            gc.enable()
        STREAMS.reset(token)


def test_a_backward_entering_at_a_middle_block_holds_one_block(stand_in: StandIn) -> None:
    # A probe loss on block 1's output (retain_graph): block 2's tensors are not in its
    # graph, so they stay in host memory; the device holds at most W, nothing after.
    x = torch.randn(4, 8, requires_grad=True)
    blocks, mids = OffloadBlocks(), []
    with blocks.active():
        h = x
        for _ in range(3):  # three offloaded blocks of two tanh's (128 bytes each)
            h = saved_call(torch.tanh, saved_call(torch.tanh, h, mode="offload"), mode="offload")
            mids.append(h := blocks.boundary(h))
        blocks.last_block()
        h = saved_call(torch.tanh, h, mode="offload")
    forward = len(stand_in.log)
    torch.autograd.backward(mids[1].sum(), retain_graph=True)
    assert max(stand_in.peak_in[forward:]) <= blocks.largest == 256 and not stand_in.holding
    assert [n for op, n in stand_in.log[forward:] if op == "to_device"] == [3, 2, 1, 0]
    probe = x.grad
    x.grad = None
    torch.autograd.backward(h.sum())  # then the whole backward, the same way as ever
    assert max(stand_in.peak_in[forward:]) <= 256 and not stand_in.holding
    y = x.detach().requires_grad_()
    reference = y
    for n in range(7):
        reference = torch.tanh(reference)
        if n == 3:
            torch.autograd.backward(reference.sum(), retain_graph=True)
            assert probe is not None and y.grad is not None and torch.equal(probe, y.grad)
            y.grad = None
    torch.autograd.backward(reference.sum())
    assert x.grad is not None and y.grad is not None and torch.equal(x.grad, y.grad)


@pytest.mark.parametrize("impl", ["no_reentrant", "reentrant"])
def test_a_block_under_torchs_checkpoint_wrapper_offloads_nothing(
    stand_in: StandIn, impl: str
) -> None:
    # As a block checkpointed by rule: its run again in the backward offloads nothing (the
    # non-reentrant one sent each input again, never used; the reentrant one out and back).
    wrapper = pytest.importorskip("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    grads = []
    for spec in ("keep", "offload"):
        torch.manual_seed(0)
        model = ByteLM(ComputeCtx.new(DType.BF16, "cpu").with_activations(spec), CONFIG)
        kind = getattr(wrapper.CheckpointImpl, impl.upper())
        model.blocks[0] = wrapper.checkpoint_wrapper(model.blocks[0], checkpoint_impl=kind)
        blocks = _Blocks(model, stand_in)
        ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        forward = len(stand_in.log)
        torch.autograd.backward(loss)
        grads.append(_grads(model))
    assert blocks.groups()[0] == [] and blocks.groups()[1]  # block 1 alone offloads
    assert not [n for op, n in stand_in.log[forward:] if op == "to_host"]
    assert max(stand_in.peak_in) <= sum(stand_in.nbytes) and not stand_in.holding
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("renamed", ["cells", "frame class"])
def test_a_torch_that_renamed_its_checkpoint_frame_warns_once(
    monkeypatch: pytest.MonkeyPatch, renamed: str
) -> None:
    # Offload finds torch's checkpoint by private names; a torch that renamed them turned the
    # check off silently before. Now its own checkpoint hook, frame not found, warns once.
    from computectx import offload

    monkeypatch.setattr(offload, "_WARNED", [])
    seen: list[bool] = []

    def region(t: torch.Tensor) -> torch.Tensor:
        seen.append(offload._in_checkpoint())
        return t * 2

    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's names as they are: found, no warning
        torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)
    if renamed == "cells":
        monkeypatch.setattr(offload, "_FRAME_CELLS", ("renamed_frame",))
    else:
        monkeypatch.setattr(offload, "_FRAME", ())  # no _CheckpointFrame under that name
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)
    assert seen == [True, False, False]
    assert [(w.category, "cannot tell torch's checkpoint regions" in str(w.message))
            for w in got] == [(RuntimeWarning, True)]  # fmt: skip
