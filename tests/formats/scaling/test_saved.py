"""The scaling state in checkpoints: tensors only, round trips, old formats, policy checks.

A ``QuantizedLinear`` saves its scaling state as buffers (``fp8_{role}_ledger``,
``fp8_{role}_tally``, ``fp8_meta``). ``data/scaling_v*.pt`` are state dicts written by
earlier versions of this package (the ``_extra_state`` dict): version 2, version 1 with
the ledger under ``ring``, and version 1 from before the histories were kept oldest to
newest (``idx`` 2, no ``world_size``), all of the same model after the same training
(``train_reference``), so each must load into the state this version trains to.
``data/scaling_v3.pt`` is the same training saved as version 3's tensors (a 7-field meta,
from before the granularity fields).
"""

from __future__ import annotations

import io
import math
import pathlib
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from computectx import ComputeCtx
from computectx.formats import (
    DelayedScaling,
    DynamicScaling,
    Fp8Scheme,
    QuantizedLinear,
    Recipe,
)
from computectx.formats.numerics.ledger import ledger_history, ledger_slot, ledger_step
from computectx.formats.scaling.saved import (
    META_WORLD,
    STATE_CODE,
    STATE_VERSION,
    Role,
    check_same_recipe,
    meta_new,
    read_meta,
    same_recipe,
)
from computectx.memory import load_weights, save_weights

DATA = pathlib.Path(__file__).parent / "data"
OLD_FILES = ["scaling_v2.pt", "scaling_v1.pt", "scaling_v1_circular.pt"]
ROLES: tuple[Role, ...] = ("input", "weight", "grad")
SCALING_KEYS = [f"fp8_{r}_{t}" for r in ROLES for t in ("ledger", "tally")] + ["fp8_meta"]


def ctx_of(policy: str = "hybrid/delayed/4/0/max") -> ComputeCtx:
    return ComputeCtx.from_flag("fp8_hybrid", "cpu").replace(recipe=Recipe.parse(policy))


def model_of(ctx: ComputeCtx) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        QuantizedLinear(16, 32, ctx=ctx), nn.ReLU(), QuantizedLinear(32, 16, ctx=ctx)
    )


def train_reference(model: nn.Sequential) -> nn.Sequential:
    """The training the old checkpoints in ``data/`` went through."""
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        model(torch.randn(8, 16, generator=g) * (1 + i)).square().mean().backward()
    return model


def layers(model: nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def scaling_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every scaling tensor of ``model`` by layer and name (copies)."""
    return {
        f"{i}.{name}": t.clone()
        for i, m in enumerate(layers(model))
        for name, t in m.named_buffers()
        if name.startswith("fp8_")
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == b[k].dtype and torch.equal(x, b[k]) for k, x in a.items()
    )


PROBE = torch.linspace(-3.0, 3.0, 5 * 16).reshape(5, 16)


def next_output(model: nn.Module) -> torch.Tensor:
    """The next training call's output: it quantizes with the loaded steps and records."""
    out: torch.Tensor = model(PROBE)
    return out.detach()


# ----- item 2: tensors only, stable names, every format round-trips --------------------


def test_the_state_dict_is_tensors_only_under_stable_names() -> None:
    m = train_reference(model_of(ctx_of()))
    sd = m.state_dict()
    assert list(sd) == [f"{i}.{k}" for i in (0, 2) for k in ("weight", "bias", *SCALING_KEYS)]
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert {str(sd[f"0.{k}"].dtype) for k in SCALING_KEYS if "ledger" in k} == {"torch.float32"}
    assert {str(sd[f"0.{k}"].dtype) for k in SCALING_KEYS if "ledger" not in k} == {"torch.int64"}
    # version, world size, scheme (hybrid), recipe (delayed), history, margin, algo (max),
    # granularity (tensor), power_of_two, mx_rounding (none), gw_hp
    assert sd["0.fp8_meta"].tolist() == [STATE_CODE, 1, 1, 1, 4, 0, 1, 1, 0, 0, 0]
    # Copies: the saved state does not move when training goes on.
    before = sd["0.fp8_input_ledger"].clone()
    m(PROBE).sum().backward()
    assert torch.equal(sd["0.fp8_input_ledger"], before)
    assert not torch.equal(layers(m)[0].scaling.input.ledger, before)


def _safetensors(sd: dict[str, Any], path: pathlib.Path, fresh: nn.Module) -> None:
    save_file(sd, str(path / "model.safetensors"))
    fresh.load_state_dict(load_file(str(path / "model.safetensors")))


def _torch(sd: dict[str, Any], path: pathlib.Path, fresh: nn.Module) -> None:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf, weights_only=True))


def _dcp(sd: dict[str, Any], path: pathlib.Path, fresh: nn.Module) -> None:
    dcp_save(sd, checkpoint_id=str(path / "dcp"))
    into = fresh.state_dict()
    dcp_load(into, checkpoint_id=str(path / "dcp"))
    fresh.load_state_dict(into)


@pytest.mark.parametrize("fmt", [_safetensors, _torch, _dcp], ids=["safetensors", "torch", "dcp"])
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group says so
def test_every_format_round_trips_the_state_exactly(
    fmt: Callable[[dict[str, Any], pathlib.Path, nn.Module], None], tmp_path: pathlib.Path
) -> None:
    m = train_reference(model_of(ctx_of()))
    fresh = model_of(ctx_of())
    torch.manual_seed(5)
    for p in fresh.parameters():  # other weights: everything comes from the checkpoint
        nn.init.normal_(p)
    sd = m.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())  # no dict for a format to refuse
    fmt(sd, tmp_path, fresh)
    assert same(scaling_of(fresh), scaling_of(m))
    assert [(op.seeded, op.elements) for op in layers(fresh)[1].scaling.operands.values()] == [
        (op.seeded, op.elements) for op in layers(m)[1].scaling.operands.values()
    ]
    assert torch.equal(next_output(fresh), next_output(m))
    assert same(scaling_of(fresh), scaling_of(m))


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_module_casts_never_touch_the_scaling_tensors(cast: str) -> None:
    m = train_reference(model_of(ctx_of()))
    before = scaling_of(m)
    assert len(before) == 2 * len(SCALING_KEYS)  # buffers, which module casts reach
    if cast == "half":
        m.half()
    else:
        m.to(getattr(torch, cast))
    assert m[0].weight.dtype == getattr(torch, "float16" if cast == "half" else cast)
    assert same(scaling_of(m), before)


def test_the_scaling_tensors_follow_the_weight_and_start_fresh_off_meta() -> None:
    m = QuantizedLinear(16, 16, ctx=ctx_of())
    m.to("meta")
    assert all(t.is_meta for t in m.buffers())
    m.to_empty(device="cpu")
    assert not any(t.is_meta for t in m.buffers())
    assert same(scaling_of(m), scaling_of(QuantizedLinear(16, 16, ctx=ctx_of())))


# ----- old checkpoints: versions 1 and 2, through a versioned migration ----------------


@pytest.mark.parametrize("name", OLD_FILES)
def test_an_old_dict_checkpoint_loads_into_the_state_this_version_trains_to(name: str) -> None:
    old = torch.load(DATA / name, weights_only=True)
    assert old["0._extra_state"]["version"] in (1, 2)
    fresh = model_of(ctx_of())
    fresh.load_state_dict(old)  # strict
    trained = train_reference(model_of(ctx_of()))
    assert same(scaling_of(fresh), scaling_of(trained))
    assert all(layer.scaling.world_size == 1 for layer in layers(fresh))  # v1: no world_size
    assert torch.equal(next_output(fresh), next_output(trained))
    # Saved again, it is the tensors of this version.
    assert "0._extra_state" not in fresh.state_dict()
    assert fresh.state_dict()["0.fp8_meta"][0] == STATE_CODE


def test_a_version_3_checkpoint_loads_as_per_tensor_scaling() -> None:
    # data/scaling_v3.pt: train_reference's state dict written by version 3 (7 meta fields).
    old = torch.load(DATA / "scaling_v3.pt", weights_only=True)
    assert old["0.fp8_meta"].tolist() == [3, 1, 1, 1, 4, 0, 1]
    fresh = model_of(ctx_of())
    fresh.load_state_dict(old)  # strict
    trained = train_reference(model_of(ctx_of()))
    assert same(scaling_of(fresh), scaling_of(trained))
    assert torch.equal(next_output(fresh), next_output(trained))
    assert fresh.state_dict()["0.fp8_meta"].tolist()[:1] == [STATE_CODE]
    other = model_of(ctx_of("hybrid/delayed/4/1/max"))
    with pytest.raises(ValueError, match="recorded under the fp8 policy hybrid/delayed/4/0/max"):
        other.load_state_dict(old)


@pytest.mark.parametrize(
    "text",
    [
        "hybrid/delayed/16/0/max",
        "e5m2/dynamic/3",
        "e4m3/row/dynamic/0",
        "hybrid/row+gw_hp+no_pow2/dynamic/0",
        "e4m3/block/dynamic/0",
        "e5m2/block+pow2/dynamic/0",
        "e4m3/mx/dynamic/0",
        "hybrid/mx+floor/dynamic/0",
    ],
)
def test_the_meta_records_every_policy_field(text: str) -> None:
    policy = Recipe.parse(text)
    assert read_meta(meta_new(policy, 3, "cpu"), "m") == (policy, 3)
    for other in ("e4m3/row/dynamic/0", "e4m3/row+gw_hp/dynamic/0", "e4m3/mx+floor/dynamic/0"):
        differs = Recipe.parse(other) != policy
        assert same_recipe(policy, Recipe.parse(other)) is not differs
        if differs:
            with pytest.raises(
                ValueError, match=re.escape(f"recorded under the fp8 policy {text}")
            ):
                check_same_recipe(policy, Recipe.parse(other), "m")


def test_an_old_checkpoint_under_another_policy_is_refused() -> None:
    old = torch.load(DATA / "scaling_v2.pt", weights_only=True)
    target = model_of(ctx_of("e4m3/delayed/4/0/max"))
    before = scaling_of(target)
    with pytest.raises(ValueError, match=r"hybrid/delayed/4/0/max.*e4m3/delayed/4/0/max"):
        target.load_state_dict(old)
    assert same(scaling_of(target), before)


V2_MUTATIONS: list[tuple[Callable[[dict[str, Any]], object], str]] = [
    (lambda s: s.update(version=99), "version 99"),
    (lambda s: s.update(policy="hybrid/sometimes"), "bad policy 'hybrid/sometimes'"),
    (lambda s: s.update(world_size=0), "world_size must be an int >= 1, got 0"),
    (lambda s: s["operands"].pop("grad"), "operands"),
    (lambda s: s["operands"]["input"].update(ledger=torch.zeros(2)), "ledger"),
    (lambda s: s["operands"]["input"].update(idx=50), "idx"),
    (lambda s: s["operands"]["weight"].update(seeded="yes"), "seeded"),
    (lambda s: ledger_step(s["operands"]["input"]["ledger"]).fill_(math.nan), "step .* nan"),
    (lambda s: ledger_step(s["operands"]["grad"]["ledger"]).fill_(0.0), "step .* 0.0"),
    (lambda s: ledger_slot(s["operands"]["input"]["ledger"], 2).fill_(-1.0), "-1.0 at slot 2"),
]


@pytest.mark.parametrize(("mutate", "message"), V2_MUTATIONS)
def test_a_bad_old_checkpoint_raises_and_changes_nothing(
    mutate: Callable[[dict[str, Any]], object], message: str
) -> None:
    old = torch.load(DATA / "scaling_v2.pt", weights_only=True)
    mutate(old["2._extra_state"])
    target = train_reference(model_of(ctx_of()))
    m = target[2]
    before = scaling_of(target)
    with pytest.raises(ValueError, match=message):
        m.load_state_dict({k[2:]: v for k, v in old.items() if k.startswith("2.")})
    assert same(scaling_of(target), before)


def test_each_old_version_reads_its_own_ledger_key() -> None:
    old = torch.load(DATA / "scaling_v1.pt", weights_only=True)
    old["0._extra_state"]["version"] = 2  # version 2 with version 1's key: no ledger
    with pytest.raises(ValueError, match="ledger \\('ledger'\\) must be"):
        model_of(ctx_of()).load_state_dict(old)


# ----- item 3: loading is checked against the policy ------------------------------------


@pytest.mark.parametrize(
    "other",
    [
        "e5m2/delayed/4/0/max",  # another scheme
        "hybrid/dynamic/0",  # another recipe
        "hybrid/delayed/4/1/max",  # another margin
        "hybrid/delayed/4/0/most_recent",  # another window reduction
    ],
)
def test_state_recorded_under_another_policy_is_refused_naming_both(other: str) -> None:
    saved = train_reference(model_of(ctx_of(other))).state_dict()
    target = train_reference(model_of(ctx_of()))
    before = scaling_of(target)
    with pytest.raises(ValueError, match="only the history length is converted") as caught:
        target.load_state_dict(saved)
    assert other in str(caught.value) and "hybrid/delayed/4/0/max" in str(caught.value)
    assert same(scaling_of(target), before)


def test_an_e5m2_state_never_reaches_an_e4m3_layer_through_load_weights(
    tmp_path: pathlib.Path,
) -> None:
    # load_weights asks the layer before it replaces anything: refused, model unchanged.
    path = save_weights(train_reference(model_of(ctx_of("e5m2/delayed/4/0/max"))), tmp_path / "w")
    target = model_of(ctx_of("e4m3/delayed/4/0/max"))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"e5m2/delayed/4/0/max.*e4m3/delayed/4/0/max"):
        load_weights(target, path, ctx_of())
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    # Buffers replaced any other way are checked at the layer's first call.
    source = model_of(ctx_of("e5m2/delayed/4/0/max"))
    for name, buffer in source.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf.startswith("fp8_"):
            target.get_submodule(owner).register_buffer(leaf, buffer.clone())
    with pytest.raises(ValueError, match=r"e5m2/delayed/4/0/max.*e4m3/delayed/4/0/max"):
        target(PROBE)


def test_load_weights_round_trips_the_scaling_state(tmp_path: pathlib.Path) -> None:
    m = train_reference(model_of(ctx_of()))
    path = save_weights(m, tmp_path / "w.safetensors")
    fresh = model_of(ctx_of())
    report = load_weights(fresh, path, ctx_of())
    assert "extra-state" not in report.reason
    assert torch.equal(next_output(fresh), next_output(m))
    assert same(scaling_of(fresh), scaling_of(m))


@pytest.mark.parametrize("new_len", [2, 7])
def test_another_history_length_is_converted(new_len: int) -> None:
    m = train_reference(model_of(ctx_of()))
    other = model_of(ctx_of(f"hybrid/delayed/{new_len}/0/max"))
    other.load_state_dict(m.state_dict())
    for src, dst in zip(layers(m), layers(other), strict=True):
        for role in ROLES:
            a, b = src.scaling.operands[role].ledger, dst.scaling.operands[role].ledger
            hist = ledger_history(a)
            want = hist[-new_len:] if new_len <= 4 else torch.cat([hist[:1].expand(3), hist])
            assert torch.equal(ledger_history(b), want)
            assert torch.equal(b[new_len:], a[4:])  # the step and the counts
        assert dst.state_dict()["fp8_meta"][4] == new_len


def _set(key: str, index: int, value: float) -> Callable[[dict[str, Any]], None]:
    def mutate(sd: dict[str, Any]) -> None:
        sd[key] = sd[key].clone()
        sd[key][index] = value

    return mutate


def _replace(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(sd: dict[str, Any]) -> None:
        sd[key] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set("fp8_meta", 0, 9), "version 9 in 11 fields; this computectx reads versions 5"),
        (_set("fp8_meta", 0, 3), "version 3 in 11 fields"),
        (_set("fp8_meta", 7, 9), r"granularity code 9 is unknown; accepted: 1 \(tensor\), 2"),
        (_set("fp8_meta", 7, 2), "bad fp8 policy: .*delayed scaling is per-tensor only"),
        (_set("fp8_meta", 8, 2), r"power_of_two code 2 is unknown; accepted: 0 \(False\)"),
        (_set("fp8_meta", 9, 1), "bad fp8 policy: .*mx_rounding applies to granularity 'mx'"),
        (_set("fp8_meta", 10, 1), "bad fp8 policy: .*gw_hp .* applies to granularity 'row'"),
        (
            _replace("fp8_meta", torch.zeros(8, dtype=torch.int64)),
            r"shape \(11,\) \(version 5 or 4",
        ),
        (_set("fp8_meta", META_WORLD, 0), "world_size must be an int >= 1, got 0"),
        (_set("fp8_meta", 2, 7), r"scheme code 7 is unknown; accepted: 1 \(hybrid\)"),
        (_set("fp8_meta", 3, 0), r"recipe code 0 is unknown; accepted: 1 \(delayed\), 2"),
        (_set("fp8_meta", 4, 0), "history_len=0"),
        (_set("fp8_meta", 6, 3), r"algo code 3 is unknown; accepted: 1 \(max\), 2"),
        (_replace("fp8_meta", torch.zeros(7)), r"fp8_meta is float32, but .* saved as int64"),
        (_replace("fp8_input_ledger", torch.zeros(3)), "fp8_input_ledger must be a 1-D"),
        (_replace("fp8_grad_ledger", torch.zeros(9)), "holds 6 amaxes, but fp8_meta records"),
        (_set("fp8_input_ledger", 4, math.nan), "step must be finite and > 0, got nan"),
        (_set("fp8_weight_ledger", 2, -1.0), "-1.0 at slot 2"),
        (_set("fp8_grad_ledger", 6, math.inf), "counts must be finite"),
        (_set("fp8_weight_tally", 0, 2), r"seeded 0 or 1 and elements >= 0, got \[2,"),
        (_replace("fp8_grad_tally", torch.zeros(2)), r"fp8_grad_tally is float32, but .* as int64"),
        (lambda sd: sd.pop("fp8_grad_tally"), "holds .* and not \\['fp8_grad_tally'\\]"),
        (_replace("_extra_state", {"version": 2}), "loads whole"),
    ],
)
def test_a_bad_state_raises_naming_the_value_and_changes_nothing(
    mutate: Callable[[dict[str, Any]], object], message: str
) -> None:
    sd = train_reference(model_of(ctx_of()))[0].state_dict()
    mutate(sd)
    target = train_reference(model_of(ctx_of()))
    before = scaling_of(target)
    with pytest.raises(ValueError, match=message):
        target[0].load_state_dict(sd)
    assert same(scaling_of(target), before)


def test_a_world_size_travels_with_the_state() -> None:
    m = train_reference(model_of(ctx_of()))
    layers(m)[0].scaling.world_size = 4
    fresh = model_of(ctx_of())
    fresh.load_state_dict(m.state_dict())
    assert layers(fresh)[0].scaling.world_size == 4 and layers(fresh)[1].scaling.world_size == 1
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        layers(fresh)[0].scaling.world_size = 0


def test_dynamic_and_delayed_states_use_their_own_codes() -> None:
    policies = {
        "e4m3/dynamic/2": [STATE_CODE, 1, 2, 2, 0, 2, 0, 1, 0, 0, 0],
        "e5m2/delayed/8/3/most_recent": [STATE_CODE, 1, 3, 1, 8, 3, 2, 1, 0, 0, 0],
    }
    for text, meta in policies.items():
        m = QuantizedLinear(16, 16, ctx=ctx_of(text))
        assert m.state_dict()["fp8_meta"].tolist() == meta
        fresh = QuantizedLinear(16, 16, ctx=ctx_of(text))
        fresh.load_state_dict(m.state_dict())
        policy = Recipe.parse(text)
        assert isinstance(policy.scaling, DelayedScaling | DynamicScaling)
        assert fresh.policy == policy and policy.format in set(Fp8Scheme)


# ----- a state cast to another dtype and back -------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_an_export_cast_and_read_back_through_dcp_is_refused_naming_the_dtype(
    dtype: torch.dtype, tmp_path: pathlib.Path
) -> None:
    # torchtitan's model-only export casts every tensor (export_dtype); DCP's load then
    # copies the saved tensors into the model's own float32 and int64 ones, casting back,
    # so load_state_dict sees the right dtypes and rounded values. The version slot of
    # fp8_meta (2**24 + 5, which no float type holds) tells.
    sd = train_reference(model_of(ctx_of())).state_dict()
    dcp_save({k: v.to(dtype) for k, v in sd.items()}, checkpoint_id=str(tmp_path / "dcp"))
    target = train_reference(model_of(ctx_of()))
    into = target.state_dict()
    dcp_load(into, checkpoint_id=str(tmp_path / "dcp"))
    assert into["0.fp8_meta"].dtype == torch.int64  # the dtype is gone by now
    before = scaling_of(target)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"fp8_meta holds -?\d+ .* cast to {name} and back"):
        target.load_state_dict(into)
    assert same(scaling_of(target), before)


def test_a_version_4_state_loads_and_is_saved_again_as_version_5() -> None:
    assert STATE_CODE == 2**24 + STATE_VERSION
    m = train_reference(model_of(ctx_of()))
    sd = m.state_dict()
    for key in [k for k in sd if k.endswith("fp8_meta")]:
        sd[key] = sd[key].clone()
        sd[key][0] = 4  # as version 4 wrote it: the version itself
    fresh = model_of(ctx_of())
    fresh.load_state_dict(sd)
    assert same(scaling_of(fresh), scaling_of(m))
    assert fresh.state_dict()["0.fp8_meta"][0] == STATE_CODE
