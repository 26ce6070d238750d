"""Result rows as dataclasses, built by column name (``FromRow``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import cache
from typing import Any, Self

Row = Mapping[str, Any]  # one result row, by column name


class FromRow:
    """Build a dataclass from a result row by column name, never by position."""

    @classmethod
    def from_row(cls, row: Row) -> Self:
        """The instance of ``row``; raise ValueError naming any field no column fills."""
        names, required = _field_names(cls)
        missing = [name for name in required if name not in row]
        if missing:
            raise ValueError(
                f"A {cls.__name__} row has no column for {', '.join(missing)} (columns: "
                f"{', '.join(row)}); the query and the dataclass must name the same fields."
            )
        return cls(**{name: row[name] for name in names if name in row})


@cache
def _field_names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every field, the fields without a default) of a FromRow dataclass; claims build
    one per row, and ``dataclasses.fields`` is not free."""
    fields = dataclasses.fields(cls)
    required = tuple(
        field.name
        for field in fields
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    )
    return tuple(field.name for field in fields), required
