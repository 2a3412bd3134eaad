"""The dtype lattice, fp8 format constants and the minimal casts (the Rust unit tests and more)."""

from __future__ import annotations

import itertools

import pytest
import torch

from computectx import DType, Fp8Format, PromotionError, cast_if, dtype_of, promote, promoted

F16, BF16, F32, F64 = DType.F16, DType.BF16, DType.F32, DType.F64


# The join written out by hand, as JAX pins its observed promotion table: rows and columns in
# the order F16, BF16, F32, F64. A change to the lattice data must change this table too.
PROMOTION_TABLE = """
        f16   bf16  f32   f64
  f16   f16   f32   f32   f64
  bf16  f32   bf16  f32   f64
  f32   f32   f32   f32   f64
  f64   f64   f64   f64   f64
"""


def test_promotion_table_is_the_literal_one() -> None:
    header, *rows = (line.split() for line in PROMOTION_TABLE.strip().splitlines())
    assert [DType.parse(n) for n in header] == list(DType)
    observed = {
        (DType.parse(row[0]), DType.parse(col)): DType.parse(cell)
        for row in rows
        for col, cell in zip(header, row[1:], strict=True)
    }
    assert len(observed) == 16
    for (a, b), expected in observed.items():
        assert promote(a, b) is expected, (a, b)


def test_golden_table_equals_torch_promote_types() -> None:
    # The published table we pin against: torch's own promotion on the four float dtypes.
    for a, b in itertools.product(DType, repeat=2):
        assert promote(a, b).torch == torch.promote_types(a.torch, b.torch), (a, b)


def test_joins_from_the_rust_design() -> None:
    assert promote(BF16, F32) is F32
    assert promote(F16, F32) is F32
    assert promote(F16, BF16) is F32  # same width, incomparable: neither holds the other
    assert promote(F32, F64) is F64
    assert promote(BF16, BF16) is BF16
    assert promote(promote(BF16, F16), F32) is promote(BF16, promote(F16, F32))


def test_order_is_the_lattice_order() -> None:
    assert F16 <= F32 and BF16 <= F32 and F32 <= F64 and F16 <= F64
    assert not F16 <= BF16 and not BF16 <= F16
    assert F16 < F32 and not F32 < F32 and F64 > BF16 and F32 >= F32
    with pytest.raises(TypeError):
        _ = F16 <= "f32"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("f32", F32), ("fp32", F32), ("float32", F32), ("float", F32), ("FP32", F32),
        ("bf16", BF16), ("bfloat16", BF16),
        ("f16", F16), ("fp16", F16), ("half", F16), ("float16", F16),
        ("f64", F64), ("fp64", F64), ("float64", F64), ("double", F64), (" bf16 ", BF16),
    ],
)  # fmt: skip
def test_parse_accepts_names_and_aliases(text: str, expected: DType) -> None:
    assert DType.parse(text) is expected


def test_name_round_trip_and_torch_dtypes() -> None:
    for d in DType:
        assert DType.parse(str(d)) is d
        assert DType.parse(d.torch) is d
        assert DType.parse(d) is d
        assert d.bits == torch.finfo(d.torch).bits


@pytest.mark.parametrize("bad", ["f8", "int8", "", "bf16 x", "float8_e4m3fn"])
def test_parse_rejects_unknown_names_listing_spellings(bad: str) -> None:
    with pytest.raises(ValueError, match="accepted") as info:
        DType.parse(bad)
    assert repr(bad) in str(info.value)
    assert "'bfloat16'" in str(info.value)


@pytest.mark.parametrize("bad", [torch.int32, torch.bool, torch.complex64, torch.uint8])
def test_parse_rejects_dtypes_outside_the_lattice(bad: torch.dtype) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        DType.parse(bad)


@pytest.mark.parametrize("bad", [torch.float8_e4m3fn, torch.float8_e5m2, Fp8Format.E4M3])
def test_parse_rejects_fp8_and_says_to_dequantize(bad: object) -> None:
    with pytest.raises(ValueError, match="Dequantize it through its scale"):
        DType.parse(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [3, None, 1.5])
def test_parse_rejects_other_types(bad: object) -> None:
    with pytest.raises(ValueError, match="cannot read a dtype"):
        DType.parse(bad)  # type: ignore[arg-type]


def test_fp8_constants_match_torch() -> None:
    for fmt in Fp8Format:
        info = torch.finfo(fmt.torch)
        assert fmt.max == info.max
        assert fmt.min_normal == info.smallest_normal
        assert 2.0**-fmt.mantissa_bits == info.eps
        assert fmt.exponent_bits + fmt.mantissa_bits == 7
        # The smallest positive code (bit pattern 0x01) is the smallest subnormal.
        smallest = torch.tensor([1], dtype=torch.uint8).view(fmt.torch).float().item()
        assert smallest == fmt.min_subnormal
        assert Fp8Format.parse(fmt.torch) is fmt
        assert Fp8Format.parse(str(fmt)) is fmt
        assert Fp8Format.parse(f"fp8_{fmt}") is fmt
    assert Fp8Format.E4M3.max == 448.0 and Fp8Format.E5M2.max == 57344.0
    with pytest.raises(ValueError, match="accepted: 'e4m3'"):
        Fp8Format.parse("e3m4")
    with pytest.raises(ValueError, match="accepted"):
        Fp8Format.parse(torch.bfloat16)


@pytest.mark.parametrize(
    "bad", [Fp8Format.E4M3, torch.float32, "f32", None], ids=["fp8", "torch", "str", "none"]
)
def test_promote_rejects_non_members(bad: object) -> None:
    with pytest.raises(PromotionError, match="promote takes two DType values"):
        promote(F32, bad)  # type: ignore[arg-type]
    with pytest.raises(PromotionError):
        promote(bad, F32)  # type: ignore[arg-type]


def test_promote_on_fp8_names_the_fix() -> None:
    with pytest.raises(PromotionError, match="dequantize_tensor"):
        promote(Fp8Format.E5M2, BF16)  # type: ignore[arg-type]


def test_cast_if_returns_the_same_object_at_the_target() -> None:
    t = torch.zeros(3, dtype=torch.bfloat16)
    assert cast_if(t, BF16) is t
    up = cast_if(t, F32)
    assert up.dtype == torch.float32 and up is not t


@pytest.mark.parametrize(
    "dt", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.bool, torch.complex64]
)
def test_cast_if_never_casts_outside_the_lattice(dt: torch.dtype) -> None:
    t = torch.zeros(3, dtype=dt)
    with pytest.raises(PromotionError, match=str(dt)):
        cast_if(t, F32)
    with pytest.raises(PromotionError):
        dtype_of(t)


def test_cast_if_rejects_a_non_dtype_target() -> None:
    t = torch.zeros(3)
    with pytest.raises(PromotionError, match="DType target"):
        cast_if(t, torch.float16)  # type: ignore[arg-type]
    with pytest.raises(PromotionError, match="fp8 storage format"):
        cast_if(t, Fp8Format.E4M3)  # type: ignore[arg-type]


def test_promoted_only_casts_the_lower_operand() -> None:
    a = torch.zeros(2, 2, dtype=torch.bfloat16)
    b = torch.zeros(2, 2, dtype=torch.float32)
    a2, b2 = promoted(a, b)
    assert a2.dtype == torch.float32 and a2 is not a
    assert b2 is b
    h = torch.zeros(2, dtype=torch.float16)
    h2, a3 = promoted(h, a)  # incomparable: both lift to F32
    assert h2.dtype == a3.dtype == torch.float32
    same1, same2 = promoted(a, a)
    assert same1 is a and same2 is a


def test_promoted_rejects_fp8_tensors() -> None:
    q = torch.zeros(2, dtype=torch.float8_e4m3fn)
    with pytest.raises(PromotionError, match="Dequantize"):
        promoted(q, torch.zeros(2))
