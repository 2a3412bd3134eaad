"""Backend choice (``computectx.formats.backend``): the reason text, forcing, the Triton checks."""

from __future__ import annotations

import sys
import types
from typing import Any, cast

import pytest
import torch

from computectx.dtypes import Fp8Format
from computectx.formats import Backend, select_backend
from computectx.formats import backend as fp8_backend
from computectx.formats.backend import check_backend, default_backend, parse_backend
from computectx.formats.ops import tensorwise as tensor_ops


def test_select_backend_on_cpu_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backend, why = select_backend("cpu")
    assert backend is Backend.REFERENCE
    assert why.startswith("reference: ")
    assert "compute capability >= 8.9" in why
    if not torch.cuda.is_available():
        assert "no CUDA device" in why
    assert select_backend("cpu", force="reference") == (
        Backend.REFERENCE,
        "reference: forced",
    )
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("cpu", force=Backend.TRITON)
    with pytest.raises(ValueError, match="'cuda-graph'"):
        select_backend("cpu", force="cuda-graph")
    with pytest.raises(ValueError, match="'gpu0'"):
        select_backend("gpu0")


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU machine this process holds compiled kernel modules, which the check rightly
    # refuses for CPU tensors (next test); here only the environment variable is at stake.
    # Every kernel module another test of this worker imported (fp8_codes among them): the
    # check asks about each one loaded.
    for name in [n for n in sys.modules if n.startswith("computectx.kernels.")]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend, why = select_backend("cpu", force="triton")
    assert backend is Backend.TRITON
    assert "TRITON_INTERPRET=1" in why
    # Without force, the interpreter is never chosen: it is for tests, and slow.
    assert select_backend("cpu")[0] is Backend.REFERENCE
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton fp8 backend cannot run on cpu"):
        tensor_ops.quantize_with_step(
            torch.ones(2), Fp8Format.E4M3, torch.ones(1), backend=Backend.TRITON
        )


def test_kernels_compiled_before_the_interpreter_was_set_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A kernel module decorated without TRITON_INTERPRET cannot run on CPU tensors; the
    # backend check says so instead of failing inside triton.
    compiled = types.ModuleType("computectx.kernels.scaled_mm")
    compiled.INTERPRETED = False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "computectx.kernels.scaled_mm", compiled)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="imported before TRITON_INTERPRET=1"):
        select_backend("cpu", force="triton")


@pytest.mark.parametrize("spelling", ["reference", " Reference ", Backend.REFERENCE])
def test_parse_backend_accepts_members_and_names(spelling: Backend | str) -> None:
    assert parse_backend(spelling) is Backend.REFERENCE


def test_bad_devices_are_refused_by_the_ctx_device_parser() -> None:
    # One device parser for the package: computectx.residency.parse_device, whose error lists
    # the accepted spellings.
    with pytest.raises(ValueError, match=r"bad device 'gpu0'; accepted: 'cpu', 'cuda', 'cuda:N'"):
        select_backend("gpu0")
    bad: Any = 0
    with pytest.raises(ValueError, match="bad device 0"):
        select_backend(bad)
    assert select_backend(" cpu ")[0] is Backend.REFERENCE


def test_check_backend_wants_a_member() -> None:
    name: Any = "reference"
    with pytest.raises(TypeError, match=r"backend must be a Backend .* got 'reference'"):
        check_backend(name, torch.ones(1))
    assert check_backend(Backend.REFERENCE, torch.ones(1)) is Backend.REFERENCE


def test_default_backend_is_cached_per_device() -> None:
    dev = torch.device("cpu")
    assert default_backend(dev) is select_backend(dev)[0]
    hits = default_backend.cache_info().hits
    default_backend(dev)
    assert default_backend.cache_info().hits == hits + 1  # answered without probing again


def test_cublas_quantizes_on_the_twins_where_triton_does_not_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # select_backend picks CUBLAS on an fp8 GPU exactly when triton does not import; its
    # quantize must then not reach for the Triton kernels. Only the device is read.
    on_gpu = cast(torch.Tensor, types.SimpleNamespace(device=torch.device("cuda", 0)))
    on_cpu = torch.ones(1)
    for imports in (False, True):
        monkeypatch.setattr(fp8_backend, "triton_imports", lambda imports=imports: imports)
        assert fp8_backend.uses_kernels(Backend.CUBLAS, on_gpu) is imports
        assert fp8_backend.uses_kernels(Backend.CUBLAS, on_cpu) is False
        assert fp8_backend.uses_kernels(Backend.TRITON, on_gpu) is True
        assert fp8_backend.uses_kernels(Backend.REFERENCE, on_gpu) is False
