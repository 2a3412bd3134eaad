"""Fault injection for ``load_weights``: every check it makes fails in turn, and each refusal
leaves every tensor (values, dtype, shape, storage) and every attribute of the model as it was.

One model holds each kind of state ``load_weights`` treats apart: plain parameters, tied
parameters, a BatchNorm's buffers (an int64 counter among them), an ``Attention``'s calibrated
``kv_amax`` (checked by ``check_state_tensors``, defaulted when absent) and ``QuantizedLinear``
scaling state (planned by ``plan_state_load``). The pictures come from the ``freeze`` fixture
(tests/conftest.py)."""

from __future__ import annotations

import copy
import json
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import computectx.memory.weights as weights_module
from computectx import ComputeCtx, Residency
from computectx.memory import load_weights, save_weights
from computectx.nn import Attention, ByteLM, LMConfig

FP8 = ComputeCtx.from_flag("fp8_e4m3", "cpu")
CONFIG = LMConfig(d_model=32, n_heads=2, d_ff=32, n_layers=1, max_len=16)
ALIASES = "computectx.aliases"

Freeze = Callable[..., object]


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lm = ByteLM(FP8, CONFIG)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied
        self.bn = nn.BatchNorm1d(4)


def _ctx(residency: str) -> ComputeCtx:
    return ComputeCtx.parity("cpu").replace(residency=Residency.parse(residency))


def _trained(seed: int) -> Net:
    net = Net(seed)
    net.bn(torch.randn(8, 4))  # running stats and num_batches_tracked move
    with torch.no_grad():
        for attn in net.modules():
            if isinstance(attn, Attention):
                attn.kv_amax.fill_(float(seed + 1))  # a calibration
    return net


@pytest.fixture(scope="module")
def template() -> Net:
    return _trained(2)


@pytest.fixture
def model(template: Net) -> Net:
    """A fresh copy of the model the faulty checkpoints are loaded into."""
    return copy.deepcopy(template)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors and alias metadata of a good checkpoint of ``Net``."""
    path = save_weights(_trained(1), tmp_path_factory.mktemp("w") / "good.safetensors")
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle)
        meta = (f.metadata() or {})[ALIASES]
    return tensors, meta


def _write(
    path: pathlib.Path, tensors: dict[str, torch.Tensor], aliases: str | dict[str, str]
) -> pathlib.Path:
    meta = aliases if isinstance(aliases, str) else json.dumps(aliases)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={ALIASES: meta})
    return path


def _edited(
    saved: tuple[dict[str, torch.Tensor], str],
    tmp: pathlib.Path,
    edit: Callable[[dict[str, torch.Tensor]], object],
    aliases: str | None = None,
) -> pathlib.Path:
    tensors = {k: v.clone() for k, v in saved[0].items()}
    edit(tensors)
    return _write(tmp / "edited.safetensors", tensors, saved[1] if aliases is None else aliases)


ATTN = "lm.blocks.0.attn."
QKV = ATTN + "qkv."

# name -> (edit of the good tensors, alias metadata or None (the good one), error, match)
FILE_FAULTS: dict[str, tuple[Callable[[dict[str, torch.Tensor]], object], str | None, Any, str]] = {
    "missing key": (lambda t: t.pop("bn.bias"), None, ValueError, r"missing keys \['bn.bias'\]"),
    "unexpected key": (
        lambda t: t.update(extra=torch.zeros(1)),
        None,
        ValueError,
        r"unexpected keys \['extra'\]",
    ),
    "shape": (
        lambda t: t.update({"lm.head.weight": torch.zeros(256, 33)}),
        None,
        ValueError,
        r"'lm.head.weight': checkpoint float32\[256, 33\]",
    ),
    "dtype": (
        lambda t: t.update({"bn.running_var": t["bn.running_var"].double()}),
        None,
        ValueError,
        r"'bn.running_var': checkpoint float64",
    ),
    "int64 counter as int32": (
        lambda t: t.update({"bn.num_batches_tracked": torch.tensor(1, dtype=torch.int32)}),
        None,
        ValueError,
        "bn.num_batches_tracked",
    ),
    "tie stored apart": (
        lambda t: t.update({"b.weight": t["a.weight"].clone()}),
        "{}",
        ValueError,
        "tied in the model are stored separately",
    ),
    "alias metadata not json": (lambda t: None, "{nope", ValueError, "bad 'computectx.aliases'"),
    "alias metadata not a map": (lambda t: None, "[1]", ValueError, "must map names"),
    "alias to no tensor": (
        lambda t: None,
        json.dumps({"b.weight": "nowhere"}),
        ValueError,
        "must map names",
    ),
    "kv_amax NaN": (
        lambda t: t[ATTN + "kv_amax"].__setitem__((0, 0), float("nan")),
        None,
        ValueError,
        r"lm\.blocks\.0\.attn\.kv_amax must be finite .*; kv_amax\[0, 0\] is NaN",
    ),
    "kv_amax half calibrated": (
        lambda t: t[ATTN + "kv_amax"].__setitem__((1, 1), 0.0),
        None,
        ValueError,
        "all zero",
    ),
    "fp8 scaling state of another dtype": (
        lambda t: t.update({QKV + "fp8_input_ledger": t[QKV + "fp8_input_ledger"].double()}),
        None,
        ValueError,
        "fp8_input_ledger",
    ),
    "fp8 meta of another policy": (
        lambda t: t.update({QKV + "fp8_meta": torch.zeros_like(t[QKV + "fp8_meta"])}),
        None,
        ValueError,
        "qkv",
    ),
    "tensor torch cannot hold": (
        lambda t: t.update(odd=torch.zeros(2, dtype=torch.uint16)),
        None,
        ValueError,
        "which torch cannot hold",
    ),
}


def _refused(
    freeze: Freeze,
    model: nn.Module,
    call: Callable[[], object],
    error: type[BaseException],
    match: str,
) -> None:
    before = freeze(model)
    with pytest.raises(error, match=match):
        call()
    assert freeze(model) == before


@pytest.mark.parametrize("fault", sorted(FILE_FAULTS))
def test_a_refused_checkpoint_changes_nothing(
    fault: str,
    saved: tuple[dict[str, torch.Tensor], str],
    tmp_path: pathlib.Path,
    freeze: Freeze,
    model: Net,
) -> None:
    edit, aliases, error, match = FILE_FAULTS[fault]
    path = _edited(saved, tmp_path, edit, aliases)
    for residency in ("device", "mmap"):
        ctx = _ctx(residency)
        _refused(freeze, model, lambda: load_weights(model, path, ctx), error, match)  # noqa: B023


def test_the_faults_start_from_a_checkpoint_that_loads(
    saved: tuple[dict[str, torch.Tensor], str],
    tmp_path: pathlib.Path,
    freeze: Freeze,
    model: Net,
) -> None:
    # The control: unedited, the same file loads and changes the model.
    path = _edited(saved, tmp_path, lambda t: None)
    before = freeze(model)
    load_weights(model, path, _ctx("device"))
    assert freeze(model) != before
    assert torch.equal(model.a.weight, saved[0]["a.weight"])
    assert model.a.weight is model.b.weight


def test_refused_arguments_and_files_change_nothing(
    saved: tuple[dict[str, torch.Tensor], str],
    tmp_path: pathlib.Path,
    freeze: Freeze,
    model: Net,
) -> None:
    good = _edited(saved, tmp_path, lambda t: None)
    auto = _ctx("auto")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json" + bytes(64))
    calls: list[tuple[Callable[[], object], type[BaseException], str]] = [
        (lambda: load_weights(model, good, "cpu"), TypeError, "ComputeCtx"),  # type: ignore[arg-type]
        (lambda: load_weights(model, good, auto, reserve_bytes=-1), ValueError, "reserve"),
        (
            lambda: load_weights(model, good, auto, reserve_bytes=True),
            ValueError,
            "reserve",
        ),
        (lambda: load_weights(model, good, auto, reserve_bytes=1.5), ValueError, "reserve"),  # type: ignore[arg-type]
        (lambda: load_weights(model, tmp_path / "none", _ctx("device")), FileNotFoundError, "none"),
        (lambda: load_weights(model, tmp_path, _ctx("device")), FileNotFoundError, "not a file"),
        (lambda: load_weights(model, garbage, _ctx("device")), ValueError, "not a valid"),
    ]
    for call, error, match in calls:
        _refused(freeze, model, call, error, match)


def test_a_checkpoint_replaced_while_it_loads_is_refused(
    saved: tuple[dict[str, torch.Tensor], str],
    tmp_path: pathlib.Path,
    freeze: Freeze,
    monkeypatch: pytest.MonkeyPatch,
    template: Net,
) -> None:
    # The header is checked, then the tensors are read: a file replaced in between (another
    # process saving over it) must not load tensors of shapes nobody checked (param.data = a
    # tensor of another shape would silently reshape the parameter).
    path = _edited(saved, tmp_path, lambda t: None)
    other = {k: v.clone() for k, v in saved[0].items()}
    other["lm.head.weight"] = torch.zeros(256, 33)
    other["bn.running_mean"] = torch.zeros(4, dtype=torch.float64)
    read_header = weights_module._read_header

    def replaced_after_reading(file: pathlib.Path) -> Any:
        header = read_header(file)
        _write(tmp_path / "other.safetensors", other, saved[1]).replace(file)
        return header

    monkeypatch.setattr(weights_module, "_read_header", replaced_after_reading)
    for residency in ("device", "mmap"):
        model = copy.deepcopy(template)
        _edited(saved, tmp_path, lambda t: None)  # the good file back
        _refused(
            freeze,
            model,
            lambda: load_weights(model, path, _ctx(residency)),  # noqa: B023
            ValueError,
            r"changed while it was read.*'lm.head.weight'",
        )
