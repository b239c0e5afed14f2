"""Command-line flags generated from the config dataclasses, so each default is written once.

A field becomes ``--<prefix><name>`` (underscores as dashes), typed from its annotation: bool
fields become ``--name`` / ``--no-name`` switches, enums take their values as choices, tuples
take one or more values. A field that is itself a config dataclass contributes its own fields,
under the prefix in its ``metadata={"prefix": ...}`` (default: its name and a dash). A field's
metadata may rename its flag (``"flag"``) or add help (``"help"``); a nested field's
``"skip"`` lists inner fields that get no flag (they keep their defaults). A nested field's
flags default to the values of its own default (so a parent may give a nested config without
defaults of its own, e.g. an SLO, a default instance). A config that rejects its values names
the flag in the error: ``--slo-ttft-s=-5.0: ...``.
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


def _flag(f: dataclasses.Field, prefix: str) -> str:
    return "--" + prefix + f.metadata.get("flag", f.name.replace("_", "-"))


def add_dataclass_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                        prefix: str = "", dest: str = "", skip: tuple[str, ...] = (),
                        defaults: object | None = None) -> None:
    """One flag per (nested) field of ``cls``; ``dest`` keys are the fields' dotted paths.
    ``defaults``: an instance of ``cls`` whose values are the flags' defaults."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        kind = _unwrap(hints[f.name])
        path = f"{dest}{f.name}"
        default = getattr(defaults, f.name) if defaults is not None else _default(f)
        if dataclasses.is_dataclass(kind):
            add_dataclass_flags(parser, kind, _nested_prefix(f, prefix), f"{path}.",
                                tuple(f.metadata.get("skip", ())), default)
            continue
        flag = _flag(f, prefix)
        help_text = f.metadata.get("help", "") + (f" (default: {default})"
                                                  if default is not None else "")
        if kind is bool:
            parser.add_argument(flag, dest=path, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            parser.add_argument(flag, dest=path, type=kind, default=default,
                                choices=list(kind), help=help_text)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, dest=path, nargs="+", type=typing.get_args(kind)[0],
                                default=default, help=help_text, metavar=f.name.upper())
        else:
            parser.add_argument(flag, dest=path, type=kind, default=default, help=help_text,
                                metavar=f.name.upper())


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def from_args(cls: type, ns: Namespace, dest: str = "", prefix: str = "", **given: Any) -> Any:
    """``cls`` built from the parsed flags (``given`` supplies fields that have no flag).
    ``prefix``: the flags' prefix, to name a flag in a rejected value's error."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kwargs[f.name] = given[f.name]
            continue
        kind = _unwrap(hints[f.name])
        path = f"{dest}{f.name}"
        if dataclasses.is_dataclass(kind) and not hasattr(ns, path):
            if any(k.startswith(f"{path}.") for k in vars(ns)):
                kwargs[f.name] = from_args(kind, ns, f"{path}.", _nested_prefix(f, prefix))
        elif hasattr(ns, path):
            value = getattr(ns, path)
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    try:
        return cls(**kwargs)
    except ValueError as e:  # core's InputError (a ValueError; this layer may not import it)
        field = getattr(e, "field", None)
        if not isinstance(field, str):
            raise
        named = _flag_named(cls, prefix, field)
        if named == field:
            raise
        raise type(e)(named, getattr(e, "value", None), getattr(e, "reason", str(e))) from None


def _flag_named(cls: type, prefix: str, field: str) -> str:
    """The flag of ``cls`` that an error's ``field`` names (a field name, or the flag's own
    name with underscores), else ``field`` unchanged."""
    for f in dataclasses.fields(cls):
        flag = _flag(f, prefix)
        if field in (f.name, flag[2:].replace("-", "_")):
            return flag
    return field
