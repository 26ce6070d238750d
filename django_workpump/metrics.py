"""Prometheus metrics of the work pump (the ``prometheus`` extra, ``prometheus_client``).

The pump's services record what they do through a recorder (``recorder()``): a
``PrometheusRecorder`` keeps counters and histograms of claims, handler runs and
outcomes, and gauges of this process (rows in flight, the NOTIFY gate). Without
``prometheus_client`` it is a ``NullRecorder`` whose methods do nothing, so the
instrumentation costs a method call and importing the package needs nothing more.

The database-wide gauges (rows per state, the oldest waiting row, instances, flow rules,
dead row versions and the oldest snapshot) are read by ``DatabaseCollector`` with the
four queries ``workpump_status`` uses for them, at most once per
``METRICS_CACHE_SECONDS``, however often Prometheus scrapes.

Serve them with ``runworkpump --metrics-port PORT`` (or ``WORKPUMP["METRICS_PORT"]``; on
127.0.0.1 unless ``--metrics-bind``) or route ``metrics_view`` in a project's URLconf. The
``topic`` label takes at most ``METRICS_MAX_TOPICS`` values, then ``other``. See
docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

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
# The topic label of every topic past WORKPUMP["METRICS_MAX_TOPICS"].
OTHER_TOPIC = "other"

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

    def __init__(self, registry: Any = None, *, max_topics: int | None = None) -> None:
        require()
        p = prometheus_client
        # Distinct topic label values; later topics share OTHER_TOPIC (METRICS_MAX_TOPICS).
        self.max_topics: int = setting("METRICS_MAX_TOPICS") if max_topics is None else max_topics
        self._topics: set[str] = set()
        self._topics_lock = threading.Lock()
        self._topics_capped = False
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

    def _topic(self, topic: str) -> str:
        """Return ``topic`` as its label value: itself, or OTHER_TOPIC past the cap."""
        if topic in self._topics:
            return topic
        with self._topics_lock:
            if topic in self._topics:
                return topic
            if len(self._topics) < self.max_topics:
                self._topics.add(topic)
                return topic
            if not self._topics_capped:
                self._topics_capped = True
                logger.warning(
                    "the workpump metrics of this process have a topic label for %d topics "
                    "(WORKPUMP['METRICS_MAX_TOPICS']); %r and every later new topic are "
                    'counted under topic="%s" so the series stay bounded. Raise the setting '
                    "if these topics need series of their own.",
                    self.max_topics,
                    topic,
                    OTHER_TOPIC,
                    extra={"action": "metrics_topics_capped"},
                )
        return OTHER_TOPIC

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
            key = (row.category, self._topic(row.topic))
            counts[key] = counts.get(key, 0) + 1
        for (category, topic), count in counts.items():
            self._child(self.claimed_total, category, topic).inc(count)

    def handler_started(self, row: ClaimedWork, queue_wait: float | None) -> None:
        if queue_wait is not None:
            topic = self._topic(row.topic)
            self._child(self.queue_wait, row.category, topic).observe(max(queue_wait, 0.0))

    def handler_finished(self, row: ClaimedWork, seconds: float) -> None:
        self._child(self.handler_duration, row.category, self._topic(row.topic)).observe(seconds)

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
            topic = self._topic(topics(outcome.work_id))
            if status == OutcomeStatus.DONE:
                self._child(self.done_total, category, topic).inc()
                continue
            reason = (reasons(outcome.work_id) if reasons is not None else None) or ""
            if status in (OutcomeStatus.RETRY, OutcomeStatus.DEAD):
                self.failed_total.labels(category, topic, reason).inc()
            if status == OutcomeStatus.DEAD:
                self.dead_lettered_total.labels(category, topic, reason).inc()

    def dead_lettered(self, category: str, topic: str, reason: str, count: int = 1) -> None:
        self.dead_lettered_total.labels(category, self._topic(topic), reason).inc(count)

    def abandoned(self, category: str, topic: str) -> None:
        self.abandoned_total.labels(category, self._topic(topic)).inc()

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

    ``collect()`` runs ``status.state_counts``, ``status.instances``,
    ``status.flow_rules`` and ``status.vacuum_health`` (four queries) at most once per
    ``METRICS_CACHE_SECONDS``;
    scrapes in between get the cached families, and concurrent scrapes share one read.
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
            GaugeMetricFamily(
                "workpump_flow",
                "Per flow rule (kind topic/key/category, its category and name): rows held "
                "now (in_flight), whole tokens left (tokens), heads waiting unclaimed "
                "(waiting), paused (1/0). A value the rule has none of is left out.",
                labels=("kind", "category", "name", "value"),
            ),
            GaugeMetricFamily(
                "workpump_dead_row_versions",
                "Dead row versions per work table, which VACUUM has not removed yet (a "
                "claim steps over the index entries of done rows), as PostgreSQL's "
                "statistics last counted them.",
                labels=("table",),
            ),
            GaugeMetricFamily(
                "workpump_oldest_snapshot_age_seconds",
                "How long the transaction of the session of this database holding the "
                "oldest snapshot (which VACUUM keeps every row version for) has been "
                "open; 0 when none holds one.",
            ),
        ]

    def _read(self) -> list[Any]:
        from django_workpump import status

        self.reads += 1
        counts = status.state_counts(using=self.using)
        instances = status.instances(using=self.using)
        rules = status.flow_rules(using=self.using)
        vacuum = status.vacuum_health(using=self.using)
        pending, ended, oldest, fleet, flow, dead_versions, snapshot_age = self._empty()
        for category in counts.categories:
            for state in PENDING_STATES:
                pending.add_metric((category.category, state), category.counts.get(state, 0))
            for state in ENDED_GAUGE_STATES:
                ended.add_metric((category.category, state), category.counts.get(state, 0))
            oldest.add_metric((category.category,), category.oldest_pending_age_seconds or 0.0)
        live = sum(1 for instance in instances if instance.live)
        fleet.add_metric(("live",), live)
        fleet.add_metric(("stale",), len(instances) - live)
        for rule in rules:
            labels = (rule.kind, rule.category, rule.name)
            values = {"in_flight": rule.in_flight, "tokens": rule.tokens, "waiting": rule.waiting}
            for value, number in {**values, "paused": int(rule.paused)}.items():
                if number is not None:
                    flow.add_metric((*labels, value), float(number))
        for table in vacuum.tables:
            dead_versions.add_metric((table.table_name,), table.dead_versions)
        held = vacuum.oldest_snapshot
        snapshot_age.add_metric((), (held.open_seconds or 0.0) if held is not None else 0.0)
        return [pending, ended, oldest, fleet, flow, dead_versions, snapshot_age]


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

# A request must arrive whole, and its answer be taken, within this many seconds.
REQUEST_TIMEOUT_SECONDS = 5.0
# Open connections at most; a new one past this closes the oldest still sending.
MAX_CONNECTIONS = 32
# Bytes of a request line and headers at most.
MAX_REQUEST_BYTES = 8192

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


class _Connection:
    """One client socket: the request read so far, then the answer left to send."""

    __slots__ = ("deadline", "received", "sending", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.received = b""
        self.sending: memoryview | None = None  # None: still reading the request


def _response(status: int, content_type: str, body: bytes, head_only: bool = False) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_REASONS[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + (b"" if head_only else body)


def _answer(request: bytes) -> bytes:
    """The whole HTTP response to one request (its line and headers)."""
    line = request.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return _response(400, "text/plain", b"Bad request: send GET /metrics.\n")
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method not in (b"GET", b"HEAD"):
        return _response(405, "text/plain", b"Method not allowed: send GET /metrics.\n")
    if target not in (b"/", b"/metrics"):
        return _response(404, "text/plain", b"Not found: the metrics are at /metrics.\n")
    try:
        body, content_type = exposition()
    except Exception as exc:  # noqa: BLE001 - one failed scrape must not stop the endpoint
        logger.warning(
            "a metrics scrape failed: %s", exc, extra={"action": "metrics_scrape_failed"}
        )
        return _response(500, "text/plain", b"The metrics could not be collected.\n")
    finally:
        # The collector's read opened this thread's connection: do not keep it idle.
        connections.close_all()
    return _response(200, content_type, body, head_only=method == b"HEAD")


class MetricsServer:
    """``/metrics`` over HTTP on one thread of its own; ``close()`` stops it.

    The thread serves every connection with non-blocking sockets and answers scrapes one
    at a time. A request must arrive whole within ``request_timeout`` seconds (and its
    answer be taken as long again), and at most ``max_connections`` are open: a new one
    past that closes the oldest still sending its request (or, when all have sent
    theirs, the oldest). So clients that connect and
    send nothing, or half a request, cost a socket each for a few seconds, never a
    thread, and a scrape that sends its request at once is answered meanwhile.
    """

    def __init__(
        self,
        port: int,
        address: str = "127.0.0.1",
        *,
        request_timeout: float = REQUEST_TIMEOUT_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        require()
        self.address = address
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        try:
            family, kind, proto, _, where = socket.getaddrinfo(
                address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            listener = socket.socket(family, kind, proto)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(where)
                listener.listen(64)
            except BaseException:
                listener.close()
                raise
        except (OSError, OverflowError) as exc:
            raise MetricsPortUnavailable(
                f"The metrics endpoint cannot listen on port {port} of {address!r} "
                f"({getattr(exc, 'strerror', None) or exc}); choose another --metrics-port "
                "(WORKPUMP['METRICS_PORT']) or --metrics-bind address."
            ) from exc
        listener.setblocking(False)
        self.listener = listener
        self.port: int = listener.getsockname()[1]  # the port taken (port 0: any free one)
        self._connections: dict[socket.socket, _Connection] = {}
        self._wake_read, self._wake_write = socket.socketpair()
        self._stopping = threading.Event()
        self._closed = False
        self.thread = threading.Thread(target=self._serve, name="workpump-metrics", daemon=True)
        self.thread.start()
        logger.info(
            "metrics served at http://%s:%d/metrics",
            f"[{address}]" if ":" in address else address,  # an IPv6 address in a URL
            self.port,
            extra={"action": "metrics_serving"},
        )

    @property
    def open_connections(self) -> int:
        """Client connections open now."""
        return len(self._connections)

    def close(self) -> None:
        """Stop serving and free the port; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        self.thread.join(5)
        for sock in list(self._connections):
            self._connections.pop(sock, None)
            with contextlib.suppress(OSError):
                sock.close()
        self.listener.close()
        self._wake_read.close()
        self._wake_write.close()

    # -- the serving thread ----------------------------------------------------------

    def _serve(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                deadlines = [c.deadline for c in self._connections.values()]
                timeout = max(0.0, min(deadlines) - now) if deadlines else None
                for key, events in self._selector.select(timeout):
                    sock = key.fileobj
                    if sock is self.listener:
                        self._accept()
                    elif sock is self._wake_read:
                        return
                    elif sock in self._connections:
                        self._service(self._connections[sock], events)
                now = time.monotonic()
                for sock, conn in list(self._connections.items()):
                    if conn.deadline <= now:
                        self._drop(sock)
        except Exception:  # pragma: no cover - a bug here must not pass silently
            logger.exception(
                "the metrics endpoint stopped", extra={"action": "metrics_server_failed"}
            )
        finally:
            self._selector.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # Out of descriptors: free one of ours, or wait a moment rather than spin
                # on a listener that stays readable.
                if self._connections:
                    self._drop_oldest()
                else:
                    self._stopping.wait(0.1)
                return
            if len(self._connections) >= self.max_connections:
                self._drop_oldest()
            sock.setblocking(False)
            self._connections[sock] = _Connection(sock, time.monotonic() + self.request_timeout)
            self._selector.register(sock, selectors.EVENT_READ)

    def _service(self, conn: _Connection, events: int) -> None:
        sock = conn.sock
        try:
            if conn.sending is None and events & selectors.EVENT_READ:
                chunk = sock.recv(4096)
                if not chunk:
                    self._drop(sock)
                    return
                conn.received += chunk
                end = conn.received.find(b"\r\n\r\n")
                if end < 0:
                    end = conn.received.find(b"\n\n")
                if end < 0 and len(conn.received) <= MAX_REQUEST_BYTES:
                    return
                if end < 0:
                    answer = _response(431, "text/plain", b"Request too large.\n")
                else:
                    answer = _answer(conn.received[:end])
                conn.sending = memoryview(answer)
                conn.deadline = time.monotonic() + self.request_timeout
                self._selector.modify(sock, selectors.EVENT_WRITE)
                events |= selectors.EVENT_WRITE  # try at once: a scrape usually fits the buffer
            if conn.sending is not None and events & selectors.EVENT_WRITE:
                sent = sock.send(conn.sending)
                conn.sending = conn.sending[sent:]
                if not conn.sending:
                    self._drop(sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(sock)

    def _drop_oldest(self) -> None:
        """Close the connection nearest its deadline, preferring one still sending its
        request: a client that sent its request has a better claim to its slot."""
        reading = [s for s, c in self._connections.items() if c.sending is None]
        candidates = reading or list(self._connections)
        self._drop(min(candidates, key=lambda s: self._connections[s].deadline))

    def _drop(self, sock: socket.socket) -> None:
        self._connections.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()
