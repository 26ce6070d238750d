"""Prometheus metrics: the pump's series after real work, the cached database gauges,
the endpoint of ``runworkpump --metrics-port`` and the view, and the package without
``prometheus_client``.

Counters live in Prometheus's default registry for the whole test process, so each test
uses topics of its own and reads the series of those topics only.
"""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import django_workpump as workpump
from django_workpump import db, metrics, models, status
from django_workpump.clock import FrozenClock
from django_workpump.db import Outcome
from django_workpump.pump.claim import ClaimPolicy, ClaimWorker
from django_workpump.pump.dispatch import Dispatcher
from django_workpump.pump.lease import LeaseRegistry
from django_workpump.pump.supervisor import EXIT_OK
from django_workpump.registry import Handler, Registry
from django_workpump.testing import run_pending
from tests.fakes import WAIT, FakeCoordinator, FakeSink, make_row
from tests.helpers import FAST_PUMP, ROOT, at, drain, enroll, scalar, wait_until

FAST = {**FAST_PUMP, "CONCURRENCY": 4}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of an exposition, by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict[Any, float], name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_the_view_after_a_drained_pump_counts_runs_outcomes_and_rows(outbox_handler, pump):
    def boom(work: Any) -> None:
        raise ValueError("no")

    outbox_handler("metrics.ok", lambda work: {"ok": True})
    outbox_handler("metrics.boom", boom, max_attempts=1)
    for n in range(5):
        workpump.send("metrics.ok", {"n": n})
    for n in range(2):
        workpump.send("metrics.boom", {"n": n})

    assert drain(pump(drain=True)) == EXIT_OK
    metrics.database_collector().clear()  # the database gauges as of now
    response = Client().get("/metrics")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    found = samples(response.content.decode())
    ok = {"category": "outbox", "topic": "metrics.ok"}
    bad = {"category": "outbox", "topic": "metrics.boom"}
    assert value(found, "workpump_claimed_total", **ok) == 5
    assert value(found, "workpump_done_total", **ok) == 5
    assert value(found, "workpump_failed_total", **ok, reason="handler_error") is None
    assert value(found, "workpump_claimed_total", **bad) == 2
    assert value(found, "workpump_done_total", **bad) is None
    assert value(found, "workpump_failed_total", **bad, reason="handler_error") == 2
    assert value(found, "workpump_dead_lettered_total", **bad, reason="handler_error") == 2
    # one observation per handler run, and per start for the queue wait
    assert value(found, "workpump_handler_duration_seconds_count", **ok) == 5
    assert value(found, "workpump_handler_duration_seconds_count", **bad) == 2
    assert value(found, "workpump_queue_wait_seconds_count", **ok) == 5
    assert value(found, "workpump_queue_wait_seconds_sum", **ok) >= 0
    assert value(found, "workpump_claim_duration_seconds_count") >= 1
    # the database-wide gauges: the two dead rows, nothing waiting, no instance left
    assert value(found, "workpump_pending", category="outbox", state="dead") == 2
    assert value(found, "workpump_pending", category="outbox", state="pending") == 0
    assert value(found, "workpump_oldest_pending_age_seconds", category="outbox") == 0
    assert value(found, "workpump_instances", state="live") == 0
    assert value(found, "workpump_notify_gate_up") == 0  # the gate stopped with the pump


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_runworkpump_serves_metrics_on_its_port_while_it_runs(outbox_handler, pump):
    started = threading.Event()
    release = threading.Event()

    def hold(work: Any) -> None:
        started.set()
        assert release.wait(10)

    outbox_handler("metrics.port", lambda work: None)
    outbox_handler("metrics.hold", hold)
    supervisor = pump(metrics_port=0)  # any free port
    url = f"http://127.0.0.1:{supervisor.metrics_server.port}/metrics"

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(url, timeout=5) as response:
            return samples(response.read().decode())

    # the listener connects beside the first claim: a row could start before it is up
    assert wait_until(lambda: value(scrape(), "workpump_notify_gate_up") == 1)
    for n in range(3):
        workpump.send("metrics.port", {"n": n})
    workpump.send("metrics.hold", {})
    assert started.wait(10)
    # the instance is registered and one row runs: the database and process gauges say so
    metrics.database_collector().clear()
    with urllib.request.urlopen(url, timeout=5) as response:
        during = samples(response.read().decode())
    release.set()
    assert value(during, "workpump_instances", state="live") == 1
    assert value(during, "workpump_in_flight", category="outbox") >= 1
    assert value(during, "workpump_notify_gate_up") == 1
    assert value(during, "workpump_pending", category="outbox", state="leased") >= 1

    def three_done() -> bool:
        with urllib.request.urlopen(url, timeout=5) as response:
            found = samples(response.read().decode())
        done = {"category": "outbox", "topic": "metrics.port"}
        return value(found, "workpump_done_total", **done) == 3

    assert wait_until(three_done)
    assert supervisor.shutdown() == EXIT_OK
    with pytest.raises(urllib.error.URLError):  # closed with the pump
        urllib.request.urlopen(url, timeout=5)


@pytest.mark.django_db
def test_scrapes_within_the_cache_window_read_the_database_once():
    clock = FrozenClock()
    collector = metrics.DatabaseCollector(cache_seconds=5, clock=clock)
    workpump.send("metrics.cached", {})

    with CaptureQueriesContext(connection) as first:
        families = {f.name: f for f in collector.collect()}
    with CaptureQueriesContext(connection) as second:
        again = {f.name: f for f in collector.collect()}
    clock.advance(5)
    with CaptureQueriesContext(connection) as third:
        list(collector.collect())

    assert len(first.captured_queries) == 4  # state counts, instances, flow rules, vacuum
    assert len(second.captured_queries) == 0
    assert len(third.captured_queries) == 4  # the window passed
    assert collector.reads == 2
    assert families.keys() == again.keys()
    pending = {tuple(s.labels.values()): s.value for s in families["workpump_pending"].samples}
    assert pending[("outbox", "pending")] == 1


@pytest.mark.django_db(transaction=True)  # each read its own transaction: a fresh view
def test_the_vacuum_gauges_report_dead_versions_per_table_and_the_oldest_snapshot(
    raw_connect,
):
    tables = {t.table_name: t.dead_versions for t in status.vacuum_health().tables}
    quiet = {f.name: f for f in metrics.DatabaseCollector(cache_seconds=0).collect()}
    holder = raw_connect()
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")  # takes the snapshot
    held = {f.name: f for f in metrics.DatabaseCollector(cache_seconds=0).collect()}

    # (other tests' backends report their statistics when idle: the counts may move)
    dead = {s.labels["table"]: s.value for s in held["workpump_dead_row_versions"].samples}
    assert dead.keys() == tables.keys()
    assert all(value >= 0 for value in dead.values())
    assert set(dead) == {
        "workpump_outbox",
        "workpump_inbox",
        "workpump_perspective_event",
        "workpump_receptor_processing",
    }
    assert [s.value for s in quiet["workpump_oldest_snapshot_age_seconds"].samples] == [0.0]
    (age,) = held["workpump_oldest_snapshot_age_seconds"].samples
    snapshot = status.vacuum_health().oldest_snapshot
    assert snapshot is not None and snapshot.pid == holder.info.backend_pid
    assert 0 < age.value <= snapshot.open_seconds  # read before it


@pytest.mark.django_db
def test_the_pending_gauge_counts_no_ended_row_and_the_ended_gauge_counts_them(outbox_handler):
    def discard(work: Any) -> None:
        if work.payload["n"] == 1:
            raise workpump.Discard("not wanted")

    outbox_handler("metrics.ended", discard)
    for n in range(3):
        workpump.send("metrics.ended", {"n": n})
    assert run_pending(topics=["metrics.ended"]) == 2  # done; the third is discarded
    waiting = [workpump.send("metrics.ended", {"n": n}) for n in range(3, 6)]
    assert set(workpump.cancel(waiting[:2])) == set(waiting[:2])  # one of them still waits

    families = {f.name: f for f in metrics.DatabaseCollector(cache_seconds=0).collect()}

    def by_state(name: str) -> dict[str, float]:
        return {
            s.labels["state"]: s.value
            for s in families[name].samples
            if s.labels["category"] == "outbox"
        }

    pending = by_state("workpump_pending")
    # the backlog is the one row that still waits: sum(workpump_pending) says so
    assert pending["pending"] == 1 and sum(pending.values()) == 1, pending
    assert {"cancelled", "discarded", "done"}.isdisjoint(pending)
    assert by_state("workpump_ended") == {"cancelled": 2, "discarded": 1}


@pytest.mark.django_db
@override_settings(WORKPUMP={"METRICS_CACHE_SECONDS": 60})
def test_two_scrapes_of_the_view_within_the_window_issue_no_second_query():
    metrics.database_collector().clear()
    client = Client()
    with CaptureQueriesContext(connection) as first:
        assert client.get("/metrics").status_code == 200
    with CaptureQueriesContext(connection) as second:
        assert client.get("/metrics").status_code == 200
    assert len(first.captured_queries) == 4  # state counts, instances, flow rules, vacuum
    assert second.captured_queries == []


def claim(instance: uuid.UUID, now: Any, **kwargs: Any) -> list[db.ClaimedWork]:
    return db.claim_work(
        instance_id=instance,
        max_rows=10,
        lease_seconds=300,
        partition_count=10_000,
        now=now,
        **kwargs,
    )


def created_at(work_id: uuid.UUID) -> Any:
    return scalar("SELECT created_at FROM workpump_outbox WHERE work_id = %s", [work_id])


@pytest.mark.django_db
def test_the_claim_says_when_each_row_was_created_and_became_claimable_in_claim_order():
    instance, peer = uuid.uuid4(), uuid.uuid4()
    enroll(instance)
    enroll(peer)
    plain = scalar("SELECT workpump.send('metrics.due', '{}'::jsonb)")
    deferred = scalar(
        "SELECT workpump.send('metrics.due', '{}'::jsonb, p_scheduled_for => %s, p_priority => 5)",
        [at(60)],
    )

    with CaptureQueriesContext(connection) as queries:
        rows = claim(instance, at(3600))

    assert len(queries.captured_queries) == 1  # the times come with the claim
    assert [row.work_id for row in rows] == [deferred, plain]  # timers first, as claim_work
    assert rows[0].due_at == at(60)  # its deferral fell due
    assert rows[1].due_at == created_at(plain)
    assert [row.created_at for row in rows] == [created_at(deferred), created_at(plain)]
    assert all(row.claimed_at == at(3600) for row in rows)
    # A lease taken over fell due when it expired, not when the row was created.
    again = claim(peer, at(3600 + 301))
    assert {row.work_id for row in again} == {plain, deferred}
    assert {row.due_at for row in again} == {at(3600 + 300)}
    assert {row.work_id: row.created_at for row in again} == {
        plain: created_at(plain),
        deferred: created_at(deferred),
    }


@pytest.mark.django_db
def test_the_rows_of_a_stream_run_say_when_each_was_created_and_became_claimable():
    instance = uuid.uuid4()
    enroll(instance)
    made = [
        scalar("SELECT workpump.send('metrics.run', %s::jsonb, 'metrics-s')", [f'{{"n": {n}}}'])
        for n in range(3)
    ]
    retried = scalar(
        "SELECT workpump.send('metrics.run', '{}'::jsonb, 'metrics-s', p_scheduled_for => %s)",
        [at(30)],
    )

    rows = claim(instance, at(60), stream_run_max=4)

    assert [row.work_id for row in rows] == [*made, retried]
    assert [row.created_at for row in rows] == [created_at(w) for w in [*made, retried]]
    assert [row.due_at for row in rows] == [*(created_at(w) for w in made), at(30)]


def test_the_queue_wait_adds_the_local_wait_to_the_database_wait():
    from django_workpump.pump.jobs import Job, queue_wait
    from tests.fakes import make_row

    row = make_row()
    due = row.claimed_at - timedelta(seconds=2)
    job = Job(type(row)(**{**row.__dict__, "due_at": due}), handle=None, received_at=100.0)
    assert queue_wait(job, 100.25) == pytest.approx(2.25)
    assert queue_wait(Job(row, handle=None, received_at=100.0), 101.0) is None


# -- without prometheus_client -----------------------------------------------------------


@pytest.fixture
def without_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """django_workpump.metrics as imported where prometheus_client is not installed."""
    kept = (metrics._default, metrics._collector)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    importlib.reload(metrics)
    try:
        yield metrics
    finally:
        monkeypatch.undo()
        importlib.reload(metrics)
        # the series stay registered in Prometheus's registry: keep using the same ones
        metrics._default, metrics._collector = kept


def test_without_prometheus_client_the_recorder_does_nothing_and_use_names_the_extra(
    without_prometheus_client,
):
    m = without_prometheus_client
    assert m.AVAILABLE is False
    assert m.recorder().enabled is False
    assert type(m.recorder()) is m.NullRecorder
    with pytest.raises(m.MetricsUnavailable) as error:
        m.metrics_view(None)
    assert "pip install 'django-workpump[prometheus]'" in str(error.value)
    with pytest.raises(m.MetricsUnavailable):
        m.MetricsServer(0)


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_without_prometheus_client_the_pump_runs_and_records_nothing(
    without_prometheus_client, outbox_handler, pump
):
    outbox_handler("metrics.absent", lambda work: None)
    workpump.send("metrics.absent", {})
    supervisor = pump(drain=True)
    assert supervisor.dispatcher.metrics.enabled is False
    assert drain(supervisor) == EXIT_OK
    assert models.Outbox.objects.get().done_at is not None
    labels = {"category": "outbox", "topic": "metrics.absent"}
    assert REGISTRY.get_sample_value("workpump_done_total", labels) is None
    assert REGISTRY.get_sample_value("workpump_claimed_total", labels) is None


@pytest.mark.django_db(transaction=True)
def test_without_prometheus_client_metrics_port_fails_with_the_install_line(
    without_prometheus_client,
):
    with pytest.raises(CommandError, match=r"pip install 'django-workpump\[prometheus\]'"):
        call_command("runworkpump", "--metrics-port", "0", "--drain")


def test_the_package_imports_without_prometheus_client():
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import django; from django.conf import settings\n"
        "settings.configure(INSTALLED_APPS=['django_workpump'])\n"
        "django.setup()\n"
        "import django_workpump, django_workpump.pump.supervisor\n"
        "from django_workpump import metrics\n"
        "assert not metrics.AVAILABLE and not metrics.recorder().enabled\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "ok", result.stderr


@pytest.mark.django_db(transaction=True)
def test_a_metrics_port_out_of_range_is_refused_in_one_sentence():
    with pytest.raises(CommandError, match="--metrics-port must be between 0 and 65535"):
        call_command("runworkpump", "--metrics-port", "70000", "--drain")


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_a_metrics_port_in_use_fails_the_start_in_one_sentence(pump):
    supervisor = pump(metrics_port=0)
    taken = supervisor.metrics_server.port
    with pytest.raises(CommandError, match=f"cannot listen on port {taken}"):
        call_command("runworkpump", "--metrics-port", str(taken), "--drain")
    assert models.ServiceInstance.objects.count() == 1  # the failed start registered nothing


def test_the_grafana_dashboard_queries_only_series_the_package_exports():
    import json
    import re

    from prometheus_client import CollectorRegistry

    own = CollectorRegistry()
    metrics.PrometheusRecorder(own)
    exported = {family.name for family in own.collect()} | {
        family.name for family in metrics.DatabaseCollector(cache_seconds=0).describe()
    }
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    expressions = [t["expr"] for p in panels for t in p["targets"]]
    used = {
        re.sub(r"_(total|bucket|count|sum)$", "", name)
        for expr in expressions
        for name in re.findall(r"\bworkpump_\w+", expr)
    }

    assert used - exported == set()
    # throughput, backlog age, failures, dead letters, instances, in flight, durations,
    # VACUUM
    for series in (
        "workpump_done",
        "workpump_claimed",
        "workpump_oldest_pending_age_seconds",
        "workpump_failed",
        "workpump_dead_lettered",
        "workpump_instances",
        "workpump_in_flight",
        "workpump_handler_duration_seconds",
        "workpump_dead_row_versions",
        "workpump_oldest_snapshot_age_seconds",
    ):
        assert series in used, series
    assert any("histogram_quantile(0.99" in expr for expr in expressions)


# -- the instrumentation points, on fakes and a registry of the test's own ----------------


def own_recorder() -> tuple[metrics.PrometheusRecorder, Callable[..., float | None]]:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    return metrics.PrometheusRecorder(registry), sample


class LosingCoordinator(FakeCoordinator):
    """Completions come back ``lost``: the lease went to someone else meanwhile."""

    def complete(self, leases, results):
        super().complete(leases, results)
        return [Outcome(lease.id, "lost") for lease in leases]


def recorded_dispatcher(
    coordinator: Any, handlers: Registry, recorder: Any, leases: LeaseRegistry | None = None
) -> Dispatcher:
    """A one-thread dispatcher on a frozen clock that counts into ``recorder``."""
    return Dispatcher(
        coordinator,
        handlers,
        LeaseRegistry() if leases is None else leases,
        concurrency=1,
        lease_grace_seconds=5,
        clock=FrozenClock(),
        metrics=recorder,
    )


def run_until_idle(dispatcher: Dispatcher) -> None:
    """Run what was submitted to ``dispatcher`` to its end, then stop it."""
    dispatcher.start()
    try:
        assert dispatcher.wait_idle(WAIT)
    finally:
        dispatcher.stop()


def test_the_dispatcher_counts_runs_outcomes_and_rows_in_flight():
    recorder, sample = own_recorder()
    coordinator = FakeCoordinator()
    handlers = Registry()
    handlers.register(Handler("outbox", "ok", lambda work: None))

    def boom(work: Any) -> None:
        raise RuntimeError("boom")

    handlers.register(Handler("outbox", "boom", boom))
    dispatcher = recorded_dispatcher(coordinator, handlers, recorder)
    rows = [dataclasses.replace(make_row(), topic=t) for t in ("ok", "ok", "boom")]
    dispatcher.submit(rows)
    assert sample("workpump_in_flight", category="outbox") == 3
    run_until_idle(dispatcher)

    ok = {"category": "outbox", "topic": "ok"}
    boom_ = {"category": "outbox", "topic": "boom"}
    assert sample("workpump_in_flight", category="outbox") == 0
    assert sample("workpump_done_total", **ok) == 2
    assert sample("workpump_failed_total", **boom_, reason="handler_error") == 1  # a retry
    assert sample("workpump_dead_lettered_total", **boom_, reason="handler_error") is None
    assert sample("workpump_handler_duration_seconds_count", **ok) == 2
    assert sample("workpump_handler_duration_seconds_count", **boom_) == 1
    assert sample("workpump_queue_wait_seconds_count", **ok) is None  # no due_at claimed
    assert dispatcher.outcomes.topics == {}  # nothing left behind


def stream_rows(topic: str, stream: str, payloads: list[dict[str, Any]]) -> list[Any]:
    """Rows of one stream as a claim returns a run: in stream order."""
    return [
        dataclasses.replace(make_row(), topic=topic, stream=stream, payload=payload)
        for payload in payloads
    ]


def test_a_stream_run_counts_each_row_it_ran_and_holds_none_after_it_ends():
    """A failed row ends its run: the row after it is released unstarted, never timed."""
    recorder, sample = own_recorder()
    coordinator = FakeCoordinator()
    handlers = Registry()

    def maybe_fail(work: Any) -> None:
        if work.payload.get("fail"):
            raise RuntimeError("boom")

    handlers.register(Handler("outbox", "run", maybe_fail))
    dispatcher = recorded_dispatcher(coordinator, handlers, recorder)
    rows = stream_rows("run", "s-1", [{"i": 1}, {"fail": True}, {"i": 3}])
    dispatcher.submit(rows)
    assert sample("workpump_in_flight", category="outbox") == 3
    run_until_idle(dispatcher)

    run = {"category": "outbox", "topic": "run"}
    assert coordinator.calls.count("release") == 1  # the third row, unstarted
    assert sample("workpump_in_flight", category="outbox") == 0
    assert sample("workpump_done_total", **run) == 1
    assert sample("workpump_failed_total", **run, reason="handler_error") == 1
    assert sample("workpump_handler_duration_seconds_count", **run) == 2
    assert dispatcher.outcomes.topics == {}


def test_a_batch_handler_counts_every_row_of_its_batch():
    recorder, sample = own_recorder()
    seen: list[int] = []
    handlers = Registry()
    handlers.register(Handler("outbox", "batch", lambda works: seen.append(len(works)), batch=True))
    dispatcher = recorded_dispatcher(FakeCoordinator(), handlers, recorder)
    dispatcher.submit(stream_rows("batch", "s-2", [{"i": i} for i in range(3)]))
    run_until_idle(dispatcher)

    batch = {"category": "outbox", "topic": "batch"}
    assert seen == [3]  # one call for the run
    assert sample("workpump_in_flight", category="outbox") == 0
    assert sample("workpump_done_total", **batch) == 3
    assert sample("workpump_handler_duration_seconds_count", **batch) == 3
    assert dispatcher.outcomes.topics == {}


def test_an_outcome_fenced_out_counts_as_lost_not_done():
    recorder, sample = own_recorder()
    handlers = Registry()
    handlers.register(Handler("outbox", "ok", lambda work: None))
    dispatcher = recorded_dispatcher(LosingCoordinator(), handlers, recorder)
    dispatcher.submit([dataclasses.replace(make_row(), topic="ok")])
    run_until_idle(dispatcher)
    assert sample("workpump_lost_total", category="outbox") == 1
    assert sample("workpump_done_total", category="outbox", topic="ok") is None
    assert dispatcher.outcomes.topics == {}


def test_the_claim_worker_times_claims_and_counts_rows_and_undecodable_dead_letters():
    recorder, sample = own_recorder()
    good = make_row()
    bad = dataclasses.replace(make_row(), payload={}, payload_error="not JSON")
    worker = ClaimWorker(
        FakeCoordinator(claims=[[good, bad]]),
        FakeSink(free=4),
        ClaimPolicy(),
        clock=FrozenClock(),
        metrics=recorder,
    )
    assert worker.run_once().claimed == 2
    work = {"category": "outbox", "topic": "orders.created"}
    assert sample("workpump_claimed_total", **work) == 2
    assert sample("workpump_claim_duration_seconds_count") == 1
    assert sample("workpump_dead_lettered_total", **work, reason="undecodable_payload") == 1


def test_the_renewal_worker_counts_the_renewals_the_database_confirmed():
    from django_workpump.pump.lease import LeaseHandle
    from django_workpump.pump.renewal import LeaseRenewalWorker

    recorder, sample = own_recorder()
    clock = FrozenClock()
    leases = LeaseRegistry()
    handles = [
        LeaseHandle(
            "outbox", uuid.uuid4(), clock.monotonic() + 10, 6, clock, lease_token=uuid.uuid4()
        )
        for _ in range(3)
    ]
    for handle in handles:
        leases.register(handle)
    coordinator = FakeCoordinator(refuse_renewal=[handles[0].work_id])
    worker = LeaseRenewalWorker(
        coordinator,
        leases,
        lease_seconds=300,
        lease_grace_seconds=30,
        clock=clock,
        metrics=recorder,
    )
    assert worker.run_once() == (0, 3)
    worker.flusher.flush_once()
    assert sample("workpump_renewals_total", category="outbox") == 2


def test_the_notify_gate_reports_its_state():
    from django_workpump.pump.notify import NotifyGate

    recorder, sample = own_recorder()
    gate = NotifyGate("", uuid.uuid4(), on_signal=lambda s: None, metrics=recorder)
    assert sample("workpump_notify_gate_up") == 0
    gate._set_available(True)
    assert sample("workpump_notify_gate_up") == 1
    gate._set_available(False, "lost")
    assert sample("workpump_notify_gate_up") == 0


def _batch_dispatcher(func: Callable[..., Any], **options: Any) -> tuple[Any, Any, Any, Any]:
    recorder, sample = own_recorder()
    handlers = Registry()
    handlers.register(Handler("outbox", "batch", func, batch=True, **options))
    coordinator = FakeCoordinator()
    leases = LeaseRegistry()
    dispatcher = recorded_dispatcher(coordinator, handlers, recorder, leases)
    return dispatcher, coordinator, leases, sample


BATCH = {"category": "outbox", "topic": "batch"}


def test_a_batch_snoozing_a_row_counts_the_rows_before_it_done_and_holds_none():
    def handler(works: list[Any]) -> None:
        raise workpump.Snooze(5, work=works[2])

    dispatcher, coordinator, _, sample = _batch_dispatcher(handler)
    dispatcher.submit(stream_rows("batch", "s-3", [{"i": i} for i in range(5)]))
    dispatcher.start()
    try:
        assert dispatcher.wait_idle(WAIT)
        assert coordinator.wait_for_call("complete")
    finally:
        dispatcher.stop()

    assert sample("workpump_in_flight", category="outbox") == 0
    assert sample("workpump_done_total", **BATCH) == 2
    assert sample("workpump_failed_total", **BATCH, reason="handler_error") is None
    assert sample("workpump_handler_duration_seconds_count", **BATCH) == 5
    assert dispatcher.outcomes.topics == {}


def test_a_batch_dead_lettered_by_its_retry_counts_one_failed_dead_row():
    def handler(works: list[Any]) -> None:
        raise KeyError("no such account")

    dispatcher, _, _, sample = _batch_dispatcher(handler, retry=workpump.Retry(on=(TimeoutError,)))
    dispatcher.submit(stream_rows("batch", "s-4", [{"i": i} for i in range(3)]))
    run_until_idle(dispatcher)

    assert sample("workpump_failed_total", **BATCH, reason="not_retryable") == 1
    assert sample("workpump_dead_lettered_total", **BATCH, reason="not_retryable") == 1
    assert sample("workpump_done_total", **BATCH) is None
    assert sample("workpump_in_flight", category="outbox") == 0


def test_an_abandoned_batch_counts_one_abandoned_handler_and_one_failed_row():
    release = threading.Event()
    started = threading.Event()

    def handler(works: list[Any]) -> None:
        started.set()
        release.wait(WAIT)

    dispatcher, coordinator, leases, sample = _batch_dispatcher(handler)
    dispatcher.submit(stream_rows("batch", "s-5", [{"i": i} for i in range(4)]))
    dispatcher.start()
    try:
        assert started.wait(WAIT)
        dispatcher.clock.advance(400)
        for handle in leases.expire_due():
            dispatcher.abandon(handle)
        assert coordinator.wait_for_call("fail")
        release.set()
        assert dispatcher.wait_idle(WAIT)
    finally:
        release.set()
        dispatcher.stop()

    assert sample("workpump_abandoned_total", **BATCH) == 1
    assert sample("workpump_failed_total", **BATCH, reason="lease_expired") == 1
    assert sample("workpump_in_flight", category="outbox") == 0
    assert dispatcher.outcomes.topics == {}


# -- a bounded label set ---------------------------------------------------------------------


def test_300_queue_topics_keep_the_series_under_the_documented_cap(caplog):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    recorder = metrics.PrometheusRecorder(registry)  # WORKPUMP["METRICS_MAX_TOPICS"]: 100
    cap = recorder.max_topics
    assert cap == 100
    for n in range(300):  # a django.tasks queue each: a topic each
        row = dataclasses.replace(make_row("inbox"), topic=f"django.tasks:default:queue-{n}")
        recorder.claim([row], 0.001)
        recorder.handler_started(row, 0.5)
        recorder.handler_finished(row, 0.01)
        outcomes = [Outcome(row.work_id, "done"), Outcome(row.work_id, "retry")]
        recorder.outcomes("inbox", outcomes, lambda _, t=row.topic: t, lambda _: "handler_error")
        recorder.abandoned("inbox", row.topic)

    series = [
        s
        for family in registry.collect()
        if family.name.startswith("workpump_")
        for s in family.samples
    ]
    topics = {s.labels["topic"] for s in series if "topic" in s.labels}
    # docs/metrics.md: per category and topic value at most 44 series, plus 4 per reason
    bound = (cap + 1) * (44 + 4 * 1)
    assert len(topics) == cap + 1
    assert "django.tasks:default:queue-0" in topics
    assert "django.tasks:default:queue-100" not in topics
    assert metrics.OTHER_TOPIC in topics
    assert len(series) <= bound < 300 * (44 + 4)
    # every row is still counted: the later topics under "other"
    other = {"category": "inbox", "topic": metrics.OTHER_TOPIC}
    assert registry.get_sample_value("workpump_claimed_total", other) == 200
    assert registry.get_sample_value("workpump_done_total", other) == 200
    capped = [r for r in caplog.records if getattr(r, "action", None) == "metrics_topics_capped"]
    assert len(capped) == 1
    assert capped[0].levelname == "WARNING"
    assert "WORKPUMP['METRICS_MAX_TOPICS']" in capped[0].getMessage()
    assert "'django.tasks:default:queue-100'" in capped[0].getMessage()


@override_settings(WORKPUMP={"METRICS_MAX_TOPICS": 0})
def test_a_cap_of_0_counts_every_topic_as_other():
    recorder, sample = own_recorder()
    recorder.claim([dataclasses.replace(make_row(), topic="emails.welcome")], 0.001)
    assert sample("workpump_claimed_total", category="outbox", topic="other") == 1
    assert sample("workpump_claimed_total", category="outbox", topic="emails.welcome") is None


def test_metrics_max_topics_is_checked_like_the_other_settings():
    from django.core.checks import run_checks

    with override_settings(WORKPUMP={"METRICS_MAX_TOPICS": -1}):
        messages = run_checks(tags=["workpump"])
    assert [(m.id, m.msg) for m in messages] == [
        ("workpump.E004", "WORKPUMP['METRICS_MAX_TOPICS'] (-1) must be at least 0.")
    ]
    with override_settings(WORKPUMP={"METRICS_MAX_TOPICS": "many"}):
        assert [m.id for m in run_checks(tags=["workpump"])] == ["workpump.E003"]


# -- the endpoint: this host only by default, bounded under half-sent requests ---------------


def scrape(port: int, timeout: float = 5) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        return response.read().decode()


@pytest.mark.django_db(transaction=True)
def test_the_endpoint_listens_on_127_0_0_1_unless_told_otherwise():
    server = metrics.MetricsServer(0)
    try:
        assert server.listener.getsockname()[0] == "127.0.0.1"
        assert "# HELP workpump_in_flight" in scrape(server.port)
    finally:
        server.close()
    everywhere = metrics.MetricsServer(0, "0.0.0.0")
    try:
        assert everywhere.listener.getsockname()[0] == "0.0.0.0"
    finally:
        everywhere.close()
    with pytest.raises(metrics.MetricsPortUnavailable, match=r"of '256\.0\.0\.1' \("):
        metrics.MetricsServer(0, "256.0.0.1")


@pytest.mark.django_db(transaction=True)
@override_settings(WORKPUMP=FAST)
def test_runworkpump_binds_the_metrics_port_to_metrics_bind(pump):
    supervisor = pump(metrics_port=0)
    assert supervisor.metrics_server.listener.getsockname()[0] == "127.0.0.1"
    with pytest.raises(CommandError, match=r"--metrics-bind is empty; give an address"):
        call_command("runworkpump", "--metrics-port", "0", "--metrics-bind", " ", "--drain")
    with pytest.raises(CommandError, match=r"cannot listen on port 0 of 'no-such-host\.invalid'"):
        call_command("runworkpump", "--metrics-port", "0", "--metrics-bind", "no-such-host.invalid")


def closed_by_server(sock: Any) -> bool:
    """Whether the server closed ``sock`` (an end of file, or a reset: its data was unread)."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.django_db(transaction=True)
def test_half_sent_requests_neither_stop_a_scrape_nor_add_threads():
    import socket

    # A timeout longer than the scrape may take: the scrape is answered in spite of them.
    server = metrics.MetricsServer(0, request_timeout=60, max_connections=32)
    threads = threading.active_count()
    held: list[socket.socket] = []
    try:
        for _ in range(200):  # each sends half a request and then nothing
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            held.append(sock)

        text = scrape(server.port, timeout=5)

        assert "# HELP workpump_in_flight" in text
        assert threading.active_count() == threads  # no thread per connection
        assert server.open_connections <= 32
        assert closed_by_server(held[0])  # the oldest half-sent request, at the cap
    finally:
        for sock in held:
            sock.close()
        server.close()


@pytest.mark.django_db(transaction=True)
def test_a_half_sent_request_is_closed_at_the_request_timeout():
    import socket

    server = metrics.MetricsServer(0, request_timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            assert closed_by_server(sock)  # well before the 10 s
        assert wait_until(lambda: server.open_connections == 0)
    finally:
        server.close()


@pytest.mark.django_db(transaction=True)
def test_the_endpoint_answers_404_405_and_a_head_request():
    import http.client

    server = metrics.MetricsServer(0)
    try:
        for method, path, status in (
            ("GET", "/other", 404),
            ("POST", "/metrics", 405),
            ("HEAD", "/metrics", 200),
            ("GET", "/metrics?x=1", 200),
        ):
            client = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            client.request(method, path)
            response = client.getresponse()
            body = response.read()
            client.close()
            assert response.status == status, (method, path)
            if method == "HEAD":
                assert body == b""
                assert int(response.headers["Content-Length"]) > 0
    finally:
        server.close()
    server.close()  # twice is fine
