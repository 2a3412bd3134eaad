"""ComputeCtx: presets, validated copies, the casts, the text and JSON forms, bad input."""

from __future__ import annotations

import base64
import json
import pickle
import re

import pytest
import torch
from pydantic import ValidationError

from computectx import (
    ComputeCtx,
    DType,
    Fp8Format,
    KvFp8,
    OptimState,
    PromotionError,
    Residency,
)
from computectx.ctx import DTYPE_FLAGS
from computectx.formats import DelayedScaling, DynamicScaling, Fp8Scheme, Recipe
from computectx.recipes import parse_scaling

CPU = torch.device("cpu")


def test_presets_set_the_rust_dtypes() -> None:
    s = ComputeCtx.serving("cpu")
    assert (s.compute, s.kv, s.accum) == (DType.BF16, DType.F32, DType.F32)
    p = ComputeCtx.parity(CPU)
    assert (p.compute, p.kv, p.accum) == (DType.F32, DType.F32, DType.F32)
    n = ComputeCtx.new(DType.F16, "cpu")
    assert (n.compute, n.kv, n.accum, n.residency) == (
        DType.F16,
        DType.F16,
        DType.F32,
        Residency.AUTO,
    )
    assert n.device == CPU and n.fp8 is None and n.grad is DType.F32 and n.master is DType.F32
    assert n.offload is None and n.offload_device == CPU
    # Optimizer state stays torch's own f32 unless asked: every preset keeps today's behaviour.
    assert n.optim_state == OptimState() and n.optim_state.format == "f32"
    assert {
        c.optim_state for c in (s, p, *(ComputeCtx.from_flag(f, CPU) for f in DTYPE_FLAGS))
    } == {OptimState()}
    # F64 compute accumulates in F64: accum is compute ⊔ F32, never below compute.
    assert ComputeCtx.new(DType.F64, "cpu").accum is DType.F64


def test_with_kv_and_with_accum_return_new_values() -> None:
    base = ComputeCtx.new(DType.BF16, "cpu")
    kv = base.with_kv(DType.F32)
    assert kv.kv is DType.F32 and base.kv is DType.BF16
    acc = base.with_accum(DType.F64)
    assert acc.accum is DType.F64 and base.accum is DType.F32
    assert kv != base and kv == base.with_kv(DType.F32)


def test_replace_validates_and_leaves_the_original_alone() -> None:
    base = ComputeCtx.new(DType.BF16, "cpu")
    changed = base.replace(grad=DType.BF16, offload=torch.device("cpu"), residency=Residency.MMAP)
    assert changed.grad is DType.BF16 and changed.residency is Residency.MMAP
    assert base.grad is DType.F32 and base.residency is Residency.AUTO
    with pytest.raises(ValueError, match="unknown ComputeCtx field"):
        base.replace(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="accum=bf16 is not at or above compute=f32"):
        ComputeCtx.parity("cpu").replace(accum=DType.BF16)


def test_frozen_hashable_equal_by_value() -> None:
    a = ComputeCtx.serving("cpu")
    b = ComputeCtx.serving(torch.device("cpu"))
    assert a == b and hash(a) == hash(b)
    assert len({a, b, ComputeCtx.parity("cpu")}) == 2
    with pytest.raises(ValidationError, match="frozen"):
        a.compute = DType.F16  # type: ignore[misc]
    assert a.compute is DType.BF16


def test_extra_fields_are_forbidden() -> None:
    with pytest.raises(ValidationError, match="bogus"):
        ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "bogus": 1})


def test_accum_defaults_to_compute_join_f32() -> None:
    assert ComputeCtx.parse("compute=f64,device=cpu").accum is DType.F64
    assert ComputeCtx.parse("compute=f16,device=cpu").accum is DType.F32
    assert ComputeCtx.model_validate({"compute": "bf16", "device": "cpu"}).accum is DType.F32


def test_constructor_accepts_names_and_defaults_kv_to_compute() -> None:
    ctx = ComputeCtx.model_validate({"compute": "bfloat16", "device": "cpu"})
    assert ctx.kv is DType.BF16 and ctx.accum is DType.F32
    ctx2 = ComputeCtx.model_validate({"compute": torch.float16, "device": CPU, "kv": "f32"})
    assert ctx2.compute is DType.F16 and ctx2.kv is DType.F32


def test_precise_runs_in_accum_and_restores_dtype() -> None:
    ctx = ComputeCtx.new(DType.BF16, "cpu")
    t = torch.zeros(4, dtype=torch.bfloat16)
    seen: list[torch.dtype] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.dtype)
        return x + 1

    out = ctx.precise(t, f)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    assert torch.equal(out, torch.ones(4, dtype=torch.bfloat16))


def test_precise_is_a_no_cast_when_already_at_accum() -> None:
    ctx = ComputeCtx.parity("cpu")
    t = torch.zeros(4)
    received: list[torch.Tensor] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        received.append(x)
        return x

    out = ctx.precise(t, f)
    assert received[0] is t and out is t


def test_precise_never_lowers_precision() -> None:
    # An F64 tensor under an F32-accum policy runs at F64 (t.dtype ⊔ accum), untouched.
    ctx = ComputeCtx.new(DType.BF16, "cpu")
    t = torch.full((2,), 1.0 + 2.0**-40, dtype=torch.float64)
    out = ctx.precise(t, lambda x: x * 1)
    assert out.dtype == torch.float64 and torch.equal(out, t)
    # F16 input under a BF16-compute policy lifts to F16 ⊔ F32 = F32.
    seen: list[torch.dtype] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.dtype)
        return x

    ctx.precise(torch.ones(2, dtype=torch.float16), record)
    assert seen == [torch.float32]


def test_precise_rejects_fp8_input_and_non_float_results() -> None:
    ctx = ComputeCtx.new(DType.BF16, "cpu")
    with pytest.raises(PromotionError, match="Dequantize"):
        ctx.precise(torch.zeros(2, dtype=torch.float8_e4m3fn), lambda x: x)
    with pytest.raises(PromotionError, match=r"returned a torch\.int64"):
        ctx.precise(torch.zeros(2, dtype=torch.bfloat16), lambda x: x.argmax(-1))


def test_to_compute_and_to_kv_are_minimal_casts() -> None:
    ctx = ComputeCtx.serving("cpu")
    b = torch.zeros(2, dtype=torch.bfloat16)
    f = torch.zeros(2)
    assert ctx.to_compute(b) is b
    assert ctx.to_kv(f) is f
    assert ctx.to_compute(f).dtype == torch.bfloat16
    assert ctx.to_kv(b).dtype == torch.float32
    with pytest.raises(PromotionError):
        ctx.to_kv(torch.zeros(2, dtype=torch.int32))


def test_autocast_lowers_only_for_half_dtypes() -> None:
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with ComputeCtx.new(DType.BF16, "cpu").autocast():
        assert lin(x).dtype == torch.bfloat16
    with ComputeCtx.parity("cpu").autocast():
        assert lin(x).dtype == torch.float32


def test_from_flag_follows_the_reference_convention() -> None:
    assert ComputeCtx.from_flag("fp32", "cpu") == ComputeCtx.parity("cpu")
    assert ComputeCtx.from_flag("bf16", "cpu") == ComputeCtx.new(DType.BF16, "cpu")
    assert ComputeCtx.from_flag("FP16", "cpu").compute is DType.F16
    e4 = ComputeCtx.from_flag("fp8_e4m3", "cpu")
    assert e4.compute is DType.BF16 and e4.fp8 is not None
    assert e4.fp8.format is Fp8Scheme.E4M3 and isinstance(e4.fp8.scaling, DelayedScaling)
    e5 = ComputeCtx.from_flag("fp8_e5m2", "cpu")
    assert e5.fp8 is not None and e5.fp8.format is Fp8Scheme.E5M2
    hy = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    assert hy.fp8 is not None and hy.fp8.format is Fp8Scheme.HYBRID
    with pytest.raises(ValueError, match="accepted: 'fp32', 'fp16', 'bf16', 'fp8_e4m3'"):
        ComputeCtx.from_flag("int8", "cpu")


def test_text_form_is_compact_and_round_trips() -> None:
    s = ComputeCtx.serving("cpu")
    assert str(s) == "compute=bf16,kv=f32,accum=f32,residency=auto,device=cpu"
    assert ComputeCtx.parse(str(s)) == s
    rich = s.replace(
        recipe=Recipe(format=Fp8Scheme.E5M2, scaling=DynamicScaling(margin=2)),
        grad=DType.BF16,
        offload=torch.device("cpu"),
        device=torch.device("cuda:1"),
    )
    text = str(rich)
    assert "recipe=e5m2/dynamic/2" in text and "grad=bf16" in text and "offload=cpu" in text
    assert "master" not in text and "optim_state" not in text  # equal to their defaults
    assert ComputeCtx.parse(text) == rich
    assert ComputeCtx.parse(" compute = bf16 , device = cpu ") == ComputeCtx.new(DType.BF16, "cpu")
    assert ComputeCtx.parse("compute=bf16,device=cpu,fp8=none,offload=none").fp8 is None


def test_fp8_kv_text_and_json_forms() -> None:
    ctx = ComputeCtx.serving("cpu").with_kv(KvFp8())
    assert str(ctx) == "compute=bf16,kv=e4m3/per_token_head,accum=f32,residency=auto,device=cpu"
    assert ComputeCtx.parse(str(ctx)) == ctx
    assert ComputeCtx.parse("compute=bf16,kv=E4M3,accum=f32,device=cpu") == ctx
    data = json.loads(ctx.model_dump_json())
    assert data["kv"] == {"format": "e4m3", "scaling": "per_token_head"}
    assert ComputeCtx.model_validate_json(ctx.model_dump_json()) == ctx
    static = ctx.with_kv(KvFp8(format=Fp8Format.E5M2, scaling="per_tensor"))
    assert ",kv=e5m2/per_tensor," in str(static)
    assert ComputeCtx.model_validate(
        {"compute": "bf16", "device": "cpu", "kv": {"scaling": "PER_HEAD"}}
    ).kv == KvFp8(scaling="per_head")
    # The serving preset itself is unchanged: KV f32.
    assert ComputeCtx.serving("cpu").kv is DType.F32
    schema = ComputeCtx.model_json_schema()
    assert {"$ref": "#/$defs/KvFp8"} in schema["properties"]["kv"]["anyOf"]


def test_json_round_trip_and_schema() -> None:
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cuda:0").replace(offload=torch.device("cpu"))
    text = ctx.model_dump_json()
    data = json.loads(text)
    assert data["device"] == "cuda:0" and data["offload"] == "cpu"
    assert data["recipe"]["scaling"]["kind"] == "delayed"
    assert ComputeCtx.model_validate_json(text) == ctx
    schema = ComputeCtx.model_json_schema()
    assert set(schema["required"]) == {"compute", "device"}
    assert schema["properties"]["device"]["type"] == "string"
    assert "precise" in schema["properties"]["accum"]["description"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("compute=bf17,device=cpu", "unknown dtype 'bf17'; accepted: 'f16'"),
        ("compute=bf16,device=gpu", "bad device 'gpu'; accepted: 'cpu'"),
        ("compute=bf16,device=cpu,colour=red", "unknown policy key 'colour'"),
        ("compute=bf16,device=cpu,compute=f32", "given twice"),
        ("compute=bf16;device=cpu", "unknown dtype 'bf16;device=cpu'"),
        ("compute=bf16,device", "expected key=value"),
        ("compute=bf16,device=cpu,residency=ram", "unknown residency 'ram'; accepted: 'device'"),
        ("compute=bf16,device=cpu,fp8=e4m3/lazy", "accepted recipes 'delayed', 'dynamic'"),
        ("compute=bf16,device=cpu,fp8=int4", "unknown fp8 scheme"),
        ("compute=bf16,device=cpu,kv=f17", "unknown kv 'f17'; accepted: a dtype ('f16'"),
        (
            "compute=bf16,device=cpu,kv=e4m3/per_row",
            "unknown KV scaling 'per_row' in 'e4m3/per_row'",
        ),
        ("compute=bf16,device=cpu,kv=e3m4/per_head", "unknown fp8 KV cache format 'e3m4'"),
        (
            "compute=bf16,device=cpu,kv=e4m3/per_head/2",
            "unknown KV scaling '2' in 'e4m3/per_head/2'",
        ),
        (
            "compute=bf16,device=cpu,fp8=hybrid/delayed/x",
            "history_len must be an integer from 1 to 1024, got 'x'",
        ),
        ("device=cpu", "compute"),
        ("", "expected key=value"),
        (
            "compute=bf16,device=cpu,optim_state=int3",
            "unknown optimizer state format 'int3' in 'int3'; accepted: f32, bf16, int8",
        ),
        (
            "compute=bf16,device=cpu,optim_state=int8/block=48",
            "block=48 is not a power of two from 32 to 4096",
        ),
        (
            "compute=bf16,device=cpu,optim_state=bf16/block=64",
            "block=64 given for format bf16, which has no blocks",
        ),
        ("compute=bf16,device=cpu,optim_state=fp8/min=-1", "min_size=-1 is negative"),
        ("compute=bf16,device=cpu,optim_state=int4/size=3", "bad part 'size=3'"),
    ],
)
def test_bad_policy_strings_name_the_bad_value(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        ComputeCtx.parse(text)


def test_parse_requires_a_string() -> None:
    with pytest.raises(TypeError, match="takes a str"):
        ComputeCtx.parse(b"compute=bf16")  # type: ignore[arg-type]


def test_bad_json_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="extra_forbidden"):
        ComputeCtx.model_validate_json('{"compute": "bf16", "device": "cpu", "speed": 11}')
    with pytest.raises(ValidationError, match="history_len"):
        ComputeCtx.model_validate_json(
            '{"compute": "bf16", "device": "cpu", "fp8": {"scaling": {"kind": "delayed",'
            ' "history_len": 0}}}'
        )


# ----- one spelling per idea ------------------------------------------------------------------


def test_dynamic_flags_sit_beside_the_delayed_ones() -> None:
    assert DTYPE_FLAGS == (
        "fp32",
        "fp16",
        "bf16",
        "fp8_e4m3",
        "fp8_e5m2",
        "fp8_hybrid",
        "fp8_e4m3_dynamic",
        "fp8_e5m2_dynamic",
        "fp8_hybrid_dynamic",
        "fp8_rowwise",
        "fp8_rowwise_gw_hp",
        "fp8_block",
        "fp8_mx",
        "nvfp4",
        "mxfp4",
    )
    for scheme in Fp8Scheme:
        delayed = ComputeCtx.from_flag(f"fp8_{scheme}", "cpu")
        dynamic = ComputeCtx.from_flag(f"fp8_{scheme}_dynamic", "cpu")
        assert delayed.fp8 == Recipe(format=scheme, scaling=DelayedScaling())
        assert dynamic.fp8 == Recipe(format=scheme, scaling=DynamicScaling())
        assert dynamic == delayed.replace(recipe=dynamic.fp8)  # only the scaling differs
    with pytest.raises(ValueError, match="'fp8_hybrid', 'fp8_e4m3_dynamic', 'fp8_e5m2_dynamic'"):
        ComputeCtx.from_flag("fp8_hybrid_lazy", "cpu")


def test_names_are_case_insensitive_in_every_text_field() -> None:
    want = ComputeCtx.new(DType.BF16, "cpu").replace(
        residency=Residency.MMAP,
        recipe=Recipe(format=Fp8Scheme.E4M3, scaling=DelayedScaling(algo="most_recent")),
        grad=DType.BF16,
        offload=CPU,
    )
    text = "COMPUTE=BF16,Device=CPU,residency=MMap,fp8=E4M3/Delayed/16/0/Most_Recent,GRAD=Bf16"
    assert ComputeCtx.parse(text + ",offload=Cpu") == want
    assert (
        ComputeCtx(
            compute="BFloat16",  # type: ignore[arg-type]
            device="CPU",  # type: ignore[arg-type]
            residency="MMAP",  # type: ignore[arg-type]
            recipe={"format": "E4M3", "scaling": {"kind": "DELAYED", "algo": "MOST_RECENT"}},  # type: ignore[arg-type]
            grad="BF16",  # type: ignore[arg-type]
            offload="CPU",  # type: ignore[arg-type]
        )
        == want
    )
    assert ComputeCtx.from_flag(" FP8_Hybrid_Dynamic ", "CUDA:1").device == torch.device("cuda:1")
    assert Recipe(format="HYBRID") == Recipe()  # type: ignore[arg-type]
    assert ComputeCtx.parse("compute=bf16,device=cpu,fp8=NONE,offload=None").fp8 is None
    assert ComputeCtx(compute=DType.BF16, device=CPU, offload="NONE").offload is None  # type: ignore[arg-type]


def test_scaling_reads_its_text_form_wherever_the_policy_does() -> None:
    assert Recipe(scaling="dynamic") == Recipe(scaling=DynamicScaling())  # type: ignore[arg-type]
    assert Recipe(scaling="dynamic/3").scaling == DynamicScaling(margin=3)  # type: ignore[arg-type]
    assert Recipe(scaling="delayed").scaling == DelayedScaling()  # type: ignore[arg-type]
    got = Recipe(scaling="delayed/8/1/most_recent").scaling  # type: ignore[arg-type]
    assert got == DelayedScaling(history_len=8, margin=1, algo="most_recent")
    assert parse_scaling("delayed/32") == DelayedScaling(history_len=32)
    # The recipe's text is the tail of the policy's: one spelling.
    for s in (DelayedScaling(history_len=4, margin=2), DynamicScaling(margin=5)):
        assert parse_scaling(str(s)) == s
        assert str(Recipe(format=Fp8Scheme.E5M2, scaling=s)) == f"e5m2/{s}"
    ctx = ComputeCtx.model_validate_json(
        '{"compute": "bf16", "device": "cpu", "fp8": {"scaling": "dynamic/2"}}'
    )
    assert ctx.recipe == Recipe(scaling=DynamicScaling(margin=2))
    with pytest.raises(ValueError, match=r"scaling must be a DelayedScaling, .* got int 5"):
        Recipe(scaling=5)  # type: ignore[arg-type]


def test_json_kind_tags_are_optional_and_default_to_delayed() -> None:
    ctx = ComputeCtx.model_validate_json(
        '{"compute": "bf16", "device": "cpu", "fp8": {"scaling": {"margin": 1}}}'
    )
    assert ctx.recipe == Recipe(scaling=DelayedScaling(margin=1))
    only_history = Recipe.model_validate({"scaling": {"history_len": 4}})
    assert only_history.scaling == DelayedScaling(history_len=4)
    tagged = Recipe.model_validate({"scaling": {"kind": "dynamic", "margin": 2}})
    assert tagged.scaling == DynamicScaling(margin=2)
    with pytest.raises(ValidationError, match=r"'lazy' .* expected tags: 'delayed', 'dynamic'"):
        Recipe.model_validate({"scaling": {"kind": "lazy"}})
    with pytest.raises(ValidationError, match="history_len"):  # a dynamic recipe has no window
        Recipe.model_validate({"scaling": {"kind": "dynamic", "history_len": 4}})


@pytest.mark.parametrize(
    ("data", "bad"),
    [
        ({"compute": "bf17", "device": "cpu"}, {"compute"}),
        ({"device": "cpu"}, {"compute"}),
        ({"compute": 3, "device": "cpu", "kv": "f32"}, {"compute"}),
        ({"compute": "bf17", "device": "gpu"}, {"compute", "device"}),
        ({"compute": "bf16", "device": "cpu", "kv": "f17"}, {"kv"}),
    ],
)
def test_one_error_per_bad_field_naming_it(data: dict[str, object], bad: set[str]) -> None:
    if bad == {"kv"}:  # a bad kv alone is the library's ValueError (no pydantic URL)
        with pytest.raises(ValueError, match=r"^bad ComputeCtx: kv='f17': unknown kv") as err:
            ComputeCtx.model_validate(data)
        assert not isinstance(err.value, ValidationError)
        return
    with pytest.raises(ValidationError) as caught:
        ComputeCtx.model_validate(data)
    assert caught.value.error_count() == len(bad), str(caught.value)
    assert {e["loc"][0] for e in caught.value.errors()} == bad
    text = ",".join(f"{k}={v}" for k, v in data.items())
    with pytest.raises(ValidationError) as parsed:
        ComputeCtx.parse(text)
    assert parsed.value.error_count() == len(bad), str(parsed.value)


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            "hybrid/delayed/16/max",
            [
                "margin must be an integer from 0 to 16, got 'max' in 'hybrid/delayed/16/max'",
                "did you mean 'hybrid/delayed/16/0/max'?",
                "'SCHEME[/delayed[/HISTORY[/MARGIN[/ALGO]]]]'",
            ],
        ),
        ("e4m3/dynamic/x", ["margin must be an integer from 0 to 16, got 'x'"]),
        ("hybrid/delayed/0", ["history_len=0: Input should be greater than or equal to 1"]),
        ("hybrid/delayed/16/0/median", ["algo='median': Input should be 'max' or 'most_recent'"]),
        ("hybrid/dynamic/0/max", ["too many fields", "dynamic scaling takes at most 1 (MARGIN)"]),
        ("dynamic", ["unknown fp8 scheme", "the scheme comes first, e.g. 'hybrid/dynamic'"]),
        ("hybrid/lazy", ["unknown fp8 scaling recipe 'lazy'", "accepted recipes 'delayed'"]),
    ],
)
def test_bad_fp8_text_names_the_field_and_the_form(text: str, needles: list[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(needles[0])) as caught:
        Recipe.parse(text)
    for needle in needles:
        assert needle in str(caught.value), str(caught.value)
    with pytest.raises(ValueError, match=re.escape(needles[0])):
        ComputeCtx.parse(f"compute=bf16,device=cpu,fp8={text}")


def test_granularity_defaults_follow_the_anchor_recipes() -> None:
    # Per tensor nothing changed: every existing form parses and prints as before.
    assert Recipe() == Recipe.parse("hybrid") == Recipe(granularity="tensor")
    assert str(Recipe.parse("e4m3/dynamic")) == "e4m3/dynamic/0"
    assert Recipe().model_dump(mode="json")["granularity"] == "tensor"
    # row, block, mx: E4M3 both ways, dynamic scaling; powers of two on for row and mx.
    row = Recipe(granularity="row")
    assert (row.format, row.scaling, row.power_of_two, row.gw_hp) == (
        Fp8Scheme.E4M3,
        DynamicScaling(),
        True,
        False,
    )
    assert row == Recipe.parse("row") == Recipe.parse("e4m3/row/dynamic/0")
    assert str(row) == "e4m3/row/dynamic/0"
    assert Recipe.parse("Row+GW_HP").gw_hp and str(Recipe.parse("row+gw_hp")) == (
        "e4m3/row+gw_hp/dynamic/0"
    )
    block = Recipe.parse("block")
    assert not block.power_of_two and Recipe.parse("block+pow2").power_of_two
    mx = Recipe.parse("mx")
    assert mx.power_of_two and mx.mx_rounding == "rceil" and str(mx) == "e4m3/mx/dynamic/0"
    assert Recipe.parse("mx+floor").mx_rounding == "floor"
    # Hybrid stays allowed, and an option at its default reads as the default.
    assert Recipe.parse("hybrid/row").format is Fp8Scheme.HYBRID
    assert (
        Recipe.parse("row+pow2")
        == row
        == Recipe.model_validate({"granularity": "row", "power_of_two": None})
    )
    assert Recipe.parse("mx+rceil") == mx
    ctx = ComputeCtx.parse("compute=bf16,device=cpu,fp8=row+gw_hp")
    assert str(ctx).endswith(",recipe=e4m3/row+gw_hp/dynamic/0")
    assert ComputeCtx.model_validate_json(ctx.model_dump_json()) == ctx


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("row/delayed", "delayed scaling is per-tensor only: granularity 'row'"),
        ("e5m2/block/delayed/4", "so it needs dynamic scaling, e.g. 'e5m2/block/dynamic'"),
        ("mx/delayed/16/0/max", "delayed scaling is per-tensor only"),
        ("tensor+pow2", "power_of_two applies to granularities 'row' and 'block'"),
        ("mx+no_pow2", "granularity 'mx' has E8M0 scales, always powers of two"),
        ("row+floor", "mx_rounding applies to granularity 'mx' only, not 'row'"),
        ("block+gw_hp", "gw_hp (a high-precision weight-gradient GEMM"),
        ("row+fast", "unknown fp8 granularity option 'fast'"),
        ("row+pow2+no_pow2", "power_of_two given twice"),
        ("e4m3/row/dynamic/0/1", "too many fields"),
    ],
)
def test_bad_granularity_text_names_the_rule(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        Recipe.parse(text)
    with pytest.raises(ValueError, match=re.escape(needle)):
        ComputeCtx.parse(f"compute=bf16,device=cpu,fp8={text}")


def test_a_delayed_non_tensor_policy_is_refused_when_built() -> None:
    with pytest.raises(ValidationError, match="delayed scaling is per-tensor only"):
        Recipe(granularity="row", scaling=DelayedScaling())
    with pytest.raises(ValidationError, match="delayed scaling is per-tensor only"):
        Recipe.model_validate({"granularity": "mx", "scaling": {"history_len": 4}})
    with pytest.raises(ValidationError, match="granularity"):
        Recipe(granularity="1x128")  # type: ignore[arg-type]  # a block, not a policy name


def test_rowwise_flags_mirror_torchaos_rowwise_recipes() -> None:
    row = ComputeCtx.from_flag("fp8_rowwise", "cpu")
    assert row == ComputeCtx.from_flag("fp8_e4m3_dynamic", "cpu").replace(recipe=row.fp8)
    assert row.fp8 == Recipe.parse("e4m3/row/dynamic/0") and row.fp8.power_of_two
    hp = ComputeCtx.from_flag("FP8_RowWise_GW_HP", "cpu")
    assert hp.fp8 == Recipe.parse("row+gw_hp") and hp.compute is DType.BF16


def test_the_old_name_of_the_recipe_field_still_reads() -> None:
    """0.1.0 called ``recipe`` ``fp8``: its text, JSON and keyword forms give the same value."""
    want = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    assert want.recipe is not None and want.fp8 == want.recipe
    text = str(want)
    assert ",recipe=hybrid/delayed/" in text and "fp8=" not in text
    assert ComputeCtx.parse(text.replace("recipe=", "fp8=")) == want
    data = json.loads(want.model_dump_json())
    data["fp8"] = data.pop("recipe")
    assert ComputeCtx.model_validate(data) == want
    assert ComputeCtx.model_validate_json(json.dumps(data)) == want
    plain = ComputeCtx.new(DType.BF16, "cpu")
    assert plain.replace(fp8=want.recipe) == want
    with pytest.raises(ValueError, match="'recipe' and 'fp8' both given"):
        ComputeCtx.parse(text + ",fp8=hybrid")
    with pytest.raises(ValueError, match="both 'fp8' and 'recipe'"):
        plain.replace(fp8=want.recipe, recipe=None)


# pickle.dumps(ComputeCtx.from_flag("bf16", "cpu")) and of ("fp8_hybrid", "cpu"), written by 0.1.0
# (commit 99ca679), whose field was named fp8 and whose recipe class was Fp8Policy.
OLD_PICKLE_BF16 = base64.b64decode(
    "gASV1AEAAAAAAACMDmNvbXB1dGVjdHguY3R4lIwKQ29tcHV0ZUN0eJSTlCmBlH2UKIwIX19kaWN0X1+UfZQojAdj"
    "b21wdXRllIwRY29tcHV0ZWN0eC5kdHlwZXOUjAVEVHlwZZSTlIwEYmYxNpSFlFKUjAJrdpRoDYwFYWNjdW2UaAqM"
    "A2YzMpSFlFKUjAlyZXNpZGVuY3mUjBRjb21wdXRlY3R4LnJlc2lkZW5jeZSMCVJlc2lkZW5jeZSTlIwEYXV0b5SF"
    "lFKUjAZkZXZpY2WUjAV0b3JjaJSMBmRldmljZZSTlIwDY3B1lIWUUpSMA2ZwOJROjARncmFklGgSjAZtYXN0ZXKU"
    "aBKMB29mZmxvYWSUTowLb3B0aW1fc3RhdGWUjBZjb21wdXRlY3R4Lm9wdGltX3N0YXRllIwKT3B0aW1TdGF0ZZST"
    "lCmBlH2UKGgFfZQojAZmb3JtYXSUaBCMBWJsb2NrlE6MCG1pbl9zaXpllE0AEHWMEl9fcHlkYW50aWNfZXh0cmFf"
    "X5ROjBdfX3B5ZGFudGljX2ZpZWxkc19zZXRfX5SPlIwUX19weWRhbnRpY19wcml2YXRlX1+UTnVidWgvTmgwj5Qo"
    "aA9oB2gaaCFoDpBoMk51Yi4="
)
OLD_PICKLE_FP8 = base64.b64decode(
    "gASV5gIAAAAAAACMDmNvbXB1dGVjdHguY3R4lIwKQ29tcHV0ZUN0eJSTlCmBlH2UKIwIX19kaWN0X1+UfZQojAdj"
    "b21wdXRllIwRY29tcHV0ZWN0eC5kdHlwZXOUjAVEVHlwZZSTlIwEYmYxNpSFlFKUjAJrdpRoDYwFYWNjdW2UaAqM"
    "A2YzMpSFlFKUjAlyZXNpZGVuY3mUjBRjb21wdXRlY3R4LnJlc2lkZW5jeZSMCVJlc2lkZW5jeZSTlIwEYXV0b5SF"
    "lFKUjAZkZXZpY2WUjAV0b3JjaJSMBmRldmljZZSTlIwDY3B1lIWUUpSMA2ZwOJSMEmNvbXB1dGVjdHgucmVjaXBl"
    "c5SMCUZwOFBvbGljeZSTlCmBlH2UKGgFfZQojAZmb3JtYXSUaCKMCUZwOFNjaGVtZZSTlIwGaHlicmlklIWUUpSM"
    "B3NjYWxpbmeUaCKMDkRlbGF5ZWRTY2FsaW5nlJOUKYGUfZQoaAV9lCiMBGtpbmSUjAdkZWxheWVklIwLaGlzdG9y"
    "eV9sZW6USxCMBm1hcmdpbpRLAIwEYWxnb5SMA21heJR1jBJfX3B5ZGFudGljX2V4dHJhX1+UTowXX19weWRhbnRp"
    "Y19maWVsZHNfc2V0X1+Uj5SMFF9fcHlkYW50aWNfcHJpdmF0ZV9flE51YowLZ3JhbnVsYXJpdHmUjAZ0ZW5zb3KU"
    "jAxwb3dlcl9vZl90d2+UiYwLbXhfcm91bmRpbmeUTowFZ3dfaHCUiXVoOk5oO4+UKGgoaEJoLmhAkGg9TnVijARn"
    "cmFklGgSjAZtYXN0ZXKUaBKMB29mZmxvYWSUTowLb3B0aW1fc3RhdGWUjBZjb21wdXRlY3R4Lm9wdGltX3N0YXRl"
    "lIwKT3B0aW1TdGF0ZZSTlCmBlH2UKGgFfZQoaChoEIwFYmxvY2uUTowIbWluX3NpemWUTQAQdWg6Tmg7j5RoPU51"
    "YnVoOk5oO4+UKGgPaAdoGmghaA6QaD1OdWIu"
)


def test_a_ctx_pickled_by_0_1_0_unpickles_to_an_equal_working_value() -> None:
    plain = pickle.loads(OLD_PICKLE_BF16)
    assert str(plain) == "compute=bf16,kv=bf16,accum=f32,residency=auto,device=cpu"
    assert plain == ComputeCtx.from_flag("bf16", "cpu") and plain.recipe is None
    fp8 = pickle.loads(OLD_PICKLE_FP8)
    assert fp8 == ComputeCtx.from_flag("fp8_hybrid", "cpu")
    assert ComputeCtx.model_validate_json(fp8.model_dump_json()) == fp8
    assert pickle.loads(pickle.dumps(fp8)) == fp8


def test_model_copy_reads_the_old_field_name_and_the_text_form_names_the_key_written() -> None:
    ctx = ComputeCtx.from_flag("fp8_hybrid", "cpu")
    assert ctx.model_copy(update={"fp8": None}).recipe is None
    with pytest.raises(ValueError, match="'fp8' given twice"):
        ComputeCtx.parse("compute=bf16,device=cpu,fp8=hybrid,fp8=hybrid")
    with pytest.raises(ValueError, match="'fp8' and 'recipe' both given"):
        ComputeCtx.parse("compute=bf16,device=cpu,fp8=hybrid,recipe=hybrid")
