"""``bench/bench_host_step.py`` on a small shape: every row steps and is reported (no timed
assertion), and the rows step the same AdamW: torch's fused kernel, and ours' f32 step, the
same kernel, give the very same weights."""

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
    fused = rows[0].params
    for row in rows:
        if row.label.startswith("ours"):
            assert all(torch.equal(a, b) for a, b in zip(fused, row.params, strict=True))
