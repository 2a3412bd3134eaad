"""The package's layers point one way, checked on the source (AST), not by importing it.

The picture in docs/design.md is this table:

- the core (``dtypes``, ``kv_policy``, ``optim_state``, ``activations``, ``recipes``,
  ``residency``, ``capability``, ``ctx`` and the package face) imports nothing downstream,
  and inside the core each module only imports the ones below it;
- ``formats`` and ``memory`` read the core; ``nn`` reads the core, ``formats`` and ``memory``;
  ``distributed`` may read all four; ``integrations`` (adapters that import a training
  framework) may read all five and nothing reads it; ``demo``/``cli`` sit on top;
- ``kernels`` imports nothing from ``computectx``, and only ``formats`` reaches it, lazily (inside
  a function), so ``import computectx.formats`` works without triton; the one exception is the
  compact optimizer step's native CPU kernel (``NATIVE_HOST_STEP``), reached lazily by the one
  module that launches it;
- no module imports another module's ``_private`` names, and a ``_private`` module is used
  only inside its own package;
- inside ``formats`` the rooms import downwards only (``FP8_RANK``): ``backend``, then the
  twins (``numerics``), ``policy``, the operators (``ops``), the scaling state (``scaling``),
  ``linear`` and ``serving``, the report, ``convert_experts``, then ``convert``/``stats``
  and the two doors; only the operator families, ``formats.ops.*``, reach ``kernels``;
- outside ``formats`` a module imports fp8 only through its two doors, ``computectx.formats`` (the
  public face) and ``computectx.formats.seam``;
- no import cycle anywhere in the package, counting imports inside functions and under
  ``TYPE_CHECKING``;
- a module reads in one sitting (aim at 400 lines, at most 500) and no function is over 100
  lines; a folder holds as many modules as its concept needs.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "computectx"

# Rank inside the core: a core module imports only core modules of a lower rank.
CORE_RANK: dict[str, int] = {
    "computectx._files": 0,  # durable file writes, for every package that writes a file
    "computectx._checks": 0,  # what counts as an integer; pydantic's errors in our words
    "computectx.dtypes": 0,
    "computectx.recipes": 1,
    "computectx.kv_policy": 1,  # the fp8 KV cache setting (KvFp8, parse_kv)
    "computectx.optim_state": 1,  # how optimizer state is stored (OptimState)
    "computectx.activations": 1,  # how the backward keeps activations (Activations)
    "computectx.residency": 1,
    "computectx.capability": 1,
    "computectx.offload": 1,  # activations kept in host memory (Offloaded, Streams)
    "computectx.saved": 2,  # what an op keeps for its backward (saved_call)
    "computectx.fp4_recipe": 2,  # the 4-bit recipes (Fp4Recipe) and the union with fp8's
    "computectx.flags": 3,  # the --dtype flags: each flag's compute dtype and recipe
    "computectx.ctx": 4,
    "computectx": 5,  # the package face re-exports the core
}

# layer -> the layers it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "kernels": frozenset(),
    "formats": frozenset({"core", "kernels"}),
    "memory": frozenset({"core"}),
    "nn": frozenset({"core", "formats", "memory"}),
    "distributed": frozenset({"core", "formats", "memory", "nn"}),
    "integrations": frozenset({"core", "formats", "memory", "nn", "distributed"}),
    "app": frozenset({"core", "formats", "memory", "nn", "distributed"}),
}
# Rank of each room of fp8 (by the module's path under computectx.formats): a module imports
# fp8 modules of its own room (no cycles) or of a lower rank.
FP8_RANK: dict[str, int] = {
    "backend": 0,
    "numerics": 1,
    "policy": 2,
    "serving": 2,  # ServingWeight: codes and steps as serving formats lay them out
    "ops": 3,
    "scaling": 4,
    "linear": 5,
    "convert_report": 6,
    "convert_experts": 7,
    "convert": 8,
    "exchange": 8,  # serving_weights: the codes and steps a converted model serves with
    "stats": 8,
    "seam": 9,
    "": 10,  # the package face, computectx.formats itself
}
FP8_DOORS = frozenset({"computectx.formats", "computectx.formats.seam"})
KERNEL_LAUNCHERS = "computectx.formats.ops."  # the operator families, each launching its own
# (launcher, kernel): the compact-state Adam step's C++ kernel, launched by the fused update.
NATIVE_HOST_STEP = ("computectx.memory.optim.fused", "computectx.kernels.host_adam")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100

SUBPACKAGE_LAYERS = {"formats", "memory", "nn", "distributed", "kernels", "integrations"}
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


def fp8_room(module: str) -> str:
    """The room of an fp8 module: the first part of its path under ``computectx.formats``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def fp8_rank(module: str) -> int:
    room = fp8_room(module)
    if room not in FP8_RANK:
        raise AssertionError(f"{module} is in no fp8 room; add it to FP8_RANK")
    return FP8_RANK[room]


@dataclass(frozen=True)
class Import:
    target: str  # the module imported from (absolute)
    names: tuple[str, ...]  # for `from target import a, b`; () for `import target`
    lazy: bool  # inside a function body
    line: int
    aliases: tuple[str, ...] = ()  # the local names bound: asname or name, per name


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


# Every check reads the same ~190 modules: each source is parsed and walked once per session
# (the trees are only read), not once per check.
@cache
def _tree(source: str) -> ast.Module:
    return ast.parse(source)


@cache
def _nodes(source: str) -> tuple[ast.AST, ...]:
    """Every node of ``source``, in ``ast.walk``'s order."""
    return tuple(ast.walk(_tree(source)))


@cache
def collect_imports(source: str, module: str, is_package: bool) -> tuple[Import, ...]:
    """Every ``computectx`` import in ``source``, resolved to absolute names."""
    found: list[Import] = []
    base = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "computectx":
                        bound = alias.asname or alias.name.split(".")[0]
                        found.append(Import(alias.name, (), lazy, child.lineno, (bound,)))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base[: len(base) - (child.level - 1)]
                    target = ".".join([*anchor, *([child.module] if child.module else [])])
                else:
                    target = child.module or ""
                if target.split(".")[0] == "computectx":
                    names = tuple(a.name for a in child.names)
                    bound_names = tuple(a.asname or a.name for a in child.names)
                    found.append(Import(target, names, lazy, child.lineno, bound_names))
            visit(child, inner)

    visit(_tree(source), False)
    return tuple(found)


@cache
def _module_exists(name: str, root: Path) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private_attribute_uses(source: str, module_aliases: set[str]) -> list[tuple[int, str]]:
    """``alias._name`` where ``alias`` is an imported computectx module."""
    uses = []
    for node in _nodes(source):
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
        for name, bound in zip(imp.names, imp.aliases if imp.names else (), strict=True):
            sub = f"{imp.target}.{name}"
            if _module_exists(sub, root):
                targets.append(sub)
                module_aliases.add(bound)
                continue
            if (
                imp.target == "computectx.formats"
                and layer not in ("formats", "kernels")
                and name not in _fp8_face(root)
            ):
                problems.append(
                    f"{module}:{imp.line} imports {name!r} from computectx.formats, which does not "
                    f"export it (its __all__, or computectx.formats.seam)"
                )
            if imp.target not in targets:
                targets.append(imp.target)
            if name.startswith("_") and not name.startswith("__") and imp.target != module:
                problems.append(
                    f"{module}:{imp.line} imports the private name {name!r} from {imp.target}"
                )
        if not imp.names:
            module_aliases.update(imp.aliases or (imp.target.split(".")[0],))
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
            if (module, target) == NATIVE_HOST_STEP:
                continue
            if (
                target_layer == "kernels"
                and layer == "formats"
                and not module.startswith(KERNEL_LAUNCHERS)
            ):
                problems.append(
                    f"{module}:{imp.line} imports {target}; only {KERNEL_LAUNCHERS}* launch kernels"
                )
            if (
                target_layer == "formats"
                and layer not in ("formats", "kernels")
                and target not in FP8_DOORS
            ):
                problems.append(
                    f"{module}:{imp.line} imports {target}, deep inside fp8; import it from "
                    f"computectx.formats or computectx.formats.seam"
                )
            if layer == target_layer == "formats" and target != module:
                mine, theirs = fp8_rank(module), fp8_rank(target)
                if theirs > mine or (theirs == mine and fp8_room(target) != fp8_room(module)):
                    problems.append(
                        f"{module}:{imp.line} imports {target}: fp8's rooms import downwards "
                        f"only (tests/test_layering.py, FP8_RANK)"
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
    if layer not in ("formats", "kernels"):
        for line, chain in _deep_fp8_attributes(source, module, is_package, root):
            problems.append(
                f"{module}:{line} reaches {chain}, deep inside fp8; use computectx.formats or "
                f"computectx.formats.seam"
            )
    return problems


@cache
def _fp8_face(root: Path) -> frozenset[str]:
    """The names ``computectx.formats`` exports (its ``__all__``, read from the source)."""
    tree = _tree((root / "formats" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for an attribute chain rooted at a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _deep_fp8_attributes(
    source: str, module: str, is_package: bool, root: Path
) -> list[tuple[int, str]]:
    """Attribute chains that reach a module inside fp8 (other than its doors) through a name
    bound to ``computectx`` or ``computectx.formats`` (``computectx.formats.ops.tensorwise.f``)."""
    bound: dict[str, str] = {}  # local name -> the module it stands for
    for imp in collect_imports(source, module, is_package):
        if not imp.names:
            name = imp.aliases[0] if imp.aliases else imp.target.split(".")[0]
            bound[name] = imp.target if name != imp.target.split(".")[0] else name
        else:
            for name, alias in zip(imp.names, imp.aliases if imp.names else (), strict=True):
                if _module_exists(f"{imp.target}.{name}", root):
                    bound[alias] = f"{imp.target}.{name}"
    found: list[tuple[int, str]] = []
    for node in _nodes(source):
        if not isinstance(node, ast.Attribute) or (chain := _dotted(node)) is None:
            continue
        head, _, rest = chain.partition(".")
        if head not in bound or not rest:
            continue
        full = f"{bound[head]}.{rest}"
        parts = full.split(".")
        for i in range(3, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix.startswith("computectx.formats.") and prefix not in FP8_DOORS:
                if _module_exists(prefix, root):
                    found.append((node.lineno, prefix))
                break
    return sorted(set(found))


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PACKAGE)) for p in SOURCES])
def test_module_respects_the_layers(path: Path) -> None:
    module = _module_name(path, PACKAGE)
    assert violations_of(path.read_text(), module, _is_package(path)) == []


def test_every_module_has_a_layer() -> None:
    layers = {layer_of(_module_name(p, PACKAGE)) for p in SOURCES}
    assert {"core", "kernels", "formats", "memory", "nn", "app"} <= layers


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the computectx modules it imports, every import counted (module level,
    inside functions, under ``TYPE_CHECKING``); ``from pkg import mod`` is an edge to
    ``pkg.mod`` only (a package's ``__init__`` runs first, but that is not an import of it)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        edges: set[str] = set()
        for imp in collect_imports(path.read_text(), module, _is_package(path)):
            names = [n for n in imp.names if _module_exists(f"{imp.target}.{n}", root)]
            edges.update(f"{imp.target}.{n}" for n in names)
            if not imp.names or len(names) < len(imp.names):
                edges.add(imp.target)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_no_import_cycle_anywhere_in_the_package() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_counts_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "computectx"
    (pkg / "formats").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "formats" / "__init__.py").write_text("")
    (pkg / "formats" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from computectx.formats.b import X\n"
    )
    (pkg / "formats" / "b.py").write_text("def f():\n    from computectx.formats import a\n")
    graph = import_graph(pkg)
    assert graph["computectx.formats.a"] == {"computectx.formats.b"}
    assert graph["computectx.formats.b"] == {"computectx.formats.a"}
    assert find_cycle(graph) is not None


# The checker itself must catch each kind of breach.
@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("computectx.ctx", "from computectx.formats.ops import select_backend", "(core) imports"),
        ("computectx.dtypes", "from computectx.ctx import ComputeCtx", "not below it"),
        ("computectx.kernels.quantize", "from computectx.dtypes import DType", "(kernels)"),
        (
            "computectx.memory.optim.offloaded",
            "import computectx.nn",
            "(memory) imports computectx.nn",
        ),
        ("computectx.formats.ops", "from computectx.kernels import quantize", "at module level"),
        ("computectx.nn.lm", "def f():\n    from computectx.kernels import quantize", "(nn)"),
        ("computectx.memory.accounting", "from computectx.dtypes import _JOIN", "private name"),
        ("computectx.nn.lm", "from computectx.memory._transfer import X", "private module"),
        (
            "computectx.nn.lm",
            "from computectx.formats import ops\nops._device_arg(1)",
            "private attr",
        ),
        ("computectx.ctx", "from computectx import ComputeCtx", "not below it"),
        (
            "computectx.nn.lm",
            "from computectx.formats.ops.blockwise import quantize_tensor",
            "deep",
        ),
        ("computectx.distributed.parallel", "from computectx.formats.scaling import layer", "deep"),
        (
            "computectx.formats.numerics.ledger",
            "from computectx.formats.ops import tensorwise",
            "down",
        ),
        (
            "computectx.formats.ops.blockwise",
            "from computectx.formats.linear.weights import X",
            "down",
        ),
        (
            "computectx.formats.scaling.saved",
            "from computectx.formats.linear import module",
            "down",
        ),
        (
            "computectx.formats.linear.module",
            "def f():\n    from computectx.kernels import x",
            "only",
        ),
        (
            "computectx.nn.lm",
            "import computectx.formats\ncomputectx.formats.ops.tensorwise.f()",
            "deep",
        ),
        (
            "computectx.nn.lm",
            "from computectx import formats\nformats.numerics.tensorwise.amax",
            "deep",
        ),
        ("computectx.nn.lm", "from computectx.formats import custom_ops", "does not export"),
        ("computectx.nn.lm", "from computectx.formats import redirect", "does not export"),
        ("computectx.nn.lm", "import computectx.formats.seam as s\ns._x", "private attr"),
        ("computectx.nn.lm", "from computectx.formats import seam as s\ns._x", "private attr"),
    ],
)
def test_checker_catches(module: str, source: str, expected: str) -> None:
    found = violations_of(source, module, is_package=False)
    assert any(expected in p for p in found), found


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("computectx.memory.optim.offloaded", "from computectx.memory._transfer import X"),
        ("computectx.ctx", "from computectx.dtypes import DType\nfrom computectx import recipes"),
        ("computectx.nn.lm", "from computectx.formats.seam import quantize_kv"),
        ("computectx.nn.lm", "import computectx.formats\ncomputectx.formats.QuantizedLinear"),
        ("computectx.nn.lm", "from computectx import formats\nformats.seam.quantize_kv"),
        (
            "computectx.formats.ops.tensorwise",
            "def launch():\n    from computectx.kernels import quantize",
        ),
        ("computectx.formats.linear.module", "from computectx.formats.ops import tensorwise"),
        (
            "computectx.formats.ops.grouped",
            "from computectx.formats.ops.blockwise import quantize_blocks",
        ),
    ],
)
def test_checker_allows(module: str, source: str) -> None:
    assert violations_of(source, module, is_package=False) == []


# One home for each vocabulary: a search of the package's source for a second definition.
FP8_SET = frozenset({"float8_e4m3fn", "float8_e5m2"})
FLOAT_SET = frozenset({"bfloat16", "float16", "float32"})
DTYPE_SET_HOMES = {"dtypes.py", "kernels/fp8_codes.py"}  # kernels may import nothing else
OPERATOR_FAMILIES = "formats/ops/"  # each family module registers its own operators
REGISTERING = frozenset(
    {"custom_op", "register_fake", "register_kernel", "triton_op", "Library", "register_autograd"}
)
GRANULARITY_HOMES = {"recipes.py", "formats/numerics/layouts.py"}
GRANULARITY_WORDS = frozenset({"tensor", "row", "block", "1x128", "128x128", "mx"})


def _dtype_collections(source: str) -> list[tuple[int, frozenset[str]]]:
    """Tuple, list and set literals of ``torch.<dtype>`` attributes, by line."""
    found = []
    for node in _nodes(source):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
            names = [
                e.attr
                for e in node.elts
                if isinstance(e, ast.Attribute)
                and isinstance(e.value, ast.Name)
                and e.value.id == "torch"
            ]
            if len(names) == len(node.elts):
                found.append((node.lineno, frozenset(names)))
    return found


def _where(predicate: object) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for path in SOURCES:
        rel = str(path.relative_to(PACKAGE))
        lines = predicate(path.read_text())  # type: ignore[operator]
        if lines:
            out[rel] = lines
    return out


def test_each_dtype_set_is_written_once() -> None:
    for wanted in (FP8_SET, FLOAT_SET):
        places = _where(
            lambda src, w=wanted: [line for line, s in _dtype_collections(src) if s == w]
        )
        assert set(places) <= DTYPE_SET_HOMES, f"{sorted(wanted)} written in {places}"


def test_the_kernels_dtype_sets_are_the_cores() -> None:
    from computectx import dtypes
    from computectx.kernels import fp8_codes

    assert fp8_codes.FP8_DTYPES == dtypes.FP8_DTYPES
    assert fp8_codes.FLOAT_DTYPES == dtypes.FLOAT_DTYPES


OPERATOR_FAMILY_OPS = {
    "formats/ops/tensorwise.py": {
        "fp8_quantize_delayed",
        "fp8_quantize_dynamic",
        "fp8_quantize_with_step",
        "fp8_scaled_mm",
        "fp8_dequantize",
        "wgrad_float32",
    },
    "formats/ops/blockwise.py": {"fp8_quantize_blocks", "fp8_block_scaled_mm"},
    "formats/ops/grouped.py": {"fp8_grouped_mm", "fp8_held_grouped_mm", "fp8_grouped_wgrad"},
    "formats/ops/attention.py": {"fp8_decode_attention"},
    "formats/ops/fp4.py": {
        "fp4_quantize",
        "fp4_scaled_mm",
        "fp4_grouped_mm",
        "fp4_grouped_wgrad",
        "fp4_quantize_rows",
        "fp4_dequantize",
    },
    "formats/ops/fp4_grouped_frozen.py": {"fp4_dequantize_experts"},
    "formats/ops/fp4_grouped_gathered.py": {"fp4_grouped_mm_gathered"},
}


def test_every_operator_is_registered_in_its_family_module() -> None:
    def registrations(src: str) -> list[int]:
        # Any mention of torch.library's registering names, however imported, and any
        # import from torch.library.
        lines = []
        for node in _nodes(src):
            if not isinstance(node, (ast.Attribute, ast.Name, ast.ImportFrom)):
                continue
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.id
                if isinstance(node, ast.Name)
                else None
            )
            if name in REGISTERING or (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.library")
            ):
                lines.append(node.lineno)
        return lines

    places = set(_where(registrations))
    assert all(p.startswith(OPERATOR_FAMILIES) for p in places), places
    assert places == set(OPERATOR_FAMILY_OPS)

    # Each family registers its own operators, and their names never change (saved graphs
    # and docs name them).
    def names(src: str) -> list[str]:
        return [
            node.value.removeprefix("computectx::")
            for node in _nodes(src)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("computectx::")
        ]

    for rel, wanted in OPERATOR_FAMILY_OPS.items():
        assert set(names((PACKAGE / rel).read_text())) == wanted, rel


def test_only_the_operator_families_call_torch_ops_computectx() -> None:
    # Every other module calls the families' functions, so importing one is what registers
    # the operators it uses (a torch.ops.computectx call hides that dependency).
    def calls(src: str) -> list[int]:
        return [
            node.lineno
            for node in _nodes(src)
            if isinstance(node, ast.Attribute) and _dotted(node) == "torch.ops.computectx"
        ]

    assert all(p.startswith(OPERATOR_FAMILIES) for p in _where(calls))


def test_no_module_in_the_package_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in SOURCES
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str, int]]:
    """Every function in ``source`` (``def`` or ``async def``, methods and nested functions
    too) longer than ``limit`` lines, from its ``def`` line to its last, docstring counted:
    (line, name, length)."""
    return [
        (node.lineno, node.name, length)
        for node in _nodes(source)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > limit
    ]


def test_no_function_in_the_package_is_over_100_lines() -> None:
    places = _where(lambda src: [f"{name}:{line} ({n})" for line, name, n in long_functions(src)])
    assert places == {}, f"functions over {MAX_FUNCTION_LINES} lines: {places}"


def test_the_function_length_check_finds_a_long_function() -> None:
    def lines(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    limit = MAX_FUNCTION_LINES
    # The def line and 100 lines of body: 101 lines, one too many; 100 in all is allowed.
    assert long_functions(f"def f():\n{lines(limit, '    ')}") == [(1, "f", limit + 1)]
    assert long_functions(f"def f():\n{lines(limit - 1, '    ')}") == []
    # Methods, async functions and nested functions are measured too.
    nested = f"class C:\n    async def m(self):\n        def inner():\n{lines(limit, ' ' * 12)}"
    assert sorted(name for _, name, _ in long_functions(nested)) == ["inner", "m"]


def test_the_granularity_vocabulary_is_defined_once() -> None:
    def literal_aliases(src: str) -> list[int]:
        lines = []
        for node in _nodes(src):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            value = node.value
            if (
                isinstance(value, ast.Subscript)
                and isinstance(value.value, ast.Name)
                and value.value.id == "Literal"
            ):
                words = {
                    e.value
                    for e in ast.walk(value.slice)
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                }
                if len(words & GRANULARITY_WORDS) >= 2:
                    lines.append(node.lineno)
        return lines

    places = _where(literal_aliases)
    assert set(places) == GRANULARITY_HOMES, places


def test_the_one_home_checks_find_a_copy() -> None:
    copy = "X = (torch.float8_e4m3fn, torch.float8_e5m2)\n"
    assert _dtype_collections(copy) == [(1, FP8_SET)]
    assert _dtype_collections("y = (torch.bfloat16, torch.float16)\n") == [
        (1, frozenset({"bfloat16", "float16"}))
    ]
