"""One loading rule for fp8 layers: ``load_state_dict`` and ``load_weights`` agree.

Both hand a layer's entries to ``computectx.formats.scaling.load.plan_scaling_load``: another
history length is converted by both, a state under another policy is refused by both naming
the two policies (not shapes), a plain ``nn.Linear`` checkpoint loads into a converted model
through both with a fresh scaling state, and a scaling tensor at another dtype than the one
saved (torchtitan's ``export_dtype="bfloat16"``) is refused by both naming the key and the
dtype. Nothing changes when a load is refused.
"""

from __future__ import annotations

import copy
import functools
import math
import pathlib
import re
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from computectx import ComputeCtx
from computectx.formats import QuantizedLinear, Recipe, convert_to_quantized
from computectx.formats.numerics.ledger import ledger_history
from computectx.formats.scaling.load import guard_whole_loads
from computectx.memory import load_weights, save_weights

Load = Callable[[nn.Module, dict[str, torch.Tensor], pathlib.Path], None]


def ctx_of(policy: str) -> ComputeCtx:
    return ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(recipe=Recipe.parse(policy))


def model_of(policy: str, seed: int = 0) -> nn.Sequential:
    # Converted as users convert: convert_to_quantized makes load_state_dict check every fp8 layer
    # before any module loads.
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_quantized(model, ctx_of(policy), module_filter=lambda m, fqn: True)
    return model


@functools.cache
def _trained(policy: str, seed: int) -> nn.Sequential:
    model = model_of(policy, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(3):
        model(torch.randn(8, 16, generator=g) * (1 + i)).square().mean().backward()
    return model


def trained(policy: str, seed: int = 0) -> nn.Sequential:
    """A model after 3 training steps (seeded ledgers), a fresh copy each call."""
    return copy.deepcopy(_trained(policy, seed))


def via_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], _: pathlib.Path) -> None:
    model.load_state_dict(sd)


def via_load_weights(model: nn.Module, sd: dict[str, torch.Tensor], tmp: pathlib.Path) -> None:
    path = tmp / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    load_weights(model, path, ComputeCtx.parity("cpu"))


PATHS = [
    pytest.param(via_state_dict, id="load_state_dict"),
    pytest.param(via_load_weights, id="load_weights"),
]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(model: nn.Module, snap: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == snap.keys() and all(
        now[k].dtype == v.dtype and torch.equal(now[k], v) for k, v in snap.items()
    )


@pytest.mark.parametrize("new_len", [2, 9])
def test_both_paths_convert_another_history_length_alike(
    new_len: int, tmp_path: pathlib.Path
) -> None:
    sd = trained("hybrid/delayed/4/0/max").state_dict()
    loaded = []
    for load in (via_state_dict, via_load_weights):
        model = model_of(f"hybrid/delayed/{new_len}/0/max", seed=3)
        load(model, sd, tmp_path)
        loaded.append(model.state_dict())
    by_dict, by_file = loaded
    assert by_dict.keys() == by_file.keys()
    for key, value in by_dict.items():
        assert value.dtype == by_file[key].dtype and torch.equal(value, by_file[key]), key
    ledger = by_file["0.fp8_input_ledger"]
    history = ledger_history(ledger)
    assert history.numel() == new_len
    kept = min(4, new_len)  # the newest entries survive the conversion
    assert torch.equal(history[-kept:], ledger_history(sd["0.fp8_input_ledger"])[-kept:])
    assert by_file["0.fp8_meta"][4] == new_len


@pytest.mark.parametrize("load", PATHS)
@pytest.mark.parametrize(
    ("saved", "target"),
    [
        ("e4m3/row/dynamic/0", "hybrid/delayed/16/0/max"),
        ("e4m3/row/dynamic/0", "e4m3/dynamic/0"),
        ("hybrid/delayed/4/0/max", "e4m3/block/dynamic/0"),
    ],
)
def test_a_state_under_another_policy_is_refused_by_both_naming_the_policies(
    load: Load, saved: str, target: str, tmp_path: pathlib.Path
) -> None:
    sd = trained(saved).state_dict()
    model = trained(target, seed=2)
    snap = snapshot(model)
    with pytest.raises(ValueError, match="only the history length is converted") as caught:
        load(model, sd, tmp_path)
    message = str(caught.value)
    assert str(Recipe.parse(saved)) in message
    assert str(Recipe.parse(target)) in message
    assert "mismatch" not in message  # the policies, not the ledgers' shapes
    assert unchanged(model, snap)


@pytest.mark.parametrize("load", PATHS)
def test_a_plain_linear_checkpoint_loads_through_both_with_a_fresh_scaling_state(
    load: Load, tmp_path: pathlib.Path
) -> None:
    # The usual path: convert, then load the high-precision weights.
    torch.manual_seed(5)
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    model = trained("hybrid/delayed/4/0/max", seed=2)  # a seeded state, to be reset
    load(model, plain.state_dict(), tmp_path)
    fresh = model_of("hybrid/delayed/4/0/max")
    for key, value in model.state_dict().items():
        expected = plain.state_dict()[key] if key in plain.state_dict() else fresh.state_dict()[key]
        assert torch.equal(value, expected), key
    assert all(
        not m.scaling.input.seeded for m in model.modules() if isinstance(m, QuantizedLinear)
    )


def _cast(sd: dict[str, torch.Tensor], key: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if k == key else v) for k, v in sd.items()}


@pytest.mark.parametrize("load", PATHS)
@pytest.mark.parametrize(
    ("key", "dtype"),
    [
        ("0.fp8_input_ledger", torch.bfloat16),
        ("2.fp8_grad_ledger", torch.float64),
        ("0.fp8_weight_tally", torch.bfloat16),
        ("2.fp8_input_tally", torch.float32),
        ("0.fp8_meta", torch.bfloat16),
        ("2.fp8_meta", torch.int32),
    ],
)
def test_a_scaling_tensor_at_another_dtype_is_refused_naming_the_key(
    load: Load, key: str, dtype: torch.dtype, tmp_path: pathlib.Path
) -> None:
    sd = trained("hybrid/delayed/4/0/max").state_dict()
    model = trained("hybrid/delayed/4/0/max", seed=2)
    snap = snapshot(model)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"{re.escape(key)} is {name}, but fp8 scaling state"):
        load(model, _cast(sd, key, dtype), tmp_path)
    assert unchanged(model, snap)


@pytest.mark.parametrize("load", PATHS)
def test_a_torchtitan_bfloat16_export_is_refused_and_nothing_loads(
    load: Load, tmp_path: pathlib.Path
) -> None:
    # torchtitan's last-step export: every tensor of the model state dict .to(bfloat16).
    sd = {
        k: v.to(torch.bfloat16) for k, v in trained("hybrid/delayed/4/0/max").state_dict().items()
    }
    model = trained("hybrid/delayed/4/0/max", seed=2).to(torch.bfloat16)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"0\.fp8_\w+ is bfloat16, but fp8 scaling state"):
        load(model, sd, tmp_path)
    assert unchanged(model, snap)
    # Without the scaling entries the bf16 weights load, and the state starts fresh.
    weights_only = {k: v for k, v in sd.items() if ".fp8_" not in k}
    load(model, weights_only, tmp_path)
    assert torch.equal(model.state_dict()["0.weight"], sd["0.weight"])
    first = model[0]
    assert isinstance(first, QuantizedLinear) and not first.scaling.input.seeded


def test_a_frozen_step_at_another_dtype_is_refused() -> None:
    served = trained("hybrid/delayed/4/0/max")
    for m in served.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    sd = served.state_dict()
    target = trained("hybrid/delayed/4/0/max", seed=2)
    for m in target.modules():
        if isinstance(m, QuantizedLinear):
            m.freeze_for_serving()
    snap = snapshot(target)
    with pytest.raises(ValueError, match=r"2\.weight_step is bfloat16, .* holds it as float32"):
        target.load_state_dict(_cast(sd, "2.weight_step", torch.bfloat16))
    assert unchanged(target, snap)
    target.load_state_dict(sd)
    assert unchanged(target, sd)


def test_load_weights_checks_every_layer_before_it_changes_any(tmp_path: pathlib.Path) -> None:
    # The second layer's state is refused: the first layer's weights and state stay too.
    sd = trained("hybrid/delayed/4/0/max").state_dict()
    sd = _cast(sd, "2.fp8_grad_ledger", torch.bfloat16)
    model = trained("hybrid/delayed/4/0/max", seed=2)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"2\.fp8_grad_ledger is bfloat16"):
        via_load_weights(model, sd, tmp_path)
    assert unchanged(model, snap)


def test_a_saved_round_trip_through_save_weights_is_exact(tmp_path: pathlib.Path) -> None:
    src = trained("e4m3/row/dynamic/0")
    path = save_weights(src, tmp_path / "row.safetensors")
    model = model_of("e4m3/row/dynamic/0", seed=4)
    load_weights(model, path, ComputeCtx.parity("cpu"))
    assert unchanged(model, snapshot(src))


def test_a_model_built_by_hand_checks_every_layer_once_guarded() -> None:
    # QuantizedLinear placed by hand: guard_whole_loads gives the model the same whole check.
    sd = _cast(trained("hybrid/delayed/4/0/max").state_dict(), "2.fp8_meta", torch.bfloat16)
    ctx = ctx_of("hybrid/delayed/4/0/max")
    torch.manual_seed(7)
    model = nn.Sequential(
        QuantizedLinear(16, 32, ctx=ctx), nn.ReLU(), QuantizedLinear(32, 16, ctx=ctx)
    )
    guard_whole_loads(model)
    guard_whole_loads(model)  # once per model
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"2\.fp8_meta is bfloat16"):
        model.load_state_dict(sd)
    assert unchanged(model, snap)


def _frozen_layers() -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
    """A frozen fp8 linear, a frozen NVFP4 linear (static) and frozen NVFP4 experts, each with
    the entries whose values a load checks once (not each call)."""
    from computectx.formats import Fp4Linear, Fp4Recipe, FrozenFp4Linear
    from computectx.formats.linear.fp4_experts import Fp4Experts
    from computectx.nn import GroupedExperts

    torch.manual_seed(0)
    fp8 = QuantizedLinear(32, 16, ctx=ComputeCtx.from_flag("fp8_hybrid", "cpu"))
    fp8.freeze_for_serving()
    fp4 = FrozenFp4Linear.from_fp4_linear(
        Fp4Linear(32, 16, ctx=ComputeCtx.from_flag("nvfp4", "cpu")), activation_amax="static"
    )
    fp4.set_input_amax(torch.tensor([2.0]))
    experts = GroupedExperts(ComputeCtx.from_flag("bf16", "cpu"), 32, 32, 2)
    experts.fp8 = Fp4Experts(Fp4Recipe.parse("nvfp4"))
    experts.freeze_for_serving(mode="weight_only")
    return {
        "fp8": (fp8, ("weight_step",)),
        "fp4": (fp4, ("weight_amax", "input_amax")),
        "experts": (experts, ("fp8.gate_up_amax", "fp8.down_amax")),
    }


@pytest.mark.parametrize("kind", ["fp8", "fp4", "experts"])
def test_a_frozen_layers_checked_entries_are_copies_in_its_state_dict(kind: str) -> None:
    """DCP's load writes into the state dict's tensors: a frozen layer's steps and amaxes,
    checked once at a load and not on each call, reach it only through ``load_state_dict``
    (which refuses a NaN); ``keep_vars=True`` still gives the live buffers."""
    layer, names = _frozen_layers()[kind]
    state = layer.state_dict()
    for name in names:
        live = layer.get_buffer(name)
        before = live.clone()
        state[name].fill_(math.nan)  # as dcp.load into a corrupt checkpoint would
        assert torch.equal(live, before), name
        assert layer.state_dict(keep_vars=True)[name] is live
    with pytest.raises(ValueError, match="finite"):
        layer.load_state_dict(state)
    for name in names:
        assert not layer.get_buffer(name).isnan().any(), name
