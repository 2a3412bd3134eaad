"""``computectx info`` and the capability probes it reports; ``--version``; parsing the
command line without importing torch."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from computectx import ComputeCtx, capability
from computectx.cli import info_lines, main


def test_info_reports_versions_probes_and_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch       {torch.__version__}" in out
    for probe in ("cuda", "fp8 tensor cores", "triton", "triton interpreter", "cpu bf16 GEMM"):
        assert f"  {probe} " in out
    ratio = capability.native_half_gemm(torch.bfloat16).measured
    assert ratio is not None and f"takes {ratio:.1f}x the float32 time" in out
    assert str(ComputeCtx.serving("cpu" if not torch.cuda.is_available() else "cuda")) in out
    assert "recipe=hybrid/delayed/16/0/max" in out
    if not torch.cuda.is_available():
        assert "fp8 backend: reference: no CUDA device" in out
        # Every backend, and whether it can be forced on this device.
        lines = out.splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith("fp8 backend:"))
        listed = {ln.split()[0]: ln.split()[1] for ln in lines[at + 1 : at + 4]}
        interpreted = capability.triton_interpreter().ok
        assert listed == {
            "triton": "yes" if interpreted else "no",
            "reference": "yes",
            "cublas": "yes",  # torch._scaled_mm has a CPU kernel
        }


def test_presets_in_info_parse_back() -> None:
    presets = [ln for ln in info_lines() if "compute=" in ln]
    assert len(presets) >= 9
    for line in presets:
        text = line.split()[-1]
        assert str(ComputeCtx.parse(text)) == text


def test_probes_give_reasons() -> None:
    for probe in (
        capability.cuda(),
        capability.fp8_tensor_cores(),
        capability.triton_available(),
        capability.triton_interpreter(),
        capability.native_half_gemm(),
    ):
        assert probe.reason
        assert bool(probe) is probe.ok
    expected = "cuda" if capability.cuda().ok else "cpu"
    assert capability.default_device() == torch.device(expected)
    if not torch.cuda.is_available():
        assert not capability.fp8_tensor_cores("cuda:0").ok
        assert "no fp8 tensor cores" in capability.fp8_tensor_cores().reason


def test_interpreter_probe_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert capability.triton_interpreter().ok
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not capability.triton_interpreter().ok


def test_module_entry_point_and_bad_command() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "computectx", "info"], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0 and "presets:" in res.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "computectx", "frobnicate"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "invalid choice: 'frobnicate'" in bad.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gemm_probe_is_measured_once_and_says_so(dtype: torch.dtype) -> None:
    threads = torch.get_num_threads()
    state = torch.random.get_rng_state()
    probe = capability.native_half_gemm(dtype)
    assert capability.native_half_gemm(dtype) is probe  # cached: measured once per process
    assert torch.get_num_threads() == threads  # timed on one thread, then restored
    assert torch.equal(torch.random.get_rng_state(), state)  # no draws from the global RNG
    assert probe.measured is not None and probe.measured > 0
    assert probe.ok is (probe.measured <= capability.HALF_GEMM_MAX_RATIO)
    name = str(dtype).removeprefix("torch.")
    assert f"a {name} matmul takes {probe.measured:.1f}x the float32 time" in probe.reason
    assert probe.ok or probe.reason.endswith(f"no native {name} GEMM")
    with pytest.raises(ValueError, match=r"got torch\.float32"):
        capability.native_half_gemm(torch.float32)


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    version = importlib.metadata.version("computectx")
    assert capsys.readouterr().out == f"computectx {version}\n"
    import computectx

    assert version == computectx.__version__


PACKAGE_DIR = Path(__file__).resolve().parent.parent / "computectx"

# Runs the CLI in a fresh interpreter, once per command line of PARSED, and prints, for each,
# what it wrote, how it exited and whether torch got imported by then (as JSON). The package
# face (computectx/__init__.py) is replaced by an empty package first, so this checks what
# the CLI modules import themselves, whatever the face imports. One interpreter for all of
# them: torch, once imported, stays imported, so the first line that imports it fails (and
# every line after it).
_WITHOUT_FACE = """
import contextlib, io, json, sys, types
face = types.ModuleType("computectx")
face.__path__ = [{path!r}]
sys.modules["computectx"] = face
from computectx.cli import main
results = []
for argv in {argvs!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(argv)
            status = "returned"
        except SystemExit as e:
            status = f"exit {{e.code}}"
    results.append([out.getvalue(), status, "torch" in sys.modules])
print(json.dumps(results))
"""
PARSED = [
    (["--help"], 0, "demo"),
    (["demo", "--help"], 0, "--grad-accum"),
    (["--version"], 0, "computectx "),
    (["demo", "--dtype", "fp32,,bf16"], 2, "has an empty name"),
    (["demo", "--steps", "0"], 2, "--steps '0'"),
    (["frobnicate"], 2, "invalid choice"),
]


@pytest.fixture(scope="module")
def parsed() -> list[tuple[str, str, bool]]:
    """For each line of PARSED: (what it wrote, how it exited, torch imported)."""
    script = _WITHOUT_FACE.format(path=str(PACKAGE_DIR), argvs=[argv for argv, _, _ in PARSED])
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return [(out, status, torch) for out, status, torch in json.loads(res.stdout)]


@pytest.mark.parametrize("at", range(len(PARSED)), ids=[" ".join(a) for a, _, _ in PARSED])
def test_parsing_and_rejecting_flags_never_imports_torch(
    parsed: list[tuple[str, str, bool]], at: int
) -> None:
    _, code, expected = PARSED[at]
    out, status, torch_imported = parsed[at]
    assert (status, torch_imported) == (f"exit {code}", False), out
    assert expected in out


def test_the_console_entry_point_answers_help_without_torch() -> None:
    """The same through ``python -m computectx``, package face included."""
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, computectx; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "False"  # the package face loads its names on first use
    for argv in (["--help"], ["--version"], ["demo", "--steps", "0"]):
        res = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "computectx", *argv],
            capture_output=True,
            text=True,
            check=False,
        )
        imported = {ln.split("|")[-1].strip() for ln in res.stderr.splitlines() if "|" in ln}
        assert res.returncode == (2 if "demo" in argv else 0)
        assert "torch" not in imported, argv


def test_info_lists_which_fine_grained_gemm_recipes_run_here() -> None:
    lines = info_lines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("fine-grained fp8 GEMM recipes"))
    listed = {" ".join(ln.split()[:3]): ln.split()[3] for ln in lines[at + 1 : at + 5]}
    assert set(listed) == {"row x row", "1x128 x 128x128", "1x128 x 1x128", "mx x mx"}
    if not torch.cuda.is_available():
        # torch's CPU _scaled_mm takes row-wise scales; its scaled_mm v2 refuses the block
        # and MX recipes on the CPU, so those pairs run on the twin.
        assert "(else the twin (reference))" in lines[at]
        assert listed == {
            "row x row": "yes",
            "1x128 x 128x128": "no",
            "1x128 x 1x128": "no",
            "mx x mx": "no",
        }


def test_info_lists_the_4bit_backend_and_which_4bit_cublas_recipes_run_here() -> None:
    lines = info_lines()
    backend = next(ln for ln in lines if ln.startswith("4-bit backend: "))
    at = lines.index("4-bit GEMM recipes on cublas (else the Triton kernel):")
    listed = {ln.split()[0]: ln.split()[1] for ln in lines[at + 1 : at + 3]}
    assert set(listed) == {"nvfp4", "mxfp4"}
    if not torch.cuda.is_available():
        # The CPU runs the twins; torch's scaled_mm v2 refuses swizzled scales on the CPU.
        assert backend.startswith("4-bit backend: emulated: cpu is not a GPU")
        assert listed == {"nvfp4": "no", "mxfp4": "no"}
        assert lines[at + 1].endswith("refuses nvfp4 on cpu: CPU does not support swizzle.")
