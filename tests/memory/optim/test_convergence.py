"""Compact optimizer state trains the demo model as float32 state does (issue 24's numerics).

A reduced ``computectx demo`` run (one block of 64, windows of 64 bytes, 60 steps, the demo's
corpus, seed, batch order, learning-rate schedule and clipping, 16 validation batches) is
trained once with ``torch.optim.AdamW`` (float32 state: the baseline, shared by every test
through a module fixture) and once per compact setting with ``CompactOptimizer``. The
tolerances are the issue's, as docs/memory.md states them: 8-bit and fp8 moments within 0.5%
of the baseline's validation loss, 4-bit moments and a bf16 master with stochastic rounding
within 1%.

The peak learning rate is 1e-3, not the demo's 3e-3: at 3e-3 this small model's trajectories
part within a few dozen steps whatever perturbs them, and the final losses of float32 and
compact state differ by up to ~1.5% either way (torchao's AdamWFp8 lands 0.72% below
float32 there, ours 0.64%): a test of the rounding noise of one trajectory, not of the
state format. At 1e-3, bf16 state lands 0.01% from float32 (docs/benchmarks.md has both).

4-bit moments learn more slowly in the first steps and then catch up: +8.9% above float32
state after 60 steps here (torchao 0.18's ``AdamW4bit`` +7.6%), +4.6% after 120, -1.2% after
240; on the full demo model (bench/bench_optim_state.py, 120 steps at 1e-3) +0.64% (torchao
+0.69%). Their test trains 240 steps (``LONG``) and holds them to the 1% bound on one side:
no more than 1% above float32 state's loss.

Every run uses the ``bf16`` compute policy (bf16 autocast over float32 weights), so the
bf16-master run differs from the baseline only by where the weights live. Each compact run
also proves its state is compact (bytes per parameter) and that it is not the baseline's
trajectory (its loss differs), so no tolerance is met by a run that quantized nothing.
Torch runs one intra-op thread meanwhile (restored after), as the demo does by default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.demo.corpus import load_corpus, train_batches, val_batches
from computectx.demo.settings import DemoSettings
from computectx.demo.train import evaluate, lr_at, model_config
from computectx.memory import CompactOptimizer, memory_report
from computectx.nn import ByteLM

SETTINGS = DemoSettings(
    d_model=64, layers=1, seq_len=64, steps=60, lr=1e-3, eval_batches=16, sample_tokens=0
)
"""The reduced demo run: every linear and the embedding hold at least 4096 elements, so
their moments are compacted at the default ``min_size``; the norms' stay float32."""

LONG = SETTINGS.model_copy(update={"steps": 240})
"""The run 4-bit moments are held to (they catch up after the first steps)."""

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Run:
    val_loss: float
    state_bytes_per_param: float
    weight_dtype: torch.dtype


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # Two threads on a busy 2-core machine wait for each other: several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _data(s: DemoSettings) -> tuple[Batches, Batches]:
    corpus = load_corpus(None, min_bytes=s.seq_len + 1)
    batches = train_batches(corpus, s.batch_size, s.seq_len, s.seed)
    train = [next(batches) for _ in range(s.steps)]
    return train, val_batches(corpus, s.batch_size, s.seq_len, s.eval_batches)


@pytest.fixture(scope="module")
def data() -> tuple[Batches, Batches]:
    return _data(SETTINGS)


def train(
    data: tuple[Batches, Batches],
    optim_state: str | None,
    master: DType,
    s: DemoSettings = SETTINGS,
) -> Run:
    """Train the reduced demo model; ``optim_state=None``: plain ``torch.optim.AdamW``."""
    ctx = ComputeCtx.from_flag("bf16", "cpu").replace(master=master)
    torch.manual_seed(s.seed)
    model = ByteLM(ctx, model_config(s))
    params = list(model.parameters())
    opt: torch.optim.Optimizer
    if optim_state is None:
        opt = torch.optim.AdamW(params, lr=s.lr)
    else:
        opt = CompactOptimizer(params, ctx.with_optim_state(optim_state), lr=s.lr)
    train_set, val = data
    for step, (x, y) in enumerate(train_set):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s.steps, s.lr)
        torch.autograd.backward(model.loss(x, y))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    report = memory_report(model, optimizer=opt)
    per_param = report.bytes(role="optimizer_state") / report.parameters
    return Run(evaluate(model, val), per_param, params[0].dtype)


@pytest.fixture(scope="module")
def baseline(data: tuple[Batches, Batches]) -> Run:
    return train(data, None, DType.F32)


@pytest.mark.parametrize(
    ("optim_state", "master", "tolerance", "most_bytes"),
    [
        ("int8", DType.F32, 0.005, 2.2),
        ("fp8", DType.F32, 0.005, 2.2),
        ("f32", DType.BF16, 0.01, 8.1),
    ],
    ids=["int8", "fp8", "bf16-master-sr"],
)
def test_compact_state_keeps_the_validation_loss_of_f32_state(
    data: tuple[Batches, Batches],
    baseline: Run,
    optim_state: str,
    master: DType,
    tolerance: float,
    most_bytes: float,
) -> None:
    assert baseline.state_bytes_per_param > 7.9  # two float32 moments per parameter
    got = train(data, optim_state, master)
    assert got.weight_dtype == master.torch
    # The moments are stored compact (bf16 master: float32 moments, weights in bf16).
    assert got.state_bytes_per_param < most_bytes
    assert got.val_loss != baseline.val_loss  # another trajectory: something was rounded
    assert got.val_loss == pytest.approx(baseline.val_loss, rel=tolerance)


def test_4_bit_moments_catch_up_with_f32_state() -> None:
    data = _data(LONG)
    baseline = train(data, None, DType.F32, LONG)
    got = train(data, "int4", DType.F32, LONG)
    assert got.state_bytes_per_param < 1.2  # two 4-bit moments and their scales
    assert got.val_loss != baseline.val_loss
    assert got.val_loss <= baseline.val_loss * 1.01
