"""A handler's declared flow limits (docs/flow-control.md): parsed and checked at
registration; ``flow.py`` writes them to the database and steers them at runtime."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

# "100/s", "6000/m", "10/h", "2.5/s": starts per unit of time.
RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*([smh])\s*$")
MAX_LIMIT = 2_147_483_647
MAX_WEIGHT = 1000


@dataclass(frozen=True)
class FlowLimits:
    """A topic's declared limits; None is no limit."""

    concurrency: int | None = None
    rate: float | None = None  # starts per second
    burst: int | None = None  # the bucket's size (default: one second of rate)
    key_concurrency: int | None = None  # the cap of each concurrency key of the topic

    def settings(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "rate": self.rate,
            "burst": self.burst,
            "key_concurrency": self.key_concurrency,
        }


def parse_rate(rate: Any, where: str) -> float | None:
    """Starts per second of ``rate``: ``"100/s"``, ``"6000/m"``, ``"10/h"``, or a number
    (per second); None for none."""
    if rate is None:
        return None
    if isinstance(rate, int | float) and not isinstance(rate, bool):
        per_second = float(rate)
    elif isinstance(rate, str) and (match := _RATE.match(rate)):
        per_second = float(match[1]) / RATE_UNITS[match[2]]
    else:
        raise ImproperlyConfigured(
            f"rate of {where} must be like '100/s', '6000/m' or '10/h' (or a number per "
            f"second), not {rate!r}."
        )
    if not math.isfinite(per_second) or per_second <= 0:
        raise ImproperlyConfigured(f"rate of {where} must be more than 0, not {rate!r}.")
    return per_second


def checked_count(value: Any, what: str, where: str, minimum: int = 0) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_LIMIT:
        raise ImproperlyConfigured(
            f"{what} of {where} must be a whole number >= {minimum}, not {value!r}."
        )
    return value


def flow_limits(
    where: str,
    *,
    concurrency: Any = None,
    rate: Any = None,
    burst: Any = None,
    key_concurrency: Any = None,
) -> FlowLimits | None:
    """The limits a handler declares, checked; None when it declares none."""
    limits = FlowLimits(
        concurrency=checked_count(concurrency, "concurrency", where),
        rate=parse_rate(rate, where),
        burst=checked_count(burst, "burst", where, minimum=1),
        key_concurrency=checked_count(key_concurrency, "key_concurrency", where),
    )
    if limits.burst is not None and limits.rate is None:
        raise ImproperlyConfigured(f"burst of {where} needs a rate: pass rate='100/s' too.")
    return None if limits == FlowLimits() else limits
