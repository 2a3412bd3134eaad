"""``computectx demo --moe``: its settings, the expert load (recorder, table, picture), the
bias step between optimizer steps, and one tiny run end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console

from computectx import ComputeCtx
from computectx.cli import main
from computectx.demo import DemoSettings
from computectx.demo.args import flag_of
from computectx.demo.moe import (
    LoadRecorder,
    layer_loads,
    load_table,
    moe_config,
    moe_hidden,
    plot_expert_load,
)
from computectx.demo.train import model_config
from computectx.distributed import update_expert_bias
from computectx.nn import ByteLM

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_moe_flags_and_their_checks(capsys: pytest.CaptureFixture[str]) -> None:
    names = ("moe", "experts", "top_k", "shared_experts", "balance", "bias_rate")
    assert [flag_of(n) for n in names] == [
        "--moe", "--experts", "--top-k", "--shared-experts", "--balance", "--bias-rate",
    ]  # fmt: skip
    s = DemoSettings(moe=True, experts=4, top_k=4, shared_experts=0, balance="none")
    assert (s.experts, s.top_k, s.balance) == (4, 4, "none")
    with pytest.raises(ValueError, match="--experts, --top-k shape the experts of --moe"):
        DemoSettings(experts=4, top_k=1)
    with pytest.raises(ValueError, match="top_k=3 exceeds experts=2"):
        DemoSettings(moe=True, experts=2, top_k=3)
    with pytest.raises(ValueError, match="'aux_free', 'aux_loss' or 'none'"):
        DemoSettings(moe=True, balance="switch")  # type: ignore[arg-type]
    # On the command line: status 2 before torch trains anything, the message without a
    # dangling field name.
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--shared-experts", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: --shared-experts shape the experts of --moe; add --moe" in err
    assert ": :" not in err


def test_the_experts_keep_the_dense_active_width() -> None:
    assert moe_hidden(384, 2, 1) == 128  # the default model: 3 x 128 = d_ff
    assert moe_hidden(384, 1, 0) == 384
    assert moe_hidden(96, 2, 1) == 32
    assert moe_hidden(100, 4, 4) == 16  # never below one fp8 multiple
    assert moe_config(DemoSettings(), 384) == {}
    dense = model_config(DemoSettings())
    cfg = model_config(DemoSettings(moe=True))
    assert dense.n_experts == 0
    assert (cfg.n_experts, cfg.top_k, cfg.n_shared_experts, cfg.moe_hidden) == (8, 2, 1, 128)
    assert (cfg.moe_balance, cfg.moe_bias_rate) == ("aux_free", 0.01)  # 10x DeepSeek-V3's
    with pytest.raises(ValueError, match="--bias-rate shape the experts of --moe"):
        DemoSettings(bias_rate=0.1)
    assert cfg.model_copy(update={"n_experts": 0, "top_k": 2}).d_ff == dense.d_ff


def _load() -> torch.Tensor:
    # 4 steps, 2 layers, 4 experts; 8 copies per (step, layer).
    return torch.tensor(
        [
            [[8, 0, 0, 0], [2, 2, 2, 2]],
            [[6, 2, 0, 0], [2, 2, 2, 2]],
            [[3, 2, 2, 1], [4, 2, 1, 1]],
            [[2, 2, 2, 2], [4, 2, 1, 1]],
        ]
    )


def test_layer_loads_and_the_table() -> None:
    first, second = layer_loads(_load(), tail=2)
    assert first.per_expert == (2.5, 2.0, 2.0, 1.5)  # the mean of the last 2 steps
    assert (first.low, first.high) == (1.5, 2.5) and first.ratio == pytest.approx(5 / 3)
    assert math.isinf(first.first_ratio)  # experts 2 and 3 got nothing in the first 2
    assert second.ratio == 4.0 and second.first_ratio == 1.0
    assert layer_loads(_load(), tail=99)[0].per_expert == (4.75, 1.5, 1.0, 0.75)  # all steps
    with pytest.raises(ValueError, match="steps, layers, experts"):
        layer_loads(torch.zeros(3, 4, dtype=torch.int64), 1)

    console = Console(width=200, record=True)
    console.print(load_table([("bf16", _load()), ("fp8_mx", _load())], tail=2))
    rows = [
        [c.strip() for c in line.strip()[1:-1].split("│")]
        for line in console.export_text().splitlines()
        if line.startswith("│")
    ]
    assert rows == [
        ["bf16", "0", "1.5", "2.5", "1.67x", "inf"],
        ["", "1", "1.0", "4.0", "4.00x", "1.00x"],
        ["fp8_mx", "0", "1.5", "2.5", "1.67x", "inf"],
        ["", "1", "1.0", "4.0", "4.00x", "1.00x"],
    ]


def test_the_picture_is_written(tmp_path: Path) -> None:
    path = tmp_path / "expert-load.png"
    plot_expert_load([("bf16", _load()), ("fp8_block", _load())], path, "title")
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 5000
    with pytest.raises(ValueError, match="no load"):
        plot_expert_load([], path)


def _tiny_moe(balance: str = "aux_free") -> ByteLM:
    cfg = model_config(
        DemoSettings(moe=True, d_model=32, layers=2, seq_len=16, sample_tokens=0, balance=balance)  # type: ignore[arg-type]
    )
    torch.manual_seed(0)
    return ByteLM(ComputeCtx.from_flag("fp32", "cpu"), cfg)


def test_the_recorder_sums_micro_batches_and_every_copy_is_routed() -> None:
    model = _tiny_moe()
    with pytest.raises(ValueError, match="no MoE layer"):
        LoadRecorder(ByteLM(ComputeCtx.from_flag("fp32", "cpu"), model_config(DemoSettings())))
    rec = LoadRecorder(model)
    with pytest.raises(RuntimeError, match="no forward was recorded"):
        rec.end_step()
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    model(ids)
    once = model.expert_load().clone()
    rec.add()
    model(ids)
    rec.add()
    rec.end_step()
    model(ids[:1])
    rec.add()
    rec.end_step()
    load = rec.load()
    assert load.shape == (2, 2, 8) and load.dtype == torch.int64
    assert torch.equal(load[0], 2 * once)  # two micro-batches, the same tokens
    # Dropless top-2: every layer routes each token twice.
    assert load.sum(-1).tolist() == [[2 * 48 * 2] * 2, [16 * 2] * 2]


def test_a_tiny_moe_run_end_to_end(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    # The loop moves the routers' biases (and resets their counts) after every step.
    steps: list[int] = []

    def spy(model: torch.nn.Module, group: object = None) -> None:
        assert isinstance(model, ByteLM) and group is None
        steps.append(int(model.moe_layers()[0].tokens_per_expert.sum()))
        update_expert_bias(model)

    monkeypatch.setattr("computectx.demo.train.update_expert_bias", spy)
    data = tmp_path / "code.txt"
    data.write_text("".join(f"def f{i % 7}(x):\n    return x + {i % 7}\n\n" for i in range(200)))
    out = tmp_path / "out"
    code = main(
        [
            "demo", "--moe", "--experts", "4", "--balance", "aux_loss", "--dtype", "fp8_block",
            "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--d-model", "32",
            "--layers", "1", "--sample-tokens", "4", "--eval-batches", "1", "--device", "cpu",
            "--data", str(data), "--out", str(out),
        ]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    assert code == 0
    assert "expert load: tokens routed to each expert per step" in stdout
    assert "each of the 4 routed experts per layer (top-2, 1 shared)" in stdout
    assert "32 tokens x 2 = 64 per layer, 16.0 per expert when balanced" in stdout
    assert "balancing: aux_loss" in stdout
    assert "expert-load.png" in stdout.rsplit("wrote ", 1)[1]
    assert (out / "expert-load.png").read_bytes().startswith(PNG)
    results = json.loads((out / "results.json").read_text())
    assert results["computectx_demo"] == 8
    assert results["settings"]["moe"] is True and results["model"]["n_experts"] == 4
    (r,) = results["results"]
    load = torch.tensor(r["expert_load"])
    assert load.shape == (3, 1, 4) and load.sum(-1).flatten().tolist() == [64] * 3
    assert r["fp8_converted_experts"] == 1  # the block's grouped experts run in fp8
    assert r["fp8_backend"] == "reference"
    assert all(math.isfinite(v) for v in r["train_losses"])
    assert steps == [64] * 3  # each step's copies, counted since the last reset
