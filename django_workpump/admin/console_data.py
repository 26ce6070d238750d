"""The console's series shaped for charts: a grid of points over a window, counters as
per-minute rates, pickup-latency quantiles from the histograms, the sampled backlog
and instances. Pure functions over the rows of ``db.console``; no SQL here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

# Window name -> (minutes shown, minutes per point).
WINDOWS = {"hour": (60, 1), "day": (1440, 10)}
DEFAULT_WINDOW = "hour"
OUTCOMES = ("done", "failed", "dead")


@dataclass(frozen=True)
class Grid:
    """The points of a chart: ``len(points)`` bins of ``step`` minutes, the last bin
    ending with minute ``end`` (inclusive), the last complete minute; ``until`` is the
    current minute, which tables count but charts leave out (a rate of a minute still
    running would read as a drop)."""

    end: datetime
    minutes: int
    step: int
    until: datetime
    points: list[datetime] = field(init=False)

    def __post_init__(self) -> None:
        since = self.since
        count = self.minutes // self.step
        object.__setattr__(
            self, "points", [since + timedelta(minutes=i * self.step) for i in range(count)]
        )

    @property
    def since(self) -> datetime:
        return self.end - timedelta(minutes=self.minutes - 1)

    def index(self, minute: datetime) -> int | None:
        """The point ``minute`` falls in, or None outside the window."""
        offset = int((minute - self.since).total_seconds() // 60)
        if offset < 0 or offset >= self.minutes:
            return None
        return offset // self.step


def window_name(requested: str | None) -> str:
    return requested if requested in WINDOWS else DEFAULT_WINDOW


def grid(window: str, now: datetime) -> Grid:
    """The grid of ``window`` up to the minute before ``now`` (a minute's start). Points
    of several minutes start at UTC multiples of their length, as the database bins them
    (and as the rollup's 10-minute buckets are), so the last point is the last whole one."""
    minutes, step = WINDOWS[window_name(window)]
    into_point = timedelta(seconds=int(now.timestamp()) % (step * 60))
    return Grid(end=now - into_point - timedelta(minutes=1), minutes=minutes, step=step, until=now)


def rates(
    rows: Iterable[dict[str, Any]], g: Grid, key: str = "outcome", keys: Sequence[str] = OUTCOMES
) -> dict[str, list[float]]:
    """Per key, the counts per point as a per-minute rate (a point of 10 minutes shows the
    mean of its minutes). A minute without counts is a zero: counters are written only
    when something happened."""
    series = {k: [0.0] * len(g.points) for k in keys}
    for row in rows:
        i = g.index(row["minute"])
        if i is not None and row[key] in series:
            series[row[key]][i] += row["n"] / g.step
    return series


def quantile(histogram: Sequence[int], bounds: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of a bucket histogram (bucket i holds [bounds[i-1], bounds[i]),
    the first from 0, the last open), interpolated linearly inside its bucket; the last
    bucket reads as its lower bound. None for an empty histogram."""
    total = sum(histogram)
    if total <= 0:
        return None
    target = q * total
    seen = 0
    for i, count in enumerate(histogram):
        if count and seen + count >= target:
            lower = bounds[i - 1] if i > 0 else 0.0
            if i >= len(bounds):
                return float(lower)
            return float(lower + (bounds[i] - lower) * (target - seen) / count)
        seen += count
    return float(bounds[-1])


def latency_quantiles(
    rows: Iterable[dict[str, Any]],
    g: Grid,
    bounds: Sequence[float],
    qs: Sequence[float] = (0.5, 0.95),
) -> dict[float, list[float | None]]:
    """Per quantile, its value per point, from the claims' histograms (rows: minute,
    bucket (1-based), n); None where nothing was claimed."""
    histograms = [[0] * (len(bounds) + 1) for _ in g.points]
    for row in rows:
        i = g.index(row["minute"])
        bucket = int(row["bucket"]) - 1
        if i is not None and 0 <= bucket <= len(bounds):
            histograms[i][bucket] += int(row["n"])
    return {q: [quantile(h, bounds, q) for h in histograms] for q in qs}


def backlog(rows: Iterable[dict[str, Any]], g: Grid) -> dict[str, list[float | None]]:
    """Rows waiting (pending + scheduled), pending alone and the oldest pending age, per
    point: the last sample in it (None: not sampled)."""
    series: dict[str, list[float | None]] = {
        k: [None] * len(g.points) for k in ("waiting", "pending", "oldest")
    }
    for row in rows:  # in minute order: a later sample of a point replaces an earlier one
        i = g.index(row["minute"])
        if i is None:
            continue
        series["pending"][i] = float(row["pending"])
        series["waiting"][i] = float(row["pending"] + row["scheduled"])
        oldest = row["oldest_pending_seconds"]
        series["oldest"][i] = float(oldest) if oldest is not None else 0.0
    return series


@dataclass
class InstanceSeries:
    instance_id: Any
    label: str
    in_flight: list[float | None]
    heartbeat_age: list[float | None]
    latest_age: float | None = None
    latest_alive: bool | None = None
    latest_in_flight: int | None = None
    url: str = ""  # its console page (set by the view)
    age: str = ""  # latest_age for people


def instances(
    rows: Iterable[dict[str, Any]], g: Grid
) -> tuple[dict[str, list[float | None]], list[InstanceSeries]]:
    """Per point: instances alive by the liveness rule when sampled ("alive": a fresh
    heartbeat, or a held alive-lock) and rows in flight ("in flight"), from the point's
    last sampled minute; and each instance's own series.

    An idle pump samples nothing (``console_sample``): a point no sample falls in carries
    the last sample before it forward, for each of its instances whose heartbeat row
    shows a beat since the point began (``beat_until``), with no heartbeat age (none was
    taken). An instance gone from the table is carried no further than its last sample.
    """
    by_minute: dict[datetime, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_minute[row["minute"]].append(row)
    totals: dict[str, list[float | None]] = {
        "alive": [None] * len(g.points),
        "in flight": [None] * len(g.points),
    }
    each: dict[Any, InstanceSeries] = {}
    # per point, the last sample in it (its rows); before the window, the last sample
    last_in: dict[int | None, list[dict[str, Any]]] = {}
    for minute in sorted(by_minute):
        i = g.index(minute)  # None: before the window, or the minute still running
        sampled = by_minute[minute]
        if i is not None:
            last_in[i] = sampled
            totals["alive"][i] = float(sum(1 for r in sampled if r["alive"]))
            totals["in flight"][i] = float(sum(r["in_flight"] for r in sampled))
        elif minute < g.since:
            last_in[None] = sampled
        for r in sampled:
            series = each.get(r["instance_id"])
            if series is None:
                series = each[r["instance_id"]] = InstanceSeries(
                    instance_id=r["instance_id"],
                    label=f"{r['service_name']}@{r['host_name']}:{r['process_id']}",
                    in_flight=[None] * len(g.points),
                    heartbeat_age=[None] * len(g.points),
                )
            if i is not None:
                series.in_flight[i] = float(r["in_flight"])
                series.heartbeat_age[i] = r["heartbeat_age_seconds"]
            series.latest_age = r["heartbeat_age_seconds"]
            series.latest_alive = bool(r["alive"])
            series.latest_in_flight = int(r["in_flight"])
    _carry_forward(last_in, each, totals, g)
    return totals, list(each.values())


def _carry_forward(
    last_in: dict[int | None, list[dict[str, Any]]],
    each: dict[Any, InstanceSeries],
    totals: dict[str, list[float | None]],
    g: Grid,
) -> None:
    """Fill the points no sample fell in from the last sample before them (``instances``)."""
    current = last_in.get(None, [])
    beating: list[dict[str, Any]] = []
    for i, start in enumerate(g.points):
        if i in last_in:
            current, beating = last_in[i], []
            continue
        beating = [
            r for r in current if r.get("beat_until") is not None and r["beat_until"] >= start
        ]
        if not beating:
            continue
        totals["alive"][i] = float(sum(1 for r in beating if r["alive"]))
        totals["in flight"][i] = float(sum(r["in_flight"] for r in beating))
        for r in beating:
            each[r["instance_id"]].in_flight[i] = float(r["in_flight"])
    # the window ends on carried points: their instances' age is their beat's, not the
    # age their old sample took
    for r in beating:
        each[r["instance_id"]].latest_age = max((g.until - r["beat_until"]).total_seconds(), 0.0)


def totals(rows: Iterable[dict[str, Any]], key: str = "outcome") -> dict[str, int]:
    """Counts summed per key over the whole window."""
    summed: dict[str, int] = defaultdict(int)
    for row in rows:
        summed[row[key]] += int(row["n"])
    return dict(summed)
