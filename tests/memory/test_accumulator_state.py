"""LowPrecGradAccumulator checkpoints: the stochastic rounding's generator, saved and restored."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import LowPrecGradAccumulator, OffloadedOptimizer

CTX = ComputeCtx.parity("cpu").replace(grad=DType.BF16)


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward untyped


def roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class Run:
    """A model, a stochastic bf16 accumulator and an offloaded AdamW, trained step by step."""

    def __init__(self, init_seed: int, acc_seed: int = 0) -> None:
        torch.manual_seed(init_seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)
        )
        self.acc = LowPrecGradAccumulator(
            self.model.parameters(), CTX, mode="stochastic", seed=acc_seed
        )
        self.opt = OffloadedOptimizer(self.model.parameters(), CTX, lr=1e-2)

    def train(self, batches: list[torch.Tensor]) -> None:
        for batch in batches:
            for micro in batch.view(3, 4, 6):  # 3 micro-batches per step
                backward(self.model(micro).sin().pow(2).mean())
            self.opt.ingest_grads(self.acc)
            self.opt.step()
            self.opt.zero_grad()

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = roundtrip(
            {
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "acc": self.acc.state_dict(),
            }
        )
        return state

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.acc.load_state_dict(state["acc"])

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def data(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(12, 6, generator=g) * 2 for _ in range(steps)]


def test_a_stochastic_resume_is_bitwise() -> None:
    batches = data(8)
    run = Run(0, acc_seed=11)
    run.train(batches[:4])
    saved = run.state()
    run.train(batches[4:])
    expected = run.weights()

    # Fresh objects, another initialisation and another seed: all of it comes from the state.
    fresh = Run(1, acc_seed=0)
    fresh.load(saved)
    fresh.train(batches[4:])
    for a, b in zip(expected, fresh.weights(), strict=True):
        assert torch.equal(a, b)


def test_the_state_is_tensors_only_and_its_seed_seeds_later_generators() -> None:
    acc = LowPrecGradAccumulator([], CTX, mode="stochastic", seed=2**64 - 1)
    sd = acc.state_dict()
    assert set(sd) == {"seed"}  # no generator drawn from yet
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    x = torch.randn(1000)
    first = acc._round(x)
    sd = acc.state_dict()
    assert set(sd) == {"seed", "generator.cpu"}
    assert sd["generator.cpu"].dtype == torch.uint8 and sd["generator.cpu"].dim() == 1
    second = acc._round(x)

    other = LowPrecGradAccumulator([], CTX, mode="stochastic", seed=0)
    other.load_state_dict(roundtrip(sd))
    assert torch.equal(other._round(x), second)  # continues where the state left off
    sd["generator.cpu"][0] ^= 1  # the saved tensor is a copy, not the live state
    assert torch.equal(acc.state_dict()["generator.cpu"], other.state_dict()["generator.cpu"])

    # A state saved before any draw: the loaded seed makes the generator when first needed.
    unseeded = LowPrecGradAccumulator([], CTX, mode="stochastic", seed=0)
    unseeded.load_state_dict(
        LowPrecGradAccumulator([], CTX, mode="stochastic", seed=2**64 - 1).state_dict()
    )
    assert torch.equal(unseeded._round(x), first)


def test_a_nearest_accumulator_saves_its_seed_and_refuses_a_generator() -> None:
    stochastic = LowPrecGradAccumulator([], CTX, mode="stochastic")
    stochastic._round(torch.randn(8))
    nearest = LowPrecGradAccumulator([], CTX)
    assert set(nearest.state_dict()) == {"seed"}
    nearest.load_state_dict(nearest.state_dict())
    with pytest.raises(ValueError, match=r"generator.cpu.*mode='nearest'.*mode='stochastic'"):
        nearest.load_state_dict(stochastic.state_dict())


def test_state_dict_refuses_sums_it_would_lose() -> None:
    run = Run(0)
    backward(run.model(torch.randn(4, 6)).sum())
    with pytest.raises(ValueError, match=r"4 parameter\(s\) hold gradient sums.*ingest_grads"):
        run.acc.state_dict()
    run.opt.ingest_grads(run.acc)
    run.acc.state_dict()


def test_a_bad_state_is_named_and_changes_nothing() -> None:
    acc = LowPrecGradAccumulator([], CTX, mode="stochastic", seed=4)
    acc._round(torch.randn(8))
    good = acc.state_dict()
    x = torch.randn(500)

    def bad(**changes: Any) -> dict[str, Any]:
        sd = {k: v.clone() for k, v in good.items()}
        sd.update(changes)
        return {k: v for k, v in sd.items() if v is not None}

    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        (bad(seed=None), ValueError, r"no 'seed' entry"),
        (bad(seed=torch.tensor(1.5)), ValueError, r"\['seed'\] must be an int64 scalar"),
        (bad(seed=torch.tensor([1, 2])), ValueError, r"\['seed'\] must be an int64 scalar"),
        (bad(extra=torch.zeros(1)), ValueError, r"unexpected key\(s\) \['extra'\]"),
        (bad(**{"generator.cpu": [0] * 8}), TypeError, r"'generator.cpu'\] must be a tensor"),
        (
            bad(**{"generator.cpu": good["generator.cpu"].long()}),
            ValueError,
            r"'generator.cpu'\] must be a 1-D uint8 tensor.*torch.int64",
        ),
        (
            bad(**{"generator.cpu": good["generator.cpu"][:50]}),
            ValueError,
            r"'generator.cpu'\] is not a generator state of cpu.*size",
        ),
        (
            bad(**{"generator.cuda:3": torch.zeros(16, dtype=torch.uint8)}),
            ValueError,
            r"'generator.cuda:3'.*never draws on cuda:3.*draws on: cpu",
        ),
        (
            bad(**{"generator.warp:0": torch.zeros(16, dtype=torch.uint8)}),
            ValueError,
            r"'generator.warp:0'\] does not name a device",
        ),
    ]
    for sd, error, message in cases:
        with pytest.raises(error, match=message):
            acc.load_state_dict(sd)
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        acc.load_state_dict([])  # type: ignore[arg-type]
    # Nothing changed: the generator goes on as if no load had been tried.
    twin = LowPrecGradAccumulator([], CTX, mode="stochastic", seed=4)
    twin.load_state_dict(good)
    assert torch.equal(acc._round(x), twin._round(x))
