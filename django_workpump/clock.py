"""Time sources for the runtime: real in production, frozen in tests.

Lease and heartbeat *timestamps* always come from the database clock; a ``Clock`` only
measures local intervals (cadences, backoff, local lease deadlines) on a monotonic scale.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (only differences mean anything)."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()


class FrozenClock:
    """A clock that moves only when told to (tests)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("A clock never goes back.")
        with self._lock:
            self._now += seconds
