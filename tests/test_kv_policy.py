"""The fp8 KV cache in the policy: KvFp8, its text and JSON forms, parse_kv, the spelling for
serving with fp8 KV, and the explicit boundary (no cast, no promotion reaches an fp8 cache)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from computectx import ComputeCtx, DType, Fp8Format, KvFp8, PromotionError, cast_if, promote
from computectx.kv_policy import KV_RECENT_MAX, KV_SCALINGS, KV_STEPS, parse_kv

CPU = torch.device("cpu")


def test_defaults_are_the_safe_choice() -> None:
    kv = KvFp8()
    assert (kv.format, kv.scaling, kv.static) == (Fp8Format.E4M3, "per_token_head", False)
    assert KV_SCALINGS == ("per_token_head", "per_head", "per_tensor")
    assert KvFp8(scaling="per_head").static and KvFp8(scaling="per_tensor").static
    assert str(kv) == "e4m3/per_token_head"
    assert hash(kv) == hash(KvFp8.parse("E4M3")) and kv == KvFp8.parse("e4m3/per_token_head")
    with pytest.raises(ValidationError, match="frozen"):
        kv.scaling = "per_head"  # type: ignore[misc]


def test_serving_with_fp8_kv_is_one_with_kv() -> None:
    serving = ComputeCtx.serving(CPU)
    fp8 = serving.with_kv(KvFp8())
    assert (fp8.compute, fp8.kv, fp8.accum) == (DType.BF16, KvFp8(), DType.F32)
    assert fp8.replace(kv=DType.F32) == serving  # only kv differs
    assert serving.kv is DType.F32  # the Rust design's preset is unchanged
    assert str(fp8) == "compute=bf16,kv=e4m3/per_token_head,accum=f32,residency=auto,device=cpu"
    # The accum rules do not change with an fp8 cache.
    with pytest.raises(ValidationError, match="accum=bf16 is not at or above compute=f32"):
        ComputeCtx.parity(CPU).with_kv(KvFp8()).with_accum(DType.BF16)


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("e4m3", KvFp8()),
        (" E5M2 / Per_Tensor ", KvFp8(format=Fp8Format.E5M2, scaling="per_tensor")),
        ("fp8_e4m3/per_head", KvFp8(scaling="per_head")),
        ("float8_e5m2", KvFp8(format=Fp8Format.E5M2)),
        (torch.float8_e4m3fn, KvFp8()),
        (Fp8Format.E5M2, KvFp8(format=Fp8Format.E5M2)),
        ({"scaling": "PER_HEAD"}, KvFp8(scaling="per_head")),
        ({"format": "e5m2", "scaling": "per_tensor"}, KvFp8(format="e5m2", scaling="per_tensor")),  # type: ignore[arg-type]
        ("bf16", DType.BF16),
        (" Float ", DType.F32),
        (torch.float16, DType.F16),
        (DType.F64, DType.F64),
    ],
)
def test_parse_kv_reads_every_form(value: object, want: DType | KvFp8) -> None:
    assert parse_kv(value) == want
    ctx = ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "kv": value})
    assert ctx.kv == want
    assert ComputeCtx.parse(str(ctx)) == ctx
    assert ComputeCtx.model_validate_json(ctx.model_dump_json()) == ctx


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("f17", "unknown kv 'f17'; accepted: a dtype ('f16'"),
        ("fp8", "unknown kv 'fp8'"),
        (
            "e4m3/per_row",
            "unknown KV scaling 'per_row' in 'e4m3/per_row'; accepted: 'per_token_head'",
        ),
        ("e4m3/dynamic", "unknown KV scaling 'dynamic'"),
        ("int8/per_head", "unknown fp8 KV cache format 'int8' in 'int8/per_head'"),
        ("e4m3/per_head/2", "unknown KV scaling '2' in 'e4m3/per_head/2'"),
        ("e4m3/e9m0", "unknown KV scaling 'e9m0' in 'e4m3/e9m0'; accepted: 'per_token_head'"),
        ("e4m3/step=e9m0", "unknown KV step format 'e9m0' in 'e4m3/step=e9m0'; accepted: 'f32'"),
        ("e4m3/recent=-1", "recent='-1' in 'e4m3/recent=-1' is not a count of positions"),
        ("e4m3/recent=1.5", "recent='1.5' in 'e4m3/recent=1.5' is not a count of positions"),
        ("e4m3/bf16/e8m0", "the step of fp8 KV cache 'e4m3/bf16/e8m0' is given twice"),
        ("e4m3/recent=1/recent=2", "the recent of fp8 KV cache 'e4m3/recent=1/recent=2' is"),
        ("e4m3/window=4", "unknown KV cache field 'window' in 'e4m3/window=4'; accepted: step="),
        ("e4m3/per_head/f32/recent=1/x", "too many fields in fp8 KV cache 'e4m3/per_head/f32/"),
        ("/per_head", "unknown fp8 KV cache format ''"),
        (torch.int8, "torch.int8 is not in the compute lattice"),
        (3, "cannot read a dtype from 3"),
    ],
)
def test_bad_kv_values_are_one_error_naming_them(value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_kv(value)
    # Through the policy too: the library's ValueError naming kv, never pydantic's
    # ValidationError with its URL (model_validate, the JSON form and the text form).
    with pytest.raises(ValueError, match=r"^bad ComputeCtx: kv=") as caught:
        ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "kv": value})
    assert not isinstance(caught.value, ValidationError)
    assert str(caught.value).startswith(f"bad ComputeCtx: kv={value!r}: "), str(caught.value)
    assert needle in str(caught.value) and "http" not in str(caught.value)
    if isinstance(value, str):
        with pytest.raises(ValueError, match=r"^bad ComputeCtx: kv=") as parsed:
            ComputeCtx.parse(f"compute=bf16,kv={value},device=cpu")
        assert not isinstance(parsed.value, ValidationError) and needle in str(parsed.value)


@pytest.mark.parametrize(
    "value", [None, 3, 2.5, object(), {"fmt": "e4m3"}, {"format": "e4m3", "x": 1}]
)
def test_a_value_of_no_kv_form_names_both_accepted_forms(value: object) -> None:
    # Whatever the value, the error quotes it and names a dtype and an fp8 cache as the
    # accepted forms (the dict's own fields for a dict).
    with pytest.raises(ValueError, match=r"accepted|takes") as err:
        parse_kv(value)
    text = str(err.value)
    if isinstance(value, dict):
        bad = sorted(set(value) - {"format", "scaling", "step", "recent"})
        assert f"unknown fp8 KV cache field(s) {', '.join(map(repr, bad))}" in text, text
        assert "'format'" in text and "'scaling'" in text and "e4m3" in text, text
        assert "'step'" in text and "'recent'" in text and "e8m0" in text, text
    else:
        assert repr(value) in text and "'bf16'" in text, text  # a dtype spelling
        assert "FORMAT[/SCALING]" in text and "KvFp8" in text, text  # the fp8 forms


def test_json_form_and_bad_json() -> None:
    ctx = ComputeCtx.new(DType.BF16, CPU).with_kv(KvFp8(format=Fp8Format.E5M2, scaling="per_head"))
    data = json.loads(ctx.model_dump_json())
    assert data["kv"] == {"format": "e5m2", "scaling": "per_head"}  # as before step and recent
    compact = ctx.with_kv(KvFp8(step="e8m0", recent=8))
    assert json.loads(compact.model_dump_json())["kv"] == {
        "format": "e4m3",
        "scaling": "per_token_head",
        "step": "e8m0",
        "recent": 8,
    }
    assert ComputeCtx.model_validate_json(compact.model_dump_json()) == compact
    assert ComputeCtx.model_validate(data) == ctx
    # An unknown field is named, with the two a KvFp8 has.
    with pytest.raises(ValueError, match=r"unknown fp8 KV cache field\(s\) 'margin'") as err:
        ComputeCtx.model_validate(
            {"compute": "bf16", "device": "cpu", "kv": {"format": "e4m3", "margin": 2}}
        )
    assert "'format'" in str(err.value) and "'scaling'" in str(err.value)
    with pytest.raises(ValueError, match="unknown fp8 format 'e3m4'"):
        ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "kv": {"format": "e3m4"}})
    with pytest.raises(ValueError, match="'per_token_head', 'per_head' or 'per_tensor'"):
        KvFp8.model_validate({"scaling": "per_row"})


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"recent": null}', "bad KvFp8: recent=None: recent must be an int count"),
        ('{"recent": "4"}', "bad KvFp8: recent='4': recent must be an int count"),
        ('{"recent": 4.0}', "bad KvFp8: recent=4.0: recent must be an int count"),
        ('{"step": null}', "bad KvFp8: step=None: Input should be 'f32', 'bf16' or 'e8m0'"),
        ('{"format": null}', "bad KvFp8: format=None"),
        ('{"scaling": "per_row"}', "bad KvFp8: scaling='per_row'"),
    ],
)
def test_bad_kv_json_is_our_value_error_everywhere(text: str, needle: str) -> None:
    # KvFp8's JSON form and dict form, and the same inside a ComputeCtx's JSON: one
    # ValueError of ours naming the field and the value, no pydantic URL.
    data = json.loads(text)
    for call in (
        lambda: KvFp8.model_validate_json(text),
        lambda: KvFp8.model_validate(data),
        lambda: ComputeCtx.model_validate_json(
            f'{{"compute": "bf16", "device": "cpu", "kv": {text}}}'
        ),
        lambda: ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "kv": data}),
    ):
        with pytest.raises(ValueError, match=r"^bad (KvFp8|ComputeCtx): ") as err:
            call()
        assert not isinstance(err.value, ValidationError), str(err.value)
        assert needle in str(err.value) and "http" not in str(err.value), str(err.value)
    assert str(err.value).startswith("bad ComputeCtx: kv=")


@pytest.mark.parametrize("kv", ["e4m3/per_row", "e4m3/recent=True", "e4m3/recent=-1",
                                "e4m3/recent=99999999"])  # fmt: skip
def test_bad_kv_text_in_a_policy_string_is_our_value_error(kv: str) -> None:
    with pytest.raises(ValueError, match=r"^bad ComputeCtx: kv=") as err:
        ComputeCtx.parse(f"compute=bf16,kv={kv},accum=f32,device=cpu")
    assert not isinstance(err.value, ValidationError) and "http" not in str(err.value)
    # Another field's error stays pydantic's ValidationError (a ValueError too).
    with pytest.raises(ValidationError, match="compute"):
        ComputeCtx.parse(f"compute=bf17,kv={kv},device=cpu")


def test_fp8_kv_is_an_explicit_boundary() -> None:
    ctx = ComputeCtx.serving(CPU).with_kv(KvFp8())
    # The cache quantizes: codes and their steps come out together, which no cast can do.
    with pytest.raises(
        PromotionError, match=r"kv=e4m3/per_token_head is an fp8 KV cache.*quantizer"
    ):
        ctx.to_kv(torch.zeros(2))
    with pytest.raises(PromotionError, match="is an fp8 KV cache, not a compute dtype"):
        promote(DType.F32, KvFp8())  # type: ignore[arg-type]
    with pytest.raises(PromotionError, match="is an fp8 KV cache, not a compute dtype"):
        cast_if(torch.zeros(2), KvFp8())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown dtype"):
        DType.parse("e4m3/per_token_head")
    # A lattice kv still casts minimally.
    f32 = ComputeCtx.serving(CPU)
    b = torch.zeros(2, dtype=torch.bfloat16)
    assert f32.to_kv(b).dtype == torch.float32


def test_kv_settings_are_distinct_policies() -> None:
    base = ComputeCtx.serving(CPU)
    settings = {base.with_kv(KvFp8(format=f, scaling=s)) for f in Fp8Format for s in KV_SCALINGS}
    assert len(settings | {base}) == 7
    with pytest.raises(TypeError, match="takes a str"):
        KvFp8.parse(3)  # type: ignore[arg-type]


# ----- compact steps and the window of recent positions (KvFp8.step, KvFp8.recent) ------------


@pytest.mark.parametrize(
    ("text", "want", "canonical"),
    [
        # The 0.1.0 strings read as they did, and print as they did.
        ("e4m3", KvFp8(), "e4m3/per_token_head"),
        ("e5m2/per_tensor", KvFp8(format=Fp8Format.E5M2, scaling="per_tensor"), None),
        ("e4m3/e8m0", KvFp8(step="e8m0"), "e4m3/per_token_head/e8m0"),
        ("E4M3/Per_Token_Head/BF16", KvFp8(step="bf16"), "e4m3/per_token_head/bf16"),
        (" e4m3 / recent=64 / e8m0 ", KvFp8(step="e8m0", recent=64), None),
        ("e4m3/step=float8_e8m0fnu/per_head", KvFp8(scaling="per_head", step="e8m0"), None),
        ("e4m3/per_token_head/f32/recent=0", KvFp8(), "e4m3/per_token_head"),
        ("fp8_e5m2/RECENT=8", KvFp8(format=Fp8Format.E5M2, recent=8), None),
    ],
)
def test_the_text_form_reads_step_and_recent(text: str, want: KvFp8, canonical: str | None) -> None:
    assert KvFp8.parse(text) == want and parse_kv(text) == want
    if canonical is not None:
        assert str(want) == canonical
    assert KvFp8.parse(str(want)) == want
    ctx = ComputeCtx.parse(f"compute=bf16,kv={text},device=cpu")
    assert ctx.kv == want and ComputeCtx.parse(str(ctx)) == ctx


def test_step_and_recent_fields() -> None:
    kv = KvFp8(step="e8m0", recent=16)
    assert (kv.step_dtype, kv.step_bytes, kv.static) == (torch.float8_e8m0fnu, 1, False)
    assert (KvFp8().step_bytes, KvFp8(step="bf16").step_bytes) == (4, 2)
    assert KvFp8(step=torch.bfloat16) == KvFp8(step="bf16")  # type: ignore[arg-type]
    assert KvFp8(step=" FP32 ") == KvFp8()  # type: ignore[arg-type]
    # A static scheme stores its few steps at the format too (its bytes do not grow with T).
    assert str(KvFp8(scaling="per_tensor", step="e8m0")) == "e4m3/per_tensor/e8m0"
    for bad in (True, 2.0, -1):
        with pytest.raises(ValueError, match="recent must be an int count"):
            KvFp8(recent=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'f32', 'bf16' or 'e8m0'"):
        KvFp8(step="e9m0")  # type: ignore[arg-type]
    assert len({KvFp8(step=s, recent=r) for s in KV_STEPS for r in (0, 1, 64)}) == 9


_BAD_FIELD_VALUES: list[object] = [True, 2.0, "2", None, np.int64(1), 10**12, -1, [4]]


@pytest.mark.parametrize("field", list(KvFp8.model_fields))
@pytest.mark.parametrize("bad", _BAD_FIELD_VALUES, ids=repr)
def test_every_field_refuses_what_a_user_might_pass_with_our_error(field: str, bad: object) -> None:
    # Issue 32 item 15: recent="4" and recent=10**12 were accepted; every other junk value
    # surfaced as pydantic's ValidationError with a URL. Now: one ValueError of ours, naming
    # the field, the value and what is accepted, from the constructor and the dict form
    # alike. (np.int64(1) is a valid count for recent: it reads as the int 1.)
    if field == "recent" and isinstance(bad, np.integer):
        kv = KvFp8(recent=bad)  # type: ignore[arg-type]  # typed int; numpy reads as one
        assert kv.recent == 1 and type(kv.recent) is int
        return
    makers: list[Callable[[], object]] = [
        lambda: KvFp8(**{field: bad}),  # type: ignore[arg-type]
        lambda: parse_kv({field: bad}),
    ]
    for make in makers:
        with pytest.raises(ValueError, match=field) as err:
            make()
        assert not isinstance(err.value, ValidationError)
        text = str(err.value)
        assert f"{field}={bad!r}" in text and "pydantic.dev" not in text, text
        assert {"format": "e4m3", "scaling": "per_head", "step": "e8m0", "recent": "1048576"}[
            field
        ] in text


def test_recent_has_a_sane_range_in_every_form() -> None:
    assert KvFp8(recent=KV_RECENT_MAX).recent == KV_RECENT_MAX
    for text in (f"e4m3/recent={KV_RECENT_MAX + 1}", "e4m3/recent=1000000000000"):
        with pytest.raises(ValueError, match=f"from 0 to {KV_RECENT_MAX}") as err:
            parse_kv(text)
        assert not isinstance(err.value, ValidationError)
    with pytest.raises(ValueError, match="got '4' \\(str\\)"):  # JSON's "4" is not a count
        KvFp8.model_validate_json('{"recent": "4"}')


_CASE_FLIPS = st.lists(st.booleans(), min_size=64, max_size=64)


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(list(Fp8Format)),
    scaling=st.sampled_from(KV_SCALINGS),
    step=st.sampled_from(KV_STEPS),
    recent=st.integers(0, 10_000),
    order=st.permutations([0, 1, 2]),
    flips=_CASE_FLIPS,
)
def test_every_setting_round_trips_through_text_and_json(
    fmt: Fp8Format,
    scaling: str,
    step: str,
    recent: int,
    order: list[int],
    flips: list[bool],
) -> None:
    kv = KvFp8(format=fmt, scaling=scaling, step=step, recent=recent)  # type: ignore[arg-type]
    assert KvFp8.parse(str(kv)) == kv
    assert KvFp8.model_validate_json(kv.model_dump_json()) == kv
    assert parse_kv(json.loads(kv.model_dump_json())) == kv
    # The parts after the format in any order and any case read the same.
    parts = [scaling, f"step={step}" if order[0] == 0 else step, f"recent={recent}"]
    text = "/".join([str(fmt)] + [parts[i] for i in order])
    text = "".join(c.upper() if f else c for c, f in zip(text, flips * 4, strict=False))
    assert KvFp8.parse(text) == kv == parse_kv(text)


_GOOD_PART = re.compile(
    r"(per_token_head|per_head|per_tensor|f32|fp32|float32|bf16|bfloat16|e8m0|e8m0fnu"
    r"|step=(f32|fp32|float32|bf16|bfloat16|e8m0|e8m0fnu)|recent=\d+)"
)


@settings(max_examples=80, deadline=None)
@given(part=st.text(alphabet="abcdefhmnoprst0123456789_=-.", min_size=1, max_size=14))
def test_a_bad_part_is_one_error_naming_it(part: str) -> None:
    text = f"e4m3/{part}"
    if _GOOD_PART.fullmatch(part):  # a scaling, a step format or a window
        kv = KvFp8.parse(text)
        assert kv == KvFp8.parse(str(kv)) and kv.format is Fp8Format.E4M3
        return
    with pytest.raises(ValueError, match=re.escape(repr(text))) as err:
        KvFp8.parse(text)
    assert "FORMAT[/SCALING][/STEP][/recent=N]" in str(err.value)
