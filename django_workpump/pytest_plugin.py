"""The pytest plugin of django-workpump (registered through the ``pytest11`` entry point).

Its ``workpump`` fixture captures what the test sends, receives and emits, and runs
pending work in the test's own transaction::

    def test_signup_sends_a_welcome(workpump, client):
        client.post("/signup/", {"email": "a@example.com"})
        workpump.assert_sent("emails.welcome", email="a@example.com")
        assert workpump.run_pending() == 1

It needs pytest-django's database access (``@pytest.mark.django_db`` or ``db``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


class WorkpumpFixture:
    """run_pending() and the captured produce calls of one test."""

    def __init__(self, captured: Any) -> None:
        self.captured = captured

    def run_pending(self, **options: Any) -> int:
        from django_workpump.testing import run_pending

        return run_pending(**options)

    def __getattr__(self, name: str) -> Any:
        # assert_sent, assert_received, assert_emitted, assert_nothing_sent, sent, ...
        return getattr(self.captured, name)


@pytest.fixture
def workpump() -> Iterator[WorkpumpFixture]:
    """Capture produced work for the test and run pending work on demand."""
    from django_workpump.testing import captured  # Django is configured by now

    with captured() as produced:
        yield WorkpumpFixture(produced)
