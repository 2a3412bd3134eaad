"""The test command installs the frameworks, pinned, so CI runs every recipe (nothing skips)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_ci_command_installs_the_integrations_extra_with_dev() -> None:
    assert '-e ".[dev,integrations]"' in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("extra", ["dev", "integrations"])
def test_the_extras_pin_exact_releases(extra: str) -> None:
    # Ranges let pip's resolver walk through old releases (dev + integrations spun for more
    # than 11 minutes over old ruff releases); exact pins resolve at once. triton follows
    # the torch build (a CUDA torch pins its own).
    loose = [r for r in EXTRAS[extra] if "==" not in r and not r.startswith("triton")]
    assert loose == [], loose


def test_torchtitan_comes_with_triton() -> None:
    assert any(r.startswith("triton") for r in EXTRAS["integrations"])  # torchtitan imports it


@pytest.mark.parametrize("module", ["accelerate", "lightning.fabric", "torchtitan", "transformers"])
def test_the_test_install_has_every_framework(module: str) -> None:
    # The test command installs them, so a missing framework is a failure here, not the
    # skip the recipe tests would give (CI sets no variable this could read: unconditional).
    try:
        importlib.import_module(module)
    except ImportError as e:
        extras = 'pip install -e ".[dev,integrations]"'
        pytest.fail(f"{module} is missing: install the test extras, {extras} ({e})")
