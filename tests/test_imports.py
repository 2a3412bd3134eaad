"""``import computectx`` works without triton, and never imports it eagerly."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = "computectx, computectx.formats, computectx.memory, computectx.nn, computectx.cli"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_every_public_package_imports_without_triton() -> None:
    # A None entry in sys.modules makes `import triton` raise ImportError, as on a machine
    # without it.
    res = _run(
        "import sys; sys.modules['triton'] = None\n"
        f"import {MODULES}\n"
        "from computectx.cli import info_lines\n"
        "print('\\n'.join(info_lines()))\n"
    )
    assert res.returncode == 0, res.stderr
    assert "triton              no   the triton package is not installed" in res.stdout
    assert "fp8 backend: reference" in res.stdout


@pytest.fixture(scope="module")
def imported() -> list[str]:
    """One fresh interpreter (with triton installed) for the two tests below: first
    ``import computectx`` and an fp8 policy, then every public package. Its lines: the
    computectx modules loaded after the first step, then the triton and the kernels modules
    loaded after the second."""
    res = _run(
        "import sys\nimport computectx\n"
        "computectx.ComputeCtx.from_flag('fp8_hybrid', 'cpu')\n"
        "print(sorted(m for m in sys.modules if m.startswith('computectx')))\n"
        f"import {MODULES}\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))\n"
        "print(sorted(m for m in sys.modules if m.startswith('computectx.kernels')))\n"
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def test_importing_computectx_does_not_import_triton(imported: list[str]) -> None:
    assert imported[1:] == ["[]", "[]"], imported


def test_importing_the_core_loads_nothing_downstream(imported: list[str]) -> None:
    # The AST test (test_layering.py) checks the import statements; this checks the effect:
    # `import computectx` and building an fp8 policy load only core modules.
    assert imported[0].split() == [
        "['computectx',",
        "'computectx._checks',",
        "'computectx.activations',",
        "'computectx.ctx',",
        "'computectx.dtypes',",
        "'computectx.flags',",
        "'computectx.fp4_recipe',",
        "'computectx.kv_policy',",
        "'computectx.offload',",
        "'computectx.optim_state',",
        "'computectx.recipes',",
        "'computectx.residency',",
        "'computectx.saved']",
    ]
