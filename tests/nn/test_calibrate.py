"""Fault injection for the calibration that sets the static KV steps (``calibrate_kv``, and
``calibrate_transformers_kv`` for a transformers model): each refusal (no ``Attention``, no
batch, an empty batch, a batch the model refuses midway, a head whose amax is zero or not
finite) leaves every tensor and every attribute of the model as it was, each module's
training mode included (the ``freeze`` fixture, tests/conftest.py). A model whose modules
are in mixed modes (a frozen part kept in eval) gets each module's own mode back, refused or
not: the root's mode used to be spread over every module. (``calibrate_transformers_kv``'s
case is in tests/integrations/test_transformers_cache.py, which imports transformers anyway.)"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.nn import Attention, ByteLM, LMConfig, calibrate_kv

Freeze = Callable[..., object]
CTX = ComputeCtx.parity("cpu")
CONFIG = LMConfig(d_model=32, n_heads=2, d_ff=32, n_layers=2, max_len=16)


def _ids(seed: int, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def calibrated() -> ByteLM:
    torch.manual_seed(0)
    model = ByteLM(CTX, CONFIG)
    calibrate_kv(model, [_ids(0)])
    return model


@pytest.fixture
def model(calibrated: ByteLM) -> ByteLM:
    """A calibrated model in training mode, its first block frozen in eval mode."""
    out = copy.deepcopy(calibrated)
    out.train()
    out.blocks[0].eval()
    return out


def _attn(model: ByteLM, i: int) -> Attention:
    layer = model.blocks[i].attn
    assert isinstance(layer, Attention)
    return layer


def _modes(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def _refused(
    freeze: Freeze, model: nn.Module, call: Callable[[], object], error: type[Exception], match: str
) -> None:
    before = freeze(model)
    with pytest.raises(error, match=match):
        call()
    assert freeze(model) == before


def _then(batches: list[torch.Tensor], last: Exception) -> Iterator[torch.Tensor]:
    yield from batches
    raise last


def test_refused_calibrations_change_nothing(model: ByteLM, freeze: Freeze) -> None:
    mixed = _modes(model)
    assert True in mixed and False in mixed
    faults: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: calibrate_kv(model, []), ValueError, "batches is empty"),
        (lambda: calibrate_kv(model, [torch.zeros(2, 0, dtype=torch.long)]), ValueError, "batch 0"),
        (
            lambda: calibrate_kv(model, [_ids(1), torch.zeros(1, 0, dtype=torch.long)]),
            ValueError,
            "batch 1",
        ),
        # The model refuses the second batch midway (byte ids past 255).
        (lambda: calibrate_kv(model, [_ids(1), torch.full((1, 3), 999)]), ValueError, "ids must"),
        # The batches themselves fail midway.
        (lambda: calibrate_kv(model, _then([_ids(2)], KeyError("gone"))), KeyError, "gone"),
        (lambda: calibrate_kv(model, [_ids(3, length=20)]), ValueError, "exceeds max_len"),
        (lambda: calibrate_kv("model", [_ids(1)]), TypeError, "nn.Module"),  # type: ignore[arg-type]
    ]
    for call, error, match in faults:
        _refused(freeze, model, call, error, match)
    assert _modes(model) == mixed


@pytest.mark.parametrize("value", [0.0, float("inf"), float("nan")])
def test_a_head_without_a_finite_positive_amax_stores_nothing(
    model: ByteLM, freeze: Freeze, value: float
) -> None:
    # Layer 1's keys and values all zero, inf or NaN: refused naming it, layer 0 (which
    # measured fine and comes first) keeps its old amax too.
    with torch.no_grad():
        _attn(model, 1).qkv.weight.fill_(value)
    match = r"blocks\.1\.attn (keys|values) of head 0 have an amax that is (0|inf|NaN) over"
    _refused(freeze, model, lambda: calibrate_kv(model, [_ids(1)]), ValueError, match)


def test_no_attention_changes_nothing(freeze: Freeze) -> None:
    plain = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    plain[1].eval()
    _refused(freeze, plain, lambda: calibrate_kv(plain, [_ids(0)]), ValueError, "no Attention")


def test_a_calibration_gives_each_module_its_own_mode_back(model: ByteLM) -> None:
    mixed = _modes(model)
    old = _attn(model, 0).kv_amax.clone()
    found = calibrate_kv(model, [_ids(5)])
    assert _modes(model) == mixed  # the frozen block stays in eval, the rest trains
    assert not torch.equal(_attn(model, 0).kv_amax, old)
    assert torch.equal(found["blocks.0.attn"], _attn(model, 0).kv_amax)
    assert all(_attn(model, i).kv_observed is None for i in range(2))
