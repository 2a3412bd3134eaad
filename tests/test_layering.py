"""The package's layers point one way, checked on the source (AST), not by importing it.

The picture in docs/design.md is this table:

- the core (``dtypes``, ``recipes``, ``residency``, ``capability``, ``ctx`` and the package
  face) imports nothing downstream, and inside the core each module only imports the ones
  below it;
- ``fp8`` and ``memory`` read the core; ``nn`` reads the core, ``fp8`` and ``memory``;
  ``distributed`` may read all four; ``integrations`` (adapters that import a training
  framework) may read all five and nothing reads it; ``demo``/``cli`` sit on top;
- ``kernels`` imports nothing from ``computectx``, and only ``fp8`` reaches it, lazily (inside
  a function), so ``import computectx.fp8`` works without triton;
- no module imports another module's ``_private`` names, and a ``_private`` module is used
  only inside its own package.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "computectx"

# Rank inside the core: a core module imports only core modules of a lower rank.
CORE_RANK: dict[str, int] = {
    "computectx._files": 0,  # durable file writes, for every package that writes a file
    "computectx.dtypes": 0,
    "computectx.recipes": 1,
    "computectx.residency": 1,
    "computectx.capability": 1,
    "computectx.ctx": 2,
    "computectx": 3,  # the package face re-exports the core
}

# layer -> the layers it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "kernels": frozenset(),
    "fp8": frozenset({"core", "kernels"}),
    "memory": frozenset({"core"}),
    "nn": frozenset({"core", "fp8", "memory"}),
    "distributed": frozenset({"core", "fp8", "memory", "nn"}),
    "integrations": frozenset({"core", "fp8", "memory", "nn", "distributed"}),
    "app": frozenset({"core", "fp8", "memory", "nn", "distributed"}),
}
SUBPACKAGE_LAYERS = {"fp8", "memory", "nn", "distributed", "kernels", "integrations"}
APP_MODULES = {"demo", "cli", "__main__"}


def layer_of(module: str) -> str:
    """The layer a ``computectx`` module belongs to."""
    if module in CORE_RANK:
        return "core"
    first = module.split(".")[1]
    if first in SUBPACKAGE_LAYERS:
        return first
    if first in APP_MODULES:
        return "app"
    raise AssertionError(f"{module} is in no layer; add it to tests/test_layering.py")


@dataclass(frozen=True)
class Import:
    target: str  # the module imported from (absolute)
    names: tuple[str, ...]  # for `from target import a, b`; () for `import target`
    lazy: bool  # inside a function body
    line: int


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def collect_imports(source: str, module: str, is_package: bool) -> list[Import]:
    """Every ``computectx`` import in ``source``, resolved to absolute names."""
    found: list[Import] = []
    base = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "computectx":
                        found.append(Import(alias.name, (), lazy, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base[: len(base) - (child.level - 1)]
                    target = ".".join([*anchor, *([child.module] if child.module else [])])
                else:
                    target = child.module or ""
                if target.split(".")[0] == "computectx":
                    names = tuple(a.name for a in child.names)
                    found.append(Import(target, names, lazy, child.lineno))
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def _module_exists(name: str, root: Path) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private_attribute_uses(source: str, module_aliases: set[str]) -> list[tuple[int, str]]:
    """``alias._name`` where ``alias`` is an imported computectx module."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            uses.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return uses


def _private_segment_owner(target: str) -> str | None:
    """For ``a.b._c.d``, the package that owns the private module ``_c`` (``a.b``)."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def violations_of(source: str, module: str, is_package: bool, root: Path = PACKAGE) -> list[str]:
    """Every layering rule ``source`` (the module ``module``) breaks, as readable lines."""
    layer = layer_of(module)
    problems: list[str] = []
    module_aliases: set[str] = set()
    for imp in collect_imports(source, module, is_package):
        # `from pkg import mod` imports the submodule; the package itself counts only when
        # a name is not a submodule (`from computectx import ComputeCtx`).
        targets = [] if imp.names else [imp.target]
        for name in imp.names:
            sub = f"{imp.target}.{name}"
            if _module_exists(sub, root):
                targets.append(sub)
                module_aliases.add(name)
                continue
            if imp.target not in targets:
                targets.append(imp.target)
            if name.startswith("_") and not name.startswith("__") and imp.target != module:
                problems.append(
                    f"{module}:{imp.line} imports the private name {name!r} from {imp.target}"
                )
        if not imp.names:
            module_aliases.add(imp.target.split(".")[0])
        for target in targets:
            owner = _private_segment_owner(target)
            if owner is not None and not (module == owner or module.startswith(owner + ".")):
                problems.append(
                    f"{module}:{imp.line} imports the private module {target} from outside {owner}"
                )
            target_layer = layer_of(target) if target != module else layer
            if layer == "kernels" and target_layer != "kernels":
                problems.append(f"{module}:{imp.line} (kernels) imports {target}")
                continue
            if target_layer == "kernels" and layer != "kernels" and not imp.lazy:
                problems.append(
                    f"{module}:{imp.line} imports {target} at module level; kernels are "
                    f"reached lazily, inside the function that launches them"
                )
            if target_layer == layer:
                if layer == "core" and CORE_RANK[target] >= CORE_RANK[module]:
                    problems.append(
                        f"{module}:{imp.line} imports {target}, which is not below it in the core"
                    )
                continue
            if target_layer not in ALLOWED[layer]:
                problems.append(f"{module}:{imp.line} ({layer}) imports {target} ({target_layer})")
    for line, use in _private_attribute_uses(source, module_aliases):
        problems.append(f"{module}:{line} uses the private attribute {use}")
    return problems


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PACKAGE)) for p in SOURCES])
def test_module_respects_the_layers(path: Path) -> None:
    module = _module_name(path, PACKAGE)
    assert violations_of(path.read_text(), module, _is_package(path)) == []


def test_every_module_has_a_layer() -> None:
    layers = {layer_of(_module_name(p, PACKAGE)) for p in SOURCES}
    assert {"core", "kernels", "fp8", "memory", "nn", "app"} <= layers


# The checker itself must catch each kind of breach.
@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("computectx.ctx", "from computectx.fp8.ops import select_backend", "(core) imports"),
        ("computectx.dtypes", "from computectx.ctx import ComputeCtx", "not below it"),
        ("computectx.kernels.quantize", "from computectx.dtypes import DType", "(kernels)"),
        ("computectx.memory.optimizer", "import computectx.nn", "(memory) imports computectx.nn"),
        ("computectx.fp8.ops", "from computectx.kernels import quantize", "at module level"),
        ("computectx.nn.lm", "def f():\n    from computectx.kernels import quantize", "(nn)"),
        ("computectx.memory.accounting", "from computectx.dtypes import _JOIN", "private name"),
        ("computectx.nn.lm", "from computectx.memory._transfer import X", "private module"),
        ("computectx.nn.lm", "from computectx.fp8 import ops\nops._device_arg(1)", "private attr"),
        ("computectx.ctx", "from computectx import ComputeCtx", "not below it"),
    ],
)
def test_checker_catches(module: str, source: str, expected: str) -> None:
    found = violations_of(source, module, is_package=False)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("computectx.fp8.ops", "def launch():\n    from computectx.kernels import quantize"),
        ("computectx.memory.optimizer", "from computectx.memory._transfer import X"),
        ("computectx.ctx", "from computectx.dtypes import DType\nfrom computectx import recipes"),
        ("computectx.nn.lm", "from computectx.fp8 import ops\nops.fp8_quantize(1)"),
    ],
)
def test_checker_allows(module: str, source: str) -> None:
    assert violations_of(source, module, is_package=False) == []
