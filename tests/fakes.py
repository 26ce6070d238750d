"""Fakes shared by the pump service tests: a scripted Coordinator, a dispatch sink, a gate.

The fakes record what the services ask of them and set Events/conditions a test can wait on
(with a timeout), so threaded tests never sleep.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import OperationalError

from django_workpump.clock import FrozenClock
from django_workpump.db import ClaimedWork, Outcome
from django_workpump.pump.coordinator import InstanceIdentity, lease_arrays
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.registry import Handler, Registry
from django_workpump.work import Lease

# How long a test waits for something a service thread should do promptly.
WAIT = 5.0
# The topic of make_row's rows, which make_dispatcher's handler serves.
TOPIC = "orders.created"

CLAIMED_AT = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def make_row(
    category: str = "outbox", *, has_more: bool = False, lease_seconds: float = 300
) -> ClaimedWork:
    """One claimed row, leased for ``lease_seconds`` from CLAIMED_AT."""
    return ClaimedWork(
        category=category,
        work_id=uuid.uuid4(),
        topic=TOPIC,
        payload={"order": 1},
        stream=None,
        attempts=1,
        max_attempts=10,
        lease_expiry=CLAIMED_AT + timedelta(seconds=lease_seconds),
        event_id=None,
        event_type=None,
        priority=0,
        claimed_at=CLAIMED_AT,
        lease_token=uuid.uuid4(),
        has_more=has_more,
    )


def blocking(release: threading.Event, rows: Sequence[ClaimedWork] = ()) -> Callable[[], Any]:
    """A claim script step that blocks until ``release`` is set, then returns ``rows``."""

    def step() -> list[ClaimedWork]:
        if not release.wait(WAIT):
            raise AssertionError("the test never released the blocked claim")
        return list(rows)

    return step


class FakeCoordinator:
    """A Coordinator whose answers are scripted and whose calls are recorded.

    Script steps (for claims and heartbeats) are values, exceptions (raised) or zero-argument
    callables (called; their result is the answer). An exhausted script gives the default.
    """

    def __init__(
        self,
        *,
        claims: Iterable[Any] = (),
        heartbeats: Iterable[Any] = (),
        eviction_due_in: float | BaseException | None = None,
        reap: Sequence[uuid.UUID] = (),
        refuse_renewal: Iterable[uuid.UUID] = (),
        renew_errors: int = 0,
        renew_refusal: BaseException | None = None,
        cancelled_renewal: Iterable[uuid.UUID] = (),
        on_heartbeat: Callable[[], Any] | None = None,
    ) -> None:
        self.identity = InstanceIdentity(host_name="test-host", process_id=4242)
        self.calls: list[str] = []  # method names, in call order
        self.claims: list[int] = []  # max_rows of each claim call
        self.underserved_only: list[bool] = []  # each claim call's underserved_only
        self.heartbeats: list[dict[str, Any]] = []
        self.renewals: list[tuple[str, list[uuid.UUID]]] = []
        self.renewal_tokens: list[uuid.UUID] = []  # every token sent to renew, in order
        self.completed: list[tuple[uuid.UUID, str | None]] = []  # (work id, result)
        self.logs: list[tuple[uuid.UUID, str | None]] = []  # (work id, attempt log JSON)
        self.released: list[uuid.UUID] = []
        self.failed: list[tuple[uuid.UUID, str, str]] = []  # (work id, error, reason)
        self.dead_lettered: list[tuple[uuid.UUID, str]] = []  # (id, error)
        self.dead_letter_reasons: list[str] = []
        self.fail_delays: list[float | None] = []  # the retry delay of each failure
        self.snoozed: list[tuple[uuid.UUID, float]] = []  # (work id, seconds)
        self.discarded: list[tuple[uuid.UUID, str]] = []  # (work id, reason)
        self.cancelled_renewals = set(cancelled_renewal)  # renew answers these 'cancelled'
        # (method, work id, lease token) of every outcome and release, in call order
        self.tokens: list[tuple[str, uuid.UUID, uuid.UUID]] = []
        self.reap_calls = 0
        self.eviction_due_in = eviction_due_in  # what next_eviction_in answers
        self.reap_result = list(reap)
        self.refused = set(refuse_renewal)
        self.renew_errors = renew_errors
        self.renew_refusal = renew_refusal  # raised by every renew (e.g. InstanceRefused)
        self.on_heartbeat = on_heartbeat
        self._claim_script: deque[Any] = deque(claims)
        self._heartbeat_script: deque[Any] = deque(heartbeats)
        self._cond = threading.Condition()

    # -- waiting ---------------------------------------------------------------------
    def wait_for_claims(self, count: int, timeout: float = WAIT) -> bool:
        """Wait until ``count`` claims were made; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.claims) >= count, timeout)

    def wait_for_call(self, name: str, count: int = 1, timeout: float = WAIT) -> bool:
        """Wait until method ``name`` was called ``count`` times; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.calls.count(name) >= count, timeout)

    def wait_for_any_call(self, *names: str, timeout: float = WAIT) -> bool:
        """Wait until one of the methods ``names`` was called; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: any(n in self.calls for n in names), timeout)

    def _record(self, name: str) -> None:
        with self._cond:
            self.calls.append(name)
            self._cond.notify_all()

    @staticmethod
    def _resolve(step: Any) -> Any:
        if isinstance(step, BaseException):
            raise step
        return step() if callable(step) else step

    # -- the Coordinator protocol ----------------------------------------------------
    def schema_ready(self) -> bool:
        self._record("schema_ready")
        return True

    def claim(self, max_rows: int, underserved_only: bool = False) -> list[ClaimedWork]:
        with self._cond:
            self.claims.append(max_rows)
            self.underserved_only.append(underserved_only)
            self.calls.append("claim")
            step = self._claim_script.popleft() if self._claim_script else []
            self._cond.notify_all()
        return self._resolve(step)

    def renew(self, leases: Sequence[Lease]) -> dict[uuid.UUID, Any]:
        category, ids, tokens = lease_arrays(leases)
        self._record("renew")
        if self.renew_errors > 0:
            self.renew_errors -= 1
            raise OperationalError("renew_leases failed: connection lost")
        if isinstance(self.renew_refusal, BaseException):
            raise self.renew_refusal
        self.renewals.append((category, list(ids)))
        self.renewal_tokens.extend(tokens)
        return {
            work_id: None if work_id in self.cancelled_renewals else CLAIMED_AT
            for work_id in ids
            if work_id not in self.refused
        }

    def complete(
        self,
        leases: Sequence[Lease],
        results: Sequence[str | None],
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]:
        _, ids, tokens = lease_arrays(leases)
        with self._cond:
            self.logs.extend(zip(ids, logs or [None] * len(ids), strict=True))
            self.completed.extend(zip(ids, results, strict=True))
            self.tokens.extend(("complete", i, t) for i, t in zip(ids, tokens, strict=True))
        self._record("complete")
        return [Outcome(work_id, "done") for work_id in ids]

    def fail(
        self,
        leases: Sequence[Lease],
        errors: Sequence[str],
        reasons: Sequence[str],
        delays: Sequence[float | None] | None = None,
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]:
        _, ids, tokens = lease_arrays(leases)
        with self._cond:
            self.logs.extend(zip(ids, logs or [None] * len(ids), strict=True))
            self.failed.extend(zip(ids, errors, reasons, strict=True))
            self.fail_delays.extend(delays or [None] * len(ids))
            self.tokens.extend(("fail", i, t) for i, t in zip(ids, tokens, strict=True))
        self._record("fail")
        return [Outcome(work_id, "retry") for work_id in ids]

    def release(self, leases: Sequence[Lease]) -> list[Outcome]:
        _, ids, tokens = lease_arrays(leases)
        with self._cond:
            self.released.extend(ids)
            self.tokens.extend(("release", i, t) for i, t in zip(ids, tokens, strict=True))
        self._record("release")
        return [Outcome(work_id, "released") for work_id in ids]

    def dead_letter(
        self,
        leases: Sequence[Lease],
        errors: Sequence[str],
        reason: str,
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]:
        _, ids, tokens = lease_arrays(leases)
        with self._cond:
            self.logs.extend(zip(ids, logs or [None] * len(ids), strict=True))
            self.dead_lettered.extend(zip(ids, errors, strict=True))
            self.dead_letter_reasons.extend([reason] * len(ids))
            self.tokens.extend(("dead_letter", i, t) for i, t in zip(ids, tokens, strict=True))
        self._record("dead_letter")
        return [Outcome(work_id, "dead") for work_id in ids]

    def snooze(self, leases: Sequence[Lease], seconds: Sequence[float]) -> list[Outcome]:
        _, ids, tokens = lease_arrays(leases)
        with self._cond:
            self.snoozed.extend(zip(ids, seconds, strict=True))
            self.tokens.extend(("snooze", i, t) for i, t in zip(ids, tokens, strict=True))
        self._record("snooze")
        return [Outcome(work_id, "snoozed") for work_id in ids]

    def discard(
        self,
        leases: Sequence[Lease],
        reasons: Sequence[str],
        logs: Sequence[str | None] | None = None,
    ) -> list[Outcome]:
        _, ids, tokens = lease_arrays(leases)
        with self._cond:
            self.logs.extend(zip(ids, logs or [None] * len(ids), strict=True))
            self.discarded.extend(zip(ids, reasons, strict=True))
            self.tokens.extend(("discard", i, t) for i, t in zip(ids, tokens, strict=True))
        self._record("discard")
        return [Outcome(work_id, "discarded") for work_id in ids]

    def heartbeat(self, metadata: Mapping[str, Any]) -> bool:
        self._record("heartbeat")
        self.heartbeats.append(dict(metadata))
        if self.on_heartbeat is not None:
            self.on_heartbeat()
        return self._resolve(self._heartbeat_script.popleft() if self._heartbeat_script else True)

    def next_eviction_in(self) -> float | None:
        self._record("next_eviction_in")
        if isinstance(self.eviction_due_in, BaseException):
            raise self.eviction_due_in
        return self.eviction_due_in

    def reap_stale(self) -> list[uuid.UUID]:
        self._record("reap_stale")
        self.reap_calls += 1
        return list(self.reap_result)

    def deregister(self) -> int:
        self._record("deregister")
        return 1

    @property
    def renewed_ids(self) -> list[uuid.UUID]:
        """Every id sent to renew, flattened, in order."""
        return [work_id for _, ids in self.renewals for work_id in ids]


class FakeSink:
    """A DispatchSink with a fixed number of free slots that records submitted batches."""

    def __init__(self, free: int = 4) -> None:
        self.free = free
        self.batches: list[list[ClaimedWork]] = []
        self.fronts: list[bool] = []  # each batch's ``front``

    def free_slots(self) -> int:
        return self.free

    def submit(self, rows: list[ClaimedWork], front: bool = False) -> None:
        self.batches.append(list(rows))
        self.fronts.append(front)


class FakeGate:
    """A NOTIFY gate whose availability a test sets; counts how often the claimer reads it.

    The claim loop reads ``available`` once per wait it computes, so ``wait_for_reads(n)``
    tells a test the loop has settled into its n-th wait.
    """

    def __init__(self, available: bool = True) -> None:
        self._available = available
        self.reads = 0
        self._cond = threading.Condition()

    @property
    def available(self) -> bool:
        with self._cond:
            self.reads += 1
            self._cond.notify_all()
            return self._available

    @available.setter
    def available(self, value: bool) -> None:
        with self._cond:
            self._available = value

    def wait_for_reads(self, count: int, timeout: float = WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.reads >= count, timeout)


class LogWatch(logging.Handler):
    """A handler that sets an Event per ``extra={"action": ...}`` it sees."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self._seen: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, action: str) -> threading.Event:
        with self._lock:
            return self._seen.setdefault(action, threading.Event())

    def emit(self, record: logging.LogRecord) -> None:
        action = getattr(record, "action", None)
        if action is not None:
            self._event(action).set()

    def wait_for(self, action: str, timeout: float = WAIT) -> bool:
        return self._event(action).wait(timeout)


@contextmanager
def watching(logger_name: str) -> Iterator[LogWatch]:
    """Attach a LogWatch to a logger for the duration of the block."""
    watch = LogWatch()
    logger = logging.getLogger(logger_name)
    old_level = logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.DEBUG)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(old_level)


class ServiceThread(threading.Thread):
    """Run a service's ``run()`` in a daemon thread and keep what it raised."""

    def __init__(self, service: Any) -> None:
        super().__init__(name=f"test-{type(service).__name__}", daemon=True)
        self.service = service
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.service.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread by finish()
            self.error = exc

    def finish(self, timeout: float = WAIT) -> None:
        """Join; fail if run() is still going or raised."""
        self.join(timeout)
        assert not self.is_alive(), f"{type(self.service).__name__}.run() did not return"
        if self.error is not None:
            raise self.error


@contextmanager
def running(service: Any, timeout: float = WAIT) -> Iterator[ServiceThread]:
    """Run ``service.run()`` in a thread for the block; then stop() it and check it returned."""
    thread = ServiceThread(service)
    thread.start()
    try:
        yield thread
    finally:
        service.stop()
        thread.join(timeout)
    thread.finish(0)


def drain_rows(
    rows: Sequence[ClaimedWork],
    handlers: Registry,
    coordinator: FakeCoordinator | None = None,
    **dispatcher_options: Any,
) -> FakeCoordinator:
    """Run ``rows`` on a dispatcher of ``handlers`` (one thread unless ``concurrency`` says
    otherwise) on a fake coordinator and a frozen clock until it is idle, then stop it."""
    coordinator = coordinator or FakeCoordinator()
    dispatcher = Dispatcher(
        coordinator,
        handlers,
        LeaseRegistry(),
        lease_grace_seconds=5,
        clock=FrozenClock(),
        **{"concurrency": 1, **dispatcher_options},
    )
    dispatcher.submit(list(rows))
    dispatcher.start()
    try:
        assert dispatcher.wait_idle(WAIT)
    finally:
        dispatcher.stop()
    return coordinator


def make_dispatcher(
    func: Any, coordinator: FakeCoordinator | None = None, **handler_options: Any
) -> tuple[Dispatcher, FakeCoordinator, LeaseRegistry, FrozenClock]:
    """A dispatcher running ``func`` for TOPIC on a fake coordinator and a frozen clock."""
    coordinator = coordinator or FakeCoordinator()
    handlers = Registry()
    handlers.register(Handler("outbox", TOPIC, func, **handler_options))
    leases = LeaseRegistry()
    clock = FrozenClock()
    dispatcher = Dispatcher(
        coordinator,
        handlers,
        leases,
        concurrency=2,
        lease_grace_seconds=30,
        max_renewals=6,
        lease_seconds=300,
        clock=clock,
    )
    return dispatcher, coordinator, leases, clock
