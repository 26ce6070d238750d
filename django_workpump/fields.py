"""Model fields the app needs that Django's core does not ship.

``django.contrib.postgres``'s ``ArrayField`` would do, but Django 6.1 refuses it unless
``django.contrib.postgres`` is in ``INSTALLED_APPS``, a setting this app must not ask of
its users for one column that only SQL writes and reads.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import models


class IntegerArrayField(models.Field):
    """A PostgreSQL ``integer[]`` column; psycopg reads and writes it as a list of ints."""

    description = "Array of integers"

    def db_type(self, connection: Any) -> str:
        return "integer[]"

    def to_python(self, value: Any) -> list[int] | None:
        if value is None:
            return None
        try:
            return [int(item) for item in value]
        except (TypeError, ValueError) as error:
            raise ValidationError(
                f"{self.name} must be a list of integers, not {value!r}", code="invalid"
            ) from error

    def get_prep_value(self, value: Any) -> list[int] | None:
        return self.to_python(super().get_prep_value(value))
