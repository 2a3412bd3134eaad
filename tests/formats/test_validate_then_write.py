"""Validate, then write: a refused ``load_state_dict`` or ``convert_to_quantized`` changes nothing.

Fault injection: each check of the call is made to fail in turn, on the *last* layer (so
that a call checking as it goes would already have changed the layers before it), and the
model afterwards is compared with a snapshot taken before: every parameter and buffer (the
same object, the same bits), every submodule (the same object, the same type), every
attribute of every module, and its load hooks. torch's own ``load_state_dict`` copies what
it can and raises at the end (a size mismatch, a value that is not a tensor, under
``strict`` a missing or unexpected key); a converted model refuses those before any module
loads, with torch's message.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from computectx import ComputeCtx
from computectx.formats import Backend, QuantizedLinear, Recipe, convert_to_quantized
from computectx.formats import convert_experts as ce
from computectx.formats.ops.grouped import QuantizedExperts
from computectx.nn import GroupedExperts

FLAGS = [
    "fp8_e4m3",  # tensor-wise delayed
    "fp8_e4m3_dynamic",
    "fp8_rowwise",
    "fp8_rowwise_gw_hp",
    "fp8_block",
    "fp8_mx",
]
Snapshot = dict[str, Any]


def _value(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return ("tensor", id(v), v.detach().clone())
    if isinstance(v, Mapping):  # hook tables and the like: which entries, in which order
        return ("mapping", id(v), tuple(v.keys()))
    if isinstance(v, (int, float, str, bool, type(None), tuple)):
        return ("value", v)
    return ("object", id(v))


def snapshot(model: nn.Module) -> Snapshot:
    """Every submodule (object, type), tensor (object, bits) and module attribute."""
    mods = list(model.named_modules(remove_duplicate=False))
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    return {
        "modules": [(n, id(m), type(m)) for n, m in mods],
        "tensors": {n: _value(t) for n, t in tensors},
        "attrs": {
            n: {k: _value(v) for k, v in vars(m).items() if k not in ("_parameters", "_buffers")}
            for n, m in mods
        },
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        assert isinstance(b, tuple)
        x, y = a[2], b[2]
        return bool(a[1] == b[1] and x.dtype == y.dtype and x.shape == y.shape) and torch.equal(
            x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
        )
    return a == b


def assert_unchanged(before: Snapshot, model: nn.Module) -> None:
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, value in before["tensors"].items():
        assert _same(value, after["tensors"][name]), f"tensor {name} changed"
    for name, attrs in before["attrs"].items():
        assert attrs.keys() == after["attrs"][name].keys(), f"attributes of {name!r} changed"
        for key, value in attrs.items():
            assert _same(value, after["attrs"][name][key]), f"{name!r}.{key} changed"


# ----- load_state_dict of converted modules --------------------------------------------------


def _model(flag: str, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    convert_to_quantized(model, ComputeCtx.from_flag(flag, "cpu"), module_filter=lambda m, f: True)
    model(torch.randn(4, 32) * (seed + 1)).square().mean().backward()  # ledgers seeded
    model.zero_grad(set_to_none=True)
    return model


@functools.cache
def _pair(flag: str) -> tuple[nn.Sequential, dict[str, torch.Tensor]]:
    # A trained model, and the state dict of another one (loading it changes every tensor).
    return _model(flag, 0), _model(flag, 1).state_dict()


def pair(flag: str) -> tuple[nn.Sequential, dict[str, Any]]:
    model, sd = _pair(flag)
    return copy.deepcopy(model), dict(sd)


def _drop_scaling(sd: dict[str, Any]) -> None:
    del sd["2.fp8_grad_tally"]  # a scaling state loads whole


def _cast_scaling(sd: dict[str, Any]) -> None:
    sd["2.fp8_input_ledger"] = sd["2.fp8_input_ledger"].to(torch.bfloat16)


FAULTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "size_mismatch": lambda sd: sd.__setitem__("2.weight", torch.zeros(16, 32)),
    "not_a_tensor": lambda sd: sd.__setitem__("2.bias", [0.0] * 32),
    "missing_key": lambda sd: sd.pop("2.bias"),
    "unexpected_key": lambda sd: sd.__setitem__("2.scale", torch.ones(1)),
    "partial_scaling_state": _drop_scaling,
    "scaling_state_cast": _cast_scaling,
}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("flag", FLAGS)
def test_a_refused_load_changes_nothing(flag: str, fault: str) -> None:
    model, sd = pair(flag)
    FAULTS[fault](sd)
    before = snapshot(model)
    with pytest.raises((RuntimeError, ValueError)) as refused:
        model.load_state_dict(sd)
    assert "2." in str(refused.value)
    assert_unchanged(before, model)


@pytest.mark.parametrize("fault", ["missing_key", "unexpected_key"])
def test_missing_and_unexpected_keys_load_the_rest_when_not_strict(fault: str) -> None:
    # strict=False: torch loads what is there and reports the keys; so does a converted model.
    model, sd = pair("fp8_rowwise")
    FAULTS[fault](sd)
    result = model.load_state_dict(sd, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (
        (["2.bias"], []) if fault == "missing_key" else ([], ["2.scale"])
    )
    loaded = model.state_dict()
    assert torch.equal(loaded["2.weight"], sd["2.weight"])
    assert torch.equal(loaded["0.fp8_weight_ledger"], sd["0.fp8_weight_ledger"])


def test_a_pre_hook_registered_later_may_still_rename_keys() -> None:
    # The check cannot foresee what a later pre-hook does to the state dict: it stands back.
    model, sd = pair("fp8_rowwise")
    old = {("last." + k[2:] if k.startswith("2.") else k): v for k, v in sd.items()}

    def rename(module: nn.Module, state: dict[str, Any], prefix: str, *_: object) -> None:
        for key in [k for k in state if k.startswith(prefix + "last.")]:
            state[prefix + "2." + key[len(prefix) + 5 :]] = state.pop(key)

    model.register_load_state_dict_pre_hook(rename)  # type: ignore[no-untyped-call]
    model.load_state_dict(old)
    assert torch.equal(model.state_dict()["2.weight"], sd["2.weight"])


@pytest.mark.parametrize("fault", ["size_mismatch", "not_a_tensor", "missing_key"])
def test_a_lone_fp8_linear_refuses_its_whole_load(fault: str) -> None:
    # Built by hand (no convert_to_quantized, so no model-wide check): the layer itself keeps its
    # bias and its scaling state when its weight cannot load.
    model, sd = pair("fp8_e4m3")
    layer = model[2]
    bad = {k.removeprefix("2."): v for k, v in sd.items() if k.startswith("2.")}
    if fault == "size_mismatch":
        bad["weight"] = torch.zeros(16, 32)
    elif fault == "not_a_tensor":
        bad["weight"] = "weights"
    else:
        del bad["weight"]
    before = snapshot(layer)
    with pytest.raises(RuntimeError, match="weight"):
        layer.load_state_dict(bad)
    assert_unchanged(before, layer)


def _experts_model(seed: int) -> nn.ModuleDict:
    torch.manual_seed(seed)
    ctx = ComputeCtx.from_flag("fp8_rowwise", "cpu")
    model = nn.ModuleDict(
        {"proj": nn.Linear(32, 32), "experts": GroupedExperts(ctx.replace(recipe=None), 32, 32, 3)}
    )
    convert_to_quantized(model, ctx, module_filter=lambda m, f: True)
    experts = model["experts"]
    assert isinstance(experts, GroupedExperts) and isinstance(experts.fp8, QuantizedExperts)
    return model


@pytest.mark.parametrize("fault", ["size_mismatch", "missing_key", "not_a_tensor"])
def test_a_refused_load_of_fp8_experts_changes_nothing(fault: str) -> None:
    model, sd = _experts_model(0), dict(_experts_model(1).state_dict())
    if fault == "size_mismatch":
        sd["experts.down"] = torch.zeros(2, 32, 32)
    elif fault == "missing_key":
        del sd["experts.down"]
    else:
        sd["experts.down"] = None
    before = snapshot(model)
    with pytest.raises(RuntimeError, match=r"experts\.down"):
        model.load_state_dict(sd)
    assert_unchanged(before, model)
    model.load_state_dict(_experts_model(1).state_dict())  # the same model loads a good one


# ----- convert_to_quantized refused midway
# -----------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        ctx = ComputeCtx.from_flag("fp32", "cpu")
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.experts = GroupedExperts(ctx, 32, 32, 2)
        self.c = nn.Linear(32, 64)


class MyLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class OtherExperts(nn.Module):
    """A framework's experts that its converter fails to convert."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 32, 32))


class FailingConverter:
    def weights(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        return {"w": module.w} if isinstance(module, OtherExperts) else None

    def current(self, module: nn.Module) -> QuantizedExperts | None:
        return None

    def convert(self, module: nn.Module, fp8: QuantizedExperts | None) -> None:
        if fp8 is not None:
            raise RuntimeError("this framework's experts cannot convert")


def _raise(message: str) -> Any:
    raise RuntimeError(message)


def _prepare(fault: str, model: Tiny, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Make one check of convert_to_quantized fail on the last thing it looks at; its arguments."""
    every: Callable[[nn.Module, str], bool] = lambda m, fqn: True  # noqa: E731
    if fault == "filter_raises_on_the_last_linear":
        return {"module_filter": lambda m, fqn: _raise("filter failed") if fqn == "c" else True}
    if fault == "filter_not_a_bool_on_the_last_linear":
        return {"module_filter": lambda m, fqn: "yes" if fqn == "c" else True}
    if fault == "filter_raises_on_the_experts":
        return {"module_filter": lambda m, fqn: _raise("no") if fqn == "experts" else True}
    if fault == "a_later_layer_under_another_policy":
        other = ComputeCtx.from_flag("fp8_e4m3_dynamic", "cpu")
        model.c = QuantizedLinear.from_linear(model.c, other)
        return {"module_filter": every}
    if fault == "experts_under_another_policy":
        mx = ComputeCtx.from_flag("fp8_mx", "cpu").fp8
        assert isinstance(mx, Recipe)
        model.experts.fp8 = QuantizedExperts(mx, Backend.REFERENCE)
        return {"module_filter": every}
    if fault == "a_converter_raises_on_the_last_linear":
        model.c = MyLinear(32, 64)
        return {
            "module_filter": every,
            "converters": {MyLinear: lambda lin, ctx, **kw: _raise("converter failed")},
        }
    if fault == "an_experts_converter_raises":
        model.add_module("z", OtherExperts())
        monkeypatch.setattr(ce, "_CONVERTERS", [*ce._CONVERTERS, FailingConverter()])
        return {"module_filter": every}
    assert fault == "a_bad_backend"
    return {"module_filter": every, "backend": "tpu"}


CONVERT_FAULTS = [
    "filter_raises_on_the_last_linear",
    "filter_not_a_bool_on_the_last_linear",
    "filter_raises_on_the_experts",
    "a_later_layer_under_another_policy",
    "experts_under_another_policy",
    "a_converter_raises_on_the_last_linear",
    "an_experts_converter_raises",
    "a_bad_backend",
]


@pytest.mark.parametrize("fault", CONVERT_FAULTS)
def test_a_refused_conversion_changes_nothing(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Tiny()
    kwargs = _prepare(fault, model, monkeypatch)
    before = snapshot(model)
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        convert_to_quantized(model, ComputeCtx.from_flag("fp8_rowwise", "cpu"), **kwargs)
    assert_unchanged(before, model)
    assert not model._load_state_dict_pre_hooks
