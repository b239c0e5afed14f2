"""Command-line flags generated from the config dataclasses, so each default is written once.

A field becomes ``--<prefix><name>`` (underscores as dashes), typed from its annotation: bool
fields become ``--name`` / ``--no-name`` switches, enums take their values as choices, tuples
take one or more values (space- or comma-separated). A field that is itself a config dataclass
contributes its own fields, under the prefix in its ``metadata={"prefix": ...}`` (default: its
name and a dash). A field's metadata may rename its flag (``"flag"``) or add help (``"help"``);
a nested field's ``"skip"`` lists inner fields that get no flag (they keep their defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any

Namespace = argparse.Namespace


def _unwrap(kind: Any) -> Any:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def _nested_prefix(f: dataclasses.Field, prefix: str) -> str:
    return prefix + f.metadata.get("prefix", f.name.replace("_", "-") + "-")


def add_dataclass_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                        prefix: str = "", dest: str = "", skip: tuple[str, ...] = ()) -> None:
    """One flag per (nested) field of ``cls``; ``dest`` keys are the fields' dotted paths."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        kind = _unwrap(hints[f.name])
        path = f"{dest}{f.name}"
        if dataclasses.is_dataclass(kind):
            add_dataclass_flags(parser, kind, _nested_prefix(f, prefix), f"{path}.",
                                tuple(f.metadata.get("skip", ())))
            continue
        flag = "--" + prefix + f.metadata.get("flag", f.name.replace("_", "-"))
        default = _default(f)
        help_text = f.metadata.get("help", "") + (f" (default: {default})"
                                                  if default is not None else "")
        if kind is bool:
            parser.add_argument(flag, dest=path, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            parser.add_argument(flag, dest=path, type=kind, default=default,
                                choices=list(kind), help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, dest=path, nargs="+", type=_items(typing.get_args(kind)[0]),
                                default=default, help=help_text, metavar=f.name.upper())
        else:
            parser.add_argument(flag, dest=path, type=kind, default=default, help=help_text,
                                metavar=f.name.upper())


def _items(kind: Any) -> Any:
    """A tuple flag's item parser: ``--x 1 2 4`` and ``--x 1,2,4`` both give (1, 2, 4)."""
    def parse(text: str) -> list:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in errors
    return parse


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def from_args(cls: type, ns: Namespace, dest: str = "", **given: Any) -> Any:
    """``cls`` built from the parsed flags (``given`` supplies fields that have no flag)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kwargs[f.name] = given[f.name]
            continue
        kind = _unwrap(hints[f.name])
        path = f"{dest}{f.name}"
        if dataclasses.is_dataclass(kind) and not hasattr(ns, path):
            kwargs[f.name] = from_args(kind, ns, f"{path}.")
        elif hasattr(ns, path):
            value = getattr(ns, path)
            if isinstance(value, list):  # a tuple flag: one list of items per word given
                value = tuple(v for part in value for v in part)
            kwargs[f.name] = value
    return cls(**kwargs)
