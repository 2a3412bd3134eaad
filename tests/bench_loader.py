"""``load_bench(name)``: a script of ``bench/`` as a module, for tests of its own figures.

The benches are scripts, not a package; a test that holds a bench's measures to their targets
loads the file once per process (``sys.modules`` keeps it: dataclasses look their module up
while the file runs, and a second load would give a second set of classes).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py``, loaded as the module ``name``."""
    if name in sys.modules:
        return sys.modules[name]
    path = BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
