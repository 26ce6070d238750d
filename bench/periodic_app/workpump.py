"""The periodic schedule of bench/periodic_lateness.py: one slot a second."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import django_workpump as workpump


@workpump.periodic("bench.periodic", every=timedelta(seconds=1))
def tick(work: Any) -> None:
    """Nothing to do: the measurement reads the outbox rows."""
