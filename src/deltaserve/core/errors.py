"""The one exception type for bad input anywhere in DeltaServe."""

from __future__ import annotations

from enum import StrEnum


class InputError(ValueError):
    """Bad configuration or data: names the field, the offending value and why.

    ``line`` is set for a malformed data row (1-based line number in its file); ``record``
    (1-based) too where a file holds several records on a line (a JSON array).
    """

    def __init__(self, field: str, value: object, reason: str, *, line: int | None = None,
                 record: int | None = None):
        self.field = field
        self.value = value
        self.reason = reason
        self.line = line
        self.record = record
        where = f"line {line}: " if line is not None else ""
        if record is not None:
            where = f"record {record}, {where}" if where else f"record {record}: "
        shown = repr(value)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(f"{where}{field}={shown}: {reason}")


def require(ok: bool, field: str, value: object, reason: str) -> None:
    """Raise :class:`InputError` unless ``ok``; keeps ``__post_init__`` checks one line each."""
    if not ok:
        raise InputError(field, value, reason)


def require_positive(field: str, value: float) -> None:
    require(value > 0, field, value, "must be > 0")


def require_non_negative(field: str, value: float) -> None:
    require(value >= 0, field, value, "must be >= 0")


def require_choice(field: str, value: object, choices: tuple[object, ...]) -> None:
    require(value in choices, field, value, f"must be one of {', '.join(map(str, choices))}")


def coerce_enum(obj: object, name: str, enum: type[StrEnum], field: str | None = None) -> None:
    """In a frozen dataclass's ``__post_init__``: accept the enum's value as a string (from a
    CLI, JSON or a caller), store the member, and name the field when the value is unknown."""
    value = getattr(obj, name)
    try:
        member = enum(value)
    except ValueError:
        raise InputError(field or name, value,
                         f"must be one of {', '.join(m.value for m in enum)}") from None
    object.__setattr__(obj, name, member)
