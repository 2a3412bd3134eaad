"""Partial stub of transformers.integrations (5.24.0): only the ``moe`` submodule is
declared; see ../__init__.pyi."""

from typing import Any

def __getattr__(name: str) -> Any: ...
