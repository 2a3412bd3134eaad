"""The 4-bit stochastic-rounding counter (``linear.fp4_counter``) as Fp4Linear holds it: plain
CPU state, never a buffer (so DDP neither broadcasts nor overwrites it:
tests/distributed/test_fp4_ranks.py), carried by ``_extra_state``; a saved counter out of
range is refused on every load path, naming the layer, before anything is written;
reentrant checkpointing advances the counter once; ``saved_counter``'s messages."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from computectx import ComputeCtx
from computectx.formats import convert_to_quantized
from computectx.formats.linear.fp4 import Fp4Linear
from computectx.formats.linear.fp4_counter import (
    FP4_COUNTER_LIMIT,
    FP4_STATE_VERSION,
    fp4_key,
    recipe_code,
    saved_counter,
    signed_seed,
    stream_word,
)
from computectx.formats.linear.fp4_streams import stream_of
from computectx.fp4_recipe import Fp4Recipe
from computectx.memory import load_weights

NV = ComputeCtx.from_flag("nvfp4", "cpu").replace(recipe=Fp4Recipe(seed=5))


def _model() -> nn.Sequential:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    convert_to_quantized(model, NV, include_head=True, min_features=16)
    return model


def _train(model: nn.Module, rows: int = 12) -> None:
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    model(x).float().square().sum().backward()


def _counters(model: nn.Module) -> list[list[int]]:
    return [m.sr_key.tolist() for m in model.modules() if isinstance(m, Fp4Linear)]


W0, W2 = (stream_word(5, stream_of(name)) for name in ("0", "2"))
"""The key words of ``_model()``'s layers: seed 5 on the streams of their names."""


def test_the_counter_is_cpu_state_not_a_buffer_and_follows_copies_and_loads() -> None:
    model = _model()
    _train(model)
    assert not [n for n, _ in model.named_buffers()]  # nothing for DDP to broadcast
    assert sorted(model.state_dict()) == [
        "0._extra_state",
        "0.bias",
        "0.weight",
        "2._extra_state",
        "2.bias",
        "2.weight",
    ]
    model.to(torch.float64).to(torch.float32)  # .to() moves the parameters, not the counter
    assert all(m.sr_key.device.type == "cpu" for m in model if isinstance(m, Fp4Linear))
    want = _counters(model)
    assert want == [[W0, 64 * (12 + 16)], [W2, 16 * (12 + 16)]]
    twin = copy.deepcopy(model)
    assert _counters(twin) == want
    _train(twin)  # the copy's counter is its own
    assert _counters(model) == want != _counters(twin)
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    assert _counters(fresh) == want
    lin = Fp4Linear.from_linear(nn.Linear(32, 16), NV)
    assert lin.sr_key.device.type == "cpu" and lin.sr_key.tolist() == [5, 0]


def _with_counter(model: nn.Module, value: int) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["2._extra_state"][3] = value
    for k in ("0.weight", "2.weight"):
        state[k] += 1.0  # would change the weights if anything were written
    return state


BAD = [-5, FP4_COUNTER_LIMIT, 2**62 - 1, 2**63 - 1]
RANGE = r"\[0, 2\*\*61\)"


@pytest.mark.parametrize("value", BAD)
def test_a_counter_out_of_range_is_refused_by_load_state_dict_before_any_load(value: int) -> None:
    source = _model()
    _train(source)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"'2'.*counter {value}.*{RANGE}"):
        model.load_state_dict(_with_counter(source, value))
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing written
    # The counter at the limit's edge loads.
    model.load_state_dict(_with_counter(source, FP4_COUNTER_LIMIT - 1))
    assert _counters(model)[1] == [W2, FP4_COUNTER_LIMIT - 1]


@pytest.mark.parametrize("value", [-5, 2**62 - 1])
def test_set_extra_state_and_load_weights_refuse_it_too(value: int, tmp_path: Path) -> None:
    source = _model()
    state = _with_counter(source, value)
    lin = _model()[2]
    assert isinstance(lin, Fp4Linear)
    with pytest.raises(ValueError, match=rf"counter {value}.*{RANGE}"):
        lin.set_extra_state(state["2._extra_state"])
    assert lin.sr_key.tolist() == [W2, 0]
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"2\._extra_state.*counter {value}.*{RANGE}"):
        load_weights(model, path, NV)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_reentrant_checkpoint_advances_the_counter_once_as_a_plain_call() -> None:
    # Its forward runs under no_grad (no key); its recomputation builds the call's only
    # graph, so it draws and advances as a call of its own. A non-reentrant recomputation
    # advances nothing (test_fp4.py: test_activation_checkpointing_is_exact).
    plain, ckpt = _model(), _model()
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    for _ in range(2):
        plain(x).float().square().sum().backward()
        y = checkpoint(ckpt, x.requires_grad_(True), use_reentrant=True)
        y.float().square().sum().backward()
    assert _counters(ckpt) == _counters(plain) == [[W0, 2 * 64 * 28], [W2, 2 * 16 * 28]]
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_saved_counter_names_what_is_wrong_and_never_prints_a_value() -> None:
    recipe = Fp4Recipe(seed=2**64 - 1)  # the key holds it as -1
    assert fp4_key(recipe, 7).tolist() == [-1, 7] and signed_seed(2**63) == -(2**63)
    good = torch.tensor([FP4_STATE_VERSION, recipe_code(recipe), -1, 3, 9])
    assert saved_counter(good, recipe, "w", "this layer runs") == (3, 9, 2)
    version_1 = torch.tensor([1, recipe_code(recipe), -1, 3])  # before streams: stream 0
    assert saved_counter(version_1, recipe, "w", "this layer runs") == (3, 0, 1)
    reads = "this computectx reads version 2 (5 entries) and version 1 (4 entries)"
    cases = {
        "got a torch.int32 tensor of shape (5,)": good.int(),
        "got a torch.int64 tensor of shape (6,)": torch.full((6,), 123456),
        "a dict with keys ['scale']": {"scale": torch.full((2,), 123456.0)},
        f"has version 3 and 5 entries; {reads}": torch.tensor([3, 0, 0, 0, 0]),
        f"has version 1 and 5 entries; {reads}": torch.tensor([1, 0, 0, 0, 0]),
        f"has version 2 and 4 entries; {reads}": torch.tensor([2, 0, 0, 0]),
        "saved under the 4-bit recipe 'nvfp4+seed=5' but this layer runs 'nvfp4+seed=1844": (
            torch.tensor([FP4_STATE_VERSION, recipe_code(recipe), 5, 0, 0])
        ),
        "holds the stochastic-rounding stream -2; accepted: an integer in [0, 2**63)": (
            torch.tensor([FP4_STATE_VERSION, recipe_code(recipe), -1, 0, -2])
        ),
    }
    for message, state in cases.items():
        with pytest.raises(ValueError, match=r"^w ") as e:
            saved_counter(state, recipe, "w", "this layer runs")
        text = str(e.value)
        assert message in text and text.startswith("w ") and "123456" not in text, text


def test_saved_stream_reads_a_state_as_its_load_does() -> None:
    # What parallel_checks.saved_fp4_streams compares across ranks, read by the layout's
    # owner (it read entry[4] by hand before): version 2's stream, version 1's stream 0, and
    # a refused state refused with the module named.
    layer = _model()[0]
    assert isinstance(layer, Fp4Linear)
    state = layer.get_extra_state()
    assert layer.saved_stream(state, "0") == layer.sr_stream == stream_of("0")
    assert layer.saved_stream(state[:4].clone().index_fill_(0, torch.tensor([0]), 1)) == 0
    with pytest.raises(ValueError, match=r"_extra_state of the 4-bit layer '0'.*stream"):
        layer.saved_stream(state.clone().index_fill_(0, torch.tensor([4]), -1), "0")
