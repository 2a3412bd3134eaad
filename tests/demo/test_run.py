"""``computectx demo`` end to end with tiny settings, its outputs, and its argument errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from computectx.cli import main
from computectx.ctx import DTYPE_FLAGS
from computectx.demo import (
    MAX_DATA_BYTES,
    POLICY_FLAGS,
    STDLIB_CORPUS_BYTES,
    DemoError,
    DemoSettings,
    load_corpus,
)
from computectx.demo import corpus as demo_corpus

TINY = [
    "--batch-size", "4",
    "--seq-len", "32",
    "--d-model", "32",
    "--layers", "1",
    "--sample-tokens", "12",
    "--device", "cpu",
]  # fmt: skip

FEWER = ["--eval-batches", "1", "--sample-tokens", "0"]
"""For the runs whose claims are not about validation or the sample: the validation and
serving passes see 4 windows, not 16, and no sample is drawn (the training is the same)."""

# Repetitive text a one-layer model learns within a few steps.
TEXT = "".join(f"def f{i % 7}(x):\n    return x + {i % 7}\n\n" for i in range(300))


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests read the result table's cells, one line per row: a width where nothing
    # wraps. pytest-xdist's workers set COLUMNS=80, which the demo honours.
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "code.txt"
    path.write_text(TEXT)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["demo", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _results(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "results.json").read_text())
    return data


def _table_rows(stdout: str) -> dict[str, list[str]]:
    """Cells of each policy row: policy, fp8 granularity, train loss, val loss, tokens/s,
    state MiB, saved MiB, fp8 non-finite, fp8 saturated (on the CPU)."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 9 and cells[2].replace(".", "").isdigit():
            rows[cells[0]] = cells
    return rows


def test_fp8_policy_runs_end_to_end(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    out = tmp_path / "out"
    code, stdout, _ = _run(
        capsys, "--dtype", "fp8_e4m3", "--steps", "12", "--data", str(text_file),
        "--out", str(out), "--lr", "1e-2", *TINY,
    )  # fmt: skip
    assert code == 0
    assert "fp8 backend: reference: " in stdout  # the reason, which names the backend once
    assert "reference (reference" not in stdout

    rows = _table_rows(stdout)
    assert list(rows) == ["fp8_e4m3"]
    row = rows["fp8_e4m3"]
    assert row[1] == "tensor"  # per-tensor scaling
    assert row[7] == "0"  # no non-finite amax on this data
    assert row[8].endswith("%")

    png = (out / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000

    data = _results(out)
    assert data["fp8_backend"] == "reference"
    (r,) = data["results"]
    assert r["flag"] == "fp8_e4m3" and "recipe=e4m3/delayed" in r["policy"]
    assert len(r["train_losses"]) == 12
    assert r["train_loss"] < r["train_losses"][0] - 0.5  # it learned something
    assert r["val_curve"][-1][1] < r["val_curve"][0][1]
    assert r["fp8_backend"] == "reference"  # what the converted layers ran on
    assert r["fp8_converted_linears"] == 5  # qkv, out and the MLP's gate/up/down; not the head
    assert r["fp8_nonfinite"] == 0
    assert 0.0 <= r["fp8_saturated_fraction_max"] <= 1.0
    assert "blocks.0.attn.qkv" in r["fp8_layers"] and "head" not in r["fp8_layers"]
    assert r["sample"].startswith("def ")
    assert r["fp8_granularity"] == "tensor"
    assert float(row[2]) == pytest.approx(r["train_loss"], abs=1e-4)
    assert float(row[3]) == pytest.approx(r["val_loss"], abs=1e-4)

    # The serving section: the trained model through the KV cache at f32, bf16 and fp8, and
    # the sample generated with the policy's own kv (bf16: the fp8 flags compute in bf16).
    assert data["computectx_demo"] == 8
    assert r["expert_load"] is None and r["fp8_converted_experts"] == 0  # dense (no --moe)
    assert r["kv"] == "bf16"
    assert "sample (fp8_e4m3, kv=bf16, temperature 0.8, top-k 40):" in stdout
    assert "serving: each trained model's validation loss through the KV cache" in stdout
    serving = {row["kv"]: row for row in r["serving"]}
    assert list(serving) == ["f32", "bf16", "e4m3/per_token_head"]
    # One layer of 32 wide (one head): keys and values, plus fp8's two float32 steps.
    assert [row["kv_bytes_per_token"] for row in serving.values()] == [256, 128, 64 + 8]
    # f32 KV rounds nothing: the cached loss is the full forward's (the val loss) up to the
    # bf16 compute's reassociation; the fp8 cache is close to it, not equal.
    f32 = serving["f32"]["val_loss"]
    assert f32 == pytest.approx(r["val_loss"], rel=2e-3)
    assert serving["e4m3/per_token_head"]["val_loss"] == pytest.approx(f32, rel=0.01)
    assert serving["e4m3/per_token_head"]["val_loss"] != f32
    assert all(row["decode_tokens_per_s"] > 0 for row in serving.values())


def test_fine_grained_policies_train_and_the_table_shows_their_granularity(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    flags = "fp8_rowwise,fp8_rowwise_gw_hp,fp8_block,fp8_mx"
    code, stdout, _ = _run(
        capsys, "--dtype", flags, "--steps", "3", "--data", str(text_file),
        "--out", str(tmp_path), *TINY, *FEWER,
    )  # fmt: skip
    assert code == 0
    want = {"fp8_rowwise": "row", "fp8_rowwise_gw_hp": "row+gw_hp", "fp8_block": "block",
            "fp8_mx": "mx"}  # fmt: skip
    assert {flag: cells[1] for flag, cells in _table_rows(stdout).items()} == want
    assert "fp8 granularity: which elements share one fp8 step" in stdout
    results = _results(tmp_path)["results"]
    assert {r["flag"]: r["fp8_granularity"] for r in results} == want
    for r in results:  # every linear but the head converts, and every step is finite
        assert r["fp8_converted_linears"] == 5
        assert f"/{want[r['flag']]}/dynamic" in r["policy"]
        assert all(v is not None for v in r["train_losses"])


def test_accumulator_and_offload_run_end_to_end(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    out = tmp_path / "out"
    code, stdout, _ = _run(
        capsys, "--dtype", "bf16", "--steps", "8", "--grad-accum", "2", "--offload",
        "--data", str(text_file), "--out", str(out), "--lr", "1e-2", "--skip-serving", *TINY,
        *FEWER,
    )  # fmt: skip
    assert code == 0
    assert "fp8 backend" not in stdout  # no fp8 policy, no backend to report
    assert "serving" not in stdout  # --skip-serving: no serving section, table or notes
    rows = _table_rows(stdout)
    assert list(rows) == ["bf16"]
    assert rows["bf16"][7:] == ["-", "-"] and rows["bf16"][1] == "-"  # no fp8, no granularity
    assert "state MiB: weights, gradients" in stdout and "memory_report" in stdout

    (r,) = _results(out)["results"]
    # The accumulator sums bf16 micro-batch gradients; AdamW steps offloaded masters.
    assert "grad=bf16" in r["policy"] and "offload=cpu" in r["policy"]
    assert r["train_loss"] < r["train_losses"][0] - 0.5
    assert r["skipped_steps"] == 0
    mem = r["memory"]
    # The weights are f32 on the CPU, the offload device: they are their own masters (one
    # storage, docs/memory.md), so the masters add nothing; AdamW keeps two f32 moments per
    # weight, and its step counts (the accumulator's buffers were drained into the weights).
    assert mem["master"] == 0 and mem["optimizer"] >= 2 * mem["params"] > 0
    assert mem["state"] == sum(
        mem[k] for k in ("params", "grads", "accumulator", "master", "optimizer")
    )
    assert r["fp8_granularity"] is None
    assert float(rows["bf16"][5]) == pytest.approx(mem["state"] / 2**20, abs=0.005)
    # saved: the step's peak, one micro-batch's forward (each backward freed its own).
    assert sum(mem["saved_kinds"].values()) == mem["saved"] > 0
    assert (out / "loss.png").stat().st_size > 5000
    assert r["serving"] == [] and _results(out)["settings"]["skip_serving"] is True


def test_policies_compare_side_by_side_and_same_seed_same_losses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    def run(seed: str, name: str) -> list[dict[str, Any]]:
        args = ["--dtype", "fp32", "--dtype", "bf16", "--steps", "4", "--seed", seed]
        code, stdout, _ = _run(
            capsys, *args, "--data", str(text_file), "--out", str(tmp_path / name), *TINY,
            "--eval-batches", "1",
        )  # fmt: skip
        assert code == 0
        assert list(_table_rows(stdout)) == ["fp32", "bf16"]
        assert "optimizer state: AdamW's weights and moments per setting" in stdout
        assert "mean step loss over the last 1 of 4 steps" in stdout
        results: list[dict[str, Any]] = _results(tmp_path / name)["results"]
        return results

    first, again, other = run("3", "a"), run("3", "b"), run("4", "c")
    # The optimizer-state table, computed: its f32 row is what the fp32 run measured, and
    # every compact setting holds less (4-bit least; a bf16 master halves the weights).
    data = _results(tmp_path / "a")
    rows = {(r["optim_state"], r["master"]): r for r in data["optim_state"]}
    assert list(rows) == [(f, "f32") for f in ("f32", "bf16", "int8", "fp8", "int4")] + [
        ("int8", "bf16"),
        ("int4", "bf16"),
    ]
    f32 = rows["f32", "f32"]
    assert f32["weights"] == first[0]["memory"]["params"]
    assert f32["moments"] == first[0]["memory"]["optimizer"]
    moments = [rows[f, "f32"]["moments"] for f in ("f32", "bf16", "int8", "int4")]
    assert moments == sorted(moments, reverse=True) and len(set(moments)) == 4
    assert rows["fp8", "f32"]["moments"] == rows["int8", "f32"]["moments"]
    assert rows["int8", "bf16"]["weights"] * 2 == f32["weights"]
    assert rows["int4", "bf16"]["moments"] == rows["int4", "f32"]["moments"]
    for a, b in zip(first, again, strict=True):
        assert a["train_losses"] == b["train_losses"]
        assert a["val_curve"] == b["val_curve"]
        assert a["sample"] == b["sample"]
    assert first[0]["train_losses"] != other[0]["train_losses"]
    # Same initial weights and batches: the policies differ only by rounding.
    assert first[0]["val_curve"][0][1] == pytest.approx(first[1]["val_curve"][0][1], abs=0.02)
    fp32, bf16 = first
    assert fp32["gemm"] == "wide" and bf16["gemm"] in ("upcast", "native")
    # The weights, gradients and AdamW state are f32 under both policies (autocast reads
    # f32 weights), but bf16 keeps narrower activations for backward.
    assert fp32["memory"]["state"] == bf16["memory"]["state"]
    assert 0 < bf16["memory"]["saved"] < fp32["memory"]["saved"]
    assert fp32["train_loss"] == fp32["train_losses"][-1]  # 4 steps: the tail is one step


def test_an_activations_row_keeps_fp8_activations_and_the_table_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    argv = ["--dtype", "bf16,bf16@precise:fp8/act_fn:fp8", "--steps", "2", *TINY, *FEWER]
    code, stdout, _ = _run(capsys, *argv, "--data", str(text_file), "--out", str(tmp_path))
    assert code == 0
    assert list(_table_rows(stdout)) == ["bf16", "bf16@precise:fp8/act_fn:fp8"]
    assert "FLAG@ACTIVATIONS: FLAG's policy keeping the activations" in stdout
    assert "device=cpu,activations=precise:fp8/act_fn:fp8" in stdout  # its policy line
    keep, fp8 = _results(tmp_path)["results"]
    assert fp8["flag"] == "bf16@precise:fp8/act_fn:fp8"
    assert fp8["memory"]["state"] == keep["memory"]["state"]
    # The norms' float32 copies and SwiGLU's bf16 inputs become one byte an element.
    assert 0 < fp8["memory"]["saved"] < 0.75 * keep["memory"]["saved"]
    kinds, kept = fp8["memory"]["saved_kinds"], keep["memory"]["saved_kinds"]
    assert list(kinds) == ["linear", "precise", "act_fn", "attention", "residual", "moe", "other"]
    assert sum(kinds.values()) == fp8["memory"]["saved"]
    assert 0 < kinds["precise"] < kept["precise"] / 3  # float32 -> E4M3 and a scale per 128
    assert 0 < kinds["act_fn"] < kept["act_fn"] / 1.9  # bf16 -> E4M3
    assert kinds["attention"] == kept["attention"] > 0  # attention: keep in both rows
    for kind in ("linear", "residual", "moe", "other"):  # keep in both rows: kept alike
        assert kinds[kind] == kept[kind]
    assert "saved MiB by kind (computectx.memory.SavedActivations" in stdout


def test_activations_the_ctx_refuses_exit_2_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = _run(capsys, "--dtype", "bf16,bf16@linear:recompute", "--out", str(out))
    assert code == 2
    assert stderr.startswith("computectx demo: error: --dtype bf16@linear:recompute: ")
    assert "accepted for linear: keep, fp8, offload" in stderr
    assert "corpus:" not in stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps '0': Input should be greater than or equal to 1"),
        (["--steps", "many"], "--steps 'many': Input should be a valid integer"),
        (["--grad-accum", "-1"], "--grad-accum '-1': Input should be greater than or equal to 1"),
        (["--dtype", "fp4"], "--dtype: unknown dtype 'fp4'; accepted: fp32, fp16, bf16"),
        (["--dtype", "bf16,int8"], "unknown dtype 'int8'"),
        (["--dtype", "fp32,,bf16"], "--dtype: 'fp32,,bf16' has an empty name"),
        (["--dtype", "bf16,"], "--dtype: 'bf16,' has an empty name"),
        (["--dtype", "bf16", "--dtype", "bf16"], "--dtype: bf16 given more than once"),
        (["--dtype", "bf16@"], "--dtype: 'bf16@' names no activations after '@'"),
        (["--dtype", "fp4@fp8"], "--dtype: unknown dtype 'fp4'; accepted: fp32"),
        (["--dtype", "bf16@fp8,BF16@FP8"], "--dtype: bf16@fp8 given more than once"),
        (["--device", "gpu"], "--device: bad device 'gpu'; the demo accepts cpu, cuda or cuda:N"),
        (["--device", "meta"], "--device: bad device 'meta'"),
        (["--seed", "-3"], "--seed '-3': Input should be greater than or equal to 0"),
        (["--d-model", "48"], "--d-model '48': Input should be a multiple of 32"),
        (["--d-model", "0"], "--d-model '0': Input should be greater than or equal to 32"),
        (["--seq-len", "4"], "--seq-len '4': Input should be greater than or equal to 8"),
        (["--lr", "0"], "--lr '0': Input should be greater than 0"),
        (["--lr", "fast"], "--lr 'fast': Input should be a valid number"),
        (["--frobnicate"], "computectx: error: unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_flags_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: computectx")
    assert message in err
    assert not out.exists()


def test_every_bad_flag_is_named_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0", "--lr", "2"])
    err = capsys.readouterr().err
    assert "--steps '0'" in err and "--lr '2': Input should be less than or equal to 1" in err


def test_a_device_that_does_not_exist_exits_2_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    dev = "cuda:0"
    if torch.cuda.is_available():
        dev = f"cuda:{torch.cuda.device_count()}"  # one past the last
    out = tmp_path / "out"
    code, stdout, stderr = _run(capsys, "--device", dev, "--out", str(out))
    assert code == 2
    assert stderr.startswith(f"computectx demo: error: --device {dev} cannot run here: ")
    assert "corpus:" not in stdout
    assert not out.exists()


def test_output_folder_problems_are_reported_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text_file: Path
) -> None:
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for out, message in (
        (a_file, "exists and is not a folder"),
        (a_file / "sub", "is not a writable folder"),
    ):
        code, stdout, stderr = _run(capsys, "--data", str(text_file), "--out", str(out), *TINY)
        assert code == 2
        assert message in stderr and str(out) in stderr
        assert "corpus:" not in stdout


def test_data_problems_are_reported_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("print(1)\n" * 5)
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "blob.dat").write_bytes(b"\x00\x01" * 5000)
    for data, message in (
        (tmp_path / "missing.txt", "does not exist"),
        (empty, "holds 0 bytes of text in 0 file(s)"),
        (binary, "holds 0 bytes of text in 0 file(s)"),
        (tiny, "holds 45 bytes of text in 1 file(s)"),
    ):
        out = tmp_path / "out"
        code, _, stderr = _run(capsys, "--data", str(data), "--out", str(out), *TINY)
        assert code == 2, data
        assert message in stderr and str(data) in stderr
        assert not out.exists()


def test_python_dash_m_reports_errors_with_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "computectx", "demo", "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert "--steps '0': Input should be greater than or equal to 1" in proc.stderr


def test_help_lists_every_setting_with_its_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln[:4] == "  --"}
    flags = {
        "--dtype" if n == "dtypes" else "--" + n.replace("_", "-")
        for n in DemoSettings.model_fields
    }
    assert set(lines) == flags
    for line in lines.values():
        assert "(default: " in line, line
    assert lines["--steps"].endswith("Optimizer steps per policy. (default: 120)")
    assert lines["--seed"].endswith("(default: 0)")
    assert lines["--lr"].endswith("(default: 0.003)")
    assert lines["--dtype"].endswith("(default: fp32,bf16,fp8_hybrid)")
    assert lines["--offload"].endswith("(default: off)")
    assert lines["--device"].endswith("(default: cuda if usable, else cpu)")
    for name in POLICY_FLAGS:
        assert name in lines["--dtype"]


def test_the_flag_names_are_the_ctx_flag_names() -> None:
    assert POLICY_FLAGS == DTYPE_FLAGS


def test_default_corpus_is_the_stdlib_read_deterministically() -> None:
    a = load_corpus(None, min_bytes=1000)
    b = load_corpus(None, min_bytes=1000)
    assert a.name == "python stdlib" and a.files > 5
    assert a.train.numel() + a.val.numel() <= STDLIB_CORPUS_BYTES + a.files
    assert a.val.numel() == pytest.approx(0.1 * (a.train.numel() + a.val.numel()), abs=1)
    assert bytes(a.train[:100].tolist()) == bytes(b.train[:100].tolist())
    assert bytes(a.val.tolist()) == bytes(b.val.tolist())
    # Python source: mostly printable ASCII.
    head = bytes(a.train[:20000].tolist())
    assert sum(32 <= c < 127 or c in (9, 10) for c in head) > 0.95 * len(head)


def test_data_folder_reads_text_files_in_order_and_skips_hidden_and_binary(
    tmp_path: Path,
) -> None:
    (tmp_path / "b.py").write_text("B" * 600)
    (tmp_path / "a.py").write_text("A" * 600)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("H" * 600)
    (tmp_path / "img.png").write_bytes(b"\x89PNG\x00" * 100)
    corpus = load_corpus(tmp_path, min_bytes=10)
    assert corpus.files == 2
    text = bytes(corpus.train.tolist()) + bytes(corpus.val.tolist())
    assert text == b"A" * 600 + b"\n" + b"B" * 600
    assert MAX_DATA_BYTES >= 1 << 20


def test_settings_validate_like_the_flags() -> None:
    assert DemoSettings(dtypes="fp32, FP8_E5M2").dtypes == ("fp32", "fp8_e5m2")  # type: ignore[arg-type]
    assert DemoSettings(dtypes=("fp32", "bf16,fp16")).dtypes == ("fp32", "bf16", "fp16")
    with pytest.raises(ValueError, match="accepted: fp32, fp16, bf16"):
        DemoSettings(dtypes=("fp64",))
    with pytest.raises(ValueError, match="has an empty name"):
        DemoSettings(dtypes=("fp32,",))
    with pytest.raises(ValueError, match="give at least one name"):
        DemoSettings(dtypes=())
    assert DemoSettings(d_model=64).d_model == 64
    with pytest.raises(ValueError, match="multiple of 32"):
        DemoSettings(d_model=48)
    assert DemoSettings(device=torch.device("cuda", 1)).device == "cuda:1"  # type: ignore[arg-type]
    assert DemoSettings(device=" CPU ").device == "cpu"
    with pytest.raises(ValueError, match="bad device 'cuda:x'"):
        DemoSettings(device="cuda:x")
    with pytest.raises(DemoError, match="does not exist"):
        load_corpus(Path("/nonexistent/computectx-demo-data"))


def test_data_is_cut_at_the_byte_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.txt").write_text("A" * 600)
    (tmp_path / "b.txt").write_text("B" * 600)
    assert not load_corpus(tmp_path).truncated
    monkeypatch.setattr(demo_corpus, "MAX_DATA_BYTES", 1000)
    corpus = load_corpus(tmp_path)
    assert corpus.truncated
    text = bytes(corpus.train.tolist()) + bytes(corpus.val.tolist())
    assert text == b"A" * 600 + b"\n" + b"B" * 400
    # A file far beyond the cap is read only up to it (a sparse 64 GiB file: reading it
    # whole would never finish).
    big = tmp_path / "big"
    big.mkdir()
    with (big / "huge.txt").open("wb") as fh:
        fh.write(b"C" * 5000)
        fh.truncate(1 << 36)
    corpus = load_corpus(big)
    assert corpus.truncated and corpus.train.numel() + corpus.val.numel() == 1000
