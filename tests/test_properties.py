"""Laws, representability, numerical bounds and round trips, checked with hypothesis."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import pickle
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from computectx import ComputeCtx, DType, Fp8Format, KvFp8, OptimState, Residency, promote
from computectx.activations import (
    ACTIVATION_KINDS,
    GROUPS,
    KIND_MODES,
    Activations,
    parse_activations,
)
from computectx.ctx import DTYPE_FLAGS
from computectx.formats import DelayedScaling, DynamicScaling, Fp8Scheme, Recipe
from computectx.formats.numerics.kv_quant import dequantize_kv, quantize_kv
from computectx.fp4_recipe import FP4_FORMATS, WGRAD_SIGNS, Fp4Recipe, parse_recipe
from computectx.kv_policy import KV_SCALINGS, KV_STEPS, parse_kv
from computectx.optim_state import (
    DEFAULT_BLOCK,
    DEFAULT_MIN_SIZE,
    OPTIM_STATE_FLAGS,
    parse_optim_state,
)
from computectx.recipes import POLICY_GRANULARITIES, parse_scaling

ALL = list(DType)

# ----- lattice laws, over every element (exhaustive: the lattice is small) ------------------


def test_join_is_idempotent_commutative_associative() -> None:
    for a in ALL:
        assert promote(a, a) is a
    for a, b in itertools.product(ALL, repeat=2):
        assert promote(a, b) is promote(b, a)
    for a, b, c in itertools.product(ALL, repeat=3):
        assert promote(promote(a, b), c) is promote(a, promote(b, c))


def test_join_is_the_least_upper_bound() -> None:
    for a, b in itertools.product(ALL, repeat=2):
        j = promote(a, b)
        assert a <= j and b <= j
        for u in ALL:  # every upper bound of both sits at or above the join
            if a <= u and b <= u:
                assert j <= u, (a, b, u)


def test_order_agrees_with_join() -> None:
    for a, b in itertools.product(ALL, repeat=2):
        assert (a <= b) == (promote(a, b) is b)


# ----- representability: the join never loses a value ---------------------------------------

_SIGNED = {16: torch.int16, 32: torch.int32, 64: torch.int64}


def _from_bits(bits: np.ndarray, d: DType) -> torch.Tensor:
    signed = torch.from_numpy(bits.view(f"int{d.bits}").copy())
    assert signed.dtype == _SIGNED[d.bits]
    return signed.view(d.torch)


def _roundtrip_exact(values: torch.Tensor, d: DType) -> None:
    finite = values[torch.isfinite(values)]
    for b in ALL:
        j = promote(d, b)
        back = finite.to(j.torch).to(d.torch)
        # Bitwise: -0.0 and subnormals must survive too.
        assert torch.equal(back.view(_SIGNED[d.bits]), finite.view(_SIGNED[d.bits])), (d, b)


@pytest.mark.parametrize("d", [DType.F16, DType.BF16])
def test_every_16_bit_value_survives_the_join(d: DType) -> None:
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    _roundtrip_exact(_from_bits(every, d), d)


@given(
    d=st.sampled_from([DType.F32, DType.F64]),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
@settings(max_examples=30)
def test_random_wide_values_survive_the_join(d: DType, seed: int) -> None:
    rng = np.random.default_rng(seed)
    # Uniform random bit patterns: every sign, exponent (subnormals, inf, NaN) and mantissa.
    bits = np.frombuffer(rng.bytes(4096 * d.bits // 8), dtype=f"uint{d.bits}")
    _roundtrip_exact(_from_bits(bits, d), d)


# ----- precise: bounded error, and the reason it exists -------------------------------------

_EPS = 1e-6


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _EPS)


def softmax(x: torch.Tensor) -> torch.Tensor:
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"rms_norm": rms_norm, "softmax": softmax}


def _ulps_off(out: torch.Tensor, ref64: torch.Tensor, d: DType) -> float:
    """Largest error of ``out`` in units of the compute dtype's spacing at the reference value.

    One ulp at ``r`` is ``2**(floor(log2|r|) - mantissa_bits)``, floored at the smallest
    subnormal spacing so values near zero are measured on the dtype's real grid.
    """
    info = torch.finfo(d.torch)
    mant = round(-math.log2(info.eps))
    r = ref64.abs().clamp_min(info.smallest_normal)
    ulp = torch.exp2(torch.floor(torch.log2(r)) - mant)
    return float(((out.double() - ref64).abs() / ulp).max())


@given(
    d=st.sampled_from([DType.BF16, DType.F16]),
    op=st.sampled_from(sorted(OPS)),
    rows=st.integers(1, 4),
    cols=st.integers(1, 512),
    log_scale=st.floats(-4, 4),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60)
def test_precise_is_within_one_ulp_of_float64(
    d: DType, op: str, rows: int, cols: int, log_scale: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 10**log_scale).to(d.torch)
    f = OPS[op]
    ctx = ComputeCtx.new(d, "cpu")
    out = ctx.precise(x, f)
    assert out.dtype == d.torch
    ref = f(x.double())  # the exact op on the very same low-precision input
    # fp32 evaluation error is ~1e-6 relative, far below half a bf16/f16 ulp, so the only
    # visible error is the final rounding to the compute dtype: at most one ulp.
    assert _ulps_off(out, ref, d) <= 1.0


@pytest.mark.parametrize(
    ("d", "op", "scale", "cols"),
    [
        (DType.F16, "rms_norm", 400.0, 64),  # x² overflows f16's 65504: naive gives 0
        (DType.BF16, "rms_norm", 3.0, 4096),  # long rows: rounding piles up
        (DType.BF16, "softmax", 8.0, 4096),
        (DType.F16, "softmax", 8.0, 4096),
    ],
)
def test_naive_low_precision_is_worse_than_precise(
    d: DType, op: str, scale: float, cols: int
) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, cols, generator=g, dtype=torch.float64) * scale).to(d.torch)
    f = OPS[op]
    ref = f(x.double())
    precise_err = _ulps_off(ComputeCtx.new(d, "cpu").precise(x, f), ref, d)
    naive = f(x)  # the very same code, run in the low dtype
    naive_err = _ulps_off(naive, ref, d) if torch.isfinite(naive).all() else math.inf
    assert precise_err <= 1.0
    assert naive_err > 1.0 and naive_err > 2 * precise_err, (naive_err, precise_err)


# ----- residency laws ------------------------------------------------------------------------

sizes = st.integers(min_value=0, max_value=2**62)


@given(model=sizes, avail=sizes)
def test_auto_resolves_by_fit(model: int, avail: int) -> None:
    got = Residency.AUTO.resolve(model, avail)
    assert got is (Residency.DEVICE if model <= avail else Residency.MMAP)
    assert Residency.DEVICE.resolve(model, avail) is Residency.DEVICE
    assert Residency.MMAP.resolve(model, avail) is Residency.MMAP
    # Monotone: more room never moves a model off the device.
    if got is Residency.DEVICE:
        assert Residency.AUTO.resolve(model, avail + 1) is Residency.DEVICE


@given(
    r=st.sampled_from(list(Residency)), neg=st.integers(max_value=-1), ok=sizes, first=st.booleans()
)
def test_negative_sizes_raise(r: Residency, neg: int, ok: int, first: bool) -> None:
    args = (neg, ok) if first else (ok, neg)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        r.resolve(*args)


# ----- text and JSON round trips, and bad strings ---------------------------------------------


_DYNAMIC = st.builds(DynamicScaling, margin=st.integers(0, 16))


@st.composite
def fp8_policies(draw: st.DrawFn) -> Recipe:
    """Every fp8 policy: per tensor (delayed or dynamic), or row, block, mx (dynamic) with
    every option that applies, each option given or left to its default (None)."""
    fmt = draw(st.sampled_from(list(Fp8Scheme)))
    granularity = draw(st.sampled_from(list(POLICY_GRANULARITIES)))
    if granularity == "tensor":
        delayed = st.builds(
            DelayedScaling,
            history_len=st.integers(1, 1024),
            margin=st.integers(0, 16),
            algo=st.sampled_from(["max", "most_recent"]),
        )
        return Recipe(format=fmt, scaling=draw(st.one_of(delayed, _DYNAMIC)))
    options: dict[str, object] = {}
    if granularity == "row":
        options["gw_hp"] = draw(st.booleans())
    if granularity in ("row", "block"):
        options["power_of_two"] = draw(st.sampled_from([None, True, False]))
    if granularity == "mx":
        options["mx_rounding"] = draw(st.sampled_from([None, "rceil", "floor"]))
    # The finer granularities take no margin (refused: see the tests below).
    fields = {"format": fmt, "scaling": DynamicScaling(), "granularity": granularity}
    return Recipe.model_validate(fields | options)


_PATTERNS = st.lists(st.text(alphabet="abcxyz019_.*?[]!-", min_size=1, max_size=8), max_size=3)


@st.composite
def fp4_recipes(draw: st.DrawFn) -> Fp4Recipe:
    """Every 4-bit recipe: each format with every option that applies, each given or left to the
    format's default (None), a seed where stochastic rounding is on, layers kept high."""
    fmt = draw(st.sampled_from(FP4_FORMATS))
    fields: dict[str, object] = {"format": fmt}
    fields["stochastic"] = draw(st.sampled_from([None, True, False]))
    fields["hadamard"] = draw(st.sampled_from([None, True, False]))
    if fmt == "nvfp4":
        fields["weight_tile"] = draw(st.sampled_from([None, "16x16", "1x16"]))
    else:
        fields["mx_rounding"] = draw(st.sampled_from([None, "rceil", "floor"]))
    if fields["stochastic"] or (fields["stochastic"] is None and fmt == "nvfp4"):
        fields["seed"] = draw(st.sampled_from([0, 2**64 - 1]) | st.integers(0, 2**64 - 1))
    fields["hp_last"] = draw(st.integers(0, 4096))
    fields["hp"] = draw(_PATTERNS)
    return Fp4Recipe.model_validate(fields)


kv_fp8s = st.builds(
    KvFp8,
    format=st.sampled_from(list(Fp8Format)),
    scaling=st.sampled_from(KV_SCALINGS),
    step=st.sampled_from(KV_STEPS),
    recent=st.integers(0, 4096),
)
"""Every fp8 KV cache setting."""


@st.composite
def optim_states(draw: st.DrawFn) -> OptimState:
    """Every optimizer-state setting: each format, its block given (every power of two the
    policy accepts) or left to the default, and min_size where the format has one."""
    fmt = draw(st.sampled_from(OPTIM_STATE_FLAGS))
    fields: dict[str, object] = {"format": fmt}
    if fmt in DEFAULT_BLOCK:
        fields["block"] = draw(st.sampled_from([None, *(2**k for k in range(5, 13))]))
    if fmt != "f32":
        fields["min_size"] = draw(st.sampled_from([DEFAULT_MIN_SIZE, 0]) | st.integers(0, 2**40))
    return OptimState.model_validate(fields)


@st.composite
def activation_policies(draw: st.DrawFn) -> Activations:
    """Every activations setting: each kind in each mode it accepts (most often all alike, as
    the bare text form says it), with any group and any checkpoint rule."""
    common = draw(st.sampled_from(["keep", "fp8", "offload"]))
    modes = {k: draw(st.sampled_from([common, *KIND_MODES[k]])) for k in ACTIVATION_KINDS}
    count = st.integers(1, 64).map(str)
    rule = st.sampled_from(["none", "all"]) | st.builds(
        "{}:{}".format, st.sampled_from(["every", "first", "last"]), count
    )
    listed = st.lists(st.integers(0, 99).map(str), min_size=1, max_size=4).map("+".join)
    checkpoint = draw(rule | listed.map("blocks:{}".format))
    return Activations(**modes, group=draw(st.sampled_from(GROUPS)), checkpoint=checkpoint)


@st.composite
def contexts(draw: st.DrawFn) -> ComputeCtx:
    compute = draw(st.sampled_from(ALL))
    policy: Recipe | Fp4Recipe | None = draw(st.one_of(st.none(), fp8_policies(), fp4_recipes()))
    devices = st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:3", "meta"]).map(torch.device)
    return ComputeCtx(
        compute=compute,
        kv=draw(st.one_of(st.sampled_from(ALL), kv_fp8s)),
        accum=draw(st.sampled_from([d for d in ALL if compute <= d])),
        residency=draw(st.sampled_from(list(Residency))),
        device=draw(devices),
        recipe=policy,
        grad=draw(st.sampled_from(ALL)),
        master=draw(st.sampled_from(ALL)),
        offload=draw(st.one_of(st.none(), devices)),
        optim_state=draw(optim_states()),
        activations=draw(activation_policies()),
    )


def check_text_round_trip(ctx: ComputeCtx) -> None:
    assert ComputeCtx.parse(str(ctx)) == ctx


def check_json_round_trip(ctx: ComputeCtx) -> None:
    assert ComputeCtx.model_validate_json(ctx.model_dump_json()) == ctx
    assert ComputeCtx.model_validate(ctx.model_dump()) == ctx


_alphabet = st.sampled_from(list("=,/:;+_ abcdefghklmnoprtuvwx01236")) | st.characters()


@given(text=st.text(alphabet=_alphabet, max_size=60))
def test_bad_strings_raise_only_documented_errors(text: str) -> None:
    with contextlib.suppress(ValueError):  # pydantic's ValidationError is a ValueError too
        ComputeCtx.parse(text)
    parsers = (DType.parse, Residency.parse, Recipe.parse, Fp4Recipe.parse, parse_recipe)
    parsers2 = (parse_scaling, KvFp8.parse, OptimState.parse, parse_optim_state, parse_activations)
    for parse in (*parsers, *parsers2):
        with contextlib.suppress(ValueError):
            parse(text)
    with contextlib.suppress(ValueError):
        parse_kv(text)


@given(
    key=st.sampled_from(["compute", "kv", "accum", "grad", "master"]),
    value=st.text(alphabet=st.characters(blacklist_characters=","), max_size=12),
)
@example(key="accum", value="f16")
@example(key="kv", value=" Half ")
@example(key="kv", value="E5m2/Per_Head")
@example(key="kv", value="e4m3/per_row")
@example(key="grad", value="e4m3")
def test_mutated_dtype_values_are_quoted_or_accepted(key: str, value: str) -> None:
    base = {"compute": "bf16", "device": "cpu", key: value}
    text = ",".join(f"{k}={v}" for k, v in base.items())
    # kv also reads an fp8 cache's text form; every other key reads dtypes only.
    read: Callable[[str], object] = parse_kv if key == "kv" else DType.parse
    try:
        ctx = ComputeCtx.parse(text)
    except ValueError as e:
        try:
            d = read(value)
        except ValueError:  # not a dtype (nor an fp8 cache for kv) at all: the message quotes it
            assert repr(value.strip()) in str(e), str(e)
        else:  # a real dtype can only break the order rule accum >= compute
            assert key == "accum" and f"accum={d} is not at or above compute=bf16" in str(e)
    else:  # accepted only when the value really is a spelling of that field
        assert getattr(ctx, key) == read(value)


# ----- one spelling per idea: any case, optional tags, scaling text, one error per field ---------


def _mangle(text: str, flips: list[bool]) -> str:
    return "".join(c.swapcase() if f else c for c, f in zip(text, flips, strict=True))


def _flips(data: st.DataObject, n: int) -> list[bool]:
    """``n`` coin flips, drawn as the bits of ``ceil(n / 8)`` bytes: as evenly spread over
    the text as ``n`` drawn booleans (about half of them set, the last characters as often
    as the first), at a seventh of their data-generation time."""
    raw = data.draw(st.binary(min_size=(n + 7) // 8, max_size=(n + 7) // 8))
    bits = int.from_bytes(raw, "little")
    return [bool(bits >> i & 1) for i in range(n)]


def _mangle_values(value: object, data: st.DataObject) -> object:
    """Every string value (never a key) of a JSON document with its case flipped at random."""
    if isinstance(value, str):
        flips = _flips(data, len(value))
        return _mangle(value, flips)
    if isinstance(value, dict):
        return {k: _mangle_values(v, data) for k, v in value.items()}
    return value


def check_every_text_field_reads_in_any_case(
    ctx: ComputeCtx, flag: str, data: st.DataObject
) -> None:
    text = str(ctx)
    flips = _flips(data, len(text))
    assert ComputeCtx.parse(_mangle(text, flips)) == ctx
    assert ComputeCtx.model_validate(_mangle_values(ctx.model_dump(mode="json"), data)) == ctx
    mangled = _mangle_values(flag, data)
    assert isinstance(mangled, str)
    assert ComputeCtx.from_flag(mangled, "cpu") == ComputeCtx.from_flag(flag, "cpu")


def check_scaling_text_and_untagged_json_round_trip(ctx: ComputeCtx) -> None:
    if not isinstance(ctx.recipe, Recipe):  # none, or a 4-bit recipe (no scaling part)
        return
    scaling = ctx.recipe.scaling
    assert parse_scaling(str(scaling)) == scaling
    fields = ctx.recipe.model_dump(mode="json") | {"scaling": str(scaling)}
    assert Recipe.model_validate(fields) == ctx.recipe
    dumped = ctx.model_dump(mode="json")
    if isinstance(scaling, DelayedScaling):  # the default recipe needs no tag
        del dumped["recipe"]["scaling"]["kind"]
    assert ComputeCtx.model_validate(dumped) == ctx


# Every law about a whole ComputeCtx is checked on the same drawn ctx: drawing one (every
# field, each nested policy) costs most of an example, and the seven checks are cheap beside
# it. Each check still sees `max_examples` contexts; a failure names the check that failed
# (the traceback's frame) and hypothesis shrinks the ctx for it.
@given(
    ctx=contexts(),
    flag=st.sampled_from(DTYPE_FLAGS),
    state=optim_states(),
    kv=st.one_of(st.sampled_from(ALL), kv_fp8s),
    policy=activation_policies(),
    data=st.data(),
)
def test_every_ctx_round_trips_in_any_case_and_each_with_changes_only_its_field(
    ctx: ComputeCtx,
    flag: str,
    state: OptimState,
    kv: DType | KvFp8,
    policy: Activations,
    data: st.DataObject,
) -> None:
    check_text_round_trip(ctx)
    check_json_round_trip(ctx)
    check_every_text_field_reads_in_any_case(ctx, flag, data)
    check_scaling_text_and_untagged_json_round_trip(ctx)
    check_with_optim_state_changes_only_it_and_round_trips(ctx, state)
    check_with_kv_changes_only_kv_and_round_trips(ctx, kv)
    check_with_activations_changes_only_it_and_round_trips(ctx, policy)


_BAD_VALUES = {
    "compute": "bf17",
    "kv": "e4m3/per_row",
    "accum": "f33",
    "residency": "ram",
    "device": "gpu",
    "recipe": "hybrid/delayed/16/max",
    "grad": "int8",
    "master": "fp4",
    "offload": "tpu0",
    "optim_state": "int8/block=100",
    "activations": "linear:recompute",
}


@given(bad=st.sets(st.sampled_from(sorted(_BAD_VALUES)), min_size=1))
def test_each_bad_field_is_one_error_naming_it(bad: set[str]) -> None:
    data = {"compute": "bf16", "device": "cpu"} | {k: _BAD_VALUES[k] for k in bad}
    text = ",".join(f"{k}={v}" for k, v in data.items())
    if bad <= {"kv", "optim_state", "activations"}:  # the nested policy values alone: ours
        calls: list[Callable[[], object]] = [
            lambda: ComputeCtx.model_validate(data),
            lambda: ComputeCtx.parse(text),
        ]
        for call in calls:
            with pytest.raises(ValueError, match=r"^bad ComputeCtx: ") as ours:
                call()
            assert not isinstance(ours.value, ValidationError), str(ours.value)
            assert all(f"{k}=" in str(ours.value) for k in bad), str(ours.value)
            assert "http" not in str(ours.value)
        return
    with pytest.raises(ValidationError) as validated:
        ComputeCtx.model_validate(data)
    with pytest.raises(ValidationError) as parsed:
        ComputeCtx.parse(text)
    for caught in (validated, parsed):
        assert {e["loc"][0] for e in caught.value.errors()} == bad, str(caught.value)
        assert caught.value.error_count() == len(bad), str(caught.value)


@given(policy=fp8_policies())
def test_fp8_policy_text_and_json_round_trip(policy: Recipe) -> None:
    text = str(policy)
    assert Recipe.parse(text) == policy
    assert Recipe.parse(text.upper()) == policy
    assert Recipe.model_validate_json(policy.model_dump_json()) == policy
    assert str(Recipe.parse(text)) == text
    if policy.granularity == "tensor":  # the forms that existed before granularity
        assert "/" + policy.granularity not in text
        assert Recipe(format=policy.format, scaling=policy.scaling) == policy
    else:  # the scheme before a granularity may be left out when it is the default
        default = text.removeprefix("e4m3/")
        assert Recipe.parse(default) == policy
        assert (default != text) is (policy.format is Fp8Scheme.E4M3)


@given(policy=fp8_policies(), history=st.integers(1, 1024))
def test_delayed_scaling_is_refused_for_every_granularity_but_tensor(
    policy: Recipe, history: int
) -> None:
    fields = policy.model_dump() | {"scaling": DelayedScaling(history_len=history)}
    if policy.granularity == "tensor":
        assert Recipe.model_validate(fields).scaling.kind == "delayed"
        return
    with pytest.raises(ValidationError, match="delayed scaling is per-tensor only"):
        Recipe.model_validate(fields)
    text = str(policy).replace(f"/{policy.scaling}", f"/delayed/{history}")
    with pytest.raises(ValueError, match="delayed scaling is per-tensor only"):
        Recipe.parse(text)


@given(policy=fp8_policies(), margin=st.integers(1, 16))
def test_a_margin_is_refused_for_every_granularity_but_tensor(policy: Recipe, margin: int) -> None:
    # Python, JSON (tagged, and untagged: a scaling dict without kind is the granularity's
    # recipe) and text all agree: per tensor the margin is the step's headroom; row, block
    # and mx take each step from the block's current amax and refuse one, naming the rule.
    dumped = policy.model_dump(mode="json")
    tagged = dumped | {"scaling": {"kind": "dynamic", "margin": margin}}
    untagged = dumped | {"scaling": {"margin": margin}}
    if policy.granularity == "tensor":
        got = Recipe.model_validate(tagged)
        assert got.scaling == DynamicScaling(margin=margin)
        assert Recipe.model_validate(untagged).scaling.margin == margin
        assert Recipe.parse(str(got)) == got
        return
    text = str(policy).replace("/dynamic/0", f"/dynamic/{margin}")
    rule = f"margin={margin} applies to per-tensor scaling only"
    for form in (tagged, untagged):
        with pytest.raises(ValidationError, match=re.escape(rule)):
            Recipe.model_validate(form)
        with pytest.raises(ValidationError, match=re.escape(rule)):
            Recipe.model_validate_json(json.dumps(form))
    with pytest.raises(ValueError, match=re.escape(rule)):
        Recipe.parse(text)
    with pytest.raises(ValueError, match=re.escape(rule)):
        ComputeCtx.parse(f"compute=bf16,device=cpu,recipe={text}")
    # Without a margin the untagged dict is the granularity's own recipe, dynamic.
    assert Recipe.model_validate(dumped | {"scaling": {}}) == policy


_NOT_BOOLS = st.one_of(
    st.sampled_from(["yes", "no", "true", "false", "on", "off", "1", "0", "", "t"]),
    st.integers(-2, 2),
    st.floats(allow_nan=False),
    st.lists(st.booleans(), max_size=1),
)


@given(policy=fp8_policies(), field=st.sampled_from(["power_of_two", "gw_hp"]), bad=_NOT_BOOLS)
def test_boolean_fields_are_strict_and_null_is_the_default(
    policy: Recipe, field: str, bad: object
) -> None:
    # pydantic's lax mode reads "yes", "off", 1 or 0.0 as booleans; the policy does not.
    dumped = policy.model_dump(mode="json")
    for read in (
        lambda d: Recipe.model_validate(d),
        lambda d: Recipe.model_validate_json(json.dumps(d)),
        lambda d: ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "recipe": d}),
    ):
        with pytest.raises(ValidationError, match="must be a boolean") as caught:
            read(dumped | {field: bad})
        assert caught.value.errors()[0]["loc"][-1] == field, str(caught.value)
        assert repr(bad) in str(caught.value), str(caught.value)
        # null (None) is the granularity's default, for every option.
        null = dumped | {"power_of_two": None, "gw_hp": None, "mx_rounding": None}
        default = Recipe(format=policy.format, granularity=policy.granularity)
        got = read(null)
        assert (got.recipe if isinstance(got, ComputeCtx) else got) == default.model_copy(
            update={"scaling": policy.scaling}
        )


@given(
    field=st.sampled_from(["history_len", "margin"]),
    bad=st.one_of(st.booleans(), st.sampled_from(["16", "1", " 2"]), st.floats(0, 16)),
)
def test_integer_fields_are_strict(field: str, bad: object) -> None:
    # A True margin is not 1 and "16" is not 16: JSON numbers only (the text form converts
    # its own digits).
    with pytest.raises(ValidationError, match="must be an integer") as caught:
        Recipe.model_validate_json(json.dumps({"scaling": {field: bad}}))
    assert caught.value.errors()[0]["loc"][-1] == field, str(caught.value)


@settings(max_examples=40)  # every option is drawn independently: 40 cover them, in 1 s
@given(recipe=fp4_recipes(), data=st.data())
def test_fp4_recipe_text_json_and_pickle_round_trip_in_any_case(
    recipe: Fp4Recipe, data: st.DataObject
) -> None:
    text = str(recipe)
    assert Fp4Recipe.parse(text) == recipe == parse_recipe(text)
    assert str(Fp4Recipe.parse(text)) == text
    flips = _flips(data, len(text))
    assert parse_recipe(_mangle(text, flips)) == recipe
    parts = text.split("+")  # the options read in any order
    assert Fp4Recipe.parse("+".join([parts[0], *reversed(parts[1:])])) == recipe
    assert Fp4Recipe.model_validate_json(recipe.model_dump_json()) == recipe
    assert pickle.loads(pickle.dumps(recipe)) == recipe
    dumped = recipe.model_dump(mode="json")
    assert dumped["hadamard_signs"] == list(WGRAD_SIGNS)  # recorded, always
    ctx = ComputeCtx.new(DType.BF16, "cpu").replace(recipe=recipe)
    assert ComputeCtx.model_validate_json(ctx.model_dump_json()).recipe == recipe
    assert ComputeCtx.model_validate(_mangle_values(ctx.model_dump(mode="json"), data)) == ctx
    assert pickle.loads(pickle.dumps(ctx)) == ctx
    # null is the format's default for every option the format has.
    nulls = {"stochastic": None, "hadamard": None, "weight_tile": None, "mx_rounding": None}
    got = Fp4Recipe.model_validate(dumped | nulls | {"seed": 0})
    assert got == Fp4Recipe(format=recipe.format, hp_last=recipe.hp_last, hp=recipe.hp)


@given(
    recipe=fp4_recipes(),
    field=st.sampled_from(["stochastic", "hadamard", "seed", "hp_last"]),
    bad=_NOT_BOOLS,
)
def test_fp4_booleans_and_integers_are_strict(recipe: Fp4Recipe, field: str, bad: object) -> None:
    integer = field in ("seed", "hp_last")
    if integer and isinstance(bad, int) and not isinstance(bad, bool):
        return  # an integer is an integer (its bounds are the field's own)
    dumped = recipe.model_dump(mode="json")
    for read in (
        lambda d: Fp4Recipe.model_validate(d),
        lambda d: Fp4Recipe.model_validate_json(json.dumps(d)),
        lambda d: ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "recipe": d}),
    ):
        want = "must be an integer" if integer else "must be a boolean"
        with pytest.raises(ValidationError, match=want) as caught:
            read(dumped | {field: bad})
        assert caught.value.errors()[0]["loc"][-1] == field, str(caught.value)


# ----- how optimizer state is stored ------------------------------------------------------------


@given(state=optim_states(), data=st.data())
def test_optim_state_text_and_json_round_trip_in_any_case(
    state: OptimState, data: st.DataObject
) -> None:
    text = str(state)
    assert OptimState.parse(text) == state == parse_optim_state(text)
    assert str(OptimState.parse(text)) == text
    flips = _flips(data, len(text))
    assert OptimState.parse(_mangle(text, flips)) == state
    assert OptimState.model_validate_json(state.model_dump_json()) == state
    assert parse_optim_state(state.model_dump(mode="json")) == state
    assert OptimState.model_validate(_mangle_values(state.model_dump(mode="json"), data)) == state
    # The parts after the format read in any order, the default block spelled out or not.
    parts = text.split("/")
    assert OptimState.parse("/".join([parts[0], *reversed(parts[1:])])) == state
    if state.quantized:
        assert OptimState.parse(f"{state.format}/block={state.block_size}/min={state.min_size}")
        assert state.block_size == (state.block or 0) > 0
        assert (state.block == DEFAULT_BLOCK[state.format]) is ("block=" not in text)
    else:
        assert state.block is None and state.block_size == 0 and "block=" not in text
    assert state.compact is (state.format != "f32")
    assert (state.min_size == DEFAULT_MIN_SIZE) is ("min=" not in text)


def check_with_optim_state_changes_only_it_and_round_trips(
    ctx: ComputeCtx, state: OptimState
) -> None:
    for given_as in (state, str(state)):
        changed = ctx.with_optim_state(given_as)
        assert changed.optim_state == state
        assert changed.replace(optim_state=ctx.optim_state) == ctx
        assert ComputeCtx.parse(str(changed)) == changed
        assert ComputeCtx.model_validate_json(changed.model_dump_json()) == changed
        # Shown in the text form only when it is not the default, f32.
        assert (f",optim_state={state}" in str(changed)) is state.compact


_NOT_INTEGERS = st.one_of(
    st.booleans(), st.sampled_from(["256", "64", " 0", ""]), st.floats(0, 4096), st.none()
)


@given(
    field=st.sampled_from(["block", "min_size"]),
    fmt=st.sampled_from(sorted(DEFAULT_BLOCK)),
    bad=_NOT_INTEGERS,
)
def test_optim_state_integer_fields_are_strict(field: str, fmt: str, bad: object) -> None:
    # A True block is not 1 and "256" is not 256: JSON numbers only (the text form converts
    # its own digits). null is the default block, and no min_size.
    fields = {"format": fmt, field: bad}
    if bad is None and field == "block":
        assert OptimState.model_validate(fields).block == DEFAULT_BLOCK[fmt]
        return
    # Our ValueError naming the field (not pydantic's, with its URL); inside a ComputeCtx,
    # the policy's error at the optim_state field with the same message.
    with pytest.raises(ValueError, match=f"{field} must be an integer") as caught:
        OptimState.model_validate_json(json.dumps(fields))
    assert not isinstance(caught.value, ValidationError)
    with pytest.raises(ValueError, match=f"{field} must be an integer") as nested:
        ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "optim_state": fields})
    assert not isinstance(nested.value, ValidationError)
    assert str(nested.value).startswith("bad ComputeCtx: optim_state="), str(nested.value)


@given(
    fmt=st.sampled_from(OPTIM_STATE_FLAGS),
    block=st.integers(-(2**13), 2**13),
    min_size=st.integers(-(2**20), 2**20),
)
@example(fmt="int8", block=100, min_size=0)
@example(fmt="bf16", block=64, min_size=0)
@example(fmt="f32", block=256, min_size=4096)
@example(fmt="f32", block=32, min_size=-1)
@example(fmt="int8", block=32, min_size=0)
@example(fmt="int4", block=8192, min_size=4096)
def test_optim_state_accepts_exactly_its_documented_values(
    fmt: str, block: int, min_size: int
) -> None:
    text = f"{fmt}/block={block}/min={min_size}"
    in_range = 32 <= block <= 4096 and block & (block - 1) == 0
    fields = {"format": fmt, "block": block, "min_size": min_size}
    # Each field's own rule first; the rules between fields only for values that pass them.
    if not in_range or min_size < 0:
        reasons = [f"block={block} is not a power of two from 32 to 4096"] * (not in_range)
        reasons += [f"min_size={min_size} is negative; accepted: an integer >= 0"] * (min_size < 0)
    elif fmt not in DEFAULT_BLOCK:
        reasons = [f"block={block} given for format {fmt}, which has no blocks"]
    else:
        state = OptimState.parse(text)
        assert (state.format, state.block, state.min_size) == (fmt, block, min_size)
        assert OptimState.model_validate(fields) == state
        return
    with pytest.raises(ValueError, match="bad optimizer state") as caught:
        OptimState.parse(text)
    with pytest.raises(ValueError, match="bad OptimState") as validated:
        OptimState.model_validate(fields)
    # The error names each refused value and what is accepted.
    for message in (str(caught.value), str(validated.value)):
        for reason in reasons:
            assert reason in message, message


@given(min_size=st.integers(-(2**20), 2**20).filter(lambda m: m != DEFAULT_MIN_SIZE))
def test_f32_state_takes_no_min_size(min_size: int) -> None:
    rule = f"min_size={min_size} given for format f32" if min_size >= 0 else "is negative"
    with pytest.raises(ValueError, match=rule):
        OptimState.parse(f"f32/min={min_size}")
    assert OptimState.parse(f"bf16/min={max(min_size, 0)}").min_size == max(min_size, 0)


# ----- the fp8 KV cache setting ----------------------------------------------------------------


@given(kv=kv_fp8s, data=st.data())
def test_kv_fp8_text_and_json_round_trip(kv: KvFp8, data: st.DataObject) -> None:
    text = str(kv)
    assert KvFp8.parse(text) == kv == parse_kv(text)
    flips = _flips(data, len(text))
    assert KvFp8.parse(_mangle(text, flips)) == kv
    assert KvFp8.model_validate_json(kv.model_dump_json()) == kv
    assert KvFp8.model_validate(kv.model_dump()) == kv
    if kv.scaling == "per_token_head" and kv.step == "f32" and kv.recent == 0:
        # The defaults (scaling, step, window) may be left out.
        assert KvFp8.parse(str(kv.format)) == kv == parse_kv(kv.format.torch)
    # An fp8 cache never reads as a lattice dtype.
    with pytest.raises(ValueError, match="unknown dtype"):
        DType.parse(text)


def check_with_kv_changes_only_kv_and_round_trips(ctx: ComputeCtx, kv: DType | KvFp8) -> None:
    changed = ctx.with_kv(kv)
    assert changed.kv == kv
    assert changed.replace(kv=ctx.kv) == ctx
    assert ComputeCtx.parse(str(changed)) == changed
    assert ComputeCtx.model_validate_json(changed.model_dump_json()) == changed
    assert f"kv={kv}," in str(changed)


@given(
    fmt=st.sampled_from(list(Fp8Format)),
    log_scale=st.floats(-30, 30),
    t=st.integers(1, 6),
    d=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60)
def test_kv_quantize_round_trip_is_within_half_a_code_step(
    fmt: Fp8Format, log_scale: float, t: int, d: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, t, d, generator=g) * 2.0**log_scale
    codes, step = quantize_kv(x, fmt)
    assert bool((torch.isfinite(step) & (step > 0)).all())
    back = dequantize_kv(codes, step)
    # fp8 rounding: half an ulp relative in the normal range, half the smallest subnormal
    # times the step below it; the float32 division and product add a few float32 ulps.
    half_ulp = x.abs() * 2.0 ** -(fmt.mantissa_bits + 1)
    floor = step.unsqueeze(-1) * fmt.min_subnormal / 2
    bound = torch.maximum(half_ulp, floor) * (1 + 2.0**-20) + x.abs() * 2.0**-22
    assert bool(((back - x).abs() <= bound).all())


# ----- how the backward keeps activations -------------------------------------------------------


@given(policy=activation_policies(), data=st.data())
def test_activations_text_and_json_round_trip_in_any_case(
    policy: Activations, data: st.DataObject
) -> None:
    text = str(policy)
    assert Activations.parse(text) == policy == parse_activations(text)
    assert str(Activations.parse(text)) == text
    flips = _flips(data, len(text))
    assert Activations.parse(_mangle(text, flips)) == policy
    assert Activations.model_validate_json(policy.model_dump_json()) == policy
    assert parse_activations(policy.model_dump(mode="json")) == policy
    assert (
        Activations.model_validate(_mangle_values(policy.model_dump(mode="json"), data)) == policy
    )
    # The parts read in any order; every kind spelled out is the same value.
    parts = text.split("/")
    shuffled = data.draw(st.permutations(parts))
    assert Activations.parse("/".join(shuffled)) == policy
    every = "/".join(f"{k}:{policy.mode(k)}" for k in ACTIVATION_KINDS)
    rest = f"/group={policy.group}/checkpoint={policy.checkpoint}"
    assert Activations.parse(f"{every}{rest}") == policy
    # The shortest form: never longer than every kind spelled out, "keep" only for the default.
    assert len(text) <= len(every) + len(rest)
    assert (text == "keep") is (policy.default and policy.group == 128)


def check_with_activations_changes_only_it_and_round_trips(
    ctx: ComputeCtx, policy: Activations
) -> None:
    for given_as in (policy, str(policy)):
        changed = ctx.with_activations(given_as)
        assert changed.activations == policy
        assert changed.replace(activations=ctx.activations) == ctx
        assert ComputeCtx.parse(str(changed)) == changed
        assert ComputeCtx.model_validate_json(changed.model_dump_json()) == changed
        # Shown in the text form only when it is not the default.
        assert (f",activations={policy}" in str(changed)) is (policy != Activations())


@given(
    kind=st.sampled_from(ACTIVATION_KINDS),
    bad=st.one_of(st.text(max_size=12), st.integers(), st.booleans(), st.none()),
)
def test_a_bad_mode_is_one_error_naming_the_kind_and_the_modes(kind: str, bad: object) -> None:
    if isinstance(bad, str) and bad.strip().lower() in KIND_MODES[kind]:  # type: ignore[index]
        return
    with pytest.raises(ValueError, match=f"{kind}=") as caught:
        Activations.model_validate({kind: bad})
    assert not isinstance(caught.value, ValidationError)
    assert "accepted" in str(caught.value) and "keep" in str(caught.value)
    with pytest.raises(ValueError, match=f"{kind}=") as nested:
        ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "activations": {kind: bad}})
    assert not isinstance(nested.value, ValidationError)
