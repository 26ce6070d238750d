"""Prometheus metrics of the work pump (the ``prometheus`` extra, ``prometheus_client``).

The pump's services record what they do through a recorder (``recorder()``): a
``PrometheusRecorder`` keeps counters and histograms of claims, handler runs and
outcomes, and gauges of this process (rows in flight, the NOTIFY gate). Without
``prometheus_client`` it is a ``NullRecorder`` whose methods do nothing, so the
instrumentation costs a method call and importing the package needs nothing more.

The database-wide gauges (rows per state, the oldest waiting row, instances) are read by
``DatabaseCollector`` with the two queries ``workpump_status`` uses for them, at most once
per ``METRICS_CACHE_SECONDS``, however often Prometheus scrapes.

Serve them with ``runworkpump --metrics-port PORT`` (or ``WORKPUMP["METRICS_PORT"]``) or
route ``metrics_view`` in a project's URLconf. See docs/metrics.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from django_workpump.clock import Clock, SystemClock
from django_workpump.conf import setting
from django_workpump.states import ENDED_STATES, OutcomeStatus, WorkState

try:
    import prometheus_client
    from prometheus_client.core import GaugeMetricFamily
except ImportError:  # the extra is not installed: metrics are off
    prometheus_client = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponse

    from django_workpump.db import ClaimedWork, Outcome

logger = logging.getLogger("django_workpump.metrics")

INSTALL = "pip install 'django-workpump[prometheus]'"
# Whether prometheus_client could be imported.
AVAILABLE = prometheus_client is not None

# Seconds: handler runs from a millisecond to the default lease (300 s).
HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

# The undone states workpump_pending reports: rows that ended are not a backlog.
PENDING_STATES = tuple(state for state in WorkState if state not in ENDED_STATES)
# The ended states workpump_ended reports, counted exactly (done rows are estimated and
# counted by workpump_done_total instead).
ENDED_GAUGE_STATES = (WorkState.CANCELLED, WorkState.DISCARDED)


class MetricsUnavailable(ImproperlyConfigured):
    """Metrics were asked for but prometheus_client is not installed."""


class MetricsPortUnavailable(RuntimeError):
    """The metrics endpoint cannot listen on the port it was given."""


def require() -> None:
    """Raise MetricsUnavailable unless prometheus_client is installed."""
    if not AVAILABLE:
        raise MetricsUnavailable(
            "Prometheus metrics need the prometheus_client package, which is not installed. "
            f"Install it with: {INSTALL}."
        )


class NullRecorder:
    """The recorder without prometheus_client: every method does nothing."""

    enabled = False

    def claim(self, rows: Sequence[ClaimedWork], seconds: float) -> None:
        pass

    def handler_started(self, row: ClaimedWork, queue_wait: float | None) -> None:
        pass

    def handler_finished(self, row: ClaimedWork, seconds: float) -> None:
        pass

    def held(self, category: str, delta: int) -> None:
        pass

    def outcomes(
        self,
        category: str,
        outcomes: Iterable[Outcome],
        topics: Callable[[Any], str],
        reasons: Callable[[Any], str | None] | None = None,
    ) -> None:
        pass

    def dead_lettered(self, category: str, topic: str, reason: str, count: int = 1) -> None:
        pass

    def abandoned(self, category: str, topic: str) -> None:
        pass

    def lost(self, category: str, count: int = 1) -> None:
        pass

    def renewed(self, category: str, count: int) -> None:
        pass

    def gate(self, up: bool) -> None:
        pass


class PrometheusRecorder(NullRecorder):
    """Record the pump's counters, histograms and gauges in a prometheus_client registry."""

    enabled = True

    def __init__(self, registry: Any = None) -> None:
        require()
        p = prometheus_client
        kw: dict[str, Any] = {"registry": p.REGISTRY if registry is None else registry}
        work = ("category", "topic")
        self.claimed_total = p.Counter(
            "workpump_claimed", "Rows leased to this process by claim_work.", work, **kw
        )
        self.done_total = p.Counter(
            "workpump_done", "Rows completed (the completion was written).", work, **kw
        )
        self.failed_total = p.Counter(
            "workpump_failed",
            "Failed attempts written (retried or dead-lettered), by failure reason.",
            (*work, "reason"),
            **kw,
        )
        self.dead_lettered_total = p.Counter(
            "workpump_dead_lettered",
            "Rows this process parked as dead: a failure on the last attempt, or a payload "
            "that cannot be decoded.",
            (*work, "reason"),
            **kw,
        )
        self.renewals_total = p.Counter(
            "workpump_renewals", "Lease renewals the database confirmed.", ("category",), **kw
        )
        self.abandoned_total = p.Counter(
            "workpump_abandoned",
            "Handlers still running at their lease deadline, given up on.",
            work,
            **kw,
        )
        self.lost_total = p.Counter(
            "workpump_lost",
            "Outcomes fenced out: the lease was lost before the outcome was written.",
            ("category",),
            **kw,
        )
        self.in_flight = p.Gauge(
            "workpump_in_flight",
            "Rows this process holds: queued for a handler thread or running.",
            ("category",),
            **kw,
        )
        self.notify_gate_up = p.Gauge(
            "workpump_notify_gate_up",
            "1 while this process's NOTIFY listener is connected and proven, else 0.",
            **kw,
        )
        self.handler_duration = p.Histogram(
            "workpump_handler_duration_seconds",
            "How long handlers ran (middleware included).",
            work,
            buckets=HANDLER_BUCKETS,
            **kw,
        )
        self.claim_duration = p.Histogram(
            "workpump_claim_duration_seconds",
            "Round trip of one claim_work call.",
            buckets=CLAIM_BUCKETS,
            **kw,
        )
        self.queue_wait = p.Histogram(
            "workpump_queue_wait_seconds",
            "From when a row became claimable (created, or its retry, deferral or expired "
            "lease fell due) to its handler's start.",
            work,
            buckets=QUEUE_WAIT_BUCKETS,
            **kw,
        )
        # Labelled children by label values: ``labels()`` validates and locks on every
        # call, and these are called for every row. A race only makes the same child twice.
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def claim(self, rows: Sequence[ClaimedWork], seconds: float) -> None:
        self.claim_duration.observe(seconds)
        counts: dict[tuple[str, str], int] = {}
        for row in rows:
            key = (row.category, row.topic)
            counts[key] = counts.get(key, 0) + 1
        for (category, topic), count in counts.items():
            self._child(self.claimed_total, category, topic).inc(count)

    def handler_started(self, row: ClaimedWork, queue_wait: float | None) -> None:
        if queue_wait is not None:
            self._child(self.queue_wait, row.category, row.topic).observe(max(queue_wait, 0.0))

    def handler_finished(self, row: ClaimedWork, seconds: float) -> None:
        self._child(self.handler_duration, row.category, row.topic).observe(seconds)

    def held(self, category: str, delta: int) -> None:
        self._child(self.in_flight, category).inc(delta)

    def outcomes(
        self,
        category: str,
        outcomes: Iterable[Outcome],
        topics: Callable[[Any], str],
        reasons: Callable[[Any], str | None] | None = None,
    ) -> None:
        for outcome in outcomes:
            status = outcome.status
            if status == OutcomeStatus.LOST:
                self.lost_total.labels(category).inc()
                continue
            topic = topics(outcome.work_id)
            if status == OutcomeStatus.DONE:
                self._child(self.done_total, category, topic).inc()
                continue
            reason = (reasons(outcome.work_id) if reasons is not None else None) or ""
            if status in (OutcomeStatus.RETRY, OutcomeStatus.DEAD):
                self.failed_total.labels(category, topic, reason).inc()
            if status == OutcomeStatus.DEAD:
                self.dead_lettered_total.labels(category, topic, reason).inc()

    def dead_lettered(self, category: str, topic: str, reason: str, count: int = 1) -> None:
        self.dead_lettered_total.labels(category, topic, reason).inc(count)

    def abandoned(self, category: str, topic: str) -> None:
        self.abandoned_total.labels(category, topic).inc()

    def lost(self, category: str, count: int = 1) -> None:
        self.lost_total.labels(category).inc(count)

    def renewed(self, category: str, count: int) -> None:
        if count:
            self.renewals_total.labels(category).inc(count)

    def gate(self, up: bool) -> None:
        self.notify_gate_up.set(1 if up else 0)


_default: NullRecorder | None = None
_default_lock = threading.Lock()


def recorder() -> NullRecorder:
    """Return the process's recorder: Prometheus's default registry, or the null one."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = PrometheusRecorder() if AVAILABLE else NullRecorder()
    return _default


# -- the database-wide gauges ----------------------------------------------------------


class DatabaseCollector:
    """The database-wide gauges, read with the status report's queries and cached.

    ``collect()`` runs ``status.state_counts`` and ``status.instances`` (two queries) at
    most once per ``METRICS_CACHE_SECONDS``; scrapes in between get the cached families,
    and concurrent scrapes share one read.
    """

    def __init__(
        self,
        *,
        cache_seconds: float | None = None,
        using: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        require()
        self.cache_seconds = cache_seconds  # None: WORKPUMP["METRICS_CACHE_SECONDS"]
        self.using = using
        self.clock = clock or SystemClock()
        self.reads = 0  # database reads so far
        self._lock = threading.Lock()
        self._families: list[Any] = []
        self._read_at: float | None = None

    def clear(self) -> None:
        """Forget the cached values: the next scrape reads the database."""
        with self._lock:
            self._read_at = None

    def describe(self) -> list[Any]:
        # Registering asks for the families; without this it would read the database.
        return self._empty()

    def collect(self) -> Iterator[Any]:
        cache = self.cache_seconds
        if cache is None:
            cache = setting("METRICS_CACHE_SECONDS")
        with self._lock:
            now = self.clock.monotonic()
            if self._read_at is None or now - self._read_at >= cache:
                try:
                    self._families = self._read()
                except Exception as exc:  # noqa: BLE001 - a scrape must not fail the page
                    logger.warning(
                        "the database-wide workpump metrics could not be read: %s",
                        exc,
                        extra={"action": "metrics_read_failed"},
                    )
                    self._families = []
                self._read_at = now
            families = list(self._families)
        yield from families

    def _empty(self) -> list[Any]:
        return [
            GaugeMetricFamily(
                "workpump_pending",
                "Undone rows per category and state (pending, scheduled, leased, orphaned, "
                "dead), database-wide.",
                labels=("category", "state"),
            ),
            GaugeMetricFamily(
                "workpump_ended",
                "Rows that ended without completing per category and state (cancelled, "
                "discarded), database-wide; never a backlog.",
                labels=("category", "state"),
            ),
            GaugeMetricFamily(
                "workpump_oldest_pending_age_seconds",
                "Age of the oldest row waiting for a claimer (pending or orphaned) per "
                "category; 0 when none waits.",
                labels=("category",),
            ),
            GaugeMetricFamily(
                "workpump_instances",
                "Registered runworkpump instances, live or stale by the liveness rule.",
                labels=("state",),
            ),
        ]

    def _read(self) -> list[Any]:
        from django_workpump import status

        self.reads += 1
        counts = status.state_counts(using=self.using)
        instances = status.instances(using=self.using)
        pending, ended, oldest, fleet = self._empty()
        for category in counts.categories:
            for state in PENDING_STATES:
                pending.add_metric((category.category, state), category.counts.get(state, 0))
            for state in ENDED_GAUGE_STATES:
                ended.add_metric((category.category, state), category.counts.get(state, 0))
            oldest.add_metric((category.category,), category.oldest_pending_age_seconds or 0.0)
        live = sum(1 for instance in instances if instance.live)
        fleet.add_metric(("live",), live)
        fleet.add_metric(("stale",), len(instances) - live)
        return [pending, ended, oldest, fleet]


_collector: DatabaseCollector | None = None


def database_collector() -> DatabaseCollector:
    """Return the DatabaseCollector registered in Prometheus's default registry (once)."""
    global _collector
    require()
    with _default_lock:
        if _collector is None:
            collector = DatabaseCollector()
            prometheus_client.REGISTRY.register(collector)
            _collector = collector
    return _collector


def exposition() -> tuple[bytes, str]:
    """Return the text of every metric in the default registry and its content type."""
    require()
    recorder()  # the pump's series exist (at zero) even before any work ran
    database_collector()
    return prometheus_client.generate_latest(), prometheus_client.CONTENT_TYPE_LATEST


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Serve the metrics in Prometheus's text format (route it in your URLconf)."""
    from django.http import HttpResponse

    body, content_type = exposition()
    return HttpResponse(body, content_type=content_type)


# -- the runworkpump endpoint ----------------------------------------------------------


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a log line


def _app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"Not found: the metrics are at /metrics.\n"]
    try:
        body, content_type = exposition()
    finally:
        # Each request runs in a thread of its own: close the connection it opened.
        connections.close_all()
    start_response("200 OK", [("Content-Type", content_type)])
    return [body]


class MetricsServer:
    """``/metrics`` over HTTP on a thread of its own; ``close()`` stops it."""

    def __init__(self, port: int, address: str = "") -> None:
        require()
        try:
            self.httpd = make_server(
                address, port, _app, server_class=_Server, handler_class=_QuietHandler
            )
        except (OSError, OverflowError) as exc:
            raise MetricsPortUnavailable(
                f"The metrics endpoint cannot listen on port {port} "
                f"({getattr(exc, 'strerror', None) or exc}); "
                "choose another --metrics-port (WORKPUMP['METRICS_PORT'])."
            ) from exc
        self.port: int = self.httpd.server_port  # the port taken (port 0: any free one)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="workpump-metrics", daemon=True
        )
        self.thread.start()
        logger.info(
            "metrics served at http://%s:%d/metrics",
            address or "0.0.0.0",
            self.port,
            extra={"action": "metrics_serving"},
        )

    def close(self) -> None:
        """Stop serving and free the port; safe to call twice."""
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.thread.join(5)
        self.httpd.server_close()
