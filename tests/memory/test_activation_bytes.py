"""``SavedActivations``: the bytes autograd keeps, by kind, as the ops tag them (counted)."""

from __future__ import annotations

import pytest
import torch

from computectx import ComputeCtx, DType
from computectx.memory import memory_report
from computectx.memory.activation_bytes import SavedActivations
from computectx.nn import rms_norm, swiglu

ROWS, WIDTH = 64, 256
N = ROWS * WIDTH


def proj_bytes() -> int:
    return 2 * WIDTH * 2 * WIDTH  # bf16: the matmul's weight needs no gradient, x's does


def _step(spec: str, micro_batches: int = 1) -> SavedActivations:
    ctx = ComputeCtx.new(DType.BF16, "cpu").with_activations(spec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, WIDTH, generator=g).bfloat16().requires_grad_()
    w = torch.nn.Parameter(torch.ones(WIDTH))
    proj = torch.randn(WIDTH, 2 * WIDTH, generator=g).bfloat16()
    with SavedActivations(exclude=[w]) as saved:
        for _ in range(micro_batches):
            h = rms_norm(ctx, x, w) @ proj  # the matmul keeps proj (untagged: "other")
            out = swiglu(ctx, h[:, :WIDTH], h[:, WIDTH:])
            torch.autograd.backward(out.float().sum())
    return saved


def test_each_kind_is_counted_apart_and_other_holds_the_rest() -> None:
    keep = _step("keep")
    assert keep.bytes("precise") == 2 * 4 * N + 4 * ROWS  # two float32 copies and 1/rms
    # gate and up are views of h: its whole storage (2N bf16 elements), and silu(gate).
    assert keep.bytes("act_fn") == 2 * 2 * N + 2 * N
    assert keep.bytes("other") == proj_bytes()
    assert keep.bytes() == sum(keep.counts.values())
    assert keep.bytes(device="cpu") == keep.bytes() and keep.bytes(device="cuda") == 0
    fp8 = _step("precise:fp8/act_fn:fp8")
    assert fp8.bytes("precise") == N + 4 * N // 128
    assert fp8.bytes("act_fn") == 2 * (N + 4 * N // 128)
    assert fp8.bytes("other") == keep.bytes("other")
    assert fp8.bytes("attention") == 0


def test_memory_report_has_a_row_per_device_kind_and_dtype_of_what_the_backward_kept() -> None:
    keep, fp8 = _step("keep"), _step("precise:fp8/act_fn:fp8")
    model = torch.nn.Linear(4, 4)
    plain = memory_report(model)
    r = memory_report(model, activations=keep)
    assert r.bytes(role="activations") == keep.bytes() > 0
    assert r.bytes(role="activations", kind="precise", dtype="float32") == 2 * 4 * N + 4 * ROWS
    assert r.bytes(kind="act_fn", dtype="bfloat16") == 2 * 2 * N + 2 * N
    assert r.bytes(kind="other", device="cpu") == proj_bytes()
    assert r.bytes(kind="attention") == 0
    rows = [row for row in r.rows if row.role == "activations"]
    assert [(row.kind, row.dtype, row.storages) for row in rows] == [
        ("precise", "float32", 3),  # two float32 copies of x and 1/rms
        ("act_fn", "bfloat16", 2),  # h (gate and up are views of it) and silu(gate)
        ("other", "bfloat16", 1),
    ]
    # The state's rows and figures are as without the measurement.
    assert r.rows[: len(plain.rows)] == plain.rows
    assert r.bytes_per_param() == plain.bytes_per_param() == 4.0
    assert r.by_device()["cpu"]["activations"] == keep.bytes()
    assert "activations" not in plain.by_device()["cpu"]
    assert "activations:precise" in str(r) and "activations:act_fn" in str(r)
    assert r.peak == {}  # a CPU has no allocator peak; CUDA devices report theirs
    c = memory_report(model, activations=fp8)
    assert c.bytes(kind="precise", dtype="float8_e4m3fn") == N  # one byte a code
    assert c.bytes(kind="precise", dtype="float32") == 4 * N // 128  # a scale per 128
    assert c.bytes(kind="act_fn", dtype="float8_e4m3fn") == 2 * N
    assert c.bytes(role="activations") == fp8.bytes()
    assert c.bytes(kind="other") == r.bytes(kind="other")  # the untagged matmul: as kept
    with pytest.raises(ValueError, match=r"unknown kind 'norm'; accepted: 'linear', .*'other'"):
        r.bytes(kind="norm")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SavedActivations"):
        memory_report(model, activations=object())  # type: ignore[arg-type]


def test_each_storage_counts_once_and_excluded_ones_not_at_all() -> None:
    a = torch.randn(1000, requires_grad=True)
    with SavedActivations() as saved:
        torch.autograd.backward((a * a).sum())  # mul saves `a` twice: one storage
    assert saved.bytes() == saved.bytes("other") == 4000
    b = torch.randn(250, requires_grad=True)
    with SavedActivations(exclude=[a]) as saved:
        torch.autograd.backward((a * b.repeat(4)).sum())  # saves `a` (excluded) and a copy
    assert saved.bytes() == 4000  # the repeated b, 1000 floats
    assert saved.storages == {("cpu", "other", "float32"): 1}


def test_the_peak_is_the_most_held_at_once_and_a_step_releases_all_it_saved() -> None:
    one, two = _step("keep"), _step("keep", micro_batches=2)
    per_micro = 2 * 4 * N + 4 * ROWS + 3 * 2 * N  # precise + act_fn, as counted above
    # Each backward releases what its forward saved (proj too, though it lives on): the
    # next micro-batch's saves count again, but are never held beside the first's.
    assert two.bytes() == 2 * one.bytes() == 2 * (per_micro + proj_bytes())
    assert one.peak == two.peak == {"cpu": per_micro + proj_bytes()}
    assert sum(two.at_peak.values()) == two.peak["cpu"]
    assert two.at_peak[("cpu", "act_fn")] == 3 * 2 * N and two.at_peak[("cpu", "linear")] == 0
    assert set(two.held.values()) == {0}  # each backward released what its forward saved
    fp8 = _step("precise:fp8/act_fn:fp8", micro_batches=2)
    assert fp8.peak["cpu"] == 3 * (N + 4 * N // 128) + proj_bytes()
    r = memory_report(torch.nn.Linear(4, 4), activations=two)
    assert r.saved_peak == two.peak and r.peak == {}
    assert f"saved peak on cpu: {two.peak['cpu']:,}" in str(r)
    assert memory_report(torch.nn.Linear(4, 4)).saved_peak == {}


def test_a_graph_dropped_without_backward_releases_its_saves_at_once() -> None:
    x = torch.randn(1000, requires_grad=True)
    with SavedActivations() as saved:
        y = torch.exp(x)  # saves its own output: no cycle through the hooks (no gc needed)
        loss = (y * 2).sum()
    assert saved.held == {("cpu", "other"): 4000} and saved.peak == {"cpu": 4000}
    del y, loss
    assert saved.held == {("cpu", "other"): 0} and saved.peak == {"cpu": 4000}
