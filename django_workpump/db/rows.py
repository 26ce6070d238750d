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
        names, fields, required = _field_names(cls)  # type: ignore[arg-type]  # a class hashes
        columns = row.keys()
        if not columns >= required:  # a set comparison: claims build one per row
            missing = [name for name in names if name in required and name not in row]
            raise ValueError(
                f"A {cls.__name__} row has no column for {', '.join(missing)} (columns: "
                f"{', '.join(row)}); the query and the dataclass must name the same fields."
            )
        if columns <= fields:
            return cls(**row)
        return cls(**{name: row[name] for name in names if name in row})


@cache
def _field_names(cls: type) -> tuple[tuple[str, ...], frozenset[str], frozenset[str]]:
    """(every field in order, the same as a set, the fields without a default) of a
    FromRow dataclass; claims build one per row, and ``dataclasses.fields`` is not free."""
    fields = dataclasses.fields(cls)
    required = frozenset(
        field.name
        for field in fields
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    )
    names = tuple(field.name for field in fields)
    return names, frozenset(names), required
