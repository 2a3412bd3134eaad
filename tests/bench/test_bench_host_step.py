"""``bench/bench_host_step.py`` on a small shape: every row of every part steps and is reported
(no timed assertion), and the rows that must step the same AdamW do: torch's fused kernel and
ours' f32 step (the same kernel) give the very same weights, with a clip before the step as
without it; our compact rows' default path and their twin agree to the state formats' error."""

from __future__ import annotations

import bench_host_step as bench
import torch


def test_the_bench_reports_every_row_and_ours_equal_torchs_fused_step() -> None:
    shape = (2, 16, 8)
    rows, notes = bench.contenders(shape, peers=False)
    bench.measure(rows, shape, reps=2, warmup=1)
    labels = [row.label for row in rows]
    assert labels[0] == "torch AdamW fused=True" and notes == []
    assert {"f32", "clip", "compact", "bf16"} == {row.part for row in rows}
    assert not any(label.startswith(("DeepSpeed", "torchao", "bitsandbytes")) for label in labels)
    assert all(len(row.times) == 2 for row in rows)
    lines = bench.table(rows, 2 * 16 * 8)
    ours = [row.label for row in rows if row.label.startswith("ours") and not row.clip]
    assert len(lines) == 2 + len(rows) + len(ours) and "| 1.00 |" in lines[2]
    assert [line.split(" ÷ checked: ")[0] for line in lines[2 + len(rows) :]] == ours
    clipped = [row for row in rows if row.clip]
    assert [row.label for row in clipped] == [
        "torch AdamW fused=True, clip + step",
        "ours OffloadedOptimizer f32, clip + step",
        "ours CompactOptimizer f32, clip + step",
        *(f"ours {fmt} moments, clip + step" for fmt in bench.FORMATS),
    ]
    assert "| 1.00 |" in lines[2 + rows.index(clipped[0])]
    # Ours f32 steps equal torch's fused ones, with the clip as without it, and torch's fused
    # step behind GradScaler's check at scale 1 (the like-for-like row) steps the same.
    fused, fused_clipped = rows[0].params, clipped[0].params
    (checked,) = [row for row in rows if row.label == bench.CHECKED]
    assert checked.scaler is not None and checked.part == "f32"
    assert all(torch.equal(a, b) for a, b in zip(fused, checked.params, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(fused, fused_clipped, strict=True))
    for row in rows:
        if row.label.startswith("ours") and row.part in ("f32", "clip"):
            same = fused_clipped if row.clip else fused
            assert all(torch.equal(a, b) for a, b in zip(same, row.params, strict=True))
    # Every compact and bf16-master row stepped its weights (none is a row that does nothing).
    start = bench._params(shape, torch.float32)
    for row in rows:
        if row.part in ("compact", "bf16") or (row.clip and "moments" in row.label):
            moved = [not torch.equal(a.float(), b) for a, b in zip(row.params, start, strict=True)]
            assert all(moved), row.label


def test_the_bytes_a_step_moves() -> None:
    assert bench.moved(4, "f32", False) == 28  # read w, g, m, v; write w, m, v
    assert bench.moved(4, "int8", True) == 20  # 12 for w and g, 4 for the codes, 4 the check
    assert bench.moved(2, "f32", True) == 24  # bf16 weight and gradient, f32 moments, the check
    assert bench.moved(4, "int4", False) == 14
