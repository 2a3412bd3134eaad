"""The ``computectx demo`` flags, built from ``DemoSettings``' fields (no torch import).

Every flag is a field: its name, help (the field's docstring) and default come from
``DemoSettings``, and argparse passes the raw strings on, so pydantic converts and bounds
each value once, in one place. Only ``run_command`` loads torch, after the flags passed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from computectx.demo.settings import DemoError, DemoSettings

__all__ = ["add_arguments", "flag_of", "run_command", "settings_from_args"]


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


def flag_of(name: str) -> str:
    """The command-line flag of the ``DemoSettings`` field ``name`` (``--batch-size``)."""
    field = DemoSettings.model_fields[name]
    return str(_extra(field).get("flag", "--" + name.replace("_", "-")))


def _shown(field: FieldInfo) -> str:
    extra = _extra(field)
    if "shown_default" in extra:
        return str(extra["shown_default"])
    value = field.get_default(call_default_factory=True)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _metavar(name: str, field: FieldInfo) -> str:
    extra = _extra(field)
    if "metavar" in extra:
        return str(extra["metavar"])
    kinds = {int: "N", float: "X", Path: "PATH"}
    for kind, metavar in kinds.items():
        if field.annotation is kind or field.annotation == (kind | None):
            return metavar
    return name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ``DemoSettings`` field to ``parser`` (the ``demo`` subcommand's).

    Flags that are not given are left out of the namespace, so the field defaults apply;
    ``--help`` shows each default.
    """
    for name, field in DemoSettings.model_fields.items():
        # argparse formats help with %-style placeholders: a literal % must be doubled.
        text = " ".join((field.description or "").split()).replace("%", "%%")
        help_text = f"{text} (default: {_shown(field)})"
        flag = flag_of(name)
        if field.annotation is bool:
            parser.add_argument(
                flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text
            )
        elif isinstance(field.default, tuple):
            parser.add_argument(
                flag,
                dest=name,
                action="append",
                default=argparse.SUPPRESS,
                metavar=_metavar(name, field),
                help=help_text,
            )
        else:
            parser.add_argument(
                flag,
                dest=name,
                default=argparse.SUPPRESS,
                metavar=_metavar(name, field),
                help=help_text,
            )


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    """``DemoSettings`` from parsed flags; ``DemoError`` naming each bad flag and its value."""
    fields = {k: v for k, v in vars(args).items() if k in DemoSettings.model_fields}
    try:
        return DemoSettings(**fields)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = err["loc"]
            name = str(loc[0]) if loc else ""
            flag = flag_of(name) if name in DemoSettings.model_fields else name
            msg = str(err["msg"]).removeprefix("Value error, ")
            if err["type"] == "value_error":
                # Our validators name the value themselves; a whole-settings check (no
                # field) names its flags in its message.
                msgs.append(f"{flag}: {msg}" if flag else msg)
            else:
                msgs.append(f"{flag} {err['input']!r}: {msg}")
        raise DemoError("; ".join(msgs)) from None


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``computectx demo`` subcommand: 0 on success, 2 on a bad setting.

    A flag that ``DemoSettings`` rejects exits through ``parser.error`` (usage and the
    message, status 2) before torch is imported; a setting that only the run can refuse
    (no such CUDA device, unreadable data, an unwritable ``--out``) prints
    ``computectx demo: error: ...`` and returns 2.
    """
    try:
        settings = settings_from_args(args)
    except DemoError as e:
        parser.error(str(e))
    from computectx.demo.run import run_demo  # torch, nn, fp8: only once the flags passed

    try:
        run_demo(settings)
    except DemoError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
