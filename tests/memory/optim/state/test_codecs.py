"""The optimizer-state codecs: maps, round-trip bounds, blocks, parts and their checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from computectx.memory.optim.state import codecs, maps, packed
from computectx.memory.optim.state.codecs import decode, encode, from_parts, round_trip_bound
from computectx.memory.optim.state.maps import MapName, dynamic_tree_values, qmap, qmap_midpoints
from computectx.memory.optim.state.packed import Kind, Packed, packed_nbytes, part_names, parts_of
from computectx.optim_state import OptimState, StateFormat

FORMATS: tuple[StateFormat, ...] = ("bf16", "int8", "fp8", "int4")
KINDS: tuple[Kind, ...] = ("signed", "unsigned")
CASES = [(f, k) for f in FORMATS for k in KINDS]


def small(fmt: StateFormat) -> OptimState:
    """``fmt`` with blocks of 32, so that small tensors hold several blocks."""
    return OptimState(format=fmt) if fmt == "bf16" else OptimState(format=fmt, block=32)


def sample(shape: tuple[int, ...], seed: int, magnitude: float, kind: Kind) -> torch.Tensor:
    """Values spread over 8 decades below ``magnitude``, about a quarter of them zeros."""
    gen = torch.Generator().manual_seed(seed)
    spread = 10.0 ** (-8 * torch.rand(shape, generator=gen, dtype=torch.float64))
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * spread * magnitude
    x = torch.where(torch.rand(shape, generator=gen) < 0.25, 0.0, x)
    return (x.abs() if kind == "unsigned" else x).float()


shapes = st.one_of(
    st.tuples(st.integers(1, 600)),
    st.tuples(st.integers(1, 70), st.integers(1, 70)),
    st.tuples(st.integers(1, 16), st.integers(1, 16), st.integers(1, 16)),
)
magnitudes = st.sampled_from([1e-30, 1e-8, 1.0, 3e4, 1e30])
seeds = st.integers(0, 2**31 - 1)


# ----- the maps ----------------------------------------------------------------------------


def test_maps_hold_their_defining_values() -> None:
    signed8, unsigned8 = qmap("dynamic8_signed"), qmap("dynamic8_unsigned")
    signed4, linear4 = qmap("dynamic4_signed"), qmap("linear4_unsigned")
    for m in (signed8, unsigned8, signed4, linear4):
        assert m.dtype == torch.float32
        assert bool((m.diff() > 0).all())  # sorted, no duplicates
        assert float(m.max()) == 1.0
    for m in (signed8, signed4):
        assert {0.0, -1.0, 1.0} <= set(m.tolist())
        assert torch.equal(m, -m.flip(0))  # symmetric
    assert float(unsigned8.min()) == 0.0
    assert (len(signed8), len(unsigned8), len(signed4), len(linear4)) == (255, 256, 15, 16)
    assert torch.equal(linear4, torch.arange(1, 17, dtype=torch.float32) / 16)
    # Dettmers' tree: decimal exponents 10**-E for E = 0..6 (signed), fraction in (0.1, 1].
    assert float(signed8[signed8 > 0].min()) == pytest.approx(1e-6)
    assert float(unsigned8[unsigned8 > 0].min()) == pytest.approx(1e-7)
    assert dynamic_tree_values(4, signed=True)[8:] == pytest.approx(
        [0.01, 0.055, 0.1, 0.325, 0.55, 0.775, 1.0]
    )
    mids = qmap_midpoints("dynamic8_signed")
    assert bool(((mids > signed8[:-1]) & (mids < signed8[1:])).all())
    with pytest.raises(ValueError, match="unknown quantization map 'nope'"):
        qmap("nope")  # type: ignore[arg-type]


MAP_NAMES: tuple[MapName, ...] = (
    "dynamic8_signed",
    "dynamic8_unsigned",
    "dynamic4_signed",
    "linear4_unsigned",
)


def _patterns_as_f32(patterns: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in ``[0, 2**32)`` as float32, non-finite ones dropped."""
    signed = torch.where(patterns >= 2**31, patterns - 2**32, patterns)
    x = signed.to(torch.int32).view(torch.float32)
    return x[x.isfinite()]


def _search_inputs(mids: torch.Tensor, seed: int) -> torch.Tensor:
    """(a) each midpoint and the f32 patterns 1 and 2 ulps either side of it; (b) random bit
    patterns (every magnitude: subnormals to 3.4e38, both signs), random values in [-1, 1],
    both ends of every 2**16-pattern bucket, 0, -0 and the smallest subnormals."""
    inf = torch.full_like(mids, math.inf)
    up = torch.nextafter(mids, inf)
    down = torch.nextafter(mids, -inf)
    near = [mids, up, down, torch.nextafter(up, inf), torch.nextafter(down, -inf)]
    gen = torch.Generator().manual_seed(seed)
    random_bits = _patterns_as_f32(torch.randint(0, 2**32, (1 << 20,), generator=gen))
    in_range = torch.rand(1 << 18, generator=gen) * 2 - 1
    buckets = torch.arange(1 << 16, dtype=torch.int64) << 16
    edges = _patterns_as_f32(torch.cat((buckets, buckets | 0xFFFF)))
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2e-45, -2e-45, 1.1754942e-38])
    return torch.cat((*near, random_bits, in_range, edges, tiny))


@pytest.mark.parametrize("name", MAP_NAMES)
def test_table_search_gives_exactly_the_codes_of_bucketize(name: MapName) -> None:
    mids = qmap_midpoints(name)
    found = maps.nearest_table(name)
    assert found is not None  # every map passes the one-midpoint-per-bucket check
    x = _search_inputs(mids, seed=len(mids))
    expected = torch.bucketize(x, mids)  # the old way: right=False, a tie to the lower code
    assert torch.equal(packed.nearest_codes(x, *found).long(), expected)
    compiled = torch.compile(packed.nearest_codes, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, *found).long(), expected)
    # Ties: a value equal to a midpoint takes the lower code, as bucketize does.
    assert torch.equal(packed.nearest_codes(mids, *found).long(), torch.arange(len(mids)))
    # The codec's encode goes through the table and gives bucketize's codes.
    spec = packed.Spec("int8" if "8" in name else "int4", "_signed" in name, 256, False)
    spec_maps = packed.maps_for(spec, torch.device("cpu"))
    assert spec_maps.table is found.table
    n = torch.rand(4096, generator=torch.Generator().manual_seed(1)) * 2 - 1
    n = n.abs() if "unsigned" in name else n
    table_parts = packed.encode_tensors(n, spec, spec_maps)
    bucketize_parts = packed.encode_tensors(n, spec, packed.Maps(spec_maps.values, spec_maps.mids))
    assert all(torch.equal(a, b) for a, b in zip(table_parts, bucketize_parts, strict=True))


def test_table_search_refuses_midpoints_closer_than_a_bucket() -> None:
    # Two midpoints within one 2**16-pattern bucket (relative width 2**-7): no table.
    assert maps.build_table(torch.tensor([0.5, 0.501, 0.75])) is None
    assert maps.build_table(torch.tensor([0.5, 0.51, 0.75])) is not None


@pytest.mark.parametrize(
    ("name", "documented", "text"),
    [
        ("dynamic8_signed", 0.0070, "0.0070 * block absmax"),
        ("dynamic8_unsigned", 0.0035, "0.0035 * block absmax"),
        ("dynamic4_signed", 0.1125, "0.1125 * block absmax"),
        ("linear4_unsigned", 1 / 32, "``s / 32 + slack`` for n >= 1/16"),
    ],
)
def test_worst_case_column_of_the_bound_table_is_half_the_largest_gap(
    name: MapName, documented: float, text: str
) -> None:
    half_gap = float(qmap(name).diff().max()) / 2
    assert half_gap == pytest.approx(documented, rel=0.01)
    assert text in (codecs.__doc__ or "")


# ----- round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "kind"), CASES)
@settings(max_examples=20, deadline=None)
@given(shape=shapes, seed=seeds, magnitude=magnitudes)
def test_round_trip_is_within_the_bound_and_keeps_signs_and_zeros(
    fmt: StateFormat, kind: Kind, shape: tuple[int, ...], seed: int, magnitude: float
) -> None:
    state = small(fmt)
    x = sample(shape, seed, magnitude, kind)
    p = encode(x, state, kind)
    y = decode(p)
    assert y.dtype == torch.float32 and y.shape == x.shape
    err = (y.double() - x.double()).abs()
    bound = round_trip_bound(x, state, kind)
    assert bool((err <= bound.double()).all()), float((err - bound.double()).max())
    assert bool((y * x >= 0).all())  # never across zero
    if (fmt, kind) == ("int4", "unsigned"):
        # No zero in the linear map: a zero decodes to 1/16 of its scale, > 0 where s > 0
        # (the bound at x = 0 is s * (1/16 + 2**-20) + 2**-149).
        assert torch.equal(y[x == 0] > 0, bound[x == 0] > 2.0**-148)
    else:
        assert bool((y[x == 0] == 0).all())
    assert p.nbytes() == packed_nbytes(shape, state, kind)
    assert p.nbytes() == sum(t.numel() * t.element_size() for t in parts_of(p).values())


@pytest.mark.parametrize(("fmt", "kind"), CASES)
@settings(max_examples=12, deadline=None)
@given(shape=shapes, seed=seeds, magnitude=st.sampled_from([1e-20, 1.0, 1e30]))
def test_re_encoding_is_a_fixed_point(
    fmt: StateFormat, kind: Kind, shape: tuple[int, ...], seed: int, magnitude: float
) -> None:
    """encode(decode(p)) == p part by part (what a DCP reshard to the same blocks relies on)."""
    state = small(fmt)
    p = encode(sample(shape, seed, magnitude, kind), state, kind)
    again = encode(decode(p), state, kind)
    for name, part in p.parts.items():
        assert torch.equal(again.parts[name], part), name


@pytest.mark.parametrize(("fmt", "kind"), [c for c in CASES if c[0] != "bf16"])
def test_each_blocks_largest_element_decodes_exactly(fmt: StateFormat, kind: Kind) -> None:
    x = sample((5, 77), 3, 10.0, kind)
    y = decode(encode(x, small(fmt), kind))
    blocks = torch.nn.functional.pad(x.reshape(-1), (0, 13 * 32 - x.numel())).view(-1, 32)
    top = blocks.abs().argmax(dim=1) + 32 * torch.arange(blocks.shape[0])
    top = top[top < x.numel()]
    assert torch.equal(y.reshape(-1)[top], x.reshape(-1)[top])


@pytest.mark.parametrize(("fmt", "kind"), [c for c in CASES if c[0] != "bf16"])
@settings(max_examples=10, deadline=None)
@given(numel=st.integers(33, 300), seed=seeds)
def test_blocks_never_straddle(fmt: StateFormat, kind: Kind, numel: int, seed: int) -> None:
    """Changing one block's values changes no other block's codes or scale."""
    state = small(fmt)
    x = sample((numel,), seed, 1.0, kind)
    nblocks = -(-numel // 32)
    b = seed % nblocks
    changed = x.clone()
    changed[32 * b : 32 * (b + 1)] *= 1000.0
    changed[32 * b] = 7.0
    p, q = encode(x, state, kind), encode(changed, state, kind)
    others = torch.ones(nblocks, dtype=torch.bool)
    others[b] = False
    assert torch.equal(p.parts["absmax"][others], q.parts["absmax"][others])
    assert not torch.equal(p.parts["absmax"][b], q.parts["absmax"][b])
    per_byte = 2 if fmt == "int4" else 1  # an int4 byte holds two codes of one block
    owner = torch.arange(p.parts["codes"].numel()) * per_byte // 32
    keep = owner != b
    assert torch.equal(p.parts["codes"][keep], q.parts["codes"][keep])


def test_unsigned_int4_of_a_matrix_is_rank1_normalized() -> None:
    state = OptimState(format="int4", block=32)
    v = sample((64, 2, 64), 1, 1.0, "unsigned")
    p = encode(v, state, "unsigned")
    assert set(p.parts) == {"codes", "rows", "cols"} and p.block == 0
    flat = v.reshape(64, -1)
    assert torch.equal(p.parts["rows"], flat.amax(dim=1))
    assert torch.equal(p.parts["cols"], flat.amax(dim=0))
    assert p.parts["codes"].numel() == v.numel() // 2
    # A matrix whose maxima would take more room than block absmaxes uses blocks.
    assert part_names(state, "unsigned", (2, 3000)) == ("codes", "absmax")
    assert part_names(state, "unsigned", (6000,)) == ("codes", "absmax")
    assert part_names(state, "signed", (300, 300)) == ("codes", "absmax")


def test_packed_nbytes_gives_the_documented_bytes_per_element() -> None:
    n = 4096 * 4096
    assert packed_nbytes(n, OptimState(format="f32"), "signed") == 4 * n
    assert packed_nbytes(n, OptimState(format="bf16"), "signed") == 2 * n
    assert packed_nbytes(n, OptimState(format="int8"), "signed") == n + 4 * n // 256
    assert packed_nbytes(n, OptimState(format="fp8"), "unsigned") == n + 4 * n // 256
    assert packed_nbytes(n, OptimState(format="int4"), "signed") == n // 2 + 4 * n // 128
    rank1 = packed_nbytes((4096, 4096), OptimState(format="int4"), "unsigned")
    assert rank1 == n // 2 + 4 * 2 * 4096


# ----- parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "kind"), CASES)
@pytest.mark.parametrize("shape", [(70,), (5, 77), (2, 3, 4), (64, 80)])
def test_parts_round_trip_through_from_parts(
    fmt: StateFormat, kind: Kind, shape: tuple[int, ...]
) -> None:
    state = small(fmt)
    x = sample(shape, 5, 2.0, kind)
    p = encode(x, state, kind)
    parts = parts_of(p)
    assert tuple(parts) == part_names(state, kind, shape)
    assert all(parts[k] is p.parts[k] for k in parts)  # no copy
    q = from_parts(parts, shape, state, kind, "state[0]['exp_avg']")
    assert isinstance(q, Packed) and (q.format, q.kind, q.shape, q.block) == (
        p.format,
        p.kind,
        p.shape,
        p.block,
    )
    assert torch.equal(decode(q), decode(p))


def test_from_parts_refuses_bad_parts_naming_where_and_what_is_accepted() -> None:
    state = small("int8")
    p = encode(sample((100,), 0, 1.0, "signed"), state, "signed")
    good = parts_of(p)
    where = "state[3]['exp_avg']"

    def refused(parts: dict[str, object], match: str) -> None:
        with pytest.raises(ValueError, match=match) as info:
            from_parts(parts, (100,), state, "signed", where)
        assert where in str(info.value)

    refused({"codes": good["codes"]}, r"has parts \['codes'\]; accepted: exactly")
    refused({**good, "extra": good["codes"]}, "'extra'")
    refused({**good, "codes": good["codes"].int()}, "part 'codes' is torch.int32")
    refused({**good, "absmax": good["absmax"][:2]}, r"accepted: torch.float32\[4\]")
    refused({**good, "absmax": "1.0"}, "must be a tensor, got str")
    refused({**good, "absmax": -good["absmax"] - 1}, "negative or non-finite scales")
    bad = good["codes"].clone()
    bad[0] = 255
    refused({**good, "codes": bad}, "code 255; the int8 signed map has codes 0..254")
    four = small("int4")
    q = parts_of(encode(sample((64,), 0, 1.0, "signed"), four, "signed"))
    q["codes"] = q["codes"] | 0xF0
    with pytest.raises(ValueError, match=r"code 15; the int4 signed map has codes 0\.\.14"):
        from_parts(q, (64,), four, "signed", where)
    f8 = parts_of(encode(sample((64,), 0, 1.0, "signed"), small("fp8"), "signed"))
    f8["codes"] = f8["codes"].clone().fill_(0x7F)
    with pytest.raises(ValueError, match="NaN codes"):
        from_parts(f8, (64,), small("fp8"), "signed", where)


def test_encode_and_decode_refuse_bad_input() -> None:
    int8 = OptimState(format="int8")
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\)"):
        encode(torch.tensor([1.0, math.inf]), int8, "signed")
    with pytest.raises(ValueError, match="negative value"):
        encode(torch.tensor([1.0, -1.0]), int8, "unsigned")
    with pytest.raises(ValueError, match=r"1 NaN value\(s\)"):
        encode(torch.tensor([1.0, math.nan]), int8, "signed", saturate=True)
    # A finite value beyond bf16's range saturates (round to nearest would give inf).
    big = decode(encode(torch.tensor([3.4e38, -3.4e38]), OptimState(format="bf16"), "signed"))
    assert big.tolist() == [torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max]
    with pytest.raises(ValueError, match="'f32' is not packed"):
        encode(torch.ones(3), OptimState(), "signed")
    with pytest.raises(ValueError, match="floating tensor"):
        encode(torch.ones(3, dtype=torch.int64), int8, "signed")
    with pytest.raises(ValueError, match="kind='both' is not a state kind"):
        encode(torch.ones(3), int8, "both")  # type: ignore[arg-type]
    p = encode(torch.ones(3, 4), int8, "signed")
    with pytest.raises(ValueError, match=r"out must be float32 of shape \[3, 4\]"):
        decode(p, out=torch.empty(12))
    out = torch.empty(3, 4)
    assert decode(p, out=out) is out and torch.equal(out, torch.ones(3, 4))


def test_round_trip_bound_of_f32_is_zero_and_empty_tensors_encode() -> None:
    assert torch.equal(round_trip_bound(torch.ones(3), OptimState(), "signed"), torch.zeros(3))
    for fmt in FORMATS:
        p = encode(torch.empty(0, 5), small(fmt), "unsigned")
        assert decode(p).shape == (0, 5) and p.nbytes() == 0


@pytest.mark.parametrize(("fmt", "kind"), [c for c in CASES if c != ("int4", "unsigned")])
def test_shards_split_at_a_block_boundary_merge_exactly(fmt: StateFormat, kind: Kind) -> None:
    """A reshard 2 -> 1 whose shard sizes are whole blocks re-forms the blocks exactly."""
    state = small(fmt)
    x = sample((10, 48), 8, 1.0, kind)  # two shards of 5 rows: 240 elements, 7.5 blocks
    halves = [encode(h, state, kind) for h in (x[:4], x[4:])]  # 192 = 6 blocks, then 288
    merged = encode(torch.cat([decode(h) for h in halves]), state, kind)
    for name, part in merged.parts.items():
        want = torch.cat([h.parts[name].reshape(-1) for h in halves])
        assert torch.equal(part.reshape(-1), want), name
    # Split elsewhere, the merged blocks are new: one more rounding, within the bound of the
    # shards' layout plus the bound of the new layout.
    shards = (x[:5], x[5:])
    y = torch.cat([decode(encode(h, state, kind)) for h in shards])
    err = (decode(encode(y, state, kind)).double() - x.double()).abs()
    first = torch.cat([round_trip_bound(h, state, kind) for h in shards]).double()
    assert bool((err <= first + round_trip_bound(y, state, kind).double()).all())
