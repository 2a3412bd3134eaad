"""Compact optimizer state (``ctx.optim_state``) on 2 gloo ranks: DDP, FSDP2 and DCP 2 <-> 1.

Three launches (rank processes are the cost): one process runs every reference and saves a
checkpoint; two ranks run DDP, FSDP2, parallelize and DCP (save, resume, load the one
process's); one process loads the two ranks' checkpoint. The gradients are exact
(``scenarios_optim_state``'s docstring says how), so the claims are bitwise wherever both
sides quantize the same elements together:

- DDP: every rank's bf16 masters (stochastic rounding) and packed parts are identical, and
  identical to one process on the whole batch; no step and no ``state_dict`` adds a
  collective (rank 0 takes both state dicts alone).
- FSDP2: each rank's blocks (and ``int4``'s rank-1 row and column scales) are its shard's:
  its state equals, bit for bit, that of one process whose weights are split at the shard
  boundaries into separate parameters.
- ``parallelize`` (both strategies) steps exactly as the hand-built DDP and FSDP2 runs.
- DCP (``int8`` and ``int4``): the checkpoint holds decoded float32 state; a load re-forms
  the saved codes exactly where the loading blocks are the saving ones (same world size;
  shards of whole blocks), and elsewhere re-encodes the decoded values: the loaded parts are
  exactly ``encode(saved)``, within ``round_trip_bound(saved)`` of it (the stated conversion
  bound, one round trip); training on from there stays within Adam's step bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from computectx.memory.optim.state import encode, kind_of, parts_of, round_trip_bound
from computectx.optim_state import OptimState

from . import scenarios_optim_state as so
from .conftest import RunRanks

Result = dict[str, Any]
LIMIT_S = 60.0  # per launch; the collectives time out after 30 s (worker.py)


def test_compact_state_on_two_ranks_ddp_fsdp2_and_dcp(run_ranks: RunRanks, tmp_path: Path) -> None:
    one_path, two_path = str(tmp_path / "one"), str(tmp_path / "two")
    (one,) = run_ranks(
        "scenarios_optim_state.py:one_process", world_size=1, limit_s=LIMIT_S, path=one_path
    )
    r0, r1 = run_ranks(
        "scenarios_optim_state.py:two_ranks", limit_s=LIMIT_S, path=two_path, other=one_path
    )
    (back,) = run_ranks(
        "scenarios_optim_state.py:load_in_one_process",
        world_size=1,
        limit_s=LIMIT_S,
        other=two_path,
    )
    for fmt in so.DDP_FORMATS:
        check_ddp(fmt, *(_under(r, f"ddp/{fmt}/") for r in (r0, r1, one)))
    for fmt in so.FSDP_FORMATS:
        check_fsdp(fmt, *(_under(r, f"fsdp/{fmt}/") for r in (r0, r1, one)))
    # parallelize wires the same runs: DDP (with its gradient accumulator) and FSDP2.
    fmt = so.DDP_FORMATS[0]
    for r in (r0, r1):
        for strategy in ("ddp", "fsdp"):
            got = _snap(_under(r, f"parallelize/{strategy}/"))
            assert_same(got, _snap(_under(r, f"{strategy}/{fmt}/")), f"parallelize {strategy}")
    for fmt in so.DCP_ALIGNED:
        check_dcp(fmt, *(_under(r, f"dcp/{fmt}/") for r in (r0, r1, one, back)))
    check_dcp_files(f"{two_path}-int8")
    check_one_rank_faults(r0, r1)


def check_one_rank_faults(r0: Result, r1: Result) -> None:
    """State bad on rank 1 only: every rank raises the same error naming rank 1, at once,
    before any rank changes anything (a step: DDP replicas or FSDP2 shards would part ways;
    a load under FSDP2); then the group trains on."""
    cases = {
        "ddp/step": ("Parallel.step", "['step'] is -1.0"),
        "fsdp/step": ("Parallel.step", "['step'] is -1.0"),
        "fsdp/load": ("Parallel.load_state_dict", "['step'] is nan"),
    }
    for case, (call, why) in cases.items():
        for r in (r0, r1):
            got = r[f"faults/{case}"]
            assert got["error"].startswith(f"ValueError: {call} failed on rank(s) 1 of the"), (
                case,
                got["error"],
            )
            assert why in got["error"], (case, got["error"])
            assert got["s"] < 5.0, (case, got["s"])
            assert not got["changed"], case
    assert r0["faults/fsdp/one_group"]  # the optimizer's reductions ride on step's one join
    for a, b in zip(r0["faults/ddp/trained_on"], r1["faults/ddp/trained_on"], strict=True):
        assert torch.equal(a, b)


def _under(r: Result, prefix: str) -> Result:
    return {k[len(prefix) :]: v for k, v in r.items() if k.startswith(prefix)}


def _group(r: Result, kind: str) -> dict[str, Any]:
    """``parts``, ``masters`` or ``decoded`` entries of a snapshot, by the rest of the key."""
    return _under(r, f"{kind}/")


def assert_same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(a)} != {sorted(b)}"
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), f"{what}/{key}"


def _snap(r: Result) -> dict[str, Any]:
    """Every tensor of a snapshot (parts as this rank holds them, masters and decoded whole)."""
    return {k: v for k, v in r.items() if isinstance(v, torch.Tensor)}


# ----- DDP ---------------------------------------------------------------------------------


def check_ddp(fmt: str, r0: Result, r1: Result, one: Result) -> None:
    # The state is packed (codes and scales for the weights; the bias, under min, float32),
    # the masters bf16, the format in both state dict forms.
    parts = _group(r0, "parts")
    assert parts["a_w/exp_avg.codes"].dtype == torch.uint8, fmt
    assert parts["c_w/exp_avg_sq.codes"].dtype == torch.uint8, fmt
    assert parts["a_b/exp_avg"].dtype == torch.float32 and "a_w/exp_avg" not in parts, fmt
    assert all(m.dtype == torch.bfloat16 for m in _group(r0, "masters").values()), fmt
    assert r0["optim_state"] == r0["form_optim_state"] == fmt
    # Every rank holds the same bits: masters (stochastic rounding drew the same numbers),
    # packed parts, decoded state; and so does one process on the whole batch.
    assert_same(_snap(r0), _snap(r1), f"ddp {fmt}: rank 0 against rank 1")
    assert_same(_snap(r0), _snap(one), f"ddp {fmt}: 2 ranks against one process")
    # No collective of the optimizer's in a step; state_dict() on rank 0 alone needs none.
    for r in (r0, r1):
        assert r["step_collectives"] == [], fmt
    assert r0["rank0_alone"] == [], fmt


# ----- FSDP2 -------------------------------------------------------------------------------


def check_fsdp(fmt: str, r0: Result, r1: Result, one: Result) -> None:
    state = OptimState.parse(fmt)
    for rank, r in enumerate((r0, r1)):
        # Masters and state are this rank's shard of every weight (rows split 32/32, 40/40).
        assert r["local_shapes"] == {
            "a_w": [32, 16],
            "a_b": [32],
            "b_w": [32, 16],
            "c_w": [40, 16],
            "d_w": [48, 128],
        }
        parts = _group(r, "parts")
        # Blocks sit inside the shard: c_w's 640 elements take their own blocks (the whole
        # 80 x 16 would take ceil(1280 / block)), and int4's rank-1 second moment has one
        # scale per local row.
        blocks = -(-640 // state.block_size)
        assert parts["c_w/exp_avg.absmax"].numel() == blocks, fmt
        assert parts["c_w/exp_avg_sq.absmax"].numel() == blocks, fmt
        if state.format == "int4":
            assert parts["d_w/exp_avg_sq.rows"].numel() == 48, fmt
            assert parts["d_w/exp_avg_sq.cols"].numel() == 128, fmt
        # ... and equal, bit for bit, those of one process whose weights are the shards:
        # piece `rank` of each weight, a parameter of its own.
        pieces = {
            k.replace(f"_{rank}/", "/"): v
            for k, v in _group(one, "parts").items()
            if k.split("/")[0].endswith(f"_{rank}")
        }
        assert_same(parts, pieces, f"fsdp {fmt}: rank {rank}'s parts against piece {rank}")
    # Gathered whole, masters and decoded state are the pieces side by side, on every rank.
    for kind in ("masters", "decoded"):
        whole = _group(r0, kind)
        assert_same(whole, _group(r1, kind), f"fsdp {fmt}: {kind}, rank 0 against rank 1")
        pieces = _group(one, kind)
        for key, value in whole.items():
            fqn, _, rest = key.partition("/")
            if value.dim() == 0:  # step: one number
                assert torch.equal(value, pieces[f"{fqn}_0/{rest}".rstrip("/")]), key
                continue
            joined = torch.cat([pieces[f"{fqn}_{k}/{rest}".rstrip("/")] for k in range(2)])
            assert torch.equal(value, joined), f"fsdp {fmt}: {kind}/{key}"
    assert r0["rank0_alone"] == [], fmt  # the rank-0 rule holds under FSDP2 too


# ----- DCP ---------------------------------------------------------------------------------


def check_dcp(fmt: str, r0: Result, r1: Result, one: Result, back: Result) -> None:
    state, aligned = OptimState.parse(fmt), so.DCP_ALIGNED[fmt]
    # The same format loads without a conversion warning, at any world size.
    for r in (one, r0, r1):
        assert r["resume_warnings"] == [], fmt
    for r in (r0, r1, back):
        assert r["from_other/warnings"] == [], fmt
    # Same world size: what loads is what was saved, every part bit for bit (decode, then
    # encode with the same blocks, re-forms the codes), and training on equals the
    # uninterrupted run.
    for r, who in ((one, "1 -> 1"), (r0, "2 -> 2, rank 0"), (r1, "2 -> 2, rank 1")):
        assert_same(_snap(r["resumed_loaded"]), _snap(r["saved"]), f"{fmt} {who}, loaded")
        assert_same(_snap(r["resumed"]), _snap(r["uninterrupted"]), f"{fmt} {who}, trained")
    # Both ranks gather the same whole state.
    for phase in ("saved", "uninterrupted", "from_other/loaded", "from_other/continued"):
        a, b = _phase(r0, phase), _phase(r1, phase)
        for kind in ("masters", "decoded"):
            assert_same(_group(a, kind), _group(b, kind), f"{fmt} {phase}: {kind}, ranks")
    # Another world size: 2 -> 1 and 1 -> 2.
    loaded = [r0["from_other/loaded"], r1["from_other/loaded"]]
    check_resharded(state, aligned, [r0["saved"], r1["saved"]], [back["from_other/loaded"]])
    check_resharded(state, aligned, [one["saved"]], loaded)
    # Trained on at the other world size: the weights whose shards are whole blocks go on
    # bit for bit as the uninterrupted run (masters and state). The others, re-encoded on
    # load, train on from a state within one round trip of the saved one; an Adam step
    # moves a weight by at most lr (1 - beta1) / sqrt(1 - beta2) = 3.2 lr (Kingma and Ba,
    # 2.1), so the two runs' masters, equal at the load, part by at most twice that a step
    # (observed after 2 steps: int8 c_w 4.8e-4, int4 d_w 3.6e-3, against 0.126).
    for a, b, who in (
        (back["from_other/continued"], r0["uninterrupted"], "2 -> 1"),
        (r0["from_other/continued"], one["uninterrupted"], "1 -> 2"),
    ):
        for kind in ("masters", "decoded"):
            got, ref = _group(a, kind), _group(b, kind)
            assert got.keys() == ref.keys()
            for key in got:
                fqn = key.split("/")[0]
                if fqn in aligned:
                    assert torch.equal(got[key], ref[key]), f"{fmt} {who}: {kind}/{key}"
                elif kind == "masters":
                    err = float((got[key] - ref[key]).abs().max())
                    step = 0.1 / 0.001**0.5 * so.LR
                    assert err <= 2 * step * so.AFTER, f"{fmt} {who}: {key} {err}"


def _phase(r: Result, phase: str) -> Result:
    value = r[phase] if phase in r else _under(r, f"{phase}/")
    assert isinstance(value, dict)
    return value


def check_resharded(
    state: OptimState, aligned: tuple[str, ...], saved: list[Result], loaded: list[Result]
) -> None:
    """What ``loaded`` (each loading rank's snapshot) holds after loading what ``saved`` (each
    saving rank's) saved: masters exactly; every packed state exactly ``encode`` of the
    loading rank's rows of the saved (decoded) values, so within ``round_trip_bound`` of
    them; where the shards hold whole blocks (``aligned``), the saved parts themselves."""
    who = f"{len(saved)} -> {len(loaded)}"
    whole_saved = _group(saved[0], "decoded")
    saved_parts = [_group(s, "parts") for s in saved]
    for rank, got in enumerate(loaded):
        assert_same(_group(got, "masters"), _group(saved[0], "masters"), f"{who}, masters")
        decoded = _group(got, "decoded")
        assert decoded.keys() == whole_saved.keys()
        parts = _group(got, "parts")
        for key, value in decoded.items():
            fqn, _, name = key.partition("/")
            if value.dim() == 0 or f"{fqn}/{name}" in parts:  # a scalar, or kept float32
                assert torch.equal(value, whole_saved[key]), f"{who}: decoded/{key}"
                continue
            own = whole_saved[key].chunk(len(loaded))[rank].contiguous()
            packed = parts_of(encode(own, state, kind_of(name)))
            got_parts = {k.split(".", 1)[1]: v for k, v in parts.items() if k.startswith(f"{key}.")}
            assert_same(got_parts, dict(packed), f"{who}: rank {rank}'s {key} parts")
            error = (value - whole_saved[key]).chunk(len(loaded))[rank]
            bound = round_trip_bound(own, state, kind_of(name))
            assert bool((error.abs() <= bound).all()), f"{who}: decoded/{key}"
            if fqn in aligned:
                assert torch.equal(value, whole_saved[key]), f"{who}: decoded/{key}"
    # Where shards hold whole blocks, the saving ranks' parts side by side are the loading
    # ranks' side by side.
    loaded_parts = [_group(g, "parts") for g in loaded]
    for key in saved_parts[0]:
        if key.split("/")[0] in aligned and "." in key:
            joined_saved = torch.cat([p[key].reshape(-1) for p in saved_parts])
            joined_loaded = torch.cat([p[key].reshape(-1) for p in loaded_parts])
            assert torch.equal(joined_loaded, joined_saved), f"{who}: parts/{key}"


def check_dcp_files(path: str) -> None:
    """The 2-rank checkpoint holds each moment as one global float32 tensor (decoded), and
    the format's text; no packed part."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    for key, shape in [
        ("optim.state.c_w.exp_avg", [80, 16]),
        ("optim.state.a_w.exp_avg_sq", [64, 16]),
    ]:
        entry = meta[key]
        assert isinstance(entry, TensorStorageMetadata) and list(entry.size) == shape, key
        assert entry.properties.dtype == torch.float32, key
    assert "optim.optim_state" in meta
    assert not [k for k in meta if k.endswith((".codes", ".absmax"))]
