"""Config dataclasses as plain JSON values and back, for a config that crosses a process boundary
(``deltaserve serve --engine vllm`` hands its co-serving config to vLLM's engine process).

Nested dataclasses become objects, enums their values, tuples lists; :func:`from_dict` rebuilds
the same tree (so every ``__post_init__`` check runs again on the other side) and rejects keys
the class does not have.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import TypeVar

from deltaserve.core.errors import InputError

T = TypeVar("T")
JSONValue = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]


def to_dict(config: object) -> dict[str, JSONValue]:
    """``config`` (a dataclass instance) as JSON-able values."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"not a dataclass instance: {config!r}")
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _plain(value: object) -> JSONValue:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{type(value).__name__} has no JSON form: {value!r}")


def from_dict(cls: type[T], data: Mapping[str, JSONValue]) -> T:
    """The ``cls`` instance that :func:`to_dict` gave ``data`` for."""
    if not isinstance(data, Mapping):
        raise InputError(cls.__name__, data, "expected an object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise InputError(cls.__name__, unknown,
                         f"unknown fields; known: {', '.join(sorted(names))}")
    return cls(**{k: _typed(hints[k], v) for k, v in data.items()})


def _typed(kind: object, value: JSONValue) -> object:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if value is None:
            return None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return from_dict(kind, value)  # type: ignore[arg-type]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(value)
    if typing.get_origin(kind) is tuple and isinstance(value, list):
        inner = typing.get_args(kind)[0]
        return tuple(_typed(inner, v) for v in value)
    return value
