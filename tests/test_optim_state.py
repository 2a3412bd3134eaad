"""The optimizer-state policy: ``OptimState`` and ``ComputeCtx.optim_state`` (values, text and
JSON forms, defaults, bad input). The codecs and optimizers that read it are tested in
tests/memory; the fuzzed round trips in tests/test_properties.py."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import computectx
from computectx import OPTIM_STATE_FLAGS, ComputeCtx, DType, OptimState, parse_optim_state
from computectx.optim_state import DEFAULT_BLOCK, DEFAULT_MIN_SIZE

BASE = ComputeCtx.new(DType.BF16, "cpu")


def test_the_default_is_f32_state_with_no_blocks() -> None:
    state = OptimState()
    assert (state.format, state.block, state.min_size) == ("f32", None, DEFAULT_MIN_SIZE)
    assert (state.block_size, state.compact, state.quantized) == (0, False, False)
    assert str(state) == "f32" and DEFAULT_MIN_SIZE == 4096
    assert BASE.optim_state == state
    assert "optim_state" not in str(BASE)


@pytest.mark.parametrize(
    ("fmt", "block", "compact", "quantized"),
    [
        ("f32", 0, False, False),
        ("bf16", 0, True, False),
        ("int8", 256, True, True),
        ("fp8", 256, True, True),
        ("int4", 128, True, True),
    ],
)
def test_each_format_resolves_its_block(
    fmt: str, block: int, compact: bool, quantized: bool
) -> None:
    state = OptimState.parse(fmt)
    assert state.format == fmt
    assert (state.block_size, state.compact, state.quantized) == (block, compact, quantized)
    assert state.block == (block or None)
    assert str(state) == fmt
    # The default block spelled out is the same value, with the same text form.
    if block:
        assert OptimState.parse(f"{fmt}/block={block}") == state
        assert DEFAULT_BLOCK[fmt] == block
    assert fmt in OPTIM_STATE_FLAGS


def test_flags_are_the_formats_in_order() -> None:
    assert OPTIM_STATE_FLAGS == ("f32", "bf16", "int8", "fp8", "int4")
    assert [OptimState.parse(f).format for f in OPTIM_STATE_FLAGS] == list(OPTIM_STATE_FLAGS)


def test_text_form_shows_only_what_differs_and_reads_in_any_order_and_case() -> None:
    state = OptimState(format="int4", block=64, min_size=0)
    assert str(state) == "int4/block=64/min=0"
    for text in (
        "INT4/Min=0/BLOCK=64",
        " int4 / block = 64 / min_size = 0 ",
        "int4/min=0/block=64",
    ):
        assert OptimState.parse(text) == state
    assert str(OptimState(format="fp8", min_size=100)) == "fp8/min=100"
    assert str(OptimState(format="bf16", min_size=0)) == "bf16/min=0"
    assert str(OptimState(format="int8", block=1024)) == "int8/block=1024"


def test_json_form() -> None:
    state = OptimState(format="int8")
    assert json.loads(state.model_dump_json()) == {
        "format": "int8",
        "block": 256,
        "min_size": 4096,
    }
    assert parse_optim_state({"format": "int8", "block": 256, "min_size": 4096}) == state
    assert parse_optim_state({"format": "INT8"}) == state
    assert parse_optim_state({"format": "int8", "block": None}) == state
    assert json.loads(OptimState().model_dump_json()) == {
        "format": "f32",
        "block": None,
        "min_size": 4096,
    }


def test_ctx_field_text_json_and_with_optim_state() -> None:
    ctx = BASE.with_optim_state("int4/block=64")
    assert ctx.optim_state == OptimState(format="int4", block=64)
    assert BASE.optim_state == OptimState()  # the original never changes
    text = str(ctx)
    assert (
        text == "compute=bf16,kv=bf16,accum=f32,residency=auto,device=cpu,optim_state=int4/block=64"
    )
    assert ComputeCtx.parse(text) == ctx
    assert ComputeCtx.parse(text.replace("int4/block=64", "INT4/Block=64")) == ctx
    data = json.loads(ctx.model_dump_json())
    assert data["optim_state"] == {"format": "int4", "block": 64, "min_size": 4096}
    assert ComputeCtx.model_validate_json(ctx.model_dump_json()) == ctx
    # Every spelling the field reads: a value, its text form, its dict.
    for value in (
        OptimState(format="int4", block=64),
        "int4/block=64",
        {"format": "int4", "block": 64},
    ):
        got = ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "optim_state": value})
        assert got == ctx
    assert BASE.with_optim_state(OptimState(format="int8")) == BASE.replace(
        optim_state=OptimState(format="int8")
    )
    assert BASE.with_optim_state("int8").with_optim_state("f32") == BASE
    # Independent of the other memory fields.
    both = ctx.replace(master=DType.BF16, offload=torch.device("cpu"))
    assert ComputeCtx.parse(str(both)) == both and both.optim_state == ctx.optim_state


def test_schema_describes_the_field() -> None:
    schema = ComputeCtx.model_json_schema()
    assert "optim_state" in schema["properties"]
    assert "optim_state" not in schema["required"]
    assert "OptimState" in schema["$defs"]
    assert "float32" in schema["properties"]["optim_state"]["description"]
    fmt = schema["$defs"]["OptimState"]["properties"]["format"]
    assert fmt["enum"] == list(OPTIM_STATE_FLAGS)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("int3", "unknown optimizer state format 'int3' in 'int3'; accepted: f32, bf16, int8"),
        ("", "unknown optimizer state format '' in ''"),
        ("int8/block=100", "bad optimizer state 'int8/block=100': block=100 is not a power of two"),
        ("int8/block=16", "block=16 is not a power of two from 32 to 4096"),
        ("int4/block=8192", "block=8192 is not a power of two from 32 to 4096"),
        ("f32/block=256", "block=256 given for format f32, which has no blocks; a block applies"),
        ("bf16/block=64", "block=64 given for format bf16, which has no blocks"),
        ("int8/min=-1", "min_size=-1 is negative; accepted: an integer >= 0"),
        ("f32/min=0", "min_size=0 given for format f32, which keeps every tensor float32"),
        ("int8/block=2.5", "block='2.5' in optimizer state 'int8/block=2.5' is not an integer"),
        ("int8/min=", "min='' in optimizer state 'int8/min=' is not an integer"),
        ("int8/block=64/block=64", "block given twice in optimizer state"),
        ("int8/min=1/min_size=1", "min_size given twice in optimizer state"),
        ("int8/64", "bad part '64' in optimizer state 'int8/64'; accepted: block=N, min=M"),
        ("int8/", "bad part '' in optimizer state 'int8/'"),
        ("int8/scale=2", "bad part 'scale=2'"),
    ],
)  # fmt: skip
def test_bad_text_names_the_value_and_what_is_accepted(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        OptimState.parse(text)
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_optim_state(text)
    # Inside a ComputeCtx: our ValueError (no pydantic URL), naming the field.
    with pytest.raises(ValueError, match=re.escape(needle)) as caught:
        ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "optim_state": text})
    assert not isinstance(caught.value, ValidationError)
    assert str(caught.value).startswith("bad ComputeCtx: optim_state=")


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (3, "bad optimizer state 3 (int); accepted: an OptimState, its text form"),
        (None, "bad optimizer state None (NoneType)"),
        (DType.BF16, "bad optimizer state"),
        ({"format": "int8", "bits": 8}, "unknown optimizer state field(s) 'bits'"),
    ],
)
def test_parse_optim_state_refuses_other_values(value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_optim_state(value)


def test_dicts_are_checked_field_by_field() -> None:
    def read(state: object) -> ComputeCtx:
        return ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "optim_state": state})

    # Inside a ComputeCtx the error is ours (a ValueError at the optim_state field, no
    # pydantic URL); the message names each bad field, its value and what is accepted.
    with pytest.raises(ValueError, match="bad ComputeCtx: optim_state=") as caught:
        read({"format": "int8", "block": True, "min_size": "0"})
    assert not isinstance(caught.value, ValidationError)
    assert str(caught.value).startswith("bad ComputeCtx: optim_state=")
    assert "block must be an integer, got bool True" in str(caught.value)
    assert "min_size must be an integer, got str '0'" in str(caught.value)
    with pytest.raises(ValueError, match="bits=8: no such field; accepted: format, block"):
        read({"format": "int8", "bits": 8})
    with pytest.raises(ValueError, match="unknown optimizer state format 'q8'"):
        read({"format": "q8", "block": 64})
    with pytest.raises(ValueError, match=re.escape("block=64 given for format f32")):
        read({"block": 64})
    with pytest.raises(ValueError, match="bad optimizer state"):
        read(8)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"format": "int8", "block": 2.0}, "integer, got float 2.0; accepted: a power"),
        ({"format": "int8", "block": True}, "block must be an integer, got bool True"),
        ({"format": "int8", "block": "64"}, "block must be an integer, got str '64'"),
        ({"format": "int8", "block": 2**70}, f"block={2**70} is not a power of two"),
        ({"format": "int8", "min_size": 2.0}, "integer, got float 2.0; accepted: an int"),
        ({"format": "int8", "min_size": True}, "min_size must be an integer, got bool True"),
        ({"format": "int8", "min_size": "2"}, "min_size must be an integer, got str '2'"),
        ({"format": "int8", "min_size": None}, "min_size must be an integer, got NoneType None"),
        ({"format": "int8", "min_size": np.bool_(True)}, "min_size must be an integer, got bool"),
        ({"format": "int8", "min_size": 2**64}, f"min_size={2**64} is too large; accepted: an int"),
        ({"format": "int8", "min_size": -1}, "min_size=-1 is negative"),
        ({"format": None}, "format=None: unknown optimizer state format None; accepted: f32, bf16"),
        ({"format": 8}, "format=8: unknown optimizer state format 8; accepted: f32, bf16"),
        ({"format": "int8", "bits": 8}, "bits"),
    ],
)  # fmt: skip
def test_bad_fields_are_our_value_error_naming_value_and_accepted(
    fields: dict[str, object], needle: str
) -> None:
    # Every way in (the constructor, model_validate, the JSON form, parse_optim_state's dict
    # form, with_optim_state) gives the library's ValueError, never pydantic's (no URL).
    ways: list[Callable[[], object]] = [
        lambda: OptimState(**fields),
        lambda: OptimState.model_validate(fields),
        lambda: parse_optim_state(fields),
        lambda: ComputeCtx.parity("cpu").with_optim_state(fields),  # type: ignore[arg-type]
    ]
    if not isinstance(fields.get("min_size"), np.generic):
        ways.append(lambda: OptimState.model_validate_json(json.dumps(fields)))
    for way in ways:
        with pytest.raises(ValueError, match=re.escape(needle)) as caught:
            way()
        assert not isinstance(caught.value, ValidationError), caught.value
        assert "errors.pydantic.dev" not in str(caught.value)


def test_numpy_integers_read_as_their_value() -> None:
    state = OptimState(format="int8", block=np.int64(64), min_size=np.int32(0))
    assert state == OptimState.parse("int8/block=64/min=0")
    assert type(state.block) is int and type(state.min_size) is int


def test_frozen_and_hashable() -> None:
    a = OptimState.parse("int8")
    assert a == OptimState(format="int8", block=256) and hash(a) == hash(OptimState(format="int8"))
    assert len({a, OptimState(), OptimState(format="fp8")}) == 3
    with pytest.raises(ValidationError, match="frozen"):
        a.block = 64  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes a str"):
        OptimState.parse(b"int8")  # type: ignore[arg-type]


def test_package_face_exports() -> None:
    assert computectx.OptimState is OptimState
    assert computectx.OPTIM_STATE_FLAGS is OPTIM_STATE_FLAGS
    assert computectx.parse_optim_state is parse_optim_state
    assert {"OptimState", "OPTIM_STATE_FLAGS", "parse_optim_state"} <= set(computectx.__all__)
