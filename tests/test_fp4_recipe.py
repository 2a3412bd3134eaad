"""Fp4Recipe: NVFP4 and MXFP4 as recipes of the policy: defaults, text and JSON forms, the flags,
the layers kept high, bad input, and the fp8 entry points refusing a 4-bit recipe."""

from __future__ import annotations

import json
import pickle
import re

import pytest
from pydantic import ValidationError

from computectx import ComputeCtx, DType
from computectx.ctx import DTYPE_FLAGS
from computectx.demo.settings import DemoSettings
from computectx.formats import (
    Fp4Recipe,
    QuantizedLinear,
    Recipe,
    autocast,
)
from computectx.formats.numerics import e2m1
from computectx.fp4_recipe import WGRAD_SIGNS, parse_recipe

NVFP4 = Fp4Recipe()
MXFP4 = Fp4Recipe(format="mxfp4")


def test_defaults_are_transformer_engines_nvfp4_and_ocps_mxfp4() -> None:
    assert (NVFP4.format, NVFP4.weight_tile, NVFP4.mx_rounding) == ("nvfp4", "16x16", None)
    assert NVFP4.stochastic and NVFP4.hadamard and NVFP4.block == 16
    assert (MXFP4.weight_tile, MXFP4.mx_rounding, MXFP4.block) == (None, "rceil", 32)
    assert not MXFP4.stochastic and not MXFP4.hadamard
    for r in (NVFP4, MXFP4):
        assert r.hadamard_signs == WGRAD_SIGNS and (r.seed, r.hp_last, r.hp) == (0, 0, ())
    # The sign vector has one home, the core; the twin reads it from there.
    assert e2m1.WGRAD_SIGNS is WGRAD_SIGNS
    assert len(WGRAD_SIGNS) == 16 and set(WGRAD_SIGNS) == {1, -1}


@pytest.mark.parametrize(
    ("text", "want", "canonical"),
    [
        ("nvfp4", NVFP4, "nvfp4"),
        ("NVFP4+W1x16+No_SR", Fp4Recipe(weight_tile="1x16", stochastic=False), "nvfp4+w1x16+no_sr"),
        ("nvfp4+no_rht+w16x16+sr", Fp4Recipe(hadamard=False), "nvfp4+no_rht"),
        ("mxfp4+floor", Fp4Recipe(format="mxfp4", mx_rounding="floor"), "mxfp4+floor"),
        ("mxfp4+rceil+no_sr", MXFP4, "mxfp4"),
        (
            "mxfp4+rht+sr+seed=7",
            Fp4Recipe(format="mxfp4", hadamard=True, stochastic=True, seed=7),
            "mxfp4+sr+rht+seed=7",
        ),
        (
            "nvfp4+hp=Lm_Head+hp_last=2+hp=*.attn.*",
            Fp4Recipe(hp_last=2, hp=("*.attn.*", "lm_head")),
            "nvfp4+hp_last=2+hp=*.attn.*+hp=lm_head",
        ),
    ],
)
def test_text_forms_read_and_write(text: str, want: Fp4Recipe, canonical: str) -> None:
    assert Fp4Recipe.parse(text) == want == parse_recipe(text)
    assert str(want) == canonical and Fp4Recipe.parse(canonical) == want
    ctx = ComputeCtx.parse(f"compute=bf16,device=cpu,recipe={text}")
    assert ctx.recipe == want and str(ctx).endswith(f",recipe={canonical}")
    assert ComputeCtx.parse(str(ctx)) == ctx
    assert ComputeCtx.model_validate_json(ctx.model_dump_json()) == ctx
    assert pickle.loads(pickle.dumps(ctx)) == ctx


def test_json_records_every_field_and_the_format_picks_the_recipe() -> None:
    data = json.loads(NVFP4.model_dump_json())
    assert data == {
        "format": "nvfp4",
        "weight_tile": "16x16",
        "mx_rounding": None,
        "stochastic": True,
        "hadamard": True,
        "hadamard_signs": list(WGRAD_SIGNS),
        "seed": 0,
        "hp_last": 0,
        "hp": [],
    }
    base = {"compute": "bf16", "device": "cpu"}
    assert ComputeCtx.model_validate(base | {"recipe": {"format": "MXFP4"}}).recipe == MXFP4
    assert ComputeCtx.model_validate(base | {"recipe": {}}).recipe == Recipe()  # fp8's default
    got = ComputeCtx.model_validate(base | {"recipe": {"format": "e4m3"}}).recipe
    assert isinstance(got, Recipe)
    # 0.1.0's key reads a 4-bit recipe too.
    assert ComputeCtx.model_validate(base | {"fp8": "nvfp4"}).recipe == NVFP4


def test_flags_name_the_4_bit_recipes_at_bf16() -> None:
    assert DTYPE_FLAGS[-2:] == ("nvfp4", "mxfp4")
    nv, mx = ComputeCtx.from_flag("NVFP4", "cpu"), ComputeCtx.from_flag("mxfp4", "cpu")
    assert nv == ComputeCtx.new(DType.BF16, "cpu").replace(recipe=NVFP4)
    assert mx.recipe == MXFP4 and mx.compute is DType.BF16
    assert str(nv) == "compute=bf16,kv=bf16,accum=f32,residency=auto,device=cpu,recipe=nvfp4"


def test_layers_kept_high_by_pattern_or_final_blocks() -> None:
    r = Fp4Recipe(hp_last=2, hp=("*.attn.*",))
    assert r.keeps_high("blocks.0.Attn.q") and not r.keeps_high("blocks.0.mlp.up", 0, 4)
    assert r.keeps_high("blocks.2.mlp.up", 2, 4) and r.keeps_high("blocks.3.mlp.up", 3, 4)
    assert not NVFP4.keeps_high("blocks.3.mlp.up", 3, 4)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("nvfp4/dynamic", "a 4-bit recipe has no scaling part, got 'nvfp4/dynamic'"),
        ("nvfp4+floor", "mx_rounding='floor' applies to format 'mxfp4' only"),
        ("mxfp4+w1x16", "weight_tile='1x16' applies to format 'nvfp4' only"),
        ("nvfp4+no_sr+seed=3", "seed=3 keys stochastic rounding, which is off"),
        ("nvfp4+fast", "unknown 4-bit option 'fast' in 'nvfp4+fast'; form 'nvfp4[+OPTION...]'"),
        ("nvfp4+sr+no_sr", "stochastic given twice in 'nvfp4+sr+no_sr'"),
        ("nvfp4+seed=x", "seed='x' in 'nvfp4+seed=x' is not an integer"),
        ("nvfp4+seed=-1", "seed=-1: Input should be greater than or equal to 0"),
        ("nvfp4+hp_last=5000", "hp_last=5000: Input should be less than or equal to 4096"),
        ("nvfp4+hp=a/b", "no scaling part"),
        ("nvfp4+hp=", "bad module-name pattern ''"),
        ("nvfp4+", "unknown 4-bit option ''"),
    ],
)
def test_bad_text_names_the_value_and_the_form(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        Fp4Recipe.parse(text)
    with pytest.raises(ValueError, match=re.escape(needle)):
        ComputeCtx.parse(f"compute=bf16,device=cpu,recipe={text}")


def test_bad_values_name_what_is_accepted() -> None:
    with pytest.raises(ValueError, match=r"unknown fp8 scheme in 'int4'.*or a 4-bit recipe"):
        parse_recipe("int4")
    with pytest.raises(ValidationError, match="sign vector is fixed to TransformerEngine's"):
        Fp4Recipe.model_validate({"hadamard_signs": [1] * 16})
    with pytest.raises(ValidationError, match="format"):
        Fp4Recipe.model_validate({"format": "fp4"})
    with pytest.raises(ValidationError, match="extra_forbidden"):
        Fp4Recipe.model_validate({"granularity": "row"})
    with pytest.raises(ValidationError, match=r"recipe must be a Recipe .fp8., an Fp4Recipe"):
        ComputeCtx.model_validate({"compute": "bf16", "device": "cpu", "recipe": 4})
    with pytest.raises(ValidationError, match=r"bad module-name pattern 'a,b'"):
        Fp4Recipe(hp=("a,b",))


def test_fp8_entry_points_refuse_a_4_bit_recipe_and_never_run_fp8() -> None:
    # convert_to_quantized converts to Fp4Linear (tests/formats/linear/test_fp4.py).
    ctx = ComputeCtx.from_flag("nvfp4", "cpu")
    for call in (
        lambda: QuantizedLinear(16, 16, ctx=ctx),
        lambda: autocast(ctx),
    ):
        with pytest.raises(
            NotImplementedError, match=r"4-bit recipe 'nvfp4'.* fp8 never runs in their place"
        ):
            call()
    # The demo trains the 4-bit rows, with --moe (Fp4Experts) and --nproc (parallelize) too.
    assert DemoSettings(dtypes=("bf16", "mxfp4")).dtypes == ("bf16", "mxfp4")
    assert DemoSettings(dtypes=("bf16", "mxfp4"), moe=True).moe
    assert DemoSettings(dtypes=("nvfp4",), nproc=2, batch_size=8).nproc == 2
