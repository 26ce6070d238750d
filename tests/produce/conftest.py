"""Fixtures of the producer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import django_workpump as workpump
from django_workpump.registry import registry


@pytest.fixture
def order_handlers() -> Iterator[None]:
    """A perspective and a receptor on order.placed, unregistered afterwards."""
    workpump.perspective("order_totals", events=["order.placed", "order.refunded"])(
        lambda work: None
    )
    workpump.receptor("warehouse", events=["order.placed"], max_attempts=3)(lambda work: None)
    yield
    registry.unregister("perspective_event", "order_totals")
    registry.unregister("receptor", "warehouse")
