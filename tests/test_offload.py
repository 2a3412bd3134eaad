"""``offload``: activations kept in host memory, tested on a CPU through a stand-in for CUDA's
streams that keeps CUDA's rules: a copy runs only once something waits for it (the latest a
device may run it), a tensor brought back reads NaN until the compute stream waited for it, a
copy back starts only after the copy out it reads; and it counts the device bytes offload
holds at every step."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import SavedActivations
from computectx.memory.activation_bytes import SavedKind
from computectx.nn import ByteLM, LMConfig
from computectx.offload import STREAMS, OffloadBlocks
from computectx.saved import saved_call

CONFIG = LMConfig(d_model=32, n_layers=3, n_heads=2, d_ff=32, max_len=32)
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
        number = len(self._numbers) // 2
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
        t = torch.full_like(host, float("nan"))  # unreadable until waited for
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


def test_offload_brings_each_block_back_a_block_ahead_and_keeps_gradients(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []  # tensors offloaded per block, in forward order
    boundary = OffloadBlocks.boundary

    def recorded(self: OffloadBlocks, x: torch.Tensor) -> torch.Tensor:
        sizes.append(len(self.groups[-1]))
        return boundary(self, x)

    monkeypatch.setattr(OffloadBlocks, "boundary", recorded)
    model, loss, saved = _train(KINDS)
    forward = len(stand_in.log)
    groups, start = [], 0
    for n in sizes:
        groups.append(list(range(start, start + n)))
        start += n
    per_block = sum(stand_in.nbytes[i] for i in groups[0])
    # The last block (and the final norm) stays on the device: its backward comes first.
    assert sizes == [sizes[0], sizes[0], 0] and sizes[0] > 1
    assert sum(stand_in.nbytes) == 2 * per_block
    # The forward holds the block computing and the one before it, never more.
    assert max(stand_in.peak_in[:forward]) <= 2 * per_block
    torch.autograd.backward(loss)
    # So does the backward: the block whose gradients it computes and the one coming back.
    final = stand_in.log[forward:]
    assert max(stand_in.peak_in[forward:]) <= 2 * per_block
    # Every block's tensors are all on their way back before the first of them is used, and
    # before the block after it has used all of its own (the last block: before its
    # backward): prefetched, not fetched on demand.
    for i, group in enumerate(groups[:2]):
        sent = [final.index(("to_device", n)) for n in group]
        used = [final.index(("wait", n)) for n in group]
        assert max(sent) < min(used)
        if i == 0:
            assert max(sent) < max(final.index(("wait", n)) for n in groups[1])
        else:
            assert final[: len(group)] == [("to_device", n) for n in group]
    # Each tensor came back once and was used once; nothing is left on the device.
    assert sorted(n for op, n in final if op == "wait") == list(range(2 * sizes[0]))
    assert not stand_in.holding
    # Exact: on the way back the op computes its internals again from the same input.
    keep, keep_loss, kept = _train("keep")
    torch.autograd.backward(keep_loss)
    assert torch.equal(loss, keep_loss)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(keep), strict=True))
    # What stays on the device for the backward: the inputs of the first two blocks' ops
    # are gone; the last block keeps them as recompute does.
    assert saved.bytes() < kept.bytes()
    _, _, recomputed = _train("precise:recompute/act_fn:recompute/attention:recompute")
    kinds: tuple[SavedKind, ...] = ("precise", "act_fn", "attention", "residual")
    assert all(saved.bytes(kind) > 0 for kind in kinds)
    assert sum(saved.bytes(k) for k in kinds) < sum(recomputed.bytes(k) for k in kinds) * 2 // 3


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
