"""``computectx demo``: train one small LM under each precision policy and compare them.

The model is ``computectx.nn.ByteLM``; the default corpus is the Python standard library's
own source files, read byte by byte from the running interpreter, so the demo needs no
download. Every policy starts from the same weights and sees the same batches in the same
order, so the differences in the results table are the policy's doing.

The modules, one job each: ``settings`` (``DemoSettings``, torch-free), ``args`` (the flags,
torch-free), ``corpus``, ``moe`` (``--moe``: the experts' shape, their load per step, its
table and picture), ``train``, ``footprint`` (memory by role), ``serving`` (the loss through
the KV cache), ``report`` (tables, JSON, plot) and ``run`` (``run_demo``). Importing
this package loads only the torch-free two; the other names load their module, and torch, on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from computectx.demo.settings import DEFAULT_DTYPES, POLICY_FLAGS, DemoError, DemoSettings

if TYPE_CHECKING:
    from computectx.demo.corpus import MAX_DATA_BYTES, STDLIB_CORPUS_BYTES, Corpus, load_corpus
    from computectx.demo.footprint import Footprint
    from computectx.demo.report import DemoReport
    from computectx.demo.run import run_demo
    from computectx.demo.train import PolicyResult

__all__ = [
    "DEFAULT_DTYPES",
    "MAX_DATA_BYTES",
    "POLICY_FLAGS",
    "STDLIB_CORPUS_BYTES",
    "Corpus",
    "DemoError",
    "DemoReport",
    "DemoSettings",
    "Footprint",
    "PolicyResult",
    "load_corpus",
    "run_demo",
]

_LAZY = {
    "MAX_DATA_BYTES": "corpus",
    "STDLIB_CORPUS_BYTES": "corpus",
    "Corpus": "corpus",
    "load_corpus": "corpus",
    "Footprint": "footprint",
    "DemoReport": "report",
    "run_demo": "run",
    "PolicyResult": "train",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
