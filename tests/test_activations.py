"""The activations policy: ``Activations`` and ``ComputeCtx.activations`` (values, text and JSON
forms, defaults, bad input). The fuzzed round trips are in tests/test_properties.py."""

from __future__ import annotations

import pickle

import pytest
import torch

import computectx
from computectx import Activations, ComputeCtx, DType, parse_activations
from computectx.activations import ACTIVATION_KINDS, DEFAULT_GROUP, KIND_MODES, SAVE_MODES

BASE = ComputeCtx.new(DType.BF16, "cpu")


def test_the_default_keeps_everything_as_today() -> None:
    policy = Activations()
    assert all(policy.mode(k) == "keep" for k in ACTIVATION_KINDS)
    assert policy.default and policy.group == DEFAULT_GROUP == 128
    assert str(policy) == "keep" and Activations.parse("keep") == policy
    assert BASE.activations == policy and "activations" not in str(BASE)
    for ctx in (ComputeCtx.parity("cpu"), ComputeCtx.serving("cpu")):
        assert ctx.activations == policy
    assert computectx.Activations is Activations


def test_kinds_and_modes_are_the_documented_ones_in_order() -> None:
    assert ACTIVATION_KINDS == ("linear", "precise", "act_fn", "attention", "residual", "moe")
    assert SAVE_MODES == ("keep", "fp8", "offload", "recompute")
    assert [k for k in ACTIVATION_KINDS if "recompute" not in KIND_MODES[k]] == [
        "linear",
        "residual",
        "moe",
    ]


@pytest.mark.parametrize(
    ("text", "shortest"),
    [
        ("fp8", "fp8"),
        ("FP8/Attention:KEEP", "fp8/attention:keep"),
        ("attention:keep/fp8", "fp8/attention:keep"),
        ("precise:fp8", "precise:fp8"),
        ("precise:fp8/act_fn:fp8/group=64", "precise:fp8/act_fn:fp8/group=64"),
        ("offload/linear:fp8/residual:fp8/moe:fp8", "fp8/precise:offload/act_fn:offload/"
         "attention:offload"),
        ("keep/precise:recompute", "precise:recompute"),
        (" group=32 ", "group=32"),
        ("checkpoint=Every:2/fp8", "fp8/checkpoint=every:2"),
        ("checkpoint=every:1", "checkpoint=all"),
        ("checkpoint = blocks:3+0+3/keep", "checkpoint=blocks:0+3"),
        ("checkpoint=none/precise:fp8", "precise:fp8"),
    ],
)  # fmt: skip
def test_text_form_reads_and_prints_the_shortest(text: str, shortest: str) -> None:
    policy = Activations.parse(text)
    assert str(policy) == shortest
    assert Activations.parse(shortest) == policy == parse_activations(text)


def test_a_bare_recompute_says_which_kinds_take_it() -> None:
    with pytest.raises(ValueError, match=r"bare mode sets every kind.*\(precise:recompute/"):
        Activations.parse("recompute")
    policy = Activations.parse("recompute/linear:keep/residual:fp8/moe:keep")
    assert [policy.mode(k) for k in ACTIVATION_KINDS] == [
        "keep", "recompute", "recompute", "recompute", "fp8", "keep"
    ]  # fmt: skip


def test_an_unknown_kind_is_refused_naming_the_kinds() -> None:
    for kind in ["bogus", "group", "Precise"]:
        with pytest.raises(ValueError, match=f"unknown activation kind '{kind}'; accepted: linear"):
            Activations().mode(kind)  # type: ignore[arg-type]


def test_a_bare_mode_sets_every_kind_and_kinds_override_it() -> None:
    policy = Activations.parse("fp8/attention:keep/group=64")
    assert [policy.mode(k) for k in ACTIVATION_KINDS] == ["fp8", "fp8", "fp8", "keep", "fp8", "fp8"]
    assert policy.group == 64 and not policy.default
    assert policy == Activations(
        linear="FP8", precise="fp8", act_fn="fp8", residual="fp8", moe="fp8", group=64
    )


def test_the_ctx_carries_it_in_text_json_and_pickle() -> None:
    ctx = BASE.with_activations("precise:fp8/act_fn:fp8")
    assert str(ctx).endswith(",activations=precise:fp8/act_fn:fp8")
    assert ComputeCtx.parse(str(ctx)) == ctx
    assert ComputeCtx.model_validate_json(ctx.model_dump_json()) == ctx
    assert ctx.model_dump(mode="json")["activations"] == {
        "linear": "keep",
        "precise": "fp8",
        "act_fn": "fp8",
        "attention": "keep",
        "residual": "keep",
        "moe": "keep",
        "group": 128,
        "checkpoint": "none",
    }
    assert pickle.loads(pickle.dumps(ctx)) == ctx
    assert ctx.replace(activations=Activations()) == BASE
    assert BASE.activations == Activations()  # a copy, never an edit


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("recompute", "linear cannot be kept as recompute; accepted for linear: keep, fp8, offl"),
        ("precise:zip", "unknown activation save mode 'zip'; accepted: keep, fp8, offload, rec"),
        ("norm:fp8", r"bad part 'norm:fp8'.*KIND one of linear, precise, act_fn"),
        ("precise:fp8/precise:keep", "activation kind precise given twice"),
        ("fp8/keep", "two bare modes"),
        ("group=100", "group=100 is not one of 16, 32, 64, 128"),
        ("group=1e2", r"group='1e2' .* is not an integer"),
        ("group=64/group=64", "group given twice"),
        ("", "bad part ''"),
        ("checkpoint=every:0", "bad checkpoint rule 'every:0'; accepted: none, all, every:N"),
        ("checkpoint=blocks:1+x", "bad checkpoint rule 'blocks:1\\+x'"),
        ("checkpoint=each:2", "bad checkpoint rule 'each:2'"),
        ("checkpoint=all/checkpoint=all", "checkpoint given twice"),
    ],
)  # fmt: skip
def test_bad_text_names_the_value_and_what_is_accepted(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Activations.parse(text)
    with pytest.raises(ValueError, match=message):
        ComputeCtx.parse(f"compute=bf16,device=cpu,activations={text}")


def test_bad_values_of_other_types() -> None:
    # Inside the ctx's text a comma ends the value: the rest is read as the next policy key.
    with pytest.raises(ValueError, match="unknown policy key 'group'"):
        ComputeCtx.parse("compute=bf16,device=cpu,activations=fp8,group=64")
    with pytest.raises(ValueError, match=r"bad activations 3 \(int\); accepted: an Activations"):
        parse_activations(3)
    with pytest.raises(ValueError, match=r"unknown activations field.*'norm'"):
        parse_activations({"norm": "fp8"})
    with pytest.raises(ValueError, match="group must be an integer, got bool True"):
        Activations.model_validate({"group": True})
    with pytest.raises(ValueError, match="group must be an integer, got str '64'"):
        Activations.model_validate_json('{"group": "64"}')
    with pytest.raises(TypeError, match="takes a str"):
        Activations.parse(b"fp8")  # type: ignore[arg-type]


def test_precise_names_the_kinds_for_an_unknown_kind() -> None:
    ctx = ComputeCtx.new(DType.BF16, "cpu")
    x = torch.zeros(2, dtype=torch.bfloat16)
    for bad in ("bogus", "Precise", "group"):
        with pytest.raises(ValueError, match="unknown activation kind"):
            ctx.precise(x, lambda t: t * 2, kind=bad)  # type: ignore[call-overload]


def test_softmax_names_the_kinds_for_an_unknown_kind() -> None:
    from computectx.nn.precise import softmax

    ctx = ComputeCtx.new(DType.BF16, "cpu")
    x = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    for bad in ("bogus", "group"):  # "group" read 128 as its mode and ran the custom path
        with pytest.raises(ValueError, match="unknown activation kind"):
            softmax(ctx, x, dim=-1, kind=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rule", "taken"),
    [
        ("none", []),
        ("all", [0, 1, 2, 3, 4]),
        ("every:2", [0, 2, 4]),
        ("every:3", [0, 3]),
        ("first:2", [0, 1]),
        ("last:2", [3, 4]),
        ("last:9", [0, 1, 2, 3, 4]),
        ("blocks:1+4+7", [1, 4]),
    ],
)
def test_checkpoint_rules_take_the_blocks_they_say(rule: str, taken: list[int]) -> None:
    policy = Activations(checkpoint=rule)
    assert [i for i in range(5) if policy.checkpointed(i, 5)] == taken
    assert not policy.default or rule == "none"
    ctx = BASE.with_activations(policy)
    assert (
        ComputeCtx.parse(str(ctx)) == ctx == ComputeCtx.model_validate_json(ctx.model_dump_json())
    )
    with pytest.raises(ValueError, match="checkpoint must be a str"):
        Activations.model_validate({"checkpoint": 2})
