"""What one rank may call, tested: on 2 gloo ranks, rank 0 alone makes every public call
(forwards in each mode, ``state_dict``, its ``torch.save``, ``load_state_dict``, ``step``)
under DDP, FSDP2, expert parallelism and expert parallelism with DDP (one launch,
``scenarios_one_rank.py``; a 0.5 s join timeout, a 10 s collective timeout, a 120 s wall
limit). Each call returns a correct result or raises a clear error naming the rank that did
not join, and the next two joint steps equal the steps of a run without the lone calls, bit
for bit. docs/distributed.md's table "What one rank may call" must say what this finds. In the
same launch a tiny ``ByteLM`` with buffers (dense and MoE) under DDP: rank 0's lone evaluation
forwards run, and the ranks then train on alike."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import _run
from .scenarios_one_rank import BUFFER_CALLS, BUFFER_FAMILIES, CALLS, FAMILIES, JOIN_S

DOCS = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
COLUMNS = {
    "DDP": "ddp",
    "FSDP2": "fsdp",
    "expert parallel": "ep",
    "expert parallel + DDP": "ep+ddp",
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("one-rank")
    return _run(
        tmp, "scenarios_one_rank.py:table", 2, 120.0, {"families": [*FAMILIES, *BUFFER_FAMILIES]}
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_one_ranks_calls_run_or_raise_clearly_and_the_group_trains_on(
    ranks: list[dict[str, Any]], name: str
) -> None:
    r0, r1 = ranks[0][name], ranks[1][name]
    for call in CALLS:
        outcome, message = r0[call]
        if outcome == "raises":
            assert message.startswith("RuntimeError: "), (call, message)
            assert "rank(s) 1 of the group did not join it" in message, (call, message)
            assert "every rank of the group must run it together" in message, (call, message)
            assert r0[f"{call} s"] < JOIN_S + 5.0, (call, r0[f"{call} s"])
    for r in (r0, r1):
        for key, want in r["without"].items():
            assert torch.equal(r["after"][key], want), (name, key)


@pytest.mark.parametrize("name", BUFFER_FAMILIES)
def test_a_lone_evaluation_forward_of_a_model_with_buffers_runs_under_ddp(
    ranks: list[dict[str, Any]], name: str
) -> None:
    # DDP broadcasts a module's buffers from rank 0 before every forward unless told not
    # to: rank 0's lone broadcast left the ranks' collectives one apart, and the next step
    # timed out (the collective timeout, 10 s).
    r0, r1 = ranks[0][name], ranks[1][name]
    assert {call: r0[call][0] for call in BUFFER_CALLS} == dict.fromkeys(BUFFER_CALLS, "runs"), r0
    assert any(key.startswith("buffer ") for key in r0["after"]), sorted(r0["after"])
    for r in (r0, r1):
        for key, want in r["without"].items():
            assert torch.equal(r["after"][key], want), (name, key)
    for key, value in r0["after"].items():  # the replicas, weights and buffers alike
        if key != "losses":
            assert torch.equal(value, r1["after"][key]), (name, key)


def test_a_lone_forward_between_the_first_backward_and_step_raises_or_runs_under_ddp(
    ranks: list[dict[str, Any]],
) -> None:
    # DDP rebuilds its buckets (a broadcast) in the first forward with grad on after the
    # first backward: rank 0's lone one made it alone, and the step after it timed out.
    r0, r1 = ranks[0]["before first step"], ranks[1]["before first step"]
    assert r0["grad on"].startswith("raises "), r0["grad on"]
    assert "rank(s) 1 of the group did not join it" in r0["grad on"], r0["grad on"]
    assert r0["no_grad"] == "runs", r0["no_grad"]
    for key, value in r0["after"].items():
        if key != "losses":
            assert torch.equal(value, r1["after"][key]), key


def _docs_table() -> dict[tuple[str, str], str]:
    text = DOCS.read_text()
    start = text.index("| call on rank 0 alone |")
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), text[start:].splitlines()))
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    out = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        call = cells[0].strip("`")
        for column, cell in zip(header[1:], cells[1:], strict=True):
            out[(call, COLUMNS[column])] = re.split(r"\W", cell, maxsplit=1)[0]
    return out


def test_the_docs_table_says_what_the_harness_finds(ranks: list[dict[str, Any]]) -> None:
    table = _docs_table()
    found = {(call, name): ranks[0][name][call][0] for name in FAMILIES for call in CALLS}
    assert table == found, {k: (table.get(k), v) for k, v in found.items() if table.get(k) != v}
