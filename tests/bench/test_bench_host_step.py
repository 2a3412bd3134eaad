"""``bench/bench_host_step.py`` on a small shape: every row steps and is reported (no timed
assertion), and the rows step the same AdamW: torch's fused kernel, and ours' f32 step, the
same kernel, give the very same weights, with a clip before the step as without it."""

from __future__ import annotations

import bench_host_step as bench
import torch


def test_the_bench_reports_every_row_and_ours_equal_torchs_fused_step() -> None:
    shape = (2, 16, 8)
    rows, notes = bench.contenders(shape)
    bench.measure(rows, shape, reps=2, warmup=1)
    labels = [row.label for row in rows]
    assert labels[0] == "torch AdamW fused=True"
    assert "ours OffloadedOptimizer f32" in labels and "ours CompactOptimizer f32" in labels
    assert all(len(row.times) == 2 for row in rows)
    lines = bench.table(rows, 2 * 16 * 8)
    assert len(lines) == 2 + len(rows) and "| 1.00 |" in lines[2]
    assert notes or "DeepSpeed CPUAdam" in labels
    clipped = [row for row in rows if row.clip]
    assert [row.label for row in clipped] == [
        "torch AdamW fused=True, clip + step",
        "ours OffloadedOptimizer f32, clip + step",
        "ours CompactOptimizer f32, clip + step",
    ]
    assert "| 1.00 |" in lines[2 + rows.index(clipped[0])]
    # Ours steps equal torch's fused ones, with the clip as without it.
    fused, fused_clipped = rows[0].params, clipped[0].params
    assert not all(torch.equal(a, b) for a, b in zip(fused, fused_clipped, strict=True))
    for row in rows:
        if row.label.startswith("ours"):
            same = fused_clipped if row.clip else fused
            assert all(torch.equal(a, b) for a, b in zip(same, row.params, strict=True))
