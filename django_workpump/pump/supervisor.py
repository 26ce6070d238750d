"""Supervisor: starts the pump's services and stops them all, in order.

Start: schema gate -> first heartbeat (registers the instance) -> NOTIFY gate (takes the
alive-lock) -> dispatcher, renewals, heartbeat, maintenance, periodic -> claiming.
Stop: stop claiming -> wait for in-flight handlers (bounded) -> flush outcomes and
renewals -> stop heartbeats -> deregister (own timeout) -> stop the rest. If any service
dies, or the instance is evicted (its heartbeat, claim or renewal is refused), everything
stops and the exit code says why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
from django.db import connections

from django_workpump import flow, metrics, middleware, subscriptions
from django_workpump.clock import Clock, SystemClock
from django_workpump.conf import (
    get_settings,
    lock_loss_grace_seconds,
    tombstone_retention_seconds,
)
from django_workpump.periodic import ScheduleRegistry, schedules
from django_workpump.pump.claim import ClaimPolicy, ClaimWorker
from django_workpump.pump.coordinator import (
    DatabaseCoordinator,
    InstanceIdentity,
    release_thread_connection,
)
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.flusher import FlusherHealth
from django_workpump.pump.heartbeat import HeartbeatPolicy, HeartbeatWorker
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.pump.maintenance import MaintenanceWorker
from django_workpump.pump.naming import application_name, name_thread_connections
from django_workpump.pump.notify import NotifyGate
from django_workpump.pump.periodic import PeriodicWorker
from django_workpump.pump.renewal import LeaseRenewalWorker
from django_workpump.pump.service import LoopService
from django_workpump.registry import (
    CATEGORIES,
    Registry,
    claim_prefixes,
    claim_topics,
    registry,
)
from django_workpump.states import CancelReason

logger = logging.getLogger("django_workpump.supervisor")

EXIT_OK = 0
EXIT_SERVICE_DIED = 1
EXIT_EVICTED = 3
EXIT_TOO_MANY_ABANDONED = 4

MISSING_MIGRATIONS = "Missing workpump migrations. Run `python manage.py migrate workpump`."


class SchemaNotReady(RuntimeError):
    pass


@dataclass(frozen=True)
class PumpOptions:
    categories: Sequence[str] = CATEGORIES
    concurrency: int | None = None  # None: WORKPUMP["CONCURRENCY"]
    service_name: str = "workpump"
    listen: bool = True
    drain: bool = False
    topics: Sequence[str] | None = None  # None: every topic with a handler here
    queues: Sequence[str] | None = None  # django.tasks queues; None: as topics says
    metrics_port: int | None = None  # serve /metrics here; None: WORKPUMP["METRICS_PORT"]
    metrics_bind: str = "127.0.0.1"  # the address the metrics port is bound on


class DrainWatcher(LoopService):
    """In drain mode: stop the pump once nothing is left to claim.

    That is once a poll that started after the last outcome was written (so it saw
    every head that outcome promoted) found nothing, and no claim took rows meanwhile.
    """

    name = "drain"

    def __init__(
        self,
        dispatcher: Dispatcher,
        claim: ClaimWorker,
        *,
        pump_stopping: threading.Event,
        on_drained: Callable[[], object],
    ) -> None:
        super().__init__()
        self.dispatcher = dispatcher
        self.claim = claim
        self.pump_stopping = pump_stopping
        self.on_drained = on_drained

    def _stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout``; True once the pump or this watcher is stopping."""
        return self.pump_stopping.wait(timeout) or self._stop.is_set()

    def run(self) -> None:
        while not self._stopped(0.05):
            if self.dispatcher.in_flight or self.dispatcher.pending_outcomes:
                continue
            claimed_before = self.claim.claimed_total
            started_before = self.claim.polls
            self.claim.request_immediate_poll()
            while self.claim.last_poll[0] <= started_before and not self._stopped(0.01):
                pass
            idle = not self.dispatcher.in_flight and not self.dispatcher.pending_outcomes
            # A poll under way at the idle check may have claimed rows whose outcomes were
            # written after the empty poll began: then look again.
            claimed_meanwhile = self.claim.claimed_total != claimed_before
            if idle and self.claim.last_poll[1] == 0 and not claimed_meanwhile:
                self.on_drained()
                return


def listen_conninfo(settings: dict[str, Any]) -> str:
    """The DSN of the gate's direct connection: LISTEN_DSN, else the Django alias's."""
    if settings["LISTEN_DSN"]:
        return str(settings["LISTEN_DSN"])
    params = dict(connections[settings["DATABASE_ALIAS"]].get_connection_params())
    for key in ("cursor_factory", "context", "prepare_threshold", "server_side_binding"):
        params.pop(key, None)
    return psycopg.conninfo.make_conninfo(**{k: v for k, v in params.items() if v is not None})


class Supervisor:
    def __init__(
        self,
        options: PumpOptions | None = None,
        *,
        handlers: Registry = registry,
        identity: InstanceIdentity | None = None,
        clock: Clock | None = None,
        periodic_schedules: ScheduleRegistry = schedules,
    ) -> None:
        self.options = options or PumpOptions()
        self.settings = dict(get_settings())
        self.identity = identity or InstanceIdentity(service_name=self.options.service_name)
        self.clock = clock or SystemClock()
        self._gate_down_since: float | None = None  # monotonic; None while the gate is up
        self.alias: str = self.settings["DATABASE_ALIAS"]
        self.handlers = handlers
        s = self.settings
        # Claim only what this process can run (raises TopicSelectionError for a name
        # that has no handler here).
        self.topics = claim_topics(
            handlers,
            self.options.categories,
            topics=self.options.topics,
            queues=self.options.queues,
        )
        # ... and every topic starting with a prefix handler's prefix, unless narrowed
        self.topic_prefixes = claim_prefixes(
            handlers,
            self.options.categories,
            topics=self.options.topics,
            queues=self.options.queues,
        )
        # Serve /metrics on this port (0: any free one) while the pump runs; None: off.
        self.metrics_port: int | None = (
            self.options.metrics_port
            if self.options.metrics_port is not None
            else s["METRICS_PORT"]
        )
        if self.metrics_port is not None:
            metrics.require()  # before anything starts: name the extra to install
            if not 0 <= self.metrics_port <= 65535:
                raise ValueError(
                    f"The metrics port ({self.metrics_port}) must be between 0 and 65535."
                )
        self.metrics = metrics.recorder()
        self.metrics_server: metrics.MetricsServer | None = None
        self.coordinator = DatabaseCoordinator(
            self.identity,
            self.options.categories,
            self.topics,
            self.topic_prefixes,
        )
        self.leases = LeaseRegistry()
        self.dispatcher = Dispatcher(
            self.coordinator,
            handlers,
            self.leases,
            concurrency=self.options.concurrency or s["CONCURRENCY"],
            lease_grace_seconds=s["LEASE_GRACE_SECONDS"],
            max_renewals=s["MAX_RENEWALS_PER_WORK"],
            abandoned_limit=s["MAX_ABANDONED_HANDLERS"],
            lease_seconds=s["LEASE_SECONDS"],
            alias=self.alias,
            clock=self.clock,
            on_slot_free=self._slot_freed,
            on_stream_ready=self._stream_ready,
            on_fatal=lambda reason: self.request_stop(reason, EXIT_TOO_MANY_ABANDONED),
            middleware=middleware.load(s["MIDDLEWARE"]),
            handler_connections=s["HANDLER_CONNECTIONS"],
        )
        self.renewal = LeaseRenewalWorker(
            self.coordinator,
            self.leases,
            lease_seconds=s["LEASE_SECONDS"],
            lease_grace_seconds=s["LEASE_GRACE_SECONDS"],
            max_batch=s["RENEWAL_MAX_BATCH"],
            coalesce_window=s["RENEWAL_COALESCE_WINDOW_MS"] / 1000,
            immediate_flush_at=s["RENEWAL_IMMEDIATE_FLUSH_AT"],
            capacity=s["RENEWAL_CAPACITY"],
            on_deadline=self.dispatcher.abandon,
            on_refused=self._refused,
            on_cancelled=self.dispatcher.cancel_running,
            clock=self.clock,
        )
        self.gate: NotifyGate | None = None
        if self.options.listen:
            self.gate = NotifyGate(
                listen_conninfo(s),
                self.identity.instance_id,
                on_signal=self._signal,
                on_availability=self._gate_changed,
                on_cancel=self.dispatcher.cancel_running,
                hold_alive_lock=s["LIVENESS_SOURCE_MODE"] == "advisory_lock_when_available",
                clock=self.clock,
            )
        gate = self.gate
        self.heartbeat = HeartbeatWorker(
            self.coordinator,
            HeartbeatPolicy.from_settings(s),
            alive_lock_held=(lambda: gate.alive_lock_held) if gate is not None else None,
            on_evicted=lambda: self.request_stop("evicted by peers", EXIT_EVICTED),
            metadata=self._metadata,
            clock=self.clock,
        )
        self.claim = ClaimWorker(
            self.coordinator,
            self.dispatcher,
            ClaimPolicy.from_settings(s),
            gate=self.gate,
            clock=self.clock,
            enabled=s["CLAIM_ENABLED"],
            on_refused=self._refused,
        )
        self.maintenance = MaintenanceWorker(
            alias=self.alias,
            interval_seconds=s["MAINTENANCE_INTERVAL_SECONDS"],
            retention_seconds=s["RETENTION_SECONDS"],
            stale_after_seconds=s["STALE_AFTER_SECONDS"],
            definitively_dead_after_seconds=s["DEFINITIVELY_DEAD_AFTER_SECONDS"],
            lock_loss_grace_seconds=lock_loss_grace_seconds(s),
            dead_retention_seconds=s["DEAD_RETENTION_SECONDS"],
            inbox_dedup_retention_seconds=s["INBOX_DEDUP_RETENTION_SECONDS"],
            tombstone_retention_seconds=tombstone_retention_seconds(s),
            console_retention_seconds=s["CONSOLE_RETENTION_SECONDS"],
        )
        # Started only where there is something to fire (and it is not switched off).
        self.periodic: PeriodicWorker | None = None
        if s["PERIODIC_ENABLED"] and periodic_schedules.all():
            self.periodic = PeriodicWorker(
                alias=self.alias,
                partition_count=s["PARTITION_COUNT"],
                max_payload_bytes=s["MAX_PAYLOAD_BYTES"],
                default_max_attempts=s["MAX_ATTEMPTS"],
                registry=periodic_schedules,
                clock=self.clock,
            )
        self.exit_code: int | None = None
        self.stop_reason: str | None = None
        self._stopping = threading.Event()
        # The services with a supervised thread, by name, in start order.
        self._services: dict[str, LoopService] = {}
        self._started = False
        # The thread that called start() and the connections it had open then: shutdown
        # closes only the ones the pump opened there, never its caller's (call_command).
        self._start_thread: threading.Thread | None = None
        self._caller_connections: set[str] = set()

    # -- wiring callbacks ----------------------------------------------------------
    def _slot_freed(self) -> None:
        self.claim.slot_freed()

    def _stream_ready(self) -> None:
        self.claim.request_immediate_poll()

    def _refused(self, reason: str) -> None:
        """The database refused a claim or renewal: stop as on a refused heartbeat.

        The instance holds no lease any more: every running handler is told at once
        (``work.cancelled``, reason ``lost``).
        """
        self.request_stop(f"evicted: {reason}", EXIT_EVICTED)
        self.leases.cancel_all(CancelReason.LOST)

    def _signal(self, signal: str) -> None:
        if signal in self.options.categories:
            self.claim.request_immediate_poll(new_work=True)
        elif signal == "orphan" or signal.removesuffix(":ended") in self.options.categories:
            # rows were released, or flow-controlled rows ended (room under a cap): a
            # claim for free slots, not new work
            self.claim.request_immediate_poll()

    def _gate_changed(self, available: bool) -> None:
        self._gate_down_since = None if available else self.clock.monotonic()
        if not available:
            self.heartbeat.request_beat()  # the alive-lock went with the connection
        self.claim.on_gate_changed(available)

    def _metadata(self) -> dict[str, Any]:
        return {
            "categories": list(self.options.categories),
            # What this instance claims: status and the admin count the rows nobody runs.
            "topics": self.topics,
            "topic_prefixes": self.topic_prefixes,
            "concurrency": self.dispatcher.concurrency,
            "listener": None if self.gate is None else self.gate.available,
            "listener_down_seconds": self._listener_down_seconds(),
            "alive_lock": None if self.gate is None else self.gate.alive_lock_held,
            "in_flight": self.dispatcher.in_flight,
            # workpump_status shows these: outcomes this instance cannot write
            "stalled_flushers": {
                h.name: {
                    "failures": h.failures,
                    "failing_seconds": round(h.failing_seconds, 1),
                    "pending": h.pending,
                    "last_error": h.last_error,
                }
                for h in self.flusher_health()
                if h.stalled
            },
        }

    def _listener_down_seconds(self) -> float | None:
        """How long the NOTIFY listener has been down (None: up, or not listening)."""
        if self.gate is None or self.gate.available:
            return None
        if self._gate_down_since is None:  # never up since the start
            self._gate_down_since = self.clock.monotonic()
        return round(self.clock.monotonic() - self._gate_down_since, 1)

    def flusher_health(self) -> list[FlusherHealth]:
        """Return the health of the outcome and renewal flushers."""
        return [
            self.dispatcher.completions.health(),
            self.dispatcher.failures.health(),
            self.renewal.flusher.health(),
        ]

    # -- lifecycle -----------------------------------------------------------------
    def start(self, on_ready: Callable[[], None] | None = None) -> None:
        """Check the schema, register, and start every service thread.

        ``on_ready`` is called once every service but the claim runs, just before the
        first claim: ``runworkpump`` prints its startup line there, so that line comes
        before anything the claimed work logs. A stop requested meanwhile (a signal
        during startup) starts no claiming; the caller's ``shutdown()`` then releases
        whatever is held.
        """
        if self._stopping.is_set():
            return
        self._start_thread = threading.current_thread()
        self._caller_connections = {
            c.alias for c in connections.all(initialized_only=True) if c.connection is not None
        }
        if not self.coordinator.schema_ready():
            raise SchemaNotReady(MISSING_MIGRATIONS)
        if self.metrics_port is not None and self.metrics_server is None:
            # First: a port already taken fails the start before anything registers.
            self.metrics_server = metrics.MetricsServer(
                self.metrics_port, self.options.metrics_bind
            )
        if self.heartbeat.policy.enabled:
            first = self.heartbeat.beat()  # registers the instance before the first claim
            if first.accepted is False:
                raise RuntimeError(f"instance {self.identity.instance_id} is tombstoned")
        if self.periodic is not None:
            self.periodic.register()  # schedules as the code defines them, before any fires
        # SQL emit fans out from these; upsert only: this process may load part of the code
        subscriptions.sync(replace=False, using=self.alias, handlers=self.handlers)
        # the handlers' flow limits, as the code declares them now (overrides stay)
        flow.sync(using=self.alias, handlers=self.handlers)
        self._started = True
        if self.gate is not None:
            self._launch(self.gate)
        self.dispatcher.start()
        self._launch(self.renewal)  # its flusher, then its ticking thread
        self._launch(self.heartbeat)
        self._launch(self.maintenance)
        if self.periodic is not None:
            self._launch(self.periodic)
        if on_ready is not None:
            on_ready()
        if self._stopping.is_set():
            return  # stopped while starting: claim nothing
        self._launch(self.claim)
        if self.options.drain:
            self._launch(
                DrainWatcher(
                    self.dispatcher,
                    self.claim,
                    pump_stopping=self._stopping,
                    on_drained=lambda: self.request_stop("drained: nothing left to claim", EXIT_OK),
                )
            )
        # DEBUG: runworkpump's startup line says it, with the details
        logger.debug(
            "workpump instance %s started", self.identity.instance_id, extra={"action": "started"}
        )
        if not any(self.topics.values()) and not any(self.topic_prefixes.values()):
            logger.warning(
                "no handler is registered for categories %s: this instance claims nothing",
                ", ".join(self.options.categories),
                extra={"action": "no_handlers"},
            )

    def _launch(self, service: LoopService) -> None:
        """Start a service whose thread names its connections, closes them on exit, and
        stops the whole pump (exit code 1) if it dies."""
        service.supervise(
            on_thread_start=partial(
                name_thread_connections, application_name(self.identity.instance_id, service.name)
            ),
            on_thread_exit=partial(release_thread_connection, self.alias),
            on_died=self._service_died,
        )
        self._services[service.name] = service
        service.start()

    def _service_died(self, service: LoopService, exc: BaseException) -> None:
        logger.exception("service %s died", service.name, extra={"action": "service_died"})
        self.request_stop(f"service {service.name} died: {exc}", EXIT_SERVICE_DIED)

    def request_stop(self, reason: str, exit_code: int = EXIT_OK) -> None:
        """Ask the pump to stop (any thread; the first reason and code win)."""
        if self._stopping.is_set():
            return
        self.stop_reason, self.exit_code = reason, exit_code
        logger.info("stopping: %s", reason, extra={"action": "stopping"})
        self._stopping.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested; True if it was."""
        return self._stopping.wait(timeout)

    def shutdown(self) -> int:
        """Stop everything in order; return the exit code."""
        self.request_stop("shutdown requested", EXIT_OK)
        if not self._started:
            if self.metrics_server is not None:
                self.metrics_server.close()
            return self.exit_code or EXIT_OK
        s = self.settings
        self.claim.stop()
        self.claim.join(5)
        self.dispatcher.stop_accepting()
        if not self.dispatcher.wait_idle(s["SHUTDOWN_TIMEOUT_SECONDS"]):
            failed = self.dispatcher.fail_running(s["SHUTDOWN_TIMEOUT_SECONDS"])
            logger.warning(
                "%d handlers still running after %s s: their attempts are failed (reason "
                "shutdown) and counted",
                failed,
                s["SHUTDOWN_TIMEOUT_SECONDS"],
                extra={"action": "shutdown_timeout"},
            )
        self.dispatcher.stop()
        self.renewal.stop()  # flushes the renewals still buffered
        self.renewal.join(5)
        # Before deregistering: a beat landing after it would register the instance again.
        self.heartbeat.stop()
        self.heartbeat.join(5)
        if self.exit_code != EXIT_EVICTED:
            self._deregister(timeout=5)
        self.maintenance.stop()
        if self.periodic is not None:
            self.periodic.stop()
        if self.gate is not None:
            self.gate.stop()
        for service in list(self._services.values()):
            service.join(5)
        if self.metrics_server is not None:
            self.metrics_server.close()
        self._close_own_connections()
        logger.debug(  # runworkpump's stop line says it, with the counts
            "workpump instance %s stopped (%s)",
            self.identity.instance_id,
            self.stop_reason,
            extra={"action": "stopped"},
        )
        return self.exit_code if self.exit_code is not None else EXIT_OK

    def _close_own_connections(self) -> None:
        """Close the connections start() opened in its thread; leave the caller's open."""
        if threading.current_thread() is not self._start_thread:
            return  # service threads close their own; this thread's are not the pump's
        for connection in connections.all(initialized_only=True):
            if connection.alias not in self._caller_connections:
                connection.close()

    def _deregister(self, timeout: float) -> None:
        """Release this instance's rows and delete its row, giving up after ``timeout``."""
        done = threading.Event()

        def deregister() -> None:
            try:
                name_thread_connections(application_name(self.identity.instance_id, "deregister"))
                released = self.coordinator.deregister()
                logger.log(
                    logging.INFO if released else logging.DEBUG,
                    "deregistered; released %d rows",
                    released,
                    extra={"action": "deregistered"},
                )
            except Exception:
                logger.exception(
                    "deregistration failed: peers will evict this instance",
                    extra={"action": "deregister_failed"},
                )
            finally:
                release_thread_connection(self.alias)
                done.set()

        threading.Thread(target=deregister, name="workpump-deregister", daemon=True).start()
        if not done.wait(timeout):
            logger.warning(
                "deregistration did not finish in %s s: peers will evict this instance",
                timeout,
                extra={"action": "deregister_timeout"},
            )
