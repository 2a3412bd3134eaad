"""Generate docs/api.md, the API reference, from the package itself.

``python docs/gen_api.py`` writes the page; ``python docs/gen_api.py --check`` writes nothing
and exits 1, with a short diff, when the page on disk is not what the package gives now
(tests/test_api_doc.py runs the same comparison).

Each section documents one module's ``__all__``: per name, its signature (annotations printed
as written in the source, normalized by ``ast.unparse``) and the first paragraph of its
docstring; for a class, its base, its enum members or pydantic fields, and the public methods,
class methods, static methods and properties its own body (or a private base) defines.
Module-level constants and type aliases read their docstring from the string literal under
the assignment (PEP 257's attribute docstrings), found by following the ``from ... import``
chain to the defining module.
Names are ordered as the page always was: all-caps names first, then capitalized ones
(classes, type aliases), then the rest, each group in code-point order. Nothing printed
depends on the machine: a repr holding a memory address is replaced by the source
expression or the bare name.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import enum
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"

INTRO = """\
# API reference

Every public name of `computectx`, `computectx.formats`, `computectx.memory`,
`computectx.distributed` and `computectx.nn`, of `computectx.formats.seam` (what packages built
on fp8 use), and of the modules a user calls directly (the fine-grained linear, the
block-scaled GEMM, the grouped GEMM and its experts converters, expert parallelism, the KV
quantizer, decode attention, the FSDP2 fp8 all-gather, the transformers cache): its
signature and the first paragraph of its docstring, with the public methods and properties of
each class. This page reads as it is. The docs build
(`.venv/bin/mkdocs build --strict`) also renders the full docstrings from the code where a
`:::` line stands, at the end of each section.

This page is generated from the code by `docs/gen_api.py`: edit the docstrings, then run
`.venv/bin/python docs/gen_api.py` (tests/test_api_doc.py fails while the page is stale).
"""

MORE_MODULES = """\
## More modules

The capability probes (`computectx info`) and the demo (`computectx demo`), in full:

::: computectx.capability
    options:
      heading_level: 3

::: computectx.demo
    options:
      heading_level: 3
"""

CONSTANT_REPR_LIMIT = 80
"""A constant's repr longer than this is cut to this length, ending in ``...``."""


class Section(typing.NamedTuple):
    """One ``## title: `module``` section of the page."""

    module: str
    title: str
    full_reference: tuple[str, ...] | None = None
    """The ``:::`` targets at the end (default: the module); ``()`` for none."""
    skip_names_of: tuple[str, ...] = ()
    """Leave out names whose objects these modules' ``__all__`` export (documented there)."""


SECTIONS: tuple[Section, ...] = (
    Section(
        "computectx",
        "The policy",
        full_reference=(
            "computectx.ComputeCtx",
            "computectx.DType",
            "computectx.Fp8Format",
            "computectx.Residency",
            "computectx.promote",
            "computectx.promoted",
            "computectx.cast_if",
            "computectx.dtype_of",
            "computectx.available_bytes",
            "computectx.PromotionError",
        ),
    ),
    Section(
        "computectx.formats",
        "fp8",
        full_reference=(
            "computectx.formats.linear.module",
            "computectx.formats.convert",
            "computectx.formats.linear.autocast",
            "computectx.formats.scaling.layer",
            "computectx.formats.numerics.ledger",
            "computectx.formats.stats",
            "computectx.formats.backend",
            "computectx.formats.ops.blockwise",
            "computectx.recipes",
        ),
    ),
    Section("computectx.memory", "Memory"),
    Section("computectx.distributed", "Distributed"),
    Section("computectx.nn", "Model blocks"),
    Section("computectx.formats.seam", "What packages built on fp8 use"),
    Section("computectx.formats.linear.blockwise", "The fine-grained fp8 linear"),
    Section("computectx.formats.ops.tensorwise", "The tensor-wise fp8 operators"),
    Section("computectx.formats.ops.grouped", "The grouped fp8 GEMM (mixture of experts)"),
    Section("computectx.formats.convert_experts", "Converting grouped experts"),
    # `import computectx.distributed.expert_parallel as ep` gives the function the package
    # exports under that name: its public names are exported from computectx.distributed
    # (documented there); the rest are reached with `from ... import`.
    Section(
        "computectx.distributed.expert_parallel",
        "Expert parallelism's other names (`from ... import` them)",
        skip_names_of=("computectx.distributed",),
    ),
    Section("computectx.integrations.transformers_moe", "transformers MoE experts in fp8"),
    Section("computectx.integrations.torchtitan_moe", "torchtitan MoE experts in fp8"),
    Section("computectx.formats.numerics.kv_quant", "The fp8 KV cache's quantizer"),
    Section("computectx.formats.ops.attention", "Decode attention over an fp8 KV cache"),
    Section("computectx.distributed.fp8_all_gather", "FSDP2 fp8 all-gather"),
    Section("computectx.integrations.transformers_cache", "The transformers cache"),
    Section("computectx.formats.numerics.layouts", "The granularity vocabulary and block layouts"),
    Section(
        "computectx.formats.numerics.blockwise",
        "Fine-grained quantize layouts and the block GEMM's twin",
    ),
    Section("computectx.kernels.cublas", "The cuBLAS recipes"),
    Section(
        "computectx.formats.policy",
        "The fp8 entry points' ctx check",
        skip_names_of=("computectx.formats", "computectx.recipes"),
    ),
    # computectx.recipes renders in full under the fp8 section; here only what that
    # section does not list.
    Section(
        "computectx.recipes",
        "Policy granularities",
        full_reference=(),
        skip_names_of=("computectx.formats",),
    ),
)


# --- text helpers -------------------------------------------------------------------------


def first_paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring on one line, ``code`` in single backticks."""
    if not doc:
        return ""
    text = inspect.cleandoc(doc).strip()
    para = re.split(r"\n\s*\n", text, maxsplit=1)[0]
    return " ".join(line.strip() for line in para.splitlines()).replace("``", "`")


def _own_doc(obj: object) -> str | None:
    """``obj``'s own docstring (a class's is never inherited; a dataclass's generated one
    is no docstring)."""
    if isinstance(obj, type):
        doc = obj.__dict__.get("__doc__")
        generated = isinstance(doc, str) and doc.startswith(f"{obj.__name__}(")
        if dataclasses.is_dataclass(obj) and generated:
            return None
        return doc if isinstance(doc, str) else None
    doc = getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) else None


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PACKAGE_PATH = re.compile(r"\bcomputectx(?:\.\w+)*\.(\w+)")


def _clean_repr(text: str) -> str:
    """A repr without ``typing.`` and with computectx's own names unqualified."""
    text = text.replace("typing_extensions.", "").replace("typing.", "")
    return _PACKAGE_PATH.sub(r"\1", text)


def annotation_text(annotation: object) -> str:
    """An annotation as written (a string, under ``from __future__ import annotations``),
    normalized by ``ast.unparse``; an evaluated one formatted by ``type_text``."""
    if isinstance(annotation, str):
        try:
            return ast.unparse(ast.parse(annotation, mode="eval"))
        except SyntaxError:
            return annotation
    return type_text(annotation)


def public_path(cls: type) -> str:
    """The shortest importable dotted name of ``cls`` (``torch.nn.Module``); the bare name
    for computectx's own classes and builtins."""
    module = cls.__module__
    if module == "builtins" or module.split(".")[0] == "computectx":
        return cls.__qualname__
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        mod = sys.modules.get(candidate)
        if mod is not None and getattr(mod, cls.__name__, None) is cls:
            return f"{candidate}.{cls.__name__}"
    return f"{module}.{cls.__qualname__}"


def type_text(tp: object) -> str:
    """An evaluated type as it would be written: ``DType | KvFp8``, ``Literal['a']``."""
    if tp is None or tp is type(None):
        return "None"
    if tp is Ellipsis:
        return "..."
    if tp is typing.Any:
        return "Any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is typing.Union or isinstance(tp, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is not None:
        head = type_text(origin) if isinstance(origin, type) else _clean_repr(repr(origin))
        if not args:
            return head
        inner = ", ".join(
            f"[{', '.join(type_text(x) for x in a)}]" if isinstance(a, list) else type_text(a)
            for a in args
        )
        return f"{head}[{inner}]"
    if isinstance(tp, type):
        return public_path(tp)
    if isinstance(tp, typing.ForwardRef):
        return tp.__forward_arg__
    return _clean_repr(repr(tp))


def value_text(value: object) -> str:
    """A default value as code: ``DType.F32``, ``torch.optim.AdamW``, ``DelayedScaling()``."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, type):
        return public_path(value)
    if inspect.isroutine(value):
        return getattr(value, "__qualname__", getattr(value, "__name__", repr(value)))
    fields = getattr(type(value), "model_fields", None)
    if isinstance(fields, dict) and hasattr(value, "model_dump"):
        changed = []
        for name, info in fields.items():
            got = getattr(value, name)
            if info.is_required() or got != info.get_default(call_default_factory=True):
                changed.append(f"{name}={value_text(got)}")
        return f"{type(value).__name__}({', '.join(changed)})"
    text = repr(value)
    if _ADDRESS.search(text):
        return type(value).__name__
    return _clean_repr(text)


# --- signatures ---------------------------------------------------------------------------


def params_text(sig: inspect.Signature, *, drop_first: bool = False) -> str:
    """The parameter list of ``sig`` with annotations as written."""
    params = list(sig.parameters.values())
    if drop_first and params and params[0].kind is not inspect.Parameter.VAR_POSITIONAL:
        params = params[1:]
    parts: list[str] = []
    star_done = False
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            text = f"*{p.name}"
            star_done = True
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            text = f"**{p.name}"
        else:
            text = p.name
        if p.annotation is not inspect.Parameter.empty:
            text += f": {annotation_text(p.annotation)}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {value_text(p.default)}"
        parts.append(text)
        nxt = params[i + 1] if i + 1 < len(params) else None
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and (
            nxt is None or nxt.kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
    return ", ".join(parts)


def return_text(sig: inspect.Signature) -> str:
    """`` -> T``, or nothing for ``None`` and unannotated returns."""
    ret = sig.return_annotation
    if ret is inspect.Signature.empty:
        return ""
    text = annotation_text(ret)
    return "" if text == "None" else f" -> {text}"


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def callable_text(name: str, fn: Any, *, drop_first: bool = False) -> str:
    """``name(params) -> ret``."""
    sig = _signature(fn)
    if sig is None:
        return f"{name}(...)"
    return f"{name}({params_text(sig, drop_first=drop_first)}){return_text(sig)}"


_IDENT = re.compile(r"[A-Za-z_]\w*")


def typevar_note(fn: Any) -> str:
    """`` (`_Q` a type variable bound to `str`)`` for each TypeVar the signature names."""
    sig = _signature(fn)
    globs = getattr(inspect.unwrap(fn), "__globals__", None)
    if sig is None or not isinstance(globs, dict):
        return ""
    annotations = [p.annotation for p in sig.parameters.values()] + [sig.return_annotation]
    names: list[str] = []
    for ann in annotations:
        if isinstance(ann, str):
            for ident in _IDENT.findall(ann):
                if isinstance(globs.get(ident), typing.TypeVar) and ident not in names:
                    names.append(ident)
    notes = []
    for ident in names:
        tv = globs[ident]
        if tv.__bound__ is not None:
            notes.append(f"`{ident}` a type variable bound to `{type_text(tv.__bound__)}`")
        elif tv.__constraints__:
            allowed = ", ".join(f"`{type_text(c)}`" for c in tv.__constraints__)
            notes.append(f"`{ident}` a type variable constrained to {allowed}")
        else:
            notes.append(f"`{ident}` a type variable")
    return f" ({'; '.join(notes)})" if notes else ""


# --- module-level assignments and their docstrings ----------------------------------------


class Assignment(typing.NamedTuple):
    """A top-level ``NAME = expr`` of a module: the expression's source and its docstring."""

    source: str
    doc: str | None


@functools.cache
def _module_tree(module_name: str) -> tuple[dict[str, Assignment], dict[str, tuple[str, str]]]:
    """A module's top-level assignments, and its ``from X import a as b`` (``b -> (X, a)``)."""
    try:  # the spec, not sys.modules: the answer must not depend on what was imported
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    file = spec.origin if spec is not None else None
    if not file or not file.endswith(".py"):
        return {}, {}
    tree = ast.parse(Path(file).read_text(encoding="utf-8"))
    package = module_name if file.endswith("__init__.py") else module_name.rpartition(".")[0]
    assigned: dict[str, Assignment] = {}
    imported: dict[str, tuple[str, str]] = {}
    body = tree.body
    for i, node in enumerate(body):
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and value is not None:
            doc = None
            nxt = body[i + 1] if i + 1 < len(body) else None
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                doc = nxt.value.value
            assigned[target.id] = Assignment(ast.unparse(value), doc)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                imported[alias.asname or alias.name] = (base, alias.name)
    return assigned, imported


def find_assignment(module_name: str, name: str) -> Assignment | None:
    """Where ``module_name.name`` was assigned, following ``from ... import`` chains."""
    seen: set[tuple[str, str]] = set()
    while (module_name, name) not in seen:
        seen.add((module_name, name))
        assigned, imported = _module_tree(module_name)
        if name in assigned:
            return assigned[name]
        if name not in imported:
            return None
        module_name, name = imported[name]
    return None


# --- entries ------------------------------------------------------------------------------


def _is_type_alias(obj: object) -> bool:
    if isinstance(obj, type):
        return False
    return typing.get_origin(obj) is not None or isinstance(obj, types.UnionType)


def _block(head: str, doc: str | None, extra: Sequence[str] = ()) -> list[str]:
    lines = [head, ""]
    para = first_paragraph(doc)
    if para:
        lines += [para, ""]
    for item in extra:
        lines += [item, ""]
    return lines


def _private_base(base: type) -> bool:
    """Whether ``base`` is computectx's and private: its name, or a module on its path
    (``computectx.memory.optim._wrapper``), starts with ``_``."""
    module = base.__module__
    if module.split(".")[0] != "computectx":
        return False
    return any(part.startswith("_") for part in [*module.split("."), base.__name__])


def member_lines(cls: type) -> list[str]:
    """The ``- method(...)`` bullets of the public callables and properties ``cls`` defines
    (itself or through a private base), in definition order."""
    out: list[str] = []
    # A private base's members read as the class's own (the page never names that base).
    scanned = [cls]
    for base in cls.__mro__[1:]:
        if not _private_base(base):
            break
        scanned.append(base)
    defined: dict[str, object] = {}
    for owner in reversed(scanned):
        defined.update(vars(owner))
    for name, attr in defined.items():
        if name.startswith("_"):
            continue
        if isinstance(attr, property | functools.cached_property):
            fget = attr.fget if isinstance(attr, property) else attr.func
            ret = getattr(fget, "__annotations__", {}).get("return")
            head = f"{name}: {annotation_text(ret)}" if ret is not None else name
            line, doc = f"- `{head}` (property)", attr.__doc__
        elif isinstance(attr, classmethod):
            fn = attr.__func__
            line = f"- `{callable_text(name, fn, drop_first=True)}` (class method)"
            doc = fn.__doc__
        elif isinstance(attr, staticmethod):
            fn = attr.__func__
            line, doc = f"- `{callable_text(name, fn)}` (static)", fn.__doc__
        elif inspect.isfunction(attr):
            line, doc = f"- `{callable_text(name, attr, drop_first=True)}`", attr.__doc__
        else:
            continue
        para = first_paragraph(doc)
        out.append(f"{line}: {para}" if para else line)
    return out


def _display_bases(cls: type) -> list[type]:
    """The direct bases worth naming; a private base stands for its first public ancestor."""
    shown: list[type] = []
    for base in cls.__bases__:
        if base in (object, typing.Generic) or getattr(base, "_is_protocol", False):
            continue
        while (base.__name__.startswith("_") or _private_base(base)) and base.__bases__:
            base = base.__bases__[0]
        if base is not object and base not in shown:
            shown.append(base)
    return shown


def _pydantic_fields(cls: type) -> str:
    fields: dict[str, Any] = getattr(cls, "model_fields", {})
    parts = []
    for name, info in fields.items():
        text = f"{name}: {type_text(info.annotation)}"
        if not info.is_required():
            if info.default_factory is not None:
                factory = info.default_factory
                if info.default_factory_takes_validated_data:
                    default = f"{value_text(factory)}(...)"
                else:
                    default = value_text(factory())
            else:
                default = value_text(info.default)
            text += f" = {default}"
        bounds = []
        for meta in info.metadata:
            for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                if hasattr(meta, attr) and type(meta).__name__.lower() == attr:
                    bounds.append(f"{sign} {getattr(meta, attr)!r}")
            if type(meta).__name__ == "MultipleOf":
                bounds.append(f"multiple of {meta.multiple_of!r}")
        if bounds:
            text += f" ({', '.join(bounds)})"
        parts.append(text)
    return f"*, {', '.join(parts)}" if parts else ""


def class_lines(name: str, cls: type) -> list[str]:
    """A class's signature line, first docstring paragraph and member bullets."""
    doc = _own_doc(cls)
    extra: list[str] = []
    if issubclass(cls, enum.Enum):
        enum_bases = ", ".join(public_path(b) for b in cls.__bases__ if issubclass(b, enum.Enum))
        head = f"`class {name}({enum_bases})`"
        extra.append(f"Members: {', '.join(f'`{m.name}`' for m in cls)}.")
    elif issubclass(cls, BaseException):
        head = f"`class {name}({', '.join(public_path(b) for b in cls.__bases__)})`"
    elif getattr(cls, "_is_protocol", False):
        head = f"`class {name}(Protocol)`"
        call = vars(cls).get("__call__")
        sig = _signature(call) if inspect.isfunction(call) else None
        if sig is not None:
            head += f": called as `({params_text(sig, drop_first=True)}){return_text(sig)}`"
    else:
        if hasattr(cls, "model_fields") and hasattr(cls, "model_validate"):
            params = _pydantic_fields(cls)
        else:
            sig = _signature(cls)
            params = params_text(sig) if sig is not None else "..."
        head = f"`class {name}({params})`"
        shown = _display_bases(cls)
        if shown:
            head += ", " + " and ".join(f"a `{public_path(b)}`" for b in shown)
    members = member_lines(cls)
    return _block(head, doc, extra) + ([*members, ""] if members else [])


def entry_lines(module_name: str, name: str, obj: object) -> list[str]:
    """The ``### `name``` entry of one public name."""
    lines = [f"### `{name}`", ""]
    if isinstance(obj, type):
        return lines + class_lines(name, obj)
    found = find_assignment(module_name, name)
    if _is_type_alias(obj):
        text = _clean_repr(repr(obj))
        if _ADDRESS.search(text):
            text = found.source if found is not None else name
        return lines + _block(f"`{name} = {text}` (a type)", found.doc if found else None)
    if callable(obj) and not isinstance(obj, types.ModuleType):
        head = f"`{callable_text(name, obj)}`{typevar_note(obj)}"
        return lines + _block(head, _own_doc(obj))
    text = repr(obj)
    if _ADDRESS.search(text):
        text = name
    else:
        text = _clean_repr(text)
        if len(text) > CONSTANT_REPR_LIMIT:
            text = text[: CONSTANT_REPR_LIMIT - 3] + "..."
    return lines + _block(f"`{name} = {text}`", found.doc if found else None)


def sort_key(name: str) -> tuple[int, str]:
    """All-caps names, then capitalized ones, then the rest; code-point order in each."""
    if name.isupper():
        return (0, name)
    return (1, name) if name[:1].isupper() else (2, name)


def _exports(module_name: str) -> dict[str, object]:
    module = importlib.import_module(module_name)
    names: Sequence[str] = module.__all__
    return {name: getattr(module, name) for name in names}


def section_lines(section: Section) -> list[str]:
    module = importlib.import_module(section.module)
    lines = [f"## {section.title}: `{section.module}`", ""]
    para = first_paragraph(module.__doc__)
    if para:
        lines += [para, ""]
    skip = {id(obj) for other in section.skip_names_of for obj in _exports(other).values()}
    exports = _exports(section.module)
    for name in sorted(exports, key=sort_key):
        obj = exports[name]
        if id(obj) in skip:
            continue
        lines += entry_lines(section.module, name, obj)
    targets = (section.module,) if section.full_reference is None else section.full_reference
    if targets:
        lines += [f"### The full reference of `{section.module}`", ""]
        for target in targets:
            lines += [f"::: {target}", "    options:", "      heading_level: 4", ""]
    return lines


def render() -> str:
    """The whole page."""
    lines = [INTRO]
    for section in SECTIONS:
        lines += section_lines(section)
    return "\n".join(lines) + "\n" + MORE_MODULES


def main(argv: Sequence[str] | None = None, output: Path | str | None = None) -> int:
    """Write the page to ``output`` (default docs/api.md); with ``--check``, write nothing
    and return 1, printing a short diff, when ``output`` differs from what ``render`` gives."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if the page is stale")
    args = parser.parse_args(argv)
    path = Path(output) if output is not None else API_MD
    text = render()
    if not args.check:
        path.write_text(text, encoding="utf-8")
        return 0
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current == text:
        return 0
    diff = list(
        difflib.unified_diff(
            current.splitlines(),
            text.splitlines(),
            fromfile=f"{path} (on disk)",
            tofile=f"{path} (generated)",
            lineterm="",
            n=1,
        )
    )
    shown = diff[:40]
    print("\n".join(shown))
    if len(diff) > len(shown):
        print(f"... ({len(diff) - len(shown)} more diff lines)")
    print(f"{path} is stale: run `.venv/bin/python docs/gen_api.py`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
