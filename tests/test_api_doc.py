"""docs/api.md is what docs/gen_api.py generates from the package as it is now."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "docs" / "gen_api.py"
API_MD = ROOT / "docs" / "api.md"


@pytest.fixture(scope="module")
def gen_api() -> Any:
    """docs/gen_api.py, loaded by path (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("computectx_docs_gen_api", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rendered(gen_api: Any) -> str:
    text: str = gen_api.render()
    return text


def test_api_md_is_what_the_generator_writes(rendered: str) -> None:
    assert rendered == API_MD.read_text(encoding="utf-8"), (
        "docs/api.md is stale: run `.venv/bin/python docs/gen_api.py` and commit the result"
    )


def test_the_page_holds_a_known_signature(rendered: str) -> None:
    assert (
        "### `convert_to_quantized`\n\n`convert_to_quantized(model: nn.Module, ctx: ComputeCtx, "
        in rendered
    )
    assert "min_features: int | None = None" in rendered
    assert "## What packages built on fp8 use: `computectx.formats.seam`" in rendered
    assert " at 0x" not in rendered


def test_check_fails_on_a_stale_page_and_passes_on_a_fresh_one(
    gen_api: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "api.md"
    page.write_text("# API reference\n\nstale\n", encoding="utf-8")
    assert gen_api.main(["--check"], page) == 1
    assert "stale" in capsys.readouterr().err
    assert page.read_text(encoding="utf-8") == "# API reference\n\nstale\n"
    assert gen_api.main([], page) == 0
    assert gen_api.main(["--check"], page) == 0
