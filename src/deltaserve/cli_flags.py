"""Command-line flags generated from the config dataclasses, so each default is written once.

A field becomes ``--<prefix><name>`` (underscores as dashes), typed from its annotation: bool
fields become ``--name`` / ``--no-name`` switches, enums take their values as choices, tuples
take one or more values (space- or comma-separated). A field that is itself a config dataclass
contributes its own fields, under the prefix in its ``metadata={"prefix": ...}`` (default: its
name and a dash). A field's metadata may rename its flag (``"flag"``) or add help (``"help"``);
a nested field's ``"skip"`` lists inner fields that get no flag (they keep their defaults). A
nested field's flags default to the values of its own default (so a parent may give a nested
config without defaults of its own, e.g. an SLO, a default instance). A config that rejects its
values names the flag in the error: ``--slo-ttft-s=-5.0: ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import TypeVar

from deltaserve.core.errors import InputError

Namespace = argparse.Namespace
T = TypeVar("T")


def _unwrap(kind: object) -> object:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def _nested_prefix(f: dataclasses.Field, prefix: str) -> str:
    return prefix + f.metadata.get("prefix", f.name.replace("_", "-") + "-")


def _flag(f: dataclasses.Field, prefix: str) -> str:
    return "--" + prefix + f.metadata.get("flag", f.name.replace("_", "-"))


def add_dataclass_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                        prefix: str = "", dest: str = "", skip: tuple[str, ...] = (),
                        defaults: object | None = None) -> dict[str, str]:
    """One flag per (nested) field of ``cls``; ``dest`` keys are the fields' dotted paths.
    ``defaults``: an instance of ``cls`` whose values are the flags' defaults. Returns each
    flag by its ``dest`` (for :func:`checked_from_args`)."""
    hints = typing.get_type_hints(cls)
    flags: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        kind = _unwrap(hints[f.name])
        path = f"{dest}{f.name}"
        default = getattr(defaults, f.name) if defaults is not None else _default(f)
        if dataclasses.is_dataclass(kind):
            flags.update(add_dataclass_flags(parser, kind, _nested_prefix(f, prefix), f"{path}.",
                                             tuple(f.metadata.get("skip", ())), default))
            continue
        flag = _flag(f, prefix)
        flags[path] = flag
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
    return flags


def _items(kind: type) -> object:
    """A tuple flag's item parser: ``--x 1 2 4`` and ``--x 1,2,4`` both give (1, 2, 4)."""
    def parse(text: str) -> list[object]:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in errors
    return parse


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def from_args(cls: type[T], ns: Namespace, dest: str = "", **given: object) -> T:
    """``cls`` built from the parsed flags (``given`` supplies fields that have no flag)."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kwargs[f.name] = given[f.name]
            continue
        kind = _unwrap(hints[f.name])
        path = f"{dest}{f.name}"
        if dataclasses.is_dataclass(kind) and not hasattr(ns, path):
            if any(k.startswith(f"{path}.") for k in vars(ns)):
                kwargs[f.name] = from_args(kind, ns, f"{path}.")
        elif hasattr(ns, path):
            value = getattr(ns, path)
            if isinstance(value, list):  # a tuple flag: one list of items per word given
                value = tuple(v for part in value for v in part)
            kwargs[f.name] = value
    return cls(**kwargs)


def checked_from_args(cls: type[T], ns: Namespace, flags: dict[str, str], dest: str = "",
                      **given: object) -> T:
    """:func:`from_args`, with a config error re-raised naming the flag that set the value."""
    try:
        return from_args(cls, ns, dest, **given)
    except InputError as e:
        flag = flag_of(e, flags, ns)
        if flag is None:
            raise
        raise InputError(flag, e.value, e.reason) from e


def flag_of(error: InputError, flags: dict[str, str], ns: Namespace) -> str | None:
    """The flag behind a config error: the one whose field path ends with the error's field
    name (``lora.r`` for ``lora_r``), else whose path holds every word of it
    (``checkpoint.every_steps`` for ``checkpoint_every``), else the only one of those (or of
    all) that holds the offending value."""
    field = error.field.replace("-", "_")
    for match in (lambda d: d.replace(".", "_") == field or d.rsplit(".", 1)[-1] == field
                  or d.replace(".", "_").endswith("_" + field),
                  lambda d: _words(field) <= _words(d)):
        named = [d for d in flags if match(d)]
        if len(named) == 1:
            return flags[named[0]]
        if named:
            break
    holding = [d for d in (named or flags) if _same(getattr(ns, d, None), error.value)]
    return flags[holding[0]] if len(holding) == 1 else None


def _words(name: str) -> set[str]:
    return {w.removesuffix("s") for w in name.replace(".", "_").split("_") if w}


def _same(a: object, b: object) -> bool:
    if isinstance(a, list):
        a = tuple(a)
    return type(a) is type(b) and a == b

