"""Test helpers: run pending work in the test's own transaction, and capture what was produced.

``runworkpump`` runs in its own process on its own connections, so it never sees the
uncommitted rows of a Django ``TestCase``. ``run_pending()`` claims and runs them in the
calling thread, on the test's connection, through the same SQL as the pump (claims by
topic, per-stream order, lease tokens, fenced completion), so it works inside ``TestCase``
and ``TransactionTestCase`` alike. An async handler runs through ``async_to_sync`` from
the calling thread, so its ORM calls (``acreate``, ``sync_to_async``) come back to that
thread and run in the test's transaction too. ``captured()`` records what the code under
test sent, received and emitted. See docs/testing.md.
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from django.db import transaction

from django_workpump import coroutines, db, producer, tracing
from django_workpump.clock import SystemClock
from django_workpump.conf import setting
from django_workpump.control import Discard, Release, Snooze, named_index
from django_workpump.pump.claim import warn_unreadable_headers
from django_workpump.pump.jobs import stream_run_key
from django_workpump.pump.lease import LeaseHandle
from django_workpump.pump.running import claimed_work, store_checkpoint
from django_workpump.registry import CATEGORIES, claim_prefixes, claim_topics, registry
from django_workpump.states import FailureReason, OutcomeStatus
from django_workpump.storable import error_text, storable_result
from django_workpump.work import Work

# The instance id run_pending claims as: registered in the test's transaction, like any
# instance (a claim by an unregistered instance is refused).
TEST_INSTANCE_ID = uuid.UUID("00000000-0000-4000-8000-00000000face")
TEST_LEASE_SECONDS = 300


@dataclass(frozen=True)
class Failure:
    """A handler failure recorded by ``run_pending(raise_errors=False)``."""

    category: str
    work_id: uuid.UUID
    topic: str
    error: BaseException


@dataclass
class RunReport:
    """What one ``run_pending`` call did (also returned as an int: the rows run)."""

    ran: int = 0
    failures: list[Failure] = field(default_factory=list)
    snoozed: list[uuid.UUID] = field(default_factory=list)  # raised workpump.Snooze
    discarded: list[uuid.UUID] = field(default_factory=list)  # raised workpump.Discard
    released: list[uuid.UUID] = field(default_factory=list)  # raised workpump.Release


def run_pending(
    *,
    categories: Iterable[str] | None = None,
    topics: Iterable[str] | None = None,
    max_rounds: int = 100,
    raise_errors: bool = True,
    using: str | None = None,
    report: RunReport | None = None,
    savepoint: bool = True,
) -> int:
    """Run every row that is claimable now, in rounds, until none is left; return how many.

    Each round claims what is claimable (stream heads only, so streams run in order; the
    next row of a stream becomes claimable once its head completed), runs each handler in
    a savepoint, and completes or fails the row through the same fenced SQL as the pump.
    A batch handler gets each stream's run (``STREAM_RUN_MAX`` rows) in one call, with
    the pump's meaning of its outcome (docs/control-flow.md, "Batch handlers").
    Events' perspective and receptor rows are followed in later rounds. Rows scheduled for
    later (a deferral, a retry's backoff) are not due, so they do not run. As under the
    pump, a row whose payload cannot be decoded is parked dead unrun, and one whose
    headers cannot be read runs without them.

    The first handler exception is raised (its row is failed first, as the pump would);
    with ``raise_errors=False`` failures are recorded in ``report`` and the run goes on
    (a ``KeyboardInterrupt`` is always raised, after its row is failed).
    ``savepoint=False`` runs handlers without the savepoint, so a failing handler's
    writes stay, as under ``runworkpump``, where a handler that is not ``atomic`` runs
    in autocommit (a task's attempt records among them); use it outside a transaction
    (``TransactionTestCase``), or with handlers that cannot break the test's transaction.
    Raises RuntimeError when work is still claimable after ``max_rounds`` rounds (a
    handler that keeps producing work for itself).
    """
    from django_workpump.tasks import load_task_code

    load_task_code()  # as runworkpump does at start: a task row runs only loaded code
    alias = using or setting("DATABASE_ALIAS")
    chosen = [c for c in (categories or CATEGORIES)]
    named = list(topics) if topics is not None else None
    wanted = claim_topics(registry, chosen, topics=named)
    prefixes = claim_prefixes(registry, chosen, topics=named)
    report = report if report is not None else RunReport()
    # Batch handlers get stream runs, as under the pump (STREAM_RUN_MAX rows a claim).
    batched = {c: [t for t in ts if _is_batch(c, t)] for c, ts in wanted.items()}
    batched = {c: ts for c, ts in batched.items() if ts}
    single = {c: [t for t in ts if t not in batched.get(c, ())] for c, ts in wanted.items()}
    _register(alias)
    for _ in range(max_rounds):
        runs: list[list[Any]] = []
        if batched:
            rows = db.claim_work(
                instance_id=TEST_INSTANCE_ID,
                max_rows=1_000,
                lease_seconds=TEST_LEASE_SECONDS,
                partition_count=setting("PARTITION_COUNT"),
                categories=list(batched),
                topics=batched,
                stream_run_max=setting("STREAM_RUN_MAX"),
                using=alias,
            )
            runs.extend(_runs_of(rows, alias))
        rows = db.claim_work(
            instance_id=TEST_INSTANCE_ID,
            max_rows=1_000,
            lease_seconds=TEST_LEASE_SECONDS,
            partition_count=setting("PARTITION_COUNT"),
            categories=chosen,
            topics=single if batched else wanted,
            topic_prefixes={c: p for c, p in prefixes.items() if p} or None,
            using=alias,
        )
        if not rows and not runs:
            return report.ran
        rows = _runnable([*rows, *(row for run in runs for row in run)], rows, alias)
        runs = [kept for run in runs if (kept := [row for row in run if not row.payload_error])]
        for run in runs:
            _run_batch(run, alias, raise_errors, report, savepoint)
        for row in rows:
            _run_one(row, alias, raise_errors, report, savepoint)
    raise RuntimeError(
        f"run_pending: work was still claimable after {max_rounds} rounds; a handler may be "
        "producing work for itself. Raise max_rounds if that is intended."
    )


def _runnable(claimed: list[Any], rows: list[Any], alias: str) -> list[Any]:
    """``rows`` but those whose payload cannot be decoded, which are parked dead (reason
    ``undecodable_payload``) as the pump parks them; rows whose headers cannot be read
    run without them, with the pump's warning."""
    warn_unreadable_headers(claimed)
    undecodable = [row for row in claimed if row.payload_error]
    for row in undecodable:
        error = f"the payload cannot be decoded: {row.payload_error}"
        reason = str(FailureReason.UNDECODABLE_PAYLOAD)
        outcomes = db.fail_work(
            instance_id=TEST_INSTANCE_ID,
            category=row.category,
            ids=[row.work_id],
            lease_tokens=[row.lease_token],
            errors=[error],
            reasons=[reason],
            using=alias,
        )
        if any(o.status == OutcomeStatus.RETRY for o in outcomes):
            db.dead_letter(category=row.category, ids=[row.work_id], reason=reason, using=alias)
    return [row for row in rows if not row.payload_error]


def _is_batch(category: str, topic: str) -> bool:
    handler = registry.get(category, topic)
    return handler is not None and handler.batch


def _register(alias: str) -> None:
    db.record_heartbeat(
        instance_id=TEST_INSTANCE_ID,
        service_name="run_pending",
        host_name="test",
        process_id=0,
        using=alias,
    )


def _run_one(row: Any, alias: str, raise_errors: bool, report: RunReport, savepoint: bool) -> None:
    handler = registry.get(row.category, row.topic)
    if handler is None:  # not claimed by topic; a row a test wrote by hand
        raise LookupError(f"No handler registered for {row.category} {row.topic!r}.")
    work = _work_of(row, alias)
    try:
        # A savepoint: a failing handler's writes go, the test's transaction stays usable
        # (savepoint=False: they stay, as under runworkpump).
        with (
            transaction.atomic(using=alias) if savepoint else nullcontext(),
            tracing.handling(work),
        ):
            result = handler.func([work] if handler.batch else work)
            if inspect.isawaitable(result):
                result = coroutines.run(result)
    except BaseException as exc:  # noqa: BLE001 (as the pump: it ends the attempt)
        _raised(row, exc, alias, raise_errors, report)
        return
    db.complete_work(
        instance_id=TEST_INSTANCE_ID,
        category=row.category,
        ids=[row.work_id],
        lease_tokens=[row.lease_token],
        results=[storable_result(result)],
        using=alias,
    )
    report.ran += 1


def _raised(
    row: Any, exc: BaseException, alias: str, raise_errors: bool, report: RunReport
) -> None:
    """Write what a handler's exception does to ``row``, as the pump does."""
    if isinstance(exc, Snooze):
        # As the pump does: back for later, the attempt not spent (a later round runs it
        # again once due; MAX_SNOOZES bounds a handler that always snoozes).
        db.snooze_work(
            instance_id=TEST_INSTANCE_ID,
            category=row.category,
            ids=[row.work_id],
            lease_tokens=[row.lease_token],
            seconds=[exc.seconds],
            max_snoozes=setting("MAX_SNOOZES"),
            using=alias,
        )
        report.snoozed.append(row.work_id)
        return
    if isinstance(exc, Discard):
        db.discard_work(
            instance_id=TEST_INSTANCE_ID,
            category=row.category,
            ids=[row.work_id],
            lease_tokens=[row.lease_token],
            reasons=[exc.reason],
            using=alias,
        )
        report.discarded.append(row.work_id)
        return
    if isinstance(exc, Release):
        # As the pump outside a shutdown: the attempt counts, the row is claimable again
        # at once (a later round runs it; max_attempts bounds a handler that always does).
        db.fail_work(
            instance_id=TEST_INSTANCE_ID,
            category=row.category,
            ids=[row.work_id],
            lease_tokens=[row.lease_token],
            errors=["the handler released the row unfinished"],
            reasons=[FailureReason.RELEASED],
            retry_delays=[0.0],
            using=alias,
        )
        report.released.append(row.work_id)
        return
    # As the pump: any other exception fails the attempt.
    db.fail_work(
        instance_id=TEST_INSTANCE_ID,
        category=row.category,
        ids=[row.work_id],
        lease_tokens=[row.lease_token],
        errors=[error_text(exc)],
        reasons=["handler_error"],
        retry_base_seconds=setting("RETRY_BACKOFF_BASE_SECONDS"),
        retry_max_seconds=setting("RETRY_BACKOFF_MAX_SECONDS"),
        using=alias,
    )
    if raise_errors or isinstance(exc, KeyboardInterrupt):
        raise exc
    report.failures.append(Failure(row.category, row.work_id, row.topic, exc))


def _runs_of(rows: list[Any], alias: str) -> list[list[Any]]:
    """Claimed rows as the pump runs them: a stream's rows together, in stream order.

    The rows of a chain leased behind their dependency are released unstarted, as the
    pump releases them for a batch handler: they wait for it to complete.
    """
    runs: dict[Any, list[Any]] = {}
    for row in rows:
        if row.after_id is None:
            runs.setdefault(stream_run_key(row), []).append(row)
    chained = [row for row in rows if row.after_id is not None]
    if chained:
        db.release_work(
            instance_id=TEST_INSTANCE_ID,
            category=chained[0].category,  # the outbox: chains are of the outbox alone
            ids=[row.work_id for row in chained],
            lease_tokens=[row.lease_token for row in chained],
            using=alias,
        )
    return list(runs.values())


def _run_batch(
    rows: list[Any], alias: str, raise_errors: bool, report: RunReport, savepoint: bool
) -> None:
    """Run a batch handler on one stream run, with the pump's outcomes (docs/control-flow.md).

    In the savepoint (the default) a raising handler's writes roll back as an atomic
    handler's do, so the rows before a ``Snooze``/``Discard``'s row are released and run
    again in the next round rather than completed without their writes.
    """
    first = rows[0]
    handler = registry.get(first.category, first.topic)
    if handler is None:
        raise LookupError(f"No handler registered for {first.category} {first.topic!r}.")
    works = [_work_of(row, alias) for row in rows]
    try:
        with (
            transaction.atomic(using=alias) if savepoint else nullcontext(),
            tracing.handling_batch(works),
        ):
            result = handler.func(works)
            if inspect.isawaitable(result):
                coroutines.run(result)
    except BaseException as exc:  # noqa: BLE001 (as the pump: it ends the attempt)
        raised: BaseException = exc
    else:
        _complete(rows, alias)
        report.ran += len(rows)
        return
    at = 0  # the row the exception concerns: a Snooze's or Discard's, else the first
    if isinstance(raised, Snooze | Discard):
        try:
            at = named_index(raised, works)
        except ValueError as error:  # it named no row of this batch: fail the first
            raised = error
    # Without the savepoint or an atomic handler, the rows before it keep their writes.
    done = rows[:at] if not (handler.atomic or savepoint) else []
    if done:
        _complete(done, alias)
        report.ran += len(done)
    rest = [row for row in rows[len(done) :] if row is not rows[at]]
    if rest:
        db.release_work(
            instance_id=TEST_INSTANCE_ID,
            category=first.category,
            ids=[row.work_id for row in rest],
            lease_tokens=[row.lease_token for row in rest],
            using=alias,
        )
    _raised(rows[at], raised, alias, raise_errors, report)


def _complete(rows: list[Any], alias: str) -> None:
    db.complete_work(
        instance_id=TEST_INSTANCE_ID,
        category=rows[0].category,
        ids=[row.work_id for row in rows],
        lease_tokens=[row.lease_token for row in rows],
        results=[None] * len(rows),
        using=alias,
    )


def _work_of(row: Any, alias: str | None = None) -> Work:
    handle = LeaseHandle(
        row.category,
        row.work_id,
        deadline=float("inf"),
        max_renewals=0,
        clock=SystemClock(),
        lease_token=row.lease_token,
    )
    return claimed_work(
        row,
        handle,
        TEST_INSTANCE_ID,
        checkpointer=partial(store_checkpoint, alias or setting("DATABASE_ALIAS")),
    )


# -- capturing what was produced -----------------------------------------------------------


@dataclass(frozen=True)
class Produced:
    """One send, receive or emit, as the code under test made it."""

    kind: str  # "send", "receive" or "emit"
    topic: str  # destination, handler name or event type
    payload: Mapping[str, Any]
    stream: str | None
    id: uuid.UUID | None


class Captured:
    """What was sent, received and emitted while ``captured()`` was active."""

    def __init__(self) -> None:
        self.items: list[Produced] = []

    def __call__(self, **item: Any) -> None:
        self.items.append(Produced(**item))

    def of(self, kind: str, topic: str | None = None) -> list[Produced]:
        return [i for i in self.items if i.kind == kind and (topic is None or i.topic == topic)]

    @property
    def sent(self) -> list[Produced]:
        return self.of("send")

    @property
    def received(self) -> list[Produced]:
        return self.of("receive")

    @property
    def emitted(self) -> list[Produced]:
        return self.of("emit")

    def _assert(self, kind: str, topic: str, subset: Mapping[str, Any]) -> Produced:
        for item in self.of(kind, topic):
            if all(item.payload.get(k) == v for k, v in subset.items()):
                return item
        seen = [(i.topic, dict(i.payload)) for i in self.of(kind)]
        want = f" with payload ⊇ {json.dumps(dict(subset), default=str)}" if subset else ""
        raise AssertionError(f"Nothing was {_PAST[kind]} to {topic!r}{want}; {_PAST[kind]}: {seen}")

    def assert_sent(self, destination: str, **payload_subset: Any) -> Produced:
        """The outbox message to ``destination`` whose payload holds ``payload_subset``."""
        return self._assert("send", destination, payload_subset)

    def assert_received(self, handler_name: str, **payload_subset: Any) -> Produced:
        return self._assert("receive", handler_name, payload_subset)

    def assert_emitted(self, event_type: str, **payload_subset: Any) -> Produced:
        return self._assert("emit", event_type, payload_subset)

    def assert_nothing_sent(self, destination: str | None = None) -> None:
        found = self.of("send", destination)
        if found:
            raise AssertionError(f"Expected nothing sent, got {[i.topic for i in found]}.")


_PAST = {"send": "sent", "receive": "received", "emit": "emitted"}


@contextmanager
def captured() -> Iterator[Captured]:
    """Record every send, receive and emit made in the block (rows are still written)."""
    capture = Captured()
    producer.capture_listeners.append(capture)
    try:
        yield capture
    finally:
        producer.capture_listeners.remove(capture)
